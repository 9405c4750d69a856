"""The registry of element formats: one frozen record per format, from which everything that lists or
switches on formats is derived (``StateFormat``'s properties, the printers' name tables, the C++ enum, the
Triton constexpr ids, the options' help, the monitor's advice, the test lists).

A format is registered once (``builtin.py`` holds the shipped ones); adding one is a record there, its
branch in each kernel library (``kernels/triton_lib.py``, ``kernels/cpu_prelude.h``, under the names the
record gives) and the docs. The completeness tests (``tests/test_format_registry.py``) prove each backend
round-trips every registered format like the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Encode = Callable[..., torch.Tensor]  # (values or codes, the element.StateFormat) -> codes or values
Pair = tuple[float, float]  # a value for a signed state, then for a non-negative one


@dataclass(frozen=True)
class ElementFormat:
    """How one element format stores a normalized value (its block scale applied) in a code.

    Pairs are (signed state, non-negative state). ``unsigned_map``: a non-negative state spends every code
    on ``[0, max]`` (else it takes the signed codes). ``blockwise``: codes are relative to a per-block scale
    (and can carry outlier patches); ``passthrough``: the stock tensor itself (no codes). ``root_domain``:
    the encode takes the value's square root (``element.normalize``), the decode squares. ``special_codes``:
    the code bytes of +inf, -inf and NaN in a flagged block (``blockquant.py``). ``fp8_mantissa``: an fp8
    format's mantissa bits (sign-magnitude codes, rounded by ``element.round_fp8``). ``advice``: what the
    monitor suggests where this format truncates a state. ``fused_cpu_encode``: the C++ kernel encodes a block inside
    the next block's lane loop (a few vector instructions), where it is built for 16 lanes. ``cpp_name`` /
    ``triton_name``: the format's name in the C++ prelude's enum and among ``triton_lib``'s constexprs (None: no kernel
    reads it). ``lookup_table``: the table a Triton kernel of the format reads (the launcher passes it). ``map_version``
    / ``upgrade_codes``: a format whose code map changed saves its version, and converts the codes of older ones on
    load. ``bits``: the bits of one code where it is not the code dtype's width; 4 packs two codes a byte
    (``packing.py``), ``code_dtype`` then naming the dtype of one unpacked code.
    ``default_block_size``: the block a state of the format gets when ``block_size`` is not given (None:
    ``options.DEFAULT_BLOCK_SIZE``; a parameter's states take the smallest of theirs).
    """

    name: str
    code_dtype: tuple[torch.dtype, torch.dtype]
    qmax: Pair
    min_positive: Pair
    encode: Encode
    decode: Encode
    unsigned_map: bool = False
    blockwise: bool = True
    passthrough: bool = False
    root_domain: bool = False
    flagged_qmax: Pair | None = None  # None: qmax
    neg_qmax: float | None = None  # a signed state's most negative code's magnitude, where it is not qmax
    special_codes: tuple[tuple[int, int, int], tuple[int, int, int]] | None = None
    fp8_mantissa: int | None = None
    round_stochastic: Callable[..., torch.Tensor] | None = None  # element.round_stochastic's signature
    advice: str | None = None
    fused_cpu_encode: bool = False
    cpp_name: str | None = None
    triton_name: str | None = None
    lookup_table: Callable[[bool], torch.Tensor] | None = None
    map_version: int | None = None
    upgrade_codes: Callable[..., torch.Tensor] | None = None  # (codes, StateFormat, flagged) -> codes
    bits: int | None = None  # None: the width of code_dtype
    default_block_size: int | None = None

    @property
    def id(self) -> int:
        """The format's number in the kernels (the C++ enum's value, the Triton constexpr's): its place in
        the registry."""
        return list(_REGISTRY).index(self.name)


_REGISTRY: dict[str, ElementFormat] = {}


def register(fmt: ElementFormat) -> ElementFormat:
    """Add ``fmt`` to the registry (after every format registered before: the kernels number formats by
    their place); a name registered twice is an error."""
    if fmt.name in _REGISTRY:
        raise ValueError(f"format {fmt.name!r} is registered already")
    if fmt.blockwise and fmt.special_codes is None:
        raise ValueError(f"blockwise format {fmt.name!r} needs the special codes of a flagged block")
    if fmt.bits not in (None, 4) or (fmt.bits == 4 and (not fmt.blockwise or fmt.default_block_size is None)):
        raise ValueError(f"format {fmt.name!r}: bits is None (its code dtype's width) or 4 (a blockwise format "
                         f"with a default_block_size), got {fmt.bits}")
    _REGISTRY[fmt.name] = fmt
    return fmt


def element_format(name: str) -> ElementFormat:
    """The record of format ``name``; a ValueError naming the registered ones for another name."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; expected one of {format_names()}") from None


def registered() -> tuple[ElementFormat, ...]:
    """Every registered format, in registry order."""
    return tuple(_REGISTRY.values())


def format_names() -> tuple[str, ...]:
    """The names of every registered format, in registry order."""
    return tuple(_REGISTRY)


def passthrough() -> ElementFormat:
    """The registered format that keeps the stock tensor (what small tensors and ``fp32`` overrides keep)."""
    return next(f for f in _REGISTRY.values() if f.passthrough)
