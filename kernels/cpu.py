"""The CPU lowering (``backend="inductor"``, what ``"auto"`` picks for CPU tensors).

The split step's prologue (host math on Python floats) runs as its FX code; the body becomes one
fused C++ kernel (``cpu_emit``) compiled with inductor's toolchain and cached on disk
(``cpu_build``). The kernel is specific to the signature only: any parameter size, and any number
of parameters in one call (``run_many``), which is how many small tensors cost one launch.

Why not inductor's own code generation: the block quantization needs, per block, the K largest
magnitudes with their offsets, an absmax of the rest and an encode that depends on both. Expressed in
torch ops for inductor (view as (-1, block), amax, topk/argmax, scatter, divide, round, cast) it
becomes several loops over the block with scalar reductions; the kernel here gathers each lane's
largest magnitudes while the update writes the block, then encodes in one more pass over L1.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import os
import warnings
from array import array
from collections.abc import Callable, Sequence

import torch
from torch.fx import GraphModule

from . import cpu_build
from .cpu_emit import ENTRY, EmittedStep, UnsupportedStep, emit_step


class CpuStep:
    """A compiled step with the split graph's signature; ``run_many`` steps several parameters at once."""

    def __init__(self, step: GraphModule, emitted: EmittedStep, kernel: Callable[..., int]) -> None:
        self.step = step
        self.emitted = emitted
        self.kernel = kernel
        self.prologue = step.prologue.forward
        top = [n for n in step.graph.nodes if n.op == "placeholder"]
        index = {n: i for i, n in enumerate(top)}
        call_pro = next(n for n in step.graph.nodes if n.op == "call_module" and n.target == "prologue")
        call_body = next(n for n in step.graph.nodes if n.op == "call_module" and n.target == "body")
        self.prologue_args = tuple(index[a] for a in call_pro.args)
        # Where each body input comes from: ("arg", i) a top-level input, ("pro", j) a prologue output.
        sources = []
        for a in call_body.args:
            if a.op == "placeholder":
                sources.append(("arg", index[a]))
            else:
                assert a.target is operator.getitem and a.args[0] is call_pro
                sources.append(("pro", a.args[1]))
        self.pointer_args = tuple(sources[p.index][1] for p in emitted.pointers)
        assert all(sources[p.index][0] == "arg" for p in emitted.pointers)
        self.scalar_sources = tuple(sources[i] for i in emitted.scalars)
        self.scalar_states = tuple(index[n] for n in top if n.meta.get("role") == "scalar_state")
        self.param_arg = next(index[n] for n in top if n.meta.get("role") == "param")
        self.launches = 0

    def __call__(self, *args: object) -> None:
        self.run_many([args])

    def run_many(self, rows: Sequence[Sequence[object]]) -> None:
        """Step every row (one parameter's top-level inputs each), one kernel call per set of rows
        whose scalar states (the step count) are equal; all rows share their hyperparameters."""
        if len(rows) > 1 and self.scalar_states:
            classes: dict[tuple, list] = {}
            for row in rows:
                classes.setdefault(tuple(row[k].item() for k in self.scalar_states), []).append(row)
            for same in classes.values():
                self._launch(same)
        else:
            self._launch(rows)

    def _launch(self, rows: Sequence[Sequence[object]]) -> None:
        """The prologue runs once, on the first row; the other rows' scalar states are set to its
        result, then one kernel call steps every row."""
        first = rows[0]
        outputs = self.prologue(*(first[i] for i in self.prologue_args))
        if len(rows) > 1 and self.scalar_states:
            for k in self.scalar_states:
                torch._foreach_copy_([row[k] for row in rows[1:]], [first[k]] * (len(rows) - 1))
        scalars = array("d", [float(outputs[j] if kind == "pro" else first[j]) for kind, j in self.scalar_sources])
        table = array("q")
        keep: list[torch.Tensor] = []  # contiguous copies of strided read-only inputs, alive until the call
        for row in rows:
            table.extend(self._pointers(row, keep))
        table_addr, _ = table.buffer_info()
        scalars_addr = scalars.buffer_info()[0] if scalars else None
        status = self.kernel(len(rows), table_addr, scalars_addr, torch.get_num_threads())
        self.launches += 1
        if status:
            raise MemoryError("lowbit-compile CPU kernel could not allocate its block buffers")

    def _pointers(self, row: Sequence[object], keep: list[torch.Tensor]) -> list[int]:
        """[element count, data pointers...] for one parameter, after checking every buffer's layout."""
        param = row[self.param_arg]
        n = param.numel()
        block, patches = self.emitted.block, self.emitted.patches
        blocks = -(-n // block)
        expected = {"n": n, "blocks": blocks, "patches": blocks * patches, "empty": 0}
        out = [n]
        for spec, i in zip(self.emitted.pointers, self.pointer_args):
            t = row[i]
            dtype_ok = t.dtype.itemsize == 1 if spec.dtype == torch.uint8 else t.dtype == spec.dtype
            if not dtype_ok or t.numel() != expected[spec.length] or t.device.type != "cpu":
                raise ValueError(f"input {spec.name!r}: expected {expected[spec.length]} elements of "
                                 f"{spec.dtype} on cpu, got {t.numel()} of {t.dtype} on {t.device}")
            if not t.is_contiguous():
                if spec.written:
                    raise ValueError(f"input {spec.name!r} must be contiguous (it is written in place)")
                t = t.contiguous()
                keep.append(t)
            out.append(t.data_ptr())
        return out


def lower_cpu(step: GraphModule) -> Callable[..., None]:
    """Lower a split, rewritten step to the fused CPU kernel; the reference where the emitter refuses."""
    stock = not any(n.target is torch.ops.lowbit.dequantize.default for n in step.body.graph.nodes)
    try:
        emitted = emit_step(step.body, exact=stock)
    except UnsupportedStep as err:
        warnings.warn(f"lowbit-compile: the CPU kernel does not cover this step ({err}); running the eager "
                      "reference lowering instead", stacklevel=2)
        return step.forward
    try:
        cpu_build.compiler()
    except RuntimeError as err:
        warnings.warn(f"lowbit-compile: {err}; running the eager reference lowering instead", stacklevel=2)
        return step.forward
    lib = cpu_build.load(emitted.full_source)
    if emitted.mkl_sqrt:
        vsqrt = _torch_vsqrt()
        if vsqrt is not None:
            lib.lowbit_set_vsqrt(ctypes.c_void_p(vsqrt))
    kernel = getattr(lib, ENTRY)
    kernel.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    kernel.restype = ctypes.c_int
    return CpuStep(step, emitted, kernel)


@functools.cache
def _torch_vsqrt() -> int | None:
    """The address of the float32 square root torch's own CPU kernels use: MKL's vmsSqrt, exported by
    libtorch_cpu when torch is built with MKL (None otherwise: torch then uses the SIMD square root)."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    except OSError:
        return None
    fn = getattr(lib, "vmsSqrt", None)
    return ctypes.cast(fn, ctypes.c_void_p).value if fn is not None else None
