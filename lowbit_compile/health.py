"""``monitor(opt, every=N)``: sample ``stats`` every N steps while training, log the figures, and warn
once, naming the parameter and the fix, when a state is being truncated.

The failure 8-bit users fear most is silent: the loss keeps falling while the small values of a
state are stored as 0. A monitor is a step pre-hook of the optimizer (so it sees the gradients the
step will use); on every N-th step it measures what that step will store (``stats``: on copies, one
parameter at a time) and hands the figures to Python ``logging`` and to any sinks given.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .config import param_names
from .formats import StateFormat
from .memory import memory_report
from .runtime.release_conflicts import RELEASE_REFUSAL, SamplesAtStep
from .runtime.rewritten_step import RunRewritten
from .runtime.wrapped import wrapped_of
from .state_stats import StateStats, stats

_log = logging.getLogger("lowbit_compile.monitor")  # the logger the docs name

# A state is flagged when its figures, averaged over its recent samples (an exponential moving
# average, weight AVERAGE_WEIGHT per sample, from its MIN_SAMPLES-th sample on; one sample sees only
# a few blocks), cross these: more than MAX_ZERO_FLUSH of the non-zero values the step computes
# stored as exactly 0 (linear int8 crosses it on every task of the quality bench, the default layout
# stays several times below: bench/monitor.py, docs/monitoring.md), or a round-trip error
# ||Q(x) - x|| / ||x|| above MAX_REL_ERROR (no 8-bit layout comes near it on those tasks: a state
# whose values its format cannot represent).
MAX_ZERO_FLUSH = 0.01
MAX_REL_ERROR = 0.1
AVERAGE_WEIGHT = 0.2
MIN_SAMPLES = 3

# Blocks per parameter one sample measures, evenly spaced and others each sample: 8 blocks of 512
# are 4096 values; a sample then costs in proportion to the number of parameters, not their size.
DEFAULT_MAX_BLOCKS = 8

# A sink: a TensorBoard ``SummaryWriter`` (``add_scalar``), a Lightning logger (``log_metrics``), a
# ``logging.Logger``, or any callable ``log(metrics: dict, step: int)`` (``wandb.log``).
Sink = Any


class LowbitHealthWarning(UserWarning):
    """A quantized optimizer state is losing values (see ``monitor``)."""


@dataclass(frozen=True)
class Alert:
    """One state whose averaged figures crossed a threshold: its latest sample and the averages."""

    step: int
    stats: StateStats
    zero_flush: float
    rel_error: float

    def message(self, max_zero_flush: float, max_rel_error: float) -> str:
        s = self.stats
        fmt = StateFormat.from_tag(s.fmt)
        found = []
        if self.zero_flush > max_zero_flush:
            found.append(f"{self.zero_flush:.1%} of its non-zero values are stored as 0 "
                         f"(threshold {max_zero_flush:.0%})")
        if self.rel_error > max_rel_error:
            found.append(f"its round trip loses {self.rel_error:.0%} of the norm (threshold {max_rel_error:.0%})")
        finer = fmt.spec.advice  # the format the registry suggests instead, if any
        smaller = f"block_size={fmt.block_size // 4}" if fmt.block_size >= 256 else None
        options = " or ".join(x for x in (finer, smaller) if x)
        return (f"lowbit_compile: {s.state} of parameter {s.param!r} ({fmt.name}, blocks of {fmt.block_size}) is being "
                f"truncated (averaged over its recent samples, at step {self.step}): {' and '.join(found)}. Fix: "
                + (f"{options}; or " if options else "")
                + f"keep this parameter's states in 16 or 32 bits: overrides={{{s.param!r}: 'bf16'}} (or 'fp32')"
                + ("" if not s.param.startswith("group") else "; pass model= to name it"))


class Monitor(SamplesAtStep):
    """What ``monitor(...)`` returns: ``history`` holds each sample's metrics, ``alerts`` the states
    flagged so far; ``remove()`` (or leaving a ``with`` block) detaches it."""

    def __init__(self, opt: torch.optim.Optimizer, every: int, names: dict[torch.Tensor, str] | None,
                 sinks: Sequence[Sink], max_zero_flush: float, max_rel_error: float, max_blocks: int | None) -> None:
        self.opt = opt
        self.every = every
        self.max_blocks = max_blocks
        self.names = names
        self.sinks = list(sinks)
        self.max_zero_flush = max_zero_flush
        self.max_rel_error = max_rel_error
        self.steps = 0
        self.history: list[dict[str, float]] = []
        self.alerts: list[Alert] = []
        self._warned: set[tuple[str, str]] = set()
        self._averages: dict[tuple[str, str], tuple[int, float, float]] = {}  # samples, zero flush, rel error
        self._handle = opt.register_step_pre_hook(self._pre_step)

    def _pre_step(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Sample on every ``every``-th step, once the gradients exist: a step with a closure
        (Lightning's) computes them inside the step, so the sample runs right after the closure."""
        self.steps += 1
        in_kwargs = "closure" in kwargs
        closure = kwargs["closure"] if in_kwargs else args[1] if len(args) > 1 else None
        redirected = isinstance(closure, RunRewritten)  # enable() redirected this stock step to the rewritten one
        # (which may wrap ``opt`` only after the caller's closure ran: see enable's Scope._rewrite)
        if self.steps % self.every or not (redirected or wrapped_of(opt) is not None):
            return None
        if redirected:
            closure.closure = self._sampling(closure.closure)
            return None
        sampling = self._sampling(closure)
        return (args, {**kwargs, "closure": sampling}) if in_kwargs or len(args) < 2 else \
            ((args[0], sampling, *args[2:]), kwargs)

    def _sampling(self, closure: Callable[[], Any] | None) -> Callable[[], Any]:
        def sample_after_closure() -> Any:
            loss = closure() if closure is not None else None
            found_inf = getattr(self.opt, "found_inf", None)  # GradScaler is about to skip this step
            if wrapped_of(self.opt) is not None and (found_inf is None or not found_inf.item()):
                self.check()
            return loss

        return sample_after_closure

    def check(self) -> dict[str, float]:
        """Sample now (between ``backward()`` and ``step()``): log the figures, warn on new alerts."""
        names = self.names if self.names is not None else getattr(wrapped_of(self.opt), "names", {})
        # each sample measures other blocks (offset = samples so far), so all are covered over a run
        rows = stats(self.opt, ((n, p) for p, n in names.items()), max_blocks=self.max_blocks,
                     offset=len(self.history))
        metrics = _metrics(rows)
        if rows:
            metrics["lowbit/state_bytes_per_param"] = memory_report(self.opt).total.bytes_per_param
        metrics = {"step": float(self.steps), **metrics}
        self.history.append(metrics)
        if rows:
            _log.info("step %d: %s", self.steps, _summary(rows))
        for sink in self.sinks:
            _write(sink, {k: v for k, v in metrics.items() if k != "step"}, self.steps, rows)
        new = []
        for s in rows:
            alert = self._average(s)
            if alert is not None and (s.param, s.state) not in self._warned:
                new.append(alert)
        for alert in new:
            self._warned.add((alert.stats.param, alert.stats.state))
            self.alerts.append(alert)
            text = alert.message(self.max_zero_flush, self.max_rel_error)
            _log.warning("%s", text)
            warnings.warn(text, LowbitHealthWarning, stacklevel=2)
        return metrics

    def _average(self, s: StateStats) -> Alert | None:
        """Fold one sample of a state into its moving averages; an Alert if they cross a threshold."""
        if s.zero_flush is None or s.rel_error is None:
            return None
        key = (s.param, s.state)
        n, flush, err = self._averages.get(key, (0, s.zero_flush, s.rel_error))
        if n:
            flush += AVERAGE_WEIGHT * (s.zero_flush - flush)
            err += AVERAGE_WEIGHT * (s.rel_error - err)
        self._averages[key] = (n + 1, flush, err)
        if n + 1 >= MIN_SAMPLES and (flush > self.max_zero_flush or err > self.max_rel_error):
            return Alert(self.steps, s, flush, err)
        return None

    def remove(self) -> None:
        """Stop sampling."""
        self._handle.remove()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def monitor(opt: torch.optim.Optimizer, every: int = 100, *, log: Sink | Sequence[Sink] | None = None,
            model: torch.nn.Module | Iterable[tuple[str, torch.Tensor]] | None = None,
            max_zero_flush: float = MAX_ZERO_FLUSH, max_rel_error: float = MAX_REL_ERROR,
            max_blocks: int | None = DEFAULT_MAX_BLOCKS) -> Monitor:
    """Sample ``stats(opt)`` every ``every`` steps of ``opt`` and warn once per state whose figures,
    averaged over its recent samples, cross a threshold: more than ``max_zero_flush`` of its non-zero
    values stored as 0, or a round-trip error above ``max_rel_error`` (relative to the state's norm).

    Args:
        opt: the optimizer (wrapped now, or later by ``enable``: until then there is nothing to sample).
        every: steps between samples.
        max_blocks: quantization blocks per parameter a sample measures (evenly spaced, other ones
            each sample); ``None``: all of them, at the cost of about one stock fp32 step.
        log: where the figures go besides the ``lowbit_compile.monitor`` logger (INFO): a TensorBoard
            ``SummaryWriter``, a Lightning logger, a ``logging.Logger``, a callable
            ``log(metrics, step)`` such as ``wandb.log``, or a list of those.
        model: names the parameters in warnings and figures (default: the names the optimizer was
            wrapped with, else ``group<i>.<j>``).

    Returns a ``Monitor``; ``remove()`` it (or use it as a ``with`` block) to stop.
    """
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"every must be a positive int (steps between samples), got {every!r}")
    for name, value in (("max_zero_flush", max_zero_flush), ("max_rel_error", max_rel_error)):
        if not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError(f"{name} must be a fraction in [0, 1], got {value!r}")
    sinks = [] if log is None else list(log) if isinstance(log, (list, tuple)) else [log]
    for sink in sinks:
        if not (isinstance(sink, logging.Logger) or hasattr(sink, "add_scalar") or hasattr(sink, "log_metrics")
                or callable(sink)):
            raise TypeError(f"log= takes a SummaryWriter, a Lightning logger, a logging.Logger or a callable "
                            f"log(metrics, step); got {type(sink).__name__}")
    names = param_names(model) if model is not None else None
    if max_blocks is not None and (not isinstance(max_blocks, int) or max_blocks < 1):
        raise ValueError(f"max_blocks must be a positive int or None, got {max_blocks!r}")
    if getattr(wrapped_of(opt), "release", None) is not None:
        raise ValueError(RELEASE_REFUSAL)
    return Monitor(opt, every, names, sinks, float(max_zero_flush), float(max_rel_error), max_blocks)


def _metrics(rows: Sequence[StateStats]) -> dict[str, float]:
    """Per state key, the worst (largest) value over parameters of each figure, and the worst over all:
    for the rounding bias, the state held furthest above its exact value."""
    out: dict[str, float] = {}
    for figure in ("rel_error", "zero_flush", "rounding_bias", "patched_blocks", "update_ratio"):
        for s in rows:
            value = getattr(s, figure)
            if value is None or (isinstance(value, float) and math.isnan(value)):
                continue
            for key in (f"lowbit/{figure}/{s.state}", f"lowbit/{figure}"):
                out[key] = max(out.get(key, value), value)
    return out


def _summary(rows: Sequence[StateStats]) -> str:
    def worst(figure: str) -> str:
        measured = [s for s in rows if getattr(s, figure) is not None]
        if not measured:
            return "-"
        s = max(measured, key=lambda r: getattr(r, figure))
        return f"{getattr(s, figure):.2e} ({s.state} of {s.param})"

    return (f"worst round-trip error {worst('rel_error')}, worst zero flush {worst('zero_flush')}, "
            f"largest rounding bias {worst('rounding_bias')}, largest update/param {worst('update_ratio')} over "
            f"{len(rows)} quantized states")


def _write(sink: Sink, metrics: dict[str, float], step: int, rows: Sequence[StateStats]) -> None:
    if isinstance(sink, logging.Logger):
        sink.info("lowbit-compile step %d: %s", step, _summary(rows) if rows else "no quantized states yet")
    elif hasattr(sink, "add_scalar"):
        for key, value in metrics.items():
            sink.add_scalar(key, value, step)
    elif hasattr(sink, "log_metrics"):
        sink.log_metrics(metrics, step)
    else:
        sink(metrics, step)


