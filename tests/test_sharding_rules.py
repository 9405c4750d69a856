"""The two rules of sharded states, in one process as rank 1 of 2 (torch's fake process group: a mesh of
two ranks, no collective): which states are low-bit is judged on the parameter's global size, never its
shard's, and a sharded load reads the rows of this rank's shard. (tests/test_distributed.py checks both
across real processes, in the slow tier.)"""

from __future__ import annotations

import pytest
import torch

from lowbit_compile import QuantizedState, lowbit_compile
from lowbit_compile.formats import StateFormat
from lowbit_compile.state import codec, sharding

from .helpers import assert_same

SHAPE = (9, 40)  # rank 1 of 2 holds rows 5..9: its first element is not at a block boundary


@pytest.fixture
def rank_1_of_2():
    """The default process group as rank 1 of a world of 2, and the mesh of both ranks."""
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def sharded(full: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's rows of ``full`` as a dim-0 sharded ``DTensor``, as FSDP2 holds a parameter."""
    from torch.distributed.tensor import DTensor, Shard

    start, stop = (full.shape[0] + 1) // 2, full.shape[0]  # torch.chunk's split: rank 1's rows
    return DTensor.from_local(full[start:stop].clone(), mesh, [Shard(0)], run_check=False, shape=full.shape,
                              stride=full.stride())


def test_min_8bit_size_is_judged_on_the_whole_parameter(rank_1_of_2):
    """A parameter of 360 elements, of which this rank holds 160, with ``min_8bit_size=200``: low-bit
    on every rank (its shard alone would be under the threshold), and fp32 from 400 on."""
    param = torch.nn.Parameter(sharded(torch.randn(SHAPE), rank_1_of_2))
    assert sharding.local(param).numel() == 160 and param.numel() == 360
    for threshold, low_bit in ((200, True), (400, False)):
        opt = lowbit_compile(torch.optim.AdamW([param]), "int8", block_size=64, min_8bit_size=threshold,
                             backend="reference")
        param.grad = sharded(torch.randn(SHAPE), rank_1_of_2)
        opt.step()
        state = sharding.local(opt.state[param]["exp_avg"])
        assert isinstance(state, QuantizedState) is low_bit


def test_a_sharded_load_reads_the_rows_of_this_ranks_shard(rank_1_of_2):
    """An unsharded checkpoint loaded by rank 1: its state holds the saved values of rows 5..9 (its
    blocks counted from its own first element, so re-quantized from the saved values), not rows 0..4."""
    fmt = StateFormat("int8", 64, 2, False)
    full = torch.randn(SHAPE)
    saved = QuantizedState.from_dense(full, fmt)
    param = sharded(torch.empty(SHAPE), rank_1_of_2)
    assert sharding.local_rows(param) == (5, 9)
    loaded = sharding.local(codec.unpack(codec.pack(saved, full), param, "exp_avg"))
    expected = QuantizedState.from_dense(saved.dequantize()[5:].contiguous(), fmt)
    assert loaded.shape == (4, 40)
    assert_same(list(loaded.storage_parts), list(expected.storage_parts))
