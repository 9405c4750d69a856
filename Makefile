# Two entry points (see README): `make demo` runs the demo training, `make test` runs lint + tests.
# Each creates .venv and installs what it needs; torch is pinned to the CPU build for dev and CI.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[test]" $(TORCH_PIN)
	touch $@

$(VENV)/.demo: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[demo]" $(TORCH_PIN)
	touch $@

$(VENV)/.peers: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[peers,bench]" $(TORCH_PIN)
	touch $@

.PHONY: demo test bench-deps bench-step
demo: $(VENV)/.demo
	$(PY) examples/demo.py

test: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

bench-deps: $(VENV)/.peers

# the optimizer step benchmark against torch, bitsandbytes and torchao (QUICK=1: a few minutes)
bench-step: $(VENV)/.peers
	$(PY) bench/step_bench.py $(if $(QUICK),--quick,)
