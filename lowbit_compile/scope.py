"""``enable(...)``: a scope (decorator or ``with`` block) in which every supported ``torch.optim``
optimizer that steps is rewritten by ``lowbit_compile`` on its first step, whoever created it and
whoever calls ``step``.

It is built on torch's process-wide optimizer step hooks; they are registered when the first scope
is entered and removed when the last one is left (importing the package registers nothing). For the
same span ``Optimizer.load_state_dict`` is replaced by one that, in scope, gives a stock optimizer
a low-bit checkpoint with its steps in place (torch has no process-wide load hook, and outside
lowbit_compile such a checkpoint is refused: ``state.stock.STOCK_REFUSAL``); the first step converts
the packed states the stock loader keeps. The pre-hook runs
*inside* the stock ``Adam.step`` wrapper, before the per-optimizer pre-hooks and the stock update,
and may only replace the step's ``(args, kwargs)``. On an optimizer's first step in scope the hook
converts it (from then on its ``step`` is the rewritten one) and, through
``rewritten_step.stock_step_runs_rewritten``, turns the stock update of this very call into the rewritten
one: the first step is already low-bit, and every per-optimizer hook still runs once, in order.

Scopes are per context (a ``contextvars`` value): a step taken in another thread, or after the
scope ends, is not touched. An optimizer rewritten inside keeps its low-bit states after the scope
ends unless ``restore_on_exit=True``.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import inspect
import logging
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .api import is_wrapped, lowbit_compile, restore
from .config import Config, UnmatchedOverride, param_names
from .formats import format_names
from .formats.rounding import SEED
from .health import Monitor
from .health import monitor as sample_health
from .memory import memory_report
from .options import DEFAULT_FMT, FmtSpec, Options, ScopeOptions, args_doc, entry_signature, from_keywords
from .runtime.release_conflicts import RELEASE_REFUSAL
from .runtime.rewritten_step import stock_step_runs_rewritten
from .runtime.wrap import REWRITTEN, check_optimizer
from .state import stock

_log = logging.getLogger("lowbit_compile.enable")  # the logger the docs name
_active: contextvars.ContextVar[tuple[Scope, ...]] = contextvars.ContextVar("lowbit_enable_scopes", default=())
_hook_lock = threading.Lock()
_hook_users = 0
_hook_handles: list = []


@dataclass
class Rewritten:
    """What one scope did to one optimizer, for the end-of-run summary."""

    label: str
    params: int
    steps: int = 0
    state_bytes: int = 0
    stock_state_bytes: int = 0
    restored_at_step: int | None = None
    reported_at: tuple[int, float] | None = None  # (steps, time) of the last progress line

    def measure(self, opt: torch.optim.Optimizer) -> None:
        """Bytes the optimizer's states hold now, and what stock states of the same dtypes would (stock
        keeps no stochastic-rounding counter)."""
        self.state_bytes = memory_report(opt).total.bytes
        self.stock_state_bytes = sum(
            v.numel() * v.dtype.itemsize
            for state in opt.state.values() for k, v in state.items() if isinstance(v, torch.Tensor) and k != SEED
        )


class Scope(contextlib.ContextDecorator):
    """The object ``enable(...)`` returns: use it as ``with scope:`` or ``@scope``.

    ``rewritten`` lists what it converted; ``skipped`` counts optimizers stepped in scope that it
    left stock, by reason; ``summary()`` formats both.
    """

    def __init__(self, fmt: FmtSpec = DEFAULT_FMT, **options: Any) -> None:
        given, scope = from_keywords("enable()", {"fmt": fmt, **options}, Options, ScopeOptions)
        self.config = Config.of(given)
        if given.release_grads and scope.monitor is not None:
            raise ValueError(RELEASE_REFUSAL)
        self._options = given.kept()
        model = given.model
        self._names = param_names(model) if model is not None else None
        self.restore_at_step = scope.restore_at_step
        self.restore_on_exit = scope.restore_on_exit
        self.monitor_every = scope.monitor
        self.log_every = scope.log_every
        self.monitors: list[Monitor] = []
        self.rewritten: list[Rewritten] = []
        self.skipped: collections.Counter[str] = collections.Counter()
        self._records: weakref.WeakKeyDictionary[torch.optim.Optimizer, Rewritten] = weakref.WeakKeyDictionary()
        self._decided: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._restore_requested = False
        self._tokens: list[contextvars.Token] = []
        self._seen_modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        # submodule -> its parent, for the submodules registered in scope
        self._parents: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref] = weakref.WeakKeyDictionary()
        self._module_hooks: list = []

    # entering and leaving ---------------------------------------------------------------------
    def __enter__(self) -> Scope:
        stock.guard_stock_steps()
        _acquire_hooks()
        self._tokens.append(_active.set((*_active.get(), self)))
        wants_names = self.config.uses_names or self.monitor_every is not None
        if wants_names and self._names is None and not self._module_hooks:
            # Name patterns (or a monitor's messages) without model=: learn names from the modules
            # that run forward in scope, named in the outermost module that holds them (a parent
            # registered in scope counts even if only its children are called, as Lightning calls
            # training_step, not forward).
            modules = torch.nn.modules.module
            self._module_hooks = [
                modules.register_module_forward_pre_hook(lambda module, args: self._seen_modules.add(module)),
                modules.register_module_module_registration_hook(self._learn_parent),
            ]
        return self

    def __exit__(self, *exc: object) -> None:
        _active.reset(self._tokens.pop())
        _release_hooks()
        if self._tokens:
            return
        self._stop_learning_names()
        while self.monitors:
            self.monitors.pop().remove()
        if self.restore_on_exit:
            for opt in list(self._records.keys()):
                if is_wrapped(opt):
                    self._restore(opt)

    def request_restore(self) -> None:
        """Switch every optimizer this scope rewrote back to stock fp32 states at the end of its next
        step (safe to call from a signal handler or another thread), and rewrite no more."""
        self._restore_requested = True

    # the hooks --------------------------------------------------------------------------------
    def _pre_step(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if is_wrapped(opt):
            return None
        if opt not in self._decided:
            self._decided.add(opt)
            if self._rewrites(opt):
                return self._rewrite(opt, args, kwargs)
        stock.refuse_packed_states(opt)  # left stock: its stock step cannot take low-bit states
        return None

    def _rewrites(self, opt: torch.optim.Optimizer) -> bool:
        """Whether this scope rewrites ``opt`` (counting why not, when not)."""
        if not isinstance(opt, REWRITTEN):
            self.skipped[f"{type(opt).__name__} (not an optimizer lowbit_compile rewrites)"] += 1
            return False
        if self._restore_requested:
            self.skipped[f"{type(opt).__name__} (stepped after a restore request)"] += 1
            return False
        try:
            check_optimizer(opt)
        except (TypeError, ValueError) as err:
            warnings.warn(f"lowbit_compile.enable left a {type(opt).__name__} stock: {err}", stacklevel=5)
            self.skipped[f"{type(opt).__name__} (unsupported: {err})"] += 1
            return False
        return True

    def _rewrite(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.monitor_every is not None:
            self.monitors.append(sample_health(opt, self.monitor_every))  # names given in _convert
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None or not self._names_pending(opt):
            self._convert(opt)
            return stock_step_runs_rewritten(opt, args, kwargs)

        # A step with a closure (Lightning's loop) runs the forward that names the parameters inside
        # it: run the closure first, as the stock step would, then convert and run the rewritten update.
        def closure_then_convert() -> Any:
            try:
                loss = closure()
            except BaseException:
                self._forget(opt)
                raise
            self._convert(opt)
            return loss

        return stock_step_runs_rewritten(opt, (opt,), {"closure": closure_then_convert})

    def _convert(self, opt: torch.optim.Optimizer) -> None:
        """Wrap ``opt`` with the scope's options and the parameter names known now."""
        try:
            lowbit_compile(opt, **self._options, model=self._names_of(opt))
        except BaseException:
            self._forget(opt)
            raise
        n_params = sum(p.numel() for group in opt.param_groups for p in group["params"])
        record = Rewritten(f"{type(opt).__name__} #{len(self.rewritten) + 1}", n_params)
        self.rewritten.append(record)
        self._records[opt] = record
        for mon in self.monitors:
            if mon.opt is opt:
                mon.names = {p: name for name, p in self._known_names(opt)}
        self._stop_learning_names()
        _log.info("rewrote %s (%s params) with low-bit states", record.label, f"{n_params:,}")

    def _forget(self, opt: torch.optim.Optimizer) -> None:
        """``opt`` was not converted (its step failed first): decide again at its next step."""
        self._decided.discard(opt)
        for mon in [m for m in self.monitors if m.opt is opt]:
            mon.remove()
            self.monitors.remove(mon)

    def _post_step(self, opt: torch.optim.Optimizer) -> bool:
        """Count a step of an optimizer this scope rewrote; False if it is not one of ours."""
        record = self._records.get(opt)
        if record is None:
            return False
        if record.restored_at_step is not None:
            return True
        if not is_wrapped(opt):  # the user called restore(opt) during the step's hooks or before it
            record.restored_at_step = record.steps
            return True
        record.steps += 1
        if record.steps == 1:
            record.measure(opt)
            record.reported_at = (1, time.perf_counter())
        elif self.log_every is not None and record.steps % self.log_every == 0:
            self._progress(opt, record)
        if self._restore_requested or (self.restore_at_step is not None and record.steps >= self.restore_at_step):
            self._restore(opt)
        return True

    def _progress(self, opt: torch.optim.Optimizer, record: Rewritten) -> None:
        """One line: steps so far, the mean time per step since the last line, state memory saved."""
        record.measure(opt)
        now = time.perf_counter()
        last_steps, last_time = record.reported_at or (record.steps, now)
        per_step = (now - last_time) / max(1, record.steps - last_steps)
        record.reported_at = (record.steps, now)
        saved = record.stock_state_bytes - record.state_bytes
        pct = 100.0 * saved / record.stock_state_bytes if record.stock_state_bytes else 0.0
        _log.info("%s: step %s, %.1f ms/step, states %s held, %s saved (%.1f%%)", record.label, f"{record.steps:,}",
                  1e3 * per_step, _mib(record.state_bytes), _mib(saved), pct)

    def _restore(self, opt: torch.optim.Optimizer) -> None:
        record = self._records[opt]
        record.measure(opt)  # the low-bit figures, before the states turn back to fp32
        restore(opt)
        record.restored_at_step = record.steps
        _log.info("switched %s back to stock fp32 states after its step %d", record.label, record.steps)

    # parameter names for name-pattern overrides ------------------------------------------------
    def _names_of(self, opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]] | None:
        if not self.config.uses_names:
            return None
        names = self._names if self._names is not None else self._learned_names()
        params = [p for group in opt.param_groups for p in group["params"]]
        missing = sum(p not in names for p in params)
        if missing:
            raise RuntimeError(
                f"lowbit_compile.enable: {missing} of the {len(params)} parameters of a {type(opt).__name__} "
                "have no known name, so the name-pattern overrides cannot be applied to them; run the "
                "model's forward inside the scope before the first step, or pass model= to enable()"
            )
        if self._names is None:
            try:
                self.config.check_patterns(names.values())
            except UnmatchedOverride as err:
                raise UnmatchedOverride(
                    f"lowbit_compile.enable: {err} The names were learned from the modules run in scope, within "
                    "the outermost one that was called or created in scope (a model created outside whose own "
                    "forward is not called, as Lightning calls training_step, names only its submodules' "
                    "parameters): pass model= to enable(), or create the model inside the scope",
                    err.pattern, err.names, err.hint) from None
        # every known name, not only this optimizer's: patterns are checked against the whole model
        return [(name, p) for p, name in names.items()]

    def _names_pending(self, opt: torch.optim.Optimizer) -> bool:
        """Whether names are wanted (patterns, a monitor) and some of ``opt``'s parameters have none yet."""
        if self._names is not None or not (self.config.uses_names or self.monitor_every is not None):
            return False
        names = self._learned_names()
        return any(p not in names for group in opt.param_groups for p in group["params"])

    def _known_names(self, opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
        """The names of ``opt``'s parameters known so far (``model=``, or modules run in scope)."""
        names = self._names if self._names is not None else self._learned_names()
        return [(names[p], p) for group in opt.param_groups for p in group["params"] if p in names]

    def _learn_parent(self, parent: torch.nn.Module, name: str, sub: torch.nn.Module | None) -> None:
        if sub is not None:
            self._parents[sub] = weakref.ref(parent)

    def _learned_names(self) -> dict[torch.Tensor, str]:
        return _outermost_names(_with_parents(self._seen_modules, self._parents))

    def _stop_learning_names(self) -> None:
        while self._module_hooks:
            self._module_hooks.pop().remove()

    # reporting --------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-measure the optimizers still alive and still rewritten (params may have been added)."""
        for opt, record in list(self._records.items()):
            if record.restored_at_step is None and is_wrapped(opt):
                record.measure(opt)

    def summary(self) -> str:
        """A one-screen account of what the scope rewrote and the state memory it saved."""
        fmt = self.config.fmt if isinstance(self.config.fmt, str) else dict(self.config.fmt)
        lines = [f"lowbit-compile: {len(self.rewritten)} optimizer(s) rewritten (fmt={fmt}, "
                 f"block_size={self.config.block_size}, outliers={self.config.outliers})"]
        if self.rewritten:
            lines.append(f"  {'optimizer':<12}{'params':>15}{'steps':>8}{'stock states':>16}{'low-bit states':>16}"
                         f"{'saved':>16}{'%':>7}")
            for r in self.rewritten:
                lines.append(_summary_row(r.label, r.params, r.steps, r.stock_state_bytes, r.state_bytes)
                             + (f"   restored to fp32 after step {r.restored_at_step}"
                                if r.restored_at_step is not None else ""))
            if len(self.rewritten) > 1:
                lines.append(_summary_row("total", sum(r.params for r in self.rewritten),
                                          sum(r.steps for r in self.rewritten),
                                          sum(r.stock_state_bytes for r in self.rewritten),
                                          sum(r.state_bytes for r in self.rewritten)))
            lines.append("  (bytes of optimizer state; stock = the same states at their stock dtype)")
        for reason, count in sorted(self.skipped.items()):
            lines.append(f"  left stock: {count} x {reason}")
        return "\n".join(lines)


def enable(fmt: str | Mapping[str, str] | Callable = DEFAULT_FMT, **options: Any) -> Any:
    """Rewrite every supported ``torch.optim`` optimizer (``runtime.wrap.REWRITTEN``: Adam, AdamW, SGD, ..., Muon,
    RMSprop, ...) stepped inside the scope with low-bit states; others are left stock and counted.

    Use as ``@enable(fmt="int8")``, bare ``@enable``, or ``with enable(...):``. Options are those of
    ``lowbit_compile`` (``fmt``, ``block_size``, ...: ``options.Options``) plus those of the scope:
<SCOPE_OPTIONS>

    Name-pattern overrides without ``model=`` take the names from the modules whose forward runs in scope
    (the outermost module names them). Optimizers already wrapped by ``lowbit_compile`` keep their own
    configuration.
    """
    if callable(fmt) and not options:
        return Scope()(fmt)
    return Scope(fmt, **options)


Scope.__init__.__signature__ = entry_signature(  # type: ignore[attr-defined]
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)], Options, ScopeOptions, returns="None")
enable.__doc__ = enable.__doc__.replace("<SCOPE_OPTIONS>", args_doc(ScopeOptions, indent=4, formats=format_names()))


def _summary_row(label: str, params: int, steps: int, stock: int, held: int) -> str:
    saved = stock - held
    pct = 100.0 * saved / stock if stock else 0.0
    return f"  {label:<12}{params:>15,}{steps:>8,}{stock:>16,}{held:>16,}{saved:>16,}{pct:>6.1f}%"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _with_parents(modules: Iterable[torch.nn.Module],
                  parents: Mapping[torch.nn.Module, weakref.ref]) -> list[torch.nn.Module]:
    """``modules`` and every ancestor ``parents`` knows of."""
    found: dict[int, torch.nn.Module] = {}
    for module in modules:
        while module is not None and id(module) not in found:
            found[id(module)] = module
            ref = parents.get(module)
            module = ref() if ref is not None else None
    return list(found.values())


def _outermost_names(modules: Iterable[torch.nn.Module]) -> dict[torch.Tensor, str]:
    """Parameter names in the outermost of ``modules`` (those no other one contains)."""
    modules = list(modules)
    inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    names: dict[torch.Tensor, str] = {}
    for module in modules:
        if id(module) not in inner:
            for param, name in param_names(module).items():
                names.setdefault(param, name)
    return names


def _global_pre_hook(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    if torch.compiler.is_compiling():  # a stock step dynamo traces: decided eagerly, in a graph break
        return _eager_hooks[_global_pre_hook](opt, args, kwargs)
    scopes = _active.get()
    return scopes[-1]._pre_step(opt, args, kwargs) if scopes else None


def _global_post_hook(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if torch.compiler.is_compiling():
        return _eager_hooks[_global_post_hook](opt, args, kwargs)
    for scope in reversed(_active.get()):
        if scope._post_step(opt):
            return


# A stock optimizer stepped for the first time in scope is rewritten by that step, which torch.compile
# cannot hold in its graph: the hooks run as a graph break, and under fullgraph=True dynamo's error says this.
_IN_COMPILE = ("lowbit_compile.enable() rewrites an optimizer on its first step in scope, which torch.compile "
               "cannot capture; wrap the optimizer before compiling (opt = lowbit_compile(opt, ...), or "
               "lowbit_compile.optim.AdamW(...)), or take its first step outside the compiled function; its "
               "later steps are one op in the graph")
_eager_hooks: dict[Callable, Callable] = {}  # made with the hooks (torch.compiler loads dynamo)


_stock_load_state_dict = torch.optim.Optimizer.load_state_dict


@functools.wraps(_stock_load_state_dict)
def _load_state_dict(self: torch.optim.Optimizer, state_dict: dict) -> None:
    """``Optimizer.load_state_dict`` while a scope is open: in scope, a low-bit checkpoint's steps are
    put back first (a wrapped optimizer's own loader does the same), so a stock optimizer takes it."""
    if _active.get():
        state_dict = stock.unmarked_state_dict(state_dict)
    return _stock_load_state_dict(self, state_dict)


def _acquire_hooks() -> None:
    global _hook_users
    with _hook_lock:
        if _hook_users == 0:
            if not _eager_hooks:
                _eager_hooks.update({hook: torch.compiler.disable(hook, reason=_IN_COMPILE)
                                     for hook in (_global_pre_hook, _global_post_hook)})
            _hook_handles.append(register_optimizer_step_pre_hook(_global_pre_hook))
            _hook_handles.append(register_optimizer_step_post_hook(_global_post_hook))
            torch.optim.Optimizer.load_state_dict = _load_state_dict
        _hook_users += 1


def _release_hooks() -> None:
    global _hook_users
    with _hook_lock:
        _hook_users -= 1
        if _hook_users == 0:
            while _hook_handles:
                _hook_handles.pop().remove()
            if torch.optim.Optimizer.load_state_dict is _load_state_dict:  # unless someone replaced it since
                torch.optim.Optimizer.load_state_dict = _stock_load_state_dict


# an optimizer stepped in scope is rewritten (or refused) by Scope._pre_step, not by the stock-step guard
# (a step dynamo traces does not read the scopes: _global_pre_hook decides it in a graph break)
stock.defer_to(lambda opt: not torch.compiler.is_compiling() and bool(_active.get()))
