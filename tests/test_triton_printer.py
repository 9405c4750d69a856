"""The Triton source printed from the rewritten step graphs of Adam and AdamW (snapshots, default
layout), where the CUDA and CPU targets differ, and the errors for what the lowering does not cover."""

from __future__ import annotations

import difflib
import operator

import pytest
import torch
from expecttest import TestCase

from lowbit_compile.formats import StateFormat
from lowbit_compile.kernels.lowering import LoweringError, Target

from .graphs import body

printer = pytest.importorskip("lowbit_compile.kernels.triton_printer")
CUDA, CPU = Target("cuda"), Target("cpu")


def one_param(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(64, dtype=dtype))]


class TestEmittedSource(TestCase):
    def test_adam(self):
        kernel = printer.emit_kernel(body(torch.optim.Adam(one_param())), "adam_step", CUDA)
        self.assertExpectedInline(kernel.source, """\
import triton
import triton.language as tl

from lowbit_compile.kernels import triton_lib as lb


@triton.jit
def adam_step(
    param_ptr, grad_ptr, exp_avg_codes_ptr, exp_avg_scales_ptr, exp_avg_sq_codes_ptr, exp_avg_sq_scales_ptr, sub,
    hp_betas_1, sub_1, pow_3, hp_eps, neg, clone_default_ptr, n_elements, first_block, BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = first_block + tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    offsets = rows[:, None] * BLOCK + cols[None, :]
    mask = offsets < n_elements
    row_mask = rows * BLOCK < n_elements
    param = lb.load_elements(param_ptr, offsets, mask, lb.F32)
    grad = lb.load_elements(grad_ptr, offsets, mask, lb.F32)
    sub = tl.cast(sub, tl.float32)
    hp_betas_1 = tl.cast(hp_betas_1, tl.float32)
    sub_1 = tl.cast(sub_1, tl.float32)
    pow_3 = tl.cast(pow_3, tl.float32)
    hp_eps = tl.cast(hp_eps, tl.float32)
    neg = tl.cast(neg, tl.float32)
    clone_default = lb.load_scalar(clone_default_ptr, lb.F32)
    # sqrt8:512:0:s
    dequantize_default = lb.dequantize(exp_avg_codes_ptr, exp_avg_scales_ptr, None, None, None, rows, cols,
                                       offsets, mask, row_mask, FMT=lb.SQRT8, K=0, POS_INF_CODE=127,
                                       NEG_INF_CODE=129, NAN_CODE=128)
    # sqrt8:512:0:u
    dequantize_default_1 = lb.dequantize(exp_avg_sq_codes_ptr, exp_avg_sq_scales_ptr, None, None, None, rows, cols,
                                         offsets, mask, row_mask, FMT=lb.SQRT8, K=0, POS_INF_CODE=255,
                                         NEG_INF_CODE=253, NAN_CODE=254)
    lerp_small = tl.abs(sub) < 0.5
    lerp_diff = grad - dequantize_default
    lerp = tl.fma(tl.where(lerp_small, sub, sub - 1.0), lerp_diff, tl.where(lerp_small, dequantize_default, grad))
    mul = dequantize_default_1 * hp_betas_1
    addcmul = tl.where(sub_1 == 1.0, tl.fma(grad, grad, mul), tl.fma(sub_1, grad * grad, mul))
    sqrt = tl.sqrt(addcmul)
    div = sqrt * (1.0 / pow_3)
    add_1 = div + hp_eps
    addcdiv_q = lerp / add_1
    addcdiv = tl.where(neg == 1.0, param + addcdiv_q, tl.fma(neg, addcdiv_q, param))
    lb.store_elements(param_ptr, offsets, addcdiv, mask, lb.F32)
    # sqrt8:512:0:s
    lb.quantize(lerp, exp_avg_codes_ptr, exp_avg_scales_ptr, None, None, None, rows, cols, offsets, mask, row_mask,
                FMT=lb.SQRT8, NONNEG=False, K=0, QMAX=16129.0, MIN_POSITIVE=1.0, INV_QMAX=6.200012285262346e-05,
                FLAGGED_QMAX=15876.0, INV_FLAGGED_QMAX=6.29881615168415e-05, POS_INF_CODE=127, NEG_INF_CODE=129,
                NAN_CODE=128, APPROXIMATE=True)
    # sqrt8:512:0:u
    lb.quantize(addcmul, exp_avg_sq_codes_ptr, exp_avg_sq_scales_ptr, None, None, None, rows, cols, offsets, mask,
                row_mask, FMT=lb.SQRT8, NONNEG=True, K=0, QMAX=65025.0, MIN_POSITIVE=1.0,
                INV_QMAX=1.537870048196055e-05, FLAGGED_QMAX=63504.0, INV_FLAGGED_QMAX=1.5747040379210375e-05,
                POS_INF_CODE=255, NEG_INF_CODE=253, NAN_CODE=254, APPROXIMATE=True, seed=clone_default, STREAM=2)
""")

    def test_adamw(self):
        kernel = printer.emit_kernel(body(torch.optim.AdamW(one_param())), "adamw_step", CUDA)
        self.assertExpectedInline(kernel.source, """\
import triton
import triton.language as tl

from lowbit_compile.kernels import triton_lib as lb


@triton.jit
def adamw_step(
    param_ptr, grad_ptr, exp_avg_codes_ptr, exp_avg_scales_ptr, exp_avg_sq_codes_ptr, exp_avg_sq_scales_ptr, sub,
    sub_1, hp_betas_1, sub_2, pow_3, hp_eps, neg, clone_default_ptr, n_elements, first_block, BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = first_block + tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    offsets = rows[:, None] * BLOCK + cols[None, :]
    mask = offsets < n_elements
    row_mask = rows * BLOCK < n_elements
    param = lb.load_elements(param_ptr, offsets, mask, lb.F32)
    grad = lb.load_elements(grad_ptr, offsets, mask, lb.F32)
    sub = tl.cast(sub, tl.float32)
    sub_1 = tl.cast(sub_1, tl.float32)
    hp_betas_1 = tl.cast(hp_betas_1, tl.float32)
    sub_2 = tl.cast(sub_2, tl.float32)
    pow_3 = tl.cast(pow_3, tl.float32)
    hp_eps = tl.cast(hp_eps, tl.float32)
    neg = tl.cast(neg, tl.float32)
    clone_default = lb.load_scalar(clone_default_ptr, lb.F32)
    # sqrt8:512:0:s
    dequantize_default = lb.dequantize(exp_avg_codes_ptr, exp_avg_scales_ptr, None, None, None, rows, cols,
                                       offsets, mask, row_mask, FMT=lb.SQRT8, K=0, POS_INF_CODE=127,
                                       NEG_INF_CODE=129, NAN_CODE=128)
    # sqrt8:512:0:u
    dequantize_default_1 = lb.dequantize(exp_avg_sq_codes_ptr, exp_avg_sq_scales_ptr, None, None, None, rows, cols,
                                         offsets, mask, row_mask, FMT=lb.SQRT8, K=0, POS_INF_CODE=255,
                                         NEG_INF_CODE=253, NAN_CODE=254)
    mul_1 = param * sub
    lerp_small = tl.abs(sub_1) < 0.5
    lerp_diff = grad - dequantize_default
    lerp = tl.fma(tl.where(lerp_small, sub_1, sub_1 - 1.0), lerp_diff, tl.where(lerp_small, dequantize_default, grad))
    mul_2 = dequantize_default_1 * hp_betas_1
    addcmul = tl.where(sub_2 == 1.0, tl.fma(grad, grad, mul_2), tl.fma(sub_2, grad * grad, mul_2))
    sqrt = tl.sqrt(addcmul)
    div = sqrt * (1.0 / pow_3)
    add_1 = div + hp_eps
    addcdiv_q = lerp / add_1
    addcdiv = tl.where(neg == 1.0, mul_1 + addcdiv_q, tl.fma(neg, addcdiv_q, mul_1))
    lb.store_elements(param_ptr, offsets, addcdiv, mask, lb.F32)
    # sqrt8:512:0:s
    lb.quantize(lerp, exp_avg_codes_ptr, exp_avg_scales_ptr, None, None, None, rows, cols, offsets, mask, row_mask,
                FMT=lb.SQRT8, NONNEG=False, K=0, QMAX=16129.0, MIN_POSITIVE=1.0, INV_QMAX=6.200012285262346e-05,
                FLAGGED_QMAX=15876.0, INV_FLAGGED_QMAX=6.29881615168415e-05, POS_INF_CODE=127, NEG_INF_CODE=129,
                NAN_CODE=128, APPROXIMATE=True)
    # sqrt8:512:0:u
    lb.quantize(addcmul, exp_avg_sq_codes_ptr, exp_avg_sq_scales_ptr, None, None, None, rows, cols, offsets, mask,
                row_mask, FMT=lb.SQRT8, NONNEG=True, K=0, QMAX=65025.0, MIN_POSITIVE=1.0,
                INV_QMAX=1.537870048196055e-05, FLAGGED_QMAX=63504.0, INV_FLAGGED_QMAX=1.5747040379210375e-05,
                POS_INF_CODE=255, NEG_INF_CODE=253, NAN_CODE=254, APPROXIMATE=True, seed=clone_default, STREAM=2)
""")

    def test_batched_kernel_differs_only_where_a_program_finds_its_tensor_and_tile(self):
        graph = body(torch.optim.AdamW(one_param()))
        single, batched = (printer.emit_kernel(graph, "adamw_step", CUDA, batched=b).source.splitlines()
                           for b in (False, True))
        diff = [line for line in difflib.unified_diff(single, batched, "per-tensor", "batched", n=0, lineterm="")
                if not line.startswith("@@")]
        self.assertExpectedInline("\n".join(diff), """\
--- per-tensor
+++ batched
-    param_ptr, grad_ptr, exp_avg_codes_ptr, exp_avg_scales_ptr, exp_avg_sq_codes_ptr, exp_avg_sq_scales_ptr, sub,
-    sub_1, hp_betas_1, sub_2, pow_3, hp_eps, neg, clone_default_ptr, n_elements, first_block, BLOCK: tl.constexpr,
-    ROWS: tl.constexpr,
+    sub, sub_1, hp_betas_1, sub_2, pow_3, hp_eps, neg, row_table_ptr, program_rows_ptr, BLOCK: tl.constexpr,
+    ROWS: tl.constexpr, MASKED: tl.constexpr,
-    rows = first_block + tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
+    pid = tl.program_id(0).to(tl.int64)
+    entry = row_table_ptr + tl.load(program_rows_ptr + pid).to(tl.int64) * 9
+    n_total = tl.load(entry + 1)
+    if MASKED:  # the tensor's last tile, partial: bounded by the tensor's size
+        first_block = n_total // (ROWS * BLOCK) * ROWS
+        n_elements = n_total
+    else:  # a tile wholly inside its tensor: a bound the compiler knows is a multiple of the tile
+        first_block = (pid - tl.load(entry)) * ROWS
+        n_elements = (first_block + ROWS) * BLOCK
+    param_ptr = tl.multiple_of(tl.load(entry + 2).to(tl.pointer_type(tl.float32), bitcast=True), 16)
+    grad_ptr = tl.multiple_of(tl.load(entry + 3).to(tl.pointer_type(tl.float32), bitcast=True), 16)
+    exp_avg_codes_ptr = tl.multiple_of(tl.load(entry + 4).to(tl.pointer_type(tl.int8), bitcast=True), 16)
+    exp_avg_scales_ptr = tl.multiple_of(tl.load(entry + 5).to(tl.pointer_type(tl.float32), bitcast=True), 16)
+    exp_avg_sq_codes_ptr = tl.multiple_of(tl.load(entry + 6).to(tl.pointer_type(tl.uint8), bitcast=True), 16)
+    exp_avg_sq_scales_ptr = tl.multiple_of(tl.load(entry + 7).to(tl.pointer_type(tl.float32), bitcast=True), 16)
+    clone_default_ptr = tl.multiple_of(tl.load(entry + 8).to(tl.pointer_type(tl.float32), bitcast=True), 16)
+    rows = first_block + tl.arange(0, ROWS).to(tl.int64)""")

    def test_cpu_flavor_differs_only_where_eager_cpu_rounds_differently(self):
        graph = body(torch.optim.AdamW(one_param()))
        cuda, cpu = (printer.emit_kernel(graph, "adamw_step", t).source.splitlines() for t in (CUDA, CPU))
        diff = [line for line in difflib.unified_diff(cuda, cpu, "cuda", "cpu", n=0, lineterm="")
                if not line.startswith("@@")]
        self.assertExpectedInline("\n".join(diff), """\
--- cuda
+++ cpu
-    addcmul = tl.where(sub_2 == 1.0, tl.fma(grad, grad, mul_2), tl.fma(sub_2, grad * grad, mul_2))
+    addcmul = tl.fma(sub_2 * grad, grad, mul_2)
-    div = sqrt * (1.0 / pow_3)
+    div = sqrt / pow_3
-    addcdiv_q = lerp / add_1
-    addcdiv = tl.where(neg == 1.0, mul_1 + addcdiv_q, tl.fma(neg, addcdiv_q, mul_1))
+    addcdiv = mul_1 + ((neg * lerp) / add_1)
-                FMT=lb.SQRT8, NONNEG=False, K=0, QMAX=16129.0, MIN_POSITIVE=1.0, INV_QMAX=6.200012285262346e-05,
-                FLAGGED_QMAX=15876.0, INV_FLAGGED_QMAX=6.29881615168415e-05, POS_INF_CODE=127, NEG_INF_CODE=129,
-                NAN_CODE=128, APPROXIMATE=True)
+                FMT=lb.SQRT8, NONNEG=False, K=0, QMAX=16129.0, MIN_POSITIVE=1.0, INV_QMAX=0.0,
+                FLAGGED_QMAX=15876.0, INV_FLAGGED_QMAX=0.0, POS_INF_CODE=127, NEG_INF_CODE=129, NAN_CODE=128,
+                APPROXIMATE=True)
-                row_mask, FMT=lb.SQRT8, NONNEG=True, K=0, QMAX=65025.0, MIN_POSITIVE=1.0,
-                INV_QMAX=1.537870048196055e-05, FLAGGED_QMAX=63504.0, INV_FLAGGED_QMAX=1.5747040379210375e-05,
-                POS_INF_CODE=255, NEG_INF_CODE=253, NAN_CODE=254, APPROXIMATE=True, seed=clone_default, STREAM=2)
+                row_mask, FMT=lb.SQRT8, NONNEG=True, K=0, QMAX=65025.0, MIN_POSITIVE=1.0, INV_QMAX=0.0,
+                FLAGGED_QMAX=63504.0, INV_FLAGGED_QMAX=0.0, POS_INF_CODE=255, NEG_INF_CODE=253, NAN_CODE=254,
+                APPROXIMATE=True, seed=clone_default, STREAM=2)""")

    def test_a_4bit_format_differs_from_sqrt8_in_its_codes_bytes_and_its_map(self):
        """sqrt4 against sqrt8 in one layout (batched: the pointers' types show): both signs' codes are
        uint8 bytes (two codes each), a dequantize says the sign the bytes do not, and the map's range and
        special codes are sqrt4's; the arithmetic is the same."""
        sqrt8, sqrt4 = (printer.emit_kernel(body(torch.optim.AdamW(one_param()), fmt, block_size=128), "adamw_step",
                                            CUDA, batched=True).source.splitlines() for fmt in ("sqrt8", "sqrt4"))
        diff = [line for line in difflib.unified_diff(sqrt8, sqrt4, "sqrt8", "sqrt4", n=0, lineterm="")
                if not line.startswith("@@")]
        self.assertExpectedInline("\n".join(diff), """\
--- sqrt8
+++ sqrt4
-    exp_avg_codes_ptr = tl.multiple_of(tl.load(entry + 4).to(tl.pointer_type(tl.int8), bitcast=True), 16)
+    exp_avg_codes_ptr = tl.multiple_of(tl.load(entry + 4).to(tl.pointer_type(tl.uint8), bitcast=True), 16)
-    # sqrt8:128:0:s
+    # sqrt4:128:0:s
-                                       offsets, mask, row_mask, FMT=lb.SQRT8, K=0, POS_INF_CODE=127,
-                                       NEG_INF_CODE=129, NAN_CODE=128)
-    # sqrt8:128:0:u
+                                       offsets, mask, row_mask, FMT=lb.SQRT4, K=0, POS_INF_CODE=7,
+                                       NEG_INF_CODE=249, NAN_CODE=248, NONNEG=False)
+    # sqrt4:128:0:u
-                                         offsets, mask, row_mask, FMT=lb.SQRT8, K=0, POS_INF_CODE=255,
-                                         NEG_INF_CODE=253, NAN_CODE=254)
+                                         offsets, mask, row_mask, FMT=lb.SQRT4, K=0, POS_INF_CODE=15,
+                                         NEG_INF_CODE=13, NAN_CODE=14, NONNEG=True)
-    # sqrt8:128:0:s
+    # sqrt4:128:0:s
-                FMT=lb.SQRT8, NONNEG=False, K=0, QMAX=16129.0, MIN_POSITIVE=1.0, INV_QMAX=6.200012285262346e-05,
-                FLAGGED_QMAX=15876.0, INV_FLAGGED_QMAX=6.29881615168415e-05, POS_INF_CODE=127, NEG_INF_CODE=129,
-                NAN_CODE=128, APPROXIMATE=True)
-    # sqrt8:128:0:u
+                FMT=lb.SQRT4, NONNEG=False, K=0, QMAX=49.0, MIN_POSITIVE=1.0, INV_QMAX=0.020408162847161293,
+                FLAGGED_QMAX=36.0, INV_FLAGGED_QMAX=0.02777777798473835, POS_INF_CODE=7, NEG_INF_CODE=249,
+                NAN_CODE=248, APPROXIMATE=True)
+    # sqrt4:128:0:u
-                row_mask, FMT=lb.SQRT8, NONNEG=True, K=0, QMAX=65025.0, MIN_POSITIVE=1.0,
-                INV_QMAX=1.537870048196055e-05, FLAGGED_QMAX=63504.0, INV_FLAGGED_QMAX=1.5747040379210375e-05,
-                POS_INF_CODE=255, NEG_INF_CODE=253, NAN_CODE=254, APPROXIMATE=True, seed=clone_default, STREAM=2)
+                row_mask, FMT=lb.SQRT4, NONNEG=True, K=0, QMAX=225.0, MIN_POSITIVE=1.0,
+                INV_QMAX=0.004444444552063942, FLAGGED_QMAX=144.0, INV_FLAGGED_QMAX=0.0069444444961845875,
+                POS_INF_CODE=15, NEG_INF_CODE=13, NAN_CODE=14, APPROXIMATE=True, seed=clone_default, STREAM=2)""")


def test_an_op_without_a_lowering_is_an_error_naming_it():
    graph = body(torch.optim.Adam(one_param()))
    sqrt = next(n for n in graph.graph.nodes if n.target is torch.ops.aten.sqrt.default)
    sqrt.target = torch.ops.aten.exp.default
    with pytest.raises(LoweringError, match=r"no lowering for aten\.exp\.default \(node 'sqrt'\)"):
        printer.emit_kernel(graph, "step", CUDA)


def test_a_python_function_node_is_an_error_naming_it():
    graph = body(torch.optim.Adam(one_param()))
    sqrt = next(n for n in graph.graph.nodes if n.target is torch.ops.aten.sqrt.default)
    sqrt.target = operator.neg
    with pytest.raises(LoweringError, match="no lowering for <built-in function neg>"):
        printer.emit_kernel(graph, "step", CPU)


def test_float64_params_are_refused():
    with pytest.raises(LoweringError, match="torch.float64"):
        printer.emit_kernel(body(torch.optim.Adam(one_param(torch.float64))), "step", CUDA)


def test_states_of_one_param_must_share_a_block_size():
    graph = body(torch.optim.Adam(one_param()))
    quantize = [n for n in graph.graph.nodes if n.target is torch.ops.lowbit.quantize_.default][-1]
    fmt = StateFormat.from_tag(quantize.args[-1])
    quantize.args = (*quantize.args[:-1], StateFormat(fmt.name, 256, fmt.outliers, fmt.nonneg).tag())
    with pytest.raises(LoweringError, match=r"different block sizes \[256, 512\]"):
        printer.emit_kernel(graph, "step", CUDA)

