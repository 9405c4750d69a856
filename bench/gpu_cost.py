"""Offline GPU cost model of the Triton step kernels (issue 35), no GPU needed.

Compiles every step kernel users get (each format with fp32 and bf16 params, master weights exact and
8bit, stochastic rounding, patches, and the standalone state kernels) for sm_90 and sm_80 with Triton's
bundled ptxas, and reports per kernel: registers per thread, spill (local memory) bytes, shared memory,
SASS instructions per element (the cubin's instructions, ``cuobjdump -sass``, over the elements one
thread handles), the occupancy registers, shared memory and warps allow, and the bytes per element the
kernel must move; for a step, also the two variants of its batched kernel (what aligned tensors get: one
launch over many tensors' whole tiles, one over their partial last tiles): registers, occupancy and SASS
per element of each. Beside them the same for ``floor_adamw8``, a plain blockwise 8-bit AdamW kernel
(the GPU's floor, the counterpart of the CPU memory floor), and ``floor_adamw4``, its 4-bit twin, which
a 4-bit format's kernels are measured against. ``python -m bench.gpu_cost [--arch 90 80]``: prints a
table, writes ``bench/results/gpu_cost.json`` (``--out`` another path). Run with ``TRITON_INTERPRET``
unset.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# per-SM limits: registers, warps, blocks, shared memory (bytes usable per SM; 1 KiB reserved per block)
SM_LIMITS = {90: (65536, 64, 32, 228 * 1024), 80: (65536, 64, 32, 164 * 1024)}
FLOOR_BLOCK, FLOOR_ROWS, FLOOR_WARPS = 512, 2, 4  # the H200 run's floor kernel launch
# the 4-bit floor: blocks of 128 (sqrt4's), in the 8-bit floor's tile of 1024 elements on 4 warps
FLOOR4_BLOCK, FLOOR4_ROWS = 128, 8


@triton.jit
def floor_adam(p, g, mc, vc, ms_ptr, vs_ptr, rows, row_mask, lr, beta1, beta2, eps, decay, bc1, bc2_root):
    """The floors' update: m and v from their roots' codes (``mc``, ``vc`` as fp32) and per-row scales, then
    AdamW (approximate square root and division); the new p, m and v."""
    m = mc * tl.abs(mc) * tl.load(ms_ptr + rows, mask=row_mask, other=0.0)[:, None]
    v = vc * vc * tl.load(vs_ptr + rows, mask=row_mask, other=0.0)[:, None]
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    return p * decay - lr * (m / bc1) / (tl.sqrt(v) / bc2_root + eps), m, v


@triton.jit
def floor_roots(m, v, ms_ptr, vs_ptr, rows, row_mask, M_QMAX: tl.constexpr, V_QMAX: tl.constexpr):
    """The floors' encode: per-row scales (absmax over the largest code's square) stored, and the new codes'
    roots (rounded half to even; m's magnitude, its sign left to the caller)."""
    m_scale = tl.max(tl.abs(m), axis=1) / M_QMAX
    v_scale = tl.max(v, axis=1) / V_QMAX
    tl.store(ms_ptr + rows, m_scale, mask=row_mask)
    tl.store(vs_ptr + rows, v_scale, mask=row_mask)
    m_root = (tl.sqrt(tl.abs(m) / tl.maximum(m_scale, 1e-38)[:, None]) + 12582912.0) - 12582912.0
    v_root = (tl.sqrt(v / tl.maximum(v_scale, 1e-38)[:, None]) + 12582912.0) - 12582912.0
    return m_root, v_root


@triton.jit
def floor_adamw8(p_ptr, g_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, n, lr, beta1, beta2, eps, decay, bc1, bc2_root,
                 BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """AdamW on fp32 params with sqrt-companded 8-bit m (int8) and v (uint8) codes and an fp32 absmax
    scale per BLOCK, approximate square root and division: the least a blockwise 8-bit step does."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offsets = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offsets < n
    p = tl.load(p_ptr + offsets, mask=mask, other=0.0)
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0)
    mc = tl.load(m_ptr + offsets, mask=mask, other=0).to(tl.float32)
    vc = tl.load(v_ptr + offsets, mask=mask, other=0).to(tl.float32)
    row_mask = rows * BLOCK < n
    p, m, v = floor_adam(p, g, mc, vc, ms_ptr, vs_ptr, rows, row_mask, lr, beta1, beta2, eps, decay, bc1, bc2_root)
    tl.store(p_ptr + offsets, p, mask=mask)
    m_root, v_root = floor_roots(m, v, ms_ptr, vs_ptr, rows, row_mask, 16129.0, 65025.0)  # 127^2, 255^2
    tl.store(m_ptr + offsets, tl.where(m < 0, -m_root, m_root).to(tl.int8), mask=mask)
    tl.store(v_ptr + offsets, v_root.to(tl.uint8), mask=mask)


@triton.jit
def floor_adamw4(p_ptr, g_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, n, lr, beta1, beta2, eps, decay, bc1, bc2_root,
                 BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """:func:`floor_adamw8` with 4-bit codes, two a byte (element 2i in the low nibble of byte i): m's
    roots -7..7 (sign-extended), v's 0..15: the least a blockwise 4-bit step does."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offsets = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offsets < n
    pairs = rows[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
    pair_mask = pairs * 2 < n
    p = tl.load(p_ptr + offsets, mask=mask, other=0.0)
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0)
    mb = tl.load(m_ptr + pairs, mask=pair_mask, other=0)
    vb = tl.load(v_ptr + pairs, mask=pair_mask, other=0)
    mc = tl.reshape(tl.join((mb << 4) >> 4, mb >> 4), (ROWS, BLOCK)).to(tl.float32)
    vc = tl.reshape(tl.join(vb & 15, vb >> 4), (ROWS, BLOCK)).to(tl.float32)
    row_mask = rows * BLOCK < n
    p, m, v = floor_adam(p, g, mc, vc, ms_ptr, vs_ptr, rows, row_mask, lr, beta1, beta2, eps, decay, bc1, bc2_root)
    tl.store(p_ptr + offsets, p, mask=mask)
    m_root, v_root = floor_roots(m, v, ms_ptr, vs_ptr, rows, row_mask, 49.0, 225.0)  # 7^2, 15^2
    m_lo, m_hi = tl.split(tl.reshape(tl.where(m < 0, -m_root, m_root).to(tl.int8), (ROWS, BLOCK // 2, 2)))
    v_lo, v_hi = tl.split(tl.reshape(v_root.to(tl.uint8), (ROWS, BLOCK // 2, 2)))
    tl.store(m_ptr + pairs, (m_lo & 15) | (m_hi << 4), mask=pair_mask)
    tl.store(v_ptr + pairs, v_lo | (v_hi << 4), mask=pair_mask)


@dataclass(frozen=True)
class Case:
    """One kernel users get: a step of ``opt`` (AdamW unless named) or a standalone state kernel."""

    name: str
    fmt: str = "sqrt8"
    dtype: torch.dtype = torch.float32
    master: str | None = None
    rounding: str | tuple[tuple[str, str], ...] = "auto"  # the default; per state as pairs (a Case is hashed)
    outliers: int = 0
    state_kernel: str | None = None  # "quantize" / "dequantize"


def cases() -> list[Case]:
    out = []
    for fmt in ("sqrt8", "int8", "dynamic8", "fp8_e4m3", "fp8_e5m2", "bf16", "fp32", "sqrt4"):
        for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            out.append(Case(f"step {fmt} {tag}-params", fmt, dtype))
    out += [Case("step sqrt8 bf16-params master exact", dtype=torch.bfloat16, master="exact"),
            Case("step sqrt8 bf16-params master 8bit", dtype=torch.bfloat16, master="8bit"),
            Case("step sqrt8 fp32-params stochastic", rounding="stochastic"),
            Case("step sqrt8 bf16-params stochastic", dtype=torch.bfloat16, rounding="stochastic"),
            *(Case(f"step {fmt} fp32-params nearest", fmt, rounding="nearest")
              for fmt in ("sqrt8", "int8", "dynamic8", "fp8_e4m3", "sqrt4")),
            Case("step sqrt8 fp32-params 2 patches", outliers=2)]
    for fmt in ("sqrt8", "int8", "dynamic8", "fp8_e4m3", "fp8_e5m2", "sqrt4"):
        for kind in ("quantize", "dequantize"):
            out.append(Case(f"{kind} {fmt} fp32", fmt, state_kernel=kind))
    return out


@functools.cache
def step_body(case: Case) -> torch.fx.GraphModule:
    """The body of the split step ``lowbit_compile`` builds for this case (traced on the CPU)."""
    from lowbit_compile import lowbit_compile
    from lowbit_compile.runtime import compile as compile_module

    captured = []
    original = compile_module.lower

    def capture(graph, backend, device):
        captured.append(graph)
        return original(graph, backend, device)

    param = torch.nn.Parameter(torch.randn(4096, dtype=case.dtype))
    opt = lowbit_compile(torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01), fmt=case.fmt,
                         outliers=case.outliers, min_8bit_size=0, backend="reference",
                         master_weights=case.master,
                         rounding=dict(case.rounding) if isinstance(case.rounding, tuple) else case.rounding)
    compile_module.lower = capture
    try:
        param.grad = torch.randn_like(param)
        opt.step()
    finally:
        compile_module.lower = original
    return captured[-1].body


def target_for(arch: int):
    """The lowering target of a GPU of compute capability ``arch`` (its FP8 path included)."""
    from lowbit_compile.kernels.lowering import Target
    from lowbit_compile.kernels.triton_backend import FP8_NATIVE_ARCH

    return Target("cuda", fp8_native=arch >= FP8_NATIVE_ARCH)


def emitted_for(case: Case, arch: int):
    from lowbit_compile.config import own_block_size
    from lowbit_compile.formats import StateFormat
    from lowbit_compile.kernels.triton_printer import dequantize_graph, emit_kernel, quantize_graph

    if case.state_kernel:  # in blocks of 512, or of the format's own default (a 4-bit one's)
        fmt = StateFormat.make(case.fmt, own_block_size(case.fmt), case.outliers, False)
        graph = (quantize_graph if case.state_kernel == "quantize" else dequantize_graph)(fmt, case.dtype)
        name = f"lowbit_{case.state_kernel}"
    else:
        graph, name = step_body(case), "lowbit_step"
    return graph, emit_kernel(graph, name, target_for(arch))


def bytes_per_element(graph: torch.fx.GraphModule, emitted) -> float:
    """What the kernel must read and write per element: per-element tensors at their dtype (read, and
    written where stored; a state kernel only reads its input and only writes its output), block scales
    and patches per block, 0-d tensors and tables nothing; a state's codes at its format's bits (4-bit: half a byte)."""
    from lowbit_compile.ir.contract import state_access

    steps = emitted.name == "lowbit_step"
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    code_bits = {a.parts[0]: a.fmt.bits for a in map(state_access, graph.graph.nodes) if a is not None}
    total = 0.0
    for p in emitted.params:
        if p.kind != "input" or not p.tensor:
            continue
        size = torch.empty(0, dtype=p.dtype).element_size()
        times = 2 if steps and p.index in emitted.written else 1
        if p.name.endswith(("scales_ptr", "patch_values_ptr", "patch_index_ptr")):
            per_block = 1 if p.name.endswith("scales_ptr") else emitted_patches(p.name, emitted)
            total += times * size * per_block / emitted.block
        elif p.name.endswith("ties_ptr"):
            total += times * size / 32  # one bit per element (read and written only at ties: at most this)
        else:  # state codes and master residuals (state parts: no example value), params, grads, stock states
            node = placeholders[p.index]
            val = node.meta.get("val")
            if node in code_bits:
                total += times * code_bits[node] / 8
            elif p.name.endswith(("codes_ptr", "residual_ptr")) or isinstance(val, torch.Tensor) and val.dim() > 0:
                total += times * size
    return total


def emitted_patches(name: str, emitted) -> int:
    match = re.search(rf"{re.escape(name)}, .*?K=(\d+)", emitted.source.replace("\n", " "))
    return int(match.group(1)) if match else 0


def tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def cuobjdump(cubin: bytes, flag: str) -> str:
    """What ``cuobjdump <flag>`` prints of ``cubin``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool("cuobjdump"), flag, f.name], capture_output=True, text=True, check=True).stdout


def resource_usage(cubin: bytes) -> dict:
    """Registers, stack/local (spilled) and shared memory of a cubin (``cuobjdump -res-usage``; any
    architecture, where ``-sass`` no longer disassembles sm_70)."""
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", cuobjdump(cubin, "-res-usage")))
    return {"registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"]), "local_bytes": int(fields["LOCAL"]),
            "cubin_shared": int(fields["SHARED"])}


def cubin_figures(cubin: bytes) -> dict:
    """:func:`resource_usage` and the SASS instruction count."""
    sass = cuobjdump(cubin, "-sass")
    instructions = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/\s+\S", line)]
    # the padding after the final EXIT (BRA to itself, NOPs) is never run
    # and the slow-path subroutines placed after it (div.rn's and sqrt.rn's out-of-range operands) rarely are
    last = max((i for i, line in enumerate(instructions) if re.search(r"\bEXIT\b", line)),
               default=len(instructions) - 1)
    body = instructions[:last + 1]
    return {**resource_usage(cubin), "sass": len(body),
            "sass_branches": sum(bool(re.search(r"\bBRA\b", line)) for line in body)}


def occupancy(arch: int, registers: int, shared: int, warps: int) -> dict:
    """Resident blocks and warps per SM that registers (allocated per warp in 256-register units),
    shared memory and the warp and block limits allow."""
    regs_sm, warps_sm, blocks_sm, smem_sm = SM_LIMITS[arch]
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = (regs_sm // per_warp) // warps if per_warp else blocks_sm
    by_smem = smem_sm // (shared + 1024) if shared else blocks_sm
    blocks = min(by_regs, by_smem, warps_sm // warps, blocks_sm)
    limiter = min((by_regs, "registers"), (by_smem, "shared"), (warps_sm // warps, "warps"), key=lambda t: t[0])[1]
    return {"blocks_per_sm": blocks, "occupancy": blocks * warps / warps_sm, "limited_by": limiter}


_ANY_SET = "    return tl.max(flags.to(tl.int32)) != 0\n"


@functools.cache
def common_path_lib() -> str | None:
    """A copy of ``triton_lib`` whose ``any_set`` is False, imported as a module of that name: kernels
    built on it hold only the path a tile without inf or NaN runs (the static count holds the rare
    fix-ups too, which such a tile branches over)."""
    import linecache
    import sys
    import types

    from lowbit_compile.kernels import triton_lib

    source = inspect.getsource(triton_lib)
    if "def any_set" not in source:
        return None
    assert source.count(_ANY_SET) == 1, "triton_lib.any_set changed: update bench/gpu_cost.py"
    source = source.replace(_ANY_SET, "    return False\n")
    source = source.replace("from ..formats", "from lowbit_compile.formats")
    name = "lowbit_triton_lib_common_path"
    filename = f"<{name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module
    exec(compile(source, filename, "exec"), module.__dict__)
    return name


def floor_bits(case: Case) -> int:
    """The floor a case is measured against: the 4-bit one for a 4-bit format's kernels, else the 8-bit one."""
    from lowbit_compile.formats import element_format

    return 4 if element_format(case.fmt).bits == 4 else 8


def compile_case(case: Case, arch: int) -> dict:
    from lowbit_compile.kernels import triton_backend

    graph, emitted = emitted_for(case, arch)
    options = triton_backend.launch_options(emitted)
    row = {"kernel": case.name, "block": emitted.block, "rows": emitted.rows, **options,
           "elements_per_thread": elements_per_thread(emitted),
           "bytes_per_element": round(bytes_per_element(graph, emitted), 4), **compiled_figures(emitted, arch)}
    # kernels without rare fix-ups (before any_set) run their whole static path
    fig = common_path_figures(emitted, arch) or row
    row["sass_common"] = fig["sass"]
    row["sass_common_per_element"] = fig["sass_per_element"]
    if not case.state_kernel:  # the launch GPU users get for aligned tensors: BatchedLaunch's kernel
        row.update(batched_figures(graph, arch))
    return row


def elements_per_thread(emitted) -> float:
    from lowbit_compile.kernels import triton_backend

    return emitted.block * emitted.rows / (triton_backend.launch_options(emitted)["num_warps"] * 32)


def compiled_figures(emitted, arch: int, masked: bool = False) -> dict:
    """:func:`figures` of ``emitted`` compiled for ``arch`` as a launch on aligned tensors (``masked``: a
    batched kernel's last-tile variant)."""
    from lowbit_compile.kernels import triton_backend

    compiled = triton_backend.compile_emitted(emitted, arch, aligned=True, masked=masked)
    return figures(compiled, arch, triton_backend.launch_options(emitted)["num_warps"], elements_per_thread(emitted))


def common_path_figures(emitted, arch: int, masked: bool = False) -> dict | None:
    """:func:`compiled_figures` of ``emitted`` built on :func:`common_path_lib` (None without one)."""
    lib = common_path_lib()
    if lib is None:
        return None
    lib_import = "from lowbit_compile.kernels import triton_lib as lb"
    common = dataclasses.replace(emitted, source=emitted.source.replace(lib_import, f"import {lib} as lb"))
    return compiled_figures(common, arch, masked)


def spilled(fig: dict) -> bool:
    return fig["local_bytes"] > 0 or fig["stack_bytes"] > 0


def batched_figures(graph: torch.fx.GraphModule, arch: int) -> dict:
    """Registers, spills, occupancy and SASS per element (all of it, and without the rare fix-ups, as
    ``sass_common``) of the batched kernel's two variants: ``batched_*`` the one every whole tile runs,
    ``last_tile_*`` the masked one of each tensor's partial last tile."""
    from lowbit_compile.kernels.triton_printer import emit_kernel

    batched = emit_kernel(graph, "lowbit_step_batched", target_for(arch), batched=True)
    out = {}
    for prefix, masked in (("batched", False), ("last_tile", True)):
        fig = compiled_figures(batched, arch, masked)
        common = common_path_figures(batched, arch, masked) or fig
        out.update({f"{prefix}_registers": fig["registers"], f"{prefix}_spills": fig["spills"],
                    f"{prefix}_occupancy": fig["occupancy"], f"{prefix}_sass_per_element": fig["sass_per_element"],
                    f"{prefix}_common_per_element": common["sass_per_element"]})
    return out


def figures(compiled, arch: int, warps: int, elements: float) -> dict:
    fig = cubin_figures(compiled.asm["cubin"])
    shared = compiled.metadata.shared
    return {**fig, "shared_bytes": shared, "spills": spilled(fig),
            "sass_per_element": round(fig["sass"] / elements, 1), **occupancy(arch, fig["registers"], shared, warps)}


FLOORS = {8: (floor_adamw8, FLOOR_BLOCK, FLOOR_ROWS), 4: (floor_adamw4, FLOOR4_BLOCK, FLOOR4_ROWS)}


def compile_floor(arch: int, bits: int = 8) -> dict:
    """The figures of the floor kernel of ``bits``-bit states (``FLOORS``) for ``arch``."""
    kernel, block, rows = FLOORS[bits]
    signature = {"p_ptr": "*fp32", "g_ptr": "*fp32", "m_ptr": "*i8", "v_ptr": "*u8", "ms_ptr": "*fp32",
                 "vs_ptr": "*fp32", "n": "i64", **{k: "fp32" for k in ("lr", "beta1", "beta2", "eps", "decay", "bc1",
                                                                       "bc2_root")},
                 "BLOCK": "constexpr", "ROWS": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values())
             if kind.startswith("*") or kind == "i64"}
    source = ASTSource(kernel, signature, constexprs={"BLOCK": block, "ROWS": rows}, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": FLOOR_WARPS,
                                                                                    "enable_fp_fusion": True})
    elements = block * rows / (FLOOR_WARPS * 32)
    return {"kernel": f"{kernel.__name__} (bench)", "block": block, "rows": rows, "num_warps": FLOOR_WARPS,
            "num_stages": 3, "enable_fp_fusion": True, "elements_per_thread": elements,
            "bytes_per_element": 4 * 3 + bits / 8 * 4 + 4 * 2 * 2 / block,
            **figures(compiled, arch, FLOOR_WARPS, elements)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], choices=sorted(SM_LIMITS))
    parser.add_argument("--only", default="", help="a regex: compile only the kernels whose name matches")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu_cost.json",
                        help="where to write the JSON (default: the one current result, bench/results/gpu_cost.json)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("unset TRITON_INTERPRET: this compiles real Triton kernels")
    torch.manual_seed(0)
    rows = []
    for arch in args.arch:
        floors = {bits: compile_floor(arch, bits) for bits in FLOORS}
        for floor in floors.values():
            rows.append({"arch": arch, **floor, "sass_common": floor["sass"],
                         "sass_common_per_element": floor["sass_per_element"], "x_floor_sass": 1.0,
                         "x_floor_common": 1.0})
        for case in cases():
            if args.only and not re.search(args.only, case.name):
                continue
            t = time.perf_counter()
            floor = floors[floor_bits(case)]
            row = {"arch": arch, **compile_case(case, arch), "floor": floor["kernel"]}
            row["x_floor_sass"] = round(row["sass_per_element"] / floor["sass_per_element"], 2)
            row["x_floor_common"] = round(row["sass_common_per_element"] / floor["sass_per_element"], 2)
            if "batched_common_per_element" in row:
                row["x_floor_batched"] = round(row["batched_common_per_element"] / floor["sass_per_element"], 2)
            row["compile_s"] = round(time.perf_counter() - t, 1)
            rows.append(row)
            print_row(row, header=len(rows) == len(floors) + 1)
    print()
    print_table(rows)
    import lowbit_compile
    out = args.out
    out.parent.mkdir(exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(lowbit_compile.__file__).parent).stdout.strip()
    out.write_text(json.dumps({"triton": triton.__version__, "torch": torch.__version__, "commit": commit,
                               "sm_limits": SM_LIMITS, "kernels": rows}, indent=1))
    print(f"wrote {out}")


COLUMNS = [("arch", "sm", 3), ("kernel", "kernel", 42), ("registers", "regs", 5), ("local_bytes", "local", 6),
           ("shared_bytes", "smem", 6), ("num_warps", "warps", 5), ("elements_per_thread", "el/thr", 6),
           ("sass", "SASS", 6), ("sass_per_element", "SASS/el", 7), ("x_floor_sass", "xfloor", 6),
           ("sass_common_per_element", "common/el", 9), ("x_floor_common", "xfloor", 6),
           ("occupancy", "occ", 5), ("batched_registers", "b.regs", 6),
           ("batched_common_per_element", "b.common/el", 11), ("x_floor_batched", "xfloor", 6),
           ("batched_occupancy", "b.occ", 5), ("last_tile_registers", "l.regs", 6),
           ("last_tile_common_per_element", "l.common/el", 11), ("last_tile_occupancy", "l.occ", 5),
           ("bytes_per_element", "B/el", 6)]


def _cell(row: dict, key: str, width: int) -> str:
    value = row.get(key, "")
    if key.endswith("occupancy") and value != "":
        value = f"{value:.0%}"
    elif isinstance(value, float):
        value = f"{value:g}"
    return f"{value!s:>{width}}" if key != "kernel" else f"{value!s:<{width}}"


def print_row(row: dict, header: bool = False) -> None:
    if header:
        print(" ".join(f"{h:>{w}}" if k != "kernel" else f"{h:<{w}}" for k, h, w in COLUMNS))
    print(" ".join(_cell(row, k, w) for k, _, w in COLUMNS), flush=True)


def print_table(rows: list[dict]) -> None:
    print(" ".join(f"{h:>{w}}" if k != "kernel" else f"{h:<{w}}" for k, h, w in COLUMNS))
    for row in rows:
        print(" ".join(_cell(row, k, w) for k, _, w in COLUMNS))


if __name__ == "__main__":
    main()
