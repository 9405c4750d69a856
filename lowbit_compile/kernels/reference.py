"""The eager reference lowering: run the rewritten step graph with plain torch ops.

It is the oracle every fused backend is tested against and the fallback for optimizers of one's own
whose ops no printer covers. The dequantize/quantize nodes run ``blockquant``'s reference code, so a
full-size fp32 copy of each quantized state exists while the step runs; the fused backends avoid
exactly that.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.fx import GraphModule

from .kernel import RowLaunch, per_step_inputs


class ReferenceStep:
    """A split, rewritten step run op by op, one parameter at a time."""

    backend = "reference"

    def __init__(self, step: GraphModule) -> None:
        self.step = step
        self.flat = per_step_inputs(step)

    def launch(self, rows: Sequence[list]) -> RowLaunch:
        return RowLaunch(self._run, rows, self.flat)

    def _run(self, rows: Sequence[list]) -> None:
        for row in rows:
            self.step(*row)
