"""``lowbit_compile.enable``: which optimizers a scope rewrites, when, and what it leaves alone."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import lowbit_compile as package
from lowbit_compile import QuantizedState, enable, is_wrapped, lowbit_compile, memory_report, restore
from lowbit_compile.config import DEFAULT_FMT

SHAPES = [(64, 80), (80,)]  # one tensor above min_8bit_size=4096 (quantized), one below (stock fp32)


def make(cls=torch.optim.AdamW, **kw) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    return params, cls(params, lr=1e-2, **kw)


def step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], n: int = 1, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def test_lowbit_compile_carries_enable_and_stays_a_function():
    assert package.lowbit_compile is lowbit_compile and lowbit_compile.enable is enable
    _, opt = make()
    assert lowbit_compile(opt) is opt and is_wrapped(opt)


def test_first_step_in_scope_is_already_the_rewritten_update():
    """An optimizer created outside and stepped inside: its very first step is the low-bit one,
    identical to the step of an optimizer wrapped explicitly with the same options."""
    params, opt = make()
    ref_params, ref = make()
    lowbit_compile(ref, fmt="int8")
    with enable(fmt="int8"):
        step(opt, params)
    step(ref, ref_params)
    assert is_wrapped(opt) and isinstance(opt.state[params[0]]["exp_avg"], QuantizedState)
    assert type(opt.state[params[1]]["exp_avg"]) is torch.Tensor  # under min_8bit_size
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)


def test_decorator_rewrites_optimizers_created_inside():
    made = []

    @enable(fmt="bf16")
    def train():
        params, opt = make(torch.optim.Adam)
        step(opt, params, n=2)
        made.append((opt, params))

    train()
    opt, params = made[0]
    assert is_wrapped(opt)
    assert opt.state[params[0]]["exp_avg"].fmt.name == "bf16"


def test_bare_decorator_uses_the_defaults():
    @enable
    def train():
        params, opt = make()
        step(opt, params)
        return opt, params

    opt, params = train()
    assert opt.state[params[0]]["exp_avg"].fmt.name == DEFAULT_FMT


def test_nothing_outside_the_scope_is_touched():
    before_params, before = make()
    step(before, before_params)  # stepped before the scope
    with enable():
        pass
    after_params, after = make()
    step(after, after_params)  # stepped after the scope
    step(before, before_params)
    for opt, params in ((before, before_params), (after, after_params)):
        assert not is_wrapped(opt) and "step" not in opt.__dict__
        assert all(type(v) is torch.Tensor for p in params for v in opt.state[p].values())


def test_a_step_in_another_thread_is_outside_the_scope():
    params, opt = make()
    with enable():
        worker = threading.Thread(target=step, args=(opt, params))
        worker.start()
        worker.join()
    assert not is_wrapped(opt)


def test_per_optimizer_hooks_run_once_and_the_pre_hook_before_the_update():
    params, opt = make(torch.optim.Adam)  # no weight decay: a zero grad leaves the param unchanged
    start = [p.detach().clone() for p in params]
    calls = []

    def pre(o, args, kwargs):
        calls.append(("pre", is_wrapped(o)))
        for p in params:
            p.grad.zero_()

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", is_wrapped(o))))
    with enable():
        step(opt, params, n=2)
    assert calls == [("pre", True), ("post", True)] * 2
    for p, p0 in zip(params, start):
        assert torch.equal(p, p0)


def test_closure_is_called_once_and_its_loss_returned():
    params, opt = make()
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = sum((p**2).sum() for p in params)
        loss.backward()
        return loss

    with enable():
        first = opt.step(closure)
        second = opt.step(closure)
    assert len(calls) == 2 and is_wrapped(opt)
    assert first.requires_grad and second < first


def test_optimizers_it_cannot_rewrite_are_left_stock_and_reported():
    params, lbfgs = make(torch.optim.LBFGS)  # a line search over all parameters: never elementwise

    def closure():
        lbfgs.zero_grad()
        loss = sum((p**2).sum() for p in params)
        loss.backward()
        return loss

    with enable() as scope, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a refusal may come with a warning naming the reason
        lbfgs.step(closure)
        lbfgs.step(closure)
    assert not is_wrapped(lbfgs) and scope.rewritten == []
    ((reason, count),) = scope.skipped.items()
    assert reason.startswith("LBFGS (") and count == 1
    assert f"left stock: 1 x {reason}" in scope.summary()


def test_an_unsupported_adam_is_left_stock_with_a_warning():
    p = torch.nn.Parameter(torch.randn(8, dtype=torch.complex64))
    opt = torch.optim.Adam([p])
    p.grad = torch.randn_like(p)
    with enable() as scope, pytest.warns(UserWarning, match="complex parameter"):
        opt.step()
    assert not is_wrapped(opt) and scope.rewritten == [] and opt.state[p]["exp_avg"].dtype == torch.complex64


def test_an_explicitly_wrapped_optimizer_keeps_its_own_options():
    params, opt = make()
    lowbit_compile(opt, fmt="fp8_e4m3")
    with enable(fmt="int8") as scope:
        step(opt, params)
    assert opt.state[params[0]]["exp_avg"].fmt.name == "fp8_e4m3" and scope.rewritten == []


def test_the_innermost_scope_decides():
    params, opt = make()
    with enable(fmt="int8") as outer, enable(fmt="dynamic8") as inner:
        step(opt, params)
    assert opt.state[params[0]]["exp_avg"].fmt.name == "dynamic8"
    assert len(inner.rewritten) == 1 and outer.rewritten == []


def test_restore_inside_the_scope_sticks():
    params, opt = make()
    with enable() as scope:
        step(opt, params)
        restore(opt)
        step(opt, params, n=2)
    assert not is_wrapped(opt)
    assert scope.rewritten[0].steps == 1 and scope.rewritten[0].restored_at_step == 1


def test_restore_at_step_switches_back_after_that_many_steps():
    params, opt = make()
    with enable(restore_at_step=2) as scope:
        step(opt, params, n=2)
        assert not is_wrapped(opt)
        assert all(type(v) is torch.Tensor for p in params for v in opt.state[p].values())
        step(opt, params)
    record = scope.rewritten[0]
    assert record.restored_at_step == 2 and record.steps == 2
    assert record.state_bytes < record.stock_state_bytes  # measured before the switch
    assert "restored to fp32 after step 2" in scope.summary()


def test_request_restore_applies_at_the_end_of_the_next_step():
    params, opt = make()
    with enable() as scope:
        step(opt, params)
        scope.request_restore()
        assert is_wrapped(opt)
        step(opt, params)
        assert not is_wrapped(opt)
        late_params, late = make()
        step(late, late_params)  # after a restore request nothing new is rewritten
    assert not is_wrapped(late) and scope.skipped == {"AdamW (stepped after a restore request)": 1}


def test_restore_on_exit():
    params, opt = make()
    with enable(restore_on_exit=True):
        step(opt, params)
        assert is_wrapped(opt)
    assert not is_wrapped(opt)


def test_summary_counts_the_bytes_saved():
    params, opt = make()
    with enable() as scope:
        step(opt, params, n=3)
    record = scope.rewritten[0]
    held = memory_report(opt).total.bytes
    stock = (64 * 80 + 80) * 4 * 2 + 4  # fp32 m and v of both tensors, and the 0-d fp32 step of the small one
    stock += 4  # the step counter of the large one
    assert (record.params, record.steps, record.state_bytes, record.stock_state_bytes) == (64 * 80 + 80, 3, held, stock)
    row = scope.summary().splitlines()[2].split()
    assert row[:2] == ["AdamW", "#1"] and row[6] == f"{stock - held:,}"
    assert row[7] == f"{100 * (stock - held) / stock:.1f}%"


def test_name_patterns_learn_names_from_the_forward_in_scope():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(100, 64), torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
    opt = torch.optim.AdamW(model.parameters())
    with enable(overrides={"0.*": "bf16", "*.bias": "int8"}, min_8bit_size=4096):
        model(torch.arange(10)).sum().backward()
        opt.step()
    formats = {name: getattr(opt.state[p]["exp_avg"], "fmt", None) for name, p in model.named_parameters()}
    assert formats["0.weight"].name == "bf16"  # 6400 elements, override
    assert formats["1.weight"].name == DEFAULT_FMT  # 4096 elements: not under min_8bit_size, the default
    assert formats["1.bias"].name == "int8"  # 64 elements, the override beats min_8bit_size
    assert formats["2.weight"] is None  # 64 elements, stock fp32


def test_name_patterns_and_monitor_names_when_the_forward_runs_in_the_steps_closure(caplog):
    """``opt.step(closure)`` (Lightning's loop): the forward that names the parameters runs inside the
    step, after the step pre-hook; the closure runs first, then the patterns apply and the monitor
    names module parameters, from the first step on."""
    import logging

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("embed", torch.nn.Embedding(64, 32))
    model.add_module("proj", torch.nn.Linear(32, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = model(torch.arange(8)).square().mean()
        loss.backward()
        return loss

    with caplog.at_level(logging.INFO, logger="lowbit_compile"), \
            enable(overrides={"*embed*": "fp32"}, min_8bit_size=16, monitor=1) as scope:
        losses = [opt.step(closure) for _ in range(3)]
        assert scope.monitors[0].names == {p: n for n, p in model.named_parameters()}
    assert len(calls) == 3 and all(isinstance(loss, torch.Tensor) for loss in losses)
    assert scope.rewritten[0].steps == 3
    assert type(opt.state[model.embed.weight]["exp_avg"]) is torch.Tensor  # the override
    for p in model.proj.parameters():
        assert opt.state[p]["exp_avg"].fmt.name == DEFAULT_FMT
    samples = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(samples) == 2 and all("of proj." in line and "group0" not in line for line in samples)


def test_a_failing_closure_leaves_the_optimizer_undecided():
    """A closure that raises on the first step leaves the optimizer stock and unconverted; its next
    step in scope converts it."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())

    def closure(fail: bool):
        if fail:
            raise KeyError("boom")
        model(torch.ones(4)).sum().backward()

    with enable(overrides={"bias": "fp32"}, min_8bit_size=0):
        with pytest.raises(KeyError, match="boom"):
            opt.step(lambda: closure(True))
        assert not is_wrapped(opt) and not opt.state
        opt.step(lambda: closure(False))
    assert is_wrapped(opt) and type(opt.state[model.bias]["exp_avg"]) is torch.Tensor
    assert isinstance(opt.state[model.weight]["exp_avg"], QuantizedState)


def test_names_learned_within_a_module_created_in_scope_whose_forward_is_not_called():
    """Lightning calls ``training_step``, not the LightningModule's forward: a model created in scope
    still names its submodules' parameters from the root; one created outside says how to fix it."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64)

        def loss(self):
            return self.head(self.embed(torch.arange(8))).square().mean()

    def train(model):
        opt = torch.optim.AdamW(model.parameters())
        model.loss().backward()
        opt.step()
        return opt

    with enable(overrides={"embed.*": "fp32"}, min_8bit_size=0):
        model = Model()
        opt = train(model)
    assert type(opt.state[model.embed.weight]["exp_avg"]) is torch.Tensor
    assert isinstance(opt.state[model.head.weight]["exp_avg"], QuantizedState)
    model = Model()
    with enable(overrides={"embed.*": "fp32"}), pytest.raises(ValueError, match="pass model= to enable"):
        train(model)


def test_name_patterns_without_a_forward_or_model_fail_loudly():
    params, opt = make()
    with enable(overrides={"*embed*": "fp32"}):
        for _ in range(2):  # every step fails: none falls back to the stock step silently
            with pytest.raises(RuntimeError, match="no known name"):
                step(opt, params)
    assert not is_wrapped(opt) and not opt.state


def test_name_patterns_with_model_given():
    torch.manual_seed(0)
    model = torch.nn.Linear(100, 100)
    opt = torch.optim.Adam(model.parameters())
    with enable(overrides={"weight": "fp8_e5m2"}, model=model, min_8bit_size=0):
        model(torch.randn(2, 100)).sum().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.step()
    assert opt.state[model.weight]["exp_avg"].fmt.name == "fp8_e5m2"
    assert opt.state[model.bias]["exp_avg"].fmt.name == DEFAULT_FMT


@pytest.mark.parametrize("options,error", [
    ({"fmt": "int4"}, "fmt must be one of"),
    ({"block_size": 1000}, "power of two"),
    ({"overrides": {"*": "q"}}, "must be one of"),
    ({"restore_at_step": 0}, "positive int"),
])
def test_bad_options_are_refused_when_the_scope_is_made(options, error):
    with pytest.raises(ValueError, match=error):
        enable(**options)


# -- process-wide hooks: only while a scope is entered ---------------------------------------------
def global_step_hooks() -> tuple[int, int]:
    from torch.optim import optimizer

    return len(optimizer._global_optimizer_pre_hooks), len(optimizer._global_optimizer_post_hooks)


@pytest.mark.slow
def test_importing_the_package_registers_only_the_stock_step_guard():
    """A fresh interpreter: ``import lowbit_compile`` adds exactly one of torch's process-wide hooks,
    the read-only step pre-hook that stops a stock step over low-bit states loaded from a checkpoint
    (issues 14 and 47: registered at import so the stock optimizer fails naming the fix), and no module
    hook; a wrap adds nothing more."""
    import subprocess
    import sys

    code = """
import torch
from torch.nn.modules import module
from torch.optim import optimizer

def hooks():
    return (len(optimizer._global_optimizer_pre_hooks), len(optimizer._global_optimizer_post_hooks),
            len(module._global_forward_pre_hooks), len(module._global_forward_hooks),
            len(module._global_backward_hooks), len(module._global_module_registration_hooks))

before = hooks()
import lowbit_compile
import lowbit_compile.optim
after_import = hooks()
opt = lowbit_compile.lowbit_compile(torch.optim.AdamW([torch.nn.Parameter(torch.randn(8))]))
after_wrap = hooks()
guard = [h.__qualname__ for h in optimizer._global_optimizer_pre_hooks.values()]
print(before == (0,) * 6, after_import == after_wrap == (1, 0, 0, 0, 0, 0), guard)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "True True ['_guard_hook']", out.stdout


def test_a_scope_registers_its_hooks_on_entry_and_removes_them_on_exit():
    base = global_step_hooks()
    outer, inner = enable(), enable(fmt="int8")
    with outer:
        assert global_step_hooks() == (base[0] + 1, base[1] + 1)
        with inner:
            assert global_step_hooks() == (base[0] + 1, base[1] + 1)  # shared, counted
        assert global_step_hooks() == (base[0] + 1, base[1] + 1)  # the outer scope still needs them
        params, opt = make()
        step(opt, params)
        assert is_wrapped(opt)
    assert global_step_hooks() == base
    with outer:  # a scope entered again registers them again
        assert global_step_hooks() == (base[0] + 1, base[1] + 1)
    assert global_step_hooks() == base


def test_concurrent_scopes_in_threads_share_the_hooks_and_each_rewrites_its_own():
    base = global_step_hooks()
    barrier = threading.Barrier(2)
    results: dict[str, object] = {}

    def worker(fmt: str) -> None:
        params, opt = make()
        with enable(fmt=fmt):
            barrier.wait()  # both scopes entered
            results[f"hooks {fmt}"] = global_step_hooks()
            step(opt, params)
            barrier.wait()  # both stepped before either leaves
        results[fmt] = opt.state[params[0]]["exp_avg"].fmt.name

    threads = [threading.Thread(target=worker, args=(f,)) for f in ("int8", "bf16")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["int8"] == "int8" and results["bf16"] == "bf16"  # each thread's scope decided its own
    assert results["hooks int8"] == results["hooks bf16"] == (base[0] + 1, base[1] + 1)
    assert global_step_hooks() == base


def test_a_scope_that_raises_still_removes_its_hooks():
    base = global_step_hooks()
    with pytest.raises(KeyError), enable():
        raise KeyError("boom")
    assert global_step_hooks() == base


def test_progress_lines_and_the_monitor_of_a_scope(caplog):
    import logging

    params, opt = make()
    with caplog.at_level(logging.INFO, logger="lowbit_compile"), enable(monitor=2, log_every=2) as scope:
        step(opt, params, n=4)
        assert len(scope.monitors) == 1 and [h["step"] for h in scope.monitors[0].history] == [2, 4]
    assert not scope.monitors
    lines = [r.getMessage() for r in caplog.records if "ms/step" in r.getMessage()]
    assert len(lines) == 2 and lines[0].startswith("AdamW #1: step 2, ") and "saved" in lines[0]
