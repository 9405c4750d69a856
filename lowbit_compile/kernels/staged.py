"""The kernel of a staged step (``passes.stages``): its elementwise stages run as lowered kernels of
their own, its whole-tensor stages as torch ops, one parameter at a time, so the temporaries between
stages exist for one parameter at once and never outlive its step.

A sharded parameter (an FSDP2 ``DTensor``) steps its local shard in the elementwise stages; its
whole-tensor stages take their shaped inputs as ``DTensor`` of the parameter's mesh and placements,
so the torch ops (and their collectives) are the ones stock runs on the ``DTensor``, and give back
their outputs' local shards in the parameter's placements."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch.fx import GraphModule

from ..ir.contract import Role, is_view, role_of
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


class _ShardedStage(torch.nn.Module):
    """A whole-tensor stage of a sharded parameter's step: run on ``DTensor`` inputs (its shaped ones
    local shards of the parameter's shape ``shape``), its outputs' local shards in the parameter's
    placements (a scalar one replicated)."""

    def __init__(self, stage: GraphModule, shape: tuple[int, ...], placement: tuple) -> None:
        super().__init__()
        self.stage = stage
        self.shape = torch.Size(shape)
        self.mesh, self.placements = placement
        self.shaped = [_shape_of(n) == self.shape for n in stage.graph.nodes if n.op == "placeholder"]

    def forward(self, *args: object) -> tuple:
        from torch.distributed.tensor import DTensor, Replicate

        stride = torch.empty(self.shape, device="meta").stride()
        inputs = [DTensor.from_local(a, self.mesh, self.placements, run_check=False, shape=self.shape, stride=stride)
                  if shaped else a for a, shaped in zip(args, self.shaped)]
        out = []
        for value in self.stage(*inputs):
            if isinstance(value, DTensor):
                placements = self.placements if value.shape == self.shape else [Replicate()] * self.mesh.ndim
                value = value.redistribute(self.mesh, placements).to_local()
            out.append(value)
        return tuple(out)


class StagedStep:
    """A staged step: ``step`` (the split graph of ``passes.stages``) with each elementwise stage run by
    its kernel in ``kernels``, parameter by parameter, at ``shape`` (what the step was traced at); with
    ``placement`` (device mesh, placements), on the local shards of ``DTensor`` parameters of that
    global ``shape``."""

    def __init__(self, step: GraphModule, kernels: dict[str, StepKernel], shape: tuple[int, ...],
                 placement: tuple | None = None) -> None:
        self.step = step
        self.backend = next(iter(kernels.values())).backend
        self.shape = shape if placement is None else _local_shape(shape, placement)
        self.runner = copy.copy(step)  # the same graph, its elementwise children replaced by their kernels
        for name, kernel in kernels.items():
            setattr(self.runner, name, _StageKernel(kernel, getattr(step, name)))
        for name, child in step.named_children() if placement is not None else ():
            if name not in kernels:
                setattr(self.runner, name, _ShardedStage(child, shape, placement))
        self.shaped = [role_of(n) in _SHAPED for n in step.graph.nodes if n.op == "placeholder"]
        self.transient_bytes = peak_bytes(step, frozenset(kernels))

    def launch(self, rows: Sequence[list]) -> RowLaunch:
        return RowLaunch(self._run, rows)

    def _run(self, rows: Sequence[list]) -> None:
        for row in rows:
            self.runner(*(v.view(self.shape) if shaped else v for v, shaped in zip(row, self.shaped)))


def _shape_of(node: torch.fx.Node) -> torch.Size | None:
    val = node.meta.get("val")
    return val.shape if isinstance(val, torch.Tensor) else None


def _local_shape(shape: tuple[int, ...], placement: tuple) -> tuple[int, ...]:
    """This rank's shard shape of a ``DTensor`` of global ``shape`` on (device mesh, placements)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = placement
    return tuple(compute_local_shape_and_global_offset(shape, mesh, placements)[0])


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


def _nbytes(val: object) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_nbytes(v) for v in val)
    return 0
