"""Wrapping an optimizer and unwrapping it: every check first (the optimizer, its groups, the backend, the
names overrides need, the states a format dict names, gradient release), then the conversion of its states
and the install of the rewritten step. The verbs (``api.lowbit_compile``, ``api.restore``) and the
optimizer classes (``optim.py``) call these; the class swap is theirs.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from ..config import Config, param_names
from ..kernels.backends import BackendError, resolve
from ..options import Options, from_keywords
from ..param_groups import check_group, reads_every_default
from ..state import stock
from ..state.schema import probe_schema
from . import release
from .rewritten_step import conform_updates, install, uninstall
from .wrapped import wrapped_of

# The stock optimizers whose step is elementwise over each parameter: enable() rewrites these (and STAGED).
# Any other torch.optim.Optimizer subclass is accepted by lowbit_compile() once its step is traced and
# found elementwise or staged; these stock ones are refused up front, with the reason.
SUPPORTED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adagrad,
             torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta, torch.optim.ASGD,
             torch.optim.Rprop)
# The stock optimizers whose step is not elementwise but runs in stages (passes/stages.py): traced at
# each parameter's shape, its matmuls and norms as torch ops, its per-element states low-bit (Adafactor's
# row and column factors, reduced over the parameter, keep their stock storage).
STAGED = (torch.optim.Muon, torch.optim.Adafactor)
REWRITTEN = SUPPORTED + STAGED  # what enable() rewrites and lowbit_compile() accepts without a probe
REFUSED = {
    torch.optim.LBFGS: "its step re-evaluates the closure in a line search and mixes every parameter "
                       "(dot products and a history over the flattened gradient)",
    torch.optim.SparseAdam: "it steps sparse gradients only, updating the rows they touch",
}




def wrap(opt: torch.optim.Optimizer, options: dict[str, Any]) -> None:
    """Wrap ``opt`` with the keyword options of ``lowbit_compile`` (``fmt`` among them), or re-configure a
    wrapped one: the options given replace the earlier ones, one left out taking its default (with a warning
    naming each that changes so), and the states are converted once from the values they hold. Everything
    that can fail does so before ``opt`` changes."""
    (given,) = from_keywords("lowbit_compile()", options, Options)
    config = Config.of(given)
    check_optimizer(opt)
    check_backend(opt, config)
    model = given.model
    known = param_names(model) if model is not None else None  # model may be a one-shot iterator
    if known is None and opt.param_groups and all("param_names" in g for g in opt.param_groups):
        # an optimizer built from named_parameters() knows its names
        known = {p: n for g in opt.param_groups for n, p in zip(g["param_names"], g["params"])}
    names = _names_for(opt, config, known)
    _warn_if_no_master(opt, config)
    wrapped = wrapped_of(opt)
    if names is None:
        names = wrapped.names if wrapped is not None else {}
    if known is not None and config.uses_names:
        config.check_patterns(known.values())
    _check_state_names(opt, config)
    if config.release_grads:
        release.check_attach(opt)
    updates = conform_updates(opt, config, names)  # everything that can fail, before anything changes
    if wrapped is not None:
        _warn_of_defaults(opt, wrapped.options, set(options))
    install(opt, config, given.kept(), names, updates)
    if config.release_grads:
        release.attach(opt, wrapped_of(opt))
    else:
        release.detach(opt)


def unwrap(opt: torch.optim.Optimizer) -> None:
    """Undo :func:`wrap`: stock-dtype states, the class's ``step``, no hooks (nothing for an unwrapped ``opt``)."""
    wrapped = wrapped_of(opt)
    if wrapped is None:
        return
    release.detach(opt)
    uninstall(opt, wrapped)


def _warn_of_defaults(opt: torch.optim.Optimizer, kept: dict[str, Any], given: set[str]) -> None:
    """Warn when wrapping ``opt`` again returns options the earlier wrap set (``kept``) to their defaults
    because this call (which gives ``given``) leaves them out."""
    defaults = {f.name: f.default for f in dataclasses.fields(Options)}
    back = {k: v for k, v in kept.items() if k not in given and v != defaults[k]}
    if back:
        it, they = ("them", "they") if len(back) > 1 else ("it", "it")
        warnings.warn(
            f"lowbit_compile: this {type(opt).__name__} was wrapped with {_listed(back)}; wrapping it again without "
            f"{it}, {they} return to the default {_listed({k: defaults[k] for k in back})} (an option a call leaves "
            f"out takes its default, as on a first wrap) and the states are converted. Pass {it} again to keep {it}",
            stacklevel=4)


def _listed(options: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in options.items())


def _names_for(opt: torch.optim.Optimizer, config: Config, known: dict[torch.Tensor, str] | None) -> dict | None:
    """The names of ``opt``'s parameters among the ``model=`` names; name-pattern overrides need every one."""
    if known is None:
        wrapped = wrapped_of(opt)
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


def _warn_if_no_master(opt: torch.optim.Optimizer, config: Config) -> None:
    """One warning when ``master_weights`` is set but no parameter of ``opt`` is bf16 or fp16 (fp32 ones are
    their own master)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    if config.master_weights is not None and params and all(config.master_format(p) is None for p in params):
        warnings.warn(f"master_weights={config.master_weights!r} has no effect: every parameter of this "
                      f"{type(opt).__name__} is {params[0].dtype}, its own master; it keeps the fp32 "
                      "master of bfloat16 and float16 parameters", stacklevel=4)


def check_optimizer(opt: object) -> None:
    """Refuse what is no optimizer, one of the stock optimizers that cannot be rewritten (naming why), a group
    the rewritten step cannot take, and a staged step or one of one's own that is not elementwise (traced
    now)."""
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"lowbit_compile takes a torch.optim.Optimizer, got {type(opt).__name__}")
    for cls, why in REFUSED.items():
        if isinstance(opt, cls):
            raise TypeError(
                f"lowbit_compile cannot rewrite {type(opt).__name__}: {why}; its step is not elementwise over "
                "each parameter, so it cannot run one block at a time (leave this optimizer unwrapped)"
            )
    for i, group in enumerate(opt.param_groups):
        _check_group(f"param_groups[{i}]", group, opt)
    if not isinstance(opt, SUPPORTED):  # a staged or one's own step: trace it now, to refuse it here if need be
        for group in opt.param_groups:
            for param in {p.dim(): p for p in group["params"]}.values():
                probe_schema(opt, group, param)


def _check_group(where: str, group: dict, opt: torch.optim.Optimizer) -> None:
    check_group(where, group, opt.defaults, reads_every_default(opt))
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
    where = f"the new param group (param_groups[{len(opt.param_groups)}])"
    check_group(where, param_group, {})  # a dict with params; the defaults fill in the rest
    params = param_group["params"]
    param_group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
    group = {**opt.defaults, **param_group}
    _check_group(where, group, opt)
    if not isinstance(opt, REWRITTEN):
        for param in {p.dim(): p for p in group["params"]}.values():
            probe_schema(opt, group, param)
    backend = wrapped_of(opt).config.backend
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


def _check_state_names(opt: torch.optim.Optimizer, config: Config) -> None:
    """Refuse a fmt dict or override that names a state no optimizer keeps (a misspelling)."""
    if not config.state_names:
        return
    kept = set()
    for group in opt.param_groups:
        for param in {p.dim(): p for p in group["params"] if not p.is_meta}.values():
            kept.update(probe_schema(opt, group, param).per_element)
    config.check_state_names(kept, type(opt).__name__)



# The stock-step guard leaves alone a wrapped optimizer (its step converts what a loader left in its
# state) and optimizers that are not stock elementwise ones (ZeroRedundancyOptimizer keeps a copy of
# its inner optimizer's state but steps the inner one).
stock.defer_to(lambda opt: wrapped_of(opt) is not None or not isinstance(opt, REWRITTEN))
