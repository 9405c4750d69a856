"""``python -m lowbit_compile``: ``run`` an unmodified training script with low-bit optimizer states,
or ``estimate`` the training memory of a model size with and without them.

The command line is parsed, and the script looked for, before torch loads (seconds): options the
library validates (format names, backends) are checked right after, before the script runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import runpy
import signal
import sys
from collections.abc import Sequence
from typing import Any

from .options import (
    FORMATS,
    FP32,
    MAX_PARAM_COUNT,
    PARAM_DTYPE_NAMES,
    Options,
    ScopeOptions,
    cli_flags,
    parse_spec,
    with_formats,
)

# The runner's flags: the options of lowbit_compile and enable() that have one (options.py), and its
# own; everything from the script path (or -m MODULE) on belongs to the script.
_OPTION_FLAGS = cli_flags(Options, ScopeOptions)
_RUNNER_FLAGS: tuple[tuple[str, dict], ...] = (
    ("--restore-on-signal", dict(metavar="SIG", help="switch back to stock fp32 states at the next step after this "
                                                     "signal, e.g. USR2 (kill -USR2 PID)")),
    ("--no-summary", dict(action="store_true", help="do not print the summary at exit")),
)
# Keyword names in library errors, as the flag a user of the CLI types instead.
_FLAG_NAMES = {**{f.name: flag for f, flag in _OPTION_FLAGS}, "param_dtype": "--param-dtype", "zero_stage":
               "--zero-stage", "shards": "--shards", "muon_params": "--muon-params"}


class _HelpFormatter(argparse.HelpFormatter):
    """Lists the registered formats where a flag's help names them (:data:`options.FORMATS`): the registry
    loads torch, so only printing the help loads it, not parsing the command line."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = super()._get_help_string(action)
        if text is None or FORMATS not in text:
            return text
        from .formats import format_names

        return with_formats(text, format_names())


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m lowbit_compile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a training script with its torch.optim optimizers rewritten",
                         usage="python -m lowbit_compile run [options] (script.py | -m module) [args...]",
                         formatter_class=_HelpFormatter)
    for field, flag in _OPTION_FLAGS:
        run.add_argument(flag, dest=field.name, default=field.metadata["cli_default"], help=field.metadata["cli"],
                         **field.metadata["argparse"])
    for flag, kwargs in _RUNNER_FLAGS:
        run.add_argument(flag, **kwargs)
    est = sub.add_parser("estimate", help="training memory of a model size, stock AdamW vs low-bit states",
                         formatter_class=_HelpFormatter)
    est.add_argument("--params", required=True, type=parse_count, help="parameter count: 7e9, 7B, 125M")
    est.add_argument("--param-dtype", default=FP32, help=", ".join(PARAM_DTYPE_NAMES))
    est.add_argument("--master-weights", choices=(FP32, "exact", "8bit"), metavar="MODE",
                     help="the fp32 master of bf16/fp16 params, a MODE as run's flag takes (exact, 8bit: our "
                          "residual in the low-bit column), or fp32 (the recipe's fp32 copy in both columns)")
    for field, flag in _OPTION_FLAGS:
        if field.name in ("fmt", "block_size", "outliers", "release_grads"):
            est.add_argument(flag, dest=field.name, help=field.metadata["cli"], **field.metadata["argparse"])
    est.add_argument("--shards", type=int, default=1, help="devices the sharded components are split over")
    est.add_argument("--zero-stage", type=int, default=3, choices=(1, 2, 3),
                     help="what --shards splits: 1 states, 2 +grads, 3 +params (FSDP full shard)")
    est.add_argument("--amsgrad", action="store_true", help="count the max_exp_avg_sq state too")
    est.add_argument("--muon-params", type=parse_count, default=0,
                     help="how many of the params (the matrices) Muon steps, with one momentum; AdamW the rest")

    if argv[:1] == ["run"]:
        ours, target, script_args = _split_run_argv(argv[1:])
        args = parser.parse_args(["run", *ours])
        if target is None:
            run.error("give the script to run (script.py or -m module)")
        return _run(args, target, script_args, run)
    args = parser.parse_args(argv)
    from . import _load

    _load()  # torch loads here, after the command line was read
    from .estimate import estimate

    try:
        options = _given(fmt=parse_spec(args.fmt, "--fmt") if args.fmt is not None else None,
                         block_size=args.block_size, outliers=args.outliers, release_grads=args.release_grads or None)
        print(estimate(args.params, param_dtype=args.param_dtype, master_weights=args.master_weights,
                       shards=args.shards, zero_stage=args.zero_stage, amsgrad=args.amsgrad,
                       muon_params=args.muon_params, **options))
    except ValueError as err:
        est.error(_as_flags(str(err)))
    return 0


def parse_count(text: str) -> int:
    """A parameter count: ``7e9``, ``7000000000``, ``7B``, ``1.3b``, ``125M``, ``350k`` (``--params``); an
    argparse error, which it prints as is, says what one looks like."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (examples: 7e9, 7B, 1.3b, 125M, 350k)")
    count = float(match.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}[match.group(2)]
    if not count < MAX_PARAM_COUNT + 1:  # 1e400 is inf
        raise argparse.ArgumentTypeError(f"{text!r} is more parameters than can be sized (at most "
                                         f"{MAX_PARAM_COUNT:.0e}: tensor sizes are int64)".replace("e+", "e"))
    if round(count) <= 0:
        raise argparse.ArgumentTypeError(f"the parameter count must be positive, got {text!r}")
    return round(count)


def _parsed(field: Any, flag: str, value: Any) -> Any:
    """A flag's value as its option takes it (None: not given)."""
    parse = field.metadata["parse"]
    return parse(value, flag) if parse is not None and value is not None else value


def _given(**options: Any) -> dict[str, Any]:
    """The options given on the command line (the library's defaults for the others)."""
    return {k: v for k, v in options.items() if v is not None}


def _as_flags(message: str) -> str:
    """A library error (``block_size must be ...``, ``pass param_dtype='bf16'``) in the CLI's terms."""
    def flag(match: re.Match) -> str:
        return _FLAG_NAMES[match.group(1)] + (" " if match.group(2) else "")

    return re.sub(r"(?<![\w-])(" + "|".join(_FLAG_NAMES) + r")\b(=)?", flag, message)


def _split_run_argv(argv: list[str]) -> tuple[list[str], tuple[str, str] | None, list[str]]:
    """(runner options, ("script", path) or ("module", name), the script's own arguments)."""
    takes_value = {flag for f, flag in _OPTION_FLAGS if f.metadata["argparse"].get("action") != "store_true"}
    takes_value |= {flag for flag, kwargs in _RUNNER_FLAGS if kwargs.get("action") != "store_true"}
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-m", "--"):
        i += 1 + (argv[i] in takes_value)
    if i >= len(argv):
        return argv, None, []
    if argv[i] == "--":
        return (argv[:i], ("script", argv[i + 1]), argv[i + 2:]) if i + 1 < len(argv) else (argv[:i], None, [])
    if argv[i] == "-m":
        return (argv[:i], ("module", argv[i + 1]), argv[i + 2:]) if i + 1 < len(argv) else (argv[:i], None, [])
    return argv[:i], ("script", argv[i]), argv[i + 1:]


def _run(args: argparse.Namespace, target: tuple[str, str], script_args: list[str],
         parser: argparse.ArgumentParser) -> int:
    try:
        given = {field.name: _parsed(field, flag, getattr(args, field.name)) for field, flag in _OPTION_FLAGS}
        signum = _signal_number(args.restore_on_signal) if args.restore_on_signal else None
        _check_target(target)
    except ValueError as err:
        parser.error(_as_flags(str(err)))
    from . import _load

    _load()  # torch loads here, after the command line and the script were checked
    from .config import UnmatchedOverride
    from .scope import Scope

    try:
        scope = Scope(**_given(**given))
    except (ValueError, TypeError, NotImplementedError) as err:
        parser.error(_as_flags(str(err)))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("lowbit-compile: %(message)s"))
    logging.getLogger(__package__).addHandler(handler)
    logging.getLogger(__package__).setLevel(logging.INFO)
    if signum is not None:
        signal.signal(signum, lambda *_: scope.request_restore())
    kind, name = target
    unmatched: UnmatchedOverride | None = None
    try:
        with scope:
            if kind == "script":
                sys.argv = [name, *script_args]
                sys.path[0] = os.path.dirname(os.path.abspath(name))
                globals_ = runpy.run_path(name, run_name="__main__")
            else:
                sys.argv = [name, *script_args]
                sys.path[0] = os.getcwd()
                globals_ = runpy.run_module(name, run_name="__main__", alter_sys=True)
            scope.refresh()  # optimizers the script kept at module level are still alive here
            del globals_
    except UnmatchedOverride as err:  # names are known at the first step: a bad option all the same
        unmatched = err
    finally:
        if unmatched is None and not args.no_summary and os.environ.get("RANK", "0") == "0":
            print(scope.summary(), file=sys.stderr)
    if unmatched is not None:
        print(f"{parser.prog}: error: --override {unmatched.pattern!r} matches no parameter name of the modules the "
              f"script ran ({unmatched.names}); fix or remove it.{unmatched.hint}", file=sys.stderr)
        return 2
    return 0


def _check_target(target: tuple[str, str]) -> None:
    """A script that is not there, or a module that cannot be found, is an error before anything runs."""
    kind, name = target
    if kind == "script" and not os.path.isfile(name):
        raise ValueError(f"no such script: {name!r} (give a path to a Python file, or -m module.name)")
    if kind == "module":
        first, sys.path[0] = sys.path[0], os.getcwd()  # where _run will look for it
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package that does not exist
            found = False
        finally:
            sys.path[0] = first
        if not found:
            raise ValueError(f"no module named {name!r} (with -m, give an importable module, e.g. mypkg.train)")


def _signal_number(name: str) -> int:
    """The signal ``name`` names, if it is one a user sends on purpose: not one that cannot be caught
    (KILL, STOP), one a fault raises (a handler that returns would hang on SEGV), INT (Ctrl-C must still
    interrupt) or TERM (a stop request must still stop)."""
    upper = name.upper()
    number = getattr(signal, upper if upper.startswith("SIG") else f"SIG{upper}", None)
    if not isinstance(number, signal.Signals):
        raise ValueError(f"--restore-on-signal: unknown signal {name!r} (e.g. USR1, USR2)")
    allowed = {signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP}
    if number not in allowed and not signal.SIGRTMIN <= number <= signal.SIGRTMAX:
        raise ValueError(f"--restore-on-signal: {number.name} cannot be used; use USR1, USR2, HUP or a "
                         "real-time signal (kill -USR2 PID)")
    return int(number)
