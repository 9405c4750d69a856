"""What a param group must hold for the rewritten step, checked where an optimizer is wrapped, a group is
added and a step meets a group it has not seen: an error naming the entry and the fix, before anything
changes (a stock step fails deep in the trace on such a group, or steps with it silently)."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch

from .passes.trace import unhooked_step


def check_group(where: str, group: Any, defaults: Mapping[str, Any], complete: bool = True) -> None:
    """Refuse a group that is not a dict with ``params``, or whose numeric hyperparameters (those with a
    number, or a tuple of numbers, as the optimizer's default) are not numbers as the default's, or, when
    the step reads every default (``complete``: torch.optim's own steps), missing."""
    if not isinstance(group, Mapping):
        raise TypeError(f"{where} must be a dict, got {type(group).__name__}")
    if "params" not in group:
        raise ValueError(f"{where} has no 'params': a param group is a dict such as {{'params': [...], 'lr': 1e-3}}; "
                         "add_param_group() fills in the optimizer's defaults for the rest")
    for key, default in defaults.items():
        if key == "params" or not _numeric(default):
            continue
        if key not in group:
            if not complete:  # a step of one's own may read it with group.get(key, default)
                continue
            raise ValueError(f"{where} has no {key!r} (the optimizer's default is {default!r}); add groups with "
                             "add_param_group(), which fills in the defaults")
        _check_value(f"{where}[{key!r}]", group[key], default)


def _number(value: Any) -> bool:
    """A real number (not a bool) or a one-element tensor: what a float hyperparameter may be."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex()
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _numeric(default: Any) -> bool:
    """Whether a default is a hyperparameter of numbers: a number, or a tuple of numbers (and Nones)."""
    if isinstance(default, (tuple, list)):
        return bool(default) and all(v is None or _number(v) for v in default) and any(map(_number, default))
    return _number(default)


def _check_value(where: str, value: Any, default: Any) -> None:
    if isinstance(default, (tuple, list)):
        if not isinstance(value, (tuple, list)) or len(value) != len(default):
            raise ValueError(f"{where} must be a tuple of {len(default)} numbers, as the default {default!r}, got "
                             f"{value!r}")
        for i, (v, d) in enumerate(zip(value, default)):
            if not (_number(v) or (v is None and d is None)):
                raise ValueError(f"{where}[{i}] must be a number{' or None' if d is None else ''}, as in the default "
                                 f"{default!r}, got {v!r}{_as_number(v)}")
    elif not _number(value):
        raise ValueError(f"{where} must be a number or a one-element tensor, as the default {default!r}, got "
                         f"{value!r}{_as_number(value)}")


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
