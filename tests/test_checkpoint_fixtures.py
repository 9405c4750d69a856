"""Checkpoints saved by earlier releases (``tests/fixtures/checkpoints/<layout>/``, written by
``tests/checkpoint_cases.py`` with that release's code) load, save back as this version saves them and resume bit
for bit: every format, outlier patches, master residuals, rounding counters, SGD, Muon and Adafactor. A checkpoint
of layout 0 (saved before packed states carried their ``LAYOUT_VERSION``) saves back the same bytes with every packed
state carrying the current version; one of the current layout saves back unchanged. A layout newer than this
version reads is refused, naming the version and the fix.

The step after loading of the two stochastic cases (``params_after``, ``state_dict_after``) was recomputed
when issue 49 changed the draws to 16 bits (the same params, other codes); their saved states are v0's as
written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lowbit_compile.checkpoint import LAYOUT_VERSION
from lowbit_compile.state import codec
from tests import checkpoint_cases as make
from tests.helpers import assert_same, saved_and_loaded

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "checkpoints").glob("v*/*.pt"))


def test_every_layout_has_fixtures_of_every_case():
    layouts = {f.parent.name for f in FIXTURES}
    assert layouts == {f"v{v}" for v in range(LAYOUT_VERSION + 1)}, "a layout without fixtures"
    for layout in layouts:
        assert {f.stem for f in FIXTURES if f.parent.name == layout} == set(make.CASES), layout


def _packed(value: object) -> bool:
    return isinstance(value, dict) and any(is_packed(value) for is_packed in (
        codec.is_packed, codec.is_packed_residual, codec.is_packed_ties, codec.is_packed_counter))


def as_saved_now(state_dict: dict) -> dict:
    """A state dict an older layout saved, as this version saves it back: every packed state (a refused one
    under its ``lowbit_`` key too) carries the current layout version, the rest stays as it was."""
    state = {idx: {k: ({**v, "lowbit_layout": LAYOUT_VERSION} if _packed(v) else v) for k, v in entry.items()}
             for idx, entry in state_dict["state"].items()}
    return {**state_dict, "state": state}


def loaded(path: Path) -> tuple[dict, list[torch.nn.Parameter], torch.optim.Optimizer]:
    """The fixture, its params and a reference-backend optimizer that loaded its state dict."""
    fixture = torch.load(path, weights_only=True)
    params = [torch.nn.Parameter(p.clone()) for p in fixture["params"]]
    opt = make.wrapped(fixture["case"], params, "reference")
    opt.load_state_dict(saved_and_loaded(fixture["state_dict"]))  # a stock load keeps the step tensors it is given
    return fixture, params, opt


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: f"{p.parent.name}-{p.stem}")
def test_an_old_checkpoint_saves_back_as_the_current_layout(path, one_thread):
    fixture, _, opt = loaded(path)
    saved = as_saved_now(fixture["state_dict"])
    if fixture["version"] == LAYOUT_VERSION:
        assert_same(saved, fixture["state_dict"], "a current layout's own state dict")
    assert_same(saved_and_loaded(opt.state_dict()), saved, "saved back")


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: f"{p.parent.name}-{p.stem}")
def test_an_old_checkpoint_resumes_bit_for_bit(path, one_thread):
    fixture, params, opt = loaded(path)
    make.step(opt, params, fixture["grads"])
    assert_same([p.detach() for p in params], fixture["params_after"], "params")
    assert_same(saved_and_loaded(opt.state_dict()), as_saved_now(fixture["state_dict_after"]), "state after the step")


NEWER = [("adamw_int8_outliers", "exp_avg"), ("adamw_bf16_master_exact", "master_residual"),
         ("adamw_bf16_master_exact", "master_ties"), ("adamw_bf16_master_8bit", "master_seed"),
         ("adamw_stochastic", "rounding_seed")]


@pytest.mark.parametrize(("case", "key"), NEWER, ids=[f"{c}-{k}" for c, k in NEWER])
def test_a_state_of_a_newer_layout_is_refused_naming_it_and_the_fix(case, key, one_thread):
    """A packed state saved by a newer lowbit-compile (its ``lowbit_layout`` past ``LAYOUT_VERSION``) fails the load
    naming the state, both versions and the fix, and changes nothing."""
    fixture = torch.load(FIXTURES[0].parent.parent / f"v{LAYOUT_VERSION}" / f"{case}.pt", weights_only=True)
    state_dict = fixture["state_dict"]
    entry = state_dict["state"][0]
    entry[key] = {**entry[key], "lowbit_layout": LAYOUT_VERSION + 1}
    params = [torch.nn.Parameter(p.clone()) for p in fixture["params"]]
    opt = make.wrapped(case, params, "reference")
    with pytest.raises(ValueError, match=rf"state {key!r}: it was saved in layout {LAYOUT_VERSION + 1} by a newer "
                                         rf"lowbit-compile, and this version reads layouts 0 to {LAYOUT_VERSION}: "
                                         r"upgrade lowbit-compile"):
        opt.load_state_dict(state_dict)
    assert not opt.state
