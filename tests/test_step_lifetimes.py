"""What a step keeps after it ends: no grad, no param storage it let go of, no hyperparameter tensor,
on every backend and path; and what it reads each step: a grad whose storage was swapped, or a
strided grad updated in place, is read as it is now (``fmt="fp32"`` stays stock bit for bit)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from lowbit_compile import enable
from lowbit_compile import lowbit_compile as wrap
from lowbit_compile import optim as lowbit_optim

BF16 = torch.bfloat16
SHAPES = [(64, 80), (80,), (33, 7)]  # one quantized (above min_8bit_size), two stock fp32


def _params(shapes=SHAPES, dtype=torch.float32, seed=0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _assert_grads_die(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int = 3,
                      interpreter_cycles: bool = False) -> None:
    """Each step's grads (their storage) are freed by ``zero_grad(set_to_none=True)``, with no
    garbage collection: nothing but ``p.grad`` referred to them. Triton's interpreter leaves its last
    launch's arguments in a reference cycle (compiled kernels do not): there, after a collection."""
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen).to(p.dtype)
            if i == 0 and step == 1 and p.dim() == 2:  # a strided grad too
                g = torch.randn(tuple(reversed(p.shape)), generator=gen).to(p.dtype).t()
            p.grad = g
        del g
        storages = [weakref.ref(p.grad.untyped_storage()) for p in params]
        opt.step()
        opt.zero_grad(set_to_none=True)
        if interpreter_cycles:
            gc.collect()
        assert [r() is None for r in storages] == [True] * len(params), step


CASES = {
    "cpu": dict(backend="cpu"),
    "cpu-fp32": dict(fmt="fp32", backend="cpu"),
    "reference": dict(fmt="int8", backend="reference", min_8bit_size=0),
    "triton": dict(fmt="int8", backend="triton", min_8bit_size=0),
    "stochastic": dict(backend="cpu", rounding="stochastic", min_8bit_size=0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_grads_die_at_zero_grad(case):
    params = _params()
    _assert_grads_die(wrap(torch.optim.AdamW(params, weight_decay=0.1), **CASES[case]), params,
                      interpreter_cycles=case == "triton")


@pytest.mark.parametrize("mode", ["exact", "8bit"])
def test_grads_die_at_zero_grad_with_master_weights(mode):
    params = _params(dtype=BF16)
    _assert_grads_die(wrap(torch.optim.AdamW(params), master_weights=mode), params)


def test_grads_die_at_zero_grad_with_many_small_tensors():
    """One launch over many rows (the launch plan small tensors share) binds grads per step only."""
    params = _params([(n,) for n in range(40, 240, 5)])
    opt = wrap(torch.optim.Adam(params), backend="cpu", min_8bit_size=0)
    _assert_grads_die(opt, params, steps=4)
    assert opt._lowbit.plan is not None  # the steady steps replayed the plan


def test_grads_die_at_zero_grad_in_an_enable_scope():
    params = _params()
    opt = torch.optim.AdamW(params)
    with enable():
        _assert_grads_die(opt, params)


def test_grads_die_at_zero_grad_with_an_optim_class():
    params = _params()
    _assert_grads_die(lowbit_optim.AdamW(params, weight_decay=0.1), params)


def test_a_replaced_param_storage_and_tensor_lr_are_let_go_after_the_step():
    """``p.data = new`` (as ``module.to``/``half`` do) between steps frees the old storage at once, and
    a tensor lr replaced in the group is freed too: the plan holds neither."""
    params = _params()
    opt = wrap(torch.optim.AdamW(params), backend="cpu")
    opt.param_groups[0]["lr"] = torch.tensor(1e-3)  # not in opt.defaults, which stock keeps
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    opt.step()
    old = [weakref.ref(p.untyped_storage()) for p in params]
    lr = weakref.ref(opt.param_groups[0]["lr"])
    for p in params:
        p.data = p.detach().clone()
    opt.param_groups[0]["lr"] = torch.tensor(2e-3)
    assert [r() is None for r in old] == [True] * len(params)
    assert lr() is None
    opt.step()  # and the plan follows the new storage
    assert all(torch.isfinite(p).all() for p in params)


# stale grads ---------------------------------------------------------------------------------------
def _stock_twin(params):
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    return twin, torch.optim.AdamW(twin, weight_decay=0.1, foreach=False)


@pytest.mark.parametrize("swap", ["data", "set_"])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_grad_whose_storage_is_swapped_is_read_from_its_new_storage(swap, backend):
    """``p.grad.data = t`` and ``p.grad.set_(t)`` keep the grad object and change its storage:
    every step reads the storage the grad has now (fp32 stays stock bit for bit)."""
    params = _params()
    twin, stock = _stock_twin(params)
    opt = wrap(torch.optim.AdamW(params, weight_decay=0.1), "fp32", backend=backend)
    gen = torch.Generator().manual_seed(2)
    for p, q in zip(params, twin):
        p.grad = torch.randn(p.shape, generator=gen)
        q.grad = p.grad.clone()
    for step in range(4):
        for p, q in zip(params, twin):
            new = torch.randn(p.shape, generator=gen)
            if swap == "data":
                p.grad.data = new
            else:
                p.grad.set_(new)
            q.grad.copy_(new)
        opt.step()
        stock.step()
        assert all(torch.equal(p, q) for p, q in zip(params, twin)), step


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_strided_grad_updated_in_place_is_read_as_it_is_now(backend):
    """A contiguous param whose grad is strided and accumulates in place (``zero_grad(set_to_none=False)``,
    then ``add_``): each step reads the grad's current values, never an older copy."""
    params = _params()
    twin, stock = _stock_twin(params)
    opt = wrap(torch.optim.AdamW(params, weight_decay=0.1), "fp32", backend=backend)
    for p, q in zip(params, twin):
        if p.dim() == 2:
            p.grad = torch.zeros(tuple(reversed(p.shape))).t()
            q.grad = torch.zeros(tuple(reversed(p.shape))).t()
        else:
            p.grad, q.grad = torch.zeros(p.shape), torch.zeros(p.shape)
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        opt.zero_grad(set_to_none=False)
        stock.zero_grad(set_to_none=False)
        for _ in range(2):
            for p, q in zip(params, twin):
                g = torch.randn(p.shape, generator=gen)
                p.grad.add_(g)
                q.grad.add_(g)
        assert not params[0].grad.is_contiguous()
        opt.step()
        stock.step()
        assert all(torch.equal(p, q) for p, q in zip(params, twin)), step


def _transpose_data(grad: torch.Tensor) -> None:
    grad.data = grad.data.t()


def _shorten_data(grad: torch.Tensor) -> None:
    grad.data = grad.data.reshape(-1)[:100]


# how a grad is restrided, then shrunk, at the same address; whether its version stays too
RESTRIDES = {"in place": (torch.Tensor.t_, lambda g: g.resize_(63, 64), False),
             "data": (_transpose_data, _shorten_data, True)}


@pytest.mark.parametrize("restride", list(RESTRIDES))
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_grad_restrided_at_the_same_address_is_read_as_it_is_now(restride, backend):
    """The same grad objects at the same data pointers, transposed between steps (``t_`` in place, or
    ``.data =`` a transposed view of its own storage, which keeps its version too) and written in
    place: each step reads the grad's current layout; a grad shrunk at the same address (``resize_``,
    ``.data = g[:n]``) is refused, not read past its end."""
    transpose, shrink, same_version = RESTRIDES[restride]
    params = _params([(48, 48), (64, 64)])
    twin, stock = _stock_twin(params)
    opt = wrap(torch.optim.AdamW(params, weight_decay=0.1), "fp32", backend=backend)
    gen = torch.Generator().manual_seed(4)
    for p, q in zip(params, twin):
        p.grad, q.grad = torch.zeros(p.shape), torch.zeros(p.shape)
    for step in range(4):
        for p, q in zip(params, twin):
            ptr, version = p.grad.data_ptr(), p.grad._version
            if step:
                transpose(p.grad)
                transpose(q.grad)
            assert p.grad.data_ptr() == ptr
            assert p.grad._version == version or not same_version
            g = torch.randn(p.shape, generator=gen)
            with torch.no_grad():
                p.grad.copy_(g)
                q.grad.copy_(g)
        opt.step()
        stock.step()
        assert all(torch.equal(p, q) for p, q in zip(params, twin)), step
    shrink(params[1].grad)
    with pytest.raises((ValueError, RuntimeError)):
        opt.step()


# add_param_group after wrapping ----------------------------------------------------------------------
@pytest.mark.parametrize("group", [
    pytest.param(lambda: {"params": [torch.nn.Parameter(torch.randn(10))], "differentiable": True}, id="differentiable"),
    pytest.param(lambda: {"params": [torch.nn.Parameter(torch.randn(10, dtype=torch.complex64))]}, id="complex"),
    pytest.param(lambda: {"params": iter([torch.nn.Parameter(torch.randn(10, dtype=torch.complex64))])}, id="iterator"),
])
def test_add_param_group_after_wrapping_is_checked_like_the_constructor(group):
    """A group the constructor path would refuse is refused by ``add_param_group`` on a wrapped
    optimizer, before it is added: the optimizer keeps its groups and still steps."""
    params = _params()
    opt = wrap(torch.optim.AdamW(params))
    with pytest.raises((ValueError, TypeError), match="lowbit_compile"):
        opt.add_param_group(group())
    assert len(opt.param_groups) == 1
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()


def test_fp16_params_step_in_fp32_so_stock_fp16_non_finite_values_may_become_finite():
    """The fp16 statement of docs/numerics.md: the 8-bit formats compute an fp16 param's update in fp32, so where
    stock fp16 AdamW's own arithmetic overflows or divides by an eps that rounds to 0 in fp16, ours
    stays finite; no element stock keeps finite becomes non-finite."""
    gen = torch.Generator().manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(8192, generator=gen).half())
    twin = torch.nn.Parameter(ours.detach().clone())
    opt = wrap(torch.optim.AdamW([ours]), "int8")
    stock = torch.optim.AdamW([twin], foreach=False)
    for _ in range(3):
        g = (torch.randn(8192, generator=gen) * torch.logspace(-8, 2, 8192)).half()
        ours.grad, twin.grad = g, g.clone()
        opt.step()
        stock.step()
    assert not torch.isfinite(twin).all()  # stock fp16's own step leaves inf/NaN here
    assert torch.isfinite(ours).all()
