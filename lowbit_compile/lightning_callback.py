"""``LowbitMonitor``: ``lowbit_compile.monitor`` on every optimizer of a Lightning ``Trainer``.

    trainer = L.Trainer(..., callbacks=[LowbitMonitor(every=100)])

or in a Lightning CLI config: ``trainer.callbacks: [{class_path: lowbit_compile.lightning_callback.LowbitMonitor}]``.
Needs ``lightning``. The samples go to the ``lowbit_compile.monitor`` logger and to the Trainer's
loggers (TensorBoard, W&B, CSV, ...), or to ``log=`` if given.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

from .health import MAX_REL_ERROR, MAX_ZERO_FLUSH, Monitor, Sink, monitor


class LowbitMonitor(Callback):
    """Samples each optimizer's state health every ``every`` optimizer steps while fitting; a step with
    Lightning's closure is sampled after the closure computed the gradients."""

    def __init__(self, every: int = 100, log: Sink | list[Sink] | None = None,
                 max_zero_flush: float = MAX_ZERO_FLUSH, max_rel_error: float = MAX_REL_ERROR) -> None:
        self.every, self.sinks = every, log  # not self.log: Lightning sets that on every callback
        self.thresholds = dict(max_zero_flush=max_zero_flush, max_rel_error=max_rel_error)
        self.monitors: list[Monitor] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        sinks = self.sinks if self.sinks is not None else list(trainer.loggers)
        self.monitors = [monitor(opt, self.every, log=sinks, model=pl_module, **self.thresholds)
                         for opt in trainer.optimizers]

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        while self.monitors:
            self.monitors.pop().remove()
