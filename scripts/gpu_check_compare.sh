#!/usr/bin/env bash
# `draftsmith compare` on a GPU: the exports given (default: the demo's EAGLE-3, BF16 and FP8),
# vLLM's n-gram and no speculation, each served in a GPU build of vLLM at every N and at each
# concurrency on GSM8K prompts. Prints compare's table: per load, every (candidate, N) served
# tokens/s beside its prediction from vLLM's step costs (the error the README quotes for the
# CPU), whether vLLM's counts equal the in-tree decoder's, and the --speculative-config to serve.
# A DSpark export runs on vLLM's V2 model runner (the runner sets it; on the CPU build it is
# measured in-tree and never recommended). Prepared for a lent GPU machine: one short run
# (~5 min for the demo's SmolLM2 drafts).
#
#   scripts/gpu_check_compare.sh [EXPORT ...]     (CONCURRENCY=1,4,16,64 PROMPTS=64 MAX_NEW=128)
#
# Needs: draftsmith's .venv (the in-tree acceptance, on the GPU if its torch has one) and a GPU
# vLLM whose Python is $DRAFTSMITH_VLLM_PYTHON, with draftsmith's plugin installed there
# (pip install trainer/vllm/plugin). Every candidate is served over the target in one dtype:
# bfloat16 when an FP8 export is given (vLLM's Quark loader needs it), else float32 (DTYPE=bfloat16
# serves BF16-only comparisons as production does).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DRAFTSMITH_VLLM_PYTHON:?set DRAFTSMITH_VLLM_PYTHON to the python of a GPU vLLM build}"
export DRAFTSMITH_VLLM_PYTHON TOKENIZERS_PARALLELISM=false
CONCURRENCY=${CONCURRENCY:-1,4,16,64}
PROMPTS=${PROMPTS:-64}
MAX_NEW=${MAX_NEW:-128}
OUT=${OUT:-runs/gpu-check-compare}
EXPORTS=("$@")
[ ${#EXPORTS[@]} -gt 0 ] || EXPORTS=(runs/demo/export-bf16 runs/demo/export-fp8)
for e in "${EXPORTS[@]}"; do
  [ -f "$e/draftsmith_export.json" ] || { echo "gpu_check_compare: '$e' is not an export (make demo writes runs/demo/export-*)" >&2; exit 1; }
done
"$DRAFTSMITH_VLLM_PYTHON" -c "import vllm, draftsmith_vllm_plugin; print('vLLM', vllm.__version__)"
.venv/bin/python -c "import torch; print('in-tree on', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU')"
.venv/bin/python -m recipes.compare --drafts "${EXPORTS[@]}" --dataset gsm8k --num-prompts "$PROMPTS" \
    --max-new-tokens "$MAX_NEW" --concurrency "$CONCURRENCY" --output-dir "$OUT" "dtype=${DTYPE:-auto}"
