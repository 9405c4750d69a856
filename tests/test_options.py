"""One options schema (``lowbit_compile/options.py``): every entry point takes the same options, with
the same defaults, named the same way, and refuses an unknown one naming the fix."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re

import pytest
import torch

from lowbit_compile import lowbit_compile, optim
from lowbit_compile.cli import _OPTION_FLAGS, main
from lowbit_compile.options import Options, ScopeOptions

Scope = importlib.import_module("lowbit_compile.scope").Scope
LIBRARY = [f.name for f in dataclasses.fields(Options)]
SCOPE = [f.name for f in dataclasses.fields(ScopeOptions)]


def test_the_keyword_api_is_the_one_users_had():
    """The signature derived from the schema is, text for text, the one written out before it."""
    assert str(inspect.signature(lowbit_compile)) == (
        "(opt: 'torch.optim.Optimizer', fmt: 'str | Mapping[str, str]' = 'sqrt8', *, block_size: 'int | None' = None, "
        "outliers: 'int' = 0, min_8bit_size: 'int' = 4096, backend: 'str' = 'auto', overrides: 'Overrides | None' "
        "= None, model: 'torch.nn.Module | Iterable[tuple[str, torch.Tensor]] | None' = None, master_weights: "
        "'str | None' = None, rounding: 'RoundingSpec' = 'auto', release_grads: 'bool' = False) -> "
        "'torch.optim.Optimizer'")


def test_every_entry_point_takes_every_option_with_its_default():
    defaults = {f.name: f.default for f in dataclasses.fields(Options) + dataclasses.fields(ScopeOptions)}
    api = inspect.signature(lowbit_compile).parameters
    scope = inspect.signature(Scope.__init__).parameters
    adamw = inspect.signature(optim.AdamW.__init__).parameters
    assert list(api)[1:] == LIBRARY and list(scope)[1:] == LIBRARY + SCOPE
    assert all(adamw[k].kind is inspect.Parameter.KEYWORD_ONLY for k in LIBRARY if k != "fmt")
    for params in (api, scope, adamw):
        assert all(params[k].default == defaults[k] for k in params if k in defaults)
    assert {f.name for f, _ in _OPTION_FLAGS} == set(LIBRARY + SCOPE) - {"model", "restore_on_exit"}


def test_each_option_is_documented_where_it_is_taken():
    for name in LIBRARY:
        assert f"    {name}: " in lowbit_compile.__doc__, name
    for name in SCOPE:
        assert f"{name}: " in importlib.import_module("lowbit_compile.scope").enable.__doc__, name


@pytest.mark.parametrize("call,where", [
    (lambda opt: lowbit_compile(opt, blocksize=256), "lowbit_compile()"),
    (lambda opt: Scope(blocksize=256), "enable()"),
])
def test_an_unknown_keyword_names_the_one_it_resembles(call, where):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(TypeError, match=rf"{where.replace('(', '[(]').replace(')', '[)]')} got an unexpected "
                                        r"keyword argument 'blocksize' \(did you mean 'block_size'\?\)"):
        call(opt)
    assert not hasattr(opt, "_lowbit")


def test_a_scope_option_is_refused_by_lowbit_compile():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(TypeError, match="unexpected keyword argument 'restore_at_step'"):
        lowbit_compile(opt, restore_at_step=3)


def test_cli_flags_carry_the_schema_defaults_and_parsers(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for field, flag in _OPTION_FLAGS:
        assert flag in text and field.metadata["cli"].split()[0] in text, flag


def test_a_state_format_defaults_to_the_shipped_blocks():
    from lowbit_compile.formats import StateFormat
    from lowbit_compile.options import DEFAULT_BLOCK_SIZE, DEFAULT_OUTLIERS

    fmt = StateFormat("int8")
    assert (fmt.block_size, fmt.outliers) == (DEFAULT_BLOCK_SIZE, DEFAULT_OUTLIERS) == (512, 0)


def test_type_checkers_see_every_keyword_of_lowbit_compile():
    """``**options`` is typed ``Unpack[OptionKeywords]``: its keys and annotations are the schema's fields
    after ``fmt`` (annotations as text, as ``from __future__ import annotations`` keeps them)."""
    import dataclasses

    from lowbit_compile.options import OptionKeywords, Options

    fields = [f for f in dataclasses.fields(Options) if f.name != "fmt"]
    assert list(OptionKeywords.__annotations__) == [f.name for f in fields]
    annotations = [getattr(a, "__forward_arg__", a) for a in OptionKeywords.__annotations__.values()]
    assert annotations == [str(f.type) for f in fields]


@pytest.mark.parametrize("keyword, value, says", [
    ("optim_bits", 32, "fmt='fp32'"),
    ("optim_bits", 8, "8-bit states are the default here"),
    ("block_wise", True, "always quantized in blocks here: remove it"),
    ("block_wise", False, "block_size=32768 is the largest block"),
    ("percentile_clipping", 100, "does nothing at that value: remove it"),
    ("percentile_clipping", 5, r"clip_grad_norm_"),
    ("is_paged", True, "no paged"),
    ("max_unorm", 1.0, "no update-norm clipping"),
    ("args", None, "overrides="),
    ("bf16_stochastic_round", True, "master_weights='8bit'"),
])
@pytest.mark.parametrize("entry", ["lowbit_compile()", "enable()", "AdamW()"])
def test_a_bitsandbytes_or_torchao_keyword_says_what_it_is_here(entry, keyword, value, says):
    """Keywords users carry over from bitsandbytes' (or torchao's) 8-bit optimizers: each entry point
    names the library and what the keyword maps to, or that it is not needed; nothing is wrapped."""
    params = [torch.nn.Parameter(torch.zeros(4))]
    opt = torch.optim.AdamW(params)
    call = {"lowbit_compile()": lambda: lowbit_compile(opt, **{keyword: value}),
            "enable()": lambda: Scope(**{keyword: value}),
            "AdamW()": lambda: optim.AdamW(params, lr=0.1, **{keyword: value})}[entry]
    library = "torchao" if keyword == "bf16_stochastic_round" else "bitsandbytes"
    with pytest.raises(TypeError, match=rf"^{re.escape(entry)} got {keyword}={re.escape(repr(value))}, a keyword of "
                                        rf"{library}'s 8-bit optimizers, not of lowbit_compile: .*{says}"):
        call()
    assert not hasattr(opt, "_lowbit")
