"""The verbs: ``lowbit_compile(opt)`` switches a stock optimizer to low-bit states, ``restore(opt)`` switches
it back, ``is_wrapped(opt)`` says which it runs.

The optimizer object stays the same instance with the same ``param_groups``; its class becomes the
low-bit subclass of its class (``optim.lowbit_class``; ``lowbit_compile.optim`` names those of the stock
classes), its ``step`` an instance attribute shadowing the class method (``runtime/rewritten_step.py``),
and its state tensors change. Every check runs first (``runtime/wrap.py``): everything that can fail does
so before the optimizer changes.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch

from .formats import format_names
from .optim import lowbit_class, stock_class
from .options import FmtSpec, OptionKeywords, Options, args_doc, entry_signature
from .runtime.wrap import unwrap, wrap
from .runtime.wrapped import wrapped_of

if TYPE_CHECKING:
    from typing_extensions import Unpack  # torch's dependency; only type checkers read it here


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
    wrap(opt, dict(options))
    opt.__class__ = lowbit_class(type(opt))
    return opt


lowbit_compile.__signature__ = entry_signature(  # type: ignore[attr-defined]
    [inspect.Parameter("opt", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="torch.optim.Optimizer")], Options,
    returns="torch.optim.Optimizer")
lowbit_compile.__doc__ = lowbit_compile.__doc__.replace("<OPTIONS>", args_doc(Options, formats=format_names()))


def restore(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Turn a wrapped optimizer back into a stock one: fp32 (stock-dtype) states, the class's step,
    and its stock class again (an optimizer built from a ``lowbit_compile.optim`` class included).

    A 16-bit parameter stepped with master weights keeps its value (its master rounded to nearest even,
    as the fp32 master recipe leaves it) and loses its residual; its states take its dtype, as the stock
    step over it keeps them (take ``master_params(opt)`` first to keep the fp32 masters)."""
    if wrapped_of(opt) is None:
        return opt
    unwrap(opt)
    opt.__class__ = stock_class(type(opt))
    return opt


def is_wrapped(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` runs the low-bit step now (``lowbit_compile`` applied, ``restore`` not since)."""
    return wrapped_of(opt) is not None
