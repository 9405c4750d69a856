"""States of sharded (``DTensor``) parameters, as FSDP2's ``fully_shard`` makes them.

Each rank steps and keeps the state of its local shard only. A quantized state of a ``DTensor``
parameter is a ``DTensor`` too, with the parameter's global shape and placements around a
:class:`QuantizedState` of the local shard, so code that walks optimizer state sees what stock
AdamW gives it (``.shape`` is global, ``.full_tensor()`` gathers) and
``torch.distributed.checkpoint`` sees a sharded tensor, never a per-rank plain one (which it would
take for a replica and save from one rank only). Which states are low-bit is decided on the
parameter's global shape (``param.numel()`` of a ``DTensor`` is global), so every rank and every
world size makes the same choice.
"""

from __future__ import annotations

import sys

import torch

from ..formats import StateFormat
from .quantized import QuantizedState


def is_sharded(t: object) -> bool:
    # No DTensor exists before torch.distributed.tensor is imported, so importing lowbit_compile never
    # pays for that import (seconds) itself.
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor inside ``t`` (the very object, not a view), or ``t`` itself."""
    return t._local_tensor if is_sharded(t) else t


def placement(t: torch.Tensor) -> tuple | None:
    """``(device mesh, placements)`` of a ``DTensor``; None for a plain tensor."""
    return (t.device_mesh, tuple(t.placements)) if is_sharded(t) else None


def like(local_value: torch.Tensor, template: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """``local_value`` (this rank's part) as a ``DTensor`` on ``template``'s mesh and placements, of
    global ``shape`` (default: ``template``'s); ``local_value`` itself if ``template`` is not sharded."""
    if not is_sharded(template):
        return local_value
    if shape is None:
        shape, stride = template.shape, template.stride()
    else:
        shape = torch.Size(shape)
        stride = torch.empty(shape, device="meta").stride()
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local_value, template.device_mesh, template.placements, run_check=False,
                              shape=shape, stride=stride)


def is_quantized(value: object) -> bool:
    return isinstance(value, torch.Tensor) and isinstance(local(value), QuantizedState)


def quantize(value: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """``value`` (plain or ``DTensor``, dense or quantized) stored in ``fmt``, sharded like ``value``."""
    dense = local(value)
    if isinstance(dense, QuantizedState):
        dense = dense.dequantize()
    new = dense if fmt.passthrough else QuantizedState.from_dense(dense, fmt)
    return like(new, value)


def dequantize(value: torch.Tensor) -> torch.Tensor:
    """The stock dense tensor of a (possibly sharded) quantized state."""
    return like(local(value).dequantize(), value)


def row_splits(param: torch.Tensor) -> list[int]:
    """Where the dim-0 shards of ``param`` start and end: ``[0, s1, ..., rows]``, the same on every rank."""
    rows = param.shape[0] if param.dim() else 1
    return sorted({0, rows, *(b for r in shard_ranges(param) for b in r)})


def shard_ranges(param: torch.Tensor) -> list[tuple[int, int]]:
    """The rows ``[start, stop)`` of each dim-0 shard of ``param``, one per rank of its mesh's
    sharding dims in mesh order (which is row order; empty shards included), the same on every rank.

    Only dim-0 sharding (FSDP2's default) and replication keep a rank's shard one contiguous range of
    the flattened parameter; other placements are refused here, which is when a checkpoint needs it.
    """
    rows = param.shape[0] if param.dim() else 1
    if not is_sharded(param):
        return [(0, rows)]
    from torch.distributed.tensor import Replicate, Shard

    ranges = [(0, rows)]
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard or placement.dim != 0:
            raise NotImplementedError(
                f"lowbit_compile checkpoints support parameters sharded on dim 0 (FSDP2's default) or "
                f"replicated; this one has placements {param.placements}"
            )
        n = param.device_mesh.size(dim)
        split = []
        for start, stop in ranges:
            for i in range(n):
                size, offset = _chunk(stop - start, n, i)
                split.append((start + offset, start + offset + size))
        ranges = split
    return ranges


def _chunk(size: int, n: int, i: int) -> tuple[int, int]:
    """The size and offset of chunk ``i`` of ``n`` of ``size`` rows, split as ``torch.chunk`` and DTensor's
    ``Shard`` split them (its own helper for this is private before torch 2.10)."""
    full = -(-size // n)
    offset = min(size, full * i)
    return min(size, offset + full) - offset, offset


def local_rows(param: torch.Tensor) -> tuple[int, int]:
    """The global rows ``[start, stop)`` this rank's shard of ``param`` holds."""
    rows = param.shape[0] if param.dim() else 1
    if not is_sharded(param):
        return 0, rows
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return (offset[0], offset[0] + shape[0]) if param.dim() else (0, rows)
