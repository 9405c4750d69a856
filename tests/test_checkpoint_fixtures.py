"""Checkpoints saved by earlier releases (``tests/fixtures/checkpoints/<layout>/``, written by
``tests/checkpoint_cases.py`` with that release's code) load, save back unchanged and resume bit for bit: every format, outlier
patches, master residuals, rounding counters, SGD, Muon and Adafactor.

The step after loading of the two stochastic cases (``params_after``, ``state_dict_after``) was recomputed
when issue 49 changed the draws to 16 bits (the same params, other codes); their saved states are v0's as
written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import checkpoint_cases as make
from tests.helpers import assert_same, saved_and_loaded

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "checkpoints").glob("v*/*.pt"))


def test_every_layout_has_fixtures_of_every_case():
    layouts = {f.parent.name for f in FIXTURES}
    assert layouts, "no checkpoint fixtures"
    for layout in layouts:
        assert {f.stem for f in FIXTURES if f.parent.name == layout} == set(make.CASES), layout


def loaded(path: Path) -> tuple[dict, list[torch.nn.Parameter], torch.optim.Optimizer]:
    """The fixture, its params and a reference-backend optimizer that loaded its state dict."""
    fixture = torch.load(path, weights_only=True)
    params = [torch.nn.Parameter(p.clone()) for p in fixture["params"]]
    opt = make.wrapped(fixture["case"], params, "reference")
    opt.load_state_dict(saved_and_loaded(fixture["state_dict"]))  # a stock load keeps the step tensors it is given
    return fixture, params, opt


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: f"{p.parent.name}-{p.stem}")
def test_an_old_checkpoint_saves_back_unchanged(path, one_thread):
    fixture, _, opt = loaded(path)
    assert_same(saved_and_loaded(opt.state_dict()), fixture["state_dict"], "saved back")


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: f"{p.parent.name}-{p.stem}")
def test_an_old_checkpoint_resumes_bit_for_bit(path, one_thread):
    fixture, params, opt = loaded(path)
    make.step(opt, params, fixture["grads"])
    assert_same([p.detach() for p in params], fixture["params_after"], "params")
    assert_same(saved_and_loaded(opt.state_dict()), fixture["state_dict_after"], "state after the step")
