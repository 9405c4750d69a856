"""The rewritten step of a wrapped optimizer: the ``step`` that ``lowbit_compile`` installs, the
preparation of each parameter's kernel and states (every kind of per-parameter state, ``state/kinds.py``,
brought to the configuration) and the plan that binds and runs them; also the redirect that keeps the
class's stock ``step`` from running on low-bit states, and the conversion of existing states to their
configured formats."""

from __future__ import annotations

import collections
import contextvars
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..config import Config
from ..formats import blockquant
from ..formats.residual import MasterFormat
from ..param_groups import check_group, reads_every_default
from ..passes.trace import entries_read, unhooked_step
from ..state import QuantizedState, hooks, kinds, stock
from ..state.kind import StateConfig, apply
from ..state.kinds import OWN_KEYS
from ..state.master import stand_in
from ..state.schema import StateSchema, init_state, probe_schema
from . import step_op
from .compile import compile_steps, step_request
from .released_grad import is_released
from .run import Prepared, StepPlan, group_signature
from .wrapped import ATTR, Wrapped, wrapped_of

# True while a rewritten ``step`` (the instance attribute) runs its hooks and update, so that the
# redirect below can tell it from the class's stock ``step`` reached some other way.
_IN_REWRITTEN_STEP: contextvars.ContextVar[bool] = contextvars.ContextVar("lowbit_in_rewritten_step", default=False)


def install(opt: torch.optim.Optimizer, config: Config, options: dict[str, Any], names: dict[torch.Tensor, str],
            updates: list) -> None:
    """Wrap ``opt`` (or re-configure it): attach its :class:`Wrapped` and the hooks that pack and load its
    checkpoints, store the converted states ``updates`` (``conform_updates``), and install the rewritten
    ``step``. Everything that can fail was checked before; this changes ``opt``."""
    stock.guard_stock_steps()
    wrapped = wrapped_of(opt)
    if wrapped is None:
        previous = opt.__dict__.get("step")
        handles = [
            opt.register_state_dict_post_hook(hooks.pack_state_dict),
            opt.register_load_state_dict_pre_hook(_before_load),
            opt.register_load_state_dict_post_hook(hooks.finish_load),
            opt.register_step_pre_hook(_redirect_stock_step),
        ]
        wrapped = Wrapped(config, options, previous, handles)
        step_op.register(opt, wrapped)
    else:
        wrapped.config, wrapped.options = config, options
    wrapped.names = names
    for state, changes in updates:
        apply(state, changes)
    step_op.refresh(opt, wrapped)
    setattr(opt, ATTR, wrapped)
    opt.step = _make_step(opt)


def uninstall(opt: torch.optim.Optimizer, wrapped: Wrapped) -> None:
    """Undo ``install``: stock-dtype states (every kind released: no residual, no rounding counter), no
    hooks, the class's ``step`` (or the one it shadowed), no :class:`Wrapped`."""
    for param, state in opt.state.items():
        kinds.release(param, state)
    for hook in wrapped.hooks:
        hook.remove()
    del opt.step
    if wrapped.previous_step is not None:
        opt.step = wrapped.previous_step
    delattr(opt, ATTR)


def _make_step(opt: torch.optim.Optimizer) -> Callable:
    """The instance ``step``: stock hooks around the rewritten update. It does an LR scheduler's
    "optimizer.step() was called" tracking itself, so that a scheduler made later does not wrap it in
    a function that ``torch.compile`` will not trace; under ``torch.compile`` it is one op."""
    hooked = torch.optim.Optimizer.profile_hook_step(_rewritten_update())

    def step(self, closure=None):
        if torch.compiler.is_compiling():  # dynamo traces it: one op, whose eager run comes back here
            return step_op.captured_step(self, closure)
        self._opt_called = True
        token = _IN_REWRITTEN_STEP.set(True)
        try:
            return hooked(self, closure)
        finally:
            _IN_REWRITTEN_STEP.reset(token)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return types.MethodType(step, opt)


def stock_step_runs_rewritten(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """New ``(args, kwargs)`` for a global step pre-hook to return, so that the stock ``step`` being
    called runs the rewritten update instead.

    A global pre-hook runs inside the stock step's hook wrapper and cannot cancel the stock update;
    it can only replace its arguments. The stock update gets an idle twin (same class and defaults,
    no param groups: it updates nothing) and a closure that runs the rewritten update (with the
    caller's closure, if any). The stock step calls that closure where it would call the caller's,
    after every per-optimizer pre-hook, and returns its loss. Post-hooks see the twin in ``args``.
    """
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    twin = object.__new__(type(opt))
    twin.__dict__.update(opt.__dict__)
    twin.param_groups = []
    twin.state = collections.defaultdict(dict)
    return (twin,), {"closure": RunRewritten(opt, closure)}


class RunRewritten:
    """The closure ``stock_step_runs_rewritten`` hands the idle stock step: the rewritten update of
    ``opt``, which calls ``closure`` (the caller's, or None) first. A later pre-hook that needs to act
    between the caller's closure and the update (``monitor``) replaces ``closure``."""

    def __init__(self, opt: torch.optim.Optimizer, closure: Callable[[], Any] | None) -> None:
        self.opt = opt
        self.closure = closure

    def __call__(self) -> Any:
        return _rewritten_update()(self.opt, self.closure)


def _redirect_stock_step(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The step pre-hook of a wrapped optimizer: stepped through its class's stock ``step`` -- a
    bound method captured before it was wrapped, which accelerate's AcceleratedOptimizer puts back
    after every GradScaler step -- it still runs the rewritten update, never the stock one on
    quantized states. A step an earlier hook (``enable``'s) already redirected is left alone."""
    if wrapped_of(opt) is None or _IN_REWRITTEN_STEP.get() or (args and args[0] is not opt):
        return None
    return stock_step_runs_rewritten(opt, args, kwargs)


_DISABLED_STEP: list[Callable] = []


def _rewritten_update() -> Callable:
    """The rewritten update as the step calls it: under ``torch.compile`` a graph break
    (``torch.compiler.disable``) that runs as is, since its host side (tracing, caches, the scalar
    prologue) is not traceable and each param's update is already one fused launch. Made on the first
    wrap, not at import (``torch.compiler`` loads dynamo)."""
    if not _DISABLED_STEP:
        _DISABLED_STEP.append(torch.compiler.disable(_lowbit_step))
    return _DISABLED_STEP[0]


@torch.no_grad()
def _lowbit_step(opt: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    wrapped = wrapped_of(opt)
    if wrapped is None:  # the closure restored the optimizer (restore(opt)): the step it asked for is stock
        unhooked_step(type(opt))(opt)
        return loss
    if wrapped.release is not None:  # release_grads: the params stepped in backward; this completes the iteration
        wrapped.release.before_step(opt)
    with wrapped.lock:
        _locked_step(opt, wrapped)
    return loss


def _locked_step(opt: torch.optim.Optimizer, wrapped: Wrapped) -> None:
    """The update itself, under the optimizer's lock: bind (or prepare) the plan, unscale, run."""
    config = wrapped.config
    # torch.amp.GradScaler hands an optimizer whose _step_supports_amp_scaling is True (fused=True)
    # still-scaled grads plus these two tensors, and expects it to skip or unscale as the fused
    # stock step does (which also writes the unscaled grad back).
    found_inf = getattr(opt, "found_inf", None)
    if found_inf is not None and found_inf.item():
        return
    grad_scale = getattr(opt, "grad_scale", None)
    plan, on_meta = wrapped.plan, []
    if plan is None or not plan.refresh(opt, config):
        plan, on_meta = _prepare(opt, wrapped)
        wrapped.plan = plan if plan.reusable and not on_meta else None
        wrapped.transient = plan.transient
        step_op.refresh(opt, wrapped)
    if grad_scale is not None:
        for grad in plan.grads():
            grad.div_(grad_scale)
    plan.run()
    if on_meta:
        _meta_step(opt, wrapped, on_meta)


def prepare_params(opt: torch.optim.Optimizer, wrapped: Wrapped, params: list[torch.Tensor]) -> StepPlan:
    """The plan that steps ``params`` alone, whose grads are complete (gradient release's bucket)."""
    return _prepare(opt, wrapped, {id(p) for p in params})[0]


def _prepare(opt: torch.optim.Optimizer, wrapped: Wrapped, only: set[int] | None = None
             ) -> tuple[StepPlan, list[tuple[dict, torch.Tensor]]]:
    """The full preparation of a step (of the params whose ids are in ``only``, if given): find or build
    the kernel of every parameter to step (a step that cannot be built fails here, with every state,
    counter and grad as it was), then create or convert the states of the parameters stepped for the
    first time, and bind them all. Also the params on the ``meta`` device, which the stock update steps."""
    config = wrapped.config
    while True:  # once more if a trace found the step reads group entries the signatures left out
        seen = entries_read()
        ready, todo, requests, on_meta = _requests(opt, wrapped, only)
        compiled_steps = compile_steps(requests)  # the kernels of all signatures compile at once
        if entries_read() == seen:
            break
    # Then create or convert the states of the parameters stepped for the first time, and run.
    materialised = 0
    for compiled, (wanted, group, group_sig, param, grad) in zip(compiled_steps, todo):
        state = opt.state[param]
        if _holds_meta(state):  # stepped on the meta device, materialised since: no values to keep
            state.clear()
            materialised += 1
        if not state.keys() - set(OWN_KEYS):
            state.update(init_state(param, wanted.schema, dict(wanted.formats)))
        # a loader that bypasses load_state_dict (ZeroRedundancyOptimizer) leaves packed or stock states
        apply(state, kinds.conformed(param, state, wanted))
        prepared = wrapped.prepared[param] = Prepared.make(compiled, state, param, config, group_sig)
        ready.append((prepared, group, param, grad, state))
    if materialised:
        warnings.warn(f"lowbit-compile: {materialised} parameter(s) of this {type(opt).__name__} were stepped on the "
                      "meta device and hold values now; their states held none and start afresh (step 0), as a new "
                      "optimizer's would", stacklevel=5)
    return StepPlan(opt, config, ready, subset=only is not None), on_meta


def _requests(opt: torch.optim.Optimizer, wrapped: Wrapped, only: set[int] | None = None
              ) -> tuple[list, list, list, list]:
    """The parameters whose prepared step still holds, and the step requests of the others (with what
    their states need once built); the params on the ``meta`` device apart. A param whose grad was
    released (it stepped in backward) has nothing left to step."""
    config = wrapped.config
    complete = reads_every_default(opt)
    for i, group in enumerate(opt.param_groups):  # a group changed since it was checked
        check_group(f"param_groups[{i}]", group, opt.defaults, complete)
    ready, todo, requests = [], [], []
    on_meta: list[tuple[dict, torch.Tensor]] = []
    positions = _positions(opt)
    for group in opt.param_groups:
        group_sig, values = group_signature(group, unhooked_step(type(opt)))
        guards: dict[int, bool] = {}
        for param in group["params"]:
            grad = param.grad
            if grad is None or is_released(grad) or (only is not None and id(param) not in only):
                continue
            if param.is_meta:  # no values to quantize: see _meta_step
                on_meta.append((group, param))
                continue
            if grad.is_sparse:
                raise RuntimeError(
                    "lowbit_compile: a parameter has a sparse gradient, which the rewritten step does not "
                    "take (it is traced for dense gradients); use torch.optim.SparseAdam, or leave the "
                    "optimizer unwrapped, for sparse gradients"
                )
            state = opt.state.get(param, {})
            if _holds_meta(state):  # stepped on the meta device: the step starts afresh (_prepare clears it)
                state = {}
            apply(state, stock.step_restored(state))  # a loader that bypasses load_state_dict (ZeRO)
            prepared = wrapped.prepared.get(param)
            if prepared is not None and prepared.still_valid(state, param, config, group_sig, guards, values):
                ready.append((prepared, group, param, grad, state))
                continue
            wanted = _state_config(opt, config, wrapped.names, group, param, positions[id(param)])
            requests.append(step_request(opt, group, param, state, wanted.schema, dict(wanted.formats), config,
                                         wanted.master))
            todo.append((wanted, group, group_sig, param, grad))
    return ready, todo, requests, on_meta


def _meta_step(opt: torch.optim.Optimizer, wrapped: Wrapped, params: list[tuple[dict, torch.Tensor]]) -> None:
    """The step of parameters on the meta device, which hold no values: the stock update as stock runs
    it there (shapes, the scalar states), each per-element state then held in its configured format, of
    empty meta storage: the states and ``memory_report`` are what the parameters' will be once they hold
    values (the states then start afresh, ``_prepare``)."""
    config, formats = wrapped.config, {}
    for group, param in params:
        state = opt.state[param]
        for key, value in state.items():  # the stock update reads plain tensors
            if isinstance(value, QuantizedState):
                state[key] = torch.empty(value.shape, dtype=value.dtype, device="meta")
        probe = torch.empty((1,) * param.dim(), dtype=param.dtype)  # the probe runs the stock step on values
        schema = _schema(opt, group, probe, config.master_format(param))
        formats[param] = config.formats_for(param, schema.per_element, wrapped.names.get(param), schema.nonneg)
    _stock_step(opt, params)
    for param, held in formats.items():
        state = opt.state[param]
        for key, fmt in held:
            value = state.get(key)
            if not fmt.passthrough and isinstance(value, torch.Tensor) and value.is_meta:
                state[key] = QuantizedState(blockquant.empty(value.numel(), fmt, "meta"), fmt, value.shape,
                                            value.dtype)


def _holds_meta(state: dict) -> bool:
    """Whether a parameter's state is one of the meta device (made by a step of the parameter there)."""
    return any(isinstance(v, torch.Tensor) and v.is_meta for v in state.values())


def _stock_step(opt: torch.optim.Optimizer, params: list[tuple[dict, torch.Tensor]]) -> None:
    """The class's own update of ``params`` (each with its group), on ``opt``'s state."""
    shell = object.__new__(type(opt))
    shell.__dict__.update(opt.__dict__)
    groups: dict[int, dict] = {}
    for group, param in params:
        groups.setdefault(id(group), {**group, "params": []})["params"].append(param)
    shell.param_groups = list(groups.values())
    unhooked_step(type(opt))(shell)


def _state_config(opt: torch.optim.Optimizer, config: Config, names: Mapping[torch.Tensor, str], group: dict,
                  param: torch.Tensor, position: int) -> StateConfig:
    """What ``config`` asks of ``param``'s state in ``group``: its states' formats, the schema of its step
    (the fp32 master's under master weights), its master, whether a state rounds stochastically."""
    mformat = config.master_format(param)
    schema = _schema(opt, group, param, mformat)
    formats = dict(config.formats_for(param, schema.per_element, names.get(param), schema.nonneg))
    return StateConfig(formats, schema, mformat, bool(config.stochastic(formats)), position, type(opt).__name__)


def _schema(opt: torch.optim.Optimizer, group: dict, param: torch.Tensor, mformat: MasterFormat | None
            ) -> StateSchema:
    """The states ``param``'s step keeps: those of the fp32 step of its master when it has one."""
    return probe_schema(opt, group, stand_in(param) if mformat else param)


def conform_updates(opt: torch.optim.Optimizer, config: Config, names: Mapping[torch.Tensor, str]
                    ) -> list[tuple[dict, dict]]:
    """``(state, changes)`` that bring every existing parameter state to ``config`` (adoption mid-training, a
    re-configuration, a checkpoint a stock loader stored): all built before any is stored, so a state that
    cannot be converted changes nothing."""
    updates = []
    positions = _positions(opt)
    for group in opt.param_groups:
        for param in group["params"]:
            state = opt.state.get(param)
            if not state or param.is_meta or _holds_meta(state):  # no values: nothing to convert
                continue
            changes = stock.step_restored(state)
            wanted = _state_config(opt, config, names, group, param, positions[id(param)])
            changes.update(kinds.conformed(param, {k: v for k, v in {**state, **changes}.items() if v is not None},
                                           wanted))
            updates.append((state, changes))
    return updates


def _positions(opt: torch.optim.Optimizer) -> dict[int, int]:
    """Each param's position in ``param_groups`` order (by id): where its stochastic-rounding counters
    start (``first_counter``)."""
    return {id(p): i for i, p in enumerate(p for group in opt.param_groups for p in group["params"])}


def _before_load(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``load_state_dict`` pre hook: read and convert every state first (``state.hooks.prepare_load``)."""
    wrapped = wrapped_of(opt)
    positions = _positions(opt)
    return hooks.prepare_load(
        opt, state_dict,
        lambda group, param: _state_config(opt, wrapped.config, wrapped.names, group, param, positions[id(param)]),
        wrapped.names.get)
