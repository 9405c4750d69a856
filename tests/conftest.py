"""Shared test helpers: small transformer-shaped parameter sets and stepping a wrapped optimizer."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import Phase, settings

# Triton kernels run on CPU tensors under the interpreter. triton.language builds its own jit helpers
# (tl.argmax, ...) when triton is first imported, so this must be set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")


def _fma_fp32(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """fp32 ``x * y + z`` rounded once: the product is exact in float64, the sum rounded to odd there
    (53 bits, more than fp32's 24 + 2), so the one rounding to fp32 is the fma's."""
    p = x.astype(np.float64) * y.astype(np.float64)
    zz = z.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + zz
        t = s - p
        err = (p - (s - t)) + (zz - t)  # the exact error of s (TwoSum)
    bits = s.view(np.int64)
    inexact = np.isfinite(err) & (err != 0) & ((bits & 1) == 0)
    bits = np.where(inexact, bits + np.where((err > 0) == (s > 0), 1, -1), bits)
    return bits.view(np.float64).astype(np.float32)


def _interpreter_fma_rounds_once() -> None:
    """Triton's interpreter before 3.9 computes ``tl.fma`` as a multiply and an add, rounding twice;
    the GPU's fma (the kernels' arithmetic the tests stand for) rounds once, so give it that fma.
    Decided by what the interpreter computes: (1 + 2**-12)**2 - 1 is 2**-11 + 2**-24 rounded once."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    one = lambda v: interpreter.TensorHandle(np.array([v], dtype=np.float32), tl.float32)  # noqa: E731
    x = np.float32(1 + 2**-12)
    if builder.create_fma(object.__new__(builder), one(x), one(x), one(-1.0)).data[0] == 2**-11 + 2**-24:
        return
    plain = builder.create_fma

    def create_fma(self, x, y, z):
        if z.data.dtype != np.float32:
            return plain(self, x, y, z)
        return interpreter.TensorHandle(_fma_fp32(*np.broadcast_arrays(x.data, y.data, z.data)), z.dtype.scalar)

    builder.create_fma = create_fma


_interpreter_fma_rounds_once()

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
