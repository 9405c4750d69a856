"""The wrapped step under ``torch.compile``: one ``lowbit::optimizer_step`` op in the graph
(``fullgraph=True`` where torch's dynamo can call an optimizer's own ``step``: 2.10 and later), bit for
bit the eager step, no recompile under an LR schedule, a whole train step in one graph where torch
traces ``backward``, and a graph break that names lowbit_compile and the fix where the step cannot be
one op."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import lowbit_compile
from lowbit_compile import lowbit_compile as wrap
from lowbit_compile.runtime.step_op import REFUSALS

# torch 2.9's dynamo cannot call a step set on the optimizer object (stock's under an LR scheduler
# neither): there the compiled function breaks at opt.step() and the step is one op in a graph of its own
FULLGRAPH_STEP = torch.__version__ >= "2.10"
# tracing loss.backward() into the graph (torch._dynamo.config.trace_autograd_ops) came in torch 2.11
TRACES_BACKWARD = hasattr(torch._dynamo.config, "trace_autograd_ops")


@pytest.fixture(autouse=True)
def _fresh_dynamo(one_thread):
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def model_and_optimizer(**options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
               **{"fmt": "int8", "min_8bit_size": 0, **options})
    return model, opt


def snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    states = [t.clone() for s in opt.state.values() for v in s.values()
              for t in (v.storage_parts if isinstance(v, lowbit_compile.QuantizedState) else [v])]
    return params, states


def assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        assert len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y))


def steps_with_schedule(compiled_step, n=6, **options):
    """``n`` steps of the wrapped optimizer under an LR schedule that changes lr every step, each stepped
    through ``compiled_step(opt)`` (eager when None)."""
    model, opt = model_and_optimizer(**options)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    x = torch.randn(16, 32)
    for _ in range(n):
        model(x).square().mean().backward()
        opt.step() if compiled_step is None else compiled_step(opt)
        opt.zero_grad()
        sched.step()
    return snapshot(model, opt)


def holds_the_op(graphs) -> bool:
    return any(node.target in (torch.ops.lowbit.optimizer_step, torch.ops.lowbit.optimizer_step.default)
               for gm in graphs for node in gm.graph.nodes)


def test_a_compiled_function_calling_the_step_holds_it_as_one_op_bit_for_bit_without_recompiling():
    """Two compiles (the first step creates the states the second graph passes the op), then none
    while the schedule changes lr every step; params and every state tensor as the eager step's."""
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, fullgraph=FULLGRAPH_STEP)
    def step(opt):
        opt.step()

    eager = steps_with_schedule(None)
    compiled = steps_with_schedule(step)
    assert_same(compiled, eager)
    assert counter.frame_count == 2 and holds_the_op(counter.graphs)


def test_compiling_the_bound_step_itself_holds_it_as_one_op():
    counter = CompileCounterWithBackend("aot_eager")
    compiled = {}

    def step(opt):
        if opt not in compiled:
            compiled[opt] = torch.compile(opt.step, backend=counter, fullgraph=True)
        compiled[opt]()

    assert_same(steps_with_schedule(step, n=4), steps_with_schedule(None, n=4))
    assert counter.frame_count == 2 and holds_the_op(counter.graphs)


def test_a_graph_reading_the_params_after_the_step_sees_them_stepped():
    """The op declares the params written, so what the graph computes from them after it follows it."""

    def outputs(compiled):
        torch._dynamo.reset()
        model, opt = model_and_optimizer()

        def step_then_read(x):
            opt.step()
            return model(x).sum()

        run = torch.compile(step_then_read, backend="aot_eager", fullgraph=FULLGRAPH_STEP) if compiled \
            else step_then_read
        x = torch.randn(4, 32)
        outs = []
        for _ in range(3):
            model(x).square().mean().backward()
            outs.append(run(x).detach())
            opt.zero_grad()
        return torch.stack(outs)

    assert torch.equal(outputs(True), outputs(False))


@pytest.mark.parametrize("fullgraph", [FULLGRAPH_STEP and TRACES_BACKWARD, False])
def test_a_whole_compiled_train_step_matches_eager(fullgraph):
    """Forward, backward and step in one compiled function; in one graph (fullgraph=True) where torch
    traces backward (torch._dynamo.config.trace_autograd_ops, torch 2.11 and later)."""
    counter = CompileCounterWithBackend("aot_eager")

    def train(compiled):
        torch._dynamo.reset()
        model, opt = model_and_optimizer()

        def train_step(x):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            model.zero_grad()
            return loss.detach()

        run = torch.compile(train_step, backend=counter, fullgraph=fullgraph) if compiled else train_step
        x = torch.randn(16, 32)
        with torch._dynamo.config.patch(trace_autograd_ops=True) if fullgraph else contextlib.nullcontext():
            losses = [run(x) for _ in range(4)]
        return torch.stack(losses), snapshot(model, opt)

    (eager_losses, eager), (losses, compiled) = train(False), train(True)
    assert torch.equal(losses, eager_losses)
    assert_same(compiled, eager)
    assert holds_the_op(counter.graphs)


def test_a_compiled_step_resumes_from_a_loaded_state_dict_as_eager():
    """load_state_dict replaces every state tensor between compiled steps: the next step runs on the
    new ones, as the eager step does."""

    def resumed(compiled):
        torch._dynamo.reset()
        model, opt = model_and_optimizer()
        run = torch.compile(lambda: opt.step(), backend="aot_eager", fullgraph=FULLGRAPH_STEP) if compiled \
            else opt.step
        x = torch.randn(8, 32)
        saved = None
        for i in range(5):
            model(x).square().mean().backward()
            run()
            opt.zero_grad()
            if i == 1:
                saved = opt.state_dict()
            if i == 3:
                opt.load_state_dict(saved)
        return snapshot(model, opt)

    assert_same(resumed(True), resumed(False))


def test_the_op_run_by_a_dispatch_mode_builds_the_first_steps_kernels():
    """AOT autograd runs a graph's first call under a torch_dispatch mode, below which functionalization is
    off; the op's first run traces the optimizer (make_fx, functionalized) all the same."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lowbit_compile.runtime.wrapped import wrapped_of

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def run(mode):
        model, opt = model_and_optimizer()
        model(torch.randn(4, 32)).square().mean().backward()
        inputs = wrapped_of(opt).graph_inputs
        with mode, torch.no_grad():
            torch.ops.lowbit.optimizer_step(inputs.handle, list(inputs.params), [p.grad for p in inputs.params],
                                            list(inputs.states))
        return snapshot(model, opt)

    assert_same(run(PassThrough()), run(contextlib.nullcontext()))


@pytest.mark.slow
def test_under_inductor_the_op_steps_the_optimizers_own_tensors_bit_for_bit(monkeypatch):
    """Inductor writes the op's inputs in place (no copies of params or states to run it on)."""
    from lowbit_compile.runtime import step_op

    copied = []
    same = step_op._same

    def recording(given, own):
        if same(given, own):
            return True
        copied.append(given)
        return False

    monkeypatch.setattr(step_op, "_same", recording)
    step = torch.compile(lambda opt: opt.step(), backend="inductor", fullgraph=FULLGRAPH_STEP)
    assert_same(steps_with_schedule(step, n=3), steps_with_schedule(None, n=3))
    assert copied == []


def test_a_step_with_a_closure_is_a_graph_break_that_names_the_fix():
    model, opt = model_and_optimizer()
    x = torch.randn(4, 32)

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    if FULLGRAPH_STEP:
        with pytest.raises(Exception, match="loss = closure\\(\\) before opt.step\\(\\)") as err:
            torch.compile(lambda: opt.step(closure), backend="aot_eager", fullgraph=True)()
        assert "lowbit_compile" in str(err.value)
    # without fullgraph the step runs eagerly in the graph break, closure and all
    loss = torch.compile(lambda: opt.step(closure), backend="aot_eager")()
    assert loss is not None and lowbit_compile.is_wrapped(opt) and len(opt.state) == 4


def test_the_first_step_in_an_enable_scope_is_a_graph_break_that_names_the_fix():
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 32)
    with lowbit_compile.enable(fmt="int8", min_8bit_size=0):
        model(x).sum().backward()
        with pytest.raises(Exception, match="wrap the optimizer before compiling"):
            torch.compile(lambda: opt.step(), backend="aot_eager", fullgraph=True)()
        assert not lowbit_compile.is_wrapped(opt) and not opt.state
        counter = CompileCounterWithBackend("aot_eager")
        run = torch.compile(lambda: opt.step(), backend=counter)
        for _ in range(3):
            run()  # the first converts in its graph break; the next ones are the op
        assert lowbit_compile.is_wrapped(opt) and holds_the_op(counter.graphs)


def test_every_refusal_names_lowbit_compile_and_a_fix():
    for reason in REFUSALS.values():
        assert reason.startswith("lowbit_compile: ") and ("fullgraph=True" in reason or "closure()" in reason)
