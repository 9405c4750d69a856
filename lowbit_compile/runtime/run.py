"""Run a step: bind each parameter's tensors to its compiled step's inputs (the states once; the
param, grad and hyperparameters for each step, and let go when it ends) and launch every parameter
of a group that shares a kernel in one call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from operator import is_not

import torch

from ..config import Config
from ..ir.contract import Role
from ..kernels.kernel import Launch
from ..passes.trace import hyper_slots, static_group_items, tensor_meta, unhooked_step
from ..passes.trace_cache import LruCache, trace_group
from ..state import sharding
from ..state.schema import filled
from .compile import CompiledStep
from .released_grad import ReleasedGrad, is_released


def _flat(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A 1-D view of ``t`` in logical order, or a contiguous copy (then it must be written back)."""
    if t.is_contiguous():
        return t.view(-1), False
    return t.reshape(-1).clone(), True


def bind_param(compiled: CompiledStep, group: dict, param: torch.Tensor, grad: torch.Tensor,
               state: dict) -> tuple[list, list]:
    """The compiled step's inputs for ``param``, and the (tensor, flat copy) pairs to write back after
    the run. A sharded (``DTensor``) parameter steps its local shard: the update is elementwise, so
    shards step independently."""
    for key, fmt, dtype in compiled.fresh:  # states the step creates: allocated here, written by the run
        if not isinstance(state.get(key), torch.Tensor):
            state[key] = filled(param, 0.0, fmt, dtype)
    param, grad = sharding.local(param), sharding.local(grad)
    state = {k: sharding.local(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    write_back = []
    args = []
    for role, key in compiled.inputs:
        if role in (Role.PARAM, Role.PER_ELEMENT_STATE):
            tensor = param if role is Role.PARAM else state[key]
            flat, copied = _flat(tensor)
            if copied:
                write_back.append((tensor, flat))
            args.append(flat)
        elif role is Role.GRAD:  # in the param's shape: the launch flattens it (a strided one for that run)
            args.append(grad)
        elif role is Role.SCALAR_STATE:
            args.append(state[key])
        elif role is Role.STATE_PART:
            args.append(getattr(state[key[0]], key[1]))
        elif role is Role.MASTER_PART:  # a residual of the param's master: contiguous, in logical order
            args.append(state[key].view(-1))
        else:
            args.append(key.get(group))
    return args, write_back


def group_signature(group: dict, step: Callable | None = None) -> tuple[tuple, list]:
    """What of a param group a prepared step depends on (its flags, which hyperparameters are
    tensors; of ``step``'s traced, the entries it reads), and the hyperparameter values its guards are
    checked on. Computed once per group and step."""
    tgroup = trace_group(group)
    slots = hyper_slots(tgroup)
    meta = tuple((s, tensor_meta(s.get(tgroup)) if s.is_tensor else None) for s in slots)
    sig = (static_group_items(tgroup, slots, step), meta)
    return _signatures.setdefault(sig, sig), [s.get(tgroup) for s in slots]


_signatures: LruCache = LruCache()  # one object per distinct group signature: compared by identity


@dataclass
class Prepared:
    """One parameter's compiled step and state as the last full preparation found them, reused while
    the config, the group's signature, the guard, the param's storage and every state entry are
    still the same objects."""

    compiled: CompiledStep
    state: dict
    entries: tuple
    param_meta: tuple
    config: Config
    group_sig: tuple

    @staticmethod
    def make(compiled: CompiledStep, state: dict, param: torch.Tensor, config: Config,
             group_sig: tuple) -> Prepared:
        return Prepared(compiled, state, tuple(state.items()), _param_meta(param), config, group_sig)

    def still_valid(self, state: dict, param: torch.Tensor, config: Config, group_sig: tuple,
                    guards: dict[int, bool], values: list) -> bool:
        if state is not self.state or config is not self.config or group_sig is not self.group_sig:
            return False
        if len(state) != len(self.entries) or any(state.get(k) is not v for k, v in self.entries):
            return False
        if _param_meta(param) != self.param_meta:
            return False
        ok = guards.get(id(self.compiled))
        if ok is None:
            ok = guards[id(self.compiled)] = bool(self.compiled.guard(values))
        return ok


def _param_meta(param: torch.Tensor) -> tuple:
    return (param.dtype, param.shape, param.device, sharding.local(param).data_ptr(), type(param))


@dataclass
class _Bucket:
    """The parameters of one group that share a compiled step: one launch over their rows."""

    compiled: CompiledStep
    group: dict
    rows: list[list] = field(default_factory=list)
    launch: Launch | None = None
    param_index: int = -1
    grad_index: int = -1
    hypers: tuple = ()  # (row index, param-group slot) of each hyperparameter input


@dataclass
class _Member:
    """One parameter of the plan: where its row is, and what must still hold for the row to be right.
    It holds no tensor of the parameter's: its storage is checked by pointer, its grad found anew."""

    state: dict
    entries: tuple  # the state's values (which the rows hold anyway), compared by identity
    ptr: int  # the param's data pointer (of its local shard: a DTensor's is its local tensor's)
    sharded: bool
    row: list  # its row of its bucket's launch
    param_index: int  # where the row takes the param and the grad
    grad_index: int


class StepPlan:
    """One optimizer's step as its last full preparation bound it: every parameter's row, and one
    prepared launch per group and compiled step. A later step that finds the same groups, params,
    storage, states, config and guards (:meth:`refresh`) binds each parameter's current grad and the
    hyperparameters' current values, then runs (:meth:`run`): a few attribute checks per parameter
    instead of a preparation. Between steps the rows hold only the optimizer's states: no param
    storage, grad or hyperparameter tensor outlives the step that used it."""

    def __init__(self, opt: torch.optim.Optimizer, config: Config,
                 items: list[tuple[Prepared, dict, torch.Tensor, torch.Tensor, dict]], subset: bool = False) -> None:
        self.config = config
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.write_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        members: dict[int, _Member] = {}
        for prepared, group, param, grad, state in items:
            compiled = prepared.compiled
            bucket = self.buckets.get((id(compiled), id(group)))
            if bucket is None:
                roles = compiled.inputs
                bucket = self.buckets[id(compiled), id(group)] = _Bucket(
                    compiled, group, param_index=next(i for i, (role, _) in enumerate(roles) if role is Role.PARAM),
                    grad_index=next(i for i, (role, _) in enumerate(roles) if role is Role.GRAD),
                    hypers=tuple((i, key) for i, (role, key) in enumerate(roles) if role is Role.HYPERPARAMETER))
            args, write_back = bind_param(compiled, group, param, grad, state)
            self.write_back += write_back
            members[id(param)] = _Member(state, tuple(state.values()), sharding.local(param).data_ptr(),
                                         sharding.is_sharded(param), args, bucket.param_index, bucket.grad_index)
            bucket.rows.append(args)
        for bucket in self.buckets.values():
            bucket.launch = bucket.compiled.kernel.launch(bucket.rows)
        # one parameter at a time: the largest of the kernels' own temporaries (a staged step's)
        self.transient = max((getattr(b.compiled.kernel, "transient_bytes", 0) for b in self.buckets.values()),
                             default=0)
        # per group, its params by position with their member (None: stepped without a grad); a plan of
        # a subset (gradient release's bucket) lists only its own params, and no group without one
        step = unhooked_step(type(opt))
        self.n_groups = len(opt.param_groups)
        self.groups = []
        for gi, group in enumerate(opt.param_groups):
            params = group["params"]
            indexed = [(i, members.get(id(p))) for i, p in enumerate(params) if not subset or id(p) in members]
            if indexed or not subset:
                self.groups.append((gi, group, params, len(params), group_signature(group, step)[0], indexed))
        # strided params and states are bound through copies; a step that creates states (SGD's
        # first, momentum_buffer = grad) is followed by another trace, so neither is replayed
        self.reusable = not self.write_back and not any(b.compiled.fresh for b in self.buckets.values())

    def refresh(self, opt: torch.optim.Optimizer, config: Config) -> bool:
        """Whether this plan still binds ``opt``'s step; if so, its rows now hold the current params,
        grads and hyperparameters (until :meth:`run` ends)."""
        if self._bind(opt, config):
            return True
        self._release()
        return False

    def _bind(self, opt: torch.optim.Optimizer, config: Config) -> bool:
        groups = opt.param_groups
        if config is not self.config or len(groups) != self.n_groups:
            return False
        state_of, step = opt.state, unhooked_step(type(opt))
        for gi, planned, params, count, sig, members in self.groups:
            group = groups[gi]
            if group is not planned or group["params"] is not params or len(params) != count:
                return False
            group_sig, values = group_signature(group, step)
            if group_sig is not sig:
                return False
            for i, m in members:
                p = params[i]
                grad = p.grad
                if m is None:
                    if grad is not None and not is_released(grad):  # a released grad stepped in backward
                        return False
                    continue
                if grad is None:
                    return False
                storage, local_grad = (p._local_tensor, grad._local_tensor) if m.sharded else (p, grad)
                # the grad's dtype, size and layout are checked by the launch, which binds it
                if (type(local_grad) is ReleasedGrad or state_of.get(p) is not m.state or storage.data_ptr() != m.ptr
                        or grad.layout is not torch.strided or len(m.state) != len(m.entries)
                        or any(map(is_not, m.state.values(), m.entries))):  # a state entry replaced
                    return False
                row = m.row
                row[m.param_index] = storage
                row[m.grad_index] = local_grad
            for bucket in self.buckets.values():
                if bucket.group is group:
                    if not bucket.compiled.guard(values):
                        return False
                    for i, slot in bucket.hypers:
                        value = slot.get(group)
                        if bucket.rows[0][i] is not value:  # every row holds the same: rewritten together
                            for row in bucket.rows:
                                row[i] = value
        return True

    def stepped_groups(self) -> list[dict]:
        """The param groups this plan steps parameters of."""
        return [group for _, group, _, _, _, members in self.groups if any(m is not None for _, m in members)]

    def grads(self) -> list[torch.Tensor]:
        """The grads bound for this step (between :meth:`refresh` or construction and :meth:`run`)."""
        return [row[b.grad_index] for b in self.buckets.values() for row in b.rows]

    def run(self) -> None:
        try:
            for bucket in self.buckets.values():
                bucket.launch.run()
            for dst, flat in self.write_back:
                dst.copy_(flat.view(dst.shape))
        finally:
            self._release()

    def _release(self) -> None:
        """Take this step's params, grads and tensor hyperparameters out of the rows."""
        for bucket in self.buckets.values():
            tensors = [i for i, _ in bucket.hypers if isinstance(bucket.rows[0][i], torch.Tensor)]
            for row in bucket.rows:
                row[bucket.param_index] = row[bucket.grad_index] = None
                for i in tensors:
                    row[i] = None
