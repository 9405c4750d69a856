"""Build the graphs of each pass for one param of a stock optimizer (for snapshot tests), at the
default state layout unless told otherwise: the library's own rewrite (``passes.pipeline``)."""

from __future__ import annotations

import torch

from lowbit_compile.config import DEFAULT_BLOCK_SIZE, DEFAULT_FMT, DEFAULT_OUTLIERS, Config
from lowbit_compile.formats.rounding import DEFAULT_ROUNDING
from lowbit_compile.options import Options
from lowbit_compile.passes.pipeline import Rewrite, rewrite
from lowbit_compile.state.schema import init_state, probe_schema, trace_for


def pass_graphs(opt: torch.optim.Optimizer, fmt: str | dict = DEFAULT_FMT, block_size: int = DEFAULT_BLOCK_SIZE,
                outliers: int = DEFAULT_OUTLIERS, rounding: str | dict = DEFAULT_ROUNDING) -> dict[str, torch.fx.GraphModule]:
    group = opt.param_groups[0]
    param = group["params"][0]
    schema = probe_schema(opt, group, param)
    config = Config.of(Options(fmt, block_size, outliers, min_8bit_size=0, backend="reference", rounding=rounding))
    formats = dict(config.formats_for(param, schema.per_element, nonneg=schema.nonneg))
    state = init_state(param, schema, formats)
    traced = trace_for(opt, group, param, state, schema.per_element).graph
    return {"traced": traced, **rewrite(traced, Rewrite(formats, config.stochastic(formats)))}


def body(opt: torch.optim.Optimizer, fmt: str | dict = DEFAULT_FMT, **layout) -> torch.fx.GraphModule:
    """The elementwise body a backend lowers."""
    return pass_graphs(opt, fmt, **layout)["split"].body


def code(gm: torch.fx.GraphModule) -> str:
    return gm.code.strip()
