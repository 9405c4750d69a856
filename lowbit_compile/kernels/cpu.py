"""The CPU backend (``backend="cpu"``, what ``"auto"`` picks for CPU tensors).

The split step's prologue (host math on Python floats) runs as its FX code; the body becomes one
fused C++ kernel (``cpp_printer``) compiled with the C++ toolchain inductor uses and cached on disk
(``cpu_build``). The kernel is specific to the signature only: any parameter size, and any number
of parameters in one call (``CpuLaunch``), which is how many small tensors cost one launch.

Why not inductor's own code generation: the block quantization needs, per block, the K largest
magnitudes with their offsets, an absmax of the rest and an encode that depends on both. Expressed in
torch ops for inductor (view as (-1, block), amax, topk/argmax, scatter, divide, round, cast) it
becomes several loops over the block with scalar reductions; the kernel here gathers each lane's
largest magnitudes while the update writes the block, then encodes in one more pass over L1.
"""

from __future__ import annotations

import ctypes
import functools
import os
from array import array
from collections.abc import Callable, Sequence

import torch
from torch.fx import GraphModule

from ..ir.contract import Role, role_of
from . import cpu_build
from .cpp_printer import ENTRY, EmittedStep, PointerInput, emit_step
from .kernel import advance_counters, body_sources, check_grad, same_scalar_states, step_counters
from .lowering import Target


class CpuStep:
    """A compiled step with the split graph's signature; a launch steps several parameters at once."""

    backend = "cpu"

    def __init__(self, step: GraphModule, emitted: EmittedStep, kernel: Callable[..., int]) -> None:
        self.step = step
        self.emitted = emitted
        self.kernel = kernel
        self.prologue = step.prologue.forward
        top = [n for n in step.graph.nodes if n.op == "placeholder"]
        index = {n: i for i, n in enumerate(top)}
        self.prologue_args, sources = body_sources(step)
        self.pointer_args = tuple(sources[p.index][1] for p in emitted.pointers)
        # codes travel as bytes: any 1-byte dtype (int8, uint8, float8) is the same buffer
        one_byte = frozenset({torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2})
        self.checks = tuple((i, one_byte if p.dtype == torch.uint8 else frozenset({p.dtype}), p)
                            for p, i in zip(emitted.pointers, self.pointer_args))
        assert all(sources[p.index][0] == "arg" for p in emitted.pointers)
        self.scalar_sources = tuple(sources[i] for i in emitted.scalars)
        self.scalar_states = tuple(index[n] for n in top if role_of(n) is Role.SCALAR_STATE)
        self.counters, reads = step_counters(step)
        self.shared_states = tuple(k for k in self.scalar_states if k not in self.counters)  # one value per call
        # the scalars that are a counter's value from before the step: each row passes its own
        self.counter_slots = {k: reads[j] for k, (kind, j) in enumerate(self.scalar_sources)
                              if kind == "pro" and j in reads}
        self.param_arg = next(index[n] for n in top if role_of(n) is Role.PARAM)
        self.grad_arg = next((index[n] for n in top if role_of(n) is Role.GRAD), None)

    def launch(self, rows: Sequence[list]) -> CpuLaunch:
        """One kernel call per set of rows whose scalar states (the step count; not the stochastic-rounding
        counters, which each row passes its own) are equal, prepared: every buffer checked and its pointer
        in the call's table."""
        return CpuLaunch(self, rows)

    def check(self, row: Sequence[object], i: int, n: int, spec: PointerInput, dtypes: frozenset) -> int:
        """The data pointer of input ``i`` of a row of ``n`` elements, after checking its dtype, length
        and layout (a wrong binding must fail here, not write out of bounds)."""
        t = row[i]
        blocks = -(-n // self.emitted.block)
        expected = {"n": n, "pairs": -(-n // 2), "blocks": blocks, "patches": blocks * self.emitted.patches, "empty": 0,
                    "words": -(-n // 32)}[spec.length]
        if t.dtype not in dtypes or t.numel() != expected:
            raise ValueError(f"input {spec.name!r}: expected {expected} elements of {spec.dtype}, got "
                             f"{t.numel()} of {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"input {spec.name!r} must be contiguous (it is bound once, by its pointer)")
        return t.data_ptr()


class CpuLaunch:
    """Kernel calls over fixed rows (one parameter's inputs each), kept between steps: each call's
    pointer table is built once, but for the grads, which :meth:`run` reads from the rows and points
    to on every run (a strided grad through a copy made for that run); it reads the rows'
    hyperparameters as they are when it runs. The prologue runs once per call, on its first row, and
    the other rows' scalar states are set to its result, but for their stochastic-rounding counters, which
    advance as the first row's does and reach the kernel in the row's own scalars. The param's pointer
    stays in the table: the caller checks its ``data_ptr()`` before each run.

    Every run checks each grad's dtype, size and layout and takes its ``data_ptr()`` afresh (a few
    attribute reads): training hands the step new grads every time, and a grad changed in place
    (``set_``, ``resize_``, ``.data =``, a transposed view) is caught as well. No grad is kept."""

    def __init__(self, step: CpuStep, rows: Sequence[list]) -> None:
        self.step = step
        self.rows = rows
        self.grad_arg = step.grad_arg
        grad_check = next((c for c in step.checks if c[0] == step.grad_arg), None)
        self.grad_dtype = grad_check[2].dtype if grad_check is not None else None
        self.sizes = [row[step.param_arg].numel() for row in rows]
        self.pointers = [self._pointers(row, n) for row, n in zip(rows, self.sizes)]
        self._build()

    def _pointers(self, row: Sequence[object], n: int) -> list[int]:
        """Row ``row``'s pointers in table order, the grad's as 0 (bound by each run)."""
        step = self.step
        return [0 if i == self.grad_arg else step.check(row, i, n, spec, dtypes) for i, dtypes, spec in step.checks]

    def _build(self) -> None:
        step = self.step
        grad_slot = next((k for k, (i, _, _) in enumerate(step.checks) if i == self.grad_arg), None)
        self.calls: list[tuple[list[int], array]] = []
        self.grad_slots: list[tuple[array, int, int]] = []  # (a call's table, the slot of a grad pointer, row)
        for members in same_scalar_states(self.rows, step.shared_states):
            table = array("q")
            for r in members:
                if grad_slot is not None:
                    self.grad_slots.append((table, len(table) + 1 + grad_slot, r))
                table.append(self.sizes[r])
                table.extend(self.pointers[r])
            self.calls.append((members, table))
        self.scalar_tensors = [self.rows[r][k] for r in range(len(self.rows)) for k in step.scalar_states]
        self.versions = self._versions()

    def _versions(self) -> list[int]:
        """In-place writes to the scalar states since our own (someone reset a step count)."""
        return [t._version for t in self.scalar_tensors]

    def _bind_grads(self, copies: list[torch.Tensor]) -> None:
        """Point every table at its rows' current grads, checked; strided ones through fresh copies."""
        rows, gi, dtype, sizes = self.rows, self.grad_arg, self.grad_dtype, self.sizes
        for table, slot, r in self.grad_slots:
            grad = rows[r][gi]
            check_grad(grad, dtype, sizes[r], r)
            if not grad.is_contiguous():
                grad = grad.contiguous()
                copies.append(grad)
            table[slot] = grad.data_ptr()

    def run(self) -> None:
        step = self.step
        if step.scalar_states and self._versions() != self.versions:
            self._build()  # the step counts were changed from outside: group the rows again
        copies: list[torch.Tensor] = []  # this run's contiguous copies of strided grads: freed on return
        self._bind_grads(copies)
        for members, table in self.calls:
            first = self.rows[members[0]]
            others = advance_counters(self.rows, members[1:], step.counters) if step.counter_slots else []
            outputs = step.prologue(*(first[i] for i in step.prologue_args))
            if len(members) > 1 and step.shared_states:
                for k in step.shared_states:
                    torch._foreach_copy_([self.rows[r][k] for r in members[1:]], [first[k]] * (len(members) - 1))
            row = [float(outputs[j] if kind == "pro" else first[j]) for kind, j in step.scalar_sources]
            scalars = array("d", row * (len(members) - len(others)))  # per row; others' counters their own
            slots = step.counter_slots
            for before in others:
                scalars.extend(before[slots[k]] if k in slots else x for k, x in enumerate(row))
            scalars_addr = scalars.buffer_info()[0] if scalars else None
            status = step.kernel(len(members), table.buffer_info()[0], scalars_addr, torch.get_num_threads())
            if status:
                raise MemoryError("lowbit-compile CPU kernel could not allocate its block buffers")
        if step.scalar_states:
            self.versions = self._versions()


def lower_cpu(step: GraphModule) -> Callable[[], CpuStep]:
    """The split, rewritten step as one compiled C++ kernel: emitted now (``LoweringError`` for an op no
    printer covers, ``BuildError`` without a C++ compiler), compiled in the background; calling the
    result waits for the compiler (``BuildError`` if it failed) and gives the kernel. A step without
    quantized states takes torch's own square root and true divisions, so it is bit for bit stock; with
    quantized states the kernel takes the SIMD square root and multiplies by the reciprocal of a scalar
    divisor, each within one fp32 rounding of torch's."""
    stock = not any(n.target is torch.ops.lowbit.dequantize.default for n in step.body.graph.nodes)
    emitted = emit_step(step.body, Target("cpu", torch_sqrt=stock, reciprocal_divisor=not stock))
    cpu_build.compiler()
    building = cpu_build.load_async(emitted.full_source)

    def built() -> CpuStep:
        lib = building.result()
        if emitted.mkl_sqrt:
            vsqrt = _torch_vsqrt()
            if vsqrt is not None:
                lib.lowbit_set_vsqrt(ctypes.c_void_p(vsqrt))
        kernel = getattr(lib, ENTRY)
        kernel.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        kernel.restype = ctypes.c_int
        return CpuStep(step, emitted, kernel)

    return built


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
