"""The backends, and the one policy for lowering a rewritten step on each.

``"cpu"``: the project's own C++ kernel (``cpu.py``); ``"triton"``: one Triton kernel per step (GPU;
CPU tensors under ``TRITON_INTERPRET=1``); ``"reference"``: the eager oracle; ``"auto"``: the fused
backend of the parameters' device. Importing this module imports neither triton nor inductor: a
backend's modules load when its first kernel is built.

A step is lowered completely (printed, compiled, loaded) before its first run changes anything; the
C++ compiler runs in the background meanwhile, so the kernels of one step compile at once.
When the fused backend of ``"auto"`` cannot build a step (an op of an optimizer of one's own that no
printer covers, no C++ compiler), the step runs on the reference, with one warning naming why; a
backend asked for by name fails instead, at the same point, leaving the optimizer as it was.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Callable

import torch
from torch.fx import GraphModule

from .kernel import BuildError, StepKernel
from .lowering import LoweringError
from .reference import ReferenceStep
from .triton_env import interpreting

BACKENDS = ("auto", "cpu", "triton", "reference")
DEPRECATED_NAMES = {"inductor": "cpu"}  # the CPU kernel was first built with inductor's toolchain


class BackendError(ValueError):
    """A backend that cannot run the parameters it was asked to."""


def canonical(backend: str) -> str:
    """``backend``'s current name (a deprecated one warns); a ValueError for an unknown one."""
    if backend in DEPRECATED_NAMES:
        new = DEPRECATED_NAMES[backend]
        warnings.warn(f"backend={backend!r} is deprecated; it is the C++ CPU kernel, now named backend={new!r}",
                      DeprecationWarning, stacklevel=3)
        return new
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve(backend: str, device_type: str) -> str:
    """The concrete backend for ``backend`` on tensors of ``device_type``; a :class:`BackendError`
    naming the fix when a backend asked for by name cannot run them."""
    backend = canonical(backend)
    if backend == "auto":
        if device_type == "cuda":
            if triton_available():
                return "triton"
            warnings.warn("lowbit_compile: triton is not installed, so CUDA parameters step with the eager "
                          "reference (correct, but not fused); pip install 'lowbit-compile[gpu]'", stacklevel=2)
            return "reference"
        return "cpu" if device_type == "cpu" else "reference"
    if backend == "cpu" and device_type != "cpu":
        raise BackendError(f"backend='cpu' runs CPU tensors, not {device_type} ones; use backend='auto'")
    if backend == "triton":
        if not triton_available():
            raise BackendError("backend='triton' needs the triton package (pip install triton); use backend='auto'")
        if device_type != "cuda" and not (device_type == "cpu" and interpreting()):
            raise BackendError(f"backend='triton' runs CUDA tensors (CPU ones only under TRITON_INTERPRET=1), not "
                               f"{device_type} ones; use backend='auto' or 'cpu'")
    return backend


def lower(step: GraphModule, backend: str, device: torch.device) -> Callable[[], StepKernel]:
    """The kernel of the split, rewritten ``step`` for parameters on ``device``: printed now, compiled
    in the background where the backend runs a compiler (the C++ one), so several steps compile at
    once; calling the result waits for it and gives the kernel, built completely."""
    concrete = resolve(backend, device.type)
    if concrete == "reference":
        return functools.partial(ReferenceStep, step)
    try:
        if concrete == "cpu":
            from .cpu import lower_cpu

            building = lower_cpu(step)
        else:
            from .triton_backend import TritonStep

            building = functools.partial(TritonStep, step, device)
    except (LoweringError, BuildError) as err:
        return functools.partial(_fallback, step, backend, concrete, err)

    def built() -> StepKernel:
        try:
            return building()
        except (LoweringError, BuildError) as err:
            return _fallback(step, backend, concrete, err)

    return built


def _fallback(step: GraphModule, backend: str, concrete: str, err: Exception) -> StepKernel:
    """The reference lowering of a step the fused ``concrete`` backend cannot build, under ``"auto"``;
    asked for by name, the error that says so."""
    if canonical(backend) != "auto":
        raise LoweringError(f"backend={backend!r} cannot run this step: {err}. Use backend='auto' (the "
                            "reference lowering where the kernels do not reach) or backend='reference'") from err
    warnings.warn(f"lowbit-compile: the {concrete} kernel cannot run this step ({err}); it runs on the eager "
                  "reference lowering instead (op by op, with fp32 temporaries)", stacklevel=2)
    return ReferenceStep(step)
