"""The wrapped ``step()``: per parameter, find the compiled step for its signature and run it.

A signature is everything a trace depends on: optimizer class, the group's static flags, which
hyperparameters are tensors, param dtype and device type, the state schema and the state formats.
Compiled steps are cached per process across optimizers; hyperparameter values are read from
``param_groups`` on every call, so schedulers never cause a retrace.
"""

from __future__ import annotations

import collections
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import sharding
from .config import Config
from .kernels.backends import lower, resolve
from .kernels.formats import StateFormat
from .passes.quantize_states import quantize_states
from .passes.roles import NotElementwiseError, label_roles
from .passes.signs import NonnegProof, prove_nonneg
from .passes.split import split_prologue
from .passes.trace import (
    BranchFlipped,
    HyperSlot,
    TracedStep,
    check_branch,
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
    """What the stock optimizer keeps per parameter, learned by stepping tiny probe parameters.

    ``init`` maps each state key to how the stock step creates it: ``("fill", value, dtype)`` for
    a per-element state that starts from a constant, ``("computed", dtype)`` for one the first step
    computes (SGD's ``momentum_buffer = grad.clone()``), ``("tensor", example)`` for a scalar state,
    ``("value", obj)`` otherwise. ``nonneg``: the per-element states proven never negative.
    """

    per_element: tuple[str, ...]
    init: tuple[tuple[str, tuple], ...]
    nonneg: frozenset[str] = frozenset()


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


_schemas: collections.OrderedDict[tuple, StateSchema] = collections.OrderedDict()
_SCHEMA_CACHE = 256  # schemas depend on hyperparameter values (ASGD's eta starts at lr): keep the recent ones


def probe_schema(opt: torch.optim.Optimizer, group: dict, param: torch.Tensor) -> StateSchema:
    """Learn the state layout of ``param`` in ``group`` by running the stock step on small probes.

    Each probe runs two stock steps on a few elements. A state entry shaped like the probe is
    per-element; it starts from a constant (``"fill"``) when that constant is the same for two
    probes with different values, otherwise the first traced step computes it (``"computed"``).
    A probe shaped like ``param`` (2-D, 4-D...) must step exactly like the same values laid out
    flat, or the step is not elementwise (a factored second moment, an orthogonalized update).
    Which per-element states are never negative is proven on the traced step (``passes.signs``).
    """
    tgroup = trace_group(group)
    slots = hyper_slots(tgroup)
    key = (type(opt), unhooked_step(type(opt)), static_group_items(tgroup), param.dtype, param.device.type,
           param.dim(), tuple(_value_key(s.get(tgroup)) for s in slots))
    cached = _schemas.get(key)
    if cached is not None:
        _schemas.move_to_end(key)
        return cached
    n = math.prod(_probe_shape(param.dim()))
    flat = _probe(opt, tgroup, param, (n,), offset=0.0)
    other = _probe(opt, tgroup, param, (n,), offset=0.625)
    if param.dim() != 1:
        _check_same_as_flat(opt, _probe(opt, tgroup, param, _probe_shape(param.dim()), offset=0.0), flat, n)
    per_element, init = [], []
    for name, value in flat.initial.items():
        again = other.initial.get(name)
        if isinstance(value, torch.Tensor) and value.shape == (n,):
            per_element.append(name)
            if torch.all(value == value[0]) and _same(value, again):
                init.append((name, ("fill", value[0].item(), value.dtype)))
            else:
                init.append((name, ("computed", value.dtype)))
        elif not _same(value, again):
            raise NotElementwiseError(
                f"{type(opt).__name__} starts its state {name!r} from the parameter's or the gradient's "
                "values as a whole; lowbit-compile only rewrites steps that are elementwise over each parameter")
        else:
            init.append((name, ("tensor", value) if isinstance(value, torch.Tensor) else ("value", value)))
    nonneg = _infer_nonneg(opt, tgroup, param, tuple(per_element), init, flat.after_first)
    schema = StateSchema(tuple(per_element), tuple(init), nonneg)
    _schemas[key] = schema
    if len(_schemas) > _SCHEMA_CACHE:
        _schemas.popitem(last=False)
    return schema


def _value_key(value: object) -> object:
    """A hyperparameter value as a cache key: a tensor by identity and version (no device sync)."""
    if isinstance(value, torch.Tensor):
        return (id(value), value._version, tensor_meta(value))
    return value


def _probe_shape(ndim: int) -> tuple[int, ...]:
    return ((3, 2) + (2,) * (ndim - 2))[:ndim] if ndim != 1 else (3,)


@dataclass
class _ProbeRun:
    initial: dict[str, Any]  # the first value stored under each state key
    after_first: dict[str, Any]  # the state after one step
    after_second: dict[str, Any]  # the state after two steps
    param: torch.Tensor  # the param after two steps


def _probe(opt: torch.optim.Optimizer, tgroup: dict, param: torch.Tensor, shape: tuple[int, ...],
           offset: float) -> _ProbeRun:
    """Two stock steps of a small parameter of ``shape`` (values shifted by ``offset``)."""
    n = math.prod(shape)

    def values(scale: float, shift: float) -> torch.Tensor:
        x = (torch.arange(n, dtype=torch.float64) * scale + shift + offset) * (-1) ** torch.arange(n)
        return x.to(param.dtype).to(param.device).reshape(shape)

    probe = values(0.75, 1.5)
    shell = shell_optimizer(opt, tgroup, probe, {})
    shell.state = collections.defaultdict(_RecordingState)
    snapshots = []
    with torch.no_grad():
        for grad in (values(0.125, 0.25), values(-0.375, 0.5)):
            probe.grad = grad
            unhooked_step(type(opt))(shell)
            state = shell.state[probe]
            snapshots.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
    return _ProbeRun(shell.state[probe].initial, snapshots[0], snapshots[1], probe)


def _same(a: object, b: object) -> bool:
    """Equal values (NaN equal to NaN), for tensors of equal shape and dtype too."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.all((a == b) | (a.isnan() & b.isnan()))))
    return a == b or (a != a and b != b)


def _check_same_as_flat(opt: torch.optim.Optimizer, shaped: _ProbeRun, flat: _ProbeRun, n: int) -> None:
    """Refuse a step that treats a parameter of this many dimensions other than its flat values."""
    why = None
    if shaped.after_second.keys() != flat.after_second.keys():
        why = f"keeps states {sorted(shaped.after_second)} instead of {sorted(flat.after_second)}"
    elif not _same(shaped.param.reshape(-1), flat.param):
        why = "updates it differently"
    for key, value in shaped.after_second.items() if why is None else ():
        ref = flat.after_second[key]
        if isinstance(value, torch.Tensor) and isinstance(ref, torch.Tensor) and ref.shape == (n,):
            value = value.reshape(-1) if value.numel() == n else value
        if not _same(value, ref):
            why = f"keeps its state {key!r} differently (shape {tuple(getattr(value, 'shape', ()))})"
            break
    if why is not None:
        raise NotElementwiseError(
            f"{type(opt).__name__} steps a {shaped.param.dim()}-D parameter differently from the same values "
            f"laid out flat: it {why}; lowbit-compile only rewrites steps that are elementwise over each "
            "parameter (no factored or orthogonalized updates)")


def _infer_nonneg(opt: torch.optim.Optimizer, tgroup: dict, param: torch.Tensor, per_element: tuple[str, ...],
                  init: list, after_first: dict[str, Any]) -> frozenset[str]:
    """The per-element states that every traced step keeps >= 0 (and that start >= 0): the first
    step's graph and, when the first step creates states, the graph of the steps after it."""
    first = {}
    for name, (kind, *rest) in init:
        if kind == "fill":
            first[name] = torch.empty(0, dtype=rest[1], device=param.device)
        elif kind == "tensor":
            first[name] = rest[0]
        elif kind == "value":
            first[name] = rest[0]
    examples = [first]
    if any(kind == "computed" for _, (kind, *_) in init):
        examples.append({k: (torch.empty(0, dtype=v.dtype, device=param.device) if k in per_element else v)
                         for k, v in after_first.items()})
    values = {s.name: s.get(tgroup) for s in hyper_slots(tgroup)}
    proven = {k for k, (kind, *rest) in init if k in per_element and (kind != "fill" or rest[0] >= 0)}
    for example in examples:
        traced = _traced(opt, tgroup, param.dtype, param.device, example, per_element)
        proven &= prove_nonneg(label_roles(traced.graph), values).states
    return frozenset(proven)


def init_state(param: torch.Tensor, schema: StateSchema, formats: dict[str, StateFormat]) -> dict:
    """The stock initial state of ``param`` with per-element states created directly quantized
    (of the local shard, inside a ``DTensor`` like the parameter, for a sharded parameter)."""
    state: dict[str, Any] = {}
    for name, (kind, *rest) in schema.init:
        if kind == "fill":
            value, dtype = rest
            state[name] = _filled(param, value, formats[name], dtype)
        elif kind == "tensor":
            state[name] = rest[0].clone()
        elif kind == "value":
            state[name] = rest[0]
    return state


def _filled(param: torch.Tensor, value: float, fmt: StateFormat, dtype: torch.dtype) -> torch.Tensor:
    """A per-element state of ``param`` full of ``value``, in ``fmt``."""
    if fmt.passthrough:
        return torch.full_like(param, value, dtype=dtype, memory_format=torch.preserve_format)
    shard = sharding.local(param)
    return sharding.like(QuantizedState.full(shard.shape, value, fmt, dtype, shard.device), param)


@dataclass
class CompiledStep:
    """One signature's rewritten step and how to bind a parameter's tensors to its inputs.

    ``fresh`` lists the per-element states the step creates, with their format and dtype: the
    runner allocates them (unwritten) before the first run, which writes them."""

    run: Callable[..., None]
    inputs: tuple[tuple[str, Any], ...]
    guard: Callable
    graph: torch.fx.GraphModule
    fresh: tuple[tuple[str, StateFormat, torch.dtype], ...] = ()


_compiled: dict[tuple, list[CompiledStep]] = {}
_traces: dict[tuple, list[TracedStep]] = {}


def compile_step(opt: torch.optim.Optimizer, group: dict, param: torch.Tensor, state: dict,
                 schema: StateSchema, formats: dict[str, StateFormat], config: Config) -> CompiledStep:
    """Trace, rewrite and lower the step for this parameter's signature (cached)."""
    tgroup = trace_group(group)
    slots = hyper_slots(tgroup)
    example = _trace_example(state)
    backend = resolve(config.backend, param.device.type)
    key = (_trace_key(opt, tgroup, slots, param.dtype, param.device, example, schema.per_element),
           tuple(sorted((k, f.tag()) for k, f in formats.items())), backend)
    values = [s.get(tgroup) for s in slots]
    candidates = _compiled.setdefault(key, [])
    for compiled in candidates:
        if compiled.guard(values):
            return compiled
    builder = _Builder(_skeleton(opt), tgroup, slots, param.dtype, param.device, example, schema, formats, backend)
    compiled = builder.compile(values)
    candidates.append(compiled)
    return compiled


def trace_for(opt: torch.optim.Optimizer, group: dict, param: torch.Tensor, state: dict,
              schema: StateSchema) -> TracedStep:
    """The traced stock step of ``param`` in ``group`` (cached); quantized states stand for tensors
    of their stock dtype, so the traced graph is the stock one whatever the formats."""
    return _traced(opt, trace_group(group), param.dtype, param.device, _trace_example(state), schema.per_element)


def _trace_example(state: dict) -> dict:
    return {k: (torch.empty(0, dtype=v.dtype, device=v.device) if isinstance(v, QuantizedState) else v)
            for k, v in state.items()}


def _trace_key(opt: torch.optim.Optimizer, tgroup: dict, slots: tuple[HyperSlot, ...], dtype: torch.dtype,
               device: torch.device, example: dict, per_element: tuple[str, ...]) -> tuple:
    """Everything a trace depends on but the hyperparameter values (which its guard checks)."""
    return (
        type(opt), unhooked_step(type(opt)), static_group_items(tgroup),
        tuple((s, tensor_meta(s.get(tgroup)) if s.is_tensor else None) for s in slots),
        dtype, device.type,
        # per-element states by dtype only: the trace is 1-D and elementwise, so one serves every shape
        tuple((k, (v.dtype, v.device.type) if k in per_element else tensor_meta(v))
              if isinstance(v, torch.Tensor) else (k, type(v)) for k, v in sorted(example.items())),
    )


def _traced(opt: torch.optim.Optimizer, tgroup: dict, dtype: torch.dtype, device: torch.device, example: dict,
            per_element: tuple[str, ...], exclude: frozenset[int] = frozenset()) -> TracedStep:
    """A trace of the step for this example state whose guard holds (not one of ``exclude``, by id),
    shared by every state format; traced now if there is none."""
    slots = hyper_slots(tgroup)
    values = [s.get(tgroup) for s in slots]
    traces = _traces.setdefault(_trace_key(opt, tgroup, slots, dtype, device, example, per_element), [])
    for traced in traces:
        if id(traced) not in exclude and traced.guard(values):
            return traced
    traced = trace_step(opt, tgroup, dtype, device, example, per_element)
    traces.append(traced)
    return traced


def _skeleton(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt`` without its parameters, states and wrapper: what a later retrace needs of it."""
    skeleton = object.__new__(type(opt))
    skeleton.__dict__.update({k: v for k, v in opt.__dict__.items()
                              if k not in ("param_groups", "state", "step", "_lowbit")})
    return skeleton


@dataclass
class _Builder:
    """Rewrites and lowers traces of one signature; a branching step keeps it to trace and lower the
    other way a branch goes, from the inputs of the step that went that way."""

    opt: torch.optim.Optimizer
    tgroup: dict
    slots: tuple[HyperSlot, ...]
    dtype: torch.dtype
    device: torch.device
    example: dict
    schema: StateSchema
    formats: dict[str, StateFormat]
    backend: str

    def compile(self, values: list) -> CompiledStep:
        traced = _traced(self.opt, self.tgroup, self.dtype, self.device, self.example, self.schema.per_element)
        compiled = self.lower(traced, values)
        if any(n.target is check_branch for n in traced.graph.graph.nodes):
            compiled.run = _BranchingRun(self, compiled, traced)
        return compiled

    def lower(self, traced: TracedStep, values: list) -> CompiledStep:
        roles = label_roles(traced.graph)
        guard = traced.guard
        quantized = {k for k, f in self.formats.items() if not f.passthrough}
        if quantized:
            named = {s.name: v for s, v in zip(self.slots, values)}
            proof = prove_nonneg(roles, named)
            unsigned = {k for k in quantized if self.formats[k].nonneg}
            if unsigned - proof.states:
                raise RuntimeError(
                    f"lowbit-compile stores {sorted(unsigned - proof.states)} unsigned (it proved them never "
                    f"negative on the first steps), but this step of {type(self.opt).__name__} with "
                    f"{named} can make them negative; restore() the optimizer and wrap it again")
            if unsigned:
                guard = _and(traced.guard, self.slots, proof)
            for _, states in proof.fragile_roots:
                if quantized & set(states):
                    warnings.warn(
                        f"lowbit-compile: the step of {type(self.opt).__name__} takes a square root of a value "
                        f"computed from {list(states)} that the fp32 step keeps >= 0 only by cancellation; "
                        "the rounding of quantized states can make it negative and the step NaN. Keep these "
                        f"states fp32 (fmt={{..., {', '.join(f'{k!r}: {chr(39)}fp32{chr(39)}' for k in states)}}})",
                        stacklevel=2)
        graph = split_prologue(quantize_states(roles, self.formats))
        inputs = tuple(_binding(n) for n in graph.graph.nodes if n.op == "placeholder")
        dtypes = {k: rest[-1] for k, (kind, *rest) in self.schema.init if kind in ("fill", "computed")}
        fresh = tuple((k, self.formats[k], dtypes[k]) for k in traced.fresh)
        return CompiledStep(lower(graph, self.backend), inputs, guard, graph, fresh)

    def relower(self, args: Sequence[Any], inputs: tuple, exclude: frozenset[int]) -> tuple[TracedStep, CompiledStep]:
        """Trace (or reuse a trace of) the branches the step takes for these inputs, and lower it."""
        tgroup = dict(self.tgroup)
        example = dict(self.example)
        values = []
        for (kind, key), value in zip(inputs, args):
            if kind == "hyper":
                values.append(value)
                if key.index is None:
                    tgroup[key.key] = value
                else:
                    seq = list(tgroup[key.key])
                    seq[key.index] = value
                    tgroup[key.key] = type(self.tgroup[key.key])(seq)
            elif kind == "scalar_state":
                example[key] = value
        traced = _traced(self.opt, tgroup, self.dtype, self.device, example, self.schema.per_element, exclude)
        return traced, self.lower(traced, values)


def _and(guard: Callable, slots: tuple[HyperSlot, ...], proof: NonnegProof) -> Callable:
    """``guard`` and the hyperparameter ranges a non-negativity proof assumed."""
    if not proof.assumptions:
        return guard
    names = [s.name for s in slots]
    return lambda values: guard(values) and proof.holds(dict(zip(names, values)))


class _BranchingRun:
    """The run of a step whose graph checks branches on values it computes (RAdam's ``rho_t > 5``):
    one lowering per way the branches have gone, the one that ran last tried first. A lowering whose
    branch goes the other way raises ``BranchFlipped`` before it writes anything; when none fits,
    the builder traces the branches these inputs take: one trace per branch outcome."""

    def __init__(self, builder: _Builder, first: CompiledStep, traced: TracedStep) -> None:
        self.builder = builder
        self.inputs = first.inputs
        self.hyper_index = [i for i, (kind, _) in enumerate(first.inputs) if kind == "hyper"]
        self.variants = [(first.guard, first.run)]
        self.traced = {id(traced)}

    def __call__(self, *args: Any) -> None:
        self._dispatch(args, lambda run: run(*args))

    def run_many(self, rows: Sequence[Sequence[Any]]) -> None:
        """Several parameters at once where the lowering can (it requires their scalar states to be
        equal); one at a time, each with its own branches, where it cannot."""

        def batch(run: Callable) -> None:
            if not hasattr(run, "run_many"):
                raise _OneAtATime
            run.run_many(rows)

        try:
            self._dispatch(rows[0], batch)
        except _OneAtATime:
            for row in rows:
                self(*row)

    def _dispatch(self, args: Sequence[Any], call: Callable[[Callable], None]) -> None:
        values = [args[i] for i in self.hyper_index]
        for i, (guard, run) in enumerate(self.variants):
            if not guard(values):
                continue
            try:
                call(run)
            except BranchFlipped:
                continue
            if i:
                self.variants.insert(0, self.variants.pop(i))
            return
        traced, compiled = self.builder.relower(args, self.inputs, frozenset(self.traced))
        self.traced.add(id(traced))
        run = _reorder(compiled.run, compiled.inputs, self.inputs)
        self.variants.insert(0, (compiled.guard, run))
        call(run)


class _OneAtATime(Exception):
    """The lowering that fits takes one parameter at a time (raised before it runs anything)."""


def _reorder(run: Callable, inputs: tuple, order: tuple) -> Callable:
    """``run`` taking its inputs in ``order`` (another trace may list the states differently)."""
    if inputs == order:
        return run
    index = [order.index(b) for b in inputs]

    def reordered(*args: Any) -> None:
        run(*(args[i] for i in index))

    if hasattr(run, "run_many"):
        reordered.run_many = lambda rows: run.run_many([[row[i] for i in index] for row in rows])  # type: ignore[attr-defined]
    return reordered


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
    for key, fmt, dtype in compiled.fresh:  # states the step creates: allocated here, written by the run
        if not isinstance(state.get(key), torch.Tensor):
            state[key] = _filled(param, 0.0, fmt, dtype)
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
