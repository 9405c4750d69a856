"""Low-bit optimizer classes to name in a config: ``lowbit_compile.optim.AdamW(params, lr=3e-4, fmt="int8")``.

Each class is a subclass of the stock ``torch.optim`` class of the same name whose constructor takes
the stock arguments plus the options of ``lowbit_compile`` and wraps itself, so HF
``optimizer_cls_and_kwargs``, Lightning CLI ``class_path``, Hydra ``_target_`` and torchtune
``_component_`` can select it by import path. ``lowbit_compile(opt)`` turns a stock optimizer into
an instance of the same classes (``opt.__class__`` is swapped; a subclass is made once for an
optimizer of one's own) and ``restore(opt)`` swaps it back, so a wrapped optimizer is still an
instance of its stock class, prints which formats it keeps, and survives ``copy.deepcopy``,
``pickle`` and ``torch.save`` as a wrapped optimizer.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from . import api  # the classes wrap themselves with api.lowbit_compile (api imports this module)
from .memory import memory_report
from .state import QuantizedState

# The keyword arguments of ``lowbit_compile`` the constructors take besides the stock ones.
OPTIONS = ("fmt", "block_size", "outliers", "min_8bit_size", "backend", "overrides", "master_weights", "rounding",
           "model")
_STATE_KEY = "_lowbit_options"  # where __getstate__ keeps the options a copy is wrapped with

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
_classes: dict[type, type] = {}  # stock class -> its low-bit subclass


def lowbit_class(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """The low-bit subclass of optimizer class ``cls`` (``cls`` itself if it already is one)."""
    if getattr(cls, "_lowbit_base", None) is not None:
        return cls
    made = _classes.get(cls)
    if made is None:
        made = _classes[cls] = _make_class(cls, cls.__module__)
    return made


def stock_class(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """The class ``restore`` gives back: the stock class a low-bit class was made for. A class
    derived from a low-bit one (``class Mine(lowbit_compile.optim.AdamW)``) stays as it is."""
    return cls._lowbit_base if cls.__dict__.get("_lowbit_made") else cls


def describe(opt: torch.optim.Optimizer) -> str:
    """The header ``repr`` prints before the stock text: the options and the formats held per state."""
    wrapped = getattr(opt, api._ATTR, None)
    if wrapped is None:
        return f"{type(opt).__name__} (lowbit-compile, not wrapped: stock states)"
    options = {k: v for k, v in wrapped.options.items()
               if k not in ("overrides", "master_weights", "rounding") or (v and v != "nearest")}
    head = "lowbit-compile: " + ", ".join(f"{k}={v!r}" for k, v in options.items())
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
    own = tuple(k for k in OPTIONS if k not in taken)  # an option the stock class also takes stays the stock one's

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        options = {k: kwargs.pop(k) for k in own if k in kwargs}
        super(cls, self).__init__(*args, **kwargs)
        api.lowbit_compile(self, **options)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if api.is_wrapped(self):  # the constructor's groups are checked by lowbit_compile itself
            api.check_new_group(self, param_group)
        super(cls, self).add_param_group(param_group)

    def __repr__(self) -> str:
        return f"{describe(self)}\n{super(cls, self).__repr__()}"

    def __getstate__(self) -> dict[str, Any]:
        state = super(cls, self).__getstate__()
        wrapped = getattr(self, api._ATTR, None)
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
            api.lowbit_compile(self, **options, model=names or None)

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
        "__reduce_ex__": __reduce_ex__, "add_param_group": add_param_group,
    }
    cls = type(base.__name__, (base,), namespace)
    return cls


def _signature(stock: inspect.Signature, own: tuple[str, ...]) -> inspect.Signature:
    """The stock constructor's signature with the low-bit options as keyword-only parameters."""
    defaults = inspect.signature(api.lowbit_compile).parameters
    extra = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=defaults[k].default,
                               annotation=defaults[k].annotation) for k in own]
    params = list(stock.parameters.values())
    var_kw = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    return stock.replace(parameters=[p for p in params if p not in var_kw] + extra + var_kw)


# One class per supported stock optimizer, importable as lowbit_compile.optim.<Name>.
for _stock in api.REWRITTEN:
    _classes[_stock] = globals()[_stock.__name__] = _make_class(_stock, __name__)
del _stock

Adam = _classes[torch.optim.Adam]
AdamW = _classes[torch.optim.AdamW]
SGD = _classes[torch.optim.SGD]
RMSprop = _classes[torch.optim.RMSprop]
Adagrad = _classes[torch.optim.Adagrad]
Adamax = _classes[torch.optim.Adamax]
NAdam = _classes[torch.optim.NAdam]
RAdam = _classes[torch.optim.RAdam]
Adadelta = _classes[torch.optim.Adadelta]
ASGD = _classes[torch.optim.ASGD]
Rprop = _classes[torch.optim.Rprop]
Muon = _classes[torch.optim.Muon]

__all__ = ["ASGD", "SGD", "Adadelta", "Adagrad", "Adam", "AdamW", "Adamax", "Muon", "NAdam", "RAdam", "RMSprop",
           "Rprop", "lowbit_class", "stock_class"]
