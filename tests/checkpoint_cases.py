"""The cases of the checkpoint fixtures (``tests/fixtures/checkpoints/<layout>/``, read by
``tests/test_checkpoint_fixtures.py``): state dicts saved by the code of the commit that wrote them, for every
format and the states beside the codes (outlier patches, master residuals, rounding counters, SGD, Muon,
Adafactor), each with the step that follows it.

``python -m tests.checkpoint_cases tests/fixtures/checkpoints/v<LAYOUT_VERSION>`` writes them; run it only for a new
layout (``state/codec.py``'s ``LAYOUT_VERSION``): the fixtures already saved are the record of what older releases
wrote, never regenerated.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lowbit_compile import lowbit_compile
from lowbit_compile.checkpoint import LAYOUT_VERSION
from tests.helpers import saved_and_loaded

SHAPES = ((24, 50), (300,), (33, 20))  # rows narrower than a block, a 1-D one, a non-multiple of the block
ADAMW = dict(lr=1e-2, weight_decay=0.1)
CASES = {
    # name: (optimizer class, its kwargs, param dtype, lowbit_compile options)
    **{f"adamw_{fmt}": (torch.optim.AdamW, ADAMW, torch.float32, dict(fmt=fmt))
       for fmt in ("sqrt8", "dynamic8", "int8", "fp8_e4m3", "fp8_e5m2", "bf16", "fp32")},
    "adamw_int8_outliers": (torch.optim.AdamW, ADAMW, torch.float32, dict(fmt="int8", outliers=2)),
    "adamw_mixed_amsgrad": (torch.optim.AdamW, {**ADAMW, "amsgrad": True}, torch.float32,
                            dict(fmt={"exp_avg": "int8", "exp_avg_sq": "sqrt8"})),
    "adamw_bf16_master_exact": (torch.optim.AdamW, ADAMW, torch.bfloat16, dict(master_weights="exact")),
    "adamw_bf16_master_8bit": (torch.optim.AdamW, ADAMW, torch.bfloat16, dict(master_weights="8bit")),
    "adamw_stochastic": (torch.optim.AdamW, ADAMW, torch.float32, dict(rounding="stochastic")),
    "adamw_stochastic_v_outliers": (torch.optim.AdamW, ADAMW, torch.float32,
                                    dict(fmt="int8", outliers=1, rounding={"exp_avg_sq": "stochastic"})),
    "sgd_momentum": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9), torch.float32, dict(fmt="int8")),
    "muon": (torch.optim.Muon, dict(lr=0.02), torch.float32, dict()),
    "adafactor": (torch.optim.Adafactor, dict(lr=1e-2), torch.float32, dict(fmt="int8")),
}
# rounding to nearest unless a case names it: the default of layout v0's code (issue 49 made v round
# stochastically by default; the cases keep what their checkpoints were saved with)
COMMON = dict(block_size=256, min_8bit_size=0, rounding="nearest")


def shapes_of(cls: type) -> tuple:
    """Muon steps matrices only."""
    return tuple(s for s in SHAPES if len(s) == 2) if cls is torch.optim.Muon else SHAPES


def grads(name: str, shapes: tuple, dtype: torch.dtype, steps: int) -> list[list[torch.Tensor]]:
    """Deterministic grads of each step (with a few spikes, so that patches are used)."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    out = []
    for _ in range(steps):
        gs = []
        for s in shapes:
            g = torch.randn(s, generator=gen) * 0.1
            g.view(-1)[:: 97] *= 50.0
            gs.append(g.to(dtype))
        out.append(gs)
    return out


def wrapped(name: str, params: list[torch.nn.Parameter], backend: str) -> torch.optim.Optimizer:
    cls, kwargs, _, options = CASES[name]
    return lowbit_compile(cls(params, **kwargs), **{**COMMON, **options}, backend=backend)


def step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], gs: list[torch.Tensor]) -> None:
    for p, g in zip(params, gs):
        p.grad = g.clone()
    opt.step()


def make(name: str) -> dict:
    """Three steps on the C++ kernel, the state dict, then the fourth step on the reference backend from a
    fresh optimizer that loaded it (what the test repeats)."""
    cls, _, dtype, _ = CASES[name]
    shapes = shapes_of(cls)
    gen = torch.Generator().manual_seed(len(name))
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
    gs = grads(name, shapes, dtype, 4)
    opt = wrapped(name, params, "cpu")
    for g in gs[:3]:
        step(opt, params, g)
    saved = [p.detach().clone() for p in params]
    state_dict = saved_and_loaded(opt.state_dict())  # a copy: the live state dict's tensors are the state's
    resumed = [torch.nn.Parameter(p.clone()) for p in saved]
    again = wrapped(name, resumed, "reference")
    again.load_state_dict(saved_and_loaded(state_dict))  # a stock load keeps the step tensors it is given
    step(again, resumed, gs[3])
    return {"version": LAYOUT_VERSION, "case": name, "params": saved, "grads": gs[3], "state_dict": state_dict,
            "params_after": [p.detach().clone() for p in resumed], "state_dict_after": saved_and_loaded(again.state_dict())}


def main(out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    for name in CASES:
        torch.save(make(name), Path(out) / f"{name}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
