"""The wrapped ``step()``: per parameter, find the compiled step for its signature and run it.

A signature is everything a trace depends on: optimizer class, the group's static flags, which
hyperparameters are tensors, param dtype and device type, the state schema and the state formats.
Compiled steps are cached per process across optimizers; hyperparameter values are read from
``param_groups`` on every call, so schedulers never cause a retrace.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import sharding
from .config import Config
from .kernels.backends import lower, resolve
from .kernels.formats import StateFormat
from .passes.quantize_states import quantize_states
from .passes.roles import label_roles
from .passes.split import split_prologue
from .passes.trace import (
    TracedStep,
    hyper_slots,
    shell_optimizer,
    static_group_items,
    tensor_meta,
    trace_step,
    unhooked_step,
)
from .state import QuantizedState

# Group flags that select the foreach/fused implementations: the trace always takes the
# single-tensor path, whatever the group asks for.
_IMPL_FLAGS = {"foreach": False, "fused": False}


@dataclass(frozen=True)
class StateSchema:
    """What the stock optimizer keeps per parameter, learned by stepping a tiny probe parameter.

    ``init`` maps each state key to how the stock step creates it: ``("fill", value, dtype)`` for
    a per-element state, ``("tensor", example)`` for a scalar state, ``("value", obj)`` otherwise.
    """

    per_element: tuple[str, ...]
    init: tuple[tuple[str, tuple], ...]


def trace_group(group: dict) -> dict:
    """The group as the trace sees it: the single-tensor implementation."""
    return {**group, **{k: v for k, v in _IMPL_FLAGS.items() if k in group}}


class _RecordingState(dict):
    """A state dict that remembers the first value stored under each key (the stock initial state)."""

    def __init__(self) -> None:
        super().__init__()
        self.initial: dict[str, Any] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self.initial:
            self.initial[key] = value.clone() if isinstance(value, torch.Tensor) else value
        super().__setitem__(key, value)


_schemas: dict[tuple, StateSchema] = {}


def probe_schema(opt: torch.optim.Optimizer, group: dict, param: torch.Tensor) -> StateSchema:
    """Run the stock step once on a 2-element copy-free probe to learn the state layout."""
    key = (type(opt), static_group_items(trace_group(group)), param.dtype, param.device.type)
    cached = _schemas.get(key)
    if cached is not None:
        return cached
    probe = torch.tensor([1.5, -2.5], dtype=param.dtype, device=param.device)
    probe.grad = torch.tensor([0.25, -0.5], dtype=param.dtype, device=param.device)
    shell = shell_optimizer(opt, trace_group(group), probe, {})
    shell.state = collections.defaultdict(_RecordingState)
    with torch.no_grad():
        unhooked_step(type(opt))(shell)
    recorded = shell.state[probe].initial
    per_element, init = [], []
    for name, value in recorded.items():
        if isinstance(value, torch.Tensor) and value.shape == probe.shape:
            if not torch.all(value == value[0]):
                raise NotImplementedError(
                    f"{type(opt).__name__} initializes state {name!r} from the parameter's values; "
                    "lowbit-compile supports per-element states that start from a constant"
                )
            per_element.append(name)
            init.append((name, ("fill", value[0].item(), value.dtype)))
        elif isinstance(value, torch.Tensor):
            init.append((name, ("tensor", value)))
        else:
            init.append((name, ("value", value)))
    schema = StateSchema(tuple(per_element), tuple(init))
    _schemas[key] = schema
    return schema


def init_state(param: torch.Tensor, schema: StateSchema, formats: dict[str, StateFormat]) -> dict:
    """The stock initial state of ``param`` with per-element states created directly quantized
    (of the local shard, inside a ``DTensor`` like the parameter, for a sharded parameter)."""
    state: dict[str, Any] = {}
    for name, (kind, *rest) in schema.init:
        if kind == "fill":
            value, dtype = rest
            fmt = formats[name]
            if fmt.passthrough:
                state[name] = torch.full_like(param, value, dtype=dtype, memory_format=torch.preserve_format)
            else:
                shard = sharding.local(param)
                state[name] = sharding.like(QuantizedState.full(shard.shape, value, fmt, dtype, shard.device), param)
        elif kind == "tensor":
            state[name] = rest[0].clone()
        else:
            state[name] = rest[0]
    return state


@dataclass
class CompiledStep:
    """One signature's rewritten step and how to bind a parameter's tensors to its inputs."""

    run: Callable[..., None]
    inputs: tuple[tuple[str, Any], ...]
    guard: Callable
    graph: torch.fx.GraphModule


_compiled: dict[tuple, list[CompiledStep]] = {}


def compile_step(opt: torch.optim.Optimizer, group: dict, param: torch.Tensor, state: dict,
                 schema: StateSchema, formats: dict[str, StateFormat], config: Config) -> CompiledStep:
    """Trace, rewrite and lower the step for this parameter's signature (cached)."""
    tgroup = trace_group(group)
    slots = hyper_slots(tgroup)
    key = (
        type(opt), unhooked_step(type(opt)), static_group_items(tgroup),
        tuple((s, tensor_meta(s.get(tgroup)) if s.is_tensor else None) for s in slots),
        param.dtype, param.device.type,
        # per-element states by dtype only: the trace is 1-D and elementwise, so one serves every shape
        tuple((k, (v.dtype, v.device.type) if k in schema.per_element else tensor_meta(v))
              if isinstance(v, torch.Tensor) else (k, type(v)) for k, v in sorted(state.items())),
        tuple(sorted((k, f.tag()) for k, f in formats.items())), resolve(config.backend, param.device.type),
    )
    values = [s.get(tgroup) for s in slots]
    candidates = _compiled.setdefault(key, [])
    for compiled in candidates:
        if compiled.guard(values):
            return compiled
    traced = trace_for(opt, group, param, state, schema)
    graph = split_prologue(quantize_states(label_roles(traced.graph), formats))
    inputs = tuple(_binding(n) for n in graph.graph.nodes if n.op == "placeholder")
    compiled = CompiledStep(lower(graph, key[-1]), inputs, traced.guard, graph)
    candidates.append(compiled)
    return compiled


def trace_for(opt: torch.optim.Optimizer, group: dict, param: torch.Tensor, state: dict,
              schema: StateSchema) -> TracedStep:
    """Trace the stock step of ``param`` in ``group``; quantized states stand for tensors of their
    stock dtype, so the traced graph is the stock one whatever the formats."""
    example = {k: (torch.empty(0, dtype=v.dtype, device=v.device) if isinstance(v, QuantizedState) else v)
               for k, v in state.items()}
    return trace_step(opt, trace_group(group), param.dtype, param.device, example, schema.per_element)


def _flat(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A 1-D view of ``t`` in logical order, or a contiguous copy (then it must be written back)."""
    if t.is_contiguous():
        return t.view(-1), False
    return t.reshape(-1).clone(), True


def bind_param(compiled: CompiledStep, group: dict, param: torch.Tensor, grad: torch.Tensor,
               state: dict) -> tuple[list, list]:
    """The compiled step's inputs for ``param``, and the (tensor, flat copy) pairs to write back after
    the run. A sharded (``DTensor``) parameter steps its local shard: the update is elementwise, so
    shards step independently."""
    param, grad = sharding.local(param), sharding.local(grad)
    state = {k: sharding.local(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    write_back = []
    args = []
    for kind, key in compiled.inputs:
        if kind in ("param", "per_element_state"):
            tensor = param if kind == "param" else state[key]
            flat, copied = _flat(tensor)
            if copied:
                write_back.append((tensor, flat))
            args.append(flat)
        elif kind == "grad":
            args.append(grad.reshape(-1))
        elif kind == "scalar_state":
            args.append(state[key])
        elif kind == "state_part":
            args.append(getattr(state[key[0]], key[1]))
        else:
            args.append(key.get(group))
    return args, write_back


def run_params(items: list[tuple[Prepared, dict, torch.Tensor, torch.Tensor, dict]]) -> None:
    """Run the step of every (prepared, group, param, grad, state). Parameters of one group that share
    a compiled step go to its lowering in one call when it can take several (``run_many``): many
    small tensors (biases, norms) then cost one kernel launch, not one each."""
    buckets: dict[tuple[int, int], list] = {}
    for item in items:
        buckets.setdefault((id(item[0].compiled), id(item[1])), []).append(item)
    for bucket in buckets.values():
        compiled = bucket[0][0].compiled
        run_many = getattr(compiled.run, "run_many", None)
        rows, write_back = [], []
        for prepared, *rest in bucket:
            args, wb = prepared.bind(*rest)
            rows.append(args)
            write_back += wb
        if run_many is None:
            for args in rows:
                compiled.run(*args)
        elif getattr(compiled.run, "takes_memos", False):  # it re-checks only the inputs that changed
            run_many(rows, [prepared.memo for prepared, *_ in bucket])
        else:
            run_many(rows)
        for dst, flat in write_back:
            dst.copy_(flat.view(dst.shape))


def group_signature(group: dict) -> tuple[tuple, list]:
    """What of a param group a prepared step depends on (its flags, which hyperparameters are
    tensors), and the hyperparameter values its guards are checked on. Computed once per group and
    step."""
    tgroup = trace_group(group)
    slots = hyper_slots(tgroup)
    meta = tuple((s, tensor_meta(s.get(tgroup)) if s.is_tensor else None) for s in slots)
    sig = (static_group_items(tgroup), meta)
    return _signatures.setdefault(sig, sig), [s.get(tgroup) for s in slots]


_signatures: dict[tuple, tuple] = {}  # one object per distinct group signature: compared by identity


@dataclass
class Prepared:
    """One parameter's compiled step and state as the last full preparation found them. Reused while
    the config, the group's signature, the guard, the param's storage and every state entry are
    still the same objects, so a steady step costs a few attribute checks per parameter."""

    compiled: CompiledStep
    state: dict
    entries: tuple
    param_meta: tuple
    config: Config
    group_sig: tuple
    bound: list | None = None  # the step's inputs as last bound (when no copy needs writing back)
    memo: dict = field(default_factory=dict)  # the lowering's checks of those inputs
    refresh: tuple = ()  # which of them change between steps: (index, kind, key) of grad and hyperparameters

    @staticmethod
    def make(compiled: CompiledStep, state: dict, param: torch.Tensor, config: Config,
             group_sig: tuple) -> Prepared:
        return Prepared(compiled, state, tuple(state.items()), _param_meta(param), config, group_sig)

    def still_valid(self, state: dict, param: torch.Tensor, config: Config, group_sig: tuple,
                    guards: dict[int, bool], values: list) -> bool:
        if state is not self.state or config is not self.config or group_sig is not self.group_sig:
            return False
        if len(state) != len(self.entries) or any(state.get(k) is not v for k, v in self.entries):
            return False
        if _param_meta(param) != self.param_meta:
            return False
        ok = guards.get(id(self.compiled))
        if ok is None:
            ok = guards[id(self.compiled)] = bool(self.compiled.guard(values))
        return ok


    def bind(self, group: dict, param: torch.Tensor, grad: torch.Tensor, state: dict) -> tuple[list, list]:
        """``bind_param``, once: later steps only refresh the grad and hyperparameter inputs (the param,
        state and storage views stay valid while ``still_valid`` holds)."""
        if self.bound is None:
            args, write_back = bind_param(self.compiled, group, param, grad, state)
            if write_back:
                return args, write_back
            self.bound = args
            self.refresh = tuple((i, kind, key) for i, (kind, key) in enumerate(self.compiled.inputs)
                                 if kind in ("grad", "hyper"))
            return args, []
        args = self.bound
        for i, kind, key in self.refresh:
            args[i] = sharding.local(grad).reshape(-1) if kind == "grad" else key.get(group)
        return args, []


def _param_meta(param: torch.Tensor) -> tuple:
    return (param.dtype, param.shape, param.device, sharding.local(param).data_ptr(), type(param))


def _binding(node: torch.fx.Node) -> tuple[str, Any]:
    """How the runner finds the value of one top-level input of a compiled step."""
    role, desc = node.meta["role"], node.meta["lowbit_input"]
    if role in ("param", "grad"):
        return role, None
    if role in ("per_element_state", "scalar_state"):
        return role, desc[1]
    if role == "state_part":
        return role, (desc[1], desc[2])
    return "hyper", desc[1]
