"""Which rows each dim-0 shard of a parameter holds (``sharding.shard_ranges``, behind every sharded
checkpoint): ``torch.chunk``'s split, as DTensor's ``Shard`` makes it, on every supported torch."""

from __future__ import annotations

import torch

from lowbit_compile.state.sharding import _chunk


def test_shards_split_rows_as_torch_chunk_with_empty_shards_last():
    for rows in range(0, 40):
        for n in range(1, 9):
            chunks = [(c.shape[0], int(c[0])) for c in torch.arange(rows).chunk(n)] if rows else []
            ours = [_chunk(rows, n, i) for i in range(n)]
            assert ours[:len(chunks)] == chunks, (rows, n)
            assert all(size == 0 and offset == rows for size, offset in ours[len(chunks):]), (rows, n)
