"""The rewritten step as one ``torch.library`` op, ``lowbit::optimizer_step``, so that ``torch.compile``
holds a wrapped ``opt.step()`` in its graph (``fullgraph=True`` included) instead of breaking there.

Dynamo sees only the op: its inputs are the parameters, their grads and every tensor the states hold
(codes, scales, patches, step counts, residuals), its fake implementation declares the params and
states written. Its host side (the hooks, the hyperparameters read from ``param_groups``, the scalar
prologue, kernel caches, the first step's tracing and compiling) runs when the graph reaches the op,
as the eager ``opt.step()``, so an LR schedule never recompiles the graph. What the host keeps for
the graph (:class:`GraphInputs`) is refreshed whenever a step prepares its plan anew.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from ..state import QuantizedState, sharding, stock
from .wrapped import Wrapped, wrapped_of

OP = "lowbit::optimizer_step"

# Why a step cannot be one op, with the fix: such a step is a graph break (it runs eagerly), and under
# fullgraph=True dynamo's error shows the reason.
_EAGER = ("torch.compile cannot hold as one op; call opt.step() outside the compiled function, or compile "
          "without fullgraph=True (the step then runs eagerly)")
REFUSALS = {
    "closure": "lowbit_compile: opt.step(closure) runs the closure inside the step, which torch.compile cannot hold "
               "in one graph with the rewritten step; call loss = closure() before opt.step() in the compiled "
               "function, or compile without fullgraph=True (the step then runs eagerly)",
    "dtensor": f"lowbit_compile: a parameter is a DTensor (FSDP2, tensor parallel), whose step {_EAGER}",
    "meta": f"lowbit_compile: a parameter is on the meta device, whose step {_EAGER}",
    "subclass": f"lowbit_compile: a parameter is a tensor subclass, whose step {_EAGER}",
}


class GraphInputs(NamedTuple):
    """What a compiled graph passes the op: the optimizer's handle, its params in ``param_groups``
    order, every tensor of their states; or why the step cannot be captured (``refusal``)."""

    handle: int
    params: tuple[torch.Tensor, ...]
    states: tuple[torch.Tensor, ...]
    refusal: str | None  # a key of REFUSALS


# The guard against a stock step over packed states (state.stock.refuse_packed_states) reads weak
# mappings dynamo does not trace: a stock step traced by torch.compile goes unguarded rather than failing.
stock.defer_to(lambda opt: torch.compiler.is_compiling())

_optimizers: dict[int, weakref.ref] = {}
_handles = itertools.count()
_op: list = []
_eager_steps: dict[str, Callable] = {}


def register(opt: torch.optim.Optimizer, wrapped: Wrapped) -> None:
    """Give ``opt`` its handle, the op's way back to the optimizer (``refresh`` then records its inputs)."""
    _define_op()
    handle = next(_handles)
    _optimizers[handle] = weakref.ref(opt, lambda _: _optimizers.pop(handle, None))
    wrapped.graph_inputs = GraphInputs(handle, (), (), None)


def refresh(opt: torch.optim.Optimizer, wrapped: Wrapped) -> None:
    """Record the params and state tensors as they are now (after a step prepared its plan)."""
    params = tuple(p for group in opt.param_groups for p in group["params"])
    states: list[torch.Tensor] = []
    for p in params:
        for value in opt.state.get(p, {}).values():
            value = sharding.local(value) if isinstance(value, torch.Tensor) else value
            if isinstance(value, QuantizedState):
                states.extend(value.storage_parts)
            elif type(value) is torch.Tensor:
                states.append(value)
    wrapped.graph_inputs = GraphInputs(wrapped.graph_inputs.handle, params, tuple(states), _refusal(params))


def _refusal(params: Sequence[torch.Tensor]) -> str | None:
    """Why these params cannot step as one op (the op takes plain tensors with values), or None."""
    if any(sharding.is_sharded(p) for p in params):
        return "dtensor"
    if any(p.is_meta for p in params):
        return "meta"
    if any(type(p) not in (torch.Tensor, torch.nn.Parameter) for p in params):
        return "subclass"
    return None


def captured_step(opt: torch.optim.Optimizer, closure: Callable[[], Any] | None) -> None:
    """``opt.step(closure)`` as dynamo traces it: one call of the op, or (where that cannot be) a call
    dynamo does not trace, whose reason a ``fullgraph=True`` error shows."""
    inputs = wrapped_of(opt).graph_inputs
    if closure is not None:
        return _eager_steps["closure"](opt, closure)
    if inputs.refusal is not None:
        return _eager_steps[inputs.refusal](opt, None)
    with torch.no_grad():
        torch.ops.lowbit.optimizer_step(inputs.handle, list(inputs.params), [p.grad for p in inputs.params],
                                        list(inputs.states))
    return None


def _step(opt: torch.optim.Optimizer, closure: Callable[[], Any] | None) -> Any:
    return opt.step(closure)


def _define_op() -> None:
    """Register ``lowbit::optimizer_step`` and its fake implementation, and the eager steps of what it
    cannot take (once per process, on the first wrap: ``torch.compiler`` loads dynamo)."""
    if _op:
        return
    for key, reason in REFUSALS.items():
        _eager_steps[key] = torch.compiler.disable(_step, reason=reason)

    # cudagraph_unsafe: its host side reads hyperparameters and may trace or compile; a CUDA graph that
    # replayed it would skip all that (inductor keeps it out of its CUDA graphs)
    @torch.library.custom_op(OP, mutates_args=("params", "states"), tags=(torch.Tag.cudagraph_unsafe,))
    def optimizer_step(handle: int, params: list[torch.Tensor], grads: list[torch.Tensor | None],
                       states: list[torch.Tensor]) -> None:
        _run(handle, params, grads, states)

    @optimizer_step.register_fake
    def _(handle, params, grads, states):
        return None

    _op.append(optimizer_step)


def _run(handle: int, params: list[torch.Tensor], grads: list[torch.Tensor | None],
         states: list[torch.Tensor]) -> None:
    """The op's implementation: the eager ``opt.step()`` with ``grads`` as the params' grads. Where the
    graph hands it copies of the params and states (a functionalized graph that did not write them
    in place), the step runs on the optimizer's own tensors and the copies take the result."""
    ref = _optimizers.get(handle)
    opt = ref() if ref is not None else None
    wrapped = wrapped_of(opt) if opt is not None else None
    if wrapped is None:
        raise RuntimeError("lowbit_compile: a compiled graph steps an optimizer that no longer exists or was "
                           "restored to stock; compile the function again (torch._dynamo.reset())")
    inputs = wrapped.graph_inputs
    if len(params) != len(inputs.params) or len(states) != len(inputs.states):
        raise RuntimeError("lowbit_compile: a compiled graph passed the step other params or states than the "
                           "optimizer holds; compile the function again (torch._dynamo.reset())")
    copies = [(given, own) for given, own in zip((*params, *states), (*inputs.params, *inputs.states))
              if not _same(given, own)]
    kept = [p.grad for p in inputs.params]
    with torch.no_grad(), _as_plain_call():
        for given, own in copies:
            own.copy_(given)
        try:
            for p, grad in zip(inputs.params, grads):
                if p.grad is not grad:
                    p.grad = grad
            opt.step()
        finally:
            for p, grad in zip(inputs.params, kept):
                if p.grad is not grad:
                    p.grad = grad
        for given, own in copies:
            given.copy_(own)


# What a torch_dispatch mode's redispatch leaves excluded below it (AOT autograd runs a graph's first
# call under one, and a user's mode may be active): functionalization and functorch's layers, which the
# step's own tracing (its first step traces the optimizer with make_fx) needs.
_BELOW_A_MODE = ("Functionalize", "FuncTorchDynamicLayerFrontMode", "FuncTorchDynamicLayerBackMode",
                 "PythonTLSSnapshot", "PreDispatch")


@contextlib.contextmanager
def _as_plain_call() -> Iterator[None]:
    """Run the host side as a plain eager call of the op would: without the keys a dispatch mode excluded
    and without the tracing context of a compile whose graph is running its first call."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for name in _BELOW_A_MODE:
        key = getattr(torch._C.DispatchKey, name)
        if exclude.has(key):
            exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), \
            torch._guards.tracing(None):
        yield


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are one tensor's memory, seen alike."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
                      and a.stride() == b.stride() and a.device == b.device)
