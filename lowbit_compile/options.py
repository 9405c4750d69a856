"""The user options, written once: each a dataclass field with its type, default and doc, from which
the keyword API (``lowbit_compile``, ``enable``/``Scope``, the ``lowbit_compile.optim`` classes) and the
flags of ``python -m lowbit_compile`` are derived. ``config.Config.of`` validates them, once.

Imports neither torch nor the rest of the package: the CLI reads it before torch loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    import torch

# Chosen from bench/quality.py and bench/zero_point.py (docs/formats-and-quality.md).
DEFAULT_FMT = "sqrt8"
DEFAULT_BLOCK_SIZE = 512
DEFAULT_OUTLIERS = 0
DEFAULT_MIN_8BIT_SIZE = 4096
MAX_PARAM_COUNT = 10**18  # the most parameters estimate() sizes: tensor sizes are int64 (9.2e18)
# How options and messages spell a parameter's dtype (fp32, bf16, fp16: estimate's param_dtype, the CLI's
# --param-dtype, repr's per-state summary); the first is also estimate's master_weights of a plain fp32 copy.
PARAM_DTYPE_NAMES = ("fp32", "bf16", "fp16")
FP32 = PARAM_DTYPE_NAMES[0]

FmtSpec = str | Mapping[str, str]
RoundingSpec = str | Mapping[str, str]  # "auto" | "nearest" | "stochastic", or per state
# Which parameters an override applies to: a glob on the qualified parameter name
# ("*embed*", "blocks.*.norm.weight"), a compiled regex (``re.search`` on the name), or a predicate
# ``(name, param) -> bool`` (``name`` is None when the parameter's name is unknown).
Matcher = str | re.Pattern | Callable[[str | None, "torch.Tensor"], bool]
Overrides = Mapping[Matcher, FmtSpec] | Sequence[tuple[Matcher, FmtSpec]]


def parse_spec(text: str, flag: str) -> str | dict[str, str]:
    """A flag's ``int8``, or per state ``exp_avg=int8,exp_avg_sq=dynamic8`` (``--fmt``, ``--rounding``)."""
    if "=" not in text:
        return text
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"{flag} {text!r}: expected a value or state=value pairs separated by commas")
    return {k.strip(): v.strip() for k, v in pairs}


def parse_overrides(items: list[str], flag: str) -> list[tuple[str, str]] | None:
    r"""Repeated ``PATTERN=FMT`` (``--override '*embed*=fp32'``, ``--override 're:\.norm\d=bf16'``) as
    ``overrides=`` pairs."""
    pairs = [tuple(item.rsplit("=", 1)) for item in items]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"{flag} takes PATTERN=FMT, got {items}")
    return pairs or None  # type: ignore[return-value]


def parse_steps_or_none(value: int, flag: str) -> int | None:
    """``--log-every N``: a non-negative count of steps, 0 for none."""
    if value < 0:
        raise ValueError(f"{flag} must be a non-negative int (0: no progress lines), got {value}")
    return value or None


def option(default: Any, doc: str, *, always_shown: bool = False, cli: str | None = None, flag: str | None = None,
           parse: Callable | None = None, cli_default: Any = None, **argparse_kwargs: Any) -> Any:
    """A field of an options dataclass: ``doc`` for the API's docstring; ``always_shown``: in a wrapped
    optimizer's ``repr`` even at its default (the others when set); ``cli`` (the help line) when
    ``python -m lowbit_compile run`` has a flag for it, named ``flag`` (``--`` and the name with dashes if
    None), parsed from the flag's value by ``parse(value, flag)`` (as given if None), ``cli_default``
    when not given (None: the library's default); other keywords go to ``argparse.add_argument``."""
    return dataclasses.field(default=default, metadata=dict(doc=doc, always_shown=always_shown, cli=cli, flag=flag,
                                                            parse=parse, cli_default=cli_default,
                                                            argparse=argparse_kwargs))


@dataclasses.dataclass(frozen=True)
class Options:
    """What ``lowbit_compile(opt, ...)`` takes besides the optimizer (``model`` is how parameter names
    are known; the others configure the states, see ``config.Config``)."""

    fmt: str | Mapping[str, str] = option(
        DEFAULT_FMT,
        'a registered format, one of {formats} (``"fp32"``: the stock tensor, bit for bit), or a dict from state '
        'name to one of those (any case: ``"INT8"`` is ``"int8"``). The default, ``"sqrt8"`` in blocks of 512 '
        'without patches, was chosen on the quality, zero-point and step-time benchmarks '
        '(docs/formats-and-quality.md); ``"dynamic8"`` spans more decades below a block\'s largest value.',
        always_shown=True,
        cli=f"state format ({DEFAULT_FMT}, the default; registered: {{formats}}) or per state: "
            "exp_avg=int8,exp_avg_sq=dynamic8", parse=parse_spec)
    block_size: int | None = option(
        None,
        f"elements sharing one scale; a power of two (at most 32768). None: {DEFAULT_BLOCK_SIZE}, or the smaller "
        "block a 4-bit format is measured best with (docs/formats-and-quality.md); a parameter's states share "
        "the smallest of their formats' blocks.",
        always_shown=True,
        cli=f"elements per scale (default {DEFAULT_BLOCK_SIZE}; a 4-bit format's own, smaller)", type=int)
    outliers: int = option(
        DEFAULT_OUTLIERS,
        "largest-magnitude values per block kept exactly in bf16 (patches); they help the linear int8 grid, not "
        "the companded sqrt8 and dynamic8.",
        always_shown=True,
        cli=f"bf16 outlier patches per block (default {DEFAULT_OUTLIERS})", type=int)
    min_8bit_size: int = option(
        DEFAULT_MIN_8BIT_SIZE, "tensors with fewer elements keep stock fp32 states.", always_shown=True,
        cli=f"tensors with fewer elements keep stock fp32 states (default {DEFAULT_MIN_8BIT_SIZE})", type=int)
    backend: str = option(
        "auto",
        'one of ``lowbit_compile.config.BACKENDS``: ``"auto"`` (the fused lowering for the parameters\' device) '
        'or a named one, ``"reference"`` being the eager oracle.',
        always_shown=True,
        cli="auto (the default: the fused kernel for the device), cpu, triton or reference")
    overrides: Overrides | None = option(
        None,
        "per-parameter formats, first match wins: ``{pattern: fmt}`` or ``[(pattern, fmt)]`` where a pattern is "
        'a glob on the parameter name (``"*embed*"``), a regular expression (compiled, or a string after '
        '``"re:"``: ``"re:layers\\.\\d+\\.attn"``; ``re.search`` on the name), or a predicate ``(name, param) -> '
        'bool``; e.g. ``{"*norm*": "fp32", "*embed*": "bf16"}``. A pattern that matches no name is an error. '
        "Overrides win over ``min_8bit_size``; sizes and shapes are the full (unsharded) tensor's.",
        cli="format for parameters whose name matches the glob (or, after re:, the regular expression), e.g. "
            "'*embed*=fp32' (repeatable; first match wins; names come from the modules run, so a pattern that "
            "matches none fails at the first step)",
        flag="--override", parse=parse_overrides, action="append", metavar="PATTERN=FMT")
    model: torch.nn.Module | Iterable[tuple[str, torch.Tensor]] | None = option(
        None, "the module (or ``named_parameters()`` pairs) that gives name patterns their names.")
    master_weights: str | None = option(
        None,
        '``"exact"`` or ``"8bit"``: step each bf16/fp16 parameter through its fp32 master, held as the param plus '
        'a residual state (``master_residual``): ``"exact"`` is bit for bit an fp32 master copy stepped by the '
        'stock optimizer and the param refreshed from it (2.125 B/param), ``"8bit"`` keeps the master to 1/256 of '
        "the param's spacing, unbiased (1 B/param). The stock states are then those of the fp32 step (then in "
        "``fmt``). fp32 parameters are their own master and stay as they are. See ``lowbit_compile.state.master``.",
        cli="keep the fp32 master of bf16/fp16 params as a residual state: exact (2.125 B/param, bit for bit an "
            "fp32 master copy) or 8bit (1 B/param)", metavar="MODE")
    rounding: RoundingSpec = option(
        "auto",
        '``"auto"``, ``"nearest"`` or ``"stochastic"``, or a dict from state name to one of those (the states it '
        'leaves out as ``"auto"``): how a quantized state\'s new values round to codes. Stochastic rounding '
        "picks one of the two adjacent codes with probability proportional to proximity (unbiased to 2^-17 of "
        "a code gap: 16 random bits per rounding), with random bits of a per-parameter step counter "
        "(``rounding_seed``, saved with the state, so a resumed run is bit for bit the uninterrupted one). "
        '``"auto"`` rounds the non-negative states of the 8-bit formats stochastically (Adam\'s ``exp_avg_sq``, '
        "which rounding to nearest holds above its average on long runs: docs/formats-and-quality.md#long-run) "
        'and the rest to nearest; ``"nearest"`` rounds every state to nearest (the default before). '
        "See docs/numerics.md.",
        cli="how quantized states round: auto (the default: v stochastically, m to nearest), nearest or "
            "stochastic, or per state: exp_avg=stochastic,exp_avg_sq=nearest", parse=parse_spec)
    release_grads: bool = option(
        False,
        "step each parameter inside backward as soon as its grad is complete, and free the grad at once, so the "
        "grads never all exist together (up to the grads' bytes off the peak). Params and states stay bit for "
        "bit those of stepping after backward; ``opt.step()`` completes the iteration. Off by default: what "
        "needs every grad at once (a global-norm clip, GradScaler, DDP) cannot follow and is refused, and "
        "backwards that accumulate must say so (``with opt.no_step():``). See docs/memory.md#gradient-release.",
        cli="step each param in backward as its grad completes and free the grad (saves the grads' memory; "
            "refuses clip_grad_norm_, GradScaler, DDP)", action="store_true")

    def kept(self) -> dict[str, Any]:
        """The options as keywords, less ``model``: what a wrapped optimizer keeps, and a copy of it (a
        deep copy, an unpickled one) is wrapped with again."""
        return {k: v for k, v in keywords(self).items() if k != "model"}

    @staticmethod
    def shown(kept: Mapping[str, Any]) -> dict[str, Any]:
        """Of ``kept`` options, those a wrapped optimizer's ``repr`` names: the ones always shown, and the
        others when set (not their default, nor empty)."""
        return {f.name: kept[f.name] for f in dataclasses.fields(Options) if f.name in kept
                and (f.metadata["always_shown"] or (kept[f.name] and kept[f.name] != f.default))}


@dataclasses.dataclass(frozen=True)
class ScopeOptions:
    """What ``enable(...)`` takes besides the options of ``lowbit_compile``."""

    restore_at_step: int | None = option(
        None, "switch each rewritten optimizer back to stock fp32 states after that many steps.",
        cli="switch each optimizer back to stock fp32 states after its N-th step", type=int, metavar="N")
    restore_on_exit: bool = option(False, "switch the optimizers rewritten in scope back when the scope ends.")
    monitor: int | None = option(
        None, "sample each rewritten optimizer's health every N steps while in scope (``lowbit_compile.monitor``).",
        cli="sample each rewritten optimizer's state health every N steps; warn (naming the parameter) when a "
            "state is truncated", type=int, metavar="N")
    log_every: int | None = option(
        None, "log a progress line every N steps.",
        cli="a progress line every N steps: step time, state memory saved (0: none)", type=int, metavar="N",
        parse=parse_steps_or_none, cli_default=100)

    def __post_init__(self) -> None:
        if self.restore_at_step is not None and (not is_int(self.restore_at_step) or self.restore_at_step < 1):
            raise ValueError(f"restore_at_step must be a positive int or None, got {self.restore_at_step!r}")
        for name in ("monitor", "log_every"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"{name} must be a positive int (a number of steps) or None, got {value!r}")


def keywords(options: Options | ScopeOptions) -> dict[str, Any]:
    """``options`` as the keywords that make it (a shallow view: values are not copied)."""
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}


class OptionKeywords(TypedDict, total=False):
    """The keywords of ``lowbit_compile`` after ``fmt``, for static type checkers (``**options:
    Unpack[OptionKeywords]``); ``tests/test_options.py`` holds them to :class:`Options`."""

    block_size: int | None
    outliers: int
    min_8bit_size: int
    backend: str
    overrides: Overrides | None
    model: torch.nn.Module | Iterable[tuple[str, torch.Tensor]] | None
    master_weights: str | None
    rounding: RoundingSpec
    release_grads: bool


def _optim_bits(value: Any) -> str:
    if value == 32:
        return "fmt='fp32' keeps stock 32-bit states"
    return ("8-bit states are the default here (fmt='sqrt8'); fmt='dynamic8' is bitsandbytes' own dynamic map: "
            "remove optim_bits")


def _no_op_or(off: Any, instead: str) -> Callable[[Any], str]:
    """The message of a keyword that does nothing at ``off`` (remove it) and has no equivalent otherwise."""
    return lambda value: "it does nothing at that value: remove it" if value == off else instead


# Keywords of bitsandbytes' and torchao's 8-bit optimizers that users carry over to lowbit_compile, with
# what each becomes here (from the value given). min_8bit_size and block_size are options here too.
FOREIGN_KEYWORDS: dict[str, tuple[str, Callable[[Any], str]]] = {
    "optim_bits": ("bitsandbytes", _optim_bits),
    "block_wise": ("bitsandbytes", lambda value: (
        "states are always quantized in blocks here: remove it (block_size= sets the block: bitsandbytes uses "
        "256, the default here is 512)" if value else
        "per-tensor scales are not available: block_size=32768 is the largest block")),
    "percentile_clipping": ("bitsandbytes", _no_op_or(
        100, "there is no percentile clipping here: clip gradients before the step "
             "(torch.nn.utils.clip_grad_norm_) and remove it")),
    "max_unorm": ("bitsandbytes", _no_op_or(
        0.0, "there is no update-norm clipping here: clip gradients before the step and remove it")),
    "is_paged": ("bitsandbytes", _no_op_or(
        False, "there is no paged (CPU-offloaded) mode here: 8-bit states (about 2 B/param) stay on the "
               "parameter's device; remove it")),
    "args": ("bitsandbytes", lambda value: "bitsandbytes' GlobalOptimManager settings: per-parameter formats are "
                                           "overrides= here (e.g. overrides={'*embed*': 'fp32'})"),
    "skip_zeros": ("bitsandbytes", _no_op_or(
        False, "every element is stepped here, as torch.optim steps it: remove it")),
    "bf16_stochastic_round": ("torchao", lambda value: (
        "for bf16 params, master_weights='8bit' (unbiased, 1 B/param) or 'exact' keeps the bits each step "
        "rounds away; rounding='stochastic' rounds the 8-bit states" if value else "remove it")),
}


def refuse_foreign(where: str, given: Iterable[tuple[str, Any]]) -> None:
    """A TypeError for the first of ``given`` (keyword, value) pairs that is another library's option,
    saying what it is here."""
    for name, value in given:
        if name in FOREIGN_KEYWORDS:
            library, describe = FOREIGN_KEYWORDS[name]
            raise TypeError(f"{where} got {name}={value!r}, a keyword of {library}'s 8-bit optimizers, not of "
                            f"lowbit_compile: {describe(value)}")


def from_keywords(where: str, given: Mapping[str, Any], *schemas: type) -> list[Any]:
    """``given`` keywords as one instance of each schema; an unknown keyword is a TypeError that names
    the keywords ``where`` takes (and the one it resembles)."""
    names = [f.name for schema in schemas for f in dataclasses.fields(schema)]
    unknown = sorted(set(given) - set(names))
    refuse_foreign(where, ((k, given[k]) for k in unknown))
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(f"{where} got an unexpected keyword argument {unknown[0]!r}{hint}; it takes "
                        f"{', '.join(names)}")
    return [schema(**{f.name: given[f.name] for f in dataclasses.fields(schema) if f.name in given})
            for schema in schemas]


def entry_signature(head: Iterable[inspect.Parameter], *schemas: type, returns: Any = inspect.Signature.empty
              ) -> inspect.Signature:
    """The signature of an entry point taking ``head`` then the fields of ``schemas``: ``fmt`` also by
    position (as ``lowbit_compile(opt, "int8")``), the others by keyword."""
    params = list(head)
    for schema in schemas:
        for f in dataclasses.fields(schema):
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if f.name == "fmt" else inspect.Parameter.KEYWORD_ONLY
            params.append(inspect.Parameter(f.name, kind, default=f.default, annotation=f.type))
    return inspect.Signature(params, return_annotation=returns)


def args_doc(*schemas: type, formats: Sequence[str], indent: int = 8) -> str:
    """The ``Args:`` lines of the fields of ``schemas``, for an entry point's docstring; ``formats``: the
    registered format names (``formats.format_names()``), which this module cannot import (no torch here)."""
    lines = []
    for schema in schemas:
        for f in dataclasses.fields(schema):
            doc = with_formats(f.metadata["doc"], formats, quoted=True)
            lines.append(textwrap.fill(f"{f.name}: {doc}", 108, initial_indent=" " * indent,
                                       subsequent_indent=" " * (indent + 4)))
    return "\n".join(lines)


FORMATS = "{formats}"  # where an option's doc or CLI help lists the registered formats


def with_formats(text: str, formats: Sequence[str], quoted: bool = False) -> str:
    """``text`` with the registered format names where it says :data:`FORMATS` (as literals in a docstring)."""
    return text.replace(FORMATS, ", ".join(f'``"{n}"``' if quoted else n for n in formats))


def cli_flags(*schemas: type) -> list[tuple[dataclasses.Field, str]]:
    """The fields of ``schemas`` that ``python -m lowbit_compile run`` has a flag for, with the flag."""
    return [(f, f.metadata["flag"] or "--" + f.name.replace("_", "-"))
            for schema in schemas for f in dataclasses.fields(schema) if f.metadata["cli"] is not None]


def is_int(value: object) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)
