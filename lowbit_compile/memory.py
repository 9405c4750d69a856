"""``memory_report(opt)``: bytes actually held by each optimizer state, and per parameter element."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .runtime.wrapped import wrapped_of
from .state import QuantizedState, sharding


@dataclass(frozen=True)
class StateMemory:
    bytes: int
    params: int

    @property
    def bytes_per_param(self) -> float:
        return self.bytes / self.params if self.params else 0.0


@dataclass(frozen=True)
class MemoryReport:
    """Per state key (``exp_avg``, ...), the bytes held over all parameters, and the total;
    ``transient``: the bytes a step allocates while it runs, beyond the states (a staged step's,
    Muon's, temporaries for its largest parameter, one parameter at a time; 0 for elementwise steps)."""

    per_state: dict[str, StateMemory]
    total: StateMemory
    transient: int = 0

    def __str__(self) -> str:
        lines = [f"{'state':<16}{'bytes':>16}{'B/param':>10}"]
        for key, mem in sorted(self.per_state.items()):
            lines.append(f"{key:<16}{mem.bytes:>16,}{mem.bytes_per_param:>10.3f}")
        lines.append(f"{'total':<16}{self.total.bytes:>16,}{self.total.bytes_per_param:>10.3f}")
        if self.transient:
            lines.append(f"{'transient':<16}{self.transient:>16,}  (while a step runs, one parameter at a time)")
        return "\n".join(lines)


def tensor_bytes(value: torch.Tensor) -> int:
    value = sharding.local(value)
    if isinstance(value, QuantizedState):
        return value.nbytes_held
    return value.numel() * value.element_size()


def memory_report(opt: torch.optim.Optimizer) -> MemoryReport:
    """Count the bytes of every tensor in ``opt.state``: codes, scales and patches for quantized
    states, the tensor itself for stock ones. ``params`` counts elements of params with state.
    A sharded (FSDP2) parameter counts this rank's shard: what this process holds."""
    n_params = 0
    per: dict[str, list[int]] = {}
    for group in opt.param_groups:
        for param in group["params"]:
            state = opt.state.get(param)
            if not state:
                continue
            n_params += sharding.local(param).numel()
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    per.setdefault(key, [0])[0] += tensor_bytes(value)
    per_state = {k: StateMemory(v[0], n_params) for k, v in per.items()}
    total = StateMemory(sum(v.bytes for v in per_state.values()), n_params)
    wrapped = wrapped_of(opt)
    return MemoryReport(per_state, total, wrapped.transient if wrapped is not None else 0)
