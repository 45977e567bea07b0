#!/usr/bin/env bash
# `draftsmith compare` on a GPU, in vLLM 0.34's GPU build (installed from the registry:
# scripts/vllm034_gpu_env.sh): the exports given (default: the demo's EAGLE-3 BF16 and FP8 and
# scripts/bench_compare.py's DFlash and DSpark beside them, whichever exist), vLLM's n-gram and no
# speculation, each served as `vllm serve` runs it (CUDA graphs, the engine core in its own process,
# the target's own dtype; bfloat16 where an FP8 export is compared) at every N and concurrency on
# GSM8K prompts, each cell REPEATS times after a warm-up. vLLM 0.34's own knobs are candidates of their
# own (enable_adaptive_verification; draft_lm_head_quantization=fp8 where the draft shares the target's
# head; draft_sample_method=probabilistic with TEMPERATURE > 0), or one line each saying why not.
# Prints compare's table: per load every (candidate, N) served tokens/s ± its spread beside its
# prediction, which candidates were excluded (not lossless, or counts unlike the in-tree decoder's),
# and the --speculative-config to serve; serve-dynamic.json must pass vLLM 0.34's own schedule validator.
# Prepared for a lent GPU machine: one run (~10 min for the demo's SmolLM2 drafts, after the install).
#
#   scripts/gpu_check_compare.sh [EXPORT ...]   (CONCURRENCY=1,4,16,64 PROMPTS=64 MAX_NEW=128 REPEATS=3 TEMPERATURE=0)
set -euo pipefail
cd "$(dirname "$0")/.."
export TOKENIZERS_PARALLELISM=false
source scripts/vllm034_gpu_env.sh
OUT=${OUT:-runs/gpu-check-compare}
EXPORTS=("$@")
if [ ${#EXPORTS[@]} -eq 0 ]; then
  for e in runs/demo/export-bf16 runs/demo/export-fp8 runs/demo/{dflash,dspark}-{bf16,fp8}; do
    [ -f "$e/draftsmith_export.json" ] && EXPORTS+=("$e")
  done
fi
[ ${#EXPORTS[@]} -gt 0 ] || { echo "gpu_check_compare: no exports (make demo writes runs/demo/export-*)" >&2; exit 1; }
.venv/bin/python -m recipes.compare --drafts "${EXPORTS[@]}" --dataset gsm8k --num-prompts "${PROMPTS:-64}" \
    --max-new-tokens "${MAX_NEW:-128}" --concurrency "${CONCURRENCY:-1,4,16,64}" --output-dir "$OUT" \
    "repeats=${REPEATS:-3}" "temperature=${TEMPERATURE:-0}" "dtype=${DTYPE:-auto}"
"$VLLM_PYTHON" - "$OUT/serve-dynamic.json" <<'PY'
import json, sys
from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule as validate
for name, config in json.load(open(sys.argv[1])).items():
    validate(config["num_speculative_tokens_per_batch_size"])
    print(f"schedule of {name}: taken by vLLM's validator")
PY
