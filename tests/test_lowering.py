"""The one lowering table and its printers: every primitive is printed by every printer; every op of
every stock elementwise optimizer's traced body (every optim_db flag combination that runs on CPU
float32) and of examples/lion.py lowers on both backends for every state format and param dtype; an
op no printer covers falls back (``auto``) with one warning naming it, or fails (a backend asked for
by name) before the step changes anything."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from examples.lion import Lion
from lowbit_compile import lowbit_compile
from lowbit_compile.formats import format_names
from lowbit_compile.kernels import cpp_printer, triton_printer
from lowbit_compile.kernels.lowering import LOWERINGS, LoweringError, Target, unsupported
from lowbit_compile.kernels.primitives import PRIMITIVES, Primitives
from lowbit_compile.passes.signs import SIGN_NEUTRAL, SIGN_RULES
from lowbit_compile.runtime.wrap import SUPPORTED

from .graphs import body
from .helpers import each_param, optim_db_cases, slow_but

TARGETS = (Target("cuda"), Target("cpu"), Target("cpu", reciprocal_divisor=True))
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("printer", [triton_printer.TritonPrinter, cpp_printer.CppPrinter])
def test_every_primitive_is_printed_by_every_printer(printer):
    missing = [name for name in PRIMITIVES if getattr(printer, name, None) in (None, getattr(Primitives, name))]
    assert PRIMITIVES and not missing, missing


STOCK = optim_db_cases(SUPPORTED)
ALL = slow_but([pytest.param(cls, kwargs, id=name) for cls, kwargs, name in STOCK] + [
    pytest.param(Lion, {"weight_decay": 0.1}, id="Lion (examples/lion.py)")],
    "AdamW-amsgrad", "Lion (examples/lion.py)")


def test_every_lowered_op_has_a_sign_rule_or_is_marked_sign_neutral():
    """An op a kernel can run and the sign pass has no rule for would quietly prove nothing of the states it
    writes (a state left signed, half the resolution): each is a rule of passes/signs.py or named there as
    one the proof never meets."""
    assert not SIGN_RULES.keys() & SIGN_NEUTRAL
    missing = [str(op) for op in LOWERINGS if op not in SIGN_RULES and op not in SIGN_NEUTRAL]
    assert not missing, f"lowered ops without a sign rule: {missing}"


def test_the_coverage_cases_hold_every_stock_optimizer():
    assert {cls for cls, _, _ in STOCK} == set(SUPPORTED)


@pytest.mark.parametrize(("cls", "kwargs"), ALL)
def test_every_op_lowers_on_both_backends_for_every_format_and_dtype(cls, kwargs):
    for dtype in DTYPES:
        opt = cls([torch.nn.Parameter(torch.randn(64, dtype=dtype))],
                  **{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()})
        for fmt in format_names():
            graph = body(opt, fmt)
            for target in TARGETS:
                assert unsupported(graph, target) == [], (dtype, fmt, target)
                compile(triton_printer.emit_kernel(graph, "step", target).source, "<printed>", "exec")
                if target.device == "cpu":
                    cpp_printer.emit_step(graph, target)


@pytest.mark.parametrize("cls", [*SUPPORTED, Lion], ids=lambda c: c.__name__)
def test_every_stock_optimizer_runs_the_fused_cpu_kernel(cls):
    """The C++ of each class's default-format step compiles and runs; nothing falls back."""
    params = [torch.nn.Parameter(torch.randn(5000)), torch.nn.Parameter(torch.randn(300))]
    opt = lowbit_compile(cls(params, lr=1e-3), min_8bit_size=1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
    backends = {prepared.compiled.kernel.backend for prepared in opt._lowbit.prepared.values()}
    assert backends == {"cpu"}


class Exp(torch.optim.Optimizer):
    """An optimizer of one's own whose step uses an op no printer covers (``exp``)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @each_param
    def step(self, group, p, state):
        if not state:
            state["step"] = torch.tensor(0.0)
            state["acc"] = torch.zeros_like(p)
        state["step"] += 1
        state["acc"].mul_(0.9).add_(p.grad.exp())
        p.sub_(state["acc"], alpha=group["lr"])


def test_an_uncovered_op_of_ones_own_optimizer_falls_back_with_one_warning_naming_it():
    assert torch.ops.aten.exp.default not in LOWERINGS
    p = torch.nn.Parameter(torch.randn(5000))
    twin = torch.nn.Parameter(p.detach().clone())
    opt = lowbit_compile(Exp([p]), "int8")
    ref = lowbit_compile(Exp([twin]), "int8", backend="reference")
    with pytest.warns(UserWarning, match=r"cpu kernel cannot run this step \(no lowering for aten\.exp\.default") as w:
        for _ in range(3):
            p.grad = torch.randn_like(p)
            twin.grad = p.grad.clone()
            opt.step()
            ref.step()
    assert sum("aten.exp" in str(x.message) for x in w) == 1
    assert torch.equal(p, twin)
    assert {prepared.compiled.kernel.backend for prepared in opt._lowbit.prepared.values()} == {"reference"}


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_a_backend_asked_for_by_name_fails_before_the_step_changes_anything(backend):
    """Both backends emit (and the CPU one compiles) before the prologue runs: the step counter, the
    states and the param are exactly as before the failed step, which can be retried elsewhere."""
    p = torch.nn.Parameter(torch.randn(5000))
    before = p.detach().clone()
    opt = lowbit_compile(Exp([p]), "int8", backend=backend)
    p.grad = torch.randn_like(p)
    with pytest.raises(LoweringError, match=rf"backend='{backend}' cannot run this step: no lowering for aten\.exp"):
        opt.step()
    assert torch.equal(p, before)
    assert len(opt.state) == 0
    lowbit_compile(opt, "int8", backend="reference")
    opt.step()
    assert opt.state[p]["step"].item() == 1.0


def _fresh_kernel_cache(monkeypatch, tmp_path) -> None:
    """No kernel built in this process or on disk: the next steps run the C++ compiler."""
    from lowbit_compile.kernels import cpu_build
    from lowbit_compile.runtime import compile as compile_module

    monkeypatch.setenv("LOWBIT_COMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setattr(compile_module, "_compiled", {})


def _two_signatures() -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """A parameter with 8-bit states and one under min_8bit_size (fp32 states): two kernels."""
    params = [torch.nn.Parameter(torch.randn(5000)), torch.nn.Parameter(torch.randn(64))]
    for p in params:
        p.grad = torch.randn_like(p)
    return params, torch.optim.AdamW(params, lr=1e-2)


@pytest.mark.slow
def test_the_kernels_of_one_step_compile_at_the_same_time(monkeypatch, tmp_path):
    """Each compilation waits until the other has started: built one after the other, the first
    would wait forever (here: the barrier's timeout breaks it and the step fails)."""
    from lowbit_compile.kernels import cpu_build

    _fresh_kernel_cache(monkeypatch, tmp_path)
    both_started = threading.Barrier(2, timeout=60)
    real = cpu_build._compile

    def compile_when_both_started(*args):
        both_started.wait()
        return real(*args)

    monkeypatch.setattr(cpu_build, "_compile", compile_when_both_started)
    params, stock = _two_signatures()
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for t, p in zip(twin, params):
        t.grad = p.grad.clone()
    opt = lowbit_compile(stock)
    opt.step()
    assert {prepared.compiled.kernel.backend for prepared in opt._lowbit.prepared.values()} == {"cpu"}
    monkeypatch.setattr(cpu_build, "_compile", real)
    lowbit_compile(torch.optim.AdamW(twin, lr=1e-2)).step()  # the kernels built, found in the cache
    assert all(torch.equal(p, t) for p, t in zip(params, twin))


@pytest.mark.parametrize("backend", ["auto", "cpu"])
def test_a_failed_compilation_falls_back_or_fails_before_the_step_changes_anything(monkeypatch, tmp_path, backend):
    """The compiler runs in the background; its failure is still met before the step writes anything:
    ``auto`` runs the reference with one warning, ``cpu`` raises and leaves the optimizer as it was."""
    from lowbit_compile.kernels import cpu_build
    from lowbit_compile.kernels.kernel import BuildError

    _fresh_kernel_cache(monkeypatch, tmp_path)
    real = cpu_build._compile

    def broken(source, lib_path, extra_flags):
        if "lb_quantize_scale" in source.split("// ---- generated from the rewritten step body ----")[1]:
            raise BuildError("the compiler crashed")
        real(source, lib_path, extra_flags)

    monkeypatch.setattr(cpu_build, "_compile", broken)
    params, stock = _two_signatures()
    before = [p.detach().clone() for p in params]
    opt = lowbit_compile(stock, backend=backend)
    if backend == "cpu":
        with pytest.raises(LoweringError, match="backend='cpu' cannot run this step: the compiler crashed"):
            opt.step()
        assert all(torch.equal(p, b) for p, b in zip(params, before))
        assert len(opt.state) == 0
        return
    with pytest.warns(UserWarning, match=r"the cpu kernel cannot run this step \(the compiler crashed\)"):
        opt.step()
    backends = {prepared.compiled.kernel.backend for prepared in opt._lowbit.prepared.values()}
    assert backends == {"reference", "cpu"}
