"""The rewrite of a traced step, as data: its stages in order (:data:`STAGES`), each a pass of this package
run when the request asks for it, and :func:`rewrite`, which runs them. The compile path and the tests'
graph helpers both call :func:`rewrite`, so the order lives here only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch.fx import GraphModule

from ..formats import StateFormat
from ..formats.residual import MasterFormat
from .master_weights import master_weights
from .opmath import compute_in_fp32
from .quantize_states import quantize_states
from .roles import label_roles
from .split import split_prologue
from .stages import split_stages


@dataclass(frozen=True)
class Rewrite:
    """What a traced step is rewritten for: each per-element state's format, those that round
    stochastically, whether a bf16/fp16 param's update computes in fp32 (``opmath``), its master's format,
    and whether the step runs in stages (a shaped step: Muon's)."""

    formats: Mapping[str, StateFormat]
    stochastic: frozenset[str] = frozenset()
    opmath: bool = False
    master: MasterFormat | None = None
    staged: bool = False


# (name, pass): the stages in order; a pass gives None where the request does not ask for its stage
Stage = Callable[[GraphModule, Rewrite], GraphModule | None]
STAGES: tuple[tuple[str, Stage], ...] = (
    ("roles", lambda gm, r: label_roles(gm, staged=r.staged)),
    ("quantized", lambda gm, r: quantize_states(gm, r.formats, r.stochastic)),
    ("opmath", lambda gm, r: compute_in_fp32(gm) if r.opmath else None),
    ("master", lambda gm, r: master_weights(gm, r.master) if r.master is not None else None),
    ("split", lambda gm, r: split_stages(gm) if r.staged else split_prologue(gm)),
)


def rewrite(traced: GraphModule, request: Rewrite) -> dict[str, GraphModule]:
    """The graph after each stage that runs, by stage name, in order (``"split"``, the last, is what a
    backend lowers; the compile path proves the states' signs on ``"roles"``)."""
    graphs: dict[str, GraphModule] = {}
    gm = traced
    for name, stage in STAGES:
        out = stage(gm, request)
        if out is not None:
            graphs[name] = gm = out
    return graphs
