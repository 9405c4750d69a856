"""The CPU backend (``backend="cpu"``, what ``"auto"`` picks for CPU tensors).

The split step's prologue (host math on Python floats) runs as its FX code; the body becomes one
fused C++ kernel (``cpp_printer``) compiled with the C++ toolchain inductor uses and cached on disk
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
from array import array
from collections.abc import Callable, Sequence

import torch
from torch.fx import GraphModule

from . import cpu_build
from .contract import Role, role_of
from .cpp_printer import ENTRY, EmittedStep, emit_step
from .kernel import same_scalar_states
from .lowering import Target


class CpuStep:
    """A compiled step with the split graph's signature; ``run_many`` steps several parameters at once."""

    backend = "cpu"

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
        # codes travel as bytes: any 1-byte dtype (int8, uint8, float8) is the same buffer
        one_byte = frozenset({torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2})
        self.checks = tuple((i, one_byte if p.dtype == torch.uint8 else frozenset({p.dtype}), p)
                            for p, i in zip(emitted.pointers, self.pointer_args))
        assert all(sources[p.index][0] == "arg" for p in emitted.pointers)
        self.scalar_sources = tuple(sources[i] for i in emitted.scalars)
        self.scalar_states = tuple(index[n] for n in top if role_of(n) is Role.SCALAR_STATE)
        self.param_arg = next(index[n] for n in top if role_of(n) is Role.PARAM)
        self.launches = 0

    def run_many(self, rows: Sequence[Sequence[object]], memos: Sequence[dict] | None = None) -> None:
        """Step every row (one parameter's top-level inputs each), one kernel call per set of rows
        whose scalar states (the step count) are equal; all rows share their hyperparameters.

        ``memos`` (one dict per row, kept by the caller while the row's tensors stay the same
        objects) let a steady step re-check only the inputs that changed object, the grad."""
        if memos is not None:
            rows = [_Memo(row, memo) for row, memo in zip(rows, memos)]
        for group in same_scalar_states(rows, self.scalar_states):
            self._launch([rows[r] for r in group])

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
        if status == 3:
            raise RuntimeError("lowbit-compile CPU kernel: the dynamic8 map of kernels/formats.py is finer than "
                               "the kernel's encode buckets (cpu_prelude.h, lb_dyn_build); use backend='reference'")
        if status:
            raise MemoryError("lowbit-compile CPU kernel could not allocate its block buffers")

    def _pointers(self, row: Sequence[object], keep: list[torch.Tensor]) -> list[int]:
        """[element count, data pointers...] for one parameter, after checking every buffer's dtype,
        length and layout (a wrong binding must fail here, not write out of bounds)."""
        if isinstance(row, _Memo):
            return self._memo_pointers(row, keep)
        n = row[self.param_arg].numel()
        blocks = -(-n // self.emitted.block)
        expected = {"n": n, "blocks": blocks, "patches": blocks * self.emitted.patches, "empty": 0,
                    "words": -(-n // 32)}
        out = [n]
        for i, dtypes, spec in self.checks:
            t = row[i]
            if t.dtype not in dtypes or t.numel() != expected[spec.length]:
                raise ValueError(f"input {spec.name!r}: expected {expected[spec.length]} elements of "
                                 f"{spec.dtype}, got {t.numel()} of {t.dtype}")
            if not t.is_contiguous():
                if spec.written:
                    raise ValueError(f"input {spec.name!r} must be contiguous (it is written in place)")
                t = t.contiguous()
                keep.append(t)
            out.append(t.data_ptr())
        return out


    def _memo_pointers(self, row: _Memo, keep: list[torch.Tensor]) -> list[int]:
        """``_pointers``, re-checking only the inputs that are not the same objects as at the last
        call with this memo (a steady step: the grad)."""
        seen = row.memo.get(self)
        if seen is None:
            ptrs = self._pointers(row.row, keep)
            if not keep:  # no temporary copies: the pointers stay valid while the objects do
                row.memo[self] = ([row[i] for i, _, _ in self.checks], ptrs)
            return ptrs
        tensors, ptrs = seen
        n = ptrs[0]
        blocks = -(-n // self.emitted.block)
        expected = {"n": n, "blocks": blocks, "patches": blocks * self.emitted.patches, "empty": 0,
                    "words": -(-n // 32)}
        for j, (i, dtypes, spec) in enumerate(self.checks):
            t = row[i]
            if t is tensors[j]:
                continue
            if t.dtype not in dtypes or t.numel() != expected[spec.length] or not t.is_contiguous():
                return self._pointers(row.row, keep)  # the full check says what is wrong, or copies
            tensors[j] = t
            ptrs[j + 1] = t.data_ptr()
        return ptrs


class _Memo:
    """A row with the caller's memo dict attached (``CpuStep.run_many``)."""

    __slots__ = ("row", "memo")

    def __init__(self, row: Sequence[object], memo: dict) -> None:
        self.row, self.memo = row, memo

    def __getitem__(self, i: int) -> object:
        return self.row[i]


def lower_cpu(step: GraphModule) -> CpuStep:
    """The split, rewritten step as one compiled C++ kernel (``LoweringError`` or ``RuntimeError`` when
    it cannot be built: an op no printer covers, or no C++ compiler). A step without quantized states
    takes torch's own square root and true divisions, so it is bit for bit stock; with quantized
    states the kernel takes the SIMD square root and multiplies by the reciprocal of a scalar divisor,
    each within one fp32 rounding of torch's."""
    stock = not any(n.target is torch.ops.lowbit.dequantize.default for n in step.body.graph.nodes)
    emitted = emit_step(step.body, Target("cpu", torch_sqrt=stock, reciprocal_divisor=not stock))
    cpu_build.compiler()
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
