# Two commands do all the set-up on a fresh machine:
#   make run   - create .venv and run the main job
#   make test  - create .venv, lint, and run the test suite (the CI set: tests marked slow are left out)
#   make test-all - the same with the slow tests (the full quickstart's accuracy, torchrun launches, ...)
#   make test-data - download the pinned test-only data into .cache/ (test and test-all run it first)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: run test test-all test-data lint venv bench-smoke clean

# torch is installed first, pinned, so pip takes the local CPU wheel instead of a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(PY) -m astrai.cli.main quickstart

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Real chat templates for tests/astrai/serve/test_real_templates.py: the llama-cpp-python sdist (llama.cpp's
# models/templates), pinned by version and sha256 in tests/real_templates.py; fetched once, never at test time.
test-data:
	python3 tests/real_templates.py

test: lint test-data
	$(VENV)/bin/pytest -q -m "not slow"

test-all: lint test-data
	$(VENV)/bin/pytest -q

bench-smoke: $(STAMP)
	$(PY) benchmarks/bench_attention.py --smoke
	$(PY) benchmarks/bench_rotary.py --smoke

clean:
	rm -rf $(VENV) runs build .pytest_cache .ruff_cache
