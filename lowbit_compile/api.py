"""``lowbit_compile(opt)`` and ``restore(opt)``: switch a stock optimizer to low-bit states and back.

The optimizer object stays the same instance with the same ``param_groups``; its class becomes the
low-bit subclass of its class (``lowbit_compile.optim``: still an instance of the stock class), its
``step`` an instance attribute shadowing the class method, and its state tensors change.
"""

from __future__ import annotations

import collections
import contextvars
import threading
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import checkpoint, master, sharding
from . import rounding as counter
from .compile import COUNTER_KEYS, compile_steps, step_request
from .config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_FMT,
    DEFAULT_MIN_8BIT_SIZE,
    DEFAULT_OUTLIERS,
    Config,
    Overrides,
    RoundingSpec,
    param_names,
)
from .kernels.backends import BackendError, resolve
from .kernels.formats import StateFormat
from .kernels.rounding import SEED as ROUNDING_SEED
from .passes.trace import entries_read, unhooked_step
from .run import Prepared, StepPlan, group_signature
from .state_schema import StateSchema, init_state, probe_schema

# The stock optimizers whose step is elementwise over each parameter: enable() rewrites these (and STAGED). Any
# other torch.optim.Optimizer subclass is accepted by lowbit_compile() once its step is traced and
# found elementwise; these stock ones are refused up front, with the reason.
SUPPORTED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adagrad,
             torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta, torch.optim.ASGD,
             torch.optim.Rprop)
# The stock optimizers whose step is not elementwise but runs in stages (passes/stages.py): traced at
# each parameter's shape, its matmuls and norms as torch ops, its per-element states low-bit.
STAGED = (torch.optim.Muon,)
REWRITTEN = SUPPORTED + STAGED  # what enable() rewrites and lowbit_compile() accepts without a probe
REFUSED = {
    torch.optim.LBFGS: "its step re-evaluates the closure in a line search and mixes every parameter "
                       "(dot products and a history over the flattened gradient)",
    torch.optim.SparseAdam: "it steps sparse gradients only, updating the rows they touch",
    torch.optim.Adafactor: "it factors the second moment of a matrix into row and column means and scales "
                           "the update by its norm",
}
_ATTR = "_lowbit"
# True while a rewritten ``step`` (the instance attribute) runs its hooks and update, so that the
# redirect below can tell it from the class's stock ``step`` reached some other way.
_IN_REWRITTEN_STEP: contextvars.ContextVar[bool] = contextvars.ContextVar("lowbit_in_rewritten_step", default=False)


class _Wrapped:
    """What ``lowbit_compile`` attaches to an optimizer: its config, the hooks it added, the
    ``step`` instance attribute it replaced (e.g. an LR scheduler's wrapper), and the parameter
    names that name-pattern overrides match against."""

    def __init__(self, config: Config, options: dict[str, Any], previous_step: Any, hooks: list) -> None:
        self.config = config
        self.options = options  # as given (less model=): what a copy is wrapped with again
        self.previous_step = previous_step
        self.hooks = hooks
        self.names: dict[torch.Tensor, str] = {}
        # per parameter, reused while valid; weak, so a parameter the optimizer lets go of is freed
        self.prepared: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.plan: StepPlan | None = None  # the last step's bound launches, reused while they fit
        self.transient = 0  # bytes a step allocates for one parameter at a time (a staged step's temporaries)
        # one step at a time: two threads stepping one optimizer take turns (stock's step is not
        # atomic either, but ours binds rows that a second step would rebind under the first)
        self.lock = threading.RLock()


def lowbit_compile(
    opt: torch.optim.Optimizer,
    fmt: str | Mapping[str, str] = DEFAULT_FMT,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    outliers: int = DEFAULT_OUTLIERS,
    min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE,
    backend: str = "auto",
    overrides: Overrides | None = None,
    model: torch.nn.Module | Iterable[tuple[str, torch.Tensor]] | None = None,
    master_weights: str | None = None,
    rounding: RoundingSpec = "nearest",
) -> torch.optim.Optimizer:
    """Keep every per-element state of ``opt`` (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``)
    block-quantized, and run its step through the traced, rewritten update.

    Args:
        opt: a ``torch.optim`` optimizer whose step is elementwise over each parameter (Adam, AdamW,
            SGD, RMSprop, Adagrad, Adamax, NAdam, RAdam, Adadelta, ASGD, Rprop, or a subclass of
            ``torch.optim.Optimizer`` of one's own); its existing fp32 state is converted.
        fmt: ``"sqrt8"``, ``"dynamic8"``, ``"int8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"bf16"`` or
            ``"fp32"`` (stock, bit for bit), or a dict from state name to one of those. The default,
            ``"sqrt8"`` in blocks of 512 without patches: as close to fp32 AdamW as ``"dynamic8"`` on
            every quality task and within 1 lr of fp32 on the zero-point check (bench/quality.py,
            bench/zero_point.py), and one square root to encode where dynamic8 searches its map, so
            its CPU step is about twice as fast (bench/step_bench.py). ``"dynamic8"`` spans more
            decades below a block's largest value (six against four).
        block_size: elements sharing one scale; a power of two. 512 without patches beat 2048 with
            2 patches for every format on the Zipf embedding task and kept the block buffers in L1
            on CPU.
        outliers: largest-magnitude values per block kept exactly in bf16 (patches); they help the
            linear int8 grid, not the companded sqrt8 and dynamic8.
        min_8bit_size: tensors with fewer elements keep stock fp32 states.
        backend: one of ``lowbit_compile.config.BACKENDS``: ``"auto"`` (the fused lowering for the
            parameters' device) or a named one, ``"reference"`` being the eager oracle.
        overrides: per-parameter formats, first match wins: ``{pattern: fmt}`` or ``[(pattern, fmt)]``
            where a pattern is a glob on the parameter name (``"*embed*"``), a compiled regex, or a
            predicate ``(name, param) -> bool``; e.g. ``{"*norm*": "fp32", "*embed*": "bf16"}``.
            Overrides win over ``min_8bit_size``; sizes and shapes are the full (unsharded) tensor's.
        model: the module (or ``named_parameters()`` pairs) that gives name patterns their names.
        master_weights: ``"exact"`` or ``"8bit"``: step each bf16/fp16 parameter through its fp32 master,
            held as the param plus a residual state (``master_residual``): ``"exact"`` is bit for bit an
            fp32 master copy stepped by the stock optimizer and the param refreshed from it (2.125
            B/param), ``"8bit"`` keeps the master to 1/256 of the param's spacing, unbiased (1 B/param).
            The stock states are then those of the fp32 step (then in ``fmt``). fp32 parameters are their
            own master and stay as they are. See ``lowbit_compile.master``.
        rounding: ``"nearest"`` or ``"stochastic"``, or a dict from state name to one of those: how a
            quantized state's new values round to codes. Stochastic rounding picks one of the two
            adjacent codes with probability proportional to proximity (unbiased), with random bits of
            a per-parameter step counter (``rounding_seed``, saved with the state, so a resumed run is
            bit for bit the uninterrupted one). See README, "Numerics".

    Returns ``opt`` itself, now an instance of ``lowbit_compile.optim.lowbit_class(type(opt))`` (a
    subclass of its class: ``isinstance`` checks still hold). Calling it again re-configures; it
    never quantizes twice.
    """
    from .optim import lowbit_class  # optim builds its classes from this module

    config = Config.make(fmt, block_size, outliers, min_8bit_size, backend, overrides, master_weights, rounding)
    _check_optimizer(opt)
    check_backend(opt, config)
    known = param_names(model) if model is not None else None  # model may be a one-shot iterator
    if known is None and opt.param_groups and all("param_names" in g for g in opt.param_groups):
        # an optimizer built from named_parameters() knows its names
        known = {p: n for g in opt.param_groups for n, p in zip(g["param_names"], g["params"])}
    names = _names_for(opt, config, known)
    master.warn_if_no_effect(opt, config)
    options = dict(fmt=fmt, block_size=block_size, outliers=outliers, min_8bit_size=min_8bit_size,
                   backend=backend, overrides=overrides, master_weights=master_weights, rounding=rounding)
    wrapped: _Wrapped | None = getattr(opt, _ATTR, None)
    if names is None:
        names = wrapped.names if wrapped is not None else {}
    if known is not None and config.uses_names:
        config.check_patterns(known.values())
    _check_state_names(opt, config)
    updates = _conform_updates(opt, config, names)  # everything that can fail, before anything changes
    checkpoint.guard_stock_steps()
    if wrapped is None:
        previous = opt.__dict__.get("step")
        hooks = [
            opt.register_state_dict_post_hook(checkpoint.pack_state_dict),
            opt.register_state_dict_post_hook(master.pack_state_dict),
            opt.register_state_dict_post_hook(counter.pack_state_dict),
            opt.register_state_dict_post_hook(checkpoint.mark_state_dict),
            opt.register_load_state_dict_pre_hook(_before_load),
            opt.register_load_state_dict_post_hook(checkpoint.finish_load),
            opt.register_step_pre_hook(_redirect_stock_step),
        ]
        wrapped = _Wrapped(config, options, previous, hooks)
    else:
        wrapped.config, wrapped.options = config, options
    wrapped.names = names
    for state, key, new in updates:
        _apply(state, {key: new})
    setattr(opt, _ATTR, wrapped)
    opt.step = _make_step(opt, wrapped.previous_step)
    opt.__class__ = lowbit_class(type(opt))
    return opt


def restore(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Turn a wrapped optimizer back into a stock one: fp32 (stock-dtype) states, the class's step,
    and its stock class again (an optimizer built from a ``lowbit_compile.optim`` class included).

    A 16-bit parameter stepped with master weights keeps its value (its master rounded to nearest even,
    as the fp32 master recipe leaves it) and loses its residual; its states take its dtype, as the stock
    step over it keeps them (take ``master_params(opt)`` first to keep the fp32 masters)."""
    from .optim import stock_class

    wrapped: _Wrapped | None = getattr(opt, _ATTR, None)
    if wrapped is None:
        return opt
    for param, state in opt.state.items():
        for key, value in list(state.items()):
            if sharding.is_quantized(value):
                state[key] = sharding.dequantize(value)
        master.release(param, state)
        state.pop(ROUNDING_SEED, None)
    for hook in wrapped.hooks:
        hook.remove()
    del opt.step
    if wrapped.previous_step is not None:
        opt.step = wrapped.previous_step
    delattr(opt, _ATTR)
    opt.__class__ = stock_class(type(opt))
    return opt


def transient_bytes(opt: torch.optim.Optimizer) -> int:
    """The bytes the last prepared step of the wrapped ``opt`` allocates while it runs, at most, beyond
    its states: a staged step's (Muon's) fp32 temporaries for its largest parameter; 0 otherwise."""
    wrapped: _Wrapped | None = getattr(opt, _ATTR, None)
    return wrapped.transient if wrapped is not None else 0


def is_wrapped(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` runs the low-bit step now (``lowbit_compile`` applied, ``restore`` not since)."""
    return hasattr(opt, _ATTR)


def _names_for(opt: torch.optim.Optimizer, config: Config, known: dict[torch.Tensor, str] | None) -> dict | None:
    """The names of ``opt``'s parameters among the ``model=`` names; name-pattern overrides need every one."""
    if known is None:
        wrapped: _Wrapped | None = getattr(opt, _ATTR, None)
        if config.uses_names and (wrapped is None or not wrapped.names):
            raise ValueError("overrides match parameter names, so lowbit_compile needs model=<the module> "
                             "(or model=module.named_parameters()) to know them")
        return None
    params = [p for group in opt.param_groups for p in group["params"]]
    missing = sum(p not in known for p in params)
    if missing and config.uses_names:
        raise ValueError(f"{missing} of the optimizer's {len(params)} parameters are not in model=, so name "
                         "patterns cannot apply to them; pass the module whose parameters the optimizer holds")
    return {p: known[p] for p in params if p in known}


def _check_optimizer(opt: object) -> None:
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"lowbit_compile takes a torch.optim.Optimizer, got {type(opt).__name__}")
    for cls, why in REFUSED.items():
        if isinstance(opt, cls):
            raise TypeError(
                f"lowbit_compile cannot rewrite {type(opt).__name__}: {why}; its step is not elementwise over "
                "each parameter, so it cannot run one block at a time (leave this optimizer unwrapped)"
            )
    for i, group in enumerate(opt.param_groups):
        _check_group(f"param_groups[{i}]", group)
    if not isinstance(opt, REWRITTEN):  # one's own optimizer: trace its step now, to refuse it here if need be
        for group in opt.param_groups:
            for param in {p.dim(): p for p in group["params"]}.values():
                probe_schema(opt, group, param)


def _check_group(where: str, group: dict) -> None:
    if group.get("differentiable"):
        raise ValueError(
            f"{where} has differentiable=True, which lowbit_compile does not support (quantized states "
            "cannot carry autograd history); use differentiable=False"
        )
    for p in group["params"]:
        if torch.is_complex(p):
            raise TypeError(f"{where} holds a complex parameter; lowbit_compile supports real "
                            "floating-point parameters only")
        if not p.is_floating_point():
            raise TypeError(f"{where} holds a {p.dtype} parameter; parameters must be floating point")


def check_new_group(opt: torch.optim.Optimizer, param_group: dict) -> None:
    """Refuse a group ``add_param_group`` would add to a wrapped ``opt`` that ``lowbit_compile`` would
    refuse (before anything changes); a one-shot iterable of params is listed in place, as stock does."""
    params = param_group["params"]
    param_group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
    group = {**opt.defaults, **param_group}
    _check_group(f"the new param group (param_groups[{len(opt.param_groups)}])", group)
    if not isinstance(opt, REWRITTEN):
        for param in {p.dim(): p for p in group["params"]}.values():
            probe_schema(opt, group, param)
    backend = getattr(opt, _ATTR).config.backend
    for p in group["params"]:
        try:
            resolve(backend, p.device.type)
        except BackendError as err:
            raise ValueError(f"the new param group holds a {p.device.type} parameter: {err}") from None


def check_backend(opt: torch.optim.Optimizer, config: Config) -> None:
    """Refuse a backend asked for by name that cannot run some parameter's device, before anything
    changes (``"auto"`` runs everywhere)."""
    for i, group in enumerate(opt.param_groups):
        for p in group["params"]:
            try:
                resolve(config.backend, p.device.type)
            except BackendError as err:
                raise ValueError(f"param_groups[{i}] holds a {p.device.type} parameter: {err}") from None


def _make_step(opt: torch.optim.Optimizer, previous: Any) -> Callable:
    """The instance ``step``: stock hooks around the rewritten update; keeps an LR scheduler's
    "optimizer.step() was called" tracking working when the scheduler wrapped ``step`` first."""
    hooked = torch.optim.Optimizer.profile_hook_step(_rewritten_update())
    track_lr_sched = previous is not None and getattr(previous, "_wrapped_by_lr_sched", False)

    def step(self, closure=None):
        if track_lr_sched:
            self._opt_called = True
        token = _IN_REWRITTEN_STEP.set(True)
        try:
            return hooked(self, closure)
        finally:
            _IN_REWRITTEN_STEP.reset(token)

    if track_lr_sched:
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
    if getattr(opt, _ATTR, None) is None or _IN_REWRITTEN_STEP.get() or (args and args[0] is not opt):
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
    wrapped: _Wrapped = getattr(opt, _ATTR)
    with wrapped.lock:
        _locked_step(opt, wrapped)
    return loss


def _locked_step(opt: torch.optim.Optimizer, wrapped: _Wrapped) -> None:
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
    if grad_scale is not None:
        for grad in plan.grads():
            grad.div_(grad_scale)
    plan.run()
    if on_meta:
        _stock_step(opt, on_meta)


def _prepare(opt: torch.optim.Optimizer, wrapped: _Wrapped) -> tuple[StepPlan, list[tuple[dict, torch.Tensor]]]:
    """The full preparation of a step: find or build the kernel of every parameter to step (a step
    that cannot be built fails here, with every state, counter and grad as it was), then create or
    convert the states of the parameters stepped for the first time, and bind them all. Also the
    params on the ``meta`` device, which the stock update steps."""
    config = wrapped.config
    while True:  # once more if a trace found the step reads group entries the signatures left out
        seen = entries_read()
        ready, todo, requests, on_meta = _requests(opt, wrapped)
        compiled_steps = compile_steps(requests)  # the kernels of all signatures compile at once
        if entries_read() == seen:
            break
    # Then create or convert the states of the parameters stepped for the first time, and run.
    for compiled, (schema, formats, mformat, group, group_sig, param, grad, position) in zip(compiled_steps, todo):
        state = opt.state[param]
        if not state.keys() - set(COUNTER_KEYS):
            state.update(init_state(param, schema, formats))
        # a loader that bypasses load_state_dict (ZeroRedundancyOptimizer) leaves packed or stock states
        checkpoint.conform(param, state, formats)
        _apply(state, master.conformed(param, state, mformat, schema, position))
        _apply(state, counter.conformed(state, bool(config.stochastic(formats)), position))
        prepared = wrapped.prepared[param] = Prepared.make(compiled, state, param, config, group_sig)
        ready.append((prepared, group, param, grad, state))
    return StepPlan(opt, config, ready), on_meta


def _requests(opt: torch.optim.Optimizer, wrapped: _Wrapped) -> tuple[list, list, list, list]:
    """The parameters whose prepared step still holds, and the step requests of the others (with what
    their states need once built); the params on the ``meta`` device apart."""
    config = wrapped.config
    ready, todo, requests = [], [], []
    on_meta: list[tuple[dict, torch.Tensor]] = []
    positions = _positions(opt)
    for group in opt.param_groups:
        group_sig, values = group_signature(group, unhooked_step(type(opt)))
        guards: dict[int, bool] = {}
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if param.is_meta:  # no values to quantize: the stock step, as stock AdamW runs it
                on_meta.append((group, param))
                continue
            if grad.is_sparse:
                raise RuntimeError(
                    "lowbit_compile: a parameter has a sparse gradient, which the rewritten step does not "
                    "take (it is traced for dense gradients); use torch.optim.SparseAdam, or leave the "
                    "optimizer unwrapped, for sparse gradients"
                )
            state = opt.state.get(param, {})
            _apply(state, checkpoint.step_restored(state))  # a loader that bypasses load_state_dict (ZeRO)
            prepared = wrapped.prepared.get(param)
            if prepared is not None and prepared.still_valid(state, param, config, group_sig, guards, values):
                ready.append((prepared, group, param, grad, state))
                continue
            mformat = master.format_for(param, config)
            schema = _schema(opt, group, param, mformat)
            formats = dict(config.formats_for(param, schema.per_element, wrapped.names.get(param), schema.nonneg))
            requests.append(step_request(opt, group, param, state, schema, formats, config, mformat))
            todo.append((schema, formats, mformat, group, group_sig, param, grad, positions[id(param)]))
    return ready, todo, requests, on_meta


def _stock_step(opt: torch.optim.Optimizer, params: list[tuple[dict, torch.Tensor]]) -> None:
    """The class's own update of ``params`` (each with its group), on ``opt``'s state."""
    shell = object.__new__(type(opt))
    shell.__dict__.update(opt.__dict__)
    groups: dict[int, dict] = {}
    for group, param in params:
        groups.setdefault(id(group), {**group, "params": []})["params"].append(param)
    shell.param_groups = list(groups.values())
    unhooked_step(type(opt))(shell)


def _formats(opt: torch.optim.Optimizer, config: Config, names: Mapping[torch.Tensor, str], group: dict,
             param: torch.Tensor) -> dict[str, StateFormat]:
    """The configured format of each per-element state of ``param`` in ``group``."""
    schema = _schema(opt, group, param, master.format_for(param, config))
    return dict(config.formats_for(param, schema.per_element, names.get(param), schema.nonneg))


def _schema(opt: torch.optim.Optimizer, group: dict, param: torch.Tensor, mformat: master.MasterFormat | None
            ) -> StateSchema:
    """The states ``param``'s step keeps: those of the fp32 step of its master when it has one."""
    return probe_schema(opt, group, master.stand_in(param) if mformat else param)


def _conform_updates(opt: torch.optim.Optimizer, config: Config, names: Mapping[torch.Tensor, str]) -> list:
    """``(state, key, new)`` for every existing per-element state not in its configured format
    (adoption mid-training, a re-configuration, a checkpoint a stock loader stored): all built
    before any is stored, so a state that cannot be converted changes nothing."""
    updates = []
    positions = _positions(opt)
    for group in opt.param_groups:
        for param in group["params"]:
            position = positions[id(param)]
            state = opt.state.get(param)
            if not state or param.is_meta:
                continue
            mformat = master.format_for(param, config)
            schema = _schema(opt, group, param, mformat)
            changes = checkpoint.step_restored(state)
            formats = dict(config.formats_for(param, schema.per_element, names.get(param), schema.nonneg))
            for key, fmt in formats.items():
                new = checkpoint.converted(param, key, state.get(key), fmt)
                if new is not None:
                    changes[key] = new
            changes.update(master.conformed(param, {**state, **changes}, mformat, schema, position))
            changes.update(counter.conformed(state, bool(config.stochastic(formats)), position))
            updates.extend((state, key, new) for key, new in changes.items())
    return updates


def _positions(opt: torch.optim.Optimizer) -> dict[int, int]:
    """Each param's position in ``param_groups`` order (by id): where its stochastic-rounding counters
    start (``first_counter``)."""
    return {id(p): i for i, p in enumerate(p for group in opt.param_groups for p in group["params"])}


def _apply(state: dict, changes: dict) -> None:
    """Set the entries of ``changes`` in ``state``; None removes one."""
    for key, value in changes.items():
        if value is None:
            state.pop(key, None)
        else:
            state[key] = value


def _check_state_names(opt: torch.optim.Optimizer, config: Config) -> None:
    """Refuse a fmt dict or override that names a state no optimizer keeps (a misspelling)."""
    if not config.state_names:
        return
    kept = set()
    for group in opt.param_groups:
        for param in {p.dim(): p for p in group["params"] if not p.is_meta}.values():
            kept.update(probe_schema(opt, group, param).per_element)
    config.check_state_names(kept, type(opt).__name__)


def _before_load(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``load_state_dict`` pre hook: read and convert every state first (``checkpoint.prepare_load``)."""
    wrapped: _Wrapped = getattr(opt, _ATTR)
    config = wrapped.config
    positions = _positions(opt)

    def masters_of(group: dict, param: torch.Tensor) -> Callable[[dict], dict] | None:
        mformat = master.format_for(param, config)
        if mformat is None:
            return None
        schema = _schema(opt, group, param, mformat)
        return lambda entry: master.loaded(param, entry, mformat, schema, positions[id(param)])

    return checkpoint.prepare_load(
        opt, state_dict, lambda group, param: _formats(opt, config, wrapped.names, group, param),
        wrapped.names.get, masters_of)


# The stock-step guard leaves alone a wrapped optimizer (its step converts what a loader left in its
# state) and optimizers that are not stock ones it rewrites (ZeroRedundancyOptimizer keeps a copy of
# its inner optimizer's state but steps the inner one).
checkpoint.defer_to(lambda opt: is_wrapped(opt) or not isinstance(opt, REWRITTEN))
