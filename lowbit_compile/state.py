"""``QuantizedState``: one block-quantized optimizer state, kept in ``optimizer.state[p]`` under the
stock key.

It is a tensor subclass with the parameter's shape and the stock state's dtype, so code that walks
optimizer state (``.shape``, ``.norm()``, ``.to(device)``) keeps working: any op other than the few
handled here sees the dequantized values, and an in-place op re-quantizes its result. The step
itself never goes through that path; the runner hands the raw codes to the compiled kernel.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from .kernels import blockquant
from .kernels.formats import StateFormat

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
                storage.codes[start:stop], storage.scales[b0:b1],
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
        flat = blockquant.dequantize(self.storage_parts, self.fmt, dtype or self.dtype)
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
        if handler is not None:
            return handler(*args, **kwargs)
        plain = tree_map(lambda t: t.dequantize() if isinstance(t, QuantizedState) else t, (args, kwargs))
        out = func(*plain[0], **plain[1])
        target = args[0] if args else None
        if isinstance(target, QuantizedState) and func._schema.arguments and func._schema.arguments[0].is_write:
            _copy_into(target, out)
            return target
        return out

    def _map_parts(self, fn) -> QuantizedState:
        return QuantizedState(blockquant.Quantized(*(fn(t) for t in self.storage_parts)), self.fmt,
                              self.shape, self.dtype)


def _copy_into(dst: QuantizedState, src: torch.Tensor) -> None:
    if isinstance(src, QuantizedState) and src.fmt == dst.fmt and src.shape == dst.shape:
        for a, b in zip(dst.storage_parts, src.storage_parts):
            a.copy_(b)
        return
    if isinstance(src, QuantizedState):
        src = src.dequantize()
    src = src.expand(dst.shape) if src.shape != dst.shape else src
    fresh = QuantizedState.from_dense(src.to(dst.device), dst.fmt)
    for a, b in zip(dst.storage_parts, fresh.storage_parts):
        a.copy_(b)


def _copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    if isinstance(dst, QuantizedState):
        _copy_into(dst, src)
    else:
        dst.copy_(src.dequantize() if isinstance(src, QuantizedState) else src, non_blocking)
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
    aten.copy_.default: _copy_,
}
