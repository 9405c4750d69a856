"""``LowbitMonitorCallback``: ``lowbit_compile.monitor`` on a Hugging Face ``Trainer``'s optimizer.

    trainer = Trainer(..., callbacks=[LowbitMonitorCallback(every=100)])

Needs ``transformers``. The samples go to the ``lowbit_compile.monitor`` logger, to ``log=`` if
given, and into ``trainer.state.log_history`` (so ``trainer_state.json`` keeps them).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from .health import MAX_REL_ERROR, MAX_ZERO_FLUSH, Monitor, Sink, monitor


class LowbitMonitorCallback(TrainerCallback):
    """Samples the optimizer's state health every ``every`` optimizer steps while the Trainer trains
    (the optimizer of ``optimizer_cls_and_kwargs``, or the one ``enable()`` rewrites on its first step)."""

    def __init__(self, every: int = 100, log: Sink | list[Sink] | None = None,
                 max_zero_flush: float = MAX_ZERO_FLUSH, max_rel_error: float = MAX_REL_ERROR) -> None:
        self.every, self.sinks = every, log
        self.thresholds = dict(max_zero_flush=max_zero_flush, max_rel_error=max_rel_error)
        self.monitor: Monitor | None = None
        self._logged = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer holds the torch one
        self.monitor = monitor(opt, self.every, log=self.sinks, model=model, **self.thresholds)
        self._logged = 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is None:
            return
        for sample in self.monitor.history[self._logged:]:
            state.log_history.append({**{k: v for k, v in sample.items() if k != "step"}, "step": state.global_step})
        self._logged = len(self.monitor.history)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.remove()
            self.monitor = None
