"""Which lowering turns a rewritten step graph into something to run, per backend and device."""

from __future__ import annotations

from collections.abc import Callable

from torch.fx import GraphModule

from .cpu import lower_cpu
from .reference import lower_reference

Lowering = Callable[[GraphModule], Callable[..., None]]

# "inductor" is the CPU lowering: C++ emitted from the rewritten graph, built with inductor's toolchain
LOWERINGS: dict[str, Lowering] = {"reference": lower_reference, "inductor": lower_cpu}

try:  # the fused GPU lowering, wherever triton imports
    from .triton_backend import lower_triton
except ImportError:
    pass
else:
    LOWERINGS["triton"] = lower_triton


def resolve(backend: str, device_type: str) -> str:
    """The concrete backend for ``backend`` on ``device_type`` ("auto" picks the fastest available)."""
    if backend == "auto":
        preferred = "triton" if device_type == "cuda" else "inductor"
        return preferred if preferred in LOWERINGS else "reference"
    if backend not in LOWERINGS:
        raise NotImplementedError(
            f"backend={backend!r} is not available in this version; use backend='reference' or 'auto'"
        )
    return backend


def lower(graph: GraphModule, backend: str) -> Callable[..., None]:
    return LOWERINGS[backend](graph)
