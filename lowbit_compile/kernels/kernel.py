"""The one interface of a lowered step, whatever the backend: a prepared ``launch`` steps parameters.

A lowering (``backends.lower``) gives a :class:`StepKernel` built completely (emitted, compiled,
loaded) before any step uses it, so the first step that does cannot fail half-way for a reason known
in advance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch


class BuildError(RuntimeError):
    """A kernel that could not be built here (no C++ compiler, a device the kernel cannot target)."""


class Launch(Protocol):
    """Kernel calls over fixed rows (the top-level inputs of the split step graph for one parameter
    each: param, grad, states or their storage parts, hyperparameters, in graph order), prepared once
    and run on every step the rows stay bound: the caller updates the rows in place (new grads, the
    hyperparameters' current values) and says which tensors are new objects."""

    rows: Sequence[list]

    def changed(self, r: int, i: int) -> None:
        """``rows[r][i]`` is a new grad (in the param's shape): re-check and re-point it."""

    def run(self) -> None:
        """Step every row with the rows' current values."""


@runtime_checkable
class StepKernel(Protocol):
    """A lowered step of one signature."""

    backend: str  # "cpu", "triton" or "reference": what actually runs

    def launch(self, rows: Sequence[list]) -> Launch:
        """Prepare the calls that step these rows (checks every buffer it will touch)."""


class RowLaunch:
    """A launch that runs its rows through ``run`` each time (nothing to prepare)."""

    def __init__(self, run: Callable[[Sequence[list]], None], rows: Sequence[list]) -> None:
        self._run = run
        self.rows = rows

    def changed(self, r: int, i: int) -> None:
        self.rows[r][i] = self.rows[r][i].reshape(-1)  # the step graph is traced on flat tensors

    def run(self) -> None:
        self._run(self.rows)


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
