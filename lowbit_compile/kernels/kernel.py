"""The one interface of a lowered step, whatever the backend: a prepared ``launch`` steps parameters.

A lowering (``backends.lower``) gives a :class:`StepKernel` built completely (emitted, compiled,
loaded) before any step uses it, so the first step that does cannot fail half-way for a reason known
in advance.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch.fx import GraphModule

from ..formats.residual import SEED_PERIOD
from ..ir.contract import Role, is_step_counter, role_of


class BuildError(RuntimeError):
    """A kernel that could not be built here (no C++ compiler, a device the kernel cannot target)."""


class Launch(Protocol):
    """Kernel calls over fixed rows (the top-level inputs of the split step graph for one parameter
    each: param, grad, states or their storage parts, hyperparameters, in graph order), prepared once
    and run on every step the rows stay bound. The caller owns the rows: before each run it puts in
    them that step's param and grad (in the param's shape, any strides) and hyperparameters, and
    takes them out after, so nothing of a step outlives it; a launch keeps no reference to a grad (nor
    a copy of one) once :meth:`run` returns. The states and their storage parts stay bound."""

    rows: Sequence[list]

    def run(self) -> None:
        """Step every row with the rows' current values."""


@runtime_checkable
class StepKernel(Protocol):
    """A lowered step of one signature."""

    backend: str  # "cpu", "triton" or "reference": what actually runs

    def launch(self, rows: Sequence[list]) -> Launch:
        """Prepare the calls that step these rows (checks every buffer it will touch)."""


class RowLaunch:
    """A launch that runs its rows through ``run`` each time (nothing to prepare). The inputs at
    ``flat`` (the param and grad, which the caller binds in the param's shape) are passed as flat
    contiguous views, as the step graph is traced: a strided grad through a copy made for that run."""

    def __init__(self, run: Callable[[Sequence[list]], None], rows: Sequence[list], flat: Sequence[int] = ()) -> None:
        self._run = run
        self.rows = rows
        self.flat = frozenset(flat)

    def run(self) -> None:
        if not self.flat:
            self._run(self.rows)
            return
        flat_rows = []
        for row in self.rows:
            first, *rest = (row[i] for i in self.flat)  # the param and its grad: one dtype and size
            if any(t.dtype != first.dtype or t.numel() != first.numel() for t in rest):
                raise ValueError(f"a grad does not match its param: {[(t.dtype, t.numel()) for t in (first, *rest)]}")
            flat_rows.append([v.reshape(-1).contiguous() if i in self.flat else v for i, v in enumerate(row)])
        self._run(flat_rows)


def check_grad(grad: torch.Tensor, dtype: torch.dtype, numel: int, row: int) -> None:
    """Refuse the grad of launch row ``row`` unless it has ``numel`` elements of ``dtype`` (a launch binds
    it by pointer: a wrong one must fail here, not be read past its end)."""
    if grad.dtype is not dtype or grad.numel() != numel:
        raise ValueError(f"the grad of row {row}: expected {numel} elements of {dtype}, "
                         f"got {grad.numel()} of {grad.dtype}")


def per_step_inputs(step: GraphModule) -> tuple[int, ...]:
    """The positions of a split step's param and grad among its top-level inputs."""
    top = [n for n in step.graph.nodes if n.op == "placeholder"]
    return tuple(i for i, n in enumerate(top) if role_of(n) in (Role.PARAM, Role.GRAD))


def body_sources(step: GraphModule) -> tuple[tuple[int, ...], tuple[tuple[str, int], ...]]:
    """Where a split step's prologue takes its inputs (top-level input positions), and where each body
    input comes from: ``("arg", i)`` top-level input ``i``, ``("pro", j)`` the prologue's output ``j``."""
    top = [n for n in step.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(top)}
    call_pro = next(n for n in step.graph.nodes if n.op == "call_module" and n.target == "prologue")
    call_body = next(n for n in step.graph.nodes if n.op == "call_module" and n.target == "body")
    sources = []
    for a in call_body.args:
        if a.op == "placeholder":
            sources.append(("arg", index[a]))
        else:
            assert a.target is operator.getitem and a.args[0] is call_pro
            sources.append(("pro", a.args[1]))
    return tuple(index[a] for a in call_pro.args), tuple(sources)


def step_counters(step: GraphModule) -> tuple[tuple[int, ...], dict[int, int]]:
    """The step counters of stochastic rounding among a split step's top-level inputs (positions), and
    the prologue outputs that hold a counter's value from before the step (output -> counter position).
    Each parameter's counter starts apart (``residual.first_counter``), so the rows of one launch hold
    different counters: they share the prologue's other outputs and take their own counters' values."""
    top = [n for n in step.graph.nodes if n.op == "placeholder"]
    counters = tuple(i for i, n in enumerate(top) if is_step_counter(n))
    prologue_args, _ = body_sources(step)
    inner = [n for n in step.prologue.graph.nodes if n.op == "placeholder"]
    position = {node: prologue_args[k] for k, node in enumerate(inner)}
    output = next(n for n in step.prologue.graph.nodes if n.op == "output").args[0]
    output = (output,) if isinstance(output, torch.fx.Node) else output or ()
    reads = {j: position[o.args[0]] for j, o in enumerate(output)
             if isinstance(o, torch.fx.Node) and o.target is torch.ops.aten.clone.default
             and position.get(o.args[0]) in counters}
    return counters, reads


def advance_counters(rows: Sequence[Sequence[object]], members: Sequence[int], counters: Sequence[int]
                     ) -> list[dict[int, float]]:
    """Each row's counters' values (by position) before the step, the rows' counters then advanced by one
    modulo ``SEED_PERIOD`` as the step graph advances them; in one stack and one add for all rows."""
    tensors = [rows[r][c] for r in members for c in counters]
    if not tensors:
        return [{} for _ in members]
    values = torch.stack(tensors).tolist()
    torch._foreach_add_(tensors, 1.0)
    for t, v in zip(tensors, values):
        if v + 1 >= SEED_PERIOD:  # every 2**24 steps
            t.fill_((v + 1) % SEED_PERIOD)
    n = len(counters)
    return [dict(zip(counters, values[k * n:(k + 1) * n])) for k in range(len(members))]


def same_scalar_states(rows: Sequence[Sequence[object]], indices: Sequence[int]) -> list[list[int]]:
    """Positions of ``rows`` grouped by equal values of the inputs at ``indices`` (the scalar states,
    such as the step count): the rows of a group share one run of the step's scalar prologue."""
    if len(rows) == 1 or not indices:
        return [list(range(len(rows)))]
    states = [rows[r][k] for r in range(len(rows)) for k in indices]
    if all(isinstance(t, torch.Tensor) and t.dtype == states[0].dtype and t.shape == states[0].shape
           for t in states):
        values = torch.stack(states).reshape(len(rows), -1).tolist()  # one read, not one .item() each
    else:
        n = len(indices)
        values = [[t.item() if isinstance(t, torch.Tensor) else t for t in states[r * n:(r + 1) * n]]
                  for r in range(len(rows))]
    groups: dict[tuple, list[int]] = {}
    for r, key in enumerate(values):
        groups.setdefault(tuple(key), []).append(r)
    return list(groups.values())
