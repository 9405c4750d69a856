"""Trace a stock optimizer's own ``step()`` for one parameter into a functional aten FX graph.

The step runs once per *signature* on fake 1-D tensors under ``make_fx`` + functionalization, on a
shallow shell of the user's optimizer (same class, one fake param group), so every flag keeps the
stock semantics. Float hyperparameters enter as symbolic floats and tensor hyperparameters as
tensors: both become graph inputs, and the host arithmetic on them (bias corrections, step sizes)
is recorded as Python-float nodes, so evaluating the graph repeats the stock arithmetic exactly and
an LR schedule never retraces. Branches the step takes on a hyperparameter (``weight_decay != 0``)
become guards that the cache checks on every step.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

TRACE_ELEMENTS = 16  # size of the fake 1-D parameter; the traced body is elementwise, any size runs it

_trace_count = 0


def trace_count() -> int:
    """How many optimizer steps have been traced in this process (a retrace shows up here)."""
    return _trace_count


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
        return value if self.index is None else value[self.index]


def _dynamic(value: object) -> bool:
    return (type(value) is float) or isinstance(value, torch.Tensor)


def hyper_slots(group: dict) -> tuple[HyperSlot, ...]:
    """The group entries that become graph inputs: floats and tensors, alone or in a tuple/list."""
    slots = []
    for key, value in group.items():
        if key == "params":
            continue
        if _dynamic(value):
            slots.append(HyperSlot(key, None, isinstance(value, torch.Tensor)))
        elif isinstance(value, (tuple, list)) and value and all(_dynamic(v) for v in value):
            slots.extend(HyperSlot(key, i, isinstance(v, torch.Tensor)) for i, v in enumerate(value))
    return tuple(slots)


def static_group_items(group: dict) -> tuple:
    """The group entries baked into a trace (flags such as amsgrad, maximize): part of its key."""
    dynamic = {s.key for s in hyper_slots(group)}
    items = []
    for key, value in sorted(group.items()):
        if key == "params" or key in dynamic:
            continue
        try:
            hash(value)
        except TypeError:
            value = repr(value)
        items.append((key, value))
    return tuple(items)


def tensor_meta(t: torch.Tensor) -> tuple:
    """What of a tensor hyperparameter or scalar state a trace depends on."""
    return (tuple(t.shape), t.dtype, t.device.type)


@dataclass
class TracedStep:
    """The functional graph of one parameter's step and the guards under which it holds."""

    graph: torch.fx.GraphModule
    slots: tuple[HyperSlot, ...]
    guard: Callable[[Sequence[Any]], bool]
    guard_text: str


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


def trace_step(
    opt: torch.optim.Optimizer,
    group: dict,
    param_dtype: torch.dtype,
    device: torch.device,
    state: dict[str, torch.Tensor | Any],
    per_element: Sequence[str],
) -> TracedStep:
    """Trace ``type(opt).step`` for one parameter of ``group``.

    ``state`` is an example of the parameter's state (only its tensors' dtypes and the shapes of
    the non-per-element entries are used); ``per_element`` names the entries shaped like the param.
    """
    global _trace_count
    slots = hyper_slots(group)
    shape_env = ShapeEnv()
    fake_mode = FakeTensorMode(shape_env=shape_env)
    symbols: list[sympy.Symbol] = []

    def sym_float(name: str, hint: float):
        source = ConstantSource(name)
        sym = shape_env.create_unspecified_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC)
        symbols.append(sym)
        return shape_env.create_symfloatnode(sym, hint=hint, source=source)

    tensor_keys = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
    with fake_mode:
        p = torch.empty(TRACE_ELEMENTS, dtype=param_dtype, device=device)
        g = torch.empty_like(p)
        fake_state = []
        for key in tensor_keys:
            real = state[key]
            if key in per_element:
                fake_state.append(torch.empty(TRACE_ELEMENTS, dtype=real.dtype, device=device))
            else:
                fake_state.append(torch.empty(real.shape, dtype=real.dtype, device=real.device))
    fake_hypers = []
    for slot in slots:
        value = slot.get(group)
        if slot.is_tensor:
            fake_hypers.append(fake_mode.from_tensor(value))
        else:
            fake_hypers.append(sym_float(slot.name, value))

    step_fn = unhooked_step(type(opt))
    n_state = len(tensor_keys)

    def one_step(param, grad, *rest):
        states, hypers = rest[:n_state], rest[n_state:]
        fake_group = dict(group)
        for slot, value in zip(slots, hypers):
            if slot.index is None:
                fake_group[slot.key] = value
            else:
                seq = list(fake_group[slot.key])
                seq[slot.index] = value
                fake_group[slot.key] = type(group[slot.key])(seq)
        st = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
        st.update(zip(tensor_keys, states))
        param.grad = grad
        try:
            step_fn(shell_optimizer(opt, fake_group, param, st))
        finally:
            param.grad = None

    with torch.no_grad():
        gm = make_fx(
            torch.func.functionalize(one_step, remove="mutations_and_views"), tracing_mode="fake"
        )(p, g, *fake_state, *fake_hypers)
    _trace_count += 1

    names = ["param", "grad", *(f"state_{k}" for k in tensor_keys), *(f"hp_{s.name}" for s in slots)]
    inputs = [("param",), ("grad",), *(("state", k) for k in tensor_keys), *(("hyper", s) for s in slots)]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name, desc in zip(placeholders, names, inputs):
        node.name = node.target = name
        node.meta["lowbit_input"] = desc
    gm.recompile()

    guard, text = _compile_guards(shape_env, symbols, slots)
    return TracedStep(gm, slots, guard, text)


def _compile_guards(
    shape_env: ShapeEnv, symbols: list[sympy.Symbol], slots: tuple[HyperSlot, ...]
) -> tuple[Callable, str]:
    """One predicate over the hyperparameter values: the branches the traced step took."""
    exprs = [g.expr for g in shape_env.guards]
    for expr in exprs:
        unknown = expr.free_symbols - set(symbols)
        if unknown:
            raise NotImplementedError(
                f"the optimizer's step branches on a value computed during the step ({expr}); "
                "lowbit-compile only rewrites steps whose control flow depends on hyperparameters"
            )
    if not exprs:
        return (lambda values: True), "True"
    condition = sympy.And(*exprs)
    fn = sympy.lambdify(symbols, condition, modules="math")

    def guard(values: Sequence[Any]) -> bool:
        return bool(fn(*(v for v, slot in zip(values, slots) if not slot.is_tensor)))

    return guard, str(condition)
