"""What cannot follow a released backward (``release_grads=True``), refused before the first released step
where it can be seen then: a training framework set to clip by the global norm or to accumulate behind
the optimizer's back (found on the stack of the backward), DDP (its all-reduce completes the grads after
their hooks), a GradScaler (its inf check needs every grad before any step) and a monitor (it samples
the grads at ``opt.step()``). Whatever slips past reads a :class:`~lowbit_compile.released_grad.ReleasedGrad`
later and fails there."""

from __future__ import annotations

import functools
import gc
import inspect
import sys
import weakref
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch

from ..state import sharding

_RELEASING: weakref.WeakSet = weakref.WeakSet()  # every live Release: while one lives, GradScaler.scale refuses


# Why a monitor and gradient release (release_grads=True) refuse each other.
RELEASE_REFUSAL = (
    "release_grads=True cannot combine with a monitor (monitor=, lowbit_compile.monitor, the HF and Lightning "
    "monitor callbacks): a monitor measures, at opt.step(), the step the grads will make, and release has "
    "stepped each param and freed its grad in backward. Monitor a run without release_grads, or release "
    "without monitoring")


class SamplesAtStep:
    """What reads an optimizer's grads at ``opt.step()`` from a step pre-hook (a monitor): release, which has
    stepped every param and freed its grad by then, refuses to run beside it."""


def check_monitor(opt: torch.optim.Optimizer) -> None:
    """Refuse to release the grads of an optimizer a monitor samples (``monitor``, ``enable(monitor=)``)."""
    if any(isinstance(getattr(h, "__self__", None), SamplesAtStep) for h in opt._optimizer_step_pre_hooks.values()):
        raise ValueError(RELEASE_REFUSAL)


def check_first_release(opt: torch.optim.Optimizer, param: torch.Tensor) -> None:
    """Before the first released step of ``opt``: refuse a distributed run whose grads are not complete when
    their hooks fire (DDP) and the settings of a framework on the backward's stack that need the grads."""
    dist = torch.distributed
    if not sharding.is_sharded(param) and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            "lowbit_compile: release_grads=True in a distributed run steps each parameter when its grad lands; "
            "for a plain (unsharded) parameter that is its local grad, before DDP (or an all-reduce after backward) "
            "averages it across ranks. Shard the model with FSDP2's fully_shard (its reduce-scattered grads "
            "release as each lands), or wrap the optimizer with release_grads=False")
    frameworks = tuple(m for m in _FRAMEWORKS if m in sys.modules)
    if not frameworks:
        return
    for frame in _backward_stack():
        if frame.f_globals.get("__name__", "").startswith(frameworks):
            found = _framework_refusal(_self_of(frame))
            if found:
                raise RuntimeError(f"lowbit_compile: {found}")


_FRAMEWORKS = ("lightning.pytorch", "pytorch_lightning", "transformers")  # modules whose trainers are looked for


def _self_of(frame: FrameType) -> object:
    """The ``self`` of a method's frame, without leaving a snapshot of the frame's locals behind (before
    Python 3.13 ``f_locals`` caches one in the frame, which would keep its tensors alive while it runs)."""
    if not frame.f_code.co_flags & inspect.CO_OPTIMIZED or frame.f_code.co_varnames[:1] != ("self",):
        return None
    locals_ = frame.f_locals
    obj = locals_.get("self")
    if sys.version_info < (3, 13):  # a snapshot dict (3.13 gives a view of the frame instead)
        locals_.clear()
    return obj


def _framework_refusal(obj: Any) -> str | None:
    """Why release cannot run under ``obj`` if it is a training framework's trainer set to need the grads."""
    lightning = [sys.modules[m].Trainer for m in ("lightning.pytorch", "pytorch_lightning") if m in sys.modules]
    if lightning and isinstance(obj, tuple(lightning)):
        if obj.gradient_clip_val:
            return (f"Lightning's Trainer(gradient_clip_val={obj.gradient_clip_val}) clips the grads after backward, "
                    "but release_grads=True steps and frees each grad in backward: set gradient_clip_val=None, or "
                    "wrap the optimizer with release_grads=False")
        if obj.accumulate_grad_batches > 1:
            return (f"Lightning's Trainer(accumulate_grad_batches={obj.accumulate_grad_batches}) runs the backwards "
                    "that accumulate outside optimizer.step(), where release_grads=True would step each one: set "
                    "accumulate_grad_batches=1 (and a larger batch), or wrap the optimizer with release_grads=False")
    hf = sys.modules.get("transformers.trainer")
    if hf is not None and isinstance(obj, hf.Trainer) and obj.args.max_grad_norm > 0:
        return (f"HF Trainer's TrainingArguments(max_grad_norm={obj.args.max_grad_norm}) clips the grads by their "
                "global norm after backward, but release_grads=True steps and frees each grad in backward: set "
                "max_grad_norm=0 (the logged grad norm stays exact), or wrap the optimizer with release_grads=False")
    return None


def _backward_stack() -> Iterator[FrameType]:
    """The frames of the thread that called backward: this one (a CPU backward runs hooks on the caller's
    thread) or, when the engine runs the hook on a device thread, the thread waiting in backward."""
    here = list(_frames(sys._getframe(1)))
    if not any(map(_in_backward, here)):
        for frame in sys._current_frames().values():
            frames = list(_frames(frame))
            if any(map(_in_backward, frames)):
                return iter(frames)
    return iter(here)


def _frames(frame: FrameType | None) -> Iterator[FrameType]:
    while frame is not None:
        yield frame
        frame = frame.f_back


def _in_backward(frame: FrameType) -> bool:
    return frame.f_code.co_name == "_engine_run_backward" and frame.f_globals.get("__name__") == "torch.autograd.graph"


def _releasing() -> bool:
    """Whether some optimizer releases grads now (one that died but is not collected yet does not)."""
    if not any(r.hooked for r in _RELEASING):
        return False
    gc.collect()
    return any(r.hooked for r in _RELEASING)


def guard_grad_scaler(release: object) -> None:
    """While ``release`` lives, an enabled ``torch.amp.GradScaler`` refuses to scale a loss: the scaled
    grads would step in backward before its inf check and its unscale."""
    _RELEASING.add(release)
    scaler = torch.amp.GradScaler
    if getattr(scaler.scale, "_lowbit_guard", False):
        return
    stock = scaler.scale

    @functools.wraps(stock)
    def scale(self: torch.amp.GradScaler, outputs: Any) -> Any:
        if self._enabled and _releasing():
            raise RuntimeError(
                "lowbit_compile: GradScaler (fp16 loss scaling) cannot combine with release_grads=True: its inf "
                "check needs every grad before any parameter steps, and release steps each in backward. Train in "
                "bf16 (no scaler), pass GradScaler(enabled=False), or wrap the optimizer with release_grads=False")
        return stock(self, outputs)

    scale._lowbit_guard = True  # type: ignore[attr-defined]
    scaler.scale = scale
