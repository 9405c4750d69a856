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
        self.transient_bytes = peak_bytes(step, frozenset(kernels))

    def launch(self, rows: Sequence[list]) -> RowLaunch:
        return RowLaunch(self._run, rows)

    def _run(self, rows: Sequence[list]) -> None:
        for row in rows:
            self.runner(*(v.view(self.shape) if shaped else v for v, shaped in zip(row, self.shaped)))


def peak_bytes(gm: GraphModule, kernels: frozenset[str] = frozenset()) -> int:
    """The most bytes of tensors ``gm`` allocates that are alive at once while it runs (its inputs not
    counted; views, and the children named in ``kernels``, fused kernels, allocate none), from the
    traced shapes."""
    nodes = list(gm.graph.nodes)
    last_use = {a: i for i, n in enumerate(nodes) for a in n.all_input_nodes}
    live: dict[torch.fx.Node, int] = {}
    peak = 0
    for i, node in enumerate(nodes):
        inner = 0
        if node.op == "call_module":
            child = getattr(gm, node.target)
            inner = peak_bytes(child) if node.target not in kernels else 0
        elif node.op == "call_function" and not is_view(node.target):
            live[node] = _nbytes(node.meta.get("val"))
        peak = max(peak, sum(live.values()) + inner)
        for a in node.all_input_nodes:
            if last_use.get(a) == i:
                live.pop(a, None)
    return peak


def is_view(target: object) -> bool:
    """Whether the op ``target`` returns a view of its input."""
    schema = getattr(target, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None


def _nbytes(val: object) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_nbytes(v) for v in val)
    return 0
