"""Checkpoints of a wrapped optimizer in one process: compact state_dict, bitwise resume through
torch.save/torch.load(weights_only=True), stock fp32 checkpoints in and out, other formats
converted, unreadable states named, row-sharded checkpoints loaded unsharded."""

from __future__ import annotations

import io

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from lowbit_compile import QuantizedState, checkpoint, enable, lowbit_compile, restore
from lowbit_compile.config import DEFAULT_OUTLIERS
from lowbit_compile.formats import StateFormat, decode, encode, special_codes
from lowbit_compile.formats.dynamic import dynamic_map, legacy_dynamic_map, upgrade_codes
from lowbit_compile.state import codec

from .helpers import assert_same, saved_and_loaded, state_bits, text, train

# odd shapes on purpose: partial blocks, blocks that span rows, a 1-D and a 0-d parameter
SHAPES = [(67, 33), (300,), (), (5, 1, 7)]
OPTIONS = {"block_size": 64, "min_8bit_size": 0}


def make_params(shapes=SHAPES) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(1)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def packed_bytes(packed: dict) -> int:
    return sum(t.numel() * t.element_size() for t in packed.values() if isinstance(t, torch.Tensor))


def test_state_dict_holds_codes_and_block_records_not_fp32():
    """int8 m and v: 1 code byte per element plus one 12-byte record per block of 2048 (fp32 scale,
    2 bf16 patches, 2 int16 offsets), all raw bytes; the file is about a quarter of stock AdamW's."""
    shapes = [(256, 512), (96, 2048), (64, 3000)]
    params = make_params(shapes)
    opt = lowbit_compile(torch.optim.AdamW(params), "int8", block_size=2048, outliers=2)
    stock = torch.optim.AdamW(params)
    train(opt, params, 1, 0)
    train(stock, params, 1, 0)
    state = opt.state_dict()["state"]
    held = 0
    for idx, shape in enumerate(shapes):
        blocks = -(-shape[0] * shape[1] // 2048)
        for key in ("exp_avg", "exp_avg_sq"):
            packed = state[idx][key]
            sign = "u" if key == "exp_avg_sq" else "s"
            assert checkpoint.is_packed(packed) and packed["lowbit_format"] == text(f"int8:2048:2:{sign}")
            assert packed["shape"] == text(",".join(map(str, shape))) and packed["dtype"] == text("float32")
            assert packed["row_splits"] == text(f"0,{shape[0]}")
            assert all(t.dtype == torch.uint8 for t in packed.values() if isinstance(t, torch.Tensor))
            assert packed["codes"].shape == shape
            assert packed["block_scales"].shape == (blocks, 4)
            assert packed["block_patch_values"].shape == packed["block_patch_index"].shape == (blocks, 4)
            held += packed_bytes(packed)
    elements = sum(p.numel() for p in params)
    assert held == 2 * elements + 2 * sum(-(-s[0] * s[1] // 2048) * 12 for s in shapes)
    ours, theirs = io.BytesIO(), io.BytesIO()
    torch.save(opt.state_dict(), ours)
    torch.save(stock.state_dict(), theirs)
    assert ours.tell() < 0.26 * theirs.tell()


@pytest.mark.parametrize("shape", [(1_000_000,), (100_000, 10), (300_001,)])
def test_a_1d_or_narrow_parameter_costs_one_record_per_block(shape):
    """1-D parameters (flat FSDP1/ZeRO buffers) and rows narrower than a block save one record per
    block, not one per row: 8-bit m + v cost at most 2.05 bytes per element with the defaults."""
    params = make_params([shape])
    opt = lowbit_compile(torch.optim.AdamW(params, lr=1e-2), "int8")
    train(opt, params, 2, seed=1)
    sd = opt.state_dict()
    n, blocks = params[0].numel(), -(-params[0].numel() // 512)
    for key in ("exp_avg", "exp_avg_sq"):
        packed = sd["state"][0][key]
        assert packed["block_scales"].shape == (blocks, 4) and packed["block_patch_values"].shape == (blocks, 0)
        assert packed_bytes(packed) == n + 4 * blocks
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    assert buffer.tell() / n <= 2.05
    resumed = [torch.nn.Parameter(params[0].detach().clone())]
    opt2 = lowbit_compile(torch.optim.AdamW(resumed, lr=1e-2), "int8")
    opt2.load_state_dict(saved_and_loaded(sd))
    assert_same(state_bits(opt, params), state_bits(opt2, resumed))


def test_a_1e8_element_flat_buffer_packs_within_2_05_bytes_per_element():
    """The size of a 1e8-element flat buffer's packed m and v, measured on the states themselves
    (no step: a step of 1e8 elements is too slow for the suite)."""
    n = 100_000_000
    param = torch.empty(n)
    size = 0
    for nonneg in (False, True):
        qs = QuantizedState.full(param.shape, 0.0, StateFormat.make("dynamic8", 512, 0, nonneg), torch.float32, "cpu")
        size += packed_bytes(codec.pack(qs, param))
    assert size / n <= 2.05, size / n


@pytest.mark.parametrize("fmt, amsgrad", [("int8", False), ("dynamic8", True), ("sqrt8", True), ("fp8_e4m3", False),
                                           ("fp8_e5m2", True), ("bf16", False),
                                           ({"exp_avg": "fp8_e4m3", "exp_avg_sq": "dynamic8"}, True)])
def test_resume_continues_bitwise_like_an_uninterrupted_run(fmt, amsgrad):
    params = make_params()
    opt = lowbit_compile(torch.optim.AdamW(params, lr=1e-2, amsgrad=amsgrad), fmt, **OPTIONS)
    train(opt, params, 3, seed=1)
    saved = saved_and_loaded({"params": [p.detach().clone() for p in params], "optim": opt.state_dict()})
    train(opt, params, 3, seed=2)

    resumed = [torch.nn.Parameter(p) for p in saved["params"]]
    opt2 = lowbit_compile(torch.optim.AdamW(resumed, lr=0.5, amsgrad=amsgrad), fmt, **OPTIONS)
    opt2.load_state_dict(saved["optim"])
    assert opt2.param_groups[0]["lr"] == 1e-2
    train(opt2, resumed, 3, seed=2)
    assert_same([p.detach() for p in params], [p.detach() for p in resumed])
    assert_same(state_bits(opt, params), state_bits(opt2, resumed))


def test_loading_a_stock_adamw_checkpoint_quantizes_it():
    params = make_params()
    stock = torch.optim.AdamW(params, lr=1e-2)
    train(stock, params, 2, seed=1)
    sd = saved_and_loaded(stock.state_dict())
    opt = lowbit_compile(torch.optim.AdamW(params, lr=1e-2), "int8", **OPTIONS)
    opt.load_state_dict(sd)
    for p in params:
        for key in ("exp_avg", "exp_avg_sq"):
            value = opt.state[p][key]
            assert isinstance(value, QuantizedState), "a stock state must not stay fp32"
            expected = QuantizedState.from_dense(stock.state[p][key], value.fmt)
            assert_same(list(value.storage_parts), list(expected.storage_parts))
        assert torch.equal(opt.state[p]["step"], stock.state[p]["step"])
    train(opt, params, 1, seed=2)


def test_export_gives_a_stock_fp32_state_dict_a_stock_adamw_loads():
    params = make_params()
    opt = lowbit_compile(torch.optim.AdamW(params, lr=1e-2), "dynamic8", **OPTIONS)
    train(opt, params, 2, seed=1)
    for source in (opt, saved_and_loaded(opt.state_dict())):
        exported = checkpoint.stock_state_dict(source)
        for idx, p in enumerate(params):
            for key in ("exp_avg", "exp_avg_sq"):
                dense = exported["state"][idx][key]
                assert type(dense) is torch.Tensor and dense.dtype == torch.float32 and dense.shape == p.shape
                assert torch.equal(dense, opt.state[p][key].dequantize())
    stock = torch.optim.AdamW(params, lr=1e-2)
    stock.load_state_dict(checkpoint.stock_state_dict(opt))
    train(stock, params, 1, seed=2)


# A process that never imported lowbit_compile: only torch, and torch.load(weights_only=True).
# (A lowbit_compile.py that raises on import makes sure of it, installed package or not.)
FRESH_STOCK_STEP = """
import sys, torch
saved = torch.load(sys.argv[1], weights_only=True)
params = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
opt = getattr(torch.optim, saved["name"])(params, **saved["kwargs"])
before = [p.detach().clone() for p in params]
phase = "load"
try:
    opt.load_state_dict(saved["optimizer"])
    phase = "step"
    for p, g in zip(params, saved["grads"]):
        p.grad = g.clone()
    opt.step()
    error = None
except Exception as err:
    error = f"{phase}: {type(err).__name__}: {err}"
torch.save({"params": [p.detach() for p in params], "before": before, "error": error}, sys.argv[2])
"""


def _stock_step_in_a_fresh_process(tmp_path, name: str, kwargs: dict, optimizer_state: dict,
                                   params: list[torch.Tensor], grads: list[torch.Tensor],
                                   imports_lowbit_compile: bool = False) -> dict:
    """What a stock ``torch.optim.<name>(**kwargs)`` in a fresh process does with ``optimizer_state``
    saved to a file: its ``load_state_dict``, then one step with ``grads``; the process imports
    lowbit_compile first (and uses nothing of it) where ``imports_lowbit_compile``, else cannot."""
    import subprocess
    import sys
    from pathlib import Path

    env = {"PATH": "/usr/bin:/bin"}
    if imports_lowbit_compile:
        env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
        (tmp_path / "step.py").write_text("import lowbit_compile\n" + FRESH_STOCK_STEP)
    else:
        (tmp_path / "lowbit_compile.py").write_text("raise ImportError('this process must not import lowbit_compile')")
        (tmp_path / "step.py").write_text(FRESH_STOCK_STEP)
    torch.save({"name": name, "kwargs": kwargs, "optimizer": optimizer_state, "params": [p.detach() for p in params],
                "grads": grads}, tmp_path / "in.pt")
    done = subprocess.run([sys.executable, "step.py", "in.pt", "out.pt"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    return torch.load(tmp_path / "out.pt", weights_only=True)


ADAMW = ("AdamW", {"lr": 1e-2, "weight_decay": 0.1})


def _trained_for_export(name: str = ADAMW[0], kwargs: dict = ADAMW[1], shapes=SHAPES, **options: object
                        ) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter], list[torch.Tensor]]:
    params = make_params(shapes)
    opt = lowbit_compile(getattr(torch.optim, name)(params, **kwargs), "int8", **{**OPTIONS, **options})
    train(opt, params, 2, seed=1)
    gen = torch.Generator().manual_seed(3)
    return opt, params, [torch.randn(p.shape, generator=gen) for p in params]


@pytest.mark.slow
def test_the_stock_export_loads_and_steps_in_a_process_without_lowbit_compile(tmp_path):
    """``stock_state_dict`` is a checkpoint for tools that never heard of lowbit_compile: a stock
    AdamW in a fresh process loads it (weights-only) and steps exactly as ``restore(opt)`` does here."""
    opt, params, grads = _trained_for_export()
    out = _stock_step_in_a_fresh_process(tmp_path, *ADAMW, checkpoint.stock_state_dict(opt), params, grads)
    assert out["error"] is None
    restore(opt)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    for ours, theirs in zip(params, out["params"]):
        assert torch.equal(ours.detach(), theirs)


@pytest.mark.parametrize("name, kwargs", [
    ADAMW, pytest.param("RAdam", {"lr": 1e-2, "weight_decay": 0.1}, marks=pytest.mark.slow),
    pytest.param("Adagrad", {"lr": 1e-2, "weight_decay": 0.1}, marks=pytest.mark.slow)])
def test_a_low_bit_checkpoint_is_refused_by_a_stock_optimizer_before_anything_changes(tmp_path, name, kwargs):
    """A stock step-bearing optimizer in a fresh process refuses the saved low-bit checkpoint in its
    ``load_state_dict`` (the saved step is text it cannot read as a number), naming the fix, before
    any step; in memory the step is the stock one."""
    opt, params, grads = _trained_for_export(name, kwargs)
    sd = opt.state_dict()
    assert all(type(entry["step"]) is torch.Tensor for entry in sd["state"].values())
    out = _stock_step_in_a_fresh_process(tmp_path, name, kwargs, sd, params, grads)
    assert out["error"] is not None and out["error"].startswith("load: ValueError")
    assert "lowbit_compile.restore" in out["error"] and "stock_state_dict" in out["error"]
    assert all(torch.equal(a, b) for a, b in zip(out["params"], out["before"]))


SGD = ("SGD", {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.1})


@pytest.mark.slow
@pytest.mark.parametrize("foreach", [False, True])
def test_a_stock_sgd_fails_on_a_low_bit_momentum_before_its_first_parameter_changes(tmp_path, foreach):
    """SGD saves no step to refuse: a stock SGD loads the checkpoint, and its step fails on the first
    parameter's packed momentum, before it updates it (one-by-one and foreach paths)."""
    name, kwargs = SGD[0], {**SGD[1], "foreach": foreach}
    opt, params, grads = _trained_for_export(name, kwargs)
    assert checkpoint.is_packed(opt.state_dict()["state"][0]["momentum_buffer"])
    out = _stock_step_in_a_fresh_process(tmp_path, name, kwargs, opt.state_dict(), params, grads)
    assert out["error"] is not None and out["error"].startswith("step: ")  # torch's own error, a dict for a tensor
    assert all(torch.equal(a, b) for a, b in zip(out["params"], out["before"]))


@pytest.mark.parametrize("foreach", [False, True])
def test_a_stock_sgd_in_a_process_that_imports_lowbit_compile_fails_naming_it_and_the_fix(tmp_path, foreach):
    """SGD keeps no step to refuse at load: its first step meets the checkpoint's low-bit momenta. In a
    process that imports lowbit_compile (and uses nothing of it) that step fails saying what they are
    and what to do, before any parameter changes (without lowbit_compile it is torch's own
    ``'bytes' object has no attribute 'mul_'``, above)."""
    name, kwargs = SGD[0], {**SGD[1], "foreach": foreach}
    opt, params, grads = _trained_for_export(name, kwargs, shapes=[(8,), (64, 64)], min_8bit_size=64)
    out = _stock_step_in_a_fresh_process(tmp_path, name, kwargs, opt.state_dict(), params, grads,
                                         imports_lowbit_compile=True)
    assert out["error"] is not None and out["error"].startswith("step: RuntimeError: this SGD is a stock optimizer")
    assert "lowbit_compile low-bit states" in out["error"] and "stock_state_dict" in out["error"]
    assert all(torch.equal(a, b) for a, b in zip(out["params"], out["before"]))


@pytest.mark.slow
@pytest.mark.parametrize("foreach", [False, True])
def test_a_stock_sgd_whose_first_momentum_is_fp32_changes_nothing(tmp_path, foreach):
    """SGD keeps no step to refuse: where a checkpoint holds any low-bit momentum, its fp32 momenta
    pickle refused too, so a stock SGD fails at its first param whichever kind it holds; in memory and
    through our own load they are the tensors."""
    name, kwargs = SGD[0], {**SGD[1], "foreach": foreach}
    opt, params, grads = _trained_for_export(name, kwargs, shapes=[(8,), (64, 64)], min_8bit_size=64)
    sd = opt.state_dict()
    assert [checkpoint.is_packed(e["momentum_buffer"]) for e in sd["state"].values()] == [False, True]
    assert type(sd["state"][0]["momentum_buffer"]) is torch.Tensor
    saved = saved_and_loaded(sd)
    assert saved["state"][0]["momentum_buffer"] == checkpoint.STOCK_REFUSAL
    out = _stock_step_in_a_fresh_process(tmp_path, name, kwargs, sd, params, grads)
    assert out["error"] is not None and out["error"].startswith("step: ")
    assert all(torch.equal(a, b) for a, b in zip(out["params"], out["before"]))
    twin = lowbit_compile(torch.optim.SGD([torch.nn.Parameter(p.detach().clone()) for p in params], **kwargs),
                          "int8", **{**OPTIONS, "min_8bit_size": 64})
    twin.load_state_dict(saved)
    assert torch.equal(twin.state[twin.param_groups[0]["params"][0]]["momentum_buffer"],
                       opt.state[params[0]]["momentum_buffer"])


def test_an_sgd_state_dict_without_low_bit_states_stays_stock():
    opt, _, _ = _trained_for_export(*SGD, shapes=[(8,), (16,)], min_8bit_size=1000)
    saved = saved_and_loaded(opt.state_dict())
    assert all(type(e["momentum_buffer"]) is torch.Tensor for e in saved["state"].values())


def test_a_saved_low_bit_entry_keeps_its_step_aside_and_loads_back_exactly():
    """Pickled (torch.save, deepcopy), an entry with low-bit states has the refusal as its step and
    the step under ``lowbit_step``; our loader, ``stock_state_dict`` and a stock optimizer loading
    in an ``enable()`` scope put it back. An fp32-only entry is saved as stock's."""
    import copy

    stock_load = torch.optim.Optimizer.load_state_dict
    params = make_params()
    opt = lowbit_compile(torch.optim.AdamW(params, lr=1e-2), {"exp_avg": "int8", "exp_avg_sq": "fp32"},
                         **{**OPTIONS, "min_8bit_size": 300})
    train(opt, params, 2, seed=1)
    for saved in (saved_and_loaded(opt.state_dict()), copy.deepcopy(opt.state_dict())):
        for idx, p in enumerate(params):
            entry, packed = saved["state"][idx], checkpoint.is_packed(saved["state"][idx]["exp_avg"])
            assert packed == (p.numel() >= 300)
            if packed:
                assert entry["step"] == checkpoint.STOCK_REFUSAL and torch.equal(entry["lowbit_step"], opt.state[p]["step"])
            else:
                assert set(entry) == {"step", "exp_avg", "exp_avg_sq"} and type(entry["step"]) is torch.Tensor
        again = lowbit_compile(torch.optim.AdamW(params, lr=1e-2), "int8", **OPTIONS)
        again.load_state_dict(saved)
        exported = checkpoint.stock_state_dict(saved)["state"]
        stock = torch.optim.AdamW(params, lr=1e-2)
        with enable(**OPTIONS):
            stock.load_state_dict(saved)
        for idx, p in enumerate(params):
            for loaded in (again.state[p], exported[idx], stock.state[p]):
                assert "lowbit_step" not in loaded and torch.equal(loaded["step"], opt.state[p]["step"])
    with pytest.raises(ValueError, match="lowbit_compile.restore"):
        torch.optim.AdamW(params, lr=1e-2).load_state_dict(saved)
    fp32 = lowbit_compile(torch.optim.AdamW(params, lr=1e-2), "fp32")
    train(fp32, params, 1, seed=3)
    assert all(type(e) is dict and set(e) == {"step", "exp_avg", "exp_avg_sq"} and type(e["step"]) is torch.Tensor
               for e in saved_and_loaded(fp32.state_dict())["state"].values())
    assert torch.optim.Optimizer.load_state_dict is stock_load  # the scope put torch's back


def test_restore_after_loading_gives_a_stock_optimizer_with_fp32_states():
    params = make_params()
    opt = lowbit_compile(torch.optim.AdamW(params, lr=1e-2), "int8", **OPTIONS)
    train(opt, params, 2, seed=1)
    sd = saved_and_loaded(opt.state_dict())
    plain = torch.optim.AdamW(params)
    lowbit_compile(plain, "int8", **OPTIONS).load_state_dict(sd)
    restore(plain)
    for p in params:
        for key in ("exp_avg", "exp_avg_sq"):
            assert type(plain.state[p][key]) is torch.Tensor
            assert torch.equal(plain.state[p][key], opt.state[p][key].dequantize())
    train(plain, params, 1, seed=2)


@pytest.mark.parametrize("target", [{"fmt": "fp8_e4m3", "block_size": 16}, {"fmt": "int8", "block_size": 128},
                                    {"fmt": "fp32", "block_size": 64}])
def test_another_format_or_block_size_is_converted(target):
    params = make_params()
    opt = lowbit_compile(torch.optim.AdamW(params), "int8", block_size=64, min_8bit_size=0)
    train(opt, params, 2, seed=1)
    sd = saved_and_loaded(opt.state_dict())
    opt2 = lowbit_compile(torch.optim.AdamW(params), target["fmt"], block_size=target["block_size"], min_8bit_size=0)
    opt2.load_state_dict(sd)
    for p in params:
        for key in ("exp_avg", "exp_avg_sq"):
            saved, loaded = opt.state[p][key], opt2.state[p][key]
            fmt = StateFormat.make(target["fmt"], target["block_size"], DEFAULT_OUTLIERS, key == "exp_avg_sq")
            if fmt.passthrough:
                assert type(loaded) is torch.Tensor and torch.equal(loaded, saved.dequantize())
                continue
            assert loaded.fmt == fmt
            expected = QuantizedState.from_dense(saved.dequantize(), fmt)
            assert_same(list(loaded.storage_parts), list(expected.storage_parts))
    train(opt2, params, 1, seed=2)


def _corrupt(sd: dict, change, index: int = 0, key: str = "exp_avg") -> dict:
    sd["state"][index][key] = change(dict(sd["state"][index][key]))
    return sd


CORRUPTIONS = {
    "unknown format": (lambda d: {**d, "lowbit_format": text("int9:64:2:s")}, r"'exp_avg'.*int9"),
    "format without block size": (lambda d: {**d, "lowbit_format": text("int8")},
                                  r"'exp_avg'.*not a lowbit_compile state this version can read"),
    "format as a string": (lambda d: {**d, "lowbit_format": "int8:64:0:s"}, r"'exp_avg'.*not a lowbit_compile state"),
    "unknown dtype": (lambda d: {**d, "dtype": text("float99")}, r"'exp_avg'.*dtype 'float99'"),
    "missing scales": (lambda d: {k: v for k, v in d.items() if k != "block_scales"},
                       r"'exp_avg'.*lacks \['block_scales'\]"),
    "row splits": (lambda d: {**d, "row_splits": text("0,40")}, r"'exp_avg'.*row_splits \[0, 40\] do not split the 67 rows"),
    "shape": (lambda d: {**d, "shape": text("3,3")}, r"'exp_avg' was saved for a parameter of shape \(3, 3\)"),
    "truncated codes": (lambda d: {**d, "codes": d["codes"][:50]}, r"'exp_avg'.*'codes' has shape \(50, 33\), not \(67, 33\)"),
    "codes of another dtype": (lambda d: {**d, "codes": d["codes"].view(torch.int8).to(torch.float16) - 0.5},
                               r"'exp_avg'.*'codes' holds values that are not bytes"),
    "codes of an integer dtype": (lambda d: {**d, "codes": d["codes"].to(torch.int32)},
                                  r"'exp_avg'.*'codes' has dtype torch.int32, not uint8"),
    "scales of the wrong shape": (lambda d: {**d, "block_scales": d["block_scales"][:, :2]},
                                  r"'exp_avg'.*'block_scales' has shape \(35, 2\), not \(35, 4\)"),
    "truncated scales": (lambda d: {**d, "block_scales": d["block_scales"][:-1]},
                         r"'exp_avg'.*'block_scales' has shape \(34, 4\)"),
    "scales as fp16 values": (lambda d: {**d, "block_scales": d["block_scales"].view(torch.float32).half()},
                              r"'exp_avg'.*'block_scales' has shape \(35, 1\)"),
    "patches of the wrong shape": (lambda d: {**d, "block_patch_index": d["block_patch_index"][:, :1]},
                                   r"'exp_avg'.*'block_patch_index' has shape"),
    "a dense state of the wrong shape": (lambda d: torch.zeros(3, 3),
                                         r"'exp_avg' of a parameter of shape \(67, 33\) has shape \(3, 3\)"),
    "a state that is not a tensor": (lambda d: "garbage", r"'exp_avg' is a str, not a tensor"),
    # headers that claim more than the parameter holds: refused before anything of that size is read
    "a claim of 1e12 rows": (lambda d: {**d, "shape": text("1000000000000,33"), "row_splits": text("*1")},
                             r"'exp_avg' was saved for a parameter of shape \(1000000000000, 33\)"),
    "a row split per row": (lambda d: {**d, "row_splits": text("*1")},
                            r"'exp_avg'.*'block_scales' has shape \(35, 4\), not \(67, 4\)"),
    "row splits past the rows": (lambda d: {**d, "row_splits": text("0," + "9" * 40)},
                                 r"'exp_avg'.*row_splits \[0, 9+\] do not split the 67 rows"),
    "a block size no version writes": (lambda d: {**d, "lowbit_format": text("int8:1000000000000:2:s")},
                                       r"'exp_avg'.*block size or outlier count"),
    "a header field longer than any written": (lambda d: {**d, "dtype": text("float32" + " " * 300)},
                                               r"'exp_avg'.*'dtype' is 307 bytes long, more than the 255"),
    "a header field that is a float": (lambda d: {**d, "shape": 67.0}, r"'exp_avg'.*'shape' is a float"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_a_corrupt_state_fails_naming_it_and_changes_nothing(name):
    """Each part of a saved state corrupted in turn, in the state read last (every other one
    would load): the error names the parameter and state, and the optimizer keeps its
    param_groups (the checkpoint's lr differs) and every state bit for bit."""
    change, match = CORRUPTIONS[name]
    params = make_params()
    opt = lowbit_compile(torch.optim.AdamW(params, lr=1e-2), **OPTIONS, outliers=2)
    train(opt, params, 1, seed=1)
    sd = saved_and_loaded(opt.state_dict())
    sd["param_groups"][0]["lr"] = 0.5
    sd = _corrupt(sd, change)
    sd["state"] = {k: sd["state"][k] for k in (1, 2, 3, 0)}  # the corrupt one is read last
    params_before = [p.detach().clone() for p in params]
    groups_before = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    before = {p: {k: (list(v.storage_parts) if isinstance(v, QuantizedState) else v.clone()) for k, v in opt.state[p].items()}
              for p in params}
    objects = {p: dict(opt.state[p]) for p in params}
    with pytest.raises(ValueError, match=r"parameter \(param_groups\[0\]\['params'\]\[0\], shape \(67, 33\)\)"
                                         r".*" + match):
        opt.load_state_dict(sd)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups_before
    for p, q in zip(params, params_before):
        assert torch.equal(p, q)
        assert opt.state[p].keys() == before[p].keys()
        assert all(opt.state[p][k] is objects[p][k] for k in objects[p])
        for k, v in before[p].items():
            now = opt.state[p][k]
            assert_same(list(now.storage_parts) if isinstance(now, QuantizedState) else [now],
                        v if isinstance(v, list) else [v])
    train(opt, params, 1, seed=2)


def _two_shard_checkpoint(x: torch.Tensor, fmt: StateFormat, split: int) -> dict:
    """What FSDP2 on two ranks saves for a state ``x`` (gathered, as full_state_dict gives it):
    each rank quantized its rows on their own, blocks counted from its first element."""
    halves = [codec.pack(QuantizedState.from_dense(part, fmt), part) for part in (x[:split], x[split:])]
    gathered = {name: torch.cat([h[name] for h in halves]) for name in ("codes", *codec._TABLES)}
    return {**halves[0], **gathered, "shape": text(",".join(map(str, x.shape))),
            "row_splits": text(f"0,{split},{x.shape[0]}")}


@pytest.mark.parametrize("shape, split", [((129, 10), 65), ((7, 300), 4), ((3001,), 1501)])
def test_a_checkpoint_of_two_shards_loads_unsharded(shape, split):
    fmt = StateFormat("int8", 64, 2, False)
    x = torch.randn(shape)
    packed = _two_shard_checkpoint(x, fmt, split)
    shards = [QuantizedState.from_dense(part, fmt) for part in (x[:split], x[split:])]
    dense = torch.cat([s.dequantize() for s in shards])
    assert torch.equal(checkpoint.stock_state_dict({"state": {0: {"m": packed}}})["state"][0]["m"], dense)

    loaded = codec.unpack(packed, torch.empty(shape))
    # blocks of the first shard start where the unsharded blocks do: all but its last are kept bit for bit
    whole = (split * dense[0].numel()) // 64
    assert torch.equal(loaded.codes[: whole * 64], shards[0].codes[: whole * 64])
    assert torch.equal(loaded.scales[:whole], shards[0].scales[:whole])
    # the rest is re-quantized from the saved values: a code is off by at most half a step (the
    # block's scale), a patch by bf16 rounding (2^-9 relative); twice those leaves room for rounding
    error = (loaded.dequantize() - dense).abs().reshape(-1)
    bound = torch.maximum(loaded.scales.repeat_interleave(64)[: error.numel()], dense.abs().reshape(-1) * 2**-8)
    assert bool((error <= bound).all())


def test_the_row_splits_of_many_shards_survive_a_weights_only_load():
    """300 FSDP2-like shards of 5 rows (torch.chunk's: equal but the last): listed, the splits pass the
    255 bytes ``torch.load(weights_only=True)`` reads in an int, so they are saved as ``*5``; the loaded
    state is each shard's own quantization, bit for bit (its blocks are the unsharded ones)."""
    fmt = StateFormat("int8", 64, 0, False)
    x = torch.randn(1498, 64)
    shards = [QuantizedState.from_dense(part, fmt) for part in torch.split(x, 5)]
    packed = [codec.pack(s, part) for s, part in zip(shards, torch.split(x, 5))]
    saved = {**packed[0], **{name: torch.cat([p[name] for p in packed]) for name in ("codes", *codec._TABLES)},
             "shape": text("1498,64"), "row_splits": text(codec._splits_text([*range(0, 1498, 5), 1498]))}
    assert codec._text(saved["row_splits"]) == "*5"
    assert codec._splits_text([0, 5, 10, 12]) == "0,5,10,12"  # short lists stay lists
    buffer = io.BytesIO()
    torch.save({"state": {0: {"m": saved}}}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["state"][0]["m"]
    state = codec.unpack(loaded, torch.empty(1498, 64))
    assert torch.equal(state.codes, torch.cat([s.codes for s in shards]))
    assert torch.equal(state.dequantize(), torch.cat([s.dequantize() for s in shards]))


def _peak_rss_growth(fn) -> int:
    """Bytes the resident set's high-water mark grows while ``fn`` runs (Linux: reset through clear_refs)."""
    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from the current resident set
    before = status("VmRSS:")
    fn()
    return status("VmHWM:") - before


@pytest.mark.parametrize("rows", [10**12, 3 * 10**7])
def test_a_header_that_claims_a_huge_parameter_costs_less_to_refuse_than_a_valid_load(rows):
    """A packed state that claims ``rows`` rows split every row (``*1``: a list of ``rows`` splits, which
    read as claimed took 1.5 GB for 3e7 rows before its shape was compared): refused naming the shape,
    and the refusal grows the peak resident set no more than loading the valid state of that parameter."""
    fmt = StateFormat("int8", 256, 2, False)
    param = torch.empty(2048, 256)
    valid = codec.pack(QuantizedState.from_dense(torch.randn(param.shape), fmt), param)
    hostile = {**valid, "shape": text(f"{rows},256"), "row_splits": text("*1")}
    codec.unpack(valid, param)  # warm: the first load pays for imports and caches
    loading = _peak_rss_growth(lambda: codec.unpack(valid, param))
    with pytest.raises(ValueError, match=rf"saved for a parameter of shape \({rows}, 256\), not \(2048, 256\)"):
        codec.unpack(hostile, param)

    def refuse():
        with pytest.raises(ValueError):
            codec.unpack(hostile, param)

    # 1 MiB: a page or two of the allocator's (a warm valid load reuses freed memory and can grow by 0);
    # the 3e7-row claim read as claimed grew it by 1.2 GB, the 1e12-row one raised MemoryError
    assert _peak_rss_growth(refuse) <= loading + 2**20


def test_an_export_refuses_row_splits_of_more_shards_than_elements():
    """Without a parameter to compare with (``stock_state_dict``), the saved codes bound the rows; a
    parameter without elements has codes of no bytes whatever rows it claims, and a split per row of
    1e12 rows is refused before any split is listed."""
    fmt = StateFormat("bf16")
    claim = {"lowbit_format": text(fmt.tag()), "shape": text("1000000000000,0"), "dtype": text("float32"),
             "row_splits": text("*1"), "codes": torch.empty(10**12, 0, dtype=torch.uint8)}
    with pytest.raises(ValueError, match=r"row_splits '\*1' split the 1000000000000 rows into more shards"):
        checkpoint.stock_state_dict({"state": {0: {"exp_avg": claim}}})


def test_a_loader_that_bypasses_load_state_dict_is_caught_at_the_next_step():
    """ZeroRedundancyOptimizer writes ``optim.state[p]`` itself; the step unpacks what it finds."""
    params = make_params()
    opt = lowbit_compile(torch.optim.AdamW(params, lr=1e-2), "int8", **OPTIONS)
    train(opt, params, 2, seed=1)
    sd = saved_and_loaded({"params": [p.detach().clone() for p in params], "optim": opt.state_dict()})
    train(opt, params, 2, seed=2)

    resumed = [torch.nn.Parameter(p) for p in sd["params"]]
    opt2 = lowbit_compile(torch.optim.AdamW(resumed, lr=1e-2), "int8", **OPTIONS)
    for i, p in enumerate(resumed):
        opt2.state[p] = dict(sd["optim"]["state"][i])
    train(opt2, resumed, 2, seed=2)
    assert_same([p.detach() for p in params], [p.detach() for p in resumed])


def test_distributed_state_dict_api_in_one_process():
    """get_state_dict/set_state_dict key states by parameter name; the hooks follow."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 16))

    def steps(m, opt, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(2):
            m(torch.randn(8, 64, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()

    m = model()
    opt = lowbit_compile(torch.optim.AdamW(m.parameters(), lr=1e-2), **OPTIONS)
    steps(m, opt, 1)
    msd, osd = saved_and_loaded(get_state_dict(m, opt))
    assert set(osd["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    steps(m, opt, 2)
    m2 = model()
    opt2 = lowbit_compile(torch.optim.AdamW(m2.parameters(), lr=1e-2), **OPTIONS)
    set_state_dict(m2, opt2, model_state_dict=msd, optim_state_dict=osd)
    steps(m2, opt2, 2)
    assert_same([p.detach() for p in m.parameters()], [p.detach() for p in m2.parameters()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_state_a_stock_loader_stored_is_restored_exactly_at_the_rewrite(dtype):
    """Under enable() a framework loads the checkpoint into the stock optimizer before its first
    step rewrites it (the scope puts the saved steps back for it): the stock loader casts every packed tensor to the parameter's dtype. The
    bytes survive any float cast, so the rewrite restores the states bit for bit."""
    params = [torch.nn.Parameter(p.detach().to(dtype)) for p in make_params()]
    opt = lowbit_compile(torch.optim.AdamW(params, lr=1e-2), "int8", outliers=2, **OPTIONS)
    train(opt, params, 2, seed=1)
    sd = saved_and_loaded({"params": [p.detach().clone() for p in params], "optim": opt.state_dict()})
    train(opt, params, 2, seed=2)

    resumed = [torch.nn.Parameter(p) for p in sd["params"]]
    stock = torch.optim.AdamW(resumed, lr=1e-2)
    with enable("int8", outliers=2, **OPTIONS):  # in scope, where the framework's resume runs
        stock.load_state_dict(sd["optim"])
        assert stock.state[resumed[0]]["exp_avg"]["codes"].dtype == dtype  # what the stock loader did
        train(stock, resumed, 2, seed=2)
    assert_same([p.detach() for p in params], [p.detach() for p in resumed])
    assert_same(state_bits(opt, params), state_bits(stock, resumed))



def test_a_dynamic8_checkpoint_of_the_old_map_loads_converted_code_by_code():
    """A checkpoint from before map version 2 (no ``lowbit_map``; codes index the legacy sorted
    map) loads as the nearest codes of the current map, block scales and patches as saved; a
    current one loads bit for bit; a newer map version fails naming the fix."""
    params = make_params()
    opt = lowbit_compile(torch.optim.AdamW(params, lr=1e-2), "dynamic8", **OPTIONS)
    train(opt, params, 2, seed=1)
    old = saved_and_loaded(opt.state_dict())
    legacy_codes = {}
    for idx, p in enumerate(params):
        for key in ("exp_avg", "exp_avg_sq"):
            packed, nonneg = old["state"][idx][key], opt.state[p][key].fmt.nonneg
            assert packed.pop("lowbit_map") == 2
            legacy = legacy_dynamic_map(nonneg).double()
            values = dynamic_map(nonneg)[packed["codes"].long()].double()  # how version 1 encoded them
            packed["codes"] = torch.bucketize(values, (legacy[1:] + legacy[:-1]) / 2, right=True).to(torch.uint8)
            legacy_codes[idx, key] = packed["codes"].reshape(-1).clone()
    fresh = lowbit_compile(torch.optim.AdamW(params, lr=1e-2), "dynamic8", **OPTIONS)
    fresh.load_state_dict(old)
    for idx, p in enumerate(params):
        for key in ("exp_avg", "exp_avg_sq"):
            loaded, saved = fresh.state[p][key], opt.state[p][key]
            old_values = legacy_dynamic_map(saved.fmt.nonneg)[legacy_codes[idx, key].long()]
            assert torch.equal(loaded.codes.reshape(-1), encode(old_values, saved.fmt))
            assert_same([loaded.scales, loaded.patch_values, loaded.patch_index],
                        [saved.scales, saved.patch_values, saved.patch_index])
            step = (loaded.codes.reshape(-1).long() - saved.codes.reshape(-1).long()).abs()
            assert int(step.max()) <= 1  # one code of the new map off at most, after two roundings
    current = lowbit_compile(torch.optim.AdamW(params, lr=1e-2), "dynamic8", **OPTIONS)
    current.load_state_dict(saved_and_loaded(opt.state_dict()))
    assert_same(state_bits(current, params), state_bits(opt, params))
    newer = opt.state_dict()
    newer["state"][0]["exp_avg"]["lowbit_map"] = 3
    with pytest.raises(ValueError, match=r"'exp_avg'.*map version 3.*upgrade lowbit_compile"):
        lowbit_compile(torch.optim.AdamW(params, lr=1e-2), "dynamic8", **OPTIONS).load_state_dict(newer)


def test_old_map_codes_of_a_flagged_block_keep_their_special_codes():
    for nonneg in (False, True):
        fmt = StateFormat("dynamic8", nonneg=nonneg)
        codes = torch.arange(256).to(torch.uint8)
        upgraded = upgrade_codes(codes, fmt, torch.ones(256, dtype=torch.bool))
        special = list(special_codes(fmt))
        assert upgraded[special].tolist() == special
        finite = torch.ones(256, dtype=torch.bool)
        finite[special] = False
        assert torch.all(decode(upgraded[finite], fmt).abs() <= fmt.flagged_qmax)
        plain = upgrade_codes(codes, fmt, torch.zeros(256, dtype=torch.bool))
        assert torch.equal(plain, encode(legacy_dynamic_map(nonneg), fmt))
