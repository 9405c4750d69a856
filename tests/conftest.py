"""Shared test helpers: small transformer-shaped parameter sets and stepping a wrapped optimizer."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run on CPU tensors under the interpreter. triton.language builds its own jit helpers
# (tl.argmax, ...) when triton is first imported, so this must be set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")


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
