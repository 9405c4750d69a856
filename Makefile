# The README's two entry points: `make demo` runs the demo training, `make test` runs lint + tests
# (CI); `make test-fast` is the quick tier for every change.
# Each creates .venv and installs what it needs; torch is pinned to the CPU build for dev and CI.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
# the oldest supported pair, pyproject.toml's lower bounds (PyPI's torch 2.11.0 is its CUDA build);
# `make test` runs the suite on it too, in its own venv
OLDEST ?= .venv-oldest
OLDEST_TORCH := 2.11.0
OLDEST_TRITON := 3.6.0
OLDEST_PIN := torch==$(OLDEST_TORCH) triton==$(OLDEST_TRITON)
# hypothesis's "ci" profile (tests/conftest.py): a failing example is reported as found, not shrunk;
# -X faulthandler: a crash after pytest's own handler is gone (at interpreter exit) still prints its stacks
PYTEST := -X faulthandler -m pytest -q -p no:cacheprovider --hypothesis-profile=ci

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[test]" $(TORCH_PIN)
	touch $@

$(OLDEST)/.installed: pyproject.toml Makefile
	python3 -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install -q --upgrade pip
	$(OLDEST)/bin/python -m pip install -q -e ".[test]" $(OLDEST_PIN)
	$(OLDEST)/bin/python -c "import torch, triton; v = torch.__version__.split('+')[0], triton.__version__; \
		assert v == ('$(OLDEST_TORCH)', '$(OLDEST_TRITON)'), v"  # pip kept the pins
	touch $@

$(VENV)/.demo: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[demo]" $(TORCH_PIN)
	touch $@

$(VENV)/.peers: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[peers,bench]" $(TORCH_PIN)
	touch $@

.PHONY: demo test test-fast bench-deps bench-step
demo: $(VENV)/.demo
	$(PY) examples/demo.py

test: $(VENV)/.installed $(OLDEST)/.installed
	$(VENV)/bin/ruff check .
	$(PY) $(PYTEST)
	$(OLDEST)/bin/python $(PYTEST)

# the tier to run on every change (a few minutes on 2 cores): lint and the tests not marked slow, on the
# main venv only; `make test` (CI) runs every test on both torch versions
test-fast: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(PY) $(PYTEST) -m "not slow"

bench-deps: $(VENV)/.peers

# the optimizer step benchmark against torch, bitsandbytes and torchao (QUICK=1: a few minutes)
bench-step: $(VENV)/.peers
	$(PY) bench/step_bench.py $(if $(QUICK),--quick,)
