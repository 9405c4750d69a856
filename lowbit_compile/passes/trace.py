"""Trace a stock optimizer's own ``step()`` for one parameter into a functional aten FX graph.

The step runs once per *signature* on fake 1-D tensors under ``make_fx`` + functionalization, on a
shallow shell of the user's optimizer (same class, one fake param group), so every flag keeps the
stock semantics. Float hyperparameters enter as symbolic floats and tensor hyperparameters as
tensors: both become graph inputs, and the host arithmetic on them (bias corrections, step sizes)
is recorded as Python-float nodes, so evaluating the graph repeats the stock arithmetic exactly and
an LR schedule never retraces. Branches the step takes on a hyperparameter (``weight_decay != 0``)
become guards that the cache checks on every step.

Values the step reads back from its own tensors (``step_t.item()``, ``mu.item()``) are symbolic
too. When the step branches on one (RAdam's ``rho_t > 5``, ASGD's ``mu != 1``), it is traced again
with them backed by what they are now (one stock step on small real tensors gives them): the
branch is traced the way it goes now and becomes a
:func:`check_branch` node in the graph: it raises :class:`BranchFlipped` when a later step goes the
other way, before anything is written, and the caller traces that branch too.

State the step creates (SGD's ``momentum_buffer = grad.clone()`` on the first step) or replaces by
a new tensor is copied into a state input of the graph, like an in-place update.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..ir.contract import GraphInput, Role, identifier, set_input
from .canonicalize import elementwise_forms

if TYPE_CHECKING:
    import sympy

# The tracing machinery (make_fx, ShapeEnv, sympy, dynamo's sources) is imported when a step is first
# traced, not with lowbit_compile: together they cost seconds and pull in inductor and triton.

TRACE_ELEMENTS = 16  # size of the fake 1-D parameter; the traced body is elementwise, any size runs it
_HINT_ELEMENTS = 2  # size of the real parameter whose step gives the read-back values their hints


class Layout(NamedTuple):
    """The shape and strides a shaped step (Muon's) is traced at, its parameter's own: ATen picks an
    op's CPU loop, and with it a 16-bit op's rounding, by its operands' strides."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of(cls, t: torch.Tensor) -> Layout:
        """``t``'s layout; a dense one as it is, any other as the dense one the runner steps."""
        expected = 1
        for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
            if stride != expected:
                return cls(tuple(t.shape), tuple(torch.empty(t.shape, device="meta").stride()))
            expected *= size
        return cls(tuple(t.shape), tuple(t.stride()))


def _example_param(shape: tuple[int, ...] | Layout, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized param of ``shape`` (a plain one contiguous), for a trace or its hints."""
    if isinstance(shape, Layout):
        return torch.empty_strided(shape.shape, shape.stride, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)

_trace_count = 0


def trace_count() -> int:
    """How many optimizer steps have been traced in this process (a retrace shows up here)."""
    return _trace_count


class BranchFlipped(RuntimeError):
    """A value the step computed took the other side of a branch than when it was traced."""


class _NeedsReadBacks(Exception):
    """The step decides on a value it read back, traced without its value: trace again with hints."""


def check_branch(value: Any, expected: Any) -> None:
    """The graph node of one branch on a computed value: the step continues only the way it was traced."""
    if value != expected:
        raise BranchFlipped(f"a branch of the traced step went the other way ({value!r}, traced with {expected!r})")


torch.fx.node.has_side_effect(check_branch)


@dataclass(frozen=True)
class HyperSlot:
    """Where one dynamic hyperparameter lives in a param group: ``group[key]`` or ``group[key][index]``."""

    key: str
    index: int | None
    is_tensor: bool

    @property
    def name(self) -> str:
        return self.key if self.index is None else f"{self.key}_{self.index}"

    def get(self, group: dict) -> Any:
        value = group[self.key]
        if self.index is not None:
            value = value[self.index]
        return value if type(value) is float or self.is_tensor else float(value)  # a numpy float, a Fraction


def _dynamic(value: object) -> bool:
    """A value a schedule may change: a tensor, or a real number that is not an integer (a Python or
    numpy float, a Fraction; bools and ints are flags and counts, baked into the trace)."""
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)


_slot = functools.cache(HyperSlot)  # one object per slot: built once, not on every step's signature


def hyper_slots(group: dict) -> tuple[HyperSlot, ...]:
    """The group entries that become graph inputs: floats and tensors, alone or in a tuple/list."""
    slots = []
    for key, value in group.items():
        if key == "params":
            continue
        if _dynamic(value):
            slots.append(_slot(key, None, isinstance(value, torch.Tensor)))
        elif isinstance(value, (tuple, list)) and value and all(_dynamic(v) for v in value):
            slots.extend(_slot(key, i, isinstance(v, torch.Tensor)) for i, v in enumerate(value))
    return tuple(slots)


def static_group_items(group: dict, slots: tuple[HyperSlot, ...], step: Callable | None = None) -> tuple:
    """The group entries baked into a trace (flags such as amsgrad, maximize), given its
    ``hyper_slots`` (every caller has them already): part of its key. Once ``step`` (an unhooked step
    function) has been traced, only the entries its traces read: a user's own entry (an epoch count
    written every step) is no part of the step."""
    dynamic = {s.key for s in slots}
    reads = _READS.get(step)
    items = []
    for key, value in sorted(group.items(), key=lambda item: repr(item[0])):  # keys of any type
        if key == "params" or key in dynamic or (reads is not None and key not in reads):
            continue
        try:
            hash(value)
        except TypeError:
            value = repr(value)
        items.append((key, value))
    return tuple(items)


_READS: dict[Callable, set[str]] = {}  # an unhooked step function -> the group entries its traces read


def entries_read() -> int:
    """How many group entries the steps traced so far read, over all step functions: a step prepared
    while this grew may have keyed a signature on too few entries, and is prepared again."""
    return sum(map(len, _READS.values()))


class _ReadRecorder(dict):
    """A param group that notes which of its entries the step reads (all of them, if it iterates)."""

    def __init__(self, group: dict, reads: set[str]) -> None:
        super().__init__(group)
        self.reads = reads

    def __getitem__(self, key: Any) -> Any:
        self.reads.add(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.reads.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.reads.add(key)
        return super().__contains__(key)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self.reads.add(key)
        return super().setdefault(key, default)

    def _everything(self) -> None:
        self.reads.update(super().keys())

    def __iter__(self):
        self._everything()
        return super().__iter__()

    def keys(self):
        self._everything()
        return super().keys()

    def items(self):
        self._everything()
        return super().items()

    def values(self):
        self._everything()
        return super().values()


def tensor_meta(t: torch.Tensor) -> tuple:
    """What of a tensor hyperparameter or scalar state a trace depends on."""
    return (tuple(t.shape), t.dtype, t.device.type)


@dataclass
class TracedStep:
    """The functional graph of one parameter's step and the guards under which it holds.

    ``guard`` checks the hyperparameter values before a step; branches on values the step computes
    are ``check_branch`` nodes inside ``graph``. ``fresh`` names the per-element states the step
    creates (absent from the state it was traced with), which the graph writes without reading.
    """

    graph: torch.fx.GraphModule
    slots: tuple[HyperSlot, ...]
    guard: Callable[[Sequence[Any]], bool]
    fresh: tuple[str, ...] = ()


def unhooked_step(cls: type) -> Callable:
    """The class's own ``step`` without the hook/profiler and grad-mode wrappers torch adds."""
    fn = cls.step
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def shell_optimizer(opt: torch.optim.Optimizer, group: dict, param: torch.Tensor, state: dict) -> Any:
    shell = object.__new__(type(opt))
    # Not GradScaler's grad_scale/found_inf (set on fused optimizers during scaler.step): the
    # single-tensor step refuses them, and the runner applies them itself.
    shell.__dict__.update({k: v for k, v in opt.__dict__.items() if k not in ("grad_scale", "found_inf")})
    shell.param_groups = [dict(group, params=[param])]
    shell.state = collections.defaultdict(dict, {param: state})
    return shell


class _ReadBacks(TorchDispatchMode):
    """Records every value a real step reads back into Python (``.item()``, ``float(t)``), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.values: list[float | int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._local_scalar_dense.default:
            self.values.append(out)
        return out


class _BackedReadBacks(TorchDispatchMode):
    """During the fake trace, makes the k-th read-back a symbol backed by the k-th real value, so a
    branch on it is a guard (recorded by :class:`_StepShapeEnv`) instead of a data-dependent error."""

    def __init__(self, shape_env: Any, hints: Sequence[float | int]) -> None:
        super().__init__()
        self.shape_env = shape_env
        self.hints = hints
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self._back(args[0])
        return func(*args, **(kwargs or {}))

    def _back(self, fake: torch.Tensor) -> None:
        k = self.count
        self.count += 1
        if k >= len(self.hints):
            raise NotImplementedError("the optimizer's step reads back more values when traced than when run; "
                                      "lowbit-compile cannot trace it")
        if fake.item_memo is not None:  # the same tensor read twice: the same symbol
            return
        hint = self.hints[k]
        if isinstance(hint, bool) or not isinstance(hint, (int, float)):
            raise NotImplementedError(f"the optimizer's step reads back a {type(hint).__name__} (a comparison "
                                      "of tensors: a tensor hyperparameter such as lr=torch.tensor(...) compared "
                                      "with a number?); lowbit-compile traces float and int read-backs: pass such "
                                      "a hyperparameter as a Python float")
        from torch._dynamo.source import ConstantSource
        from torch.fx.experimental.symbolic_shapes import DimDynamic

        source = ConstantSource(f"read_back_{k}")
        sym = self.shape_env.create_unspecified_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC)
        self.shape_env.read_backs.add(sym)
        make = self.shape_env.create_symintnode if isinstance(hint, int) else self.shape_env.create_symfloatnode
        fake.item_memo = make(sym, hint=hint, source=source)


# In-place ops functionalization has no kernel for (they are CompositeImplicitAutograd in ATen), as the
# ops ATen runs for them: Adafactor's ``norm(...).square_()``.
_IN_PLACE_FORMS: dict[Callable, Callable] = {torch.Tensor.square_: lambda t: t.pow_(2)}


_NUMBERS = (int, float, torch.SymFloat, torch.SymInt)


def _symbolic_extremum(builtin: Callable, sym: Callable) -> Callable:
    """``builtin`` (``max`` or ``min``) that folds symbolic numbers with ``sym`` (``torch.sym_max``)
    instead of deciding which is larger at trace time, recorded in the graph as ``builtin`` of its
    arguments in their order: ``sym`` puts a symbol first, and ``max(eps, nan)`` is not ``max(nan, eps)``."""

    def pair(a: Any, b: Any) -> Any:
        result = sym(a, b)
        if isinstance(a, (torch.SymFloat, torch.SymInt)) or isinstance(b, (torch.SymFloat, torch.SymInt)):
            from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

            mode = get_proxy_mode()
            if mode is not None and result in mode.tracer.symnode_tracker:
                node = get_proxy_slot(result, mode.tracer).force().node
                if node.target is sym:
                    swapped = not isinstance(a, (torch.SymFloat, torch.SymInt))
                    node.target = builtin
                    node.args = tuple(reversed(node.args)) if swapped else node.args
        return result

    def extremum(*args: Any, **kwargs: Any) -> Any:
        if (kwargs or len(args) < 2 or not all(isinstance(a, _NUMBERS) for a in args)
                or not any(isinstance(a, (torch.SymFloat, torch.SymInt)) for a in args)):
            return builtin(*args, **kwargs)
        return functools.reduce(pair, args)

    return extremum


@contextlib.contextmanager
def _symbolic_extrema(step: Callable):
    """While tracing, ``max``/``min`` in the module of ``step`` keep a value the step reads back
    symbolic (Adafactor's ``max(eps2, param.norm(2).item() / ...)``): a decision on a per-element
    value could not be checked before the step writes anything. Unsymbolic calls are the builtins'."""
    namespace = step.__globals__
    saved = {name: namespace[name] for name in ("max", "min") if name in namespace}
    namespace["max"] = _symbolic_extremum(max, torch.sym_max)
    namespace["min"] = _symbolic_extremum(min, torch.sym_min)
    try:
        yield
    finally:
        for name in ("max", "min"):
            namespace.pop(name)
        namespace.update(saved)


class _SymbolicScalarTensors(TorchFunctionMode):
    """``torch.as_tensor(x)`` / ``torch.tensor(x)`` of a symbolic number (ASGD's new ``eta``) as
    ``torch.scalar_tensor``, which keeps it symbolic instead of fixing its traced value; an in-place op
    functionalization cannot take as the ops it stands for (:data:`_IN_PLACE_FORMS`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _IN_PLACE_FORMS:
            return _IN_PLACE_FORMS[func](*args, **kwargs)
        if func in (torch.as_tensor, torch.tensor) and args and isinstance(args[0], (torch.SymFloat, torch.SymInt)):
            default = torch.get_default_dtype() if isinstance(args[0], torch.SymFloat) else torch.int64
            dtype = kwargs.get("dtype") or (args[1] if len(args) > 1 else None) or default
            return torch.scalar_tensor(args[0], dtype=dtype, device=kwargs.get("device"))
        return func(*args, **kwargs)


@functools.cache
def _step_shape_env() -> type:
    """The ShapeEnv subclass :func:`_trace` uses (defined on first use: ShapeEnv's module is heavy)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    class _StepShapeEnv(ShapeEnv):
        """A ShapeEnv that turns every decision the step takes on a read-back value into a
        ``check_branch(value, as_traced)`` node, inserted right where the step decides (before anything
        that depends on the decision, which may fail on the other side: ASGD's ``1 / (step - t0)``)."""

        def __init__(self) -> None:
            super().__init__()
            self.read_backs: set[sympy.Symbol] = set()
            self._checked: set[sympy.Basic] = set()

        def _get_stack_summary(self, is_debug: bool = False, framework_loc: str | None = None):
            """No source locations for symbols and guards: they only label dynamo's logs, and finding one
            imports torch.export (and networkx), seconds of a fresh process's first step."""
            from torch.fx.experimental.symbolic_shapes import SLoc

            return SLoc(framework_loc or "lowbit_compile trace", None), ""  # torch <= 2.12 formats no None

        def evaluate_sym_node(self, sym_node, size_oblivious=False, fallback_value=None):
            """Decisions on read-back values are the trace's, not torch's: torch would record them as
            guards (and torch <= 2.11, deciding ``step == 1.0`` inside ``pow``'s fake kernel, replaces the
            symbol by its value for the rest of the trace); an unknown one asks for a retrace with hints."""
            import sympy
            from torch.fx.experimental.proxy_tensor import get_proxy_mode

            expr = sym_node.expr
            if not (expr.free_symbols & self.read_backs or not sym_node.has_hint()):
                return super().evaluate_sym_node(sym_node, size_oblivious, fallback_value)
            if fallback_value is not None:  # guard_or_true/false: the caller is right either way
                return sympy.true if fallback_value else sympy.false
            in_kernel = get_proxy_mode() is None  # inside an op's fake kernel: the graph runs the op itself
            if not sym_node.has_hint():
                if in_kernel and sym_node.is_bool():  # torch >= 2.12's statically_known_true there
                    return sympy.false
                raise _NeedsReadBacks(expr)
            hint = sym_node.hint
            result = (sympy.true if hint else sympy.false) if sym_node.is_bool() else sympy.sympify(hint)
            if not in_kernel and expr not in self._checked:  # a decision taken twice is checked once
                self._checked.add(expr)
                _insert_branch_check(sym_node, result)
            return result

    return _StepShapeEnv


def _insert_branch_check(sym_node: Any, result: Any) -> None:
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if sym_node.is_bool():
        value, expected = torch.SymBool(sym_node), bool(result)
    elif sym_node.is_int():
        value, expected = torch.SymInt(sym_node), int(result)
    else:
        value, expected = torch.SymFloat(sym_node), float(result)
    if mode is None or value not in mode.tracer.symnode_tracker:
        raise NotImplementedError(
            f"the optimizer's step branches on {sym_node.expr}, a value computed during the step, "
            "outside the traced arithmetic; lowbit-compile cannot check that branch per step")
    proxy = get_proxy_slot(value, mode.tracer).force()
    mode.tracer.create_proxy("call_function", check_branch, (proxy, expected), {})


def read_back_hints(opt: torch.optim.Optimizer, group: dict, param_dtype: torch.dtype, device: torch.device,
                    state: dict[str, Any], per_element: Sequence[str],
                    shape: tuple[int, ...] | Layout | None = None) -> list[float | int]:
    """The values the stock step reads back into Python, from one real step on small tensors with
    the real scalar states and hyperparameters (per-element values cannot reach a read-back of an
    elementwise step); a step traced at a ``shape`` steps a param of that shape."""
    param = _example_param(shape or (_HINT_ELEMENTS,), param_dtype, device).fill_(1)
    param.grad = torch.full_like(param, 0.5)
    st: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            st[key] = value
        elif key in per_element:
            st[key] = torch.zeros_like(param, dtype=value.dtype)
        else:
            st[key] = value.clone()
    recorder = _ReadBacks()
    with torch.no_grad(), recorder:
        unhooked_step(type(opt))(shell_optimizer(opt, group, param, st))
    return recorder.values


def trace_step(
    opt: torch.optim.Optimizer,
    group: dict,
    param_dtype: torch.dtype,
    device: torch.device,
    state: dict[str, torch.Tensor | Any],
    per_element: Sequence[str],
    shape: tuple[int, ...] | Layout | None = None,
) -> TracedStep:
    """Trace ``type(opt).step`` for one parameter of ``group``.

    ``state`` is an example of the parameter's state (only its tensors' dtypes, the shapes and values
    of the non-per-element entries are used); ``per_element`` names the entries shaped like the
    param. A per-element name missing from ``state`` (or None there) is a state the step creates.

    Read-back values are first left unknown (most steps only compute with them); a step that
    branches on one is traced again with them backed by their current values.

    ``shape`` (None: a 1-D param of :data:`TRACE_ELEMENTS`) is the param's shape (a :class:`Layout`:
    and strides), for a step that is not elementwise (Muon's orthogonalized update): its graph holds
    for parameters of that shape (and layout) only.
    """
    try:
        return _trace(opt, group, param_dtype, device, state, per_element, None, shape)
    except _NeedsReadBacks:
        hints = read_back_hints(opt, group, param_dtype, device, state, per_element, shape)
        return _trace(opt, group, param_dtype, device, state, per_element, hints, shape)


def _trace(opt: torch.optim.Optimizer, group: dict, param_dtype: torch.dtype, device: torch.device,
           state: dict[str, torch.Tensor | Any], per_element: Sequence[str],
           hints: Sequence[float | int] | None, shape: tuple[int, ...] | Layout | None = None) -> TracedStep:
    global _trace_count
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    slots = hyper_slots(group)
    shape_env = _step_shape_env()()
    fake_mode = FakeTensorMode(shape_env=shape_env)
    symbols: list[sympy.Symbol] = []

    def sym_float(name: str, hint: float):
        source = ConstantSource(name)
        sym = shape_env.create_unspecified_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC)
        symbols.append(sym)
        return shape_env.create_symfloatnode(sym, hint=hint, source=source)

    tensor_keys = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
    fresh_keys = [k for k in per_element if not isinstance(state.get(k), torch.Tensor)]
    others = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor) and k not in fresh_keys}
    with fake_mode:
        p = _example_param(shape or (TRACE_ELEMENTS,), param_dtype, device)
        g = torch.empty_like(p)
        fake_state = []
        for key in tensor_keys:
            real = state[key]
            if key in per_element:
                fake_state.append(torch.empty_like(p, dtype=real.dtype))
            else:
                fake_state.append(torch.empty(real.shape, dtype=real.dtype, device=real.device))
        # a created state's dtype is the param's until the step says otherwise (checked below)
        fake_fresh = [torch.empty_like(p) for _ in fresh_keys]
    fake_hypers = []
    for slot in slots:
        value = slot.get(group)
        if slot.is_tensor:
            fake_hypers.append(fake_mode.from_tensor(value))
        else:
            fake_hypers.append(sym_float(f"hp_{identifier(slot.name)}", value))

    step_fn = unhooked_step(type(opt))
    n_state, n_fresh = len(tensor_keys), len(fresh_keys)

    def one_step(param, grad, *rest):
        states, fresh, hypers = rest[:n_state], rest[n_state:n_state + n_fresh], rest[n_state + n_fresh:]
        fake_group = dict(group)
        for slot, value in zip(slots, hypers):
            if slot.index is None:
                fake_group[slot.key] = value
            else:
                seq = list(fake_group[slot.key])
                seq[slot.index] = value
                fake_group[slot.key] = type(group[slot.key])(seq)
        st = dict(others)
        st.update(zip(tensor_keys, states))
        param.grad = grad
        try:
            backed = _BackedReadBacks(shape_env, hints) if hints is not None else contextlib.nullcontext()
            with _SymbolicScalarTensors(), _symbolic_extrema(step_fn), backed:
                shell = shell_optimizer(opt, fake_group, param, st)
                shell.param_groups[0] = _ReadRecorder(shell.param_groups[0], _READS.setdefault(step_fn, {"params"}))
                step_fn(shell)
        finally:
            param.grad = None
        for key, before in zip(tensor_keys, states):
            if st.get(key) is not before:  # replaced by a new tensor rather than updated in place
                before.copy_(_written_state(st, key, before))
        for key, slot in zip(fresh_keys, fresh):
            slot.copy_(_written_state(st, key, slot))
        _check_rest_of_state(st, tensor_keys, fresh_keys, others)

    with torch.no_grad():
        gm = make_fx(
            torch.func.functionalize(one_step, remove="mutations_and_views"), tracing_mode="fake"
        )(p, g, *fake_state, *fake_fresh, *fake_hypers)
    _trace_count += 1

    state_keys = tensor_keys + fresh_keys
    # the graph's own names for its inputs, never a key itself: keys come from checkpoints, and the
    # generated Python (and the kernels printed from the graph) name inputs after these
    names = ["param", "grad", *(f"state_{identifier(k)}" for k in state_keys),
             *(f"hp_{identifier(s.name)}" for s in slots)]
    # a state not per element is scalar even where its shape is the param's (Adafactor's row factor of
    # a column vector): the probe of the schema decides, at a shape where they differ
    inputs = [GraphInput(Role.PARAM), GraphInput(Role.GRAD),
              *(GraphInput(Role.STATE if k in per_element else Role.SCALAR_STATE, k) for k in state_keys),
              *(GraphInput(Role.HYPERPARAMETER, s) for s in slots)]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name, desc in zip(placeholders, names, inputs):
        node._rename(name)  # through the graph's namespace, which keeps names distinct
        node.target = node.name
        set_input(node, desc)
    gm.recompile()
    gm = elementwise_forms(gm)

    return TracedStep(gm, slots, _compile_guards(shape_env, symbols, slots), tuple(fresh_keys))


def _written_state(st: dict, key: str, slot: torch.Tensor) -> torch.Tensor:
    """The tensor the step left in ``state[key]``, which must fit the per-element slot it is copied to."""
    value = st.get(key)
    if not isinstance(value, torch.Tensor):
        raise NotImplementedError(f"the optimizer's step leaves state {key!r} as {type(value).__name__}, "
                                  "not a tensor; lowbit-compile traces steps whose state tensors stay tensors")
    if value.shape != slot.shape or value.dtype != slot.dtype:
        raise NotImplementedError(f"the optimizer's step writes state {key!r} as {value.dtype} of shape "
                                  f"{tuple(value.shape)}, not like its parameter ({slot.dtype}, "
                                  f"{tuple(slot.shape)})")
    return value


def _check_rest_of_state(st: dict, tensor_keys: Sequence[str], fresh_keys: Sequence[str], others: dict) -> None:
    """Refuse a step that changes state the graph cannot carry: Python numbers, or new tensors
    the first step did not create."""
    for key, value in st.items():
        if key in tensor_keys or key in fresh_keys:
            continue
        if key not in others:
            raise NotImplementedError(
                f"the optimizer's step creates state {key!r} on a later step than the first; "
                "lowbit-compile supports state that the first step creates")
        if value is not others[key]:
            raise NotImplementedError(
                f"the optimizer's step changes state {key!r}, a Python {type(others[key]).__name__}; "
                "lowbit-compile carries state across steps in tensors (keep it in a 0-d tensor, as "
                "torch.optim does with 'step')")


def _compile_guards(
    shape_env: Any, symbols: list[sympy.Symbol], slots: tuple[HyperSlot, ...]
) -> Callable[[Sequence[Any]], bool]:
    """One predicate over the hyperparameter values: the branches the traced step took on them.
    Branches on read-back values are ``check_branch`` nodes in the graph instead."""
    exprs = []
    for guard in shape_env.guards:
        expr = guard.expr
        unknown = expr.free_symbols - set(symbols)
        if unknown:
            raise NotImplementedError(
                f"the optimizer's step branches on a value computed during the step ({expr}) in a "
                "way lowbit-compile cannot check per step"
            )
        exprs.append(expr)
    if not exprs:
        return lambda values: True
    import sympy

    condition = sympy.And(*exprs)
    fn = sympy.lambdify(symbols, condition, modules="math")

    def guard(values: Sequence[Any]) -> bool:
        return bool(fn(*(v for v, slot in zip(values, slots) if not slot.is_tensor)))

    return guard
