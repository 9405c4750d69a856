"""The fp32 masters of a wrapped optimizer's parameters, out and in (``lowbit_compile.master_params``,
``load_master_params``): what an fp32 master copy holds, for checkpoints of the fp32 master recipe."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .runtime.wrapped import wrapped_of
from .state import sharding
from .state.master import master_of, set_master


def master_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The fp32 master of every parameter of ``opt``, in ``param_groups`` order: what an fp32 master
    copy holds. A 16-bit param with master weights joins its residual (every bit with ``"exact"``,
    within the lossy residual's step with ``"8bit"``); any other param is its own master (a copy, as
    fp32). DTensor params give DTensors."""
    out = []
    for group in opt.param_groups:
        for param in group["params"]:
            value = master_of(param, opt.state.get(param, {}))
            out.append(sharding.like(value if value is not None else sharding.local(param).detach().to(
                torch.float32, copy=True), param))
    return out


def load_master_params(opt: torch.optim.Optimizer, masters: Sequence[torch.Tensor]) -> None:
    """Set every parameter of ``opt`` from its fp32 master (``param_groups`` order, as
    :func:`master_params` gives them, e.g. the fp32 copies of a mixed-precision checkpoint): 16-bit
    params with master weights to the master rounded to nearest even and the residual it loses, other
    params to the master's value. Checks every shape first; changes nothing when one does not fit."""
    wrapped = wrapped_of(opt)
    if wrapped is None:
        raise ValueError("load_master_params needs an optimizer wrapped by lowbit_compile (master_weights=...)")
    params = [p for group in opt.param_groups for p in group["params"]]
    masters = list(masters)
    if len(masters) != len(params):
        raise ValueError(f"got {len(masters)} master tensors for the optimizer's {len(params)} parameters")
    for i, (param, master) in enumerate(zip(params, masters)):
        if not isinstance(master, torch.Tensor) or tuple(master.shape) != tuple(param.shape):
            raise ValueError(f"master {i} has shape {tuple(getattr(master, 'shape', ()))}, its parameter "
                             f"{tuple(param.shape)}")
        if not master.is_floating_point():
            raise ValueError(f"master {i} is {master.dtype}, not a floating-point tensor")
    for position, (param, master) in enumerate(zip(params, masters)):
        fmt = wrapped.config.master_format(param)
        set_master(param, opt.state[param] if fmt is not None else {}, master, fmt, position)
