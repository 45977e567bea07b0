# The README's two commands: `make demo` and `make test`. Both create or
# refresh .venv first (scripts/setup.sh), so they work on a fresh machine.
PY := .venv/bin/python

.PHONY: setup demo test test-fast lint bench clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m recipes.demo --config recipes/configs/smollm2-135m/demo.yaml $(ARGS)

# The whole suite, end-to-end tests on the real SmolLM2 included.
test: setup
	$(PY) -m pytest $(ARGS)

# Unit tests only (tiny in-process targets).
test-fast: setup
	$(PY) -m pytest -m "not slow" $(ARGS)

lint: setup
	.venv/bin/ruff check .

clean:
	rm -rf .venv runs .pytest_cache
