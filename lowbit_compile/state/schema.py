"""What a stock optimizer keeps per parameter, learned by stepping small probe parameters, and the
initial state built from it (per-element states created directly in their low-bit format)."""

from __future__ import annotations

import collections
import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..formats import StateFormat
from ..param_groups import is_real_number
from ..passes.roles import NotElementwiseError, label_roles
from ..passes.signs import prove_nonneg
from ..passes.trace import (
    Layout,
    TracedStep,
    hyper_slots,
    shell_optimizer,
    static_group_items,
    tensor_meta,
    unhooked_step,
)
from ..passes.trace_cache import TRACE_LOCK, LruCache, trace_group, traced
from . import sharding
from .quantized import QuantizedState


# How the stock step creates each state (``StateSchema.init``): one record per way, its tag first (so an
# entry still reads as the tagged tuple it was: ``("fill", value, dtype)``, ...).
class Fill(NamedTuple):
    """A per-element state the stock step starts from a constant."""

    kind: str = "fill"
    value: float = 0.0
    dtype: torch.dtype = torch.float32


class Computed(NamedTuple):
    """A per-element state the first stock step computes (SGD's ``momentum_buffer = grad.clone()``)."""

    kind: str = "computed"
    dtype: torch.dtype = torch.float32


class Reduced(NamedTuple):
    """A state reduced over some dimensions of the parameter (Adafactor's row and column factors: the
    parameter's size where ``kept``, else 1), started from a constant, kept in its stock storage."""

    kind: str = "reduced"
    kept: tuple[bool, ...] = ()
    value: float = 0.0
    dtype: torch.dtype = torch.float32


class Scalar(NamedTuple):
    """A scalar state (``step``), a tensor: its first value."""

    kind: str = "tensor"
    example: torch.Tensor | None = None


class Plain(NamedTuple):
    """Any other state: its first value."""

    kind: str = "value"
    value: Any = None


InitEntry = Fill | Computed | Reduced | Scalar | Plain


@dataclass(frozen=True)
class StateSchema:
    """What the stock optimizer keeps per parameter, learned by stepping tiny probe parameters.

    ``init`` maps each state key to how the stock step creates it (:data:`InitEntry`): :class:`Fill`,
    :class:`Computed`, :class:`Reduced`, :class:`Scalar` or :class:`Plain`. ``nonneg``: the per-element
    states proven never negative.
    ``shaped``: the step treats a parameter by its shape, not as its flat values (Muon's orthogonalized
    update), so it is traced at each parameter's shape and run in stages (``passes.stages``).
    """

    per_element: tuple[str, ...]
    init: tuple[tuple[str, InitEntry], ...]
    nonneg: frozenset[str] = frozenset()
    shaped: bool = False

    @property
    def dtypes(self) -> dict[str, torch.dtype]:
        """The dtype the stock step creates each per-element state in."""
        return {name: entry.dtype for name, entry in self.init if isinstance(entry, (Fill, Computed))}

    def read_saved(self, entry: Mapping[str, Any], shape: Sequence[int], optimizer: str,
                   counters: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """The scalar states of a saved entry as the stock step keeps them (a tensor of another dtype or
        shape than its own, as the step's: ``step`` saved as an int64 tensor), after refusing
        (``ValueError`` naming the state) an entry the step could not run on: one that holds any state
        (``counters`` aside) but lacks one the stock step keeps, or whose scalar state is not one real
        number (a finite count >= 0 for ``step``), whose reduced state (Adafactor's factors) is not a
        floating tensor of the reduced shape, or whose plain value is of another kind than the stock one's."""
        if not entry.keys() - set(counters):
            return {}
        missing = [name for name, _ in self.init if name not in entry]
        if missing:
            raise ValueError(f"its saved state lacks {missing} ({optimizer} keeps {sorted(n for n, _ in self.init)} "
                             "once a parameter has stepped); the checkpoint is truncated or of another optimizer")
        out = {}
        for name, init in self.init:
            value = entry[name]
            if isinstance(init, Scalar) and name == "step":  # a count: a negative one divides by zero (1 - beta ** 0)
                ok = is_real_number(value) and 0 <= float(value) < math.inf
                want = "a count of steps, a number >= 0"
            elif isinstance(init, Scalar):
                ok = is_real_number(value)
                want = "one real number"
            elif isinstance(init, Reduced):
                want_shape = _reduced_shape(shape, init.kept)
                ok = (isinstance(value, torch.Tensor) and value.is_floating_point()
                      and tuple(value.shape) == want_shape)
                want = f"a floating-point tensor of shape {want_shape}"
            elif isinstance(init, Plain) and is_real_number(init.value):
                ok, want = is_real_number(value), "one real number"
            else:
                continue
            if not ok:
                got = (f"a {value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                       else f"a {type(value).__name__}")
                raise ValueError(f"its saved state {name!r} is {got}, not {want}; the checkpoint is corrupt or of "
                                 "another optimizer")
            example = init.example if isinstance(init, Scalar) else None
            if isinstance(value, torch.Tensor) and example is not None and (
                    value.dtype != example.dtype or value.shape != example.shape):
                out[name] = value.detach().to(example.dtype).reshape(example.shape)
        return out

    def trace_shape(self, param: torch.Tensor) -> Layout | None:
        """The shape ``param``'s step is traced at: its own (with its strides; a ``DTensor``'s global
        one) for a shaped step, None (1-D) otherwise."""
        return Layout.of(param) if self.shaped else None


class _RecordingState(dict):
    """A state dict that remembers the first value stored under each key (the stock initial state)."""

    def __init__(self) -> None:
        super().__init__()
        self.initial: dict[str, Any] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self.initial:
            self.initial[key] = value.clone() if isinstance(value, torch.Tensor) else value
        super().__setitem__(key, value)


_schemas: LruCache = LruCache()  # schemas depend on hyperparameter values (ASGD's eta starts at lr)


def probe_schema(opt: torch.optim.Optimizer, group: dict, param: torch.Tensor) -> StateSchema:
    """Learn the state layout of ``param`` in ``group`` by running the stock step on small probes.

    Each probe runs two stock steps on a few elements. A state entry shaped like the probe is
    per-element; it starts from a constant (``"fill"``) when that constant is the same for two
    probes with different values, otherwise the first traced step computes it (``"computed"``).
    A probe shaped like ``param`` (2-D, 4-D...) that steps differently from the same values laid out
    flat (or that the stock step refuses flat: Muon takes matrices only) makes the step *shaped*: it
    is probed at that shape, traced at each parameter's shape and split into elementwise and
    non-elementwise stages. Which per-element states are never negative is proven on the traced step
    (``passes.signs``).
    """
    tgroup = trace_group(group)
    slots = hyper_slots(tgroup)
    key = (type(opt), unhooked_step(type(opt)), static_group_items(tgroup, slots, unhooked_step(type(opt))),
           param.dtype, param.device.type,
           param.dim(), tuple(_value_key(s.get(tgroup)) for s in slots))
    with TRACE_LOCK:
        cached = _schemas.get(key)
        return cached if cached is not None else _schemas.setdefault(key, _probe_schema(opt, tgroup, param))


def _probe_schema(opt: torch.optim.Optimizer, tgroup: dict, param: torch.Tensor) -> StateSchema:
    shape = _probe_shape(param.dim())
    n = math.prod(shape)
    shaped = param.dim() != 1 and _steps_by_shape(opt, tgroup, param, shape)
    probed = shape if shaped else (n,)  # a per-element state is shaped like the probe
    flat = _probe(opt, tgroup, param, probed, offset=0.0)
    other = _probe(opt, tgroup, param, probed, offset=0.625)
    per_element, init = [], []
    for name, value in flat.initial.items():
        again = other.initial.get(name)
        if isinstance(value, torch.Tensor) and value.shape == probed:
            per_element.append(name)
            first = value.reshape(-1)[0]
            if torch.all(value == first) and _same(value, again):
                init.append((name, Fill(value=first.item(), dtype=value.dtype)))
            else:
                init.append((name, Computed(dtype=value.dtype)))
        elif (kept := _reduced_dims(value, probed)) is not None:
            first = value.reshape(-1)[0]
            if not (torch.all(value == first) and _same(value, again)):
                raise NotElementwiseError(
                    f"{type(opt).__name__} starts its state {name!r}, reduced over the parameter's dimensions, "
                    "from the parameter's or the gradient's values; lowbit-compile starts such states from a "
                    "constant only")
            init.append((name, Reduced(kept=kept, value=first.item(), dtype=value.dtype)))
        elif not _same(value, again):
            raise NotElementwiseError(
                f"{type(opt).__name__} starts its state {name!r} from the parameter's or the gradient's "
                "values as a whole; lowbit-compile only rewrites steps that are elementwise over each parameter")
        else:
            init.append((name, Scalar(example=value) if isinstance(value, torch.Tensor) else Plain(value=value)))
    try:
        nonneg = _infer_nonneg(opt, tgroup, param, tuple(per_element), init, flat.after_first,
                               shape if shaped else None)
    except NotElementwiseError:  # a norm or a sum over the flat values (their order does not matter)
        if shaped:
            raise
        shaped = True
        nonneg = _infer_nonneg(opt, tgroup, param, tuple(per_element), init, flat.after_first, shape)
    return StateSchema(tuple(per_element), tuple(init), nonneg, shaped)


def _reduced_dims(value: object, shape: tuple[int, ...]) -> tuple[bool, ...] | None:
    """For a state ``value`` of a parameter of ``shape`` (no dimension of 1) that is the parameter
    reduced over some of its dimensions (size 1 there, the parameter's elsewhere): which it keeps."""
    if not isinstance(value, torch.Tensor) or value.dim() != len(shape) or tuple(value.shape) == shape:
        return None
    if any(v not in (s, 1) for v, s in zip(value.shape, shape)):
        return None
    return tuple(v == s for v, s in zip(value.shape, shape))


def _reduced_shape(shape: Sequence[int], kept: tuple[bool, ...]) -> tuple[int, ...]:
    """The shape of a state of a parameter of ``shape`` reduced over the dimensions not ``kept``."""
    return tuple(s if k else 1 for s, k in zip(shape, kept))


def _steps_by_shape(opt: torch.optim.Optimizer, tgroup: dict, param: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """Whether the stock step treats a parameter of ``shape`` other than its values laid out flat
    (or refuses them flat)."""
    n = math.prod(shape)
    shaped = _probe(opt, tgroup, param, shape, offset=0.0)
    try:
        flat = _probe(opt, tgroup, param, (n,), offset=0.0)
        _check_same_as_flat(opt, shaped, flat, n)
    except (NotElementwiseError, ValueError, RuntimeError):
        return True
    return False


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
    for key, value in _constructed_state(opt, tgroup, probe).items():
        shell.state[probe][key] = value
    snapshots = []
    with torch.no_grad():
        for grad in (values(0.125, 0.25), values(-0.375, 0.5)):
            probe.grad = grad
            unhooked_step(type(opt))(shell)
            state = shell.state[probe]
            snapshots.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
    return _ProbeRun(shell.state[probe].initial, snapshots[0], snapshots[1], probe)


def _constructed_state(opt: torch.optim.Optimizer, tgroup: dict, param: torch.Tensor) -> dict[str, Any]:
    """The state the constructor of the ``torch.optim`` class ``opt`` derives from gives ``param``:
    torch <= 2.11's Adagrad fills ``sum`` and ``step`` there, not on the first step (empty for most)."""
    stock = next((c for c in type(opt).__mro__ if c.__module__.startswith("torch.optim.")
                  and c is not torch.optim.Optimizer), None)
    if stock is None:
        return {}
    keywords = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = {name for name, p in list(inspect.signature(stock.__init__).parameters.items())[1:]
                if p.kind in keywords and name != "params"}  # never self: a group may hold any key
    fresh = stock([param], **{k: v for k, v in tgroup.items() if k in accepted})
    return dict(fresh.state.get(param, {}))


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
                  init: list, after_first: dict[str, Any], shape: tuple[int, ...] | None) -> frozenset[str]:
    """The per-element states that every traced step keeps >= 0 (and that start >= 0): the first
    step's graph and, when the first step creates states, the graph of the steps after it."""
    first = {}
    for name, entry in init:
        if isinstance(entry, Fill):
            first[name] = torch.empty(0, dtype=entry.dtype, device=param.device)
        elif isinstance(entry, Reduced):
            first[name] = torch.full(_reduced_shape(shape, entry.kept), entry.value, dtype=entry.dtype,
                                     device=param.device)
        elif isinstance(entry, Scalar):
            first[name] = entry.example
        elif isinstance(entry, Plain):
            first[name] = entry.value
    examples = [first]
    if any(isinstance(entry, Computed) for _, entry in init):
        examples.append({k: (torch.empty(0, dtype=v.dtype, device=param.device) if k in per_element else v)
                         for k, v in after_first.items()})
    values = {s: s.get(tgroup) for s in hyper_slots(tgroup)}
    proven = {k for k, entry in init if k in per_element and (not isinstance(entry, Fill) or entry.value >= 0)}
    for example in examples:
        trace = traced(opt, tgroup, param.dtype, param.device, example, per_element, shape=shape)
        proven &= prove_nonneg(label_roles(trace.graph, staged=shape is not None), values).states
    return frozenset(proven)


def init_state(param: torch.Tensor, schema: StateSchema, formats: dict[str, StateFormat]) -> dict:
    """The stock initial state of ``param`` with per-element states created directly quantized
    (of the local shard, inside a ``DTensor`` like the parameter, for a sharded parameter)."""
    state: dict[str, Any] = {}
    for name, entry in schema.init:
        if isinstance(entry, Fill):
            state[name] = filled(param, entry.value, formats[name], entry.dtype)
        elif isinstance(entry, Reduced):
            state[name] = torch.full(_reduced_shape(param.shape, entry.kept), entry.value, dtype=entry.dtype,
                                     device=param.device)
        elif isinstance(entry, Scalar):
            state[name] = entry.example.clone()
        elif isinstance(entry, Plain):
            state[name] = entry.value
    return state


def filled(param: torch.Tensor, value: float, fmt: StateFormat, dtype: torch.dtype) -> torch.Tensor:
    """A per-element state of ``param`` full of ``value``, in ``fmt``."""
    if fmt.passthrough:
        return torch.full_like(param, value, dtype=dtype, memory_format=torch.preserve_format)
    shard = sharding.local(param)
    return sharding.like(QuantizedState.full(shard.shape, value, fmt, dtype, shard.device), param)




def example_state(state: dict, schema: StateSchema, param: torch.Tensor) -> dict:
    """The state a parameter will have when its next step runs, as the trace needs it, without
    creating or converting any: per-element states as empty tensors of their stock dtype (whatever
    holds them now: a quantized state, a packed one a loader left, a stock tensor), the other entries
    as they are; for an empty state, the schema's initial one."""
    device = param.device
    dtypes = schema.dtypes
    if state:
        return {k: torch.empty(0, dtype=dtypes[k], device=device) if k in dtypes else v for k, v in state.items()}
    example: dict[str, Any] = {}
    for name, entry in schema.init:
        if isinstance(entry, Fill):
            example[name] = torch.empty(0, dtype=entry.dtype, device=device)
        elif isinstance(entry, Reduced):
            example[name] = torch.full(_reduced_shape(param.shape, entry.kept), entry.value, dtype=entry.dtype,
                                       device=device)
        elif isinstance(entry, Scalar):
            example[name] = entry.example
        elif isinstance(entry, Plain):
            example[name] = entry.value
    return example


def trace_for(opt: torch.optim.Optimizer, group: dict, param: torch.Tensor, state: dict,
              per_element: tuple[str, ...], shape: Layout | None = None) -> TracedStep:
    """The traced stock step of ``param`` in ``group`` with this state (cached; at ``shape`` for a shaped
    step): quantized states stand for empty tensors of their stock dtype (the traced graph is the stock
    one, whatever the formats)."""
    example = {k: (torch.empty(0, dtype=v.dtype, device=v.device) if isinstance(v, QuantizedState) else v)
               for k, v in state.items()}
    return traced(opt, trace_group(group), param.dtype, param.device, example, per_element, shape=shape)
