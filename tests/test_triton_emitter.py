"""The Triton source emitted from the rewritten step graphs of Adam and AdamW (snapshots), the op
coverage over the traced variants of both, and the errors for what the emitter does not lower."""

from __future__ import annotations

import difflib
import itertools
import operator

import pytest
import torch
from expecttest import TestCase

from lowbit_compile.kernels.formats import StateFormat

from .graphs import pass_graphs

emitter = pytest.importorskip("lowbit_compile.kernels.triton_emitter")


def body(opt: torch.optim.Optimizer, fmt: str = "int8") -> torch.fx.GraphModule:
    return pass_graphs(opt, fmt)["split"].body


def one_param(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(64, dtype=dtype))]


class TestEmittedSource(TestCase):
    def test_adam(self):
        kernel = emitter.emit_kernel(body(torch.optim.Adam(one_param())), "adam_step", "cuda")
        self.assertExpectedInline(kernel.source, """\
import triton
import triton.language as tl

from lowbit_compile.kernels import triton_lib as lb


@triton.jit
def adam_step(
    param_ptr, grad_ptr, exp_avg_codes_ptr, exp_avg_scales_ptr, exp_avg_patch_values_ptr, exp_avg_patch_index_ptr,
    exp_avg_sq_codes_ptr, exp_avg_sq_scales_ptr, exp_avg_sq_patch_values_ptr, exp_avg_sq_patch_index_ptr, sub,
    hp_betas_1, sub_1, pow_3, hp_eps, neg, n_elements, first_block, BLOCK: tl.constexpr, ROWS: tl.constexpr,
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
    # int8:2048:2:s
    dequantize_default = lb.dequantize(exp_avg_codes_ptr, exp_avg_scales_ptr, exp_avg_patch_values_ptr,
                                       exp_avg_patch_index_ptr, None, rows, cols, offsets, mask, row_mask,
                                       FMT=lb.INT8, K=2, DTYPE=lb.F32)
    # int8:2048:2:u
    dequantize_default_1 = lb.dequantize(exp_avg_sq_codes_ptr, exp_avg_sq_scales_ptr, exp_avg_sq_patch_values_ptr,
                                         exp_avg_sq_patch_index_ptr, None, rows, cols, offsets, mask, row_mask,
                                         FMT=lb.INT8, K=2, DTYPE=lb.F32)
    lerp = lb.lerp(dequantize_default, grad, sub)
    mul = dequantize_default_1 * hp_betas_1
    addcmul = tl.where(sub_1 == 1.0, tl.fma(grad, grad, mul), tl.fma(sub_1, grad * grad, mul))
    sqrt = tl.sqrt_rn(addcmul)
    div = sqrt * tl.math.div_rn(1.0, pow_3)
    add_1 = div + hp_eps
    addcdiv_q = tl.math.div_rn(lerp, add_1)
    addcdiv = tl.where(neg == 1.0, param + addcdiv_q, tl.fma(neg, addcdiv_q, param))
    lb.store_elements(param_ptr, offsets, addcdiv, mask, lb.F32)
    # int8:2048:2:s
    lb.quantize(lerp, exp_avg_codes_ptr, exp_avg_scales_ptr, exp_avg_patch_values_ptr, exp_avg_patch_index_ptr,
                None, rows, cols, offsets, mask, row_mask, FMT=lb.INT8, NONNEG=False, K=2, QMAX=127.0,
                MIN_POSITIVE=1.0, INV_QMAX=0.007874015718698502)
    # int8:2048:2:u
    lb.quantize(addcmul, exp_avg_sq_codes_ptr, exp_avg_sq_scales_ptr, exp_avg_sq_patch_values_ptr,
                exp_avg_sq_patch_index_ptr, None, rows, cols, offsets, mask, row_mask, FMT=lb.INT8, NONNEG=True,
                K=2, QMAX=255.0, MIN_POSITIVE=1.0, INV_QMAX=0.003921568859368563)
""")

    def test_adamw(self):
        kernel = emitter.emit_kernel(body(torch.optim.AdamW(one_param())), "adamw_step", "cuda")
        self.assertExpectedInline(kernel.source, """\
import triton
import triton.language as tl

from lowbit_compile.kernels import triton_lib as lb


@triton.jit
def adamw_step(
    param_ptr, grad_ptr, exp_avg_codes_ptr, exp_avg_scales_ptr, exp_avg_patch_values_ptr, exp_avg_patch_index_ptr,
    exp_avg_sq_codes_ptr, exp_avg_sq_scales_ptr, exp_avg_sq_patch_values_ptr, exp_avg_sq_patch_index_ptr, sub,
    sub_1, hp_betas_1, sub_2, pow_3, hp_eps, neg, n_elements, first_block, BLOCK: tl.constexpr, ROWS: tl.constexpr,
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
    # int8:2048:2:s
    dequantize_default = lb.dequantize(exp_avg_codes_ptr, exp_avg_scales_ptr, exp_avg_patch_values_ptr,
                                       exp_avg_patch_index_ptr, None, rows, cols, offsets, mask, row_mask,
                                       FMT=lb.INT8, K=2, DTYPE=lb.F32)
    # int8:2048:2:u
    dequantize_default_1 = lb.dequantize(exp_avg_sq_codes_ptr, exp_avg_sq_scales_ptr, exp_avg_sq_patch_values_ptr,
                                         exp_avg_sq_patch_index_ptr, None, rows, cols, offsets, mask, row_mask,
                                         FMT=lb.INT8, K=2, DTYPE=lb.F32)
    mul_1 = param * sub
    lerp = lb.lerp(dequantize_default, grad, sub_1)
    mul_2 = dequantize_default_1 * hp_betas_1
    addcmul = tl.where(sub_2 == 1.0, tl.fma(grad, grad, mul_2), tl.fma(sub_2, grad * grad, mul_2))
    sqrt = tl.sqrt_rn(addcmul)
    div = sqrt * tl.math.div_rn(1.0, pow_3)
    add_1 = div + hp_eps
    addcdiv_q = tl.math.div_rn(lerp, add_1)
    addcdiv = tl.where(neg == 1.0, mul_1 + addcdiv_q, tl.fma(neg, addcdiv_q, mul_1))
    lb.store_elements(param_ptr, offsets, addcdiv, mask, lb.F32)
    # int8:2048:2:s
    lb.quantize(lerp, exp_avg_codes_ptr, exp_avg_scales_ptr, exp_avg_patch_values_ptr, exp_avg_patch_index_ptr,
                None, rows, cols, offsets, mask, row_mask, FMT=lb.INT8, NONNEG=False, K=2, QMAX=127.0,
                MIN_POSITIVE=1.0, INV_QMAX=0.007874015718698502)
    # int8:2048:2:u
    lb.quantize(addcmul, exp_avg_sq_codes_ptr, exp_avg_sq_scales_ptr, exp_avg_sq_patch_values_ptr,
                exp_avg_sq_patch_index_ptr, None, rows, cols, offsets, mask, row_mask, FMT=lb.INT8, NONNEG=True,
                K=2, QMAX=255.0, MIN_POSITIVE=1.0, INV_QMAX=0.003921568859368563)
""")

    def test_cpu_flavor_differs_only_where_eager_cpu_rounds_differently(self):
        graph = body(torch.optim.AdamW(one_param()))
        cuda, cpu = (emitter.emit_kernel(graph, "adamw_step", f).source.splitlines() for f in ("cuda", "cpu"))
        diff = [line for line in difflib.unified_diff(cuda, cpu, "cuda", "cpu", n=0, lineterm="")
                if not line.startswith("@@")]
        self.assertExpectedInline("\n".join(diff), """\
--- cuda
+++ cpu
-    addcmul = tl.where(sub_2 == 1.0, tl.fma(grad, grad, mul_2), tl.fma(sub_2, grad * grad, mul_2))
+    addcmul = tl.fma(sub_2 * grad, grad, mul_2)
-    div = sqrt * tl.math.div_rn(1.0, pow_3)
+    div = tl.math.div_rn(sqrt, pow_3)
-    addcdiv_q = tl.math.div_rn(lerp, add_1)
-    addcdiv = tl.where(neg == 1.0, mul_1 + addcdiv_q, tl.fma(neg, addcdiv_q, mul_1))
+    addcdiv = mul_1 + tl.math.div_rn(neg * lerp, add_1)
-                MIN_POSITIVE=1.0, INV_QMAX=0.007874015718698502)
+                MIN_POSITIVE=1.0, INV_QMAX=0.0)
-                K=2, QMAX=255.0, MIN_POSITIVE=1.0, INV_QMAX=0.003921568859368563)
+                K=2, QMAX=255.0, MIN_POSITIVE=1.0, INV_QMAX=0.0)""")


# flags that change which aten ops the traced step holds
VARIANTS = [
    *itertools.product((torch.optim.Adam, torch.optim.AdamW), (False, True), (False, True), (False, True),
                       (torch.float32,)),
    (torch.optim.Adam, True, True, True, torch.bfloat16),
    (torch.optim.AdamW, False, False, True, torch.float16),
]


@pytest.mark.parametrize(("cls", "amsgrad", "maximize", "tensor_hypers", "dtype"), VARIANTS)
def test_every_op_of_every_traced_variant_is_lowered(cls, amsgrad, maximize, tensor_hypers, dtype):
    extra = {"lr": torch.tensor(0.01), "betas": (torch.tensor(0.9), torch.tensor(0.99))} if tensor_hypers else {}
    opt = cls(one_param(dtype), amsgrad=amsgrad, maximize=maximize, weight_decay=0.1 * tensor_hypers, **extra)
    graph = body(opt, "dynamic8")
    for flavor in emitter.FLAVORS:
        kernel = emitter.emit_kernel(graph, "step", flavor)
        compile(kernel.source, "<emitted>", "exec")
    ops = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert ops <= set(emitter.supported_ops())


def test_an_op_without_a_lowering_is_an_error_naming_it():
    graph = body(torch.optim.Adam(one_param()))
    sqrt = next(n for n in graph.graph.nodes if n.target is torch.ops.aten.sqrt.default)
    sqrt.target = torch.ops.aten.exp.default
    with pytest.raises(emitter.UnsupportedOpError, match=r"aten\.exp\.default .*'sqrt'"):
        emitter.emit_kernel(graph, "step", "cuda")


def test_a_python_function_node_is_an_error_naming_it():
    graph = body(torch.optim.Adam(one_param()))
    sqrt = next(n for n in graph.graph.nodes if n.target is torch.ops.aten.sqrt.default)
    sqrt.target = operator.neg
    with pytest.raises(emitter.UnsupportedOpError, match="no lowering for <built-in function neg>"):
        emitter.emit_kernel(graph, "step", "cpu")


def test_float64_params_are_refused():
    with pytest.raises(emitter.UnsupportedOpError, match="torch.float64"):
        emitter.emit_kernel(body(torch.optim.Adam(one_param(torch.float64))), "step", "cuda")


def test_states_of_one_param_must_share_a_block_size():
    graph = body(torch.optim.Adam(one_param()))
    quantize = [n for n in graph.graph.nodes if n.target is torch.ops.lowbit.quantize_.default][-1]
    fmt = StateFormat.from_tag(quantize.args[-1])
    quantize.args = (*quantize.args[:-1], StateFormat(fmt.name, 256, fmt.outliers, fmt.nonneg).tag())
    with pytest.raises(emitter.UnsupportedOpError, match=r"different block sizes \[256, 2048\]"):
        emitter.emit_kernel(graph, "step", "cuda")
