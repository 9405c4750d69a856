"""What a param group must hold for the rewritten step, checked where an optimizer is wrapped, a group is
added, a step meets a group it has not seen and a checkpoint's groups are loaded: an error naming the entry
and the fix, before anything changes (a stock step fails deep in the trace on such a group, or steps with
it silently)."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch

from .passes.trace import unhooked_step


def check_group(where: str, group: Any, reference: Mapping[str, Any], complete: bool = True,
                origin: str = "the default", bools: bool = False) -> None:
    """Refuse a group that is not a dict with ``params``, or whose hyperparameters are of another kind than
    ``reference``'s (the optimizer's defaults, or for a checkpoint's group the live one, ``origin`` naming
    which): a number where it has a number, a tuple of as many numbers (or Nones where it has None) where it
    has one, and with ``bools`` a bool (or None) where it has a bool. A hyperparameter ``reference`` has and
    ``group`` lacks is refused when the step reads every one (``complete``: torch.optim's own steps)."""
    if not isinstance(group, Mapping):
        raise TypeError(f"{where} must be a dict, got {type(group).__name__}")
    if "params" not in group:
        raise ValueError(f"{where} has no 'params': a param group is a dict such as {{'params': [...], 'lr': 1e-3}}; "
                         "add_param_group() fills in the optimizer's defaults for the rest")
    for key, ref in reference.items():
        if key in ("params", "param_names") or not (_numeric(ref) or (bools and isinstance(ref, bool))):
            continue
        if key not in group:
            if not complete or isinstance(ref, bool):  # a step of one's own may read it with group.get(key, default)
                continue
            raise ValueError(f"{where} has no {key!r} (the optimizer's default is {ref!r}); add groups with "
                             "add_param_group(), which fills in the defaults")
        _check_value(f"{where}[{key!r}]", group[key], ref, origin)


def is_real_number(value: object) -> bool:
    """One real number: a Python or numpy number (not a bool) or a one-element real tensor."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _numeric(ref: Any) -> bool:
    """Whether a hyperparameter of numbers: a number, or a tuple of numbers (and Nones)."""
    if isinstance(ref, (tuple, list)):
        return bool(ref) and all(v is None or is_real_number(v) for v in ref) and any(map(is_real_number, ref))
    return is_real_number(ref)


def _shown(value: Any) -> str:
    """A value for a message: its repr where short (a checkpoint may hold anything), else its type."""
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__}"


def _check_value(where: str, value: Any, ref: Any, origin: str) -> None:
    if isinstance(ref, bool):
        if not (value is None or isinstance(value, bool)):
            raise ValueError(f"{where} must be a bool or None, as {origin} {ref!r}, got {_shown(value)}")
    elif isinstance(ref, (tuple, list)):
        if not isinstance(value, (tuple, list)) or len(value) != len(ref):
            raise ValueError(f"{where} must be a tuple of {len(ref)} numbers, as {origin} {ref!r}, got "
                             f"{_shown(value)}")
        for i, (v, d) in enumerate(zip(value, ref)):
            if not (is_real_number(v) or (v is None and d is None)):
                raise ValueError(f"{where}[{i}] must be a number{' or None' if d is None else ''}, as in {origin} "
                                 f"{ref!r}, got {_shown(v)}{_as_number(v)}")
    elif not is_real_number(value):
        raise ValueError(f"{where} must be a number or a one-element tensor, as {origin} {ref!r}, got "
                         f"{_shown(value)}{_as_number(value)}")


def _as_number(value: Any) -> str:
    """A hint for a string that reads as a number (a value from a config file, left a string)."""
    if isinstance(value, str):
        try:
            return f" (a string: use {float(value)!r})"
        except ValueError:
            pass
    return ""


def reads_every_default(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt``'s step is one of torch.optim's own, which reads each of its defaults from the group."""
    return unhooked_step(type(opt)).__module__.startswith("torch.optim.")
