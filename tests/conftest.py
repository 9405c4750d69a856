"""pytest setup for every test: the Triton interpreter, hypothesis's CI profile, the seed and the one-thread
fixture. Helpers shared between test modules are in ``helpers.py``."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import Phase, settings

# Triton kernels run on CPU tensors under the interpreter. triton.language builds its own jit helpers
# (tl.argmax, ...) when triton is first imported, so this must be set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")


# CI (`make test`) runs with this profile: a failing example is reported as found, not shrunk (shrinking
# a Triton-interpreter example can take minutes); the seed in the report replays it.
settings.register_profile("ci", phases=[Phase.explicit, Phase.reuse, Phase.generate], print_blob=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny ops on a busy 2-core machine run many times faster on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
