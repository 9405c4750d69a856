"""What ``lowbit_compile`` attaches to an optimizer it wraps (:class:`Wrapped`, under ``ATTR``), and how
the modules that act on a wrapped optimizer find it."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..config import Config

ATTR = "_lowbit"  # the optimizer attribute that holds its Wrapped


class Wrapped:
    """What ``lowbit_compile`` attaches to an optimizer: its config, the hooks it added, the
    ``step`` instance attribute it replaced (e.g. an LR scheduler's wrapper), and the parameter
    names that name-pattern overrides match against."""

    def __init__(self, config: Config, options: dict[str, Any], previous_step: Any, hooks: list) -> None:
        self.config = config
        self.options = options  # as given (less model=): what a copy is wrapped with again
        self.previous_step = previous_step
        self.hooks = hooks
        self.names: dict[torch.Tensor, str] = {}
        # per parameter, reused while valid; weak, so a parameter the optimizer lets go of is freed
        self.prepared: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.plan: Any = None  # the last step's bound launches (run.StepPlan), reused while they fit
        self.transient = 0  # bytes a step allocates for one parameter at a time (a staged step's temporaries)
        # one step at a time: two threads stepping one optimizer take turns (stock's step is not
        # atomic either, but ours binds rows that a second step would rebind under the first)
        self.lock = threading.RLock()
        # release_grads=True: the hooks that step each param in backward (release.Release)
        self.release: Any = None
        self.graph_inputs: Any = None  # what a torch.compile graph hands the step (step_op.GraphInputs)


def wrapped_of(opt: torch.optim.Optimizer) -> Wrapped | None:
    """What ``lowbit_compile`` attached to ``opt``; None when it is not wrapped."""
    return getattr(opt, ATTR, None)
