"""Low-bit optimizer classes to name in a config: ``lowbit_compile.optim.AdamW(params, lr=3e-4, fmt="int8")``,
and the factory that makes them.

Each class is a subclass of the stock ``torch.optim`` class of the same name whose constructor takes
the stock arguments plus the options of ``lowbit_compile`` and wraps itself, so HF
``optimizer_cls_and_kwargs``, Lightning CLI ``class_path``, Hydra ``_target_`` and torchtune
``_component_`` can select it by import path: one for every optimizer ``lowbit_compile`` rewrites
(``runtime.wrap.REWRITTEN``). ``lowbit_compile(opt)`` turns a stock optimizer into an instance of the same
classes (``opt.__class__`` is swapped; a subclass is made once for an optimizer of one's own) and
``restore(opt)`` swaps it back, so a wrapped optimizer is still an instance of its stock class, prints which
formats it keeps, and survives ``copy.deepcopy``, ``pickle`` and ``torch.save`` as a wrapped optimizer
(pickles name :func:`_rebuild` here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any

import torch

from .memory import memory_report
from .options import PARAM_DTYPE_NAMES, Options, entry_signature, refuse_foreign
from .runtime import release
from .runtime.wrap import REWRITTEN, check_new_group, wrap
from .runtime.wrapped import wrapped_of
from .state import QuantizedState

# The keyword arguments of ``lowbit_compile`` the constructors take besides the stock ones.
_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(Options))
_STATE_KEY = "_lowbit_options"  # where __getstate__ keeps the options a copy is wrapped with

_DTYPE_NAMES = {**dict(zip((torch.float32, torch.bfloat16, torch.float16), PARAM_DTYPE_NAMES)), torch.float64: "fp64"}
_classes: dict[type, type] = {}  # stock class -> its low-bit subclass


def lowbit_class(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """The low-bit subclass of optimizer class ``cls`` (``cls`` itself if it already is one)."""
    if getattr(cls, "_lowbit_base", None) is not None:
        return cls
    made = _classes.get(cls)
    if made is None:
        # a stock class lowbit_compile.optim names is made there; one of one's own is made at run time
        made = _classes[cls] = _make_class(cls, __name__ if cls in REWRITTEN else cls.__module__)
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
                if isinstance(value, QuantizedState):  # the block too: block_size=None leaves it to the format
                    fmt = value.fmt
                    label = f"{fmt.name} in blocks of {fmt.block_size}" if fmt.blockwise else fmt.name
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
        wrap(self, options)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if wrapped_of(self) is not None:  # the constructor's groups are checked by the wrap itself
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
            wrap(self, {**options, "model": names or None})

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
    defaults = entry_signature([], Options).parameters
    extra = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=defaults[k].default,
                               annotation=defaults[k].annotation) for k in own]
    params = list(stock.parameters.values())
    var_kw = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    return stock.replace(parameters=[p for p in params if p not in var_kw] + extra + var_kw)


# One class per optimizer lowbit_compile rewrites, importable as lowbit_compile.optim.<Name>.
for _stock in REWRITTEN:
    globals()[_stock.__name__] = lowbit_class(_stock)
del _stock

__all__ = sorted([c.__name__ for c in REWRITTEN]) + ["describe", "lowbit_class", "stock_class"]
