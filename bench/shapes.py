"""The parameter sets the benchmarks and the tests step: a small GPT's shapes and a small transformer block's."""

from __future__ import annotations

import torch


def transformer_params(d: int = 128, layers: int = 2, vocab: int = 512) -> list[torch.nn.Parameter]:
    """Shapes of a small GPT: embeddings, attention and MLP matrices, norms and biases."""
    shapes = [(vocab, d), (256, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    shapes += [(d,), (d,)]
    return [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]


def model_params() -> list[torch.nn.Parameter]:
    """Shapes of a small transformer block: matrices, vectors, a scalar, a non-contiguous weight."""
    shapes = [(96, 32), (32,), (32, 96), (96,), (), (7, 5, 3)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    params.append(torch.nn.Parameter(torch.randn(40, 24).t()))  # non-contiguous param
    return params
