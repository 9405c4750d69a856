"""The DiT diffusion task of the quality evidence: it trains, its validation splits by noise band, its
sampler is reproducible, and the bench's convergence arithmetic is right."""

from __future__ import annotations

import math

import pytest
import torch

from bench.tasks import DiffusionDigits, Hyper, OptimizerSpec, train

pytest.importorskip("sklearn")


def tiny(**kwargs) -> DiffusionDigits:
    """Width 32, one block (its fc1/fc2 still reach min_8bit_size), a small validation set."""
    return DiffusionDigits(d=32, layers=1, heads=2, val_images=32, val_timesteps=2,
                           hyper=Hyper(steps=40, lr=3e-3, weight_decay=0.0, warmup=5, eval_every=20), **kwargs)


@pytest.mark.slow
def test_an_untrained_dit_predicts_zero_noise_and_training_lowers_the_denoising_loss(one_thread):
    task = tiny()
    untrained = task.evaluate(task.model(0))
    # adaLN-Zero: the read-out starts at 0, so the loss is the mean square of the fixed noise
    assert untrained["loss"] == pytest.approx(task.val_noise.pow(2).mean().item(), rel=1e-6)
    for fmt in ("fp32", "int8"):
        hist = train(task, OptimizerSpec(fmt).build, seed=0)
        assert hist.final["loss"] < 0.8 * untrained["loss"], fmt
        assert hist.val[-1]["loss"] < hist.val[0]["loss"], fmt


def test_validation_reports_each_noise_band_and_their_mean():
    task = tiny()
    out = task.evaluate(task.model(1))
    assert set(out) == {"loss", *DiffusionDigits.BANDS}
    # equal numbers of validation items per band
    assert out["loss"] == pytest.approx(sum(out[b] for b in DiffusionDigits.BANDS) / 3, rel=1e-5)
    lo, hi = DiffusionDigits.BANDS["loss_low"]
    assert ((task.val_t >= lo) & (task.val_t < hi)).sum() == task.val_t.numel() // 3


def test_a_batch_shares_timesteps_per_slice():
    gen = torch.Generator().manual_seed(0)
    _, _, t, _ = tiny().batch(gen)
    assert t.unique().numel() == 1
    _, _, t, _ = tiny(timesteps_per_batch=4).batch(gen)
    assert t.view(4, 4).unique(dim=1).shape == (4, 1)  # four slices, one timestep each
    with pytest.raises(ValueError, match="timesteps_per_batch=3 must divide batch=16"):
        tiny(timesteps_per_batch=3)


def test_samples_are_images_in_range_and_fixed_by_the_generator():
    task = tiny()
    model = task.model(0)
    labels = torch.arange(10)
    a = task.sample(model, labels, torch.Generator().manual_seed(5), steps=4)
    b = task.sample(model, labels, torch.Generator().manual_seed(5), steps=4)
    c = task.sample(model, labels, torch.Generator().manual_seed(6), steps=4)
    assert a.shape == (10, 8, 8) and a.abs().max() <= 1
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_steps_to_a_target_interpolates_between_evaluations():
    from bench.diffusion import decades, steps_to

    assert steps_to([100, 200, 300], [1.0, 0.6, 0.4], 0.5) == pytest.approx(250)
    assert steps_to([100, 200], [0.4, 0.3], 0.5) == 100  # reached at the first evaluation
    assert math.isinf(steps_to([100, 200], [1.0, 0.9], 0.5))
    assert decades([0.0, 1e-3, 1e-1]) == pytest.approx(2.0)


def test_the_step_to_step_swing_ignores_the_trend():
    from bench.diffusion import swing_decades

    trend = [10 ** (-i / 100) for i in range(400)]  # four decades of steady decay
    assert swing_decades(trend) < 0.01
    alternating = [x * (10 if i % 2 else 1) for i, x in enumerate(trend)]  # a factor 10 between neighbours
    assert swing_decades(alternating) == pytest.approx(1.0, abs=0.05)
