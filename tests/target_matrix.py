"""The CUDA compile matrix of the Triton kernels (issue 12, item 4), checked without a GPU.

Every (architecture, state format, param dtype) cell is compiled at least once, on the FP8 path a GPU
of that architecture takes (integer bit operations before sm_89, float8 conversions from sm_89), and
the fp8 cells of sm_89/sm_90 on the integer path too (what ``bench/gpu_check.py`` forces there). Per
architecture and dtype one fused step (Adam with amsgrad, AdamW or NAdam, rotating, with rotating
flags, every other one rounding its states stochastically, per tensor or batched as the launches
take it: the batched kernel's full-tile and masked last-tile variants each once per architecture) takes two or three formats as its states, and standalone quantize or dequantize kernels take
the formats left over, always including an fp8 one; block layouts and signed/unsigned states rotate
over the state kernels. So each kernel kind meets every architecture while each compile covers as
many cells as it can: compile time is what limits this test. ``python -m tests.target_matrix``
(TRITON_INTERPRET unset) compiles the plan and prints one JSON line per kernel, with its registers and the
bytes it spills (``cuobjdump -res-usage``: stack and local memory).
"""

from __future__ import annotations

import gc
import json
import resource
import time
from dataclasses import dataclass, field

import torch

from .helpers import FP8 as _FP8
from .helpers import KERNEL_FORMATS

ARCHS = (70, 75, 80, 86, 89, 90)
FORMATS = tuple(KERNEL_FORMATS)
FP8 = tuple(_FP8)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (block size, patches per block): the library's default, one block per row with patches, patches in a
# tile of several blocks (2-D argmax)
LAYOUTS = ((512, 0), (2048, 2), (512, 2))
STEP_LAYOUT = LAYOUTS[0]  # what differs between layouts is state-kernel code, compiled in all three above
FIRST_FP8_ARCH = 89  # kernels/triton_backend.FP8_NATIVE_ARCH (not imported: that imports triton)


def _tensor_hypers() -> dict:
    return {"lr": torch.tensor(0.01), "betas": (torch.tensor(0.9), torch.tensor(0.99))}


# The steps: (optimizer class, its per-element states in order, flag sets rotated over the architectures)
STEPS = {
    "Adam": (torch.optim.Adam, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
             ({"amsgrad": True}, {"amsgrad": True, "maximize": True, "weight_decay": 0.1},
              {"amsgrad": True, **_tensor_hypers()})),
    "AdamW": (torch.optim.AdamW, ("exp_avg", "exp_avg_sq"), ({"weight_decay": 0.1},)),
    "NAdam": (torch.optim.NAdam, ("exp_avg", "exp_avg_sq"), ({}, {"weight_decay": 0.1, "decoupled_weight_decay": True})),
}
STATE_KERNELS = ("quantize", "dequantize")


@dataclass(frozen=True)
class Target:
    """A CUDA architecture and the FP8 path its kernels are compiled with."""

    arch: int
    fp8_native: bool

    def __str__(self) -> str:
        return f"sm_{self.arch}{'' if self.fp8_native else '/int-fp8'}"


# every architecture on its own path, then the integer path where the native one is the default
TARGETS = tuple(Target(a, a >= FIRST_FP8_ARCH) for a in ARCHS) + tuple(
    Target(a, False) for a in ARCHS if a >= FIRST_FP8_ARCH)


@dataclass(frozen=True)
class Kernel:
    """One compile: a fused step (``kind`` a STEPS key, one format per state) or a state kernel."""

    target: Target
    kind: str
    dtype: torch.dtype
    formats: tuple[str, ...]
    layout: tuple[int, int]
    nonneg: bool = False  # state kernels
    flags: dict = field(default_factory=dict, compare=False)  # steps
    rounding: str = "nearest"  # steps: every other one rounds its states stochastically
    batched: bool = False  # steps: the kernel of a launch over many tensors (BatchedLaunch)
    masked: bool = False  # batched steps: the variant of partial last tiles (else of whole tiles)

    def __str__(self) -> str:
        states = "/".join(self.formats) + (":u" if self.nonneg else "")
        kind = self.kind if self.kind in STATE_KERNELS else f"{self.kind}({','.join(sorted(self.flags))})"
        sr = " sr" if self.rounding == "stochastic" else ""
        kind += (" batched last-tiles" if self.masked else " batched") if self.batched else ""
        return f"{self.target} {kind}{sr} {states} {str(self.dtype)[6:]} block {self.layout[0]} k{self.layout[1]}"

    def cells(self) -> set[tuple[Target, str, torch.dtype]]:
        return {(self.target, f, self.dtype) for f in self.formats}

    def graph(self) -> torch.fx.GraphModule:
        from lowbit_compile.formats import StateFormat
        from lowbit_compile.kernels.triton_printer import dequantize_graph, quantize_graph

        from .graphs import pass_graphs

        block, outliers = self.layout
        if self.kind in STATE_KERNELS:
            fmt = StateFormat.make(self.formats[0], block, outliers, self.nonneg)
            return (quantize_graph if self.kind == "quantize" else dequantize_graph)(fmt, self.dtype)
        cls, states, _ = STEPS[self.kind]
        opt = cls([torch.nn.Parameter(torch.randn(64, dtype=self.dtype))], **self.flags)
        return pass_graphs(opt, dict(zip(states, self.formats)), block, outliers, self.rounding)["split"].body


def _rotated(items: tuple, by: int) -> tuple:
    by %= len(items)
    return items[by:] + items[:by]


def plan() -> list[Kernel]:
    """The kernels to compile: per target and dtype one step, the optimizer rotating, whose states take
    the first formats of a rotated order, and a state kernel for each format left over (and for an fp8
    format where none is)."""
    kernels = []
    for i, target in enumerate(TARGETS):
        formats = FORMATS if target.fp8_native == (target.arch >= FIRST_FP8_ARCH) else FP8
        for j, dtype in enumerate(DTYPES):
            order = _rotated(formats, i + j)
            name = _rotated(tuple(STEPS), i + j)[0]
            _, states, flag_sets = STEPS[name]
            slots = [order[n % len(order)] for n in range(len(states))]
            left = list(order[len(states):])
            fp8 = _rotated(FP8, i + j)[0]  # the formats whose code depends on the architecture: in both kinds
            if not set(slots) & set(FP8):
                left[left.index(fp8)] = slots[-1]
                slots[-1] = fp8
            if not set(left) & set(FP8):
                left.append(fp8)
            kernels.append(Kernel(target, name, dtype, tuple(slots), STEP_LAYOUT,
                                  flags=flag_sets[i % len(flag_sets)],
                                  rounding=("nearest", "stochastic")[(i + j) % 2], batched=j % 2 == 0,
                                  masked=j == 2))
            for k, fmt in enumerate(left):
                seen = sum(kernel.formats == (fmt,) for kernel in kernels)  # each format: q, dq, q unsigned, ...
                kernels.append(Kernel(target, STATE_KERNELS[seen % 2], dtype, (fmt,),
                                      LAYOUTS[(i + j + k) % len(LAYOUTS)], nonneg=seen // 2 % 2 == 1))
    return kernels


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (ptxas): the cost on an idle machine."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    from bench.gpu_cost import resource_usage
    from lowbit_compile.kernels.triton_backend import compile_for_target

    kernels = plan()
    graphs = [k.graph() for k in kernels]
    # Triton's front end allocates heavily; with the graphs, torch and triton frozen out of the GC's
    # generations, collections stop rescanning them (about a third of each compile otherwise)
    gc.collect()
    gc.freeze()
    for kernel, graph in zip(kernels, graphs):
        wall, cpu = time.perf_counter(), _cpu_seconds()
        usage = {}
        try:
            compiled = compile_for_target(graph, kernel.target.arch, fp8_native=kernel.target.fp8_native,
                                          batched=kernel.batched, masked=kernel.masked)
            usage = resource_usage(compiled.asm["cubin"])
            error = None
        except Exception as e:  # reported per kernel; the test fails on any
            error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        print(json.dumps({"kernel": str(kernel), "ok": error is None, "error": error,
                          "registers": usage.get("registers"),
                          "spill_bytes": usage["stack_bytes"] + usage["local_bytes"] if usage else None,
                          "wall_s": round(time.perf_counter() - wall, 3), "cpu_s": round(_cpu_seconds() - cpu, 3)}),
              flush=True)
    gc.unfreeze()


if __name__ == "__main__":
    main()
