#!/usr/bin/env bash
# Create or reuse .speculators-venv: vLLM's peer draft trainer, speculators 0.9.0, in its own
# environment, for the side-by-side mode of scripts/bench_train.py (--peer speculators).
# Never a draftsmith dependency; only the benchmark runs it.
#
# Facts this script handles (speculators 0.9.0, Python 3.11):
# - torch==2.13.0 first: the CPU wheel on this disk, so nothing pulls a CUDA build;
# - speculators declares torchvision/torchaudio, which its training path never imports and
#   whose PyPI builds break beside the CPU torch: it is installed --no-deps with the
#   dependencies its trainer does import (hs-connectors is its hidden-state file reader).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.speculators-venv
stamp="$VENV/.draftsmith-setup"
want=$(sha256sum scripts/setup_speculators.sh | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
echo "setup-speculators: installing torch==2.13.0 (CPU) and speculators 0.9.0 into $VENV"
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
"$VENV/bin/python" -m pip install --quiet --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
"$VENV/bin/python" -m pip install --quiet "transformers>=5.0,<=5.19.0" "datasets>=4.0,<=5.1.0" \
  "loguru>=0.7.2,<=0.7.3" "numpy>=2.0,<=2.5.4" "tqdm>=4.66.3,<=4.70.1" aiohttp click httpx \
  huggingface-hub "openai>=2.0" protobuf psutil "pydantic>=2" pydantic-settings rich safetensors \
  "typer>=0.12" gguf pyyaml
"$VENV/bin/python" -c "import importlib.metadata as md, torch; from speculators.train.trainer import Trainer; \
print(f'setup-speculators: speculators {md.version(\"speculators\")}, torch {torch.__version__}')"
echo "$want" > "$stamp"
