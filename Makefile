# The README's two entry points: `make demo` runs the demo training, `make test` runs lint + tests
# (CI); `make test-fast` is the quick tier for every change.
# Each creates .venv (torch 2.13.0's CPU build) and installs what it needs there; `make test` also
# makes a venv per other supported torch (.venv-torch<version>).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
# The supported torch/triton pairs besides .venv's (torch pins the triton it was built with:
# `Requires-Dist: triton==...`). PyPI's builds of these are CUDA ones: a few GB each, ~5-10 minutes to
# install on a cold pip cache. `make test` runs the whole suite on the oldest pair (pyproject.toml's
# lower bound) and the fast tier on the ones between, each in its own venv.
OLDEST := 2.9.1
BETWEEN := 2.10.0 2.11.0 2.12.1
TRITON_2.9.1 := 3.5.1
TRITON_2.10.0 := 3.6.0
TRITON_2.11.0 := 3.6.0
TRITON_2.12.1 := 3.7.1
# hypothesis's "ci" profile (tests/conftest.py): a failing example is reported as found, not shrunk;
# -X faulthandler: a crash after pytest's own handler is gone (at interpreter exit) still prints its stacks
PYTEST := -X faulthandler -m pytest -q -p no:cacheprovider --hypothesis-profile=ci
# `make test` installs the pinned venvs while the suites run, a few at a time (downloads wait on the
# network, the suites on the CPUs); the suites themselves run one after another
JOBS ?= 3

# torch alone, then what each entry point needs on top of it
$(VENV)/.torch:
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN)
	touch $@

# $(call editable,PYTHON): pip install -e with that venv's python, one at a time (each writes
# lowbit_compile.egg-info in this tree); the torch downloads before it run in parallel
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

# .venv-torch<version>: the test extra on one pinned pair; pip must keep both pins. Built after .venv (an
# order-only prerequisite), so that the first suite is not kept waiting for job slots by these downloads
.venv-torch%/.installed: pyproject.toml Makefile | $(VENV)/.installed
	python3 -m venv .venv-torch$*
	.venv-torch$*/bin/python -m pip install -q torch==$* triton==$(TRITON_$*)
	$(call editable,.venv-torch$*/bin/python) ".[test]" torch==$* triton==$(TRITON_$*)
	.venv-torch$*/bin/python -c "import torch, triton; v = torch.__version__.split('+')[0], triton.__version__; \
		assert v == ('$*', '$(TRITON_$*)'), v"
	touch $@

.PRECIOUS: .venv-torch%/.installed
SUITES := suite-newest suite-oldest $(BETWEEN:%=fast-%)
.PHONY: demo test test-matrix lint $(SUITES) test-fast bench-deps bench-step
demo: $(VENV)/.demo
	$(PY) examples/demo.py

test:
	$(MAKE) -j$(JOBS) test-matrix

test-matrix: lint $(SUITES)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

suite-newest: $(VENV)/.installed
	$(PY) $(PYTEST)

suite-oldest: .venv-torch$(OLDEST)/.installed
	.venv-torch$(OLDEST)/bin/python $(PYTEST)

$(BETWEEN:%=fast-%): fast-%: .venv-torch%/.installed
	.venv-torch$*/bin/python $(PYTEST) -m "not slow"

# each suite waits for the one before it (an order-only prerequisite), not for its venv's install
chain = $(if $(word 2,$1),$(eval $(word 2,$1): | $(word 1,$1))$(call chain,$(wordlist 2,$(words $1),$1)))
$(call chain,lint $(SUITES))

# the tier to run on every change (a few minutes on 2 cores): lint and the tests not marked slow, on the
# main venv only; `make test` (CI) runs every test on the newest and oldest pairs, this tier on the others
test-fast: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(PY) $(PYTEST) -m "not slow"

bench-deps: $(VENV)/.peers

# the optimizer step benchmark against torch, bitsandbytes and torchao (QUICK=1: a few minutes)
bench-step: $(VENV)/.peers
	$(PY) bench/step_bench.py $(if $(QUICK),--quick,)
