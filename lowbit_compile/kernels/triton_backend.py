"""The Triton backend: compile the printed kernel of a step and launch it per parameter, plus
standalone quantize/dequantize kernels of one state.

A per-parameter launch goes through a ``torch.library`` custom op (``lowbit::fused_step``,
``lowbit::quantize_triton``, ``lowbit::dequantize_triton``) with a fake implementation, so a graph
captured by ``torch.compile`` holds an opaque call it can run; each call of a batched launch (many
parameters' full tiles, or their partial last tiles, in one kernel call) runs in a
``lowbit::fused_step_batched`` profiler range. Either way every kernel call
shows by name in the profiler. On CUDA the kernels are compiled; CPU tensors run only under
``TRITON_INTERPRET=1`` (set before the first kernel is built: ``triton.jit`` reads it when it
decorates), which the tests use.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import linecache
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
from torch.fx import GraphModule
from triton.runtime.interpreter import InterpretedFunction

from ..formats import StateFormat, blockquant, element_format
from ..ir.contract import Role, role_of
from . import triton_cache
from .kernel import (
    BuildError,
    RowLaunch,
    advance_counters,
    body_sources,
    check_grad,
    per_step_inputs,
    same_scalar_states,
    step_counters,
)
from .lowering import Target
from .triton_env import interpreting
from .triton_printer import WARP_TILE, EmittedKernel, KernelParam, dequantize_graph, emit_kernel, quantize_graph


def target_of(device: torch.device) -> Target:
    """Whose arithmetic a kernel for ``device`` reproduces: CUDA's, or (interpreted on CPU tensors)
    eager CPU's, so the interpreter tests compare with the reference on the same machine; and its
    FP8 path (:func:`fp8_native_for`)."""
    return Target("cuda" if device.type == "cuda" else "cpu", fp8_native=fp8_native_for(device))


# Launch tuning, for benchmarks: None picks num_warps from the tile size.
LAUNCH_OPTIONS: dict[str, int | None] = {"num_warps": None}

FP8_NATIVE_ARCH = 89  # the first CUDA compute capability with fp8 conversion instructions (Ada, then Hopper)
# The FP8 path of kernels emitted from now on, for tests and bench/gpu_check.py: None picks it from the device.
FP8_PATH: dict[str, bool | None] = {"native": None}


def fp8_native_for(device: torch.device) -> bool:
    """Whether kernels for ``device`` hold fp8 codes as float8 and convert them with the GPU's cvt
    instructions (sm_89 and later), or as uint8 bits with integer operations (earlier GPUs). The
    interpreter runs both; CPU tensors take the native path unless ``FP8_PATH`` says otherwise."""
    forced = FP8_PATH["native"]
    if forced is not None:
        return forced
    return _cuda_arch(device) >= FP8_NATIVE_ARCH if device.type == "cuda" else True


@functools.cache
def _cuda_arch(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


class TritonKernel:
    """One emitted kernel, compiled (or interpreted), bound to the tensors and numbers of its inputs.

    Custom ops take tensors and numbers in separate lists, so inputs travel as ``written`` tensors
    (the kernel stores into them), ``read`` tensors and ``numbers``, each in kernel-parameter order.
    """

    def __init__(self, emitted: EmittedKernel) -> None:
        self.emitted = emitted
        self.key = kernel_key(emitted)
        self.interpreted = interpreting()
        self.fn = _compile(emitted.source, emitted.name, self.key)
        # fp8 codes on the integer path: the kernel reads and writes their bytes
        self.byte_inputs = frozenset(p.index for p in emitted.params if p.kind == "input" and p.dtype == torch.uint8)

    def build(self, device: torch.device) -> None:
        """Compile for ``device`` now, not at the first launch (which comes after the step's prologue
        has advanced its counters); interpreted kernels need no compiling."""
        if self.interpreted or device.type != "cuda":
            return
        e = self.emitted
        args = [p.dtype if p.dtype is not None else 1.0 for p in e.params
                if not (e.batched and p in e.tensor_params)]  # a batched kernel reads those from its row table
        def warmup() -> None:
            if e.batched:  # both variants, after the int64 row table and the int32 program table
                for masked in (False, True):
                    self.fn.warmup(*args, torch.int64, torch.int32, **e.constexprs(masked), grid=(1,),
                                   **launch_options(e))
            else:
                self.fn.warmup(*args, 1 << 20, 0, **e.constexprs(), grid=(1,), **launch_options(e))

        try:
            triton_cache.compiling(warmup)  # a cache Triton cannot write is replaced by a private one
        except Exception as err:  # triton's compile errors have no common base class
            raise BuildError(f"compiling the Triton kernel {e.name} for {device} failed: {err}") from err

    def split(self, inputs: Sequence[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
        """The body inputs ``inputs`` (in graph order) as the op's (written, read, numbers) lists."""
        lists: dict[str, list] = {"written": [], "read": [], "numbers": []}
        for p in self.emitted.params:
            if p.kind == "input":
                value = inputs[p.index]
                lists[self._list_of(p)].append(value if p.tensor else float(value))
        return lists["written"], lists["read"], lists["numbers"]

    def launch(self, written: Sequence[torch.Tensor], read: Sequence[torch.Tensor], numbers: Sequence[float],
               first_block: int = 0) -> None:
        """Run the kernel over quantization blocks ``first_block, first_block + 1, ...`` to the end."""
        e = self.emitted
        lists = {"written": iter(written), "read": iter(read), "numbers": iter(numbers)}
        values = {p.index: next(lists[self._list_of(p)]) for p in e.params if p.kind == "input"}
        anchor = values[e.numel_input]
        device = anchor.device
        if device.type != "cuda" and not self.interpreted:
            raise RuntimeError(
                f"the triton backend runs {device.type} tensors only under TRITON_INTERPRET=1, set before the "
                "first kernel is built; use backend='reference' or 'auto' on this device"
            )
        args: list[Any] = []
        for p in e.params:
            if p.kind == "table":
                args.append(_table(p.table, p.nonneg, device))
                continue
            value = values[p.index]
            if isinstance(value, torch.Tensor) and value.device != device:
                value = value.to(device, non_blocking=True)  # a 0-d hyperparameter kept on the host
            if p.index in self.byte_inputs and value.dtype != torch.uint8:
                value = value.view(torch.uint8)
            args.append(value)
        n = anchor.numel()
        blocks = triton.cdiv(n, e.block) - first_block
        if blocks <= 0:
            return
        self.fn[(triton.cdiv(blocks, e.rows),)](*args, n, first_block, **e.constexprs(), **launch_options(e))

    def _list_of(self, p: KernelParam) -> str:
        if not p.tensor:
            return "numbers"
        return "written" if p.index in self.emitted.written else "read"


_POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int8: "*i8",
                  torch.uint8: "*u8", torch.int16: "*i16", torch.int32: "*i32", torch.float8_e4m3fn: "*fp8e4nv",
                  torch.float8_e5m2: "*fp8e5"}
_NUMBER_TYPE = _POINTER_TYPES[torch.float32].removeprefix("*")  # a number argument: an fp32


def _warps(e: EmittedKernel) -> int:
    tile = e.block * e.rows
    if e.approximate:  # 8 elements per thread, at most 16 warps (bench/gpu_cost.py)
        return min(16, max(1, tile // WARP_TILE))
    return 4 if tile <= 1024 else 8 if tile <= 4096 else 16


def launch_options(e: EmittedKernel) -> dict[str, Any]:
    """The compile options of ``e``'s launches (and of its offline builds): warps per program, and fp
    contraction only in kernels of 8-bit states (bit-identical kernels write every fma eager ATen uses)."""
    return {"num_warps": LAUNCH_OPTIONS["num_warps"] or _warps(e), "enable_fp_fusion": e.approximate}


def compile_for_target(graph: GraphModule, arch: int = 90, fp8_native: bool | None = None,
                       name: str = "lowbit_step", batched: bool = False, masked: bool = False):
    """Emit the CUDA kernel of ``graph`` (a split step's body, or a standalone state graph) as a GPU of
    compute capability ``arch`` would run it, FP8 path included (``fp8_native`` forces one), per tensor or
    ``batched`` (a step's launch over many tensors: its full-tile variant, or with ``masked`` its last-tile
    one), and compile it without a GPU (Triton's bundled ptxas): GPU-only compile errors show on any
    machine. Not available under the interpreter."""
    native = arch >= FP8_NATIVE_ARCH if fp8_native is None else fp8_native
    emitted = emit_kernel(graph, name, Target("cuda", fp8_native=native), batched=batched)
    return compile_emitted(emitted, arch, masked=masked)


def compile_emitted(emitted: EmittedKernel, arch: int = 90, aligned: bool = False, masked: bool = False):
    """Compile ``emitted`` for a GPU of compute capability ``arch`` with the options its launches use,
    without a GPU: the compiled kernel (its ``asm`` holds the PTX and the cubin). ``aligned``: as Triton
    specializes a launch whose pointers and integers are multiples of 16 (a large tensor's), else for
    any arguments. ``masked``: a batched kernel's last-tile variant (:meth:`EmittedKernel.constexprs`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if interpreting():
        raise RuntimeError("compiling for a target needs TRITON_INTERPRET unset: it builds real Triton kernels")
    params = [p for p in emitted.params if not (emitted.batched and p in emitted.tensor_params)]
    signature = {p.name: _POINTER_TYPES[p.dtype] if p.dtype is not None else _NUMBER_TYPE for p in params}
    if emitted.batched:  # the tensors' pointers are read from the row table (BatchedLaunch's int64/int32 tables)
        signature.update(row_table_ptr="*i64", program_rows_ptr="*i32", BLOCK="constexpr", ROWS="constexpr",
                         MASKED="constexpr")
    else:
        signature.update(n_elements="i64", first_block="i64", BLOCK="constexpr", ROWS="constexpr")
    fn = _compile(emitted.source, emitted.name, kernel_key(emitted))
    attrs = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values())
             if aligned and (kind.startswith("*") or kind == "i64")}
    source = ASTSource(fn, signature, constexprs=emitted.constexprs(masked), attrs=attrs)
    return triton_cache.compiling(
        lambda: triton.compile(source, target=GPUTarget("cuda", arch, 32), options=launch_options(emitted)))


def kernel_key(emitted: EmittedKernel) -> str:
    """A process-wide name for ``emitted`` built in the current mode (compiled or interpreted)."""
    digest = hashlib.sha256(emitted.source.encode()).hexdigest()[:16]
    return f"{emitted.name}_{digest}{'_interpreted' if interpreting() else ''}"


def _compile(source: str, name: str, key: str) -> Callable:
    """Exec the generated module, registered with linecache so ``triton.jit`` can read its source."""
    from . import triton_lib  # first imported here, so that TRITON_INTERPRET is read when kernels are built

    if interpreting():
        _interpreter_fma_rounds_once()
    if isinstance(triton_lib.rne, InterpretedFunction) != interpreting():
        raise RuntimeError(
            "TRITON_INTERPRET changed after the first lowbit-compile Triton kernel was built; set it once, "
            "before the first step (triton.jit reads it when it decorates)"
        )
    filename = f"<lowbit-triton-{key}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict[str, Any] = {"__name__": f"lowbit_triton_{key}"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


@functools.cache
def _table(name: str, nonneg: bool, device: torch.device) -> torch.Tensor:
    """The lookup table of format ``name`` (``ElementFormat.lookup_table``) on ``device``."""
    return element_format(name).lookup_table(nonneg).to(device)


_KERNELS: dict[str, TritonKernel] = {}


def kernel_for(emitted: EmittedKernel) -> TritonKernel:
    """The process-wide kernel of ``emitted`` (compiled once per source)."""
    key = kernel_key(emitted)
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = TritonKernel(emitted)
    return kernel


_LIBRARY = torch.library.Library("lowbit", "FRAGMENT")


def _define_launch_op(name: str) -> Callable[..., None]:
    """``lowbit::<name>(kernel, written, read, numbers)``: launch the registered kernel ``kernel``.

    Defined with a plain ``Library`` kernel rather than ``custom_op``: its Python dispatch costs
    about a tenth (tens of microseconds, against a launch per parameter per step)."""
    _LIBRARY.define(f"{name}(str kernel, Tensor(a!)[] written, Tensor[] read, float[] numbers) -> ()")

    def launch(kernel: str, written: list[torch.Tensor], read: list[torch.Tensor], numbers: list[float]) -> None:
        _KERNELS[kernel].launch(written, read, numbers)

    _LIBRARY.impl(name, launch, "CompositeExplicitAutograd")
    torch.library.register_fake(f"lowbit::{name}", lambda kernel, written, read, numbers: None, lib=_LIBRARY)
    return getattr(torch.ops.lowbit, name).default


fused_step_op = _define_launch_op("fused_step")  # one parameter's fused optimizer step
quantize_op = _define_launch_op("quantize_triton")  # one state into its storage
dequantize_op = _define_launch_op("dequantize_triton")  # one state into a dense tensor


# the step lowering ---------------------------------------------------------------------------------
class FusedStepBody(torch.nn.Module):
    """Stands in for the ``body`` child of a split step: launches its kernel through
    ``lowbit::fused_step``."""

    def __init__(self, kernel: TritonKernel) -> None:
        super().__init__()
        self.kernel = kernel

    def forward(self, *inputs: Any) -> None:
        fused_step_op(self.kernel.key, *self.kernel.split(inputs))


class TritonStep:
    """A split step whose body is one Triton kernel, emitted and built when this is made; the scalar
    prologue runs on the host, as in the reference. A launch steps all its rows in two kernel calls per
    set of rows with equal scalar states, full tiles and partial last tiles (:class:`BatchedLaunch`), or
    one call per row where a row's storage is not 16-byte aligned."""

    backend = "triton"

    def __init__(self, step: GraphModule, device: torch.device) -> None:
        if device.type != "cuda" and not interpreting():
            raise BuildError(
                f"the triton backend runs {device.type} tensors only under TRITON_INTERPRET=1, set before the "
                "first kernel is built; use backend='cpu' or 'auto' for CPU tensors"
            )
        target = target_of(device)
        kernel = kernel_for(emit_kernel(step.body, "lowbit_step", target))
        kernel.build(device)
        self.batched = kernel_for(emit_kernel(step.body, "lowbit_step_batched", target, batched=True))
        self.batched.build(device)
        root = torch.nn.Module()
        root.prologue = step.prologue
        root.body = FusedStepBody(kernel)
        self.kernel = kernel
        self.graph = GraphModule(root, copy.deepcopy(step.graph), "FusedStep")
        self.flat = per_step_inputs(step)
        self.prologue = step.prologue.forward
        self.prologue_args, self.sources = body_sources(step)
        top = [n for n in step.graph.nodes if n.op == "placeholder"]
        roles = [role_of(n) for n in top]
        self.scalar_states = tuple(i for i, r in enumerate(roles) if r is Role.SCALAR_STATE)
        self.counters, self.counter_reads = step_counters(step)
        self.shared_states = tuple(k for k in self.scalar_states if k not in self.counters)  # one value per call
        self.param_arg = roles.index(Role.PARAM)
        self.grad_arg = roles.index(Role.GRAD) if Role.GRAD in roles else None
        bound = (Role.PARAM, Role.PER_ELEMENT_STATE, Role.STATE_PART, Role.MASTER_PART)
        # body inputs bound for as long as the rows (the param's storage is checked by the caller)
        self.bound_inputs = frozenset(k for k, (kind, i) in enumerate(self.sources)
                                      if kind == "arg" and roles[i] in bound)
        self.launches = 0  # kernel calls, for tests

    def launch(self, rows: Sequence[list]) -> BatchedLaunch | RowLaunch:
        if all(t.data_ptr() % 16 == 0 for row in rows for t in self._bound(row)):
            return BatchedLaunch(self, rows)
        return RowLaunch(self._run, rows, self.flat)

    def _bound(self, row: Sequence[object]) -> list[torch.Tensor]:
        return [row[self.sources[p.index][1]] for p in self.batched.emitted.tensor_params
                if p.index in self.bound_inputs]

    def _run(self, rows: Sequence[list]) -> None:
        for row in rows:
            self.graph(*row)
            self.launches += 1


class BatchedLaunch:
    """Kernel calls over fixed rows, kept between steps: per set of rows with equal scalar states (but for
    their stochastic-rounding counters, which each row's table entry points to), one call
    of the batched kernel's full-tile variant over a 1-D grid of all their whole tiles, and one of its
    masked variant over their partial last tiles (where any row has one). Each set's row table (first
    program, element count and the tensor inputs' pointers per row) and program-to-row tables are built
    once; :meth:`run` rewrites the per-step pointers (grads, tensor hyperparameters and prologue results)
    and uploads the row table only when a pointer changed. Like ``CpuLaunch``, the prologue runs once per
    set on its first row and the other rows' scalar states are set to its result, but for their counters,
    which advance on their own. No grad (nor a copy
    of one) is referenced once :meth:`run` returns: the tables hold integers."""

    def __init__(self, step: TritonStep, rows: Sequence[list]) -> None:
        self.step = step
        self.rows = rows
        e = step.batched.emitted
        self.device = rows[0][step.param_arg].device
        self.sizes = [row[step.param_arg].numel() for row in rows]
        tensor_params = e.tensor_params
        self.stride = 2 + len(tensor_params)
        self.static = [(k, p) for k, p in enumerate(tensor_params) if p.index in step.bound_inputs]
        self.per_step = [(k, p) for k, p in enumerate(tensor_params) if p.index not in step.bound_inputs]
        for row in rows:
            for t in step._bound(row):
                if not t.is_contiguous():
                    raise ValueError("a state bound to a batched launch must be contiguous (it is bound by pointer)")
        self._build()

    def _build(self) -> None:
        step, e = self.step, self.step.batched.emitted
        tile = e.block * e.rows
        # (members, host row table, device row table, [(masked, device program rows, programs)])
        self.calls = []
        for members in same_scalar_states(self.rows, step.shared_states):
            table, full_rows, last_rows = [], [], []
            for j, r in enumerate(members):
                entry = [len(full_rows), self.sizes[r]] + [0] * (self.stride - 2)
                bound = {p.index: t for p, t in zip((p for _, p in self.static), step._bound(self.rows[r]))}
                for k, p in self.static:
                    entry[2 + k] = bound[p.index].data_ptr()
                table += entry
                full_rows += [j] * (self.sizes[r] // tile)
                last_rows += [j] * (self.sizes[r] % tile != 0)
            grids = [(masked, torch.tensor(programs, dtype=torch.int32).to(self.device), len(programs))
                     for masked, programs in ((False, full_rows), (True, last_rows)) if programs]
            self.calls.append([members, table, None, grids])
        self.scalar_tensors = [self.rows[r][k] for r in range(len(self.rows)) for k in step.scalar_states]
        self.versions = [t._version for t in self.scalar_tensors]

    def run(self) -> None:
        step = self.step
        e = step.batched.emitted
        if step.scalar_states and [t._version for t in self.scalar_tensors] != self.versions:
            self._build()  # the step counts were changed from outside: group the rows again
        keep: list[torch.Tensor] = []  # this run's copies (strided or unaligned grads, host hyperparameters)
        for call in self.calls:
            members, table, _, grids = call
            first = self.rows[members[0]]
            others = advance_counters(self.rows, members[1:], step.counters) if step.counter_reads else []
            outputs = step.prologue(*(first[i] for i in step.prologue_args))
            if len(members) > 1 and step.shared_states:
                for k in step.shared_states:
                    torch._foreach_copy_([self.rows[r][k] for r in members[1:]], [first[k]] * (len(members) - 1))
            # the other rows' counters from before the step, one 16-byte row each (the kernel's pointer alignment)
            own = {j: self._per_step_tensor(torch.tensor([[b[c], 0, 0, 0] for b in others], dtype=torch.float32),
                                            -1, members[0], "counter", keep)
                   for j, c in step.counter_reads.items()} if others else {}
            new = list(table)
            for j, r in enumerate(members):
                row = self.rows[r]
                for k, p in self.per_step:
                    kind, i = step.sources[p.index]
                    if j and kind == "pro" and i in own:
                        new[j * self.stride + 2 + k] = own[i].data_ptr() + 16 * (j - 1)
                        continue
                    value = self._per_step_tensor(outputs[i] if kind == "pro" else row[i], i, r, kind, keep)
                    new[j * self.stride + 2 + k] = value.data_ptr()
            if new != table or call[2] is None:
                call[1], call[2] = new, torch.tensor(new, dtype=torch.int64).to(self.device)
            args: list[Any] = []
            for p in e.params:
                if p.kind == "table":
                    args.append(_table(p.table, p.nonneg, self.device))
                elif not p.tensor:
                    kind, i = step.sources[p.index]
                    args.append(float(outputs[i] if kind == "pro" else first[i]))
            for masked, program_rows, programs in grids:
                with torch.profiler.record_function("lowbit::fused_step_batched"):
                    step.batched.fn[(programs,)](*args, call[2], program_rows, **e.constexprs(masked),
                                                 **launch_options(e))
                step.launches += 1
        if step.scalar_states:
            self.versions = [t._version for t in self.scalar_tensors]

    def _per_step_tensor(self, value: Any, i: int, r: int, kind: str, keep: list[torch.Tensor]) -> torch.Tensor:
        """A per-step tensor input on the launch's device, flat, contiguous and 16-byte aligned (through a
        copy kept for this run where it is not); a grad checked against its param."""
        if kind == "arg" and i == self.step.grad_arg:
            check_grad(value, self.rows[r][self.step.param_arg].dtype, self.sizes[r], r)
            value = value.reshape(-1)
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(value, dtype=torch.float32)
        if value.device != self.device:
            value = value.to(self.device)
        if not value.is_contiguous() or value.data_ptr() % 16:  # a clone is a fresh, aligned allocation
            value = value.clone(memory_format=torch.contiguous_format)
        keep.append(value)
        return value


# standalone state kernels --------------------------------------------------------------------------
@functools.cache
def _state_kernel(kind: str, fmt: StateFormat, dtype: torch.dtype, target: Target) -> TritonKernel:
    graph = quantize_graph(fmt, dtype) if kind == "quantize" else dequantize_graph(fmt, dtype)
    return kernel_for(emit_kernel(graph, f"lowbit_{kind}", target))


def quantize_into(x: torch.Tensor, out: blockquant.Quantized, fmt: StateFormat) -> None:
    """``blockquant.quantize_into`` with a Triton kernel: ``x`` (any float dtype, any shape) into ``out``."""
    flat = x.reshape(-1)
    kernel = _state_kernel("quantize", fmt, flat.dtype, target_of(flat.device))
    quantize_op(kernel.key, *kernel.split((flat, *out)))


def dequantize(q: blockquant.Quantized, fmt: StateFormat, dtype: torch.dtype = torch.float32,
               numel: int | None = None) -> torch.Tensor:
    """``blockquant.dequantize`` with a Triton kernel: the flat values of ``q`` as a new ``dtype`` tensor;
    ``numel``: their count, which a 4-bit format's codes (two a byte) do not say."""
    if fmt.packed and numel is None:
        raise ValueError(f"dequantize of a {fmt.name} state needs numel: its codes, two a byte, do not say the count")
    out = torch.empty(q.codes.numel() if numel is None else numel, dtype=dtype, device=q.codes.device)
    kernel = _state_kernel("dequantize", fmt, dtype, target_of(out.device))
    dequantize_op(kernel.key, *kernel.split((*q, out)))
    return out


def _fma_fp32(x: Any, y: Any, z: Any) -> Any:
    """fp32 ``x * y + z`` of numpy arrays rounded once: the product is exact in float64, the sum rounded
    to odd there (53 bits, more than fp32's 24 + 2), so the one rounding to fp32 is the fma's."""
    import numpy as np

    p = x.astype(np.float64) * y.astype(np.float64)
    zz = z.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + zz
        t = s - p
        err = (p - (s - t)) + (zz - t)  # the exact error of s (TwoSum)
    bits = s.view(np.int64)
    inexact = np.isfinite(err) & (err != 0) & ((bits & 1) == 0)
    bits = np.where(inexact, bits + np.where((err > 0) == (s > 0), 1, -1), bits)
    return bits.view(np.float64).astype(np.float32)


@functools.cache
def _interpreter_fma_rounds_once() -> None:
    """The interpreter of Triton < 3.9 computes ``tl.fma`` as a multiply and an add, rounding twice; the
    kernels' fma is the GPU's, rounded once, so the interpreter gets that one. Decided by what the
    interpreter computes: (1 + 2**-12)**2 - 1 is 2**-11 + 2**-24 rounded once, 2**-11 rounded twice."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    one = lambda v: interpreter.TensorHandle(np.array([v], dtype=np.float32), tl.float32)  # noqa: E731
    x = np.float32(1 + 2**-12)
    if builder.create_fma(object.__new__(builder), one(x), one(x), one(-1.0)).data[0] == 2**-11 + 2**-24:
        return
    plain = builder.create_fma

    def create_fma(self, x, y, z):
        if z.data.dtype != np.float32:
            return plain(self, x, y, z)
        return interpreter.TensorHandle(_fma_fp32(*np.broadcast_arrays(x.data, y.data, z.data)), z.dtype.scalar)

    builder.create_fma = create_fma
