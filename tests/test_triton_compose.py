"""The Triton lowering with the rest of PyTorch: a torch.compile'd training step that calls the wrapped
``opt.step()``, the launch ops inside a full graph, the profiler, and the error on CPU without the
interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lowbit_compile import lowbit_compile
from lowbit_compile.formats import StateFormat, blockquant
from lowbit_compile.kernels.kernel import RowLaunch

triton_backend = pytest.importorskip("lowbit_compile.kernels.triton_backend")
assert os.environ.get("TRITON_INTERPRET") == "1"  # set by conftest.py before triton is imported


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, lowbit_compile(opt, fmt="int8", block_size=256, min_8bit_size=0, backend="triton")


def train_step(model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()  # a graph break: the wrapped step runs eagerly, one fused launch per param
    opt.zero_grad()
    return loss.detach()


@pytest.mark.slow
def test_compiled_training_step_calling_the_wrapped_step_runs_like_eager():
    x = torch.randn(16, 32)
    runs = []
    for compiled in (False, True):
        model, opt = model_and_optimizer()
        step = torch.compile(train_step, backend="aot_eager") if compiled else train_step
        losses = [step(model, opt, x) for _ in range(3)]
        runs.append((losses, [p.detach().clone() for p in model.parameters()],
                     [s["exp_avg"].codes.clone() for s in opt.state.values()]))
    (eager_losses, eager_params, eager_codes), (losses, params, codes) = runs
    assert torch.equal(torch.stack(losses), torch.stack(eager_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))
    assert all(torch.equal(a, b) for a, b in zip(codes, eager_codes))


def test_a_launch_op_is_captured_in_a_full_graph():
    fmt = StateFormat("int8", 64, 2, False)
    x = torch.randn(300)
    expected = blockquant.quantize(x, fmt)
    triton_backend.quantize_into(x, blockquant.empty(300, fmt), fmt)  # builds the kernel
    key = triton_backend.kernel_for(triton_backend.emit_kernel(
        triton_backend.quantize_graph(fmt, torch.float32), "lowbit_quantize", triton_backend.target_of(x.device))).key

    def quantize_and_count(x, codes, scales, patch_values, patch_index):
        torch.ops.lowbit.quantize_triton(key, [codes, scales, patch_values, patch_index], [x], [])
        return (codes != 0).sum()

    out = blockquant.empty(300, fmt)
    nonzero = torch.compile(quantize_and_count, backend="aot_eager", fullgraph=True)(x, *out)
    assert all(torch.equal(a, b) for a, b in zip(out, expected))
    assert nonzero == (expected.codes != 0).sum()


@pytest.mark.parametrize("per_tensor", [False, True])
def test_the_profiler_shows_each_kernel_call_by_name(monkeypatch, per_tensor):
    """The four params of one group step in two batched kernel calls (their whole tiles, then the partial
    last tiles of the two biases), each shown as a ``lowbit::fused_step_batched`` range; where rows launch
    one by one, each is a ``lowbit::fused_step``."""
    if per_tensor:
        monkeypatch.setattr(triton_backend.TritonStep, "launch",
                            lambda self, rows: RowLaunch(self._run, rows, self.flat))
    model, opt = model_and_optimizer()
    model(torch.randn(4, 32)).sum().backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    names = [e.name for e in prof.events()]
    params = len(list(model.parameters()))
    assert names.count("lowbit::fused_step") == (params if per_tensor else 0)
    assert names.count("lowbit::fused_step_batched") == (0 if per_tensor else 2)


@pytest.mark.slow
def test_triton_on_cpu_tensors_without_the_interpreter_fails_at_wrap_time():
    """backend='triton' on CPU tensors is refused by lowbit_compile itself, naming the group and the fix,
    before anything is converted (not at the first step)."""
    code = textwrap.dedent("""
        import torch
        from lowbit_compile import is_wrapped, lowbit_compile
        p = torch.nn.Parameter(torch.randn(300))
        opt = torch.optim.Adam([p])
        try:
            lowbit_compile(opt, min_8bit_size=0, backend="triton")
        except ValueError as e:
            print(e, is_wrapped(opt))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "param_groups[0] holds a cpu parameter" in done.stdout, done.stderr[-2000:]
    assert "backend='auto' or 'cpu'" in done.stdout and done.stdout.strip().endswith("False")
