"""Switching from bitsandbytes or torchao mid-run keeps the moments: their Adam state dicts, run on the
CPU here, load through ``checkpoint.from_peer_state_dict`` into a wrapped optimizer; the imported
moments are the peer's own dequantized ones within our format's stated resolution, and the run
continues as the peer's own continued run does, within the bound the two formats' rounding allows.
A malformed peer state is refused before anything changes, naming the parameter and the cause."""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import bitsandbytes as bnb
import bitsandbytes.functional as bnb_functional
import pytest
import torch
import torchao.optim

from bench.bounds import stored_interval
from lowbit_compile import QuantizedState, lowbit_compile
from lowbit_compile.checkpoint import from_peer_state_dict

from .helpers import slow_but
from .test_numerics import assert_holds

# partial blocks on purpose: 20 whole blocks of 256 (both peers quantize it); 4100 elements, a partial last
# bitsandbytes block (torchao keeps it fp32: not a multiple of its block); 10 elements, fp32 in both peers
SHAPES = [(64, 80), (4100,), (10,)]
LR, WEIGHT_DECAY = 1e-2, 1e-2
PEER_STEPS, STEPS = 4, 4


@dataclass(frozen=True)
class Peer:
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
    ours: type[torch.optim.Optimizer]  # the stock optimizer that does what the peer does
    hyper: dict
    moments: Callable[[dict], tuple[torch.Tensor, torch.Tensor]]  # a param's m and v, read by the peer itself


def _bnb_moments(state: dict) -> tuple[torch.Tensor, torch.Tensor]:
    if state["state1"].dtype != torch.uint8:
        return state["state1"], state["state2"]
    return tuple(bnb_functional.dequantize_blockwise(state[f"state{i}"], absmax=state[f"absmax{i}"],
                                                     code=state[f"qmap{i}"], blocksize=256) for i in (1, 2))


def _torchao_moments(state: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(v.dequantize() if hasattr(v, "dequantize") else v for v in (state["exp_avg"], state["exp_avg_sq"]))


ADAMW = {"lr": LR, "weight_decay": WEIGHT_DECAY}
PEERS = {
    "bitsandbytes AdamW8bit": Peer(lambda p: bnb.optim.AdamW8bit(p, **ADAMW), torch.optim.AdamW, ADAMW, _bnb_moments),
    # bitsandbytes' Adam decays weights as AdamW does: without weight decay it is stock Adam
    "bitsandbytes Adam8bit": Peer(lambda p: bnb.optim.Adam8bit(p, lr=LR), torch.optim.Adam, {"lr": LR}, _bnb_moments),
    "torchao AdamW8bit": Peer(lambda p: torchao.optim.AdamW8bit(p, **ADAMW), torch.optim.AdamW, ADAMW,
                              _torchao_moments),
    "torchao AdamWFp8": Peer(lambda p: torchao.optim.AdamWFp8(p, **ADAMW), torch.optim.AdamW, ADAMW, _torchao_moments),
    "torchao AdamW4bit": Peer(lambda p: torchao.optim.AdamW4bit(p, **ADAMW), torch.optim.AdamW, ADAMW,
                              _torchao_moments),
}


def eager_torchao():
    """torchao compiles its per-parameter step (an inductor build per shape, seconds each on the CPU);
    the same function eagerly keeps the same states, and the compiled one is run in the slow tier."""
    return mock.patch.object(torch, "compile", lambda fn, **kwargs: fn)


def make_params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def grads(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) * (1 + seed % 3) for s in SHAPES]


def step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], grad: list[torch.Tensor]) -> None:
    for p, g in zip(params, grad):
        p.grad = g.clone()
    opt.step()


def run_peer(name: str, compiled: bool = False) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter], dict]:
    """The peer after ``PEER_STEPS`` steps, and its state dict as ``torch.load`` reads it back."""
    params = make_params()
    peer = PEERS[name].make(params)
    with contextlib.nullcontext() if compiled else eager_torchao():
        for i in range(PEER_STEPS):
            step(peer, params, grads(i))
    return peer, params, reloaded(peer.state_dict())


def reloaded(state_dict: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def imported(name: str, state_dict: dict, params: list[torch.nn.Parameter], **options) -> torch.optim.Optimizer:
    """Ours, on copies of ``params``, with the peer's state dict loaded."""
    peer = PEERS[name]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = lowbit_compile(peer.ours(twin, lr=1.0), min_8bit_size=0, backend="reference", **options)
    ours.load_state_dict(from_peer_state_dict(state_dict))
    return ours


# -- the import ---------------------------------------------------------------------------------------------
CASES = slow_but([pytest.param(name, fmt, id=f"{name}-{fmt}") for name in PEERS
                  for fmt in ("sqrt8", "dynamic8", "int8", "fp8_e4m3")],
                 *(f"{name}-sqrt8" for name in PEERS), "bitsandbytes AdamW8bit-dynamic8")


@pytest.mark.parametrize("name, fmt", CASES)
def test_imported_moments_are_the_peers_within_our_formats_resolution(name, fmt):
    """Each imported moment is our format's storage of the peer's own dequantized moment (its stated
    bound, docs/numerics.md), the step is the peer's, and so are the hyperparameters."""
    peer, params, state_dict = run_peer(name)
    ours = imported(name, state_dict, params, fmt=fmt)
    group = ours.param_groups[0]
    assert group["lr"] == pytest.approx(LR, rel=1e-7) and group["betas"] == (0.9, 0.999)
    assert group["weight_decay"] == PEERS[name].hyper.get("weight_decay", 0)
    for p, q in zip(params, group["params"]):
        state = ours.state[q]
        assert float(state["step"]) == PEER_STEPS
        for key, want in zip(("exp_avg", "exp_avg_sq"), PEERS[name].moments(peer.state[p])):
            got = state[key]
            assert isinstance(got, QuantizedState) and got.fmt.name == fmt
            assert_holds(want.reshape(-1), got.storage_parts, got.fmt)


def adam_update(m: torch.Tensor, v: torch.Tensor, t: int, lr: float, betas: tuple[float, float],
                eps: float) -> torch.Tensor:
    """Adam's update from the new moments at step ``t`` (float64)."""
    return lr * (m / (1 - betas[0] ** t)) / ((v.clamp(min=0) / (1 - betas[1] ** t)).sqrt() + eps)


@pytest.mark.parametrize("name", slow_but([pytest.param(n, id=n) for n in PEERS], *PEERS))
def test_after_import_ours_steps_as_the_peers_continued_run(name):
    """From the same params and grads, ours and the peer step on from the imported state for ``STEPS``
    steps. The bound, per element: before each step the stored moments differ by ``E = |m_ours - m_peer|``
    (``E_m``; ``E_v`` alike); Adam's new moments then differ by ``beta * E``, so the two updates differ by
    at most ``dev``, the largest change of the update over that box around the peer's (at its corners:
    the update is monotone in each moment). The param gap ``D`` grows by ``dev`` each step and decays
    with the weight (``D = (1 - lr wd) D + dev``), plus fp32 rounding: 2^-16 of the update (torchao
    takes its bias corrections in fp32: 1e-5 of them at these steps) and 2^-22 of the param. ``E`` is
    held to our format's rounding: our stored moments are within its stated resolution of Adam's new
    moments from what ours held (docs/numerics.md), and the peer's import within it of the peer's
    (``test_imported_moments_...``). A run whose moments start afresh breaks the bound at its first
    step, and so does one whose step count restarts."""
    peer, params, state_dict = run_peer(name)
    ours = imported(name, state_dict, params, rounding="nearest")
    fresh = lowbit_compile(PEERS[name].ours([torch.nn.Parameter(p.detach().clone()) for p in params],
                                            **PEERS[name].hyper, betas=(0.9, 0.999)), min_8bit_size=0,
                           backend="reference")
    restarted = imported(name, {**state_dict, "state": {i: {**e, "step": 0} if "step" in e else e
                                                         for i, e in state_dict["state"].items()}}, params)
    group = ours.param_groups[0]
    lr, betas, eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    ours_params = group["params"]
    gap = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    for k in range(STEPS):
        t = PEER_STEPS + k + 1
        grad = grads(100 + k)
        before = []
        for p, q, g in zip(params, ours_params, grad):
            held_peer = [x.double().reshape(-1) for x in PEERS[name].moments(peer.state[p])]
            held_ours = [ours.state[q][key].dequantize().double().reshape(-1) for key in ("exp_avg", "exp_avg_sq")]
            g64 = g.double().reshape(-1)
            new_peer = [betas[0] * held_peer[0] + (1 - betas[0]) * g64,
                        betas[1] * held_peer[1] + (1 - betas[1]) * g64 * g64]
            new_ours = [betas[0] * held_ours[0] + (1 - betas[0]) * g64,
                        betas[1] * held_ours[1] + (1 - betas[1]) * g64 * g64]
            width = [b * (o - h).abs() * (1 + 2.0**-20) + 2.0**-21 * n.abs() + 2.0**-149
                     for b, o, h, n in zip(betas, held_ours, held_peer, new_peer)]
            update = adam_update(*new_peer, t, lr, betas, eps)
            dev = torch.stack([(adam_update(new_peer[0] + sm * width[0], new_peer[1] + sv * width[1], t, lr, betas,
                                            eps) - update).abs() for sm in (-1, 1) for sv in (-1, 1)]).amax(0)
            before.append((new_ours, update, dev))
        with eager_torchao():
            step(peer, params, grad)
        step(ours, ours_params, grad)
        for i, (p, q, (new_ours, update, dev)) in enumerate(zip(params, ours_params, before)):
            peer_p, ours_p = p.detach().double().reshape(-1), q.detach().double().reshape(-1)
            gap[i] = (1 - lr * wd) * gap[i] + dev + 2.0**-16 * update.abs() + 2.0**-22 * peer_p.abs()
            off = (ours_p - peer_p).abs()
            assert torch.all(off <= gap[i]), (name, t, SHAPES[i], float((off - gap[i]).max()))
            for key, value in zip(("exp_avg", "exp_avg_sq"), new_ours):
                stored = ours.state[q][key]
                lo, hi = stored_interval(value.float(), stored.fmt)
                held = stored.dequantize().double().reshape(-1)
                assert torch.all((lo <= held) & (held <= hi)), (name, t, SHAPES[i], key)
        if k == 0:  # the bound holds the moments and the step count: without them, it breaks
            for other in (fresh, restarted):
                step(other, other.param_groups[0]["params"], grad)
                off = [(q.detach().double().reshape(-1) - p.detach().double().reshape(-1)).abs()
                       for p, q in zip(params, other.param_groups[0]["params"])]
                assert any(bool((o > b).any()) for o, b in zip(off, gap))
    assert all(float(ours.state[q]["step"]) == PEER_STEPS + STEPS for q in ours_params)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in PEERS if n.startswith("torchao")])
def test_a_compiled_torchao_run_imports_as_its_eager_one(name):
    """torchao as shipped (its step compiled by inductor) saves the same layout: the import holds."""
    peer, params, state_dict = run_peer(name, compiled=True)
    ours = imported(name, state_dict, params)
    for p, q in zip(params, ours.param_groups[0]["params"]):
        for key, want in zip(("exp_avg", "exp_avg_sq"), PEERS[name].moments(peer.state[p])):
            got = ours.state[q][key]
            assert_holds(want.reshape(-1), got.storage_parts, got.fmt)


# -- the layouts it reads --------------------------------------------------------------------------------
def test_flat_bitsandbytes_entries_load_as_wrapped_ones():
    """bitsandbytes before 0.48 saved its tensors beside ``step``, not nested under one key."""
    _, params, state_dict = run_peer("bitsandbytes AdamW8bit")
    flat = {**state_dict, "state": {i: {"step": e["step"], **e["__bnb_optimizer_quant_state__"]}
                                    for i, e in state_dict["state"].items()}}
    for want, got in zip(from_peer_state_dict(state_dict)["state"].values(), from_peer_state_dict(flat)["state"].values()):
        assert want.keys() == got.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(want[k], got[k]) for k in want)


def test_a_whole_tensor_bitsandbytes_state_dequantizes_with_its_one_scale():
    """``block_wise=False`` (bitsandbytes before 0.46): one scale per state, ``max1``/``max2`` (after the
    step's swap, the max the codes were written with): each value within half a map gap of the scale."""
    qmap1, qmap2 = bnb_functional.create_dynamic_map(signed=True), bnb_functional.create_dynamic_map(signed=False)
    gen = torch.Generator().manual_seed(4)
    m, v = torch.randn(64, 80, generator=gen), torch.rand(64, 80, generator=gen)
    entry = {"step": 7}
    for i, (x, qmap) in enumerate(((m, qmap1), (v, qmap2)), 1):
        scale = x.abs().max()
        entry.update({f"state{i}": (x[..., None] / scale - qmap).abs().argmin(-1).to(torch.uint8),
                      f"qmap{i}": qmap, f"max{i}": scale.reshape(1), f"new_max{i}": torch.zeros(1)})
    got = from_peer_state_dict({"state": {0: entry}, "param_groups": [{"params": [0], **ADAMW}]})["state"][0]
    assert float(got["step"]) == 7
    for x, qmap, key in ((m, qmap1, "exp_avg"), (v, qmap2, "exp_avg_sq")):
        half_gap = (qmap.diff().max() / 2) * x.abs().max()  # as far as -1 is from the signed map's end, too
        assert torch.all((got[key] - x).abs() <= half_gap * (1 + 2.0**-10))


def test_stock_entries_pass_through_and_the_input_is_not_changed():
    peer, params, state_dict = run_peer("torchao AdamW8bit")
    lr = state_dict["param_groups"][0]["lr"]
    got = from_peer_state_dict(state_dict)
    assert isinstance(lr, torch.Tensor) and state_dict["param_groups"][0]["lr"] is lr
    assert got["param_groups"][0]["lr"] == float(lr)
    assert got["state"][1] is state_dict["state"][1]  # 4100 elements: torchao keeps plain fp32 moments
    assert type(state_dict["state"][0]["exp_avg"]).__name__ == "OptimState8bit"


# -- refusals ----------------------------------------------------------------------------------------------
CALL = r"optimizer\.load_state_dict\(lowbit_compile\.checkpoint\.from_peer_state_dict\(state_dict\)\)"


@pytest.mark.parametrize("name", ["bitsandbytes AdamW8bit", "torchao AdamW8bit"])
def test_loading_a_peer_state_dict_directly_names_the_call_that_converts_it(name):
    _, params, state_dict = run_peer(name)
    ours = lowbit_compile(PEERS[name].ours(make_params()), min_8bit_size=0, backend="reference")
    library = name.split()[0]
    with pytest.raises(ValueError, match=rf"param_groups\[0\]\['params'\]\[0\].*saved by a {library} optimizer.*"
                                         + CALL):
        ours.load_state_dict(state_dict)
    assert not ours.state


def _bnb(entry: dict) -> dict:
    return entry["__bnb_optimizer_quant_state__"]


def _torchao_attr(key: str, attr: str, value: Callable) -> Callable[[dict], None]:
    def change(entry: dict) -> None:
        setattr(entry[key], attr, value(getattr(entry[key], attr)))
    return change


def _set(where: Callable[[dict], dict], key: str, value: Callable) -> Callable[[dict], None]:
    def change(entry: dict) -> None:
        where(entry)[key] = value(where(entry).get(key))
    return change


def _nan_fp8(codes: torch.Tensor) -> torch.Tensor:
    bits = codes.view(torch.uint8).clone()
    bits[0, 3] = 0x7F  # e4m3fn's NaN
    return bits.view(torch.float8_e4m3fn)


MALFORMED = {  # (peer, change of parameter 0's entry, what the message says)
    "a map of 255 values": ("bitsandbytes AdamW8bit", _set(_bnb, "qmap1", lambda q: q[:255]),
                            r"'qmap1' has shape \(255,\), not \(256,\)"),
    "a map value outside [-1, 1]": ("bitsandbytes AdamW8bit", _set(_bnb, "qmap2", lambda q: q * 3),
                                    r"'qmap2' holds values that are not finite or outside \[-1, 1\]"),
    "a NaN scale": ("bitsandbytes AdamW8bit", _set(_bnb, "absmax1", lambda a: a.index_fill(0, torch.tensor([2]),
                                                                                           math.nan)),
                    r"'absmax1' holds inf, NaN or negative scales"),
    "a negative scale": ("bitsandbytes AdamW8bit", _set(_bnb, "absmax2", lambda a: -a),
                         r"'absmax2' holds inf, NaN or negative scales"),
    "a scale short": ("bitsandbytes AdamW8bit", _set(_bnb, "absmax2", lambda a: a[:-1]),
                      r"'absmax2' holds 19 scales, where its codes need 20"),
    "no scales": ("bitsandbytes AdamW8bit", lambda e: (_bnb(e).pop("absmax1"), _bnb(e).pop("absmax2")),
                  r"has neither 'absmax1' \(a scale per block\) nor 'max1'"),
    "codes of another dtype": ("bitsandbytes AdamW8bit", _set(_bnb, "state2", lambda s: s.to(torch.int16)),
                               r"'state1' is torch.uint8 and 'state2' torch.int16"),
    "codes of another shape": ("bitsandbytes AdamW8bit", _set(_bnb, "state1", lambda s: s.t()),
                               r"'state1' has shape \(80, 64\) and 'state2' \(64, 80\), where Adam keeps both"),
    "one state (Lion)": ("bitsandbytes AdamW8bit", lambda e: _bnb(e).pop("state2"),
                         r"has no 'state1' and 'state2'.*only Adam8bit/AdamW8bit states"),
    "a negative step": ("bitsandbytes AdamW8bit", lambda e: e.update(step=-3), r"'step' is -3, not a count"),
    "a fractional step": ("torchao AdamW8bit", lambda e: e.update(step=torch.tensor(2.5)),
                          r"'step' is tensor\(2.5000\), not a count"),
    "a torchao map of 255 values": ("torchao AdamW8bit", _torchao_attr("exp_avg", "qmap", lambda q: q[:255]),
                                    r"state 'exp_avg': its qmap has shape \(255,\), not \(256,\)"),
    "torchao scales that split no blocks": ("torchao AdamW8bit", _torchao_attr("exp_avg_sq", "scale",
                                                                               lambda s: s[:-1]),
                                            r"scale has shape \(19,\), which does not split its 5120 elements"),
    "torchao codes of another dtype": ("torchao AdamW8bit", _torchao_attr("exp_avg", "codes",
                                                                          lambda c: c.to(torch.int8)),
                                       r"codes are torch.int8, not torch.uint8"),
    "packed 4-bit codes short": ("torchao AdamW4bit", _torchao_attr("exp_avg", "codes", lambda c: c[:-1]),
                                 r"codes have shape \(2559,\), where a state of shape \(64, 80\) packs 5120"),
    "an fp8 NaN code": ("torchao AdamWFp8", _torchao_attr("exp_avg", "codes", _nan_fp8),
                        r"fp8 codes hold inf or NaN"),
    "fp8 codes times a huge scale": ("torchao AdamWFp8", _torchao_attr("exp_avg", "scale", lambda s: s.fill_(3e38)),
                                     r"its codes times its scales overflow to inf"),
    "a negative second moment": ("torchao AdamWFp8", _torchao_attr("exp_avg_sq", "codes", lambda c: (-c.float()).to(
        c.dtype)), r"second moment 'exp_avg_sq' holds negative values"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_peer_state_is_refused_naming_the_parameter_and_the_cause(case):
    name, change, says = MALFORMED[case]
    _, params, state_dict = run_peer(name)
    change(state_dict["state"][0])
    ours = lowbit_compile(PEERS[name].ours(make_params()), min_8bit_size=0, backend="reference")
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*" + says):
        ours.load_state_dict(from_peer_state_dict(state_dict))
    assert not ours.state


def test_an_ademamix_group_is_refused():
    _, _, state_dict = run_peer("bitsandbytes AdamW8bit")
    state_dict["param_groups"][0].update(alpha=5.0, betas=(0.9, 0.999, 0.9999))
    with pytest.raises(ValueError, match=r"param_groups\[0\] is an AdEMAMix group"):
        from_peer_state_dict(state_dict)
