"""The passes on the steps of other optimizers: which states the sign analysis proves never negative
(and from which hyperparameter ranges), the pointwise forms of masked fills and constants, branches on
the step count as checks in the graph, states created by the first step, and old scalar states for
the body. Graphs are snapshots: a change in a traced or rewritten graph shows in review."""

from __future__ import annotations

import pytest
import torch
from expecttest import TestCase

from lowbit_compile.ir.contract import set_per_element
from lowbit_compile.passes.roles import label_roles
from lowbit_compile.passes.signs import Interval, prove_nonneg
from lowbit_compile.passes.split import _keep_old_scalar_states, split_prologue
from lowbit_compile.passes.trace import hyper_slots, trace_step
from lowbit_compile.passes.trace_cache import trace_group

from .graphs import code, pass_graphs
from .helpers import each_param


def _proof(opt, state=None, per_element=None):
    group = trace_group(opt.param_groups[0])
    p = group["params"][0]
    if state is None:
        g = label_roles(pass_graphs(opt, "fp32")["traced"])
    else:
        g = label_roles(trace_step(opt, group, p.dtype, p.device, state, per_element).graph)
    return prove_nonneg(g, {s: s.get(group) for s in hyper_slots(group)})


def _param():
    return torch.nn.Parameter(torch.randn(64))


STOCK = {
    "Adam(amsgrad)": lambda: torch.optim.Adam([_param()], amsgrad=True),
    "SGD(momentum)": lambda: torch.optim.SGD([_param()], lr=0.1, momentum=0.9),
    "RMSprop(centered, momentum)": lambda: torch.optim.RMSprop([_param()], centered=True, momentum=0.9),
    "Adagrad": lambda: torch.optim.Adagrad([_param()]),
    "Adamax": lambda: torch.optim.Adamax([_param()]),
    "NAdam": lambda: torch.optim.NAdam([_param()]),
    "RAdam": lambda: torch.optim.RAdam([_param()]),
    "Adadelta": lambda: torch.optim.Adadelta([_param()]),
    "ASGD": lambda: torch.optim.ASGD([_param()]),
    "Rprop": lambda: torch.optim.Rprop([_param()]),
}


class TestSigns(TestCase):
    def test_stock_optimizers(self):
        """Second moments, accumulators and step sizes are proven >= 0, each from the ranges it needs;
        centered RMSprop's sqrt(square_avg - grad_avg**2) is flagged as fragile under quantization."""
        lines = []
        for name, make in STOCK.items():
            proof = _proof(make())
            ranges = ", ".join(f"{k.name} in [{r.lo:g}, {r.hi:g}]" for k, r in proof.assumptions) or "-"
            fragile = "; ".join(f"{node}({', '.join(states)})" for node, states in proof.fragile_roots) or "-"
            lines.append(f"{name}: {sorted(proof.states)} | assumes {ranges} | fragile {fragile}")
        self.assertExpectedInline("\n".join(lines), """\
Adam(amsgrad): ['exp_avg_sq', 'max_exp_avg_sq'] | assumes betas_1 in [0, 1] | fragile -
SGD(momentum): [] | assumes - | fragile -
RMSprop(centered, momentum): ['square_avg'] | assumes alpha in [0, 1] | fragile sqrt(grad_avg, square_avg)
Adagrad: ['sum'] | assumes - | fragile -
Adamax: ['exp_inf'] | assumes eps in [0, 1] | fragile -
NAdam: ['exp_avg_sq'] | assumes betas_1 in [0, 1] | fragile -
RAdam: ['exp_avg_sq'] | assumes betas_1 in [0, 1] | fragile -
Adadelta: ['acc_delta', 'square_avg'] | assumes rho in [0, 1] | fragile -
ASGD: [] | assumes - | fragile -
Rprop: ['step_size'] | assumes step_sizes_0 in [0, 1] | fragile -""")


class Update(torch.optim.Optimizer):
    """One state ``v`` updated by ``rule(v, g, h)`` (h a float hyperparameter); the param by ``v``."""

    def __init__(self, params, rule, h=0.9):
        super().__init__(params, {"h": h})
        self.rule = rule

    @each_param
    def step(self, group, p, state):
        if not state:
            state["v"] = torch.zeros_like(p)
        state["v"].copy_(self.rule(state["v"], p.grad, group["h"]))
        p.sub_(state["v"])


@pytest.mark.parametrize(("rule", "h", "proven", "assumes"), [
    (lambda v, g, h: v * h + (1 - h) * g * g, 0.9, True, [("h", Interval(0.0, 1.0))]),
    (lambda v, g, h: v * h + (1 - h) * g * g, 1.5, False, []),  # 1 - h < 0
    (lambda v, g, h: v.addcmul(g, g, value=h), 0.9, True, [("h", Interval(0.0, 1.0))]),
    (lambda v, g, h: v * h + g, 0.9, False, []),  # g has any sign
    (lambda v, g, h: v - g * g, 0.9, False, []),
    (lambda v, g, h: torch.maximum(v * h, g.abs()), 0.9, True, []),
    (lambda v, g, h: (v + g).clamp(min=0.0), 0.9, True, []),
    (lambda v, g, h: (v + g).clamp(min=-1e-3), 0.9, False, []),
    (lambda v, g, h: v.lerp(g * g, h), 0.9, True, [("h", Interval(0.0, 1.0))]),
    (lambda v, g, h: v.lerp(g * g, h), 2.0, False, []),  # extrapolates
    (lambda v, g, h: torch.where(g > 0, v, g.square()), 0.9, True, []),
    (lambda v, g, h: (v + g.exp()).sqrt() / (h + v), 0.9, True, [("h", Interval(0.0, 1.0))]),
    (lambda v, g, h: v * g.sign() * g.sign(), 0.9, False, []),  # sign(g) * sign(g) is two values here
], ids=["ema of squares", "ema decay above 1", "addcmul", "plus a gradient", "minus a square", "maximum with abs",
        "clamp at 0", "clamp below 0", "lerp to a square", "lerp extrapolating", "where", "sqrt, exp, div",
        "product of two signs"])
def test_sign_rules(rule, h, proven, assumes):
    proof = _proof(Update([_param()], rule, h), {"v": torch.zeros(64)}, ("v",))
    assert (proof.states == {"v"}, [(s.name, r) for s, r in proof.assumptions]) == (proven, assumes)


class TestForms(TestCase):
    def test_rprop_masked_fills_are_where(self):
        """``sign[sign.gt(0)] = etaplus`` is an index_put with a boolean mask: it becomes ``where``, and
        the constant ``1`` a scalar_tensor, so the whole step is pointwise."""
        self.assertExpectedInline(code(pass_graphs(torch.optim.Rprop([_param()], foreach=False), "fp32")["traced"]), """\
def forward(self, param, grad, state_step, state_prev, state_step_size, hp_lr, hp_etas_0, hp_etas_1, hp_step_sizes_0, hp_step_sizes_1):
    add = torch.ops.aten.add.Tensor(state_step, 1)
    mul = torch.ops.aten.mul.Tensor(grad, state_prev)
    sign = torch.ops.aten.sign.default(mul);  mul = None
    gt = torch.ops.aten.gt.Scalar(sign, 0)
    scalar_tensor = torch.ops.aten.scalar_tensor.default(hp_etas_1, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'));  hp_etas_1 = None
    where_self = torch.ops.aten.where.self(gt, scalar_tensor, sign);  gt = scalar_tensor = sign = None
    lt = torch.ops.aten.lt.Scalar(where_self, 0)
    scalar_tensor_1 = torch.ops.aten.scalar_tensor.default(hp_etas_0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
    where_self_1 = torch.ops.aten.where.self(lt, scalar_tensor_1, where_self);  lt = scalar_tensor_1 = where_self = None
    eq = torch.ops.aten.eq.Scalar(where_self_1, 0)
    scalar_tensor_default = torch.ops.aten.scalar_tensor.default(1.0, dtype = torch.float32, device = device(type='cpu'))
    where_self_2 = torch.ops.aten.where.self(eq, scalar_tensor_default, where_self_1);  eq = scalar_tensor_default = where_self_1 = None
    mul_1 = torch.ops.aten.mul.Tensor(state_step_size, where_self_2)
    clamp = torch.ops.aten.clamp.default(mul_1, hp_step_sizes_0, hp_step_sizes_1);  mul_1 = hp_step_sizes_0 = hp_step_sizes_1 = None
    clone = torch.ops.aten.clone.default(grad, memory_format = torch.preserve_format);  grad = None
    eq_1 = torch.ops.aten.eq.Scalar(where_self_2, hp_etas_0);  where_self_2 = hp_etas_0 = None
    scalar_tensor_default_1 = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, device = device(type='cpu'))
    where_self_3 = torch.ops.aten.where.self(eq_1, scalar_tensor_default_1, clone);  eq_1 = scalar_tensor_default_1 = clone = None
    sign_1 = torch.ops.aten.sign.default(where_self_3)
    addcmul = torch.ops.aten.addcmul.default(param, sign_1, clamp, value = -1);  sign_1 = None
    copy_ = torch.ops.aten.copy_.default(param, addcmul);  param = addcmul = copy_ = None
    copy__1 = torch.ops.aten.copy_.default(state_step, add);  state_step = add = copy__1 = None
    copy__2 = torch.ops.aten.copy_.default(state_prev, where_self_3);  state_prev = where_self_3 = copy__2 = None
    copy__3 = torch.ops.aten.copy_.default(state_step_size, clamp);  state_step_size = clamp = copy__3 = None
    return None""")

    def test_sgd_first_step_creates_its_momentum_buffer(self):
        """On the first step SGD's buffer is a copy of the gradient, assigned into the state: the graph
        writes it into a state input it never reads, and quantizing it needs no dequantize."""
        g = pass_graphs(torch.optim.SGD([_param()], lr=0.1, momentum=0.9, foreach=False), "int8")
        self.assertExpectedInline(code(g["quantized"]), """\
def forward(self, param, grad, momentum_buffer_codes, momentum_buffer_scales, momentum_buffer_patch_values, momentum_buffer_patch_index, hp_lr, hp_momentum, hp_dampening, hp_weight_decay):
    clone = torch.ops.aten.clone.default(grad);  grad = None
    neg = -hp_lr;  hp_lr = None
    add = torch.ops.aten.add.Tensor(param, clone, alpha = neg);  neg = None
    copy_ = torch.ops.aten.copy_.default(param, add);  param = add = copy_ = None
    quantize__default = torch.ops.lowbit.quantize_.default(clone, momentum_buffer_codes, momentum_buffer_scales, momentum_buffer_patch_values, momentum_buffer_patch_index, 'int8:512:0:s');  clone = momentum_buffer_codes = momentum_buffer_scales = momentum_buffer_patch_values = momentum_buffer_patch_index = quantize__default = None
    return None""")

    def test_radam_checks_its_rectification_branch(self):
        """``if rho_t > 5`` depends on the step count: the step is traced with the count it has now, and
        the graph checks the branch right where the step decides it, before anything that depends on it."""
        opt = torch.optim.RAdam([_param()], foreach=False)
        self.assertExpectedInline(code(pass_graphs(opt, "fp32")["traced"]), """\
def forward(self, param, grad, state_step, state_exp_avg, state_exp_avg_sq, hp_lr, hp_betas_0, hp_betas_1, hp_eps, hp_weight_decay):
    add = torch.ops.aten.add.Tensor(state_step, 1)
    _local_scalar_dense = torch.ops.aten._local_scalar_dense.default(add)
    sub = 1.0 - hp_betas_0
    lerp = torch.ops.aten.lerp.Scalar(state_exp_avg, grad, sub);  sub = None
    mul = torch.ops.aten.mul.Tensor(state_exp_avg_sq, hp_betas_1)
    sub_1 = 1.0 - hp_betas_1
    addcmul = torch.ops.aten.addcmul.default(mul, grad, grad, value = sub_1);  mul = grad = None
    pow_1 = hp_betas_0 ** _local_scalar_dense;  hp_betas_0 = None
    sub_2 = 1.0 - pow_1;  pow_1 = None
    pow_2 = hp_betas_1 ** _local_scalar_dense
    sub_3 = 1.0 - pow_2;  pow_2 = None
    div = torch.ops.aten.div.Tensor(lerp, sub_2);  sub_2 = None
    truediv = 2.0 / sub_1;  sub_1 = None
    sub_5 = truediv - 1.0;  truediv = None
    mul_1 = 2.0 * _local_scalar_dense
    pow_3 = hp_betas_1 ** _local_scalar_dense;  hp_betas_1 = _local_scalar_dense = None
    mul_2 = mul_1 * pow_3;  mul_1 = pow_3 = None
    truediv_1 = mul_2 / sub_3;  mul_2 = sub_3 = None
    sub_6 = sub_5 - truediv_1;  sub_5 = truediv_1 = None
    gt = sub_6 > 5.0;  sub_6 = None
    check_branch = lowbit_compile_passes_trace_check_branch(gt, False);  gt = check_branch = None
    mul_3 = torch.ops.aten.mul.Tensor(div, hp_lr);  div = hp_lr = None
    add_1 = torch.ops.aten.add.Tensor(param, mul_3, alpha = -1.0);  mul_3 = None
    copy_ = torch.ops.aten.copy_.default(param, add_1);  param = add_1 = copy_ = None
    copy__1 = torch.ops.aten.copy_.default(state_step, add);  state_step = add = copy__1 = None
    copy__2 = torch.ops.aten.copy_.default(state_exp_avg, lerp);  state_exp_avg = lerp = copy__2 = None
    copy__3 = torch.ops.aten.copy_.default(state_exp_avg_sq, addcmul);  state_exp_avg_sq = addcmul = copy__3 = None
    return None""")

    def test_asgd_body_reads_the_scalar_state_from_before_the_prologue_writes_it(self):
        """Once averaging starts, ASGD's ``ax += (param - ax) * mu`` reads the state ``mu`` that the
        same step then replaces: the prologue hands the body a copy taken before its write."""
        opt = torch.optim.ASGD([_param()], t0=3.0, foreach=False)
        state = {"step": torch.tensor(5.0), "eta": torch.tensor(0.01), "mu": torch.tensor(0.5), "ax": torch.zeros(64)}
        group = trace_group(opt.param_groups[0])
        traced = trace_step(opt, group, torch.float32, torch.device("cpu"), state, ("ax",))
        split = split_prologue(label_roles(traced.graph))
        self.assertExpectedInline(code(split.body), """\
def forward(self, param, grad, state_ax, sub, neg, clone_default):
    mul_1 = torch.ops.aten.mul.Tensor(param, sub);  sub = None
    add_1 = torch.ops.aten.add.Tensor(mul_1, grad, alpha = neg);  mul_1 = grad = neg = None
    sub_1 = torch.ops.aten.sub.Tensor(add_1, state_ax)
    mul_2 = torch.ops.aten.mul.Tensor(sub_1, clone_default);  sub_1 = clone_default = None
    add_2 = torch.ops.aten.add.Tensor(state_ax, mul_2);  mul_2 = None
    copy_ = torch.ops.aten.copy_.default(param, add_1);  param = add_1 = copy_ = None
    copy__4 = torch.ops.aten.copy_.default(state_ax, add_2);  state_ax = add_2 = copy__4 = None
    return None""")

    def test_old_scalar_states_are_copied_in_graph_order(self):
        """The copies of several scalar states the body reads (an 8-bit master's seed beside a stochastic
        state's counter) come in the order of the states, not of their nodes' addresses: a set had named
        them, and so printed the kernel's source (its cache key), differently from process to process."""
        aten = torch.ops.aten
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        set_per_element(x, True)
        states = [graph.placeholder(f"s{i}") for i in range(24)]
        for state in states:
            set_per_element(graph.call_function(aten.mul.Tensor, (x, state)), True)
        for state in states:
            graph.call_function(aten.copy_.default, (state, graph.call_function(aten.add.Tensor, (state, 1.0))))
        graph.output(None)
        _keep_old_scalar_states(graph)
        clones = [n for n in graph.nodes if n.target is aten.clone.default]
        self.assertEqual([c.args[0] for c in clones], states)
        self.assertEqual([c.name for c in clones], ["clone_default"] + [f"clone_default_{i}" for i in range(1, 24)])
