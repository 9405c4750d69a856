"""The checkpoint hooks of a wrapped optimizer: ``state_dict()`` packs every kind of per-parameter state
(``kinds.KINDS``, each through the wire codec) and marks what a stock loader must refuse; ``load_state_dict()``
is all or nothing at any sharding: the whole checkpoint is read, checked and converted before anything
changes (the stock loader itself is first run on a stand-in), and the stock loader gets only the stock
step's scalar states.
"""

from __future__ import annotations

import collections
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..formats import StateFormat
from ..formats.residual import KEYS as MASTER_KEYS
from ..param_groups import check_group
from . import codec
from .foreign import refuse_foreign
from .kind import Changes, StateConfig, applied
from .kinds import KINDS, OWN_KEYS
from .stock import guard_stock_steps, mark_state_dict, unmarked_state_dict

_PENDING = "_lowbit_pending"


# state_dict() ---------------------------------------------------------------------------------------------
def pack_state_dict(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``Optimizer.state_dict`` post hook: every kind's states of each entry packed (``StateKind.pack``), then
    the entries a stock optimizer must not apply marked (``stock.mark_state_dict``)."""
    guard_stock_steps()
    params = {idx: p for saved, group in zip(state_dict["param_groups"], opt.param_groups)
              for idx, p in zip(saved["params"], group["params"])}
    for idx, entry in list(state_dict["state"].items()):
        changes: Changes = {}
        for kind in KINDS:
            changes.update(kind.pack(entry, params[idx]))
        if changes:
            state_dict["state"][idx] = {**entry, **changes}
    return mark_state_dict(opt, state_dict)


# load_state_dict() ----------------------------------------------------------------------------------------
def prepare_load(opt: torch.optim.Optimizer, state_dict: dict, config_of: Callable[[dict, torch.Tensor], StateConfig],
                 name_of: Callable[[torch.Tensor], str | None]) -> dict:
    """``load_state_dict`` pre hook: read and check all of the checkpoint, and bring every kind of
    per-parameter state to the configuration, before the stock loader changes anything; any error names the
    parameter and state, and leaves the optimizer as it was (the stock loader itself is run first on a
    stand-in, so what it would fail on fails here). The states read are kept aside for :func:`finish_load`,
    and the stock loader gets the rest (``step`` and the stock step's other scalar states).

    ``config_of(group, param)`` gives what the configuration asks of ``param`` in ``group`` (the saved group,
    as it will be after loading). Each kind loads its states strictly (``StateKind.loaded``): a state saved
    in another layout (format, block size, outliers) is converted, with one warning; the master's entries
    read (dropped for a param without master weights); the rounding counter read back, started where a
    state now rounds stochastically and the checkpoint has none, dropped where none does.
    """
    guard_stock_steps()
    state_dict = unmarked_state_dict(_checked_structure(state_dict))
    groups, saved_groups = opt.param_groups, state_dict["param_groups"]
    if len(groups) != len(saved_groups):
        raise ValueError(f"loaded state dict has a different number of parameter groups ({len(saved_groups)}) "
                         f"than the optimizer ({len(groups)}); load a checkpoint of this optimizer")
    for i, (group, saved) in enumerate(zip(groups, saved_groups)):
        if len(group["params"]) != len(saved["params"]):
            raise ValueError(
                f"loaded state dict contains a parameter group that doesn't match the size of optimizer's group: "
                f"param_groups[{i}] has {len(saved['params'])} parameters in the checkpoint and "
                f"{len(group['params'])} in the optimizer; load a checkpoint of this optimizer")
        _check_saved_group(i, group, saved)
    where: dict[Any, tuple[int, int, torch.Tensor]] = {}
    for gi, (group, saved) in enumerate(zip(groups, saved_groups)):
        for pi, (idx, param) in enumerate(zip(saved["params"], group["params"])):
            where[idx] = (gi, pi, param)
    pending: dict[torch.Tensor, dict[str, Any]] = {}
    plain: dict = {}
    relayouts: collections.Counter[tuple[str, str]] = collections.Counter()
    for idx, entry in state_dict["state"].items():
        if idx not in where:
            plain[idx] = entry
            continue
        gi, pi, param = where[idx]
        # the group as it will be: the saved values, the optimizer's own for keys an older torch did not save
        group = {**groups[gi], **saved_groups[gi], "params": groups[gi]["params"]}
        label = _label(gi, pi, param, name_of(param))
        try:
            config = config_of(group, param)
        except Exception as err:  # probing the step with the saved group: the stock constructor's checks, ...
            raise ValueError(f"{label}: the checkpoint's param_groups[{gi}] cannot step it "
                             f"({type(err).__name__}: {err}); nothing was loaded") from err
        if not isinstance(entry, Mapping):
            raise ValueError(f"{label}: its saved state is a {type(entry).__name__}, not a dict of states; the "
                             "checkpoint is corrupt")
        refuse_foreign(entry, config.formats, label)
        taken: Changes = {}
        try:
            for kind in KINDS:
                taken.update(kind.loaded(param, applied(entry, taken), config))
            stock = config.schema.read_saved(entry, param.shape, config.optimizer, OWN_KEYS)
        except ValueError as err:
            raise ValueError(f"{label}: {err}") from err
        relayouts.update(_relayouts(entry, config))
        kept = {k: v for k, v in taken.items() if v is not None}
        if kept:
            pending[param] = kept
        plain[idx] = {k: stock.get(k, v) for k, v in entry.items() if k not in taken and k not in MASTER_KEYS}
    loaded = {**state_dict, "state": plain}
    _dry_run(opt, loaded)
    if relayouts:
        _warn_relayout(relayouts)
    opt.__dict__[_PENDING] = pending
    return loaded


def _check_saved_group(index: int, group: Mapping, saved: Mapping) -> None:
    """Refuse a saved hyperparameter of another kind than the optimizer's own (``param_groups.check_group``
    against the live group): the stock loader takes any value, and the step would fail on it after the load
    changed everything."""
    try:
        check_group(f"the checkpoint's param_groups[{index}]", saved, group, complete=False, origin="the optimizer's",
                    bools=True)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{err}; the checkpoint is corrupt or of another optimizer (nothing was loaded)") from None


def _described(fmt: StateFormat) -> str:
    """A state's storage as a message names it: ``int8 (blocks of 64, 2 outliers)``."""
    if not fmt.blockwise:
        return fmt.name
    return f"{fmt.name} (blocks of {fmt.block_size}" + (f", {fmt.outliers} outliers)" if fmt.outliers else ")")


def _relayouts(entry: Mapping[str, Any], config: StateConfig) -> list[tuple[str, str]]:
    """(saved, configured) of each state of a saved ``entry`` (its headers checked by the load) that is in
    another format, block size or outlier count than the configured one."""
    out = []
    for key, value in entry.items():
        fmt = config.formats.get(key)
        if fmt is not None and codec.is_packed(value) and (saved := _described(codec.saved_format(value))) != (
                now := _described(fmt)):
            out.append((saved, now))
    return out


def _warn_relayout(relayouts: collections.Counter[tuple[str, str]]) -> None:
    """The one warning of a load that converted states saved in another layout than the configured one."""
    listed = "; ".join(f"{n} state{'s' * (n > 1)} saved as {saved}, now {now}" for (saved, now), n in relayouts.items())
    warnings.warn(f"lowbit_compile: this checkpoint's low-bit states are in another layout than this optimizer's: "
                  f"{listed}. They were converted (each value within the new layout's resolution of the saved "
                  "one), so the run does not resume bit for bit; give lowbit_compile the saved fmt, block_size "
                  "and outliers to resume exactly", stacklevel=_outside_stacklevel())


def _outside_stacklevel() -> int:
    """The ``stacklevel`` of a warning issued by the caller of this function that names the first frame
    outside torch and lowbit_compile (the user's ``load_state_dict`` call, through however many of
    torch's wrappers)."""
    inside = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def _checked_structure(state_dict: object) -> dict:
    """``state_dict`` after checking it has the shape of an optimizer's: a dict with a dict ``state``
    and a list ``param_groups`` of dicts, each with a list ``params``."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"load_state_dict takes an optimizer's state dict, got a {type(state_dict).__name__}")
    missing = [k for k in ("state", "param_groups") if k not in state_dict]
    if missing:
        raise ValueError(f"the state dict has no {missing}: it is not an optimizer's state dict (keys "
                         f"{sorted(map(str, state_dict))[:8]}); pass optimizer.state_dict()'s output")
    if not isinstance(state_dict["state"], Mapping):
        raise ValueError(f"the state dict's 'state' is a {type(state_dict['state']).__name__}, not a dict")
    groups = state_dict["param_groups"]
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping) for g in groups):
        raise ValueError("the state dict's 'param_groups' is not a list of dicts; the checkpoint is corrupt")
    for i, group in enumerate(groups):
        if not isinstance(group.get("params"), (list, tuple)):
            raise ValueError(f"the state dict's param_groups[{i}] has no list 'params'; the checkpoint is corrupt")
    return dict(state_dict)



def _dry_run(opt: torch.optim.Optimizer, state_dict: dict) -> None:
    """Run the loader of ``opt``'s class (without its hooks) over ``state_dict`` on a stand-in that
    shares no state or group with ``opt``: what the stock loader fails on (its ``__setstate__``
    reading a ``step`` that is not a number) fails here, before it has replaced ``opt``'s state, and so
    does a saved group that would leave out a hyperparameter the optimizer's group has."""
    shell = object.__new__(type(opt))
    shell.__dict__.update(opt.__dict__)
    shell.state = collections.defaultdict(dict)
    shell.param_groups = [dict(g) for g in opt.param_groups]
    shell._optimizer_load_state_dict_pre_hooks = collections.OrderedDict()
    shell._optimizer_load_state_dict_post_hooks = collections.OrderedDict()
    # tensors of more than one element stand in as empty ones: the stock loader only casts and moves them
    light = {idx: ({k: torch.empty(0, dtype=v.dtype, device=v.device) if isinstance(v, torch.Tensor) and v.numel() > 1
                    else v for k, v in entry.items()} if isinstance(entry, Mapping) else entry)
             for idx, entry in state_dict["state"].items()}
    try:
        type(opt).load_state_dict(shell, {**state_dict, "state": light})
    except Exception as err:  # whatever the stock loader raises: nothing of opt was changed
        raise ValueError(f"{type(opt).__name__}'s own load_state_dict cannot read this checkpoint "
                         f"({type(err).__name__}: {err}); nothing was loaded") from err
    for i, (group, loaded) in enumerate(zip(opt.param_groups, shell.param_groups)):
        missing = sorted(map(str, group.keys() - loaded.keys()))
        if missing:
            raise ValueError(f"the checkpoint's param_groups[{i}] lacks {missing}, which the optimizer's step "
                             "reads; the checkpoint is truncated or of another optimizer (nothing was loaded)")



def finish_load(opt: torch.optim.Optimizer) -> None:
    """``load_state_dict`` post hook: put the states :func:`prepare_load` converted in place."""
    for param, states in opt.__dict__.pop(_PENDING, {}).items():
        opt.state[param].update(states)



def _label(group: int, index: int, param: torch.Tensor, name: str | None) -> str:
    named = f" {name!r}" if name else ""
    return f"parameter{named} (param_groups[{group}]['params'][{index}], shape {tuple(param.shape)})"
