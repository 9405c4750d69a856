"""Gradient release (``release_grads=True``): each parameter steps inside backward, from a
post-accumulate-grad hook, as soon as its grad is complete, and the grad is freed at once, so the grads
of a model never all exist together.

The step run there is the optimizer's own rewritten step (``rewritten_step``) over just the parameters
whose grads are ready, with the hyperparameters of their groups as they are then, so params and states
are bit for bit those of stepping after backward; ``opt.step()`` completes the iteration (any param whose
grad arrived another way, the step hooks). Large parameters step the moment their grad lands; small ones
(under ``SMALL_NUMEL`` elements) wait for the next large one, a bucket's worth, or the end of backward,
and step with it in one launch per kernel, as the step plan batches them. What a released grad leaves in
``p.grad`` is a :class:`~lowbit_compile.released_grad.ReleasedGrad`; what cannot follow a released
backward is refused by ``release_conflicts``.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator

import torch

from ..passes.trace import hyper_slots, unhooked_step
from ..passes.trace_cache import trace_group
from ..state import sharding
from . import release_conflicts
from .released_grad import ReleasedGrad, is_released, local_released
from .rewritten_step import prepare_params
from .run import StepPlan, group_signature
from .wrapped import Wrapped, wrapped_of

# A parameter with fewer elements waits for others and steps with them: one launch for a bucket of
# small tensors (norms, biases), as the step after backward launches them. The small grads waiting hold
# at most BUCKET_NUMEL elements, and none outlives its backward.
SMALL_NUMEL = 1 << 16
BUCKET_NUMEL = 1 << 20
# Bound launches kept per optimizer (one per bucket that recurs; a new one for each new bucket).
MAX_PLANS = 4096


class Release:
    """What ``release_grads=True`` attaches to a wrapped optimizer (``Wrapped.release``): the hooks on its
    parameters, the bucket of small params waiting, the bound launch of each bucket that recurs, and
    what the backwards since the last ``opt.step()`` stepped. It holds the optimizer weakly and no
    param or grad past the bucket that stepped it."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self._opt = weakref.ref(opt)
        self._hooks: dict[int, tuple[weakref.ref, list]] = {}  # id(param) -> (param, its hook handles)
        self.released: set[int] = set()  # ids of the params stepped in backward since the last opt.step()
        self._used: dict[int, tuple[dict, tuple, list]] = {}  # id(group) -> (group, signature, values) stepped with
        self._pending: list[torch.Tensor] = []
        self._pending_numel = 0
        self._flush_task = -1  # the backward whose end steps what is still pending
        self._plans: dict[tuple[int, ...], StepPlan] = {}
        self.accumulating = 0  # depth of no_step()
        self._checked = False  # what cannot combine with release was looked for at the first released step

    # the parameters' hooks ------------------------------------------------------------------------
    def hook_params(self, opt: torch.optim.Optimizer) -> None:
        """Hook every parameter of ``opt`` not hooked yet (the constructor's, ``add_param_group``'s)."""
        for group in opt.param_groups:
            for param in group["params"]:
                if id(param) in self._hooks or not param.requires_grad:
                    continue
                handles = [param.register_hook(_BeforeGrad(self, param)),
                           param.register_post_accumulate_grad_hook(_OnGrad(self))]
                self._hooks[id(param)] = (weakref.ref(param), handles)

    def unhook(self) -> None:
        """Remove every hook (``restore``, or ``lowbit_compile`` again without ``release_grads``)."""
        for _, handles in self._hooks.values():
            for handle in handles:
                handle.remove()
        self._hooks.clear()
        self._pending.clear()
        self._pending_numel = 0
        self._plans.clear()

    @property
    def hooked(self) -> bool:
        """Whether this release is on: its optimizer lives and its params carry its hooks."""
        return bool(self._hooks) and self._opt() is not None

    def _owns(self, param: torch.Tensor) -> bool:
        entry = self._hooks.get(id(param))
        return entry is not None and entry[0]() is param

    # backward -------------------------------------------------------------------------------------
    def before_grad(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
        """Before a backward's grad accumulates into ``param.grad``: refuse a second backward before
        ``opt.step()`` (its param already stepped) and one that would add to a released grad; a released
        grad that ``zero_grad(set_to_none=False)`` zeroed gives way to ``0 + grad``, as stock adds into zeros."""
        if not self._owns(param):
            return None
        if id(param) in self.released:
            raise RuntimeError(
                f"lowbit_compile: a second backward reached {_label(param, self._opt())} before opt.step(), but "
                "release_grads=True already stepped it with its grad from the first one. To accumulate grads over "
                "several backwards, run all but the last inside `with opt.no_step():` (or wrap the optimizer with "
                "release_grads=False)")
        current = param.grad
        if not is_released(current):
            return None
        if not local_released(current).zeroed:
            raise RuntimeError(
                f"lowbit_compile: a backward reached {_label(param, self._opt())}, whose grad the last step released "
                "(release_grads=True) and nothing has cleared since: call opt.zero_grad() after opt.step(), or, to "
                "accumulate grads over several backwards, run all but the last inside `with opt.no_step():`")
        param.grad = None
        return grad + 0  # what stock's accumulation into a zeroed grad gives (-0.0 becomes 0.0)

    def grad_ready(self, param: torch.Tensor) -> None:
        """``param``'s grad is complete for this backward: queue it and step what is due."""
        opt = self._opt()
        if opt is None or not self._owns(param) or self._accumulating():
            return
        wrapped = wrapped_of(opt)
        if wrapped is None or wrapped.release is not self:
            return
        if not self._checked:
            release_conflicts.check_first_release(opt, param)  # raises before anything steps
            self._checked = True
        if id(param) in self.released:  # FSDP2 hands the grad over without a pre-hook
            self.before_grad(param, param.grad)
        grad = param.grad
        if grad is None or is_released(grad) or param.is_meta or grad.is_sparse or grad.requires_grad:
            # nothing to release here (a grad of backward(create_graph=True) is wanted after backward, for a
            # gradient penalty): opt.step() steps (or refuses) it as without release
            return
        numel = sharding.local(grad).numel()
        self._pending.append(param)
        self._pending_numel += numel
        if numel >= SMALL_NUMEL or self._pending_numel >= BUCKET_NUMEL:
            self.flush(opt, wrapped)
            return
        task = torch._C._current_graph_task_id()
        if task == -1:  # called outside a backward: no end to wait for
            self.flush(opt, wrapped)
        elif task != self._flush_task:
            self._flush_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _accumulating(self) -> bool:
        """In ``no_step()``, or in a backward accelerate (HF Trainer's accumulation, ``accelerator.accumulate``)
        marks as not the last of its step (``GradientState.sync_gradients`` False)."""
        if self.accumulating:
            return True
        state = sys.modules.get("accelerate.state")
        shared = getattr(getattr(state, "GradientState", None), "_shared_state", None)
        return bool(shared) and shared.get("sync_gradients", True) is False

    def _end_of_backward(self) -> None:
        opt = self._opt()
        wrapped = wrapped_of(opt) if opt is not None else None
        if wrapped is not None and wrapped.release is self:
            self.flush(opt, wrapped)
        else:
            self._pending.clear()
            self._pending_numel = 0

    @torch.no_grad()
    def flush(self, opt: torch.optim.Optimizer, wrapped: Wrapped) -> None:
        """Step the pending parameters in one plan, then free their grads."""
        params, self._pending, self._pending_numel = self._pending, [], 0
        if not params:
            return
        with wrapped.lock:
            plan = self._plan(opt, wrapped, params)
            grads = [sharding.local(p.grad) for p in params]
            norms = torch._foreach_norm(grads, 2)  # what clip_grad_norm_ (HF Trainer logs it) reads later
            del grads
            self._note_hyperparameters(opt, plan)
            plan.run()
            names = wrapped.names
            for param, norm in zip(params, norms):
                grad = param.grad
                released = ReleasedGrad(sharding.local(grad), norm, names.get(param))
                param.grad = _sharded_like(released, grad) if sharding.is_sharded(grad) else released
                self.released.add(id(param))

    def _plan(self, opt: torch.optim.Optimizer, wrapped: Wrapped, params: list[torch.Tensor]) -> StepPlan:
        """The bound launch of this bucket: the one kept from an earlier backward if it still binds,
        else a new one (kept if it can be replayed)."""
        key = tuple(map(id, params))
        plan = self._plans.get(key)
        if plan is not None:
            if plan.refresh(opt, wrapped.config):
                return plan
            self._plans.clear()  # something changed (a load, a re-configuration): the others are suspect too
        plan = prepare_params(opt, wrapped, params)
        if plan.reusable and len(self._plans) < MAX_PLANS:
            self._plans[key] = plan
        return plan

    def _note_hyperparameters(self, opt: torch.optim.Optimizer, plan: StepPlan) -> None:
        """Remember the hyperparameters each group's released steps used, to check at ``opt.step()``."""
        step = unhooked_step(type(opt))
        for group in plan.stepped_groups():
            if id(group) not in self._used:
                sig, values = group_signature(group, step)
                self._used[id(group)] = (group, sig, [v.clone() if isinstance(v, torch.Tensor) else v
                                                      for v in values])

    # opt.step() -----------------------------------------------------------------------------------
    def before_step(self, opt: torch.optim.Optimizer) -> None:
        """``opt.step()`` completes the iteration: step what is still pending, refuse a hyperparameter
        changed since the released steps read it, and start the next iteration (hooking new params)."""
        wrapped = wrapped_of(opt)
        self.flush(opt, wrapped)
        try:
            self._check_hyperparameters(opt)
            unhooked = self._earlier_grads(opt)
        finally:
            self.released.clear()
            self._used.clear()
        if unhooked:
            self.hook_params(opt)  # added by add_param_group, or unfrozen, since

    def _earlier_grads(self, opt: torch.optim.Optimizer) -> bool:
        """The released grads of earlier iterations that no backward reached since: one that
        ``zero_grad(set_to_none=False)`` zeroed is a zero grad again (stock steps it: weight decay, the
        moments' decay); one nothing cleared is refused (stock would step it again with the old grad). Also
        whether some param that takes grads has no hooks."""
        hooks, released, unhooked = self._hooks, self.released, False
        for group in opt.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is not None and id(p) not in released and is_released(grad):
                    held = local_released(grad)
                    if not held.zeroed:
                        raise RuntimeError(
                            f"lowbit_compile: opt.step() found {_label(p, opt)} holding the grad an earlier step "
                            "released (release_grads=True), which stock would step again; call opt.zero_grad() after "
                            "opt.step()")
                    zeros = torch.zeros(held.shape, dtype=held.dtype, device=held.device)
                    p.grad = _sharded_like(zeros, grad) if sharding.is_sharded(grad) else zeros
                unhooked = unhooked or (id(p) not in hooks and p.requires_grad)
        return unhooked

    def _check_hyperparameters(self, opt: torch.optim.Optimizer) -> None:
        step = unhooked_step(type(opt))
        for group, sig, used in self._used.values():
            now_sig, now = group_signature(group, step)
            changed = now_sig is not sig or any(not _same(a, b) for a, b in zip(used, now))
            if not changed:
                continue
            index = next((i for i, g in enumerate(opt.param_groups) if g is group), "?")
            names = _slot_names(group)
            diffs = [f"{n}: {_show(a)} -> {_show(b)}" for n, a, b in zip(names, used, now) if not _same(a, b)]
            raise RuntimeError(
                f"lowbit_compile: param_groups[{index}] changed between backward and opt.step() "
                f"({'; '.join(diffs) or 'its flags'}), but release_grads=True stepped its parameters in backward "
                "with the values before. Set hyperparameters before backward (an LR scheduler's "
                "scheduler.step() goes after opt.step(), as torch asks), or wrap with release_grads=False")


class _OnGrad:
    """A parameter's post-accumulate-grad hook; holds its :class:`Release` weakly."""

    __slots__ = ("release",)

    def __init__(self, release: Release) -> None:
        self.release = weakref.ref(release)

    def __call__(self, param: torch.Tensor) -> None:
        release = self.release()
        if release is not None:
            release.grad_ready(param)


class _BeforeGrad:
    """A parameter's tensor pre-hook (before its grad accumulates); holds the param and its release weakly."""

    __slots__ = ("param", "release")

    def __init__(self, release: Release, param: torch.Tensor) -> None:
        self.release = weakref.ref(release)
        self.param = weakref.ref(param)

    def __call__(self, grad: torch.Tensor) -> torch.Tensor | None:
        release, param = self.release(), self.param()
        return release.before_grad(param, grad) if release is not None and param is not None else None


def releaser_of(param: torch.Tensor) -> Release | None:
    """The live :class:`Release` that hooks ``param``, if any (another optimizer's, to refuse sharing)."""
    for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
        release = hook.release() if isinstance(hook, _OnGrad) else None
        if release is not None and release._owns(param):
            return release
    return None


def check_attach(opt: torch.optim.Optimizer) -> None:
    """Refuse to release ``opt``'s grads where that cannot work, before anything changes: a parameter another
    optimizer releases (it would step twice, or once on nothing), an optimizer a monitor samples."""
    wrapped = wrapped_of(opt)
    own = wrapped.release if wrapped is not None else None
    for i, group in enumerate(opt.param_groups):
        for param in group["params"]:
            other = releaser_of(param)
            if other is not None and other is not own:
                raise ValueError(
                    f"param_groups[{i}] holds a parameter that another optimizer already releases "
                    "(release_grads=True): each param steps in backward with the one optimizer whose hook frees its "
                    "grad, so two optimizers cannot step it. Give each parameter to one optimizer")
    release_conflicts.check_monitor(opt)


def attach(opt: torch.optim.Optimizer, wrapped: Wrapped) -> None:
    """Start releasing ``opt``'s grads (``release_grads=True``), or keep doing so after a re-configuration."""
    if wrapped.release is None:
        wrapped.release = Release(opt)
        release_conflicts.guard_grad_scaler(wrapped.release)
    wrapped.release.hook_params(opt)


def detach(opt: torch.optim.Optimizer) -> None:
    """Stop releasing ``opt``'s grads: params and grads step after backward again."""
    wrapped = wrapped_of(opt)
    if wrapped is not None and wrapped.release is not None:
        wrapped.release.unhook()
        wrapped.release = None


@contextlib.contextmanager
def no_step(opt: torch.optim.Optimizer) -> Iterator[None]:
    """Backwards in this block accumulate grads and step nothing, as without release; the next backward
    outside it completes the grads and steps. A no-op for an optimizer that does not release grads."""
    wrapped = wrapped_of(opt)
    release = wrapped.release if wrapped is not None else None
    if release is None:
        yield
        return
    release.accumulating += 1
    try:
        yield
    finally:
        release.accumulating -= 1


def _sharded_like(local: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``local`` as a ``DTensor`` grad of ``grad``'s mesh, placements and global shape (FSDP2 adds the next
    backward's shard into ``grad._local_tensor``)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, grad._spec, requires_grad=False)


def _label(param: torch.Tensor | None, opt: torch.optim.Optimizer | None) -> str:
    wrapped = wrapped_of(opt) if opt is not None else None
    name = wrapped.names.get(param) if wrapped is not None and param is not None else None
    return f"parameter {name!r}" if name else f"a parameter of shape {tuple(param.shape)}"


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _show(value: object) -> str:
    return f"{value.item():g}" if isinstance(value, torch.Tensor) and value.numel() == 1 else f"{value!r}"


def _slot_names(group: dict) -> list[str]:
    return [s.name for s in hyper_slots(trace_group(group))]
