"""The generated kernel sources of a wide matrix of steps, hashed: what a restructuring that must not change
behaviour compares before and after (``python -m tests.kernel_sources --check tests/fixtures/kernel_sources.txt``;
``--write FILE`` records the hashes of the code as it is).

Every stock optimizer's optim_db flag sets (fp32 params) under each state format, 0 and 2 outlier patches and
both roundings; bf16 and fp16 params under the default, int8 and fp32 states with and without master weights;
each step wrapped and stepped as a user would (``lowbit_compile(opt, ...)``, ``opt.step()``), the lowering
of every rewritten step intercepted and printed by the C++ printer and by the Triton printer (CUDA, both FP8
paths, per-tensor and batched). Then the Triton state kernels (quantize, dequantize) of every format, sign,
dtype and block layout, the C++ prelude and triton_lib's constants. Every param is quantized
(``min_8bit_size=0``: the matrix's params are small). Nothing is compiled. One line per
case: its name, how many sources it printed (with its outcome: stepped, printed or the error that refused
it) and a digest of their sha256s in order.
The optim_db flag sets depend on the torch version: compare hashes made with the same torch.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import sys
import time
import warnings
from collections.abc import Callable, Iterator

import torch

from lowbit_compile import lowbit_compile
from lowbit_compile.formats import StateFormat
from lowbit_compile.kernels import backends, cpp_printer, triton_lib
from lowbit_compile.kernels.lowering import Target
from lowbit_compile.kernels.triton_printer import dequantize_graph, emit_kernel, quantize_graph
from lowbit_compile.runtime.wrap import REWRITTEN, STAGED

from .helpers import optim_db_cases

FORMATS = ("int8", "dynamic8", "fp8_e4m3", "fp8_e5m2", "bf16", "fp32", "sqrt8", "sqrt4")
BLOCKWISE = ("int8", "dynamic8", "fp8_e4m3", "fp8_e5m2", "sqrt8", "sqrt4")
LOW_PRECISION = (torch.bfloat16, torch.float16)
MASTERS = (None, "exact", "8bit")
LAYOUTS = ((512, 0), (2048, 2), (512, 2))
TRITON_TARGETS = (Target("cuda", fp8_native=True), Target("cuda", fp8_native=False))


class _Printed(Exception):
    """Ends a step once every kernel of it was printed (nothing is compiled or run)."""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _sources(step: torch.fx.GraphModule) -> Iterator[str]:
    """The C++ kernel of a split step as its backend emits it, then its four Triton kernels."""
    stock = not any(n.target is torch.ops.lowbit.dequantize.default for n in step.body.graph.nodes)
    yield _printed(cpp_printer.emit_step, step.body, Target("cpu", torch_sqrt=stock, reciprocal_divisor=not stock))
    for target, batched in itertools.product(TRITON_TARGETS, (False, True)):
        yield _printed(emit_kernel, step.body, "lowbit_step", target, batched=batched)


def _printed(emit: Callable, *args: object, **kwargs: object) -> str:
    """The source ``emit(*args, **kwargs)`` prints (C++ with its prelude), or the error that refused it."""
    try:
        emitted = emit(*args, **kwargs)
        return getattr(emitted, "full_source", None) or emitted.source
    except Exception as err:  # noqa: BLE001 - a refusal is part of the behaviour: its message is hashed
        return f"{type(err).__name__}: {err}"


def _intercepting(record: list[str]) -> Callable:
    """A stand-in for ``backends.lower`` that prints the step's kernels into ``record``."""

    def lower(step: torch.fx.GraphModule, backend: str, device: torch.device) -> Callable:
        record.extend(_sources(step))

        def never_built() -> None:
            raise _Printed

        return never_built

    return lower


def _patch_lower(replacement: Callable) -> list[tuple[object, str, object]]:
    """Replace ``backends.lower`` wherever a module of the package holds it; the undo list."""
    original = backends.lower
    undo = []
    for name, module in list(sys.modules.items()):
        if name.startswith("lowbit_compile") and module is not None:
            for attr, value in list(vars(module).items()):
                if value is original:
                    undo.append((module, attr, value))
                    setattr(module, attr, replacement)
    return undo


def _step_cases() -> Iterator[tuple[str, Callable[[], torch.optim.Optimizer], dict]]:
    """(case name, a fresh optimizer, lowbit_compile options) over the matrix."""
    for cls, kwargs, name in optim_db_cases(REWRITTEN):
        staged = cls in STAGED

        def make(dtype: torch.dtype = torch.float32, cls=cls, kwargs=kwargs, staged=staged) -> torch.optim.Optimizer:
            gen = torch.Generator().manual_seed(0)
            param = torch.nn.Parameter(torch.randn((12, 10) if staged else (100,), generator=gen).to(dtype))
            param.grad = torch.randn(param.shape, generator=gen).to(dtype)
            return cls([param], **kwargs)

        yield f"{name} default", make, {}
        for fmt in FORMATS:
            if fmt == "fp32":
                yield f"{name} fp32", make, {"fmt": "fp32"}
                continue
            for outliers, rounding in itertools.product((0, 2) if fmt in BLOCKWISE else (0,), ("nearest", "stochastic")):
                yield f"{name} {fmt} k{outliers} {rounding}", make, {"fmt": fmt, "outliers": outliers,
                                                                    "rounding": rounding}
        for dtype, master, fmt in itertools.product(LOW_PRECISION, MASTERS, ("sqrt8", "int8", "fp32")):
            yield (f"{name} {str(dtype)[6:]} master={master} {fmt}", lambda make=make, dtype=dtype: make(dtype),
                   {"fmt": fmt, "master_weights": master})


def step_sources() -> Iterator[tuple[str, list[str]]]:
    """Each step case and its outcome and kernel sources."""
    record: list[str] = []
    undo = _patch_lower(_intercepting(record))
    try:
        for case, make, options in _step_cases():
            record.clear()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    opt = lowbit_compile(make(), backend="cpu", min_8bit_size=0, **options)
                    opt.step()
                outcome = "stepped"
            except _Printed:
                outcome = "printed"
            except Exception as err:  # noqa: BLE001 - a refusal is part of the behaviour
                outcome = f"{type(err).__name__}: {err}"
            yield case, [f"outcome: {outcome}", *record]
    finally:
        for module, attr, value in undo:
            setattr(module, attr, value)


def state_kernels() -> Iterator[tuple[str, list[str]]]:
    """The Triton quantize and dequantize kernels of every format, sign, dtype and layout."""
    for name, nonneg, dtype, (block, outliers), target in itertools.product(
            FORMATS, (False, True), (torch.float32, *LOW_PRECISION), LAYOUTS, TRITON_TARGETS):
        if name == "fp32":
            continue
        fmt = StateFormat.make(name, block, outliers, nonneg)
        yield (f"state kernels {fmt.tag()} {str(dtype)[6:]} {'native' if target.fp8_native else 'int'}-fp8",
               [_printed(emit_kernel, graph(fmt, dtype), f"lowbit_{kind}", target)
                for kind, graph in (("quantize", quantize_graph), ("dequantize", dequantize_graph))])


def library_sources() -> Iterator[tuple[str, list[str]]]:
    """The fixed C++ (the prelude with its format constants) and triton_lib's module-level constants."""
    constants = sorted((k, repr(getattr(v, "value", v))) for k, v in vars(triton_lib).items()
                       if not k.startswith("__") and isinstance(getattr(v, "value", v), (int, float, bool)))
    yield "libraries", [cpp_printer.PRELUDE, repr(constants)]


def _line(case: str, sources: list[str]) -> str:
    """A case's line: its name, how many sources, and one digest over all of them in order."""
    digest = hashlib.sha256()
    for source in sources:
        digest.update(_digest(source).encode())
    return f"{case} | {len(sources)} | {digest.hexdigest()[:24]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", metavar="FILE", help="record the hashes of the code as it is")
    group.add_argument("--check", metavar="FILE", help="compare with hashes recorded before; exit 1 on a difference")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    lines, kernels = [], 0
    for case, sources in itertools.chain(library_sources(), state_kernels(), step_sources()):
        lines.append(_line(case, sources))
        kernels += sum(not s.startswith("outcome: ") for s in sources)
    header = f"# torch {torch.__version__.split('+')[0]}; {kernels} sources in {len(lines)} cases"
    print(f"{kernels} sources in {len(lines)} cases, {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if args.write:
        with open(args.write, "w") as f:
            f.write("\n".join([header, *lines]) + "\n")
        return
    with open(args.check) as f:
        recorded = [line.rstrip("\n") for line in f if not line.startswith("#")]
    if recorded == lines:
        print(f"identical: {kernels} sources in {len(lines)} cases, as recorded in {args.check}")
        return
    old, new = set(recorded), set(lines)
    for line in [*(f"- {x}" for x in recorded if x not in new), *(f"+ {x}" for x in lines if x not in old)][:40]:
        print(line)
    print(f"DIFFERENT from {args.check}: {len(old - new)} recorded lines changed or gone, {len(new - old)} new",
          file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
    main()
