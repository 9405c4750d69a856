"""The options of ``lowbit_compile`` (``options.Options``) validated once, as a :class:`Config`, and the
per-parameter choice of state formats."""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from .formats import StateFormat, element_format, format_names, passthrough
from .formats.residual import MODES as MASTER_MODES
from .formats.residual import PARAM_DTYPES as MASTERED_DTYPES
from .formats.residual import MasterFormat
from .formats.rounding import DEFAULT_ROUNDING, ROUNDINGS
from .kernels import backends
from .options import (  # noqa: F401 (the defaults and spec types, where they were named before options.py)
    DEFAULT_BLOCK_SIZE,
    DEFAULT_FMT,
    DEFAULT_MIN_8BIT_SIZE,
    DEFAULT_OUTLIERS,
    FmtSpec,
    Matcher,
    Options,
    Overrides,
    RoundingSpec,
    is_int,
)

BACKENDS = backends.BACKENDS  # the one list of backends (the API, enable(), the CLI and the docs name these)

# Adam's states known never to be negative: what formats_for assumes when not given the states
# proven non-negative on the traced step (passes/signs.py; the compile path always passes those). They get
# unsigned codes and a quantizer that never stores a positive value as zero (see StateFormat). A
# state missing here is treated as signed, which is always correct, only coarser.
NONNEG_STATES = frozenset({"exp_avg_sq", "max_exp_avg_sq"})

# The per-element states of the stock optimizers lowbit_compile rewrites (runtime.wrap.SUPPORTED, every flag):
# a fmt dict or override may name these for an optimizer that lacks them (one config for several
# optimizers); any other name must be a per-element state of the optimizer it is applied to.
STOCK_STATES = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "grad_avg",
                          "acc_delta", "sum", "exp_inf", "ax", "prev", "step_size"})

@dataclass(frozen=True)
class Config:
    """What ``lowbit_compile(opt, ...)`` was asked for."""

    fmt: str | tuple[tuple[str, str], ...]
    block_size: int | None  # None: the formats' own (block_size_of)
    outliers: int
    min_8bit_size: int
    backend: str
    overrides: tuple[tuple[Matcher, str | tuple[tuple[str, str], ...]], ...] = ()
    master_weights: str | None = None  # "exact", "8bit" or None: how 16-bit params keep their fp32 master
    rounding: str | tuple[tuple[str, str], ...] = DEFAULT_ROUNDING  # how quantized states round, or per state
    release_grads: bool = False  # step each param in backward as its grad completes (release.py)

    @staticmethod
    def of(options: Options) -> Config:
        """Validate every option up front (all of ``options`` but ``model``), naming the bad one and the fix."""
        fmt_key = _fmt_key(options.fmt, "fmt")
        rounding_key = _spec_key(options.rounding, "rounding", ROUNDINGS)
        overrides, block_size, outliers = options.overrides, options.block_size, options.outliers
        pairs = overrides.items() if isinstance(overrides, Mapping) else (overrides or ())
        override_keys = []
        for i, pair in enumerate(pairs):
            if not isinstance(pair, Sequence) or len(pair) != 2:
                raise ValueError(f"overrides[{i}] must be a (pattern or predicate, fmt) pair, got {pair!r}")
            matcher, spec = pair
            if not isinstance(matcher, (str, re.Pattern)) and not callable(matcher):
                raise TypeError(f"override pattern {matcher!r} must be a glob string, a compiled regex or a "
                                "predicate (name, param) -> bool (a string starting 're:' is a regex)")
            if isinstance(matcher, str):
                matcher = _pattern(matcher)
            override_keys.append((matcher, _fmt_key(spec, f"overrides[{matcher!r}]")))
        if block_size is not None and (not is_int(block_size) or block_size < 1 or block_size & (block_size - 1)):
            raise ValueError(f"block_size must be a positive power of two (e.g. 256 or 2048) or None (the formats' "
                             f"own), got {block_size!r}")
        if block_size is not None and block_size > 32768:
            raise ValueError(f"block_size must be at most 32768 (patch offsets are int16), got {block_size}")
        smallest = block_size or min([DEFAULT_BLOCK_SIZE, *_default_blocks(fmt_key, override_keys)])
        if not is_int(outliers) or not 0 <= outliers <= min(smallest, 64):
            raise ValueError(f"outliers must be an int in [0, min(block_size, 64)] (block_size {smallest} here), got "
                             f"{outliers!r}")
        if block_size == 1 and any(element_format(n).bits == 4 for n in _named_formats(fmt_key, override_keys)):
            raise ValueError("block_size must be at least 2 for a 4-bit format (a block is whole bytes, two codes "
                             "each), got 1")
        if not is_int(options.min_8bit_size) or options.min_8bit_size < 0:
            raise ValueError(f"min_8bit_size must be a non-negative int, got {options.min_8bit_size!r}")
        if options.master_weights is not None and options.master_weights not in MASTER_MODES:
            raise ValueError(f"master_weights must be one of {MASTER_MODES} or None, got {options.master_weights!r}")
        if not isinstance(options.release_grads, bool):
            raise TypeError(f"release_grads must be True or False, got {options.release_grads!r}")
        return Config(fmt_key, block_size, outliers, options.min_8bit_size, backends.canonical(options.backend),
                      tuple(override_keys), options.master_weights, rounding_key, options.release_grads)

    @property
    def uses_names(self) -> bool:
        """Whether some override matches on parameter names (so the names must be known)."""
        return any(isinstance(m, (str, re.Pattern)) for m, _ in self.overrides)

    @property
    def state_names(self) -> frozenset[str]:
        """Every state name that the fmt dict and the overrides' fmt dicts give a format."""
        specs = [self.fmt, self.rounding, *(spec for _, spec in self.overrides)]
        return frozenset(k for spec in specs if not isinstance(spec, str) for k, _ in spec)

    def check_state_names(self, kept: Collection[str], optimizer: str) -> None:
        """Refuse a state name that neither this optimizer nor any stock one keeps per element."""
        unknown = sorted(self.state_names - set(kept) - STOCK_STATES)
        if unknown:
            close = {n: difflib.get_close_matches(n, sorted(set(kept) | STOCK_STATES), n=1) for n in unknown}
            hints = "; ".join(f"{n!r}" + (f" (did you mean {c[0]!r}?)" if c else "") for n, c in close.items())
            raise ValueError(f"fmt or rounding names states that {optimizer} does not keep per element: {hints}; "
                             f"its per-element states are {sorted(kept)}")

    def check_patterns(self, names: Collection[str]) -> None:
        """Refuse a name pattern that matches no parameter name: overrides exist to keep chosen
        parameters (embeddings, norms) in another format, and a pattern with a typo would quantize
        them without a word."""
        names = list(names)
        for matcher, _ in self.overrides:
            if isinstance(matcher, (str, re.Pattern)) and not any(_matches(matcher, n, None) for n in names):
                shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
                text = REGEX_PREFIX + matcher.pattern if isinstance(matcher, re.Pattern) else matcher
                regex = isinstance(matcher, str) and re.search(r"\\|\^|\$|\+|\(|\||\{|\.\*", matcher)
                hint = (f" It is a glob ('*' any characters, '?' one); for a regular expression write "
                        f"{REGEX_PREFIX + matcher!r}." if regex else "")
                raise UnmatchedOverride(f"override pattern {text!r} matches no parameter name ({shown}); fix or "
                                        f"remove it.{hint}", text, shown, hint)

    def stochastic(self, formats: Mapping[str, StateFormat]) -> frozenset[str]:
        """The quantized states of ``formats`` that round stochastically (:func:`rounds_stochastically`:
        a per-state dict's unnamed states as the default does; fp32 states never round)."""
        return frozenset(k for k, f in formats.items()
                         if rounds_stochastically(_pick(self.rounding, k) or DEFAULT_ROUNDING, f))

    def format_name(self, state_key: str) -> str:
        return _pick(self.fmt, state_key) or DEFAULT_FMT

    def master_format(self, param: torch.Tensor) -> MasterFormat | None:
        """How ``param`` keeps its fp32 master (None: it is fp32, its own master, or the option is off)."""
        if self.master_weights is None or param.dtype not in MASTERED_DTYPES:
            return None
        return MasterFormat(self.master_weights, param.dtype)

    def formats_for(self, param: torch.Tensor, per_element: tuple[str, ...], name: str | None = None,
                    nonneg: Collection[str] = NONNEG_STATES) -> tuple[tuple[str, StateFormat], ...]:
        """The format of each per-element state of ``param`` (named ``name`` in its model).

        The first override whose pattern or predicate matches wins (a state its format dict leaves
        out falls through to the rules below); otherwise tensors under ``min_8bit_size`` elements
        keep the stock fp32 state, and the rest get ``fmt``. Sizes and the shape a predicate sees
        are the full (unsharded) tensor's: a DTensor reports its global shape, so every rank of a
        sharded model decides alike. The states in ``nonneg`` are stored unsigned.
        """
        spec = next((s for m, s in self.overrides if _matches(m, name, param)), None)
        small = param.numel() < self.min_8bit_size
        if param.numel() == 0:  # nothing to store: a stock (empty) state whatever the overrides say
            spec, small = None, True
        names = []
        for key in per_element:
            fmt_name = _pick(spec, key) if spec is not None else None
            names.append(fmt_name or (passthrough().name if small else self.format_name(key)))
        block = self.block_size_of(names)
        return tuple((key, StateFormat.make(n, block, self.outliers, key in nonneg))
                     for key, n in zip(per_element, names))

    def block_size_of(self, names: Iterable[str]) -> int:
        """The block of a parameter whose states have the formats ``names``: ``block_size`` where given,
        else the smallest default of those formats (a 4-bit one's, ``ElementFormat.default_block_size``),
        ``DEFAULT_BLOCK_SIZE`` for the others; one block for all, as the fused kernels step them."""
        if self.block_size is not None:
            return self.block_size
        return min((DEFAULT_BLOCK_SIZE, *map(own_block_size, names)))


def own_block_size(name: str) -> int:
    """The block the format ``name`` takes when ``block_size`` is not given: its own
    (``ElementFormat.default_block_size``, sqrt4's 128), else ``DEFAULT_BLOCK_SIZE``."""
    return element_format(name).default_block_size or DEFAULT_BLOCK_SIZE


class UnmatchedOverride(ValueError):
    """An override's name pattern that matches no parameter name: the pattern as written, the names
    (the first few) and a hint, for the CLI to say it in its own terms."""

    def __init__(self, message: str, pattern: str, names: str, hint: str) -> None:
        super().__init__(message)
        self.pattern, self.names, self.hint = pattern, names, hint


REGEX_PREFIX = "re:"  # an override pattern string starting so is a regular expression (re.search), not a glob


def _pattern(text: str) -> str | re.Pattern:
    """An override's name pattern given as a string: a glob, or after ``re:`` a regular expression."""
    if text.startswith(REGEX_PREFIX):
        try:
            return re.compile(text[len(REGEX_PREFIX):])
        except re.error as err:
            raise ValueError(f"override pattern {text!r} is not a valid regular expression: {err}") from None
    if not text:
        raise ValueError("an override pattern is empty: it would match no parameter name; give a glob such as "
                         "'*embed*', or 're:' and a regular expression")
    return text


def param_names(model: torch.nn.Module | Iterable[tuple[str, torch.Tensor]]) -> dict[torch.Tensor, str]:
    """Parameter -> qualified name, from a module or from ``named_parameters()``-style pairs
    (a parameter shared under several names keeps the first)."""
    pairs = model.named_parameters(remove_duplicate=False) if isinstance(model, torch.nn.Module) else model
    names: dict[torch.Tensor, str] = {}
    for name, param in pairs:
        names.setdefault(param, name)
    return names


def _matches(matcher: Matcher, name: str | None, param: torch.Tensor) -> bool:
    if isinstance(matcher, str):
        return name is not None and fnmatch.fnmatchcase(name, matcher)
    if isinstance(matcher, re.Pattern):
        return name is not None and matcher.search(name) is not None
    return bool(matcher(name, param))


def _pick(spec: str | tuple[tuple[str, str], ...] | None, state_key: str) -> str | None:
    """The format a (validated) fmt spec gives ``state_key``; None when a per-state dict omits it."""
    if spec is None or isinstance(spec, str):
        return spec
    return dict(spec).get(state_key)


def _named_formats(fmt_key: str | tuple[tuple[str, str], ...], overrides: Iterable[tuple[object, object]]
                   ) -> set[str]:
    """Every format name the validated fmt and the overrides' fmt specs name."""
    specs = [fmt_key, *(spec for _, spec in overrides)]
    return {n for spec in specs for n in ([spec] if isinstance(spec, str) else [n for _, n in spec])}


def _default_blocks(fmt_key: str | tuple[tuple[str, str], ...], overrides: Iterable[tuple[object, object]]
                    ) -> list[int]:
    """The default blocks (``ElementFormat.default_block_size``) of the formats named, where they have one."""
    return [b for n in _named_formats(fmt_key, overrides) if (b := element_format(n).default_block_size)]


def _fmt_key(fmt: object, what: str) -> str | tuple[tuple[str, str], ...]:
    """A validated, hashable form of a fmt argument: a name, or sorted (state, name) pairs."""
    return _spec_key(fmt, what, format_names(), _width_hint)


# A width as other libraries name a state format: bitsandbytes' "8bit" and "4bit", "int4", "nf4", "16-bit".
_WIDTH = re.compile(r"(?:int|uint|fp|nf|q)?(\d+)[-_ ]?(?:bits?|b)?")


def _width_hint(name: str) -> str | None:
    """What a name of a width means here: the formats of that width (the default first), or that there
    are none yet; None for a name that is not a width."""
    match = _WIDTH.fullmatch(name)
    if match is None:
        return None
    bits = int(match.group(1))
    widths = {f: StateFormat(f).bits for f in format_names()}
    same = sorted((f for f, b in widths.items() if b == bits), key=lambda f: f != DEFAULT_FMT)
    if not same:
        smallest = min(widths.values())
        return (f"{bits}-bit formats are not available{' yet' if bits < smallest else ''}; the smallest states "
                f"here are {smallest}-bit: "
                f"{sorted(f for f, b in widths.items() if b == smallest)}, {DEFAULT_FMT!r} the default")
    default = " (the default)" if same[0] == DEFAULT_FMT else ""
    return f"did you mean {same[0]!r}{default}? The {bits}-bit formats are {same}"


def _spec_key(spec: object, what: str, choices: tuple[str, ...], hint: Callable[[str], str | None] | None = None
              ) -> str | tuple[tuple[str, str], ...]:
    """A validated, hashable form of an option given as one of ``choices`` or a dict from state name to one."""
    if isinstance(spec, Mapping):
        for key in spec:
            if not isinstance(key, str):
                raise TypeError(f"{what} keys must be state names (str), got {key!r}")
        return tuple(sorted((key, _choice(value, f"{what}[{key!r}]", choices, hint)) for key, value in spec.items()))
    return _choice(spec, what, choices, hint)


def _choice(value: object, what: str, choices: tuple[str, ...], hint: Callable[[str], str | None] | None = None
            ) -> str:
    """``value`` as the one of ``choices`` it names, in any case ("INT8" is "int8"); else an error that
    suggests the choices it starts (``"fp8"``: fp8_e4m3 or fp8_e5m2), what ``hint`` makes of it, or the
    choices it resembles."""
    if isinstance(value, str):
        name = value.strip().lower()
        if name in choices:
            return name
        close = [c for c in choices if c.startswith(name)] if name else []
        if not close and hint is not None and (said := hint(name)) is not None:
            raise ValueError(f"{what} must be one of {choices}, got {value!r}: {said}")
        close = close or difflib.get_close_matches(name, choices, n=2, cutoff=0.6)
        if close:
            raise ValueError(f"{what} must be one of {choices}, got {value!r} (did you mean "
                             f"{' or '.join(map(repr, close))}?)")
    raise ValueError(f"{what} must be one of {choices}, got {value!r}")


def rounds_stochastically(spec: str, fmt: StateFormat) -> bool:
    """Whether a state of ``fmt`` rounds stochastically under ``spec`` (one of :data:`ROUNDINGS`): ``"auto"``
    (the default) for the non-negative states of the 8-bit formats, the second moments the sign pass
    proves (Adam's ``exp_avg_sq``, RMSprop's ``square_avg``, ...): they decay by under a code a step, which
    rounding to nearest holds in place (v's ratchet, docs/numerics.md); signed states (momenta) and the
    16-bit bf16 states round to nearest."""
    if fmt.passthrough:
        return False
    if spec == "auto":
        return fmt.nonneg and fmt.blockwise
    return spec == "stochastic"
