"""``QuantizedState``: one block-quantized optimizer state, kept in ``optimizer.state[p]`` under the
stock key.

It is a tensor subclass with the parameter's shape and the stock state's dtype, so code that walks
optimizer state (``.shape``, ``.norm()``, ``.to(device)``) keeps working: any op other than the few
handled here sees the dequantized values, and an in-place op (on the state or on a slice of it,
``state[:10] = 0``, ``state[3].zero_()``) writes through, re-encoding exactly the blocks whose
values change. The step itself never goes through that path; the runner hands the raw codes to the
compiled kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ..formats import StateFormat, blockquant

aten = torch.ops.aten
_PARTS = ("codes", "scales", "patch_values", "patch_index")


class QuantizedState(torch.Tensor):
    """A per-element optimizer state stored as codes + per-block scales + 16-bit outlier patches."""

    codes: torch.Tensor
    scales: torch.Tensor
    patch_values: torch.Tensor
    patch_index: torch.Tensor
    fmt: StateFormat

    @staticmethod
    def __new__(cls, storage: blockquant.Quantized, fmt: StateFormat, shape: torch.Size, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=storage.codes.device, requires_grad=False
        )

    def __init__(self, storage: blockquant.Quantized, fmt: StateFormat, shape: torch.Size, dtype: torch.dtype):
        self.codes, self.scales, self.patch_values, self.patch_index = storage
        self.fmt = fmt

    @property
    def storage_parts(self) -> blockquant.Quantized:
        return blockquant.Quantized(self.codes, self.scales, self.patch_values, self.patch_index)

    @property
    def nbytes_held(self) -> int:
        """Bytes actually allocated for this state (codes, scales and patches)."""
        return sum(t.numel() * t.element_size() for t in self.storage_parts)

    @property
    def nbytes(self) -> int:  # type: ignore[override]
        """Bytes actually held (codes, scales and patches), not ``numel() * dtype.itemsize``."""
        return self.nbytes_held

    def element_size(self) -> int:  # type: ignore[override]
        """Bytes of one code (``nbytes`` adds the per-block scales and patches)."""
        return self.codes.element_size()

    # construction -----------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, x: torch.Tensor, fmt: StateFormat, chunk_blocks: int = 512) -> QuantizedState:
        """Quantize ``x``; it is read ``chunk_blocks`` blocks at a time, so a large non-contiguous or
        low-precision ``x`` never needs a full fp32 copy."""
        n = x.numel()
        storage = blockquant.empty(n, fmt, x.device)
        flat = x.reshape(-1)
        step = chunk_blocks * fmt.block_size if fmt.blockwise else max(n, 1)
        for start in range(0, n, step):
            stop = min(n, start + step)
            b0, b1 = (start // fmt.block_size, -(-stop // fmt.block_size)) if fmt.blockwise else (0, 0)
            part = blockquant.Quantized(
                storage.codes[fmt.storage_numel(start):fmt.storage_numel(stop)], storage.scales[b0:b1],
                storage.patch_values[b0:b1], storage.patch_index[b0:b1],
            )
            blockquant.quantize_into(flat[start:stop], part, fmt)
        return cls(storage, fmt, x.shape, x.dtype)

    @classmethod
    def full(cls, shape: torch.Size, value: float, fmt: StateFormat, dtype: torch.dtype,
             device: torch.device) -> QuantizedState:
        return cls(blockquant.full(shape.numel(), value, fmt, device), fmt, shape, dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The values as a plain tensor of the stock state's shape and dtype (or ``dtype``)."""
        flat = blockquant.dequantize(self.storage_parts, self.fmt, dtype or self.dtype, self.shape.numel())
        return flat.view(self.shape)

    # tensor protocol --------------------------------------------------------------------------
    def __repr__(self) -> str:
        return (f"QuantizedState(shape={tuple(self.shape)}, dtype={self.dtype}, format={self.fmt.tag()}, "
                f"device={self.device})")

    def __tensor_flatten__(self):
        return list(_PARTS), (self.fmt, self.shape, self.dtype)

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, meta: tuple, outer_size, outer_stride) -> QuantizedState:
        fmt, shape, dtype = meta
        return cls(blockquant.Quantized(*(inner[p] for p in _PARTS)), fmt, shape, dtype)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None and isinstance(args[0], QuantizedState):
            return handler(*args, **kwargs)
        return _dispatch(func, args, kwargs)

    def _map_parts(self, fn) -> QuantizedState:
        return QuantizedState(blockquant.Quantized(*(fn(t) for t in self.storage_parts)), self.fmt,
                              self.shape, self.dtype)


class StateView(torch.Tensor):
    """A view (slice, select, transpose, ...) of a :class:`QuantizedState`: reads see the
    dequantized values; an in-place op writes through into the state it views."""

    base: QuantizedState

    @staticmethod
    def __new__(cls, base: QuantizedState, view: Callable[[torch.Tensor], torch.Tensor]):
        meta = view(torch.empty(base.shape, dtype=base.dtype, device="meta"))
        return torch.Tensor._make_wrapper_subclass(cls, meta.shape, strides=meta.stride(), dtype=base.dtype,
                                                   device=base.device, requires_grad=False)

    def __init__(self, base: QuantizedState, view: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.base, self.view_of = base, view

    def __repr__(self) -> str:
        return f"StateView(shape={tuple(self.shape)}, of {self.base!r})"

    def dequantize(self) -> torch.Tensor:
        return self.view_of(self.base.dequantize())

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def _base_and_view(t: QuantizedState | StateView) -> tuple[QuantizedState, Callable[[torch.Tensor], torch.Tensor]]:
    return (t.base, t.view_of) if isinstance(t, StateView) else (t, lambda dense: dense)


def _plain(tree: Any) -> Any:
    return tree_map(lambda t: t.dequantize() if isinstance(t, (QuantizedState, StateView)) else t, tree)


def _dispatch(func, args: tuple, kwargs: dict) -> Any:
    """An op on a state or a view of one: views compose, writes go through, the rest sees values."""
    target = args[0] if args else None
    ours = isinstance(target, (QuantizedState, StateView))
    if ours and func.is_view:
        base, outer = _base_and_view(target)
        rest = args[1:]
        view = lambda dense: func(outer(dense), *rest, **kwargs)
        shaped = view(torch.empty(base.shape, dtype=base.dtype, device="meta"))
        if isinstance(shaped, (tuple, list)):  # unbind, split: one view per output
            return [StateView(base, lambda dense, i=i: view(dense)[i]) for i in range(len(shaped))]
        return StateView(base, view)
    schema = func._schema.arguments
    if ours and schema and schema[0].is_write:
        base, view = _base_and_view(target)
        dense = base.dequantize()
        func(view(dense), *_plain(args[1:]), **_plain(kwargs))
        write_values(base, dense)
        return target
    written = [args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(schema) if a.is_write]
    if any(isinstance(t, (QuantizedState, StateView)) for t in written):
        raise NotImplementedError(f"{func} writes into a low-bit optimizer state through an out= argument, which "
                                  "lowbit_compile does not support; assign the result (state.copy_(result)) instead")
    return func(*_plain(args), **_plain(kwargs))


def write_values(dst: QuantizedState, values: torch.Tensor) -> None:
    """Store ``values`` (broadcast to ``dst``'s shape) in ``dst``, re-encoding only the blocks (or,
    for a format without blocks, the elements) whose values change: the others keep their bits."""
    values = values.to(device=dst.device, dtype=dst.dtype).expand(dst.shape).reshape(-1)
    old = dst.dequantize().reshape(-1)
    changed = (values != old) & ~(values.isnan() & old.isnan())
    if not bool(changed.any()):
        return
    fmt, n = dst.fmt, values.numel()
    if not fmt.blockwise:
        index = changed.nonzero().squeeze(1)
        bits_of(dst.codes)[index] = bits_of(blockquant.quantize(values[index], fmt).codes)
        return
    b, nb = fmt.block_size, dst.scales.numel()
    blocks = torch.unique(changed.nonzero().squeeze(1) // b)
    padded = torch.nn.functional.pad(values.float(), (0, nb * b - n)).view(nb, b)
    fresh = blockquant.quantize(padded[blocks].reshape(-1), fmt)  # a partial block keeps its zero padding
    element = (blocks[:, None] * b + torch.arange(b, device=dst.device)).reshape(-1)
    inside = element < n
    if fmt.packed:  # whole blocks are whole bytes (an even block size), the last one's too
        byte = (blocks[:, None] * (b // 2) + torch.arange(b // 2, device=dst.device)).reshape(-1)
        kept = byte < dst.codes.numel()
        dst.codes[byte[kept]] = fresh.codes[kept]
    else:
        bits_of(dst.codes)[element[inside]] = bits_of(fresh.codes)[inside]
    dst.scales[blocks] = fresh.scales
    dst.patch_values[blocks] = fresh.patch_values
    dst.patch_index[blocks] = fresh.patch_index


def bits_of(codes: torch.Tensor) -> torch.Tensor:
    """Codes viewed as integers of their width (indexed writes work on those for every code dtype)."""
    return codes.view({1: torch.uint8, 2: torch.int16}[codes.element_size()])


def _copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    if isinstance(src, QuantizedState) and src.fmt == dst.fmt and src.shape == dst.shape:
        for a, b in zip(dst.storage_parts, src.storage_parts):
            a.copy_(b)
    else:
        write_values(dst, _plain(src))
    return dst


def _to_copy(self: QuantizedState, *, dtype=None, layout=None, device=None, pin_memory=None,
             non_blocking=False, memory_format=None) -> torch.Tensor:
    if dtype not in (None, self.dtype):
        return self.dequantize(dtype).to(device=device) if device else self.dequantize(dtype)
    if device is None:
        return self._map_parts(torch.clone)
    return self._map_parts(lambda t: t.to(device, non_blocking=non_blocking))


def _view(self: QuantizedState, size: list[int]) -> QuantizedState:
    """A reshape shares the storage: codes are kept flat, in the state's logical element order
    (``DTensor.from_local``/``to_local`` take such a view of the local shard)."""
    shape = torch.empty(self.shape, device="meta").view(size).shape
    return QuantizedState(self.storage_parts, self.fmt, shape, self.dtype)


_HANDLERS = {
    aten.view.default: _view,
    aten.detach.default: lambda self: self._map_parts(lambda t: t),
    aten.clone.default: lambda self, memory_format=None: self._map_parts(torch.clone),
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,  # into a QuantizedState; a copy into a view or a plain tensor is generic
}
