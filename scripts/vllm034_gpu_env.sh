# Sourced by scripts/gpu_check_{compare,export,plugin}.sh on a lent GPU machine: VLLM_PYTHON (and
# DRAFTSMITH_VLLM_PYTHON) become the python of vLLM 0.34's GPU build, what GPU users run (Model
# Runner V2 only), made once in .vllm034-gpu-venv from the registry (`vllm==0.34.*`, its CUDA
# torch and kernels) unless VLLM_PYTHON already names a GPU vLLM; draftsmith's plugin is installed
# into it. vllm 0.34.0 pins flashinfer-python==0.7.3, which a registry may lack
# (../shared/research/vllm-0.34-load-check.md): then the wheel's other requirements go in from its
# METADATA and the wheel with --no-deps (measured: 248 s, 8.5 GB; `pip check` misses flashinfer only).
if [ -z "${VLLM_PYTHON:-}" ]; then
  venv=${VLLM034_GPU_VENV:-.vllm034-gpu-venv}
  if ! "$venv/bin/python" -c "import vllm, sys; sys.exit(not vllm.__version__.startswith('0.34'))" 2>/dev/null; then
    python3 -m venv "$venv"
    if ! "$venv/bin/python" -m pip install --quiet "vllm==0.34.*"; then
      work=$(mktemp -d)
      "$venv/bin/python" -m pip download --quiet --no-deps "vllm==0.34.*" -d "$work"
      "$venv/bin/python" - "$work"/vllm-0.34.*.whl > "$work/reqs.txt" <<'PY'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
for line in meta.splitlines():
    if line.startswith("Requires-Dist: ") and "extra ==" not in line and "flashinfer-python" not in line:
        print(line.removeprefix("Requires-Dist: "))
PY
      "$venv/bin/python" -m pip install --quiet -r "$work/reqs.txt"
      "$venv/bin/python" -m pip install --quiet --no-deps "$work"/vllm-0.34.*.whl
    fi
  fi
  VLLM_PYTHON=$venv/bin/python
fi
"$VLLM_PYTHON" -m pip install --quiet --no-deps --force-reinstall ./trainer/vllm/plugin
"$VLLM_PYTHON" -c "import torch, vllm; assert torch.cuda.is_available(), 'no GPU visible to vLLM'; \
print('vLLM', vllm.__version__, 'on', torch.cuda.get_device_name(0))"
export VLLM_PYTHON DRAFTSMITH_VLLM_PYTHON=$VLLM_PYTHON
