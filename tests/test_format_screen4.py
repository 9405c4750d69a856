"""The 4-bit maps of the format screen (``bench/format_screen4.py``): each round-trips its codes, a positive
second moment never decodes to 0 (to nearest or stochastically), and stochastic rounding is unbiased."""

from __future__ import annotations

import pytest
import torch

from bench.format_screen4 import maps, maps_registered, table
from lowbit_compile.formats import StateFormat, decode, encode, format_names
from lowbit_compile.formats.rounding import state_draws

NAMES = tuple(maps())


@pytest.fixture(scope="module", autouse=True)
def registered():
    with maps_registered():
        yield
    assert not set(NAMES) & set(format_names())  # gone again: the registry's own tests never see them


@pytest.mark.parametrize("nonneg", [False, True], ids=["m", "v"])
@pytest.mark.parametrize("name", NAMES)
def test_every_code_round_trips(name, nonneg):
    fmt = StateFormat(name, 128, 0, nonneg)
    values = table(name, nonneg).values
    codes = torch.arange(len(values), dtype=torch.uint8)
    assert torch.equal(decode(codes, fmt), values)
    assert torch.equal(encode(values, fmt), codes)
    assert len(values) <= 16 and float(values.abs().max()) == 1.0


@pytest.mark.parametrize("name", NAMES)
def test_positive_v_never_decodes_to_zero(name):
    fmt = StateFormat(name, 128, 0, True)
    x = torch.tensor([1e-38, 1e-20, 1e-8, 1e-4, 1e-3, 0.004, 0.5, 1.0]).repeat(64)
    nearest = decode(encode(x, fmt), fmt)
    stochastic = decode(encode(x, fmt, draws=state_draws(3, 1, x.numel())), fmt)
    assert bool((nearest > 0).all()) and bool((stochastic > 0).all())


@pytest.mark.parametrize("nonneg", [False, True], ids=["m", "v"])
@pytest.mark.parametrize("name", NAMES)
def test_stochastic_rounding_is_unbiased_between_codes(name, nonneg):
    fmt = StateFormat(name, 128, 0, nonneg)
    values = table(name, nonneg).values
    lo, hi = (values[-3], values[-2])
    x = torch.full((1 << 16,), float(lo + 0.3 * (hi - lo)))
    out = decode(encode(x, fmt, draws=state_draws(5, 1, x.numel())), fmt)
    assert set(out.unique().tolist()) <= {float(lo), float(hi)}
    assert abs(float(out.double().mean()) - float(x[0])) < 0.01 * float(hi - lo)
