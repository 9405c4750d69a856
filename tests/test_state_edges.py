"""State tensors that behave like stock ones or refuse, and the small cases that must work like
stock or fail early and clearly: indexed writes, nbytes, consistent state_dict snapshots, empty and
meta parameters, misspelled state names, override patterns that match nothing, and a stock
optimizer handed low-bit states."""

from __future__ import annotations

import io

import pytest
import torch

from lowbit_compile import QuantizedState, checkpoint, enable, lowbit_compile, memory_report, restore
from lowbit_compile.config import STOCK_STATES
from lowbit_compile.state import codec
from lowbit_compile.state.quantized import StateView
from lowbit_compile.state.schema import probe_schema

OPTIONS = {"fmt": "int8", "block_size": 64, "min_8bit_size": 0}


def stepped(shape=(64, 40), steps: int = 2, **options) -> tuple[torch.optim.Optimizer, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(shape, generator=gen))
    opt = lowbit_compile(torch.optim.AdamW([p], lr=1e-2), **{**OPTIONS, **options})
    for _ in range(steps):
        p.grad = torch.randn(shape, generator=gen)
        opt.step()
    return opt, p


def blocks_of(qs: QuantizedState) -> list[tuple[torch.Tensor, ...]]:
    """Per block: its code bytes, scale and patches, to see which blocks a write re-encoded."""
    b, codes = qs.fmt.block_size, qs.codes.view(torch.uint8)
    return [(codes[i * b:(i + 1) * b].clone(), qs.scales[i].clone(), qs.patch_values[i].clone(),
             qs.patch_index[i].clone()) for i in range(qs.scales.numel())]


def same_block(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


# -- indexed writes -----------------------------------------------------------------------------------
WRITES = {
    "slice assignment": (lambda s: s.__setitem__(slice(0, 10), 0.0), lambda d: d.__setitem__(slice(0, 10), 0.0)),
    "select zero_": (lambda s: s[20].zero_(), lambda d: d[20].zero_()),
    "2-d slice of a row": (lambda s: s.__setitem__((30, slice(5, 9)), 0.25),
                           lambda d: d.__setitem__((30, slice(5, 9)), 0.25)),
    "column mul_": (lambda s: s[:, 3].mul_(2.0), lambda d: d[:, 3].mul_(2.0)),
    "transposed row fill_": (lambda s: s.t()[7].fill_(-0.5), lambda d: d.t()[7].fill_(-0.5)),
    "boolean mask": (lambda s: s.__setitem__(s.dequantize() > 0.05, 0.0),
                     lambda d: d.__setitem__(d > 0.05, 0.0)),
    "copy_ into a slice": (lambda s: s[40:42].copy_(torch.ones(2, 40)), lambda d: d[40:42].copy_(torch.ones(2, 40))),
}


@pytest.mark.parametrize("name", sorted(WRITES))
def test_indexed_writes_go_through_and_reencode_only_the_touched_blocks(name):
    """Stock writes through views of a state (code that resets the moments of new or pruned rows
    relies on it). The written region reads back as a fresh quantization of the new values; every
    block the write did not change keeps its bits."""
    write, write_dense = WRITES[name]
    opt, p = stepped()
    qs = opt.state[p]["exp_avg"]
    before, dense = blocks_of(qs), qs.dequantize()
    expected = dense.clone()
    write_dense(expected)
    write(qs)
    assert opt.state[p]["exp_avg"] is qs
    changed = (expected != dense).reshape(-1)
    assert bool(changed.any())
    b = qs.fmt.block_size
    touched = set((changed.nonzero().squeeze(1) // b).tolist())
    requantized = QuantizedState.from_dense(expected, qs.fmt)
    for i, (old, new) in enumerate(zip(before, blocks_of(qs))):
        assert same_block(new, blocks_of(requantized)[i] if i in touched else old), i
    opt.step()  # the step reads the written state


def test_a_write_through_a_view_of_a_view_and_unbind_go_through():
    opt, p = stepped()
    qs = opt.state[p]["exp_avg_sq"]
    qs[10:20][3].zero_()
    rows = qs.unbind(0)
    assert isinstance(rows[5], StateView)
    rows[5].fill_(0.0)
    values = qs.dequantize()
    assert bool((values[13] == 0).all()) and bool((values[5] == 0).all())


def test_reads_through_views_see_the_dequantized_values():
    opt, p = stepped()
    qs = opt.state[p]["exp_avg"]
    dense = qs.dequantize()
    assert torch.equal(qs[3:7].sum(1), dense[3:7].sum(1))
    assert torch.equal(qs.t()[2] * 2, dense.t()[2] * 2)
    assert torch.equal(torch.zeros(4).copy_(qs[0, :4]), dense[0, :4])


def test_writes_through_out_arguments_are_refused():
    opt, p = stepped()
    qs = opt.state[p]["exp_avg"]
    with pytest.raises(NotImplementedError, match=r"out= argument.*copy_"):
        torch.add(torch.ones(64, 40), 1.0, out=qs)


def test_nbytes_and_element_size_report_what_is_held():
    opt, p = stepped(block_size=64, outliers=2)
    qs = opt.state[p]["exp_avg"]
    n, blocks = p.numel(), -(-p.numel() // 64)
    assert qs.element_size() == 1
    assert qs.nbytes == n + blocks * (4 + 2 * 2 + 2 * 2) == qs.nbytes_held


# -- state_dict snapshots -----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(64, 40), (3000,), (8, 512)])
def test_a_state_dict_kept_in_memory_stays_consistent_with_the_live_state(shape):
    """Stock state_dict() tensors are the live states. Ours are too for plain parameters (every
    part a view, in both layouts): after more steps a kept state dict is the live state, whole."""
    opt, p = stepped(shape)
    sd = opt.state_dict()
    opt, _ = opt, None
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    exported = checkpoint.stock_state_dict(sd)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(exported["state"][0][key], opt.state[p][key].dequantize())
        restored = codec.unpack(sd["state"][0][key], p, key)
        assert all(torch.equal(a, b) for a, b in zip(restored.storage_parts, opt.state[p][key].storage_parts))


# -- small cases ------------------------------------------------------------------------------------
def test_empty_parameters_step_save_and_load_like_stock():
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(0,), (5, 0), (0, 7), (600,)]]
    opt = lowbit_compile(torch.optim.AdamW(params, lr=1e-2), **OPTIONS)
    stock = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2)
    for o in (opt, stock):
        for q in o.param_groups[0]["params"]:
            q.grad = torch.ones_like(q)
        o.step()
    for p, q in zip(params[:3], stock.param_groups[0]["params"]):
        assert {k: (type(v), v.shape) for k, v in opt.state[p].items()} == \
               {k: (type(v), v.shape) for k, v in stock.state[q].items()}
    assert isinstance(opt.state[params[3]]["exp_avg"], QuantizedState)
    opt.load_state_dict(torch.load(io.BytesIO(_saved(opt.state_dict())), weights_only=True))
    opt.step()


def _saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.fixture
def params_kept_on_conversion():
    """``module.to_empty()`` keeps the parameter objects (an optimizer's keys), as torch will by default."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


def test_meta_parameters_hold_low_bit_states_that_start_afresh_once_materialised(params_kept_on_conversion):
    """On the meta device (no values) a step runs as stock's there (the step count, the shapes) and each
    state is held in its configured format, of empty storage: memory_report counts what the real states
    will take, not fp32 (they stayed fp32 before). Materialised and initialised, the parameters' next step
    starts their states afresh, with a warning, bit for bit a new optimizer's first step on those values;
    restore() gives stock meta states."""
    meta = torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.LayerNorm(64)).to("meta")
    opt = lowbit_compile(torch.optim.AdamW(meta.parameters(), lr=1e-2), **OPTIONS)
    for _ in range(2):
        for p in meta.parameters():
            p.grad = torch.empty_like(p)
        opt.step()
    weight = meta[0].weight
    state = opt.state[weight]
    assert state["step"].item() == 2.0
    for key in ("exp_avg", "exp_avg_sq"):
        assert isinstance(state[key], QuantizedState) and state[key].is_meta and state[key].fmt.name == "int8"
        assert state[key].shape == weight.shape
    assert memory_report(opt).total.bytes_per_param < 2.2  # stock: 8
    meta.to_empty(device="cpu")
    assert meta[0].weight is weight
    twin = torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.LayerNorm(64))
    with torch.no_grad():
        for p, q in zip(meta.parameters(), twin.parameters()):
            p.copy_(q)
    fresh = lowbit_compile(torch.optim.AdamW(twin.parameters(), lr=1e-2), **OPTIONS)
    for p, q in zip(meta.parameters(), twin.parameters()):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    with pytest.warns(UserWarning, match=r"4 parameter\(s\) of this AdamW were stepped on the meta device"):
        opt.step()
    fresh.step()
    for p, q in zip(meta.parameters(), twin.parameters()):
        assert torch.equal(p, q) and opt.state[p]["step"].item() == 1.0
        assert torch.equal(opt.state[p]["exp_avg"].dequantize(), fresh.state[q]["exp_avg"].dequantize())
    again = torch.nn.Linear(96, 64, device="meta")
    opt = lowbit_compile(torch.optim.AdamW(again.parameters()), **OPTIONS)
    for p in again.parameters():
        p.grad = torch.empty_like(p)
    opt.step()
    restore(opt)
    assert all(type(v) is torch.Tensor for v in opt.state[again.weight].values())
    assert opt.state[again.weight]["exp_avg"].is_meta


def test_stock_state_names_cover_every_supported_optimizer():
    from lowbit_compile.runtime.wrap import SUPPORTED

    flags = {torch.optim.Adam: {"amsgrad": True}, torch.optim.AdamW: {"amsgrad": True},
             torch.optim.SGD: {"momentum": 0.9}, torch.optim.RMSprop: {"momentum": 0.9, "centered": True}}
    found = set()
    for cls in SUPPORTED:
        p = torch.nn.Parameter(torch.randn(8))
        opt = cls([p], **flags.get(cls, {}))
        found.update(probe_schema(opt, opt.param_groups[0], p).per_element)
    assert found == STOCK_STATES


@pytest.mark.parametrize("how", ["fmt", "override"])
def test_a_misspelled_state_name_is_refused_naming_the_right_one(how):
    p = torch.nn.Parameter(torch.randn(64, 64))
    opt = torch.optim.AdamW([p])
    spec = {"exp_avg": "int8", "exp_avgsq": "fp32"}
    options = {"fmt": spec} if how == "fmt" else {"overrides": [(lambda name, param: True, spec)]}
    with pytest.raises(ValueError, match=r"'exp_avgsq' \(did you mean 'exp_avg_sq'\?\).*'exp_avg', 'exp_avg_sq'"):
        lowbit_compile(opt, **options)
    assert "step" not in opt.__dict__  # nothing was wrapped
    # a state another stock optimizer keeps is fine: one config may serve several optimizers
    lowbit_compile(opt, fmt={"exp_avg": "int8", "momentum_buffer": "fp32", "max_exp_avg_sq": "fp32"})


def test_an_override_pattern_that_matches_no_parameter_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"'\*embd\*' matches no parameter name \(0.weight, 0.bias"):
        lowbit_compile(opt, overrides={"*embd*": "fp32", "1.*": "fp32"}, model=model)
    lowbit_compile(opt, overrides={"1.*": "fp32"}, model=model)


def test_under_enable_patterns_are_checked_against_the_whole_model_not_each_optimizer():
    """A GAN's two optimizers share one scope: a pattern for the generator's parameters must not
    fail the discriminator's optimizer."""
    model = torch.nn.ModuleDict({"gen": torch.nn.Linear(8, 8), "disc": torch.nn.Linear(8, 1)})
    opts = [torch.optim.AdamW(model["gen"].parameters()), torch.optim.AdamW(model["disc"].parameters())]
    with enable(overrides={"gen.*": "fp32"}, model=model, min_8bit_size=0):
        for opt in opts:
            for p in opt.param_groups[0]["params"]:
                p.grad = torch.ones_like(p)
            opt.step()
    assert type(opts[0].state[model["gen"].weight]["exp_avg"]) is torch.Tensor
    assert isinstance(opts[1].state[model["disc"].weight]["exp_avg"], QuantizedState)


def test_a_stock_optimizer_stepping_low_bit_states_fails_naming_stock_state_dict():
    """In memory ``state_dict()`` has stock steps (a saved one is refused at load: test_checkpoint), so
    here only the step's check stops a stock optimizer given low-bit states."""
    opt, p = stepped()
    sd = opt.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    stock = torch.optim.AdamW([q], lr=1e-2)
    stock.load_state_dict(sd)
    q.grad = torch.ones_like(q)
    before = q.detach().clone()
    with pytest.raises(RuntimeError, match=r"lowbit_compile\.checkpoint\.stock_state_dict"):
        stock.step()
    assert torch.equal(q, before) and stock.state[q]["step"].item() == 2
    stock.load_state_dict(checkpoint.stock_state_dict(sd))
    stock.step()
    assert stock.state[q]["step"].item() == 3


def test_a_group_size_mismatch_is_a_value_error_like_stock():
    opt, p = stepped()
    sd = opt.state_dict()
    other = lowbit_compile(torch.optim.AdamW([p, torch.nn.Parameter(torch.randn(3))]), **OPTIONS)
    with pytest.raises(ValueError, match=r"param_groups\[0\] has 1 parameters in the checkpoint and 2"):
        other.load_state_dict(sd)
