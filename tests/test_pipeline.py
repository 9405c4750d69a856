"""The rewrite's stages live in one list (``passes.pipeline``): they run in its order, each only where the
request asks for it, and the step a wrapped optimizer compiles is the rewrite the tests print."""

from __future__ import annotations

import torch

from lowbit_compile import lowbit_compile
from lowbit_compile.formats import StateFormat
from lowbit_compile.formats.residual import MasterFormat
from lowbit_compile.passes.pipeline import STAGES, Rewrite, rewrite
from lowbit_compile.runtime.wrapped import wrapped_of
from lowbit_compile.state.schema import init_state, probe_schema, trace_for

from .graphs import code, pass_graphs

FORMATS = {"exp_avg": StateFormat("int8", 512), "exp_avg_sq": StateFormat("sqrt8", 512, nonneg=True)}


def _adam_trace(dtype: torch.dtype = torch.float32) -> torch.fx.GraphModule:
    param = torch.nn.Parameter(torch.randn(64).to(dtype))
    opt = torch.optim.Adam([param])
    schema = probe_schema(opt, opt.param_groups[0], param)
    state = init_state(param, schema, FORMATS)
    return trace_for(opt, opt.param_groups[0], param, state, schema.per_element).graph


def test_the_stages_run_in_the_pipelines_order_each_where_asked():
    """A bf16 param's fp32 opmath and the fp32 master's rewrite are each a stage of their own, run where the
    request asks for it (a master's step is traced in fp32, so it never asks for both)."""
    order = [name for name, _ in STAGES]
    plain = rewrite(_adam_trace(), Rewrite(FORMATS))
    opmath = rewrite(_adam_trace(torch.bfloat16), Rewrite(FORMATS, opmath=True))
    master = rewrite(_adam_trace(), Rewrite(FORMATS, master=MasterFormat("exact", torch.bfloat16)))
    assert list(plain) == ["roles", "quantized", "split"]
    assert list(opmath) == ["roles", "quantized", "opmath", "split"]
    assert list(master) == ["roles", "quantized", "master", "split"]
    assert all(list(graphs) == [n for n in order if n in graphs] for graphs in (plain, opmath, master))


def test_a_wrapped_optimizer_compiles_the_rewrite_the_tests_print(one_thread):
    param = torch.nn.Parameter(torch.randn(64))
    opt = lowbit_compile(torch.optim.AdamW([param], weight_decay=0.1), "int8", min_8bit_size=0, backend="reference")
    param.grad = torch.randn(64)
    opt.step()
    compiled = wrapped_of(opt).prepared[param].compiled
    twin = torch.optim.AdamW([torch.nn.Parameter(torch.randn(64))], weight_decay=0.1)
    assert code(compiled.graph) == code(pass_graphs(twin, "int8")["split"])
