"""Gradient release (``release_grads=True``): each parameter steps inside backward as its grad completes and
the grad is freed; params and states equal the same optimizer without release bit for bit; what needs the
grads after backward is refused, naming the setting and the fix; nothing keeps a grad past its step."""

from __future__ import annotations

import copy
import gc
import math
import weakref

import pytest
import torch

import lowbit_compile
from lowbit_compile import QuantizedState, enable, restore
from lowbit_compile import lowbit_compile as wrap
from lowbit_compile.runtime import release as release_module
from lowbit_compile.runtime.released_grad import ReleasedGrad, is_released
from lowbit_compile.runtime.run import StepPlan

from .helpers import FORMATS, run_command

BIG = {"min_8bit_size": 1024, "block_size": 128}  # the matrices get 8-bit states, biases and norms fp32


@pytest.fixture(autouse=True)
def _one_thread_small_buckets(monkeypatch):
    """One thread; params of 1024 elements or more (the matrices) step the moment their grad lands, the
    smaller ones (biases, norms) wait in a bucket, as a model of real size divides them."""
    monkeypatch.setattr(release_module, "SMALL_NUMEL", 1024)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Net(torch.nn.Module):
    """A tied embedding (also the output layer), two matrices, a norm, biases, and a layer used on even
    iterations only (no grad on odd ones)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(48, 32)
        self.up = torch.nn.Linear(32, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.down = torch.nn.Linear(64, 32)
        self.sometimes = torch.nn.Linear(32, 32)

    def forward(self, idx: torch.Tensor, i: int = 0) -> torch.Tensor:
        h = self.embed(idx)
        h = h + self.down(torch.tanh(self.norm(self.up(h))))
        if i % 2 == 0:
            h = h + self.sometimes(h)
        logits = h @ self.embed.weight.T
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.roll(1, -1).flatten())


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 48, (4, 8), generator=gen) for _ in range(n)]


def groups(model: Net, **second: object) -> list[dict]:
    """Two param groups: the matrices with weight decay, the rest without and with ``second``."""
    matrices = [model.up.weight, model.down.weight, model.sometimes.weight]
    rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
    return [{"params": matrices, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, **second}]


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 4, seed: int = 1,
          schedule: bool = True, dtype: torch.dtype | None = None) -> list[float]:
    """``steps`` iterations (backward, step, an LR schedule, zero_grad); the losses."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if schedule else None
    losses = []
    for i, idx in enumerate(batches(steps, seed)):
        loss = model(idx, i)
        (loss.float() if dtype else loss).backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def assert_same_run(a: torch.nn.Module, b: torch.nn.Module, opt_a: torch.optim.Optimizer,
                    opt_b: torch.optim.Optimizer, part: str | None = None) -> None:
    """Params, every state tensor (a quantized one's codes, scales and patches) and the state_dicts (or
    their ``part``) equal, bit for bit."""
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        assert opt_a.state[p].keys() == opt_b.state[q].keys(), name
        for key, x in opt_a.state[p].items():
            y = opt_b.state[q][key]
            if isinstance(x, QuantizedState):
                assert x.fmt == y.fmt and all(torch.equal(s, t) for s, t in zip(x.storage_parts, y.storage_parts))
            else:
                assert torch.equal(x, y), (name, key)
    sd_a, sd_b = opt_a.state_dict(), opt_b.state_dict()
    assert_same_tree(sd_a[part] if part else sd_a, sd_b[part] if part else sd_b)


def assert_same_tree(x: object, y: object) -> None:
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    elif isinstance(x, dict):
        assert x.keys() == y.keys()
        for k in x:
            assert_same_tree(x[k], y[k])
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y)
        for u, v in zip(x, y):
            assert_same_tree(u, v)
    else:
        assert x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))


def twin_runs(make, steps: int = 4, model=Net, loop=None, **train_kwargs) -> tuple:
    """The same training with and without release: ``make(model, release_grads)`` builds the optimizer,
    ``loop(model, opt, release_grads)`` trains (default: ``train`` for ``steps``)."""
    runs = []
    for release in (False, True):
        net = model()
        opt = make(net, release)
        if loop is None:
            train(net, opt, steps, **train_kwargs)
        else:
            loop(net, opt, release)
        runs.append((net, opt))
    (a, opt_a), (b, opt_b) = runs
    return a, b, opt_a, opt_b


def int8_adamw(net: torch.nn.Module, release: bool) -> torch.optim.Optimizer:
    return wrap(torch.optim.AdamW(net.parameters(), lr=1e-2), "int8", release_grads=release, **BIG)


# -- same result, bit for bit -----------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_release_is_bitwise_the_step_after_backward(fmt):
    """Every format, with an LR schedule, weight decay, amsgrad in one group and maximize in the other, a
    tied embedding and a layer without grads on odd iterations."""
    def make(net, release):
        opt = torch.optim.AdamW(groups(net, maximize=True), lr=1e-2, amsgrad=True)
        opt.param_groups[1]["amsgrad"] = False
        return wrap(opt, fmt, release_grads=release, **BIG)

    assert_same_run(*twin_runs(make, steps=5))


def test_fp32_release_is_stock_adamw_bit_for_bit():
    """``fmt="fp32"`` with release steps as stock single-tensor AdamW (``foreach=False``) after backward."""
    stock, ours = Net(), Net()
    stock_opt = torch.optim.AdamW(groups(stock), lr=1e-2, foreach=False)
    ours_opt = wrap(torch.optim.AdamW(groups(ours), lr=1e-2), "fp32", release_grads=True)
    train(stock, stock_opt, 5)
    train(ours, ours_opt, 5)
    assert_same_run(stock, ours, stock_opt, ours_opt, part="state")  # the groups differ in foreach


@pytest.mark.parametrize("options", [
    pytest.param({"fmt": "int8", "rounding": "stochastic"}, id="stochastic-int8"),
    pytest.param({"fmt": {"exp_avg": "sqrt8", "exp_avg_sq": "dynamic8"}, "rounding": {"exp_avg_sq": "stochastic"}},
                 id="stochastic-v"),
])
def test_stochastic_rounding_draws_the_same_bits_with_release(options):
    assert_same_run(*twin_runs(lambda net, release: wrap(torch.optim.AdamW(net.parameters(), lr=1e-2),
                                                         release_grads=release, **{**BIG, **options})))


class Net16(Net):
    def __init__(self) -> None:
        super().__init__()
        self.to(torch.bfloat16)


@pytest.mark.parametrize("mode", ["exact", "8bit"])
def test_master_weights_of_bf16_params_step_alike_with_release(mode):
    def make(net, release):
        return wrap(torch.optim.AdamW(groups(net), lr=1e-2), "int8", master_weights=mode, release_grads=release,
                    **BIG)

    assert_same_run(*twin_runs(make, model=Net16, dtype=torch.bfloat16))


class Matrices(torch.nn.Module):
    """Muon steps matrices only: tall, wide and square ones."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(48, 32)
        self.a = torch.nn.Linear(32, 96, bias=False)
        self.b = torch.nn.Linear(96, 32, bias=False)

    def forward(self, idx: torch.Tensor, i: int = 0) -> torch.Tensor:
        return self.b(torch.tanh(self.a(self.embed(idx)))).square().mean()


@pytest.mark.parametrize("cls,kwargs", [(torch.optim.Muon, {"lr": 0.02}), (torch.optim.Adafactor, {"lr": 0.01})],
                         ids=["Muon", "Adafactor"])
def test_staged_optimizers_step_alike_with_release(cls, kwargs):
    def make(net, release):
        return wrap(cls(net.parameters(), **kwargs), "int8", release_grads=release, **BIG)

    assert_same_run(*twin_runs(make, model=Matrices))


def test_sgd_whose_first_step_creates_its_momentum_steps_alike_with_release():
    def make(net, release):
        return wrap(torch.optim.SGD(groups(net), lr=0.05, momentum=0.9, nesterov=True), "int8",
                    release_grads=release, **BIG)

    assert_same_run(*twin_runs(make))


@pytest.mark.slow
def test_a_compiled_model_steps_alike_with_release():
    def loop(net, opt, release):
        torch._dynamo.reset()
        compiled = torch.compile(net)
        for idx in batches(4):
            compiled(idx, 0).backward()
            assert is_released(net.up.weight.grad) == release
            opt.step()
            opt.zero_grad()

    assert_same_run(*twin_runs(int8_adamw, loop=loop))


def test_a_checkpoint_taken_with_release_resumes_exactly():
    net = Net()
    opt = int8_adamw(net, True)
    train(net, opt, 2, schedule=False)
    saved = copy.deepcopy({"model": net.state_dict(), "optim": opt.state_dict()})
    train(net, opt, 3, seed=2, schedule=False)
    again = Net()
    again_opt = wrap(torch.optim.AdamW(again.parameters(), lr=1e-2), "int8", release_grads=True, **BIG)
    again.load_state_dict(saved["model"])
    again_opt.load_state_dict(saved["optim"])
    train(again, again_opt, 3, seed=2, schedule=False)
    assert_same_run(net, again, opt, again_opt)


# -- when each parameter steps ----------------------------------------------------------------------
def test_params_step_in_backward_and_opt_step_completes_the_iteration():
    net = Net()
    opt = int8_adamw(net, True)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    net(batches(1)[0], 0).backward()
    for name, p in net.named_parameters():
        assert is_released(p.grad), name
        assert not torch.equal(p, before[name]), name  # stepped already
        assert opt.state[p]["step"].item() == 1
    stepped = {n: p.detach().clone() for n, p in net.named_parameters()}
    pre_hooks = []
    opt.register_step_pre_hook(lambda o, a, k: pre_hooks.append(1))
    opt.step()
    assert pre_hooks == [1]
    assert all(torch.equal(p, stepped[n]) for n, p in net.named_parameters())  # nothing steps twice
    assert all(opt.state[p]["step"].item() == 1 for p in net.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in net.parameters())


def test_a_large_param_steps_when_its_grad_lands_and_small_ones_wait_for_it():
    """The order grads land in: ``down`` (large) before ``norm`` and ``up`` (large); when ``up.weight``'s
    grad lands, ``down.weight`` has stepped and its grad is gone, and the small params between them
    (``norm``, ``up.bias``) still hold theirs: they step with ``up.weight``."""
    net = Net()
    seen = {}

    def look(_: torch.Tensor) -> None:
        seen.update({n: type(p.grad).__name__ for n, p in net.named_parameters()})

    net.up.weight.register_post_accumulate_grad_hook(look)  # before ours: sees the grads as they land
    _opt = int8_adamw(net, True)  # the optimizer lives: its hooks step
    net(batches(1)[0], 1).backward()
    assert seen["down.weight"] == "ReleasedGrad" and seen["up.weight"] == "Tensor"
    assert seen["norm.weight"] == seen["norm.bias"] == seen["up.bias"] == "Tensor"
    assert seen["embed.weight"] == "NoneType"  # used first in forward and as the output: its grad lands last


def test_small_params_that_land_together_step_in_one_launch_and_later_backwards_replay_the_plans(monkeypatch):
    class Scales(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scales = torch.nn.ParameterList(torch.nn.Parameter(torch.rand(16) + 0.5) for _ in range(6))
            self.out = torch.nn.Linear(16, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for s in self.scales:
                x = x * s
            return self.out(x).square().mean()

    runs, prepared = [], []
    stock_run, stock_prepare = StepPlan.run, release_module.prepare_params
    monkeypatch.setattr(StepPlan, "run", lambda self: (runs.append([len(b.rows) for b in self.buckets.values()]),
                                                       stock_run(self)))
    monkeypatch.setattr(release_module, "prepare_params", lambda *a: prepared.append(1) or stock_prepare(*a))
    net = Scales()
    opt = int8_adamw(net, True)
    for i in range(3):
        runs.clear()
        net(torch.randn(8, 16)).backward()
        # out.bias lands with out.weight (1024 elements), which steps it in the same plan (one launch per
        # kernel: its fp32 states and the weight's int8 ones); the six scales wait for the end of backward
        assert runs == [[1, 1], [6]], runs
        opt.step()
        opt.zero_grad()
        if i == 0:
            assert len(prepared) == 2
    assert len(prepared) == 2  # the later backwards replay the two bound plans


# -- references ------------------------------------------------------------------------------------
def test_no_grad_outlives_its_step_and_the_hooks_keep_nothing_alive():
    net = Net()
    grads = {}

    def keep_ref(name):
        return lambda p: grads.__setitem__(name, weakref.ref(p.grad))

    for name, p in net.named_parameters():
        p.register_post_accumulate_grad_hook(keep_ref(name))  # runs before ours: sees each grad
    alive_at_end = {}
    net.embed.weight.register_post_accumulate_grad_hook(  # after ours on the last grad to land
        lambda p: alive_at_end.update({n: r() is not None for n, r in grads.items()}))
    opt = int8_adamw(net, True)
    for idx in batches(2):
        net(idx, 0).backward()
        # the large params' grads died while backward was still running; the small ones wait for its end
        assert not alive_at_end["down.weight"] and not alive_at_end["up.weight"]
        assert not any(r() is not None for r in grads.values())
        opt.step()
        opt.zero_grad()
    opt_ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert opt_ref() is None  # the hooks on the params hold the optimizer weakly
    loss = net(batches(1)[0], 0)
    loss.backward()  # hooks of a dead optimizer do nothing: the grads stay, as without release
    assert all(type(p.grad) is torch.Tensor for p in net.parameters())
    net_ref = weakref.ref(net.up.weight)
    del net, loss
    gc.collect()
    assert net_ref() is None


# -- adoption paths ---------------------------------------------------------------------------------
def test_the_optim_class_takes_release_grads():
    a, b = Net(), Net()
    opt_a = lowbit_compile.optim.AdamW(a.parameters(), lr=1e-2, fmt="int8", **BIG)
    opt_b = lowbit_compile.optim.AdamW(b.parameters(), lr=1e-2, fmt="int8", release_grads=True, **BIG)
    assert "release_grads=True" in repr(opt_b)
    train(a, opt_a)
    train(b, opt_b)
    assert_same_run(a, b, opt_a, opt_b)


def test_enable_releases_from_the_second_iteration_on():
    def loop(net, opt, release):
        with enable(fmt="int8", release_grads=release, **BIG):
            for i, idx in enumerate(batches(3)):
                net(idx, 0).backward()
                assert is_released(net.up.weight.grad) == (release and i > 0)
                opt.step()
                opt.zero_grad()

    assert_same_run(*twin_runs(lambda net, release: torch.optim.AdamW(net.parameters(), lr=1e-2), loop=loop))


SCRIPT = '''
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(80, 64), torch.nn.Linear(64, 80))
opt = torch.optim.AdamW(model.parameters())
for i in range(3):
    opt.zero_grad()
    model(torch.arange(8)).square().mean().backward()
    print("released", i, type(model[1].weight.grad).__name__)
    opt.step()
'''


def test_the_run_command_takes_release_grads(tmp_path, monkeypatch, capsys):
    (tmp_path / "train.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    assert run_command(monkeypatch, "--release-grads", "--min-8bit-size", "0", "train.py") == 0
    out = capsys.readouterr().out
    assert "released 0 Tensor" in out and "released 1 ReleasedGrad" in out and "released 2 ReleasedGrad" in out


def test_restore_and_rewrapping_without_release_take_the_hooks_off():
    net = Net()
    opt = int8_adamw(net, True)
    train(net, opt, 1)
    wrap(opt, "int8", **BIG)
    net(batches(1)[0]).backward()
    assert type(net.up.weight.grad) is torch.Tensor
    opt.step()
    opt.zero_grad()
    wrap(opt, "int8", release_grads=True, **BIG)
    net(batches(1)[0]).backward()
    assert is_released(net.up.weight.grad)
    opt.step()
    opt.zero_grad()
    restore(opt)
    net(batches(1)[0]).backward()
    assert type(net.up.weight.grad) is torch.Tensor
    assert not net.up.weight._post_accumulate_grad_hooks


def test_a_deep_copy_releases_its_own_params():
    net = Net()
    opt = int8_adamw(net, True)
    train(net, opt, 1, schedule=False)
    net2, opt2 = copy.deepcopy((net, opt))
    net2(batches(1)[0], 0).backward()
    assert is_released(net2.up.weight.grad) and net.up.weight.grad is None
    opt2.step()
    opt2.zero_grad()
    train(net, opt, 1, seed=1, schedule=False)  # the same iteration on the original
    train(net, opt, 2, seed=5)
    train(net2, opt2, 2, seed=5)
    assert_same_run(net, net2, opt, opt2)


def test_a_param_group_added_later_releases_from_the_next_iteration():
    net = Net()
    opt = wrap(torch.optim.AdamW([net.embed.weight], lr=1e-2), "int8", release_grads=True, **BIG)
    train(net, opt, 1)
    opt.add_param_group({"params": [p for n, p in net.named_parameters() if n != "embed.weight"]})
    net(batches(1)[0], 0).backward()
    assert type(net.up.weight.grad) is torch.Tensor  # stepped at opt.step(), as its grad arrived
    opt.step()
    opt.zero_grad()
    net(batches(1)[0], 0).backward()
    assert is_released(net.up.weight.grad)


# -- accumulation and zero_grad ----------------------------------------------------------------------
def accumulate(model: torch.nn.Module, opt: torch.optim.Optimizer, release: bool, micro: int = 3) -> None:
    for step in range(2):
        for i, idx in enumerate(batches(micro, seed=step)):
            last = i == micro - 1
            with (opt.no_step() if release and not last else torch.enable_grad()):
                (model(idx, 0) / micro).backward()
        opt.step()
        opt.zero_grad()


def test_backwards_under_no_step_accumulate_and_the_last_one_steps_bit_for_bit():
    nets = [Net(), Net()]
    opts = [wrap(torch.optim.AdamW(n.parameters(), lr=1e-2), "int8", release_grads=r, **BIG)
            for n, r in zip(nets, (False, True))]
    for net, opt, release in zip(nets, opts, (False, True)):
        accumulate(net, opt, release)
    assert_same_run(nets[0], nets[1], *opts)
    plain = torch.optim.AdamW(Net().parameters())
    with release_module.no_step(plain):  # a no-op for an optimizer that does not release
        pass


def test_a_second_backward_before_step_outside_no_step_raises_naming_it():
    net = Net()
    _opt = wrap(torch.optim.AdamW(net.parameters(), lr=1e-2), "int8", release_grads=True, model=net, **BIG)
    net(batches(1)[0], 0).backward()
    with pytest.raises(RuntimeError, match=r"second backward reached parameter '.*' before opt\.step\(\).*"
                                           r"opt\.no_step\(\)"):
        net(batches(1)[0], 0).backward()


def test_a_backward_after_step_without_zero_grad_raises_naming_zero_grad():
    net = Net()
    opt = int8_adamw(net, True)
    net(batches(1)[0], 0).backward()
    opt.step()
    with pytest.raises(RuntimeError, match=r"call opt\.zero_grad\(\) after opt\.step\(\)"):
        net(batches(1)[0], 0).backward()


def test_zero_grad_keeping_zeros_steps_bit_for_bit():
    """``zero_grad(set_to_none=False)`` zeroes a released grad (it keeps no storage): the next backward
    starts from it as from stock's zeros, and a param no backward reaches steps with zeros, as stock's."""
    def loop(net, opt, release):
        for i, idx in enumerate(batches(4)):
            net(idx, i).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

    assert_same_run(*twin_runs(int8_adamw, loop=loop))


def test_a_hyperparameter_changed_between_backward_and_step_raises():
    net = Net()
    opt = int8_adamw(net, True)
    net(batches(1)[0], 0).backward()
    opt.param_groups[0]["lr"] = 5e-3
    with pytest.raises(RuntimeError, match=r"param_groups\[0\] changed between backward and opt\.step\(\) "
                                           r"\(lr: 0\.01 -> 0\.005\)"):
        opt.step()


# -- what release cannot do is never silent -----------------------------------------------------------
def released_net() -> tuple[Net, torch.optim.Optimizer]:
    net = Net()
    opt = wrap(torch.optim.AdamW(net.parameters(), lr=1e-2), "int8", release_grads=True, model=net, **BIG)
    net(batches(1)[0], 0).backward()
    return net, opt


def test_a_global_norm_clip_after_a_released_backward_raises_naming_the_settings():
    net, _ = released_net()
    stepped = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_\(max_norm=1\).*max_grad_norm=0.*"
                                           r"gradient_clip_val=None"):
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), stepped))


@pytest.mark.parametrize("foreach", [None, False])
def test_the_grad_norm_is_still_measured_exactly(foreach):
    """``clip_grad_norm_(max_norm=inf)`` (what HF Trainer logs with max_grad_norm=0) gives the norm of the
    grads as they were, bit for bit, and changes nothing."""
    norms: dict[bool, list[torch.Tensor]] = {False: [], True: []}

    def loop(net, opt, release):
        for i, idx in enumerate(batches(2)):
            net(idx, i).backward()
            norms[release].append(torch.nn.utils.clip_grad_norm_(net.parameters(), math.inf, foreach=foreach))
            opt.step()
            opt.zero_grad()

    assert_same_run(*twin_runs(int8_adamw, loop=loop))
    assert all(torch.equal(a, b) for a, b in zip(norms[False], norms[True])) and len(norms[True]) == 2


def test_reading_a_released_grad_raises_saying_why():
    net, _ = released_net()
    grad = net.up.weight.grad
    assert grad.shape == net.up.weight.shape and grad.dtype == net.up.weight.dtype
    with pytest.raises(RuntimeError, match=r"read the grad of 'up\.weight', which release_grads=True stepped in "
                                           r"backward and freed\..*release_grads=False"):
        grad.sum()
    assert "ReleasedGrad" in repr(grad)


def test_grad_scaler_is_refused_before_any_step():
    net = Net()
    _opt = int8_adamw(net, True)  # a releasing optimizer lives
    loss = net(batches(1)[0], 0)
    with pytest.raises(RuntimeError, match=r"GradScaler \(fp16 loss scaling\) cannot combine with release_grads"):
        torch.amp.GradScaler("cpu").scale(loss)
    assert torch.amp.GradScaler("cpu", enabled=False).scale(loss) is loss


def test_a_param_of_two_optimizers_is_refused_or_fails_loudly():
    net = Net()
    _opt = int8_adamw(net, True)  # it lives, and releases the params
    other = torch.optim.SGD([net.up.weight], lr=0.1)
    with pytest.raises(ValueError, match=r"another optimizer already releases"):
        wrap(other, release_grads=True)
    assert not hasattr(other, "_lowbit")
    net(batches(1)[0], 0).backward()
    with pytest.raises(RuntimeError, match=r"another optimizer stepping the same parameter"):
        other.step()


def test_a_monitor_and_release_refuse_each_other():
    net = Net()
    opt = int8_adamw(net, True)
    with pytest.raises(ValueError, match="release_grads=True cannot combine with a monitor"):
        lowbit_compile.monitor(opt, 2)
    plain = wrap(torch.optim.AdamW(Net().parameters(), lr=1e-2), "int8", **BIG)
    lowbit_compile.monitor(plain, 2)
    with pytest.raises(ValueError, match="release_grads=True cannot combine with a monitor"):
        wrap(plain, "int8", release_grads=True, **BIG)
    with pytest.raises(ValueError, match="release_grads=True cannot combine with a monitor"):
        enable(release_grads=True, monitor=10)


def test_release_grads_must_be_a_bool():
    with pytest.raises(TypeError, match="release_grads must be True or False, got 'yes'"):
        wrap(torch.optim.AdamW(Net().parameters()), release_grads="yes")


def test_the_placeholder_allocates_nothing():
    huge = torch.zeros(()).expand(10**6, 10**6)  # the grad of a 4 TB param: its placeholder must not allocate it
    released = ReleasedGrad(huge, torch.zeros(()))
    assert released.shape == huge.shape and released.dtype == huge.dtype


# -- what it saves ----------------------------------------------------------------------------------
def test_estimate_counts_no_grads_with_release(capsys):
    """7B bf16 with exact master weights and 8-bit states: 6.14 B/param outside activations (43 GB) with
    release, 8.14 without; stock mixed precision 16 (112 GB)."""
    from lowbit_compile.cli import main
    from lowbit_compile.estimate import estimate

    kept, released = (estimate(7 * 10**9, param_dtype="bf16", master_weights="exact", release_grads=r)
                      for r in (False, True))
    assert kept.stock_total == released.stock_total == 112 * 10**9
    assert kept.lowbit_total - released.lowbit_total == 14 * 10**9  # the bf16 grads
    assert released.row("grads (bf16, released)").lowbit == 0
    assert round(released.lowbit_total / 7e9, 3) == 6.141
    assert main(["estimate", "--params", "70B", "--param-dtype", "bf16", "--master-weights", "exact",
                 "--release-grads"]) == 0
    out = capsys.readouterr().out
    assert "grads (bf16, released)" in out and "per parameter: 16.000 B stock, 6.141 B low-bit" in out


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_backward_that_keeps_the_graph_of_its_grads_releases_nothing():
    """``backward(create_graph=True)`` (a gradient penalty reads the grads after it): the params step at
    ``opt.step()``, as without release, bit for bit."""
    def loop(net, opt, release):
        for idx in batches(2):
            net(idx, 0).backward(create_graph=True)
            assert sum(p.grad.square().sum() for p in net.parameters()).requires_grad
            opt.step()
            opt.zero_grad()

    assert_same_run(*twin_runs(int8_adamw, loop=loop))


def test_a_released_grad_used_as_an_operand_raises_too():
    net, _opt = released_net()
    with pytest.raises(RuntimeError, match=r"read the grad of 'up\.weight'"):
        torch.ones_like(net.up.weight).mul_(net.up.weight.grad)
