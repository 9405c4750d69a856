"""Build the graphs of each pass for one param of a stock optimizer (for snapshot tests)."""

from __future__ import annotations

import torch

from lowbit_compile.config import Config
from lowbit_compile.passes.quantize_states import quantize_states
from lowbit_compile.passes.roles import label_roles
from lowbit_compile.passes.split import split_prologue
from lowbit_compile.runner import init_state, probe_schema, trace_for


def pass_graphs(opt: torch.optim.Optimizer, fmt: str | dict[str, str] = "int8", block_size: int = 2048,
                outliers: int = 2) -> dict[str, torch.fx.GraphModule]:
    group = opt.param_groups[0]
    param = group["params"][0]
    schema = probe_schema(opt, group, param)
    formats = dict(Config.make(fmt, block_size, outliers, 0, "reference").formats_for(param, schema.per_element))
    state = init_state(param, schema, formats)
    traced = trace_for(opt, group, param, state, schema).graph
    roles = label_roles(traced)
    quantized = quantize_states(roles, formats)
    return {"traced": traced, "roles": roles, "quantized": quantized, "split": split_prologue(quantized)}


def code(gm: torch.fx.GraphModule) -> str:
    return gm.code.strip()
