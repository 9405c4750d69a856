"""Per-parameter precision: name globs, regexes and predicates, the min_8bit_size rule, and errors."""

from __future__ import annotations

import re

import pytest
import torch

from lowbit_compile import QuantizedState, lowbit_compile
from lowbit_compile.config import DEFAULT_FMT, Config, param_names
from lowbit_compile.options import Options

PER_ELEMENT = ("exp_avg", "exp_avg_sq")


def names_of(config: Config, param: torch.Tensor, name: str | None) -> dict[str, str]:
    return {k: f.name for k, f in config.formats_for(param, PER_ELEMENT, name)}


def config(**kw) -> Config:
    return Config.of(Options(**{"fmt": "int8", "block_size": 2048, "outliers": 2, "backend": "reference", **kw}))


BIG, SMALL = torch.empty(100, 100), torch.empty(10)


def test_without_overrides_size_decides():
    c = config()
    assert names_of(c, BIG, "w") == {"exp_avg": "int8", "exp_avg_sq": "int8"}
    assert names_of(c, SMALL, "w") == {"exp_avg": "fp32", "exp_avg_sq": "fp32"}


def test_glob_regex_and_predicate_first_match_wins():
    c = config(overrides=[
        ("*.embed.*", "fp32"),
        (re.compile(r"norm\d?\.weight$"), "bf16"),
        (lambda name, p: p.ndim == 2 and p.shape[0] == p.shape[1], "fp8_e4m3"),
        ("*", "dynamic8"),
    ])
    assert names_of(c, BIG, "model.embed.weight")["exp_avg"] == "fp32"
    assert names_of(c, BIG, "block.norm2.weight")["exp_avg"] == "bf16"
    assert names_of(c, BIG, "block.mlp.weight")["exp_avg"] == "fp8_e4m3"  # square: the predicate
    assert names_of(c, torch.empty(100, 50), "block.proj.weight")["exp_avg"] == "dynamic8"
    assert names_of(c, SMALL, "block.proj.bias")["exp_avg"] == "dynamic8"  # an override beats the size rule


def test_a_per_state_override_falls_through_for_the_states_it_omits():
    c = config(fmt={"exp_avg": "int8", "exp_avg_sq": "dynamic8"}, overrides={"*": {"exp_avg": "bf16"}})
    assert names_of(c, BIG, "w") == {"exp_avg": "bf16", "exp_avg_sq": "dynamic8"}
    assert names_of(c, SMALL, "w") == {"exp_avg": "bf16", "exp_avg_sq": "fp32"}


def test_unnamed_parameters_match_only_predicates():
    c = config(overrides={"*": "bf16", (lambda name, p: name is None): "fp8_e5m2"})
    assert names_of(c, BIG, None)["exp_avg"] == "fp8_e5m2"
    assert names_of(c, BIG, "w")["exp_avg"] == "bf16"


def test_the_size_rule_counts_the_full_shape():
    c = config(min_8bit_size=100 * 100)
    assert names_of(c, BIG, "w")["exp_avg"] == "int8"  # exactly the threshold: quantized
    assert names_of(c, torch.empty(99, 101), "w")["exp_avg"] == "fp32"


@pytest.mark.parametrize("overrides,error", [
    ({"*": "int4"}, "must be one of"),
    ({"*": {"exp_avg": "q"}}, "must be one of"),
    ({3: "int8"}, "glob string, a compiled regex or a predicate"),
    ([("*", "int8", "extra")], "pair"),
])
def test_bad_overrides_are_refused_up_front(overrides, error):
    with pytest.raises((ValueError, TypeError), match=error):
        config(overrides=overrides)


def test_param_names_from_a_module_or_pairs():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[1].weight = model[0].weight  # shared: keeps its first name
    names = param_names(model)
    assert names[model[0].weight] == "0.weight" and names[model[1].bias] == "1.bias"
    assert param_names(model.named_parameters()) == {p: n for n, p in model.named_parameters()}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.ModuleDict({
        "embed": torch.nn.Embedding(512, 32), "proj": torch.nn.Linear(32, 256), "norm": torch.nn.LayerNorm(256),
    })


def test_lowbit_compile_applies_name_overrides_given_the_model():
    model = _model()
    opt = lowbit_compile(torch.optim.AdamW(model.parameters()), overrides={"embed.*": "fp32", "norm.*": "bf16"},
                         model=model, min_8bit_size=1024)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    state = {name: opt.state[p]["exp_avg"] for name, p in model.named_parameters()}
    assert type(state["embed.weight"]) is torch.Tensor  # 16,384 elements, kept fp32 by name
    assert isinstance(state["proj.weight"], QuantizedState) and state["proj.weight"].fmt.name == DEFAULT_FMT
    assert type(state["proj.bias"]) is torch.Tensor  # 256 elements: the size rule
    assert state["norm.weight"].fmt.name == "bf16" and state["norm.bias"].fmt.name == "bf16"


def test_overrides_also_convert_existing_states():
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # stock fp32 states exist
    lowbit_compile(opt, overrides={"proj.*": "fp8_e4m3"}, model=model.named_parameters(), min_8bit_size=10**6)
    assert opt.state[model["proj"].weight]["exp_avg"].fmt.name == "fp8_e4m3"
    assert type(opt.state[model["embed"].weight]["exp_avg"]) is torch.Tensor


def test_name_overrides_need_the_model():
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="needs model="):
        lowbit_compile(opt, overrides={"embed.*": "fp32"})
    with pytest.raises(ValueError, match="not in model="):
        lowbit_compile(opt, overrides={"embed.*": "fp32"}, model=model["proj"])
    # a predicate needs no names
    lowbit_compile(opt, overrides={(lambda name, p: p.ndim == 1): "bf16"})
