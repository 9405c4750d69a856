"""The bench's plain-torch prototype of stochastic rounding (bench/rounding.py, not the library feature):
unbiased on every format, faithful to the library when rounding to nearest, reproducible from its seed."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from bench.rounding import check_name, code_values, library_has_rounding, make_optimizer, round_trip
from bench.tasks import Digits, Hyper, train
from lowbit_compile.formats import StateFormat

from .helpers import KERNEL_FORMATS

FORMATS = KERNEL_FORMATS
HYPER = Hyper(steps=10, lr=1e-3, weight_decay=0.01, warmup=1, eval_every=5)


def between_codes(fmt: StateFormat, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` values each a random fraction in [0.1, 0.9] of the way between two neighbouring code values
    (after a first element that sets the block's scale to exactly 2**-12), and those code gaps."""
    if fmt.name == "bf16":
        below = torch.randn(n, generator=gen).to(torch.bfloat16).float()
        above = (below.view(torch.int32) + 0x10000).view(torch.float32)  # the next bf16 away from 0
        if fmt.nonneg:
            below, above = below.abs(), above.abs()
    else:
        values = code_values(fmt)
        first = 1 if fmt.nonneg else 0  # from 0 a non-negative state rounds up only: tested below
        i = torch.randint(first, len(values) - 1, (n,), generator=gen)
        below, above = values[i] * 2.0**-12, values[i + 1] * 2.0**-12
    x = below + (above - below) * (0.1 + 0.8 * torch.rand(n, generator=gen))
    if fmt.blockwise:
        x[0], below[0], above[0] = fmt.qmax * 2.0**-12, 0.0, 0.0  # the block maximum: exact
    return x, above - below


@pytest.mark.parametrize("nonneg", [False, True], ids=["signed", "nonneg"])
@pytest.mark.parametrize("name", FORMATS)
def test_stochastic_round_trip_is_unbiased(name, nonneg, one_thread):
    fmt = StateFormat.make(name, 512, 0, nonneg)
    gen = torch.Generator().manual_seed(0)
    x, gap = between_codes(fmt, 512, gen)
    n = 2000
    draws = round_trip(x.repeat(n), fmt, gen).view(n, 512).double()  # n blocks, each a copy of x
    assert ((draws.max(0).values - draws.min(0).values).double() <= gap.double().abs() * (1 + 1e-6)).all()  # neighbours
    assert (draws.std(0)[1:] > 0).all()  # random, not a disguised nearest
    # each draw is one of the two neighbours, so its std is at most gap / 2
    bound = 5 * gap.double().abs() / 2 / n**0.5 + 1e-6 * x.double().abs()
    assert ((draws.mean(0) - x.double()).abs() <= bound).all()


def test_a_positive_nonneg_value_below_the_first_code_rounds_up_never_to_zero():
    fmt = StateFormat.make("int8", 512, 0, True)
    x = torch.full((512,), 2.0**-14)  # a quarter of the first code (scale 2**-12)
    x[0] = fmt.qmax * 2.0**-12
    draws = torch.stack([round_trip(x, fmt, torch.Generator().manual_seed(s)) for s in range(50)])
    assert (draws[:, 1:] == 2.0**-12).all()


@pytest.mark.slow
@pytest.mark.parametrize("name", FORMATS)
def test_nearest_prototype_tracks_the_library(name, one_thread):
    torch.manual_seed(0)
    lib, proto = torch.nn.Linear(128, 64), torch.nn.Linear(128, 64)
    proto.load_state_dict(lib.state_dict())
    opts = [make_optimizer(v)(list(m.parameters()), HYPER) for v, m in ((name + "+nearest", lib), (name + "+nearest-proto", proto))]
    for _ in range(10):
        x = torch.randn(32, 128)
        for m, opt in zip((lib, proto), opts):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    # the same codes; only the fp32 arithmetic of the fused kernel and of torch differ (a 1e-5 lr apart seen)
    assert (lib.weight - proto.weight).abs().max() < 1e-3 * HYPER.lr


def test_stochastic_prototype_is_reproducible_from_its_seed(one_thread):
    def run(seed):
        torch.manual_seed(0)
        m = torch.nn.Linear(128, 64)
        opt = make_optimizer("dynamic8+sr-proto", seed=seed)(list(m.parameters()), HYPER)
        for i in range(3):
            x = torch.randn(32, 128, generator=torch.Generator().manual_seed(i))
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
        return opt.state[m.weight]["exp_avg"].clone()

    assert torch.equal(run(0), run(0)) and not torch.equal(run(0), run(1))


def test_names_fail_before_a_grid_starts():
    with pytest.raises(ValueError, match=r"unknown rounding suffix \+sr2"):
        check_name("dynamic8+sr2")
    with pytest.raises(ValueError, match="our formats only"):
        check_name("bnb-AdamW8bit+sr-proto")
    if not library_has_rounding():
        with pytest.raises(ValueError, match="no rounding= option yet; .* dynamic8\\+sr-proto"):
            check_name("dynamic8+sr")
    check_name("int8-b2048-k0+nearest-proto")
    with pytest.raises(ValueError, match=r"\+perturbed applies to fp32"):
        check_name("sqrt8+perturbed")


def test_perturbed_fp32_trains_off_stock_adamw_by_float_rounding_only():
    """The noise floor of the long run's paired gaps: stock AdamW whose beta2 is one float32 step larger
    must change the trajectory (``train`` resets the lr every step, so the lr cannot carry it), by little."""
    task = Digits()
    task.hyper = replace(task.hyper, steps=20, eval_every=20)
    runs = {}
    for name in ("fp32", "fp32+perturbed"):
        built: list[torch.optim.Optimizer] = []
        make = make_optimizer(name)
        hist = train(task, lambda params, hyper, make=make, built=built: built.append(make(params, hyper)) or built[0],
                     seed=0)
        assert type(built[0]) is torch.optim.AdamW
        runs[name] = (built[0].param_groups[0]["betas"][1], hist.train_loss)
    (b_stock, stock), (b_pert, pert) = runs["fp32"], runs["fp32+perturbed"]
    assert b_pert > b_stock and torch.tensor(b_pert, dtype=torch.float32) > torch.tensor(b_stock, dtype=torch.float32)
    assert pert != stock and stock[0] == pert[0]
    assert max(abs(a / b - 1) for a, b in zip(pert, stock)) < 1e-3
