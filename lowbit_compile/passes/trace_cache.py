"""Traces of optimizer steps, cached per process: one per signature (class, static flags, dtypes,
device type, state example), shared by every state format, and one lock that serializes tracing.

Tracing runs ``make_fx`` over torch's process-wide tracing state, so two threads must never trace
at once; every trace (and every probe of a stock step) here runs under :data:`TRACE_LOCK`, which
the compile path holds for the whole of a signature's trace-rewrite-build.
"""

from __future__ import annotations

import collections
import functools
import inspect
import threading
from typing import Any

import torch

from ..options import is_int
from .trace import (
    HyperSlot,
    Layout,
    TracedStep,
    hyper_slots,
    static_group_items,
    tensor_meta,
    trace_step,
    unhooked_step,
)

# Group flags that select the foreach/fused implementations: the trace always takes the
# single-tensor path, whatever the group asks for.
_IMPL_FLAGS = {"foreach": False, "fused": False}

TRACE_LOCK = threading.RLock()


class LruCache(collections.OrderedDict):
    """A process-wide cache of the ``limit`` signatures used last: a run whose signatures keep
    changing (a new group entry each step) evicts old ones instead of growing without bound."""

    def __init__(self, limit: int = 256) -> None:
        super().__init__()
        self.limit = limit

    def get(self, key: Any, default: Any = None) -> Any:
        if key in self:
            self.move_to_end(key)
            return self[key]
        return default

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key in self:
            self.move_to_end(key)
            return self[key]
        self[key] = default
        if len(self) > self.limit:
            self.popitem(last=False)
        return default


_traces: LruCache = LruCache()  # signature -> its traces (one per way its guards can go)


def trace_group(group: dict) -> dict:
    """The group as the trace sees it: the single-tensor implementation, and a Python ``int`` given for a
    hyperparameter that torch.optim declares a float (``lr=1``, ``weight_decay=0``, ``betas=(0, 0.99)``)
    as that float, so that, like a float, it is an input of the trace, not a constant of it (an int is
    a count or a flag elsewhere: Muon's ``ns_steps``)."""
    tgroup = {**group, **{k: v for k, v in _IMPL_FLAGS.items() if k in group}}
    for key in float_hyperparameters().intersection(group):
        value = group[key]
        if is_int(value):
            tgroup[key] = float(value)
        elif isinstance(value, (tuple, list)) and any(map(is_int, value)):
            tgroup[key] = type(value)(float(v) if is_int(v) else v for v in value)
    return tgroup


@functools.cache
def float_hyperparameters() -> frozenset[str]:
    """The constructor arguments that torch.optim's optimizers annotate as floats (or tuples of them)."""
    names = set()
    for cls in vars(torch.optim).values():
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            names.update(name for name, p in inspect.signature(cls.__init__).parameters.items()
                         if "float" in str(p.annotation))
    return frozenset(names)


def trace_key(opt: torch.optim.Optimizer, tgroup: dict, slots: tuple[HyperSlot, ...], dtype: torch.dtype,
              device: torch.device, example: dict, per_element: tuple[str, ...],
              shape: tuple[int, ...] | Layout | None = None) -> tuple:
    return (
        shape,  # None: the 1-D elementwise trace; a shaped step's (Muon's) holds for that layout only
        type(opt), unhooked_step(type(opt)), static_group_items(tgroup, slots, unhooked_step(type(opt))),
        tuple((s, tensor_meta(s.get(tgroup)) if s.is_tensor else None) for s in slots),
        dtype, device.type,
        # per-element states by dtype only: the trace is 1-D and elementwise, so one serves every shape
        tuple((k, (v.dtype, v.device.type) if k in per_element else tensor_meta(v))
              if isinstance(v, torch.Tensor) else (k, type(v))
              for k, v in sorted(example.items(), key=lambda item: repr(item[0]))),  # keys of any type
    )


def traced(opt: torch.optim.Optimizer, tgroup: dict, dtype: torch.dtype, device: torch.device, example: dict,
           per_element: tuple[str, ...], exclude: frozenset[int] = frozenset(),
           shape: tuple[int, ...] | Layout | None = None) -> TracedStep:
    """A trace of the step for this example state whose guard holds (not one of ``exclude``, by id),
    shared by every state format; traced now if there is none (at ``shape``, for a shaped step)."""
    slots = hyper_slots(tgroup)
    values = [s.get(tgroup) for s in slots]
    with TRACE_LOCK:
        traces = _traces.setdefault(trace_key(opt, tgroup, slots, dtype, device, example, per_element, shape), [])
        for trace in traces:
            if id(trace) not in exclude and trace.guard(values):
                return trace
        trace = trace_step(opt, tgroup, dtype, device, example, per_element, shape)
        traces.append(trace)
        # a trace learns which group entries the step reads: the key without the others finds it too
        known = _traces.setdefault(trace_key(opt, tgroup, slots, dtype, device, example, per_element, shape), [])
        if known is not traces:
            known.append(trace)
        return trace


def skeleton(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt`` without its parameters, states and wrapper: what a later retrace needs of it."""
    shell: Any = object.__new__(type(opt))
    shell.__dict__.update({k: v for k, v in opt.__dict__.items()
                           if k not in ("param_groups", "state", "step", "_lowbit")})
    return shell
