"""The eager reference lowering: run the rewritten step graph with plain torch ops.

It is the oracle every fused backend is tested against and the fallback where none applies. The
dequantize/quantize nodes run ``blockquant``'s reference code, so a full-size fp32 copy of each
quantized state exists while the step runs; the fused backends avoid exactly that.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.fx import GraphModule


def lower_reference(step: GraphModule) -> Callable[..., None]:
    """The split, rewritten step as a callable taking the top-level graph's inputs in order."""
    return step.forward
