"""``lowbit_compile.optim``: a class per supported optimizer to name in configs, the wrapped optimizer's
identity (subclass of its stock class, a repr naming its formats), and copies that stay low-bit."""

from __future__ import annotations

import copy
import importlib
import inspect
import io
import pickle

import pytest
import torch

import lowbit_compile
from examples.lion import Lion
from lowbit_compile import QuantizedState, is_wrapped, optim, restore
from lowbit_compile import lowbit_compile as wrap
from lowbit_compile.config import DEFAULT_FMT
from lowbit_compile.runtime.wrap import SUPPORTED

SHAPES = [(64, 80), (80,)]  # one tensor quantized (>= min_8bit_size=4096 elements), one kept fp32


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]


def grads(n: int, seed: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(n)]


def params_of(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def run(opt: torch.optim.Optimizer, steps: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    for gs in steps:
        for p, g in zip(params_of(opt), gs):
            p.grad = g.clone()
        opt.step()
    return [p.detach().clone() for p in params_of(opt)]


def assert_same_states(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    for p, q in zip(params_of(a), params_of(b)):
        assert torch.equal(p, q)
        assert a.state[p].keys() == b.state[q].keys()
        for key, value in a.state[p].items():
            other = b.state[q][key]
            assert type(value) is type(other), key
            if isinstance(value, QuantizedState):
                assert value.fmt == other.fmt
                assert all(torch.equal(x, y) for x, y in zip(value.storage_parts, other.storage_parts)), key
            else:
                assert torch.equal(value, other), key


# -- the classes ------------------------------------------------------------------------------------
def test_every_supported_optimizer_has_a_class_of_the_same_name():
    for stock in SUPPORTED:
        cls = getattr(optim, stock.__name__)
        assert issubclass(cls, stock) and cls.__name__ == stock.__name__ and cls.__module__ == "lowbit_compile.optim"
        assert importlib.import_module(cls.__module__).__dict__[cls.__qualname__] is cls  # importable by path
        signature = inspect.signature(cls)
        stock_names = [n for n in inspect.signature(stock).parameters]
        assert list(signature.parameters)[:len(stock_names)] == stock_names  # the stock arguments, in order
        for option in ("fmt", "block_size", "outliers", "min_8bit_size", "backend", "overrides", "model"):
            assert signature.parameters[option].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("stock,kwargs", [(torch.optim.AdamW, {"weight_decay": 0.1}), (torch.optim.Adam, {}),
                                          (torch.optim.SGD, {"momentum": 0.9}), (torch.optim.RMSprop, {})],
                         ids=lambda x: getattr(x, "__name__", ""))
def test_a_class_steps_like_the_explicit_wrap_and_their_state_dicts_are_interchangeable(stock, kwargs):
    steps = grads(6)
    by_class = getattr(optim, stock.__name__)(make_params(), lr=1e-2, fmt="int8", block_size=256, **kwargs)
    explicit = wrap(stock(make_params(), lr=1e-2, **kwargs), fmt="int8", block_size=256)
    assert isinstance(by_class, stock) and type(by_class) is type(explicit) and is_wrapped(by_class)
    run(by_class, steps[:3])
    run(explicit, steps[:3])
    assert_same_states(by_class, explicit)
    assert str(by_class.state_dict()) == str(explicit.state_dict())
    # resume each from the other's checkpoint: both continue exactly like an uninterrupted run
    resumed_by_class = getattr(optim, stock.__name__)(make_params(), lr=1e-2, fmt="int8", block_size=256, **kwargs)
    resumed_explicit = wrap(stock(make_params(), lr=1e-2, **kwargs), fmt="int8", block_size=256)
    for resumed, source in ((resumed_by_class, explicit), (resumed_explicit, by_class)):
        with torch.no_grad():
            for p, q in zip(params_of(resumed), params_of(source)):
                p.copy_(q)
        resumed.load_state_dict(copy.deepcopy(source.state_dict()))  # as from a checkpoint file
    expected = run(by_class, steps[3:])
    assert all(torch.equal(p, q) for p, q in zip(run(resumed_by_class, steps[3:]), expected))
    assert all(torch.equal(p, q) for p, q in zip(run(resumed_explicit, steps[3:]), expected))
    assert any(isinstance(v, QuantizedState) for v in resumed_explicit.state[params_of(resumed_explicit)[0]].values())


def test_a_class_takes_named_parameters_and_name_patterns():
    model = torch.nn.Sequential(torch.nn.Embedding(128, 64), torch.nn.Linear(64, 128))
    opt = optim.AdamW(model.named_parameters(), lr=1e-3, min_8bit_size=0, overrides={"0.*": "fp32"})
    model(torch.arange(8)).sum().backward()
    opt.step()
    assert type(opt.state[model[0].weight]["exp_avg"]) is torch.Tensor
    assert isinstance(opt.state[model[1].weight]["exp_avg"], QuantizedState)


def test_bad_options_of_a_class_fail_at_construction():
    with pytest.raises(ValueError, match="fmt must be one of"):
        optim.AdamW(make_params(), fmt="int4")
    with pytest.raises(TypeError, match="fmtt"):
        optim.AdamW(make_params(), fmtt="int8")


def test_restore_gives_back_the_stock_class():
    opt = optim.Adam(make_params(), lr=1e-2)
    run(opt, grads(1))
    restore(opt)
    assert type(opt) is torch.optim.Adam and not is_wrapped(opt)
    assert type(opt.state[params_of(opt)[0]]["exp_avg"]) is torch.Tensor
    wrap(opt)
    assert type(opt) is optim.Adam


def test_own_optimizer_gets_a_subclass_made_once():
    a, b = wrap(Lion(make_params()), min_8bit_size=0), wrap(Lion(make_params()), min_8bit_size=0)
    assert type(a) is type(b) and type(a) is not Lion and isinstance(a, Lion) and type(a).__name__ == "Lion"
    assert optim.lowbit_class(Lion) is type(a) and optim.stock_class(type(a)) is Lion
    restore(a)
    assert type(a) is Lion


def test_repr_names_the_formats_before_the_stock_text():
    opt = wrap(torch.optim.AdamW(make_params(), lr=1e-2), fmt={"exp_avg": "fp8_e4m3", "exp_avg_sq": "dynamic8"})
    stock = repr(torch.optim.AdamW(make_params(), lr=1e-2))
    header, *rest = repr(opt).splitlines()
    assert header.startswith("lowbit-compile: fmt={'exp_avg': 'fp8_e4m3', 'exp_avg_sq': 'dynamic8'}, block_size=None")
    assert rest[0] == "  states: none yet (made at the first step)" and "\n".join(rest[1:]) == stock
    run(opt, grads(1))
    states = repr(opt).splitlines()[1]
    assert states.startswith("  states: exp_avg fp8_e4m3 in blocks of 512 x1, stock fp32 x1; exp_avg_sq dynamic8 in "
                             "blocks of 512 x1, stock fp32 x1;")
    assert "B/param held" in states
    assert repr(restore(opt)) == stock


# -- copies -----------------------------------------------------------------------------------------
def torch_save_load(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {"deepcopy": copy.deepcopy, "pickle": lambda o: pickle.loads(pickle.dumps(o)), "torch.save": torch_save_load}


@pytest.mark.parametrize("how", sorted(COPIES))
@pytest.mark.parametrize("make", [
    pytest.param(lambda: wrap(torch.optim.AdamW(make_params(), lr=1e-2, amsgrad=True), fmt="int8"), id="wrapped"),
    pytest.param(lambda: optim.Adam(make_params(), lr=1e-2, fmt="dynamic8", outliers=2), id="class"),
    pytest.param(lambda: wrap(Lion(make_params(), lr=1e-3), fmt="int8", min_8bit_size=0), id="own-optimizer"),
])
def test_a_copy_is_wrapped_with_equal_states_and_steps_bit_for_bit_like_the_original(make, how):
    opt = make()
    run(opt, grads(3))
    dup = COPIES[how](opt)
    assert type(dup) is type(opt) and is_wrapped(dup) and dup is not opt
    assert dup._lowbit.options == opt._lowbit.options
    assert all(p is not q for p, q in zip(params_of(opt), params_of(dup)))
    assert_same_states(opt, dup)
    later = grads(4, seed=7)
    assert all(torch.equal(p, q) for p, q in zip(run(dup, later), run(opt, later)))
    assert_same_states(opt, dup)


def test_a_copy_keeps_the_parameter_names_of_name_patterns():
    model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Linear(80, 64))
    opt = wrap(torch.optim.AdamW(model.parameters()), min_8bit_size=0, overrides={"1.*": "bf16"}, model=model)
    dup = copy.deepcopy(opt)
    model(torch.randn(2, 64)).sum().backward()
    for p, q in zip(params_of(opt), params_of(dup)):
        q.grad = p.grad.clone()
    opt.step()
    dup.step()
    formats = [v["exp_avg"].fmt.name for v in (dup.state[p] for p in params_of(dup))]
    assert formats == [DEFAULT_FMT, DEFAULT_FMT, "bf16", "bf16"]
    assert_same_states(opt, dup)


def test_a_stock_optimizer_copies_as_stock():
    opt = torch.optim.AdamW(make_params())
    run(opt, grads(1))
    dup = copy.deepcopy(opt)
    assert type(dup) is torch.optim.AdamW and not is_wrapped(dup)


def test_the_package_exports_the_classes_module():
    assert lowbit_compile.optim is optim and "optim" in lowbit_compile.__all__


def test_with_options_presets_the_low_bit_options_and_copies_like_its_class():
    model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Linear(80, 64))
    preset = optim.AdamW.with_options(model=model, overrides={"1.*": "bf16"}, min_8bit_size=0)
    assert issubclass(preset, optim.AdamW) and preset.__name__ == "AdamW"
    opt = preset(model.parameters(), lr=1e-3, fmt="int8")  # given options still win
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    assert [opt.state[p]["exp_avg"].fmt.name for p in model.parameters()] == ["int8", "int8", "bf16", "bf16"]
    dup = pickle.loads(pickle.dumps((model, opt)))[1]  # rebuilt as optim.AdamW: the class made here has no path
    assert type(dup) is optim.AdamW and is_wrapped(dup)
    assert type(restore(opt)) is torch.optim.AdamW
    with pytest.raises(TypeError, match="with_options takes"):
        optim.AdamW.with_options(lr=1e-3)
