"""The kernel of a staged step (``passes.stages``): its elementwise stages run as lowered kernels of
their own, its whole-tensor stages as torch ops, one parameter at a time, so the temporaries between
stages exist for one parameter at once and never outlive its step."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch.fx import GraphModule

from .contract import Role, role_of
from .kernel import RowLaunch, StepKernel

_SHAPED = (Role.PARAM, Role.GRAD, Role.PER_ELEMENT_STATE)


class _StageKernel(torch.nn.Module):
    """One elementwise stage's kernel, called with that stage's inputs for one parameter: its
    per-element ones flat, as every kernel steps them."""

    def __init__(self, kernel: StepKernel, stage: GraphModule) -> None:
        super().__init__()
        self.kernel = kernel
        self.flat = [role_of(n) in _SHAPED for n in stage.graph.nodes if n.op == "placeholder"]

    def forward(self, *args: object) -> None:
        row = [a.reshape(-1) if flat else a for a, flat in zip(args, self.flat)]
        self.kernel.launch([row]).run()


class StagedStep:
    """A staged step: ``step`` (the split graph of ``passes.stages``) with each elementwise stage run by
    its kernel in ``kernels``, parameter by parameter, at ``shape`` (what the step was traced at)."""

    def __init__(self, step: GraphModule, kernels: dict[str, StepKernel], shape: tuple[int, ...]) -> None:
        self.step = step
        self.backend = next(iter(kernels.values())).backend
        self.shape = shape
        self.runner = copy.copy(step)  # the same graph, its elementwise children replaced by their kernels
        for name, kernel in kernels.items():
            setattr(self.runner, name, _StageKernel(kernel, getattr(step, name)))
        self.shaped = [role_of(n) in _SHAPED for n in step.graph.nodes if n.op == "placeholder"]

    def launch(self, rows: Sequence[list]) -> RowLaunch:
        return RowLaunch(self._run, rows)

    def _run(self, rows: Sequence[list]) -> None:
        for row in rows:
            self.runner(*(v.view(self.shape) if shaped else v for v, shaped in zip(row, self.shaped)))
