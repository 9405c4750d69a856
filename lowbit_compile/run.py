"""Run a step: bind each parameter's tensors to its compiled step's inputs (once, refreshing only
the grad and hyperparameters on later steps) and launch every parameter of a group that shares a
kernel in one call."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import sharding
from .compile import CompiledStep
from .config import Config
from .kernels.contract import Role
from .passes.trace import hyper_slots, static_group_items, tensor_meta
from .state_schema import filled
from .trace_cache import trace_group


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
        elif role is Role.GRAD:
            args.append(grad.reshape(-1))
        elif role is Role.SCALAR_STATE:
            args.append(state[key])
        elif role is Role.STATE_PART:
            args.append(getattr(state[key[0]], key[1]))
        elif role is Role.MASTER_PART:  # a residual of the param's master: contiguous, in logical order
            args.append(state[key].view(-1))
        else:
            args.append(key.get(group))
    return args, write_back


def run_params(items: list[tuple[Prepared, dict, torch.Tensor, torch.Tensor, dict]]) -> None:
    """Run the step of every (prepared, group, param, grad, state). Parameters of one group that share
    a compiled step go to its kernel in one call: many small tensors (biases, norms) then cost one
    kernel launch, not one each."""
    buckets: dict[tuple[int, int], list] = {}
    for item in items:
        buckets.setdefault((id(item[0].compiled), id(item[1])), []).append(item)
    for bucket in buckets.values():
        rows, write_back = [], []
        for prepared, *rest in bucket:
            args, wb = prepared.bind(*rest)
            rows.append(args)
            write_back += wb
        bucket[0][0].compiled.kernel.run_many(rows, [prepared.memo for prepared, *_ in bucket])
        for dst, flat in write_back:
            dst.copy_(flat.view(dst.shape))


def group_signature(group: dict) -> tuple[tuple, list]:
    """What of a param group a prepared step depends on (its flags, which hyperparameters are
    tensors), and the hyperparameter values its guards are checked on. Computed once per group and
    step."""
    tgroup = trace_group(group)
    slots = hyper_slots(tgroup)
    meta = tuple((s, tensor_meta(s.get(tgroup)) if s.is_tensor else None) for s in slots)
    sig = (static_group_items(tgroup), meta)
    return _signatures.setdefault(sig, sig), [s.get(tgroup) for s in slots]


_signatures: dict[tuple, tuple] = {}  # one object per distinct group signature: compared by identity


@dataclass
class Prepared:
    """One parameter's compiled step and state as the last full preparation found them. Reused while
    the config, the group's signature, the guard, the param's storage and every state entry are
    still the same objects, so a steady step costs a few attribute checks per parameter."""

    compiled: CompiledStep
    state: dict
    entries: tuple
    param_meta: tuple
    config: Config
    group_sig: tuple
    bound: list | None = None  # the step's inputs as last bound (when no copy needs writing back)
    memo: dict = field(default_factory=dict)  # the lowering's checks of those inputs
    refresh: tuple = ()  # which of them change between steps: (index, role, key) of grad and hyperparameters

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


    def bind(self, group: dict, param: torch.Tensor, grad: torch.Tensor, state: dict) -> tuple[list, list]:
        """``bind_param``, once: later steps only refresh the grad and hyperparameter inputs (the param,
        state and storage views stay valid while ``still_valid`` holds)."""
        if self.bound is None:
            args, write_back = bind_param(self.compiled, group, param, grad, state)
            if write_back:
                return args, write_back
            self.bound = args
            self.refresh = tuple((i, role, key) for i, (role, key) in enumerate(self.compiled.inputs)
                                 if role in (Role.GRAD, Role.HYPERPARAMETER))
            return args, []
        args = self.bound
        for i, role, key in self.refresh:
            args[i] = sharding.local(grad).reshape(-1) if role is Role.GRAD else key.get(group)
        return args, []


def _param_meta(param: torch.Tensor) -> tuple:
    return (param.dtype, param.shape, param.device, sharding.local(param).data_ptr(), type(param))


