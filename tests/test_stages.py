"""The stages pass: a step with whole-tensor ops (Muon's Newton-Schulz matmuls) split into elementwise
stages around the state I/O (lowered like any step) and whole-tensor stages run as torch ops."""

from __future__ import annotations

import pytest
import torch
from expecttest import TestCase

from lowbit_compile.config import Config
from lowbit_compile.options import Options
from lowbit_compile.passes.pipeline import Rewrite, rewrite
from lowbit_compile.passes.roles import NotElementwiseError, label_roles
from lowbit_compile.runtime.compile import fp32_opmath
from lowbit_compile.state.schema import init_state, probe_schema, trace_for

from .helpers import each_param


def _muon_graphs(shape=(6, 4), fmt="sqrt8", dtype=torch.float32, **kwargs):
    param = torch.nn.Parameter(torch.randn(shape).to(dtype))
    opt = torch.optim.Muon([param], ns_steps=1, **kwargs)
    group = opt.param_groups[0]
    schema = probe_schema(opt, group, param)
    config = Config.of(Options(fmt, 512, 0, min_8bit_size=0, backend="reference"))
    formats = dict(config.formats_for(param, schema.per_element, nonneg=schema.nonneg))
    state = init_state(param, schema, formats)
    traced = trace_for(opt, group, param, state, schema.per_element, shape=schema.trace_shape(param)).graph
    return traced, rewrite(traced, Rewrite(formats, opmath=fp32_opmath(group, dtype, formats), staged=True))["split"]


class TestMuonStages(TestCase):
    def test_tall_matrix_with_8bit_momentum(self):
        _, staged = _muon_graphs()
        self.assertExpectedInline(staged.code.strip(), """\
def forward(self, param, grad, momentum_buffer_codes, momentum_buffer_scales, momentum_buffer_patch_values, momentum_buffer_patch_index, hp_lr, hp_weight_decay, hp_momentum, hp_ns_coefficients_0, hp_ns_coefficients_1, hp_ns_coefficients_2, hp_eps):
    tmp_0 = torch.ops.aten.empty_like.default(param, dtype = torch.bfloat16, memory_format = torch.contiguous_format)
    stage_0 = self.stage_0(param, grad, momentum_buffer_codes, momentum_buffer_scales, momentum_buffer_patch_values, momentum_buffer_patch_index, hp_momentum, tmp_0);  grad = momentum_buffer_codes = momentum_buffer_scales = momentum_buffer_patch_values = momentum_buffer_patch_index = hp_momentum = stage_0 = None
    stage_1 = self.stage_1(hp_ns_coefficients_0, hp_ns_coefficients_1, hp_ns_coefficients_2, hp_eps, tmp_0);  hp_ns_coefficients_0 = hp_ns_coefficients_1 = hp_ns_coefficients_2 = hp_eps = tmp_0 = None
    tmp_1 = stage_1[0];  stage_1 = None
    stage_2 = self.stage_2(param, hp_lr, hp_weight_decay, tmp_1);  param = hp_lr = hp_weight_decay = tmp_1 = stage_2 = None
    return None""")
        self.assertExpectedInline(staged.stage_0.code.strip(), """\
def forward(self, param, grad, momentum_buffer_codes, momentum_buffer_scales, momentum_buffer_patch_values, momentum_buffer_patch_index, hp_momentum, tmp_0):
    dequantize_default = torch.ops.lowbit.dequantize.default(momentum_buffer_codes, momentum_buffer_scales, momentum_buffer_patch_values, momentum_buffer_patch_index, 'sqrt8:512:0:s', 'float32')
    sub = 1.0 - hp_momentum
    lerp = torch.ops.aten.lerp.Scalar(dequantize_default, grad, sub);  dequantize_default = sub = None
    lerp_1 = torch.ops.aten.lerp.Scalar(grad, lerp, hp_momentum);  grad = hp_momentum = None
    _to_copy = torch.ops.aten._to_copy.default(lerp_1, dtype = torch.bfloat16);  lerp_1 = None
    quantize__default = torch.ops.lowbit.quantize_.default(lerp, momentum_buffer_codes, momentum_buffer_scales, momentum_buffer_patch_values, momentum_buffer_patch_index, 'sqrt8:512:0:s');  lerp = momentum_buffer_codes = momentum_buffer_scales = momentum_buffer_patch_values = momentum_buffer_patch_index = quantize__default = None
    copy__default = torch.ops.aten.copy_.default(tmp_0, _to_copy);  tmp_0 = _to_copy = copy__default = None
    return None""")
        self.assertExpectedInline(staged.stage_1.code.strip(), """\
def forward(self, hp_ns_coefficients_0, hp_ns_coefficients_1, hp_ns_coefficients_2, hp_eps, tmp_0):
    permute_copy = torch.ops.aten.permute.default(tmp_0, [1, 0]);  tmp_0 = None
    linalg_vector_norm = torch.ops.aten.linalg_vector_norm.default(permute_copy)
    clamp = torch.ops.aten.clamp.default(linalg_vector_norm, hp_eps);  linalg_vector_norm = hp_eps = None
    div = torch.ops.aten.div.Tensor(permute_copy, clamp);  permute_copy = clamp = None
    permute_copy_1 = torch.ops.aten.permute.default(div, [1, 0]);  div = None
    permute_copy_2 = torch.ops.aten.permute.default(permute_copy_1, [1, 0])
    permute_copy_4 = torch.ops.aten.permute.default(permute_copy_1, [1, 0]);  permute_copy_1 = None
    permute_copy_5 = torch.ops.aten.permute.default(permute_copy_4, [1, 0]);  permute_copy_4 = None
    mm = torch.ops.aten.mm.default(permute_copy_2, permute_copy_5);  permute_copy_5 = None
    addmm = torch.ops.aten.addmm.default(mm, mm, mm, beta = hp_ns_coefficients_1, alpha = hp_ns_coefficients_2);  mm = hp_ns_coefficients_1 = hp_ns_coefficients_2 = None
    addmm_1 = torch.ops.aten.addmm.default(permute_copy_2, addmm, permute_copy_2, beta = hp_ns_coefficients_0);  permute_copy_2 = addmm = hp_ns_coefficients_0 = None
    permute_copy_6 = torch.ops.aten.permute.default(addmm_1, [1, 0]);  addmm_1 = None
    return (permute_copy_6,)""")
        self.assertExpectedInline(staged.stage_2.code.strip(), """\
def forward(self, param, hp_lr, hp_weight_decay, tmp_1):
    mul = hp_lr * 1.224744871391589
    mul_1 = hp_lr * hp_weight_decay;  hp_lr = hp_weight_decay = None
    sub_1 = 1.0 - mul_1;  mul_1 = None
    mul_2 = torch.ops.aten.mul.Tensor(param, sub_1);  sub_1 = None
    neg = -mul;  mul = None
    add = torch.ops.aten.add.Tensor(mul_2, tmp_1, alpha = neg);  mul_2 = tmp_1 = neg = None
    copy_ = torch.ops.aten.copy_.default(param, add);  param = add = copy_ = None
    return None""")

    def test_without_nesterov_the_new_momentum_itself_is_the_temporary(self):
        _, staged = _muon_graphs(shape=(4, 4), fmt="fp32", nesterov=False)
        self.assertExpectedInline(staged.stage_0.code.strip(), """\
def forward(self, param, grad, state_momentum_buffer, hp_momentum, tmp_0):
    sub = 1.0 - hp_momentum;  hp_momentum = None
    lerp = torch.ops.aten.lerp.Scalar(state_momentum_buffer, grad, sub);  grad = sub = None
    _to_copy = torch.ops.aten._to_copy.default(lerp, dtype = torch.bfloat16)
    copy__1 = torch.ops.aten.copy_.default(state_momentum_buffer, lerp);  state_momentum_buffer = lerp = copy__1 = None
    copy__default = torch.ops.aten.copy_.default(tmp_0, _to_copy);  tmp_0 = _to_copy = copy__default = None
    return None""")


class TestSixteenBitStages(TestCase):
    def test_bf16_param_with_8bit_momentum_rounds_the_update_once_for_the_torch_ops(self):
        """The fused stages compute in fp32 (opmath); Newton-Schulz takes the bf16 update stock gives it."""
        _, staged = _muon_graphs(dtype=torch.bfloat16)
        # the momentum decodes to fp32 and the bf16 grad is read as fp32; only the temporary is bf16
        casts = [(n.args[0].name, n.kwargs["dtype"]) for n in staged.stage_0.graph.nodes
                 if n.target is torch.ops.aten._to_copy.default]
        self.assertEqual(casts, [("grad", torch.float32), ("lerp_1", torch.bfloat16)])
        self.assertEqual(next(n for n in staged.graph.nodes if n.name == "tmp_0").kwargs["dtype"], torch.bfloat16)
        self.assertExpectedInline(staged.stage_2.code.strip(), """\
def forward(self, param, hp_lr, hp_weight_decay, tmp_1):
    _to_copy_default = torch.ops.aten._to_copy.default(param, dtype = torch.float32)
    mul = hp_lr * 1.224744871391589
    mul_1 = hp_lr * hp_weight_decay;  hp_lr = hp_weight_decay = None
    sub_1 = 1.0 - mul_1;  mul_1 = None
    mul_2 = torch.ops.aten.mul.Tensor(_to_copy_default, sub_1);  _to_copy_default = sub_1 = None
    neg = -mul;  mul = None
    add = torch.ops.aten.add.Tensor(mul_2, tmp_1, alpha = neg);  mul_2 = tmp_1 = neg = None
    copy_ = torch.ops.aten.copy_.default(param, add);  param = add = copy_ = None
    return None""")

    def test_fp16_param_writes_its_update_back_in_a_fused_stage(self):
        """fp16 + the bf16 update computes in fp32; its cast back to fp16 is elementwise, not a torch op."""
        _, staged = _muon_graphs(fmt="fp32", dtype=torch.float16)
        self.assertEqual([name for name, _ in staged.named_children()], ["stage_0", "stage_1", "stage_2"])
        aten = torch.ops.aten
        tail = [n.target for n in staged.stage_2.graph.nodes if n.op == "call_function"][-3:]
        self.assertEqual(tail, [aten.add.Tensor, aten._to_copy.default, aten.copy_.default])
        self.assertNotIn(aten.add.Tensor, [n.target for n in staged.stage_1.graph.nodes])


def test_a_whole_tensor_stage_gives_its_outputs_the_strides_they_run_with():
    """A tall matrix's update leaves Newton-Schulz transposed (views run as views, the trace copied
    them dense): the next stage reads it with those strides, which its CPU lowering follows."""
    for shape, stride in [((6, 4), (1, 6)), ((4, 6), (6, 1))]:
        _, staged = _muon_graphs(shape=shape)
        tmp = next(n for n in staged.stage_2.graph.nodes if n.name == "tmp_1")
        assert tmp.meta["val"].stride() == stride


def test_the_schema_of_a_step_that_is_not_elementwise_is_shaped():
    param = torch.nn.Parameter(torch.randn(6, 4))
    schema = probe_schema(torch.optim.Muon([param]), torch.optim.Muon([param]).param_groups[0], param)
    assert schema.shaped and schema.per_element == ("momentum_buffer",)
    assert schema.trace_shape(param) == ((6, 4), (4, 1))
    assert schema.trace_shape(torch.nn.Parameter(torch.randn(4, 6).t())) == ((6, 4), (1, 6))  # traced as laid out
    adam = torch.optim.Adam([param])
    assert not probe_schema(adam, adam.param_groups[0], param).shaped


def test_roles_still_refuse_a_whole_tensor_op_in_an_unstaged_step():
    traced, _ = _muon_graphs()
    with pytest.raises(NotElementwiseError, match="_to_copy"):
        label_roles(traced)


class _Sandwich(torch.optim.Optimizer):
    """An optimizer of one's own whose matmul reads its state as it was before the step writes it."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @each_param
    def step(self, group, p, state):
        if "buf" not in state:
            state["buf"] = torch.zeros_like(p)
        buf = state["buf"]
        p.add_(buf @ buf.T @ buf, alpha=-group["lr"])
        buf.mul_(0.5).add_(p.grad)


class _CountedNormalized(torch.optim.Optimizer):
    """A step count read after a norm: every stage must see the count the step started with."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @each_param
    def step(self, group, p, state):
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
        state["step"] += 1
        p.add_(p.grad / p.grad.norm(), alpha=-group["lr"] / state["step"].item())


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize(("cls", "key"), [(_Sandwich, "buf"), (_CountedNormalized, "step")],
                         ids=["a state a matmul reads in place is read before its write-back",
                              "a step count is written after every stage read it"])
def test_a_staged_step_of_ones_own_is_stock_bit_for_bit(cls, key, backend):
    from lowbit_compile import lowbit_compile

    a = [torch.nn.Parameter(torch.randn(6, 4))]
    b = [torch.nn.Parameter(a[0].detach().clone())]
    opt_a, opt_b = lowbit_compile(cls(a), "fp32", backend=backend), cls(b)
    for _ in range(3):
        g = torch.randn(6, 4)
        a[0].grad, b[0].grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    assert torch.equal(a[0], b[0])
    assert torch.equal(opt_a.state[a[0]][key], opt_b.state[b[0]][key])
