"""``lowbit_compile(opt)`` and ``restore(opt)``: switch a stock optimizer to low-bit states and back.

The optimizer object stays the same instance with the same ``param_groups``; its class becomes the
low-bit subclass of its class (``lowbit_class``, made here because its constructor wraps itself with
``lowbit_compile``; ``lowbit_compile.optim`` names those of the stock classes), its ``step`` an
instance attribute shadowing the class method (``rewritten_step``), and its state tensors change.
The checks here run first: everything that can fail does so before the optimizer changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from typing import TYPE_CHECKING, Any

import torch

from .config import Config, param_names
from .formats import format_names
from .kernels.backends import BackendError, resolve
from .memory import memory_report
from .options import (
    PARAM_DTYPE_NAMES,
    FmtSpec,
    OptionKeywords,
    Options,
    args_doc,
    entry_signature,
    from_keywords,
    refuse_foreign,
)
from .param_groups import check_group, reads_every_default
from .runtime import release
from .runtime.rewritten_step import conform_updates, install, uninstall
from .runtime.wrapped import wrapped_of
from .state import QuantizedState, stock
from .state.schema import probe_schema

if TYPE_CHECKING:
    from typing_extensions import Unpack  # torch's dependency; only type checkers read it here

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


def lowbit_compile(opt: torch.optim.Optimizer, fmt: FmtSpec | None = None,
                   **options: Unpack[OptionKeywords]) -> torch.optim.Optimizer:
    """Keep every per-element state of ``opt`` (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``)
    block-quantized, and run its step through the traced, rewritten update.

    Args:
        opt: a ``torch.optim`` optimizer whose step is elementwise over each parameter (Adam, AdamW,
            SGD, RMSprop, Adagrad, Adamax, NAdam, RAdam, Adadelta, ASGD, Rprop, or a subclass of
            ``torch.optim.Optimizer`` of one's own), or one that runs in stages (Muon, Adafactor); its
            existing fp32 state is converted.
<OPTIONS>

    Returns ``opt`` itself, now an instance of ``lowbit_compile.optim.lowbit_class(type(opt))`` (a
    subclass of its class: ``isinstance`` checks still hold). Calling it again re-configures: the options
    of the later call replace the earlier ones, one it leaves out taking its default as on a first wrap
    (with a warning naming each that changes so), and the states are converted once from the values they
    hold; it never quantizes twice.
    """
    if fmt is not None:
        options = {"fmt": fmt, **options}  # type: ignore[assignment]
    (given,) = from_keywords("lowbit_compile()", options, Options)
    config = Config.of(given)
    _check_optimizer(opt)
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
    opt.__class__ = lowbit_class(type(opt))
    return opt


lowbit_compile.__signature__ = entry_signature(  # type: ignore[attr-defined]
    [inspect.Parameter("opt", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="torch.optim.Optimizer")], Options,
    returns="torch.optim.Optimizer")
lowbit_compile.__doc__ = lowbit_compile.__doc__.replace("<OPTIONS>", args_doc(Options, formats=format_names()))


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
            stacklevel=3)


def _listed(options: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in options.items())


def restore(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Turn a wrapped optimizer back into a stock one: fp32 (stock-dtype) states, the class's step,
    and its stock class again (an optimizer built from a ``lowbit_compile.optim`` class included).

    A 16-bit parameter stepped with master weights keeps its value (its master rounded to nearest even,
    as the fp32 master recipe leaves it) and loses its residual; its states take its dtype, as the stock
    step over it keeps them (take ``master_params(opt)`` first to keep the fp32 masters)."""
    wrapped = wrapped_of(opt)
    if wrapped is None:
        return opt
    release.detach(opt)
    uninstall(opt, wrapped)
    opt.__class__ = stock_class(type(opt))
    return opt


def is_wrapped(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` runs the low-bit step now (``lowbit_compile`` applied, ``restore`` not since)."""
    return wrapped_of(opt) is not None


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
                      "master of bfloat16 and float16 parameters", stacklevel=3)


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


# The keyword arguments of ``lowbit_compile`` the constructors take besides the stock ones.
_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(Options))
_STATE_KEY = "_lowbit_options"  # where __getstate__ keeps the options a copy is wrapped with

_DTYPE_NAMES = {**dict(zip((torch.float32, torch.bfloat16, torch.float16), PARAM_DTYPE_NAMES)), torch.float64: "fp64"}
_classes: dict[type, type] = {}  # stock class -> its low-bit subclass
_OPTIM_MODULE = __name__.rsplit(".", 1)[0] + ".optim"  # where the classes of REWRITTEN are importable


def lowbit_class(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """The low-bit subclass of optimizer class ``cls`` (``cls`` itself if it already is one)."""
    if getattr(cls, "_lowbit_base", None) is not None:
        return cls
    made = _classes.get(cls)
    if made is None:
        # a stock class lowbit_compile.optim names is made there; one of one's own is made at run time
        made = _classes[cls] = _make_class(cls, _OPTIM_MODULE if cls in REWRITTEN else cls.__module__)
    return made


def stock_class(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """The class ``restore`` gives back: the stock class a low-bit class was made for. A class
    derived from a low-bit one (``class Mine(lowbit_compile.optim.AdamW)``) stays as it is."""
    return cls._lowbit_base if cls.__dict__.get("_lowbit_made") else cls


def describe(opt: torch.optim.Optimizer) -> str:
    """The header ``repr`` prints before the stock text: the options and the formats held per state."""
    wrapped = wrapped_of(opt)
    if wrapped is None:
        return f"{type(opt).__name__} (lowbit-compile, not wrapped: stock states)"
    head = "lowbit-compile: " + ", ".join(f"{k}={v!r}" for k, v in Options.shown(wrapped.options).items())
    per_state: dict[str, dict[str, int]] = {}
    stock_bytes = 0
    for group in opt.param_groups:
        for param in group["params"]:
            for key, value in opt.state.get(param, {}).items():
                if not isinstance(value, torch.Tensor):
                    continue
                stock_bytes += value.numel() * value.dtype.itemsize
                if isinstance(value, QuantizedState):
                    label = value.fmt.name
                elif value.shape == param.shape and value.dim() > 0:
                    label = f"stock {_DTYPE_NAMES.get(value.dtype, str(value.dtype))}"
                else:
                    continue
                counts = per_state.setdefault(key, {})
                counts[label] = counts.get(label, 0) + 1
    if not per_state:
        return head + "\n  states: none yet (made at the first step)"
    held = memory_report(opt).total
    states = "; ".join(f"{key} " + ", ".join(f"{label} x{n}" for label, n in counts.items())
                       for key, counts in per_state.items())
    stock_per_param = stock_bytes / held.params if held.params else 0.0
    return (f"{head}\n  states: {states}; {held.bytes_per_param:.3f} B/param held "
            f"(stock {stock_per_param:.3f})")


def _rebuild(cls: type[torch.optim.Optimizer], state: dict) -> torch.optim.Optimizer:
    """Unpickle (or deep-copy) a wrapped optimizer: ``cls`` is its class, or the stock class whose
    low-bit subclass it was when that subclass was made at run time (not importable by name)."""
    cls = lowbit_class(cls)
    opt = cls.__new__(cls)
    opt.__setstate__(state)
    return opt


def _make_class(base: type[torch.optim.Optimizer], module: str) -> type[torch.optim.Optimizer]:
    stock_signature = inspect.signature(base.__init__)
    taken = set(stock_signature.parameters)
    own = tuple(k for k in _OPTION_NAMES if k not in taken)  # one the stock class also takes stays the stock one

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        options = {k: kwargs.pop(k) for k in own if k in kwargs}
        refuse_foreign(f"{base.__name__}()", ((k, v) for k, v in kwargs.items() if k not in taken))
        super(cls, self).__init__(*args, **kwargs)
        lowbit_compile(self, **options)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if is_wrapped(self):  # the constructor's groups are checked by lowbit_compile itself
            check_new_group(self, param_group)
        super(cls, self).add_param_group(param_group)

    def __repr__(self) -> str:
        return f"{describe(self)}\n{super(cls, self).__repr__()}"

    def no_step(self) -> contextlib.AbstractContextManager[None]:
        return release.no_step(self)

    no_step.__doc__ = release.no_step.__doc__

    def __getstate__(self) -> dict[str, Any]:
        state = super(cls, self).__getstate__()
        wrapped = wrapped_of(self)
        if wrapped is not None:
            params = [p for group in self.param_groups for p in group["params"]]
            names = [(wrapped.names[p], p) for p in params if p in wrapped.names]
            state = {**state, _STATE_KEY: (wrapped.options, names)}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        saved = state.pop(_STATE_KEY, None)
        super(cls, self).__setstate__(state)
        if saved is not None:
            options, names = saved
            lowbit_compile(self, **options, model=names or None)

    def __reduce_ex__(self, protocol: int) -> tuple:
        # a class made here is rebuilt from its stock class (one made at run time has no import path)
        made_here = type(self).__dict__.get("_lowbit_made", False)
        return _rebuild, (base if made_here else type(self), self.__getstate__())

    def with_options(sub: type, **options: Any) -> type:
        unknown = sorted(set(options) - set(own))
        if unknown:
            raise TypeError(f"{base.__name__}.with_options takes the lowbit_compile options {own}, got {unknown}")

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super(preset, self).__init__(*args, **{**options, **kwargs})

        preset = type(sub.__name__, (sub,), {"__module__": sub.__module__, "__qualname__": sub.__qualname__,
                                              "__slots__": (), "_lowbit_made": True, "__init__": __init__})
        return preset

    with_options.__doc__ = ("A subclass whose constructor defaults to these lowbit_compile options (``model=``, "
                            "``overrides=``, ...), for a framework that takes a class and passes it only the stock "
                            "arguments (HF Trainer's ``optimizer_cls_and_kwargs`` takes ``model`` out of the kwargs).")

    __init__.__signature__ = _signature(stock_signature, own)  # type: ignore[attr-defined]
    __init__.__doc__ = (f"``{base.__module__}.{base.__qualname__}`` with low-bit states: the stock arguments, "
                        f"plus the keyword options of ``lowbit_compile`` ({', '.join(own)}).")
    namespace = {
        "__module__": module, "__qualname__": base.__qualname__, "__slots__": (), "_lowbit_base": base,
        "_lowbit_made": True, "with_options": classmethod(with_options),
        "__doc__": f"{base.__qualname__} with block-quantized 8-bit states: ``lowbit_compile({base.__qualname__}"
                   "(...), **options)`` as one class.\n\n" + (base.__doc__ or ""),
        "__init__": __init__, "__repr__": __repr__, "__getstate__": __getstate__, "__setstate__": __setstate__,
        "__reduce_ex__": __reduce_ex__, "add_param_group": add_param_group, "no_step": no_step,
    }
    cls = type(base.__name__, (base,), namespace)
    return cls


def _signature(stock: inspect.Signature, own: tuple[str, ...]) -> inspect.Signature:
    """The stock constructor's signature with the low-bit options as keyword-only parameters."""
    defaults = inspect.signature(lowbit_compile).parameters
    extra = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=defaults[k].default,
                               annotation=defaults[k].annotation) for k in own]
    params = list(stock.parameters.values())
    var_kw = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    return stock.replace(parameters=[p for p in params if p not in var_kw] + extra + var_kw)


# The stock-step guard leaves alone a wrapped optimizer (its step converts what a loader left in its
# state) and optimizers that are not stock elementwise ones (ZeroRedundancyOptimizer keeps a copy of
# its inner optimizer's state but steps the inner one).
stock.defer_to(lambda opt: is_wrapped(opt) or not isinstance(opt, REWRITTEN))
