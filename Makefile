# The README's two entry points: `make demo` runs the demo training, `make test` runs lint + the whole
# suite (CI); `make test-fast` is the quick tier for every change; `make test-versions` runs the suite on
# the other supported torch versions.
# Each creates .venv (torch 2.13.0's CPU build, from this machine's disk) and installs what it needs there.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
# The supported torch/triton pairs besides .venv's (torch pins the triton it was built with:
# `Requires-Dist: triton==...`). PyPI's builds of these are CUDA ones, ~7 GB each installed with their
# nvidia libraries: CI's disk cannot hold them (its run with them ended in ENOSPC), so `make test` stays
# on .venv and `make test-versions` runs the whole suite on the oldest pair (pyproject.toml's lower
# bound) and the fast tier on the ones between, each in its own venv, one after another.
OLDEST := 2.9.1
BETWEEN := 2.10.0 2.11.0 2.12.1
TRITON_2.9.1 := 3.5.1
TRITON_2.10.0 := 3.6.0
TRITON_2.11.0 := 3.6.0
TRITON_2.12.1 := 3.7.1
# hypothesis's "ci" profile (tests/conftest.py): a failing example is reported as found, not shrunk;
# -X faulthandler: a crash after pytest's own handler is gone (at interpreter exit) still prints its stacks
PYTEST := -X faulthandler -m pytest -q -p no:cacheprovider --hypothesis-profile=ci

# torch alone, then what each entry point needs on top of it
$(VENV)/.torch:
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN)
	touch $@

# $(call editable,PYTHON): pip install -e with that venv's python, one at a time (each writes
# lowbit_compile.egg-info in this tree), also under `make -j`
editable = python3 -c 'import fcntl, subprocess, sys; lock = open(".install.lock", "w"); \
	fcntl.flock(lock, fcntl.LOCK_EX); sys.exit(subprocess.call(sys.argv[1:]))' $(1) -m pip install -q -e

$(VENV)/.installed: $(VENV)/.torch pyproject.toml Makefile
	$(call editable,$(PY)) ".[test]" $(TORCH_PIN)
	touch $@

# the demo's own extra (tqdm, matplotlib): the demo starts within seconds of the torch install
$(VENV)/.demo: $(VENV)/.torch pyproject.toml
	$(call editable,$(PY)) ".[demo]" $(TORCH_PIN)
	touch $@

$(VENV)/.peers: $(VENV)/.installed
	$(call editable,$(PY)) ".[peers,bench]" $(TORCH_PIN)
	touch $@

# .venv-torch<version>: the test extra on one pinned pair; pip must keep both pins, and keeps no cache
# (it would hold every multi-GB wheel a second time)
.venv-torch%/.installed: pyproject.toml Makefile
	python3 -m venv .venv-torch$*
	.venv-torch$*/bin/python -m pip install -q --no-cache-dir torch==$* triton==$(TRITON_$*)
	$(call editable,.venv-torch$*/bin/python) ".[test]" torch==$* triton==$(TRITON_$*)
	.venv-torch$*/bin/python -c "import torch, triton; v = torch.__version__.split('+')[0], triton.__version__; \
		assert v == ('$*', '$(TRITON_$*)'), v"
	touch $@

.PRECIOUS: .venv-torch%/.installed
.PHONY: demo test lint test-fast test-versions suite-oldest $(BETWEEN:%=fast-%) bench-deps bench-step
demo: $(VENV)/.demo
	$(PY) examples/demo.py

test: lint
	$(PY) $(PYTEST)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

# the other supported pairs, one after another (-j1: each venv is several GB)
test-versions:
	$(MAKE) -j1 suite-oldest $(BETWEEN:%=fast-%)

suite-oldest: .venv-torch$(OLDEST)/.installed
	.venv-torch$(OLDEST)/bin/python $(PYTEST)

$(BETWEEN:%=fast-%): fast-%: .venv-torch%/.installed
	.venv-torch$*/bin/python $(PYTEST) -m "not slow"

# the tier to run on every change (a few minutes on 2 cores): lint and the tests not marked slow, on .venv
test-fast: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(PY) $(PYTEST) -m "not slow"

bench-deps: $(VENV)/.peers

# the optimizer step benchmark against torch, bitsandbytes and torchao (QUICK=1: a few minutes)
bench-step: $(VENV)/.peers
	$(PY) bench/step_bench.py $(if $(QUICK),--quick,)
