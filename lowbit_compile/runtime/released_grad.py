"""The placeholder that gradient release (``release_grads=True``, ``release.py``) leaves in ``p.grad`` once
a parameter has stepped in backward and its grad is freed: a tensor of the grad's shape and dtype that
holds no storage. It answers what it can answer exactly (the grad's norm, taken before the grad was
freed, so a logged grad norm stays right; a clip with ``max_norm=inf``, which scales by 1) and refuses
every other read with an error that says why the grad is gone and what to change: code that reads grads
after a released backward fails loudly instead of finding none."""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

aten = torch.ops.aten

_NORMS = (aten.linalg_vector_norm.default, aten._foreach_norm.Scalar)
_ZEROS = (aten.zero_.default, aten._foreach_zero_.default)
_SCALINGS = (aten.mul_.Tensor, aten.mul_.Scalar, aten._foreach_mul_.Tensor, aten._foreach_mul_.Scalar,
             aten._foreach_mul_.ScalarList, aten._foreach_mul_.List)
_ACCUMULATIONS = (aten.add_.Tensor, aten._foreach_add_.List)

RELEASE_FIXES = (
    "Code that needs the grads after backward cannot follow a released backward: a global-norm clip "
    "(clip_grad_norm_; HF Trainer's max_grad_norm, Lightning's gradient_clip_val), GradScaler (fp16 loss "
    "scaling), DDP (its all-reduce writes the grads after backward), another optimizer stepping the same "
    "parameter, or code that reads p.grad. Turn that off, or wrap the optimizer with release_grads=False "
    "(the grads then live until zero_grad)")


class ReleasedGrad(torch.Tensor):
    """``p.grad`` after ``p`` stepped in backward: the grad's shape and dtype, no storage. ``norm`` is the
    grad's 2-norm (as ``torch._foreach_norm`` gave it), ``param_name`` the parameter's name when known, and
    ``zeroed`` whether ``zero_grad(set_to_none=False)`` zeroed it (the next backward then starts from 0)."""

    norm: torch.Tensor
    param_name: str | None
    zeroed: bool

    @staticmethod
    def __new__(cls, grad: torch.Tensor, norm: torch.Tensor, name: str | None = None) -> ReleasedGrad:
        out = torch.Tensor._make_wrapper_subclass(cls, grad.shape, dtype=grad.dtype, device=grad.device,
                                                  requires_grad=False)
        out.norm, out.param_name, out.zeroed = norm, name, False
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (f"ReleasedGrad(shape={tuple(self.shape)}, dtype={self.dtype}, norm={self.norm.item():.6g}: stepped "
                "in backward and freed by release_grads=True)")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        first = args[0]
        if func in _ZEROS:
            for t in first if isinstance(first, (list, tuple)) else [first]:
                if isinstance(t, ReleasedGrad):
                    t.zeroed = True
                else:
                    t.zero_()
            return None if func is aten._foreach_zero_.default else first
        if func in _NORMS:
            return _norms(func, args, kwargs)
        if func in _SCALINGS and any(isinstance(t, ReleasedGrad) for t in _released_in(args[:1])):
            return _scale_by_one(func, first)
        owner = next(t for t in _released_in(args) if isinstance(t, ReleasedGrad))
        if func in _ACCUMULATIONS and any(isinstance(t, ReleasedGrad) for t in _released_in(args[:1])):
            if owner.zeroed:  # FSDP2 adds into a sharded grad it finds, without the pre-hook that takes it away
                raise RuntimeError(
                    f"lowbit_compile: a backward accumulated into {owner._what()}, which release_grads=True stepped "
                    "and freed and zero_grad(set_to_none=False) zeroed; under FSDP2 call opt.zero_grad() "
                    "(set_to_none=True, the default) instead")
            raise RuntimeError(
                f"lowbit_compile: a backward accumulated into {owner._what()}, which an earlier backward stepped "
                "and freed (release_grads=True). Call opt.zero_grad() after opt.step(); to accumulate grads over "
                "several backwards, run all but the last inside `with opt.no_step():`")
        raise RuntimeError(f"lowbit_compile: {func} read {owner._what()}, which release_grads=True stepped in "
                           f"backward and freed. {RELEASE_FIXES}.")

    def _what(self) -> str:
        return f"the grad of {self.param_name!r}" if self.param_name else "a parameter's grad"


def is_released(grad: torch.Tensor | None) -> bool:
    """Whether ``grad`` (a ``p.grad``) is a released one, itself or as a sharded (``DTensor``) grad's shard."""
    return type(grad) is ReleasedGrad or type(getattr(grad, "_local_tensor", None)) is ReleasedGrad


def local_released(grad: torch.Tensor) -> ReleasedGrad:
    """The :class:`ReleasedGrad` of a released ``p.grad`` (a sharded one's shard)."""
    return grad if type(grad) is ReleasedGrad else grad._local_tensor


def _released_in(args: tuple) -> list:
    flat: list = []
    for a in args:
        flat.extend(a if isinstance(a, (list, tuple)) else [a])
    return flat


def _norms(func: Any, args: tuple, kwargs: dict) -> Any:
    """The recorded 2-norms of released grads; the norms of plain ones beside them computed as asked."""
    ord_ = kwargs.get("ord", args[1] if len(args) > 1 else 2)
    if func is aten.linalg_vector_norm.default:
        self = args[0]
        dim = kwargs.get("dim", args[2] if len(args) > 2 else None)
        keepdim = kwargs.get("keepdim", args[3] if len(args) > 3 else False)
        dtype = kwargs.get("dtype")
        if float(ord_) != 2.0 or dim not in (None, [], ()) or keepdim or dtype not in (None, self.norm.dtype):
            raise RuntimeError(f"lowbit_compile: torch.linalg.vector_norm(ord={ord_}, dim={dim}) of "
                               f"{self._what()}, which release_grads=True stepped in backward and freed: only its "
                               f"2-norm over all elements was kept. {RELEASE_FIXES}.")
        return self.norm.clone()
    tensors = args[0]
    if float(ord_) != 2.0 or kwargs.get("dtype") is not None:
        owner = next(t for t in tensors if isinstance(t, ReleasedGrad))
        raise RuntimeError(f"lowbit_compile: a {ord_}-norm of {owner._what()}, which release_grads=True stepped in "
                           f"backward and freed: only its 2-norm was kept. {RELEASE_FIXES}.")
    plain = [t for t in tensors if not isinstance(t, ReleasedGrad)]
    computed = iter(torch._foreach_norm(plain, ord_) if plain else [])
    return [t.norm.clone() if isinstance(t, ReleasedGrad) else next(computed) for t in tensors]


def _scale_by_one(func: Any, first: Any) -> Any:
    """A clip's scaling of released grads: a no-op for ``clip_grad_norm_(max_norm=inf)`` (the norm only,
    as HF Trainer logs it), an error naming the setting for a clip that may scale them."""
    max_norm = _clip_max_norm()
    owner = next(t for t in (first if isinstance(first, (list, tuple)) else [first]) if isinstance(t, ReleasedGrad))
    if max_norm is None:
        raise RuntimeError(f"lowbit_compile: {func} scaled {owner._what()}, which release_grads=True stepped in "
                           f"backward and freed. {RELEASE_FIXES}.")
    if not math.isinf(max_norm):
        raise RuntimeError(
            f"lowbit_compile: clip_grad_norm_(max_norm={max_norm:g}) after a backward whose grads release_grads=True "
            "stepped and freed as each completed: the params already stepped with unclipped grads, and a global-norm "
            "clip needs every grad at once. Turn the clip off (HF Trainer: TrainingArguments(max_grad_norm=0); "
            "Lightning: Trainer(gradient_clip_val=None); accelerate: no accelerator.clip_grad_norm_; or "
            "torch.nn.utils.clip_grad_norm_ with max_norm=inf, which only measures the norm), or wrap the optimizer "
            "with release_grads=False")
    return first if func in (aten.mul_.Tensor, aten.mul_.Scalar) else None


def _clip_max_norm() -> float | None:
    """The ``max_norm`` of the ``torch.nn.utils`` clip on the stack (None: the scaling is not a clip's)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__") == "torch.nn.utils.clip_grad" and "max_norm" in frame.f_locals:
            return float(frame.f_locals["max_norm"])
        frame = frame.f_back
    return None
