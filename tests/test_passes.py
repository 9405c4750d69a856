"""Snapshots of every pass on Adam and AdamW: a change in a traced or rewritten graph shows in review."""

from __future__ import annotations

import pytest
import torch
from expecttest import TestCase

from lowbit_compile.ir.contract import role_of
from lowbit_compile.passes.roles import NotElementwiseError, label_roles
from lowbit_compile.passes.trace import trace_count

from .graphs import code, pass_graphs
from .helpers import each_param


def _adam(**kw):
    return torch.optim.Adam([torch.nn.Parameter(torch.randn(64))], **kw)


def _adamw(**kw):
    return torch.optim.AdamW([torch.nn.Parameter(torch.randn(64))], **kw)


class TestAdamGraphs(TestCase):
    def test_traced_adam(self):
        g = pass_graphs(_adam())
        self.assertExpectedInline(code(g["traced"]), """\
def forward(self, param, grad, state_step, state_exp_avg, state_exp_avg_sq, hp_lr, hp_betas_0, hp_betas_1, hp_eps, hp_weight_decay):
    add = torch.ops.aten.add.Tensor(state_step, 1)
    sub = 1.0 - hp_betas_0
    lerp = torch.ops.aten.lerp.Scalar(state_exp_avg, grad, sub);  sub = None
    mul = torch.ops.aten.mul.Tensor(state_exp_avg_sq, hp_betas_1)
    sub_1 = 1.0 - hp_betas_1
    addcmul = torch.ops.aten.addcmul.default(mul, grad, grad, value = sub_1);  mul = grad = sub_1 = None
    _local_scalar_dense = torch.ops.aten._local_scalar_dense.default(add)
    pow_1 = hp_betas_0 ** _local_scalar_dense;  hp_betas_0 = None
    sub_2 = 1.0 - pow_1;  pow_1 = None
    pow_2 = hp_betas_1 ** _local_scalar_dense;  hp_betas_1 = _local_scalar_dense = None
    sub_3 = 1.0 - pow_2;  pow_2 = None
    truediv = hp_lr / sub_2;  hp_lr = sub_2 = None
    pow_3 = sub_3 ** 0.5;  sub_3 = None
    sqrt = torch.ops.aten.sqrt.default(addcmul)
    div = torch.ops.aten.div.Tensor(sqrt, pow_3);  sqrt = pow_3 = None
    add_1 = torch.ops.aten.add.Tensor(div, hp_eps);  div = hp_eps = None
    neg = -truediv;  truediv = None
    addcdiv = torch.ops.aten.addcdiv.default(param, lerp, add_1, value = neg);  add_1 = neg = None
    copy_ = torch.ops.aten.copy_.default(param, addcdiv);  param = addcdiv = copy_ = None
    copy__1 = torch.ops.aten.copy_.default(state_step, add);  state_step = add = copy__1 = None
    copy__2 = torch.ops.aten.copy_.default(state_exp_avg, lerp);  state_exp_avg = lerp = copy__2 = None
    copy__3 = torch.ops.aten.copy_.default(state_exp_avg_sq, addcmul);  state_exp_avg_sq = addcmul = copy__3 = None
    return None""")

    def test_roles_adam(self):
        g = pass_graphs(_adam())
        roles = {n.name: role_of(n).value for n in g["roles"].graph.nodes if n.op == "placeholder"}
        self.assertExpectedInline(str(roles), """{'param': 'param', 'grad': 'grad', 'state_step': 'scalar_state', 'state_exp_avg': 'per_element_state', 'state_exp_avg_sq': 'per_element_state', 'hp_lr': 'hyperparameter', 'hp_betas_0': 'hyperparameter', 'hp_betas_1': 'hyperparameter', 'hp_eps': 'hyperparameter', 'hp_weight_decay': 'hyperparameter'}""")

    def test_quantized_adam(self):
        g = pass_graphs(_adam())
        self.assertExpectedInline(code(g["quantized"]), """\
def forward(self, param, grad, state_step, exp_avg_codes, exp_avg_scales, exp_avg_patch_values, exp_avg_patch_index, exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_patch_values, exp_avg_sq_patch_index, state_rounding_seed, hp_lr, hp_betas_0, hp_betas_1, hp_eps, hp_weight_decay):
    dequantize_default = torch.ops.lowbit.dequantize.default(exp_avg_codes, exp_avg_scales, exp_avg_patch_values, exp_avg_patch_index, 'sqrt8:512:0:s', 'float32')
    dequantize_default_1 = torch.ops.lowbit.dequantize.default(exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_patch_values, exp_avg_sq_patch_index, 'sqrt8:512:0:u', 'float32')
    add = torch.ops.aten.add.Tensor(state_step, 1)
    sub = 1.0 - hp_betas_0
    lerp = torch.ops.aten.lerp.Scalar(dequantize_default, grad, sub);  dequantize_default = sub = None
    mul = torch.ops.aten.mul.Tensor(dequantize_default_1, hp_betas_1);  dequantize_default_1 = None
    sub_1 = 1.0 - hp_betas_1
    addcmul = torch.ops.aten.addcmul.default(mul, grad, grad, value = sub_1);  mul = grad = sub_1 = None
    _local_scalar_dense = torch.ops.aten._local_scalar_dense.default(add)
    pow_1 = hp_betas_0 ** _local_scalar_dense;  hp_betas_0 = None
    sub_2 = 1.0 - pow_1;  pow_1 = None
    pow_2 = hp_betas_1 ** _local_scalar_dense;  hp_betas_1 = _local_scalar_dense = None
    sub_3 = 1.0 - pow_2;  pow_2 = None
    truediv = hp_lr / sub_2;  hp_lr = sub_2 = None
    pow_3 = sub_3 ** 0.5;  sub_3 = None
    sqrt = torch.ops.aten.sqrt.default(addcmul)
    div = torch.ops.aten.div.Tensor(sqrt, pow_3);  sqrt = pow_3 = None
    add_1 = torch.ops.aten.add.Tensor(div, hp_eps);  div = hp_eps = None
    neg = -truediv;  truediv = None
    addcdiv = torch.ops.aten.addcdiv.default(param, lerp, add_1, value = neg);  add_1 = neg = None
    copy_ = torch.ops.aten.copy_.default(param, addcdiv);  param = addcdiv = copy_ = None
    copy__1 = torch.ops.aten.copy_.default(state_step, add);  state_step = add = copy__1 = None
    quantize__default = torch.ops.lowbit.quantize_.default(lerp, exp_avg_codes, exp_avg_scales, exp_avg_patch_values, exp_avg_patch_index, 'sqrt8:512:0:s');  lerp = exp_avg_codes = exp_avg_scales = exp_avg_patch_values = exp_avg_patch_index = quantize__default = None
    add_tensor = torch.ops.aten.add.Tensor(state_rounding_seed, 1.0)
    remainder_scalar = torch.ops.aten.remainder.Scalar(add_tensor, 16777216.0);  add_tensor = None
    copy__default = torch.ops.aten.copy_.default(state_rounding_seed, remainder_scalar);  remainder_scalar = copy__default = None
    quantize_stochastic__default = torch.ops.lowbit.quantize_stochastic_.default(addcmul, exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_patch_values, exp_avg_sq_patch_index, state_rounding_seed, 2, 'sqrt8:512:0:u');  addcmul = exp_avg_sq_codes = exp_avg_sq_scales = exp_avg_sq_patch_values = exp_avg_sq_patch_index = state_rounding_seed = quantize_stochastic__default = None
    return None""")

    def test_split_adam(self):
        g = pass_graphs(_adam())
        self.assertExpectedInline(code(g["split"].prologue), """\
def forward(self, state_step, state_rounding_seed, hp_lr, hp_betas_0, hp_betas_1, hp_eps, hp_weight_decay):
    clone_default = torch.ops.aten.clone.default(state_rounding_seed)
    add = torch.ops.aten.add.Tensor(state_step, 1)
    sub = 1.0 - hp_betas_0
    sub_1 = 1.0 - hp_betas_1
    _local_scalar_dense = torch.ops.aten._local_scalar_dense.default(add)
    pow_1 = hp_betas_0 ** _local_scalar_dense;  hp_betas_0 = None
    sub_2 = 1.0 - pow_1;  pow_1 = None
    pow_2 = hp_betas_1 ** _local_scalar_dense;  hp_betas_1 = _local_scalar_dense = None
    sub_3 = 1.0 - pow_2;  pow_2 = None
    truediv = hp_lr / sub_2;  hp_lr = sub_2 = None
    pow_3 = sub_3 ** 0.5;  sub_3 = None
    neg = -truediv;  truediv = None
    copy__1 = torch.ops.aten.copy_.default(state_step, add);  state_step = add = copy__1 = None
    add_tensor = torch.ops.aten.add.Tensor(state_rounding_seed, 1.0)
    remainder_scalar = torch.ops.aten.remainder.Scalar(add_tensor, 16777216.0);  add_tensor = None
    copy__default = torch.ops.aten.copy_.default(state_rounding_seed, remainder_scalar);  state_rounding_seed = remainder_scalar = copy__default = None
    return (sub, sub_1, pow_3, neg, clone_default)""")
        self.assertExpectedInline(code(g["split"].body), """\
def forward(self, param, grad, exp_avg_codes, exp_avg_scales, exp_avg_patch_values, exp_avg_patch_index, exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_patch_values, exp_avg_sq_patch_index, sub, hp_betas_1, sub_1, pow_3, hp_eps, neg, clone_default):
    dequantize_default = torch.ops.lowbit.dequantize.default(exp_avg_codes, exp_avg_scales, exp_avg_patch_values, exp_avg_patch_index, 'sqrt8:512:0:s', 'float32')
    dequantize_default_1 = torch.ops.lowbit.dequantize.default(exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_patch_values, exp_avg_sq_patch_index, 'sqrt8:512:0:u', 'float32')
    lerp = torch.ops.aten.lerp.Scalar(dequantize_default, grad, sub);  dequantize_default = sub = None
    mul = torch.ops.aten.mul.Tensor(dequantize_default_1, hp_betas_1);  dequantize_default_1 = hp_betas_1 = None
    addcmul = torch.ops.aten.addcmul.default(mul, grad, grad, value = sub_1);  mul = grad = sub_1 = None
    sqrt = torch.ops.aten.sqrt.default(addcmul)
    div = torch.ops.aten.div.Tensor(sqrt, pow_3);  sqrt = pow_3 = None
    add_1 = torch.ops.aten.add.Tensor(div, hp_eps);  div = hp_eps = None
    addcdiv = torch.ops.aten.addcdiv.default(param, lerp, add_1, value = neg);  add_1 = neg = None
    copy_ = torch.ops.aten.copy_.default(param, addcdiv);  param = addcdiv = copy_ = None
    quantize__default = torch.ops.lowbit.quantize_.default(lerp, exp_avg_codes, exp_avg_scales, exp_avg_patch_values, exp_avg_patch_index, 'sqrt8:512:0:s');  lerp = exp_avg_codes = exp_avg_scales = exp_avg_patch_values = exp_avg_patch_index = quantize__default = None
    quantize_stochastic__default = torch.ops.lowbit.quantize_stochastic_.default(addcmul, exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_patch_values, exp_avg_sq_patch_index, clone_default, 2, 'sqrt8:512:0:u');  addcmul = exp_avg_sq_codes = exp_avg_sq_scales = exp_avg_sq_patch_values = exp_avg_sq_patch_index = clone_default = quantize_stochastic__default = None
    return None""")


class TestAdamWGraphs(TestCase):
    def test_traced_adamw_amsgrad(self):
        g = pass_graphs(_adamw(amsgrad=True, maximize=True))
        self.assertExpectedInline(code(g["traced"]), """\
def forward(self, param, grad, state_step, state_exp_avg, state_exp_avg_sq, state_max_exp_avg_sq, hp_lr, hp_betas_0, hp_betas_1, hp_eps, hp_weight_decay):
    neg = torch.ops.aten.neg.default(grad);  grad = None
    add = torch.ops.aten.add.Tensor(state_step, 1)
    mul = hp_lr * hp_weight_decay;  hp_weight_decay = None
    sub = 1.0 - mul;  mul = None
    mul_1 = torch.ops.aten.mul.Tensor(param, sub);  sub = None
    sub_1 = 1.0 - hp_betas_0
    lerp = torch.ops.aten.lerp.Scalar(state_exp_avg, neg, sub_1);  sub_1 = None
    mul_2 = torch.ops.aten.mul.Tensor(state_exp_avg_sq, hp_betas_1)
    sub_2 = 1.0 - hp_betas_1
    addcmul = torch.ops.aten.addcmul.default(mul_2, neg, neg, value = sub_2);  mul_2 = neg = sub_2 = None
    _local_scalar_dense = torch.ops.aten._local_scalar_dense.default(add)
    pow_1 = hp_betas_0 ** _local_scalar_dense;  hp_betas_0 = None
    sub_3 = 1.0 - pow_1;  pow_1 = None
    pow_2 = hp_betas_1 ** _local_scalar_dense;  hp_betas_1 = _local_scalar_dense = None
    sub_4 = 1.0 - pow_2;  pow_2 = None
    truediv = hp_lr / sub_3;  hp_lr = sub_3 = None
    pow_3 = sub_4 ** 0.5;  sub_4 = None
    maximum = torch.ops.aten.maximum.default(state_max_exp_avg_sq, addcmul)
    sqrt = torch.ops.aten.sqrt.default(maximum)
    div = torch.ops.aten.div.Tensor(sqrt, pow_3);  sqrt = pow_3 = None
    add_1 = torch.ops.aten.add.Tensor(div, hp_eps);  div = hp_eps = None
    neg_1 = -truediv;  truediv = None
    addcdiv = torch.ops.aten.addcdiv.default(mul_1, lerp, add_1, value = neg_1);  mul_1 = add_1 = neg_1 = None
    copy_ = torch.ops.aten.copy_.default(param, addcdiv);  param = addcdiv = copy_ = None
    copy__1 = torch.ops.aten.copy_.default(state_step, add);  state_step = add = copy__1 = None
    copy__2 = torch.ops.aten.copy_.default(state_exp_avg, lerp);  state_exp_avg = lerp = copy__2 = None
    copy__3 = torch.ops.aten.copy_.default(state_exp_avg_sq, addcmul);  state_exp_avg_sq = addcmul = copy__3 = None
    copy__4 = torch.ops.aten.copy_.default(state_max_exp_avg_sq, maximum);  state_max_exp_avg_sq = maximum = copy__4 = None
    return None""")

    def test_quantized_adamw_amsgrad(self):
        g = pass_graphs(_adamw(amsgrad=True, maximize=True))
        self.assertExpectedInline(code(g["quantized"]), """\
def forward(self, param, grad, state_step, exp_avg_codes, exp_avg_scales, exp_avg_patch_values, exp_avg_patch_index, exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_patch_values, exp_avg_sq_patch_index, max_exp_avg_sq_codes, max_exp_avg_sq_scales, max_exp_avg_sq_patch_values, max_exp_avg_sq_patch_index, state_rounding_seed, hp_lr, hp_betas_0, hp_betas_1, hp_eps, hp_weight_decay):
    dequantize_default = torch.ops.lowbit.dequantize.default(exp_avg_codes, exp_avg_scales, exp_avg_patch_values, exp_avg_patch_index, 'sqrt8:512:0:s', 'float32')
    dequantize_default_1 = torch.ops.lowbit.dequantize.default(exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_patch_values, exp_avg_sq_patch_index, 'sqrt8:512:0:u', 'float32')
    dequantize_default_2 = torch.ops.lowbit.dequantize.default(max_exp_avg_sq_codes, max_exp_avg_sq_scales, max_exp_avg_sq_patch_values, max_exp_avg_sq_patch_index, 'sqrt8:512:0:u', 'float32')
    neg = torch.ops.aten.neg.default(grad);  grad = None
    add = torch.ops.aten.add.Tensor(state_step, 1)
    mul = hp_lr * hp_weight_decay;  hp_weight_decay = None
    sub = 1.0 - mul;  mul = None
    mul_1 = torch.ops.aten.mul.Tensor(param, sub);  sub = None
    sub_1 = 1.0 - hp_betas_0
    lerp = torch.ops.aten.lerp.Scalar(dequantize_default, neg, sub_1);  dequantize_default = sub_1 = None
    mul_2 = torch.ops.aten.mul.Tensor(dequantize_default_1, hp_betas_1);  dequantize_default_1 = None
    sub_2 = 1.0 - hp_betas_1
    addcmul = torch.ops.aten.addcmul.default(mul_2, neg, neg, value = sub_2);  mul_2 = neg = sub_2 = None
    _local_scalar_dense = torch.ops.aten._local_scalar_dense.default(add)
    pow_1 = hp_betas_0 ** _local_scalar_dense;  hp_betas_0 = None
    sub_3 = 1.0 - pow_1;  pow_1 = None
    pow_2 = hp_betas_1 ** _local_scalar_dense;  hp_betas_1 = _local_scalar_dense = None
    sub_4 = 1.0 - pow_2;  pow_2 = None
    truediv = hp_lr / sub_3;  hp_lr = sub_3 = None
    pow_3 = sub_4 ** 0.5;  sub_4 = None
    maximum = torch.ops.aten.maximum.default(dequantize_default_2, addcmul);  dequantize_default_2 = None
    sqrt = torch.ops.aten.sqrt.default(maximum)
    div = torch.ops.aten.div.Tensor(sqrt, pow_3);  sqrt = pow_3 = None
    add_1 = torch.ops.aten.add.Tensor(div, hp_eps);  div = hp_eps = None
    neg_1 = -truediv;  truediv = None
    addcdiv = torch.ops.aten.addcdiv.default(mul_1, lerp, add_1, value = neg_1);  mul_1 = add_1 = neg_1 = None
    copy_ = torch.ops.aten.copy_.default(param, addcdiv);  param = addcdiv = copy_ = None
    copy__1 = torch.ops.aten.copy_.default(state_step, add);  state_step = add = copy__1 = None
    quantize__default = torch.ops.lowbit.quantize_.default(lerp, exp_avg_codes, exp_avg_scales, exp_avg_patch_values, exp_avg_patch_index, 'sqrt8:512:0:s');  lerp = exp_avg_codes = exp_avg_scales = exp_avg_patch_values = exp_avg_patch_index = quantize__default = None
    add_tensor = torch.ops.aten.add.Tensor(state_rounding_seed, 1.0)
    remainder_scalar = torch.ops.aten.remainder.Scalar(add_tensor, 16777216.0);  add_tensor = None
    copy__default = torch.ops.aten.copy_.default(state_rounding_seed, remainder_scalar);  remainder_scalar = copy__default = None
    quantize_stochastic__default = torch.ops.lowbit.quantize_stochastic_.default(addcmul, exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_patch_values, exp_avg_sq_patch_index, state_rounding_seed, 2, 'sqrt8:512:0:u');  addcmul = exp_avg_sq_codes = exp_avg_sq_scales = exp_avg_sq_patch_values = exp_avg_sq_patch_index = quantize_stochastic__default = None
    quantize_stochastic__default_1 = torch.ops.lowbit.quantize_stochastic_.default(maximum, max_exp_avg_sq_codes, max_exp_avg_sq_scales, max_exp_avg_sq_patch_values, max_exp_avg_sq_patch_index, state_rounding_seed, 3, 'sqrt8:512:0:u');  maximum = max_exp_avg_sq_codes = max_exp_avg_sq_scales = max_exp_avg_sq_patch_values = max_exp_avg_sq_patch_index = state_rounding_seed = quantize_stochastic__default_1 = None
    return None""")

    def test_split_adamw(self):
        g = pass_graphs(_adamw())
        self.assertExpectedInline(code(g["split"]), """\
def forward(self, param, grad, state_step, exp_avg_codes, exp_avg_scales, exp_avg_patch_values, exp_avg_patch_index, exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_patch_values, exp_avg_sq_patch_index, state_rounding_seed, hp_lr, hp_betas_0, hp_betas_1, hp_eps, hp_weight_decay):
    prologue = self.prologue(state_step, state_rounding_seed, hp_lr, hp_betas_0, hp_betas_1, hp_eps, hp_weight_decay);  state_step = state_rounding_seed = hp_lr = hp_betas_0 = hp_weight_decay = None
    sub = prologue[0]
    sub_1 = prologue[1]
    sub_2 = prologue[2]
    pow_3 = prologue[3]
    neg = prologue[4]
    clone_default = prologue[5];  prologue = None
    body = self.body(param, grad, exp_avg_codes, exp_avg_scales, exp_avg_patch_values, exp_avg_patch_index, exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_patch_values, exp_avg_sq_patch_index, sub, sub_1, hp_betas_1, sub_2, pow_3, hp_eps, neg, clone_default);  param = grad = exp_avg_codes = exp_avg_scales = exp_avg_patch_values = exp_avg_patch_index = exp_avg_sq_codes = exp_avg_sq_scales = exp_avg_sq_patch_values = exp_avg_sq_patch_index = sub = sub_1 = hp_betas_1 = sub_2 = pow_3 = hp_eps = neg = clone_default = body = None
    return None""")
        self.assertExpectedInline(code(g["split"].prologue), """\
def forward(self, state_step, state_rounding_seed, hp_lr, hp_betas_0, hp_betas_1, hp_eps, hp_weight_decay):
    clone_default = torch.ops.aten.clone.default(state_rounding_seed)
    add = torch.ops.aten.add.Tensor(state_step, 1)
    mul = hp_lr * hp_weight_decay;  hp_weight_decay = None
    sub = 1.0 - mul;  mul = None
    sub_1 = 1.0 - hp_betas_0
    sub_2 = 1.0 - hp_betas_1
    _local_scalar_dense = torch.ops.aten._local_scalar_dense.default(add)
    pow_1 = hp_betas_0 ** _local_scalar_dense;  hp_betas_0 = None
    sub_3 = 1.0 - pow_1;  pow_1 = None
    pow_2 = hp_betas_1 ** _local_scalar_dense;  hp_betas_1 = _local_scalar_dense = None
    sub_4 = 1.0 - pow_2;  pow_2 = None
    truediv = hp_lr / sub_3;  hp_lr = sub_3 = None
    pow_3 = sub_4 ** 0.5;  sub_4 = None
    neg = -truediv;  truediv = None
    copy__1 = torch.ops.aten.copy_.default(state_step, add);  state_step = add = copy__1 = None
    add_tensor = torch.ops.aten.add.Tensor(state_rounding_seed, 1.0)
    remainder_scalar = torch.ops.aten.remainder.Scalar(add_tensor, 16777216.0);  add_tensor = None
    copy__default = torch.ops.aten.copy_.default(state_rounding_seed, remainder_scalar);  state_rounding_seed = remainder_scalar = copy__default = None
    return (sub, sub_1, sub_2, pow_3, neg, clone_default)""")
        self.assertExpectedInline(code(g["split"].body), """\
def forward(self, param, grad, exp_avg_codes, exp_avg_scales, exp_avg_patch_values, exp_avg_patch_index, exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_patch_values, exp_avg_sq_patch_index, sub, sub_1, hp_betas_1, sub_2, pow_3, hp_eps, neg, clone_default):
    dequantize_default = torch.ops.lowbit.dequantize.default(exp_avg_codes, exp_avg_scales, exp_avg_patch_values, exp_avg_patch_index, 'sqrt8:512:0:s', 'float32')
    dequantize_default_1 = torch.ops.lowbit.dequantize.default(exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_patch_values, exp_avg_sq_patch_index, 'sqrt8:512:0:u', 'float32')
    mul_1 = torch.ops.aten.mul.Tensor(param, sub);  sub = None
    lerp = torch.ops.aten.lerp.Scalar(dequantize_default, grad, sub_1);  dequantize_default = sub_1 = None
    mul_2 = torch.ops.aten.mul.Tensor(dequantize_default_1, hp_betas_1);  dequantize_default_1 = hp_betas_1 = None
    addcmul = torch.ops.aten.addcmul.default(mul_2, grad, grad, value = sub_2);  mul_2 = grad = sub_2 = None
    sqrt = torch.ops.aten.sqrt.default(addcmul)
    div = torch.ops.aten.div.Tensor(sqrt, pow_3);  sqrt = pow_3 = None
    add_1 = torch.ops.aten.add.Tensor(div, hp_eps);  div = hp_eps = None
    addcdiv = torch.ops.aten.addcdiv.default(mul_1, lerp, add_1, value = neg);  mul_1 = add_1 = neg = None
    copy_ = torch.ops.aten.copy_.default(param, addcdiv);  param = addcdiv = copy_ = None
    quantize__default = torch.ops.lowbit.quantize_.default(lerp, exp_avg_codes, exp_avg_scales, exp_avg_patch_values, exp_avg_patch_index, 'sqrt8:512:0:s');  lerp = exp_avg_codes = exp_avg_scales = exp_avg_patch_values = exp_avg_patch_index = quantize__default = None
    quantize_stochastic__default = torch.ops.lowbit.quantize_stochastic_.default(addcmul, exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_patch_values, exp_avg_sq_patch_index, clone_default, 2, 'sqrt8:512:0:u');  addcmul = exp_avg_sq_codes = exp_avg_sq_scales = exp_avg_sq_patch_values = exp_avg_sq_patch_index = clone_default = quantize_stochastic__default = None
    return None""")

    def test_tensor_lr_is_a_graph_input(self):
        g = pass_graphs(_adamw(lr=torch.tensor(0.01), weight_decay=0.1))
        self.assertExpectedInline(code(g["split"].prologue), """\
def forward(self, state_step, state_rounding_seed, hp_lr, hp_betas_0, hp_betas_1, hp_eps, hp_weight_decay):
    clone_default = torch.ops.aten.clone.default(state_rounding_seed)
    add = torch.ops.aten.add.Tensor(state_step, 1)
    mul = torch.ops.aten.mul.Tensor(hp_lr, hp_weight_decay);  hp_weight_decay = None
    rsub = torch.ops.aten.rsub.Scalar(mul, 1);  mul = None
    sub = 1.0 - hp_betas_0
    sub_1 = 1.0 - hp_betas_1
    _local_scalar_dense = torch.ops.aten._local_scalar_dense.default(add)
    pow_1 = hp_betas_0 ** _local_scalar_dense;  hp_betas_0 = None
    sub_2 = 1.0 - pow_1;  pow_1 = None
    pow_2 = hp_betas_1 ** _local_scalar_dense;  hp_betas_1 = _local_scalar_dense = None
    sub_3 = 1.0 - pow_2;  pow_2 = None
    div = torch.ops.aten.div.Tensor(hp_lr, sub_2);  hp_lr = sub_2 = None
    pow_3 = sub_3 ** 0.5;  sub_3 = None
    neg = torch.ops.aten.neg.default(div);  div = None
    _local_scalar_dense_1 = torch.ops.aten._local_scalar_dense.default(neg);  neg = None
    copy__1 = torch.ops.aten.copy_.default(state_step, add);  state_step = add = copy__1 = None
    add_tensor = torch.ops.aten.add.Tensor(state_rounding_seed, 1.0)
    remainder_scalar = torch.ops.aten.remainder.Scalar(add_tensor, 16777216.0);  add_tensor = None
    copy__default = torch.ops.aten.copy_.default(state_rounding_seed, remainder_scalar);  state_rounding_seed = remainder_scalar = copy__default = None
    return (rsub, sub, sub_1, pow_3, _local_scalar_dense_1, clone_default)""")

    def test_fp32_states_are_not_rewritten(self):
        g = pass_graphs(_adamw(), fmt="fp32")
        self.assertEqual(code(g["quantized"]), code(g["roles"]))


def test_passes_are_pure():
    g = pass_graphs(_adam())
    before = code(g["traced"])
    label_roles(g["traced"])
    assert code(g["traced"]) == before
    assert "lowbit" not in code(g["roles"])


def test_at_most_one_trace_per_signature():
    """Probing the schema, inferring signs and building the pass graphs share one trace (cached
    across formats and optimizers: a second call traces nothing)."""
    before = trace_count()
    pass_graphs(_adam(amsgrad=True, maximize=True))
    assert trace_count() - before <= 1
    pass_graphs(_adam(amsgrad=True, maximize=True), fmt="fp8_e4m3")
    assert trace_count() - before <= 1


def test_non_elementwise_step_is_refused():
    class NormalizedSGD(torch.optim.Optimizer):
        def __init__(self, params, lr=0.1):
            super().__init__(params, {"lr": lr})

        @each_param
        def step(self, group, p, state):
            if not state:
                state["buf"] = torch.zeros_like(p)
            state["buf"].add_(p.grad)
            p.add_(state["buf"] / state["buf"].norm(), alpha=-group["lr"])

    opt = NormalizedSGD([torch.nn.Parameter(torch.randn(64))])
    traced_graph = _trace_custom(opt)
    with pytest.raises(NotElementwiseError, match="linalg_vector_norm"):
        label_roles(traced_graph)


def _trace_custom(opt):
    from lowbit_compile.passes.trace import trace_step

    group = opt.param_groups[0]
    p = group["params"][0]
    return trace_step(opt, group, p.dtype, p.device, {"buf": torch.zeros_like(p)}, ("buf",)).graph
