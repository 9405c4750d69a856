"""Stochastic rounding of 8-bit states: does it win back what round-to-nearest loses where a state moves
less per step than one code gap? Harness over Lion on digits (``examples/lion.py``: its momentum
moves 1% a step), the diffusion task (``bench/diffusion.py``) and the long GPT run (``bench/long_run.py``).

    python bench/rounding.py                      # Lion/digits: every format, nearest vs stochastic, 3 seeds
    python bench/rounding.py --report             # the table, with the SR rows of diffusion.json, long_run.json
    python bench/diffusion.py --variants dynamic8+sr-proto int8+sr-proto --resume   # SR rows of the other two
    python bench/long_run.py --variants dynamic8+sr-proto --seeds 0 --resume

Optimizer names (here and in the two benches above): ``fp32``; one of ours as in ``bench/tasks.py``
(``dynamic8``, ``int8-b2048-k0``, ...: the library with its default rounding, v stochastically and m to
nearest); ``<ours>+nearest``: the library rounding every state to nearest (the default before);
``<ours>+sr-v``: the library with stochastic rounding of the second moments only (AdamW's default);
``<ours>+sr``: the library with ``rounding="stochastic"``; a peer; ``fp32+perturbed``: stock AdamW with
beta2 one float32 step larger, a change at float precision that training amplifies like any other, so its
paired gap to ``fp32`` is the noise floor of every paired gap (the lr would not do: ``tasks.train`` sets it
every step).

PROTOTYPE, not the library feature: ``<ours>+nearest-proto`` and ``<ours>+sr-proto`` emulate 8-bit states
in plain torch. The stock optimizer keeps fp32 states, and after every step each per-element state of
a tensor the library would quantize (``min_8bit_size``) is replaced by its block-quantized round trip:
``formats/blockquant.py``'s reference for nearest, an unbiased stochastic encode (round up with the
probability of the distance to the code below over the code gap) for ``sr``, drawn from a generator
seeded by (seed, step, tensor), so a run is reproducible. The ``nearest-proto`` rows check the
emulation against the library's own runs. Writes ``bench/results/rounding.{json,md}``.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: find bench/

import torch
from torch import nn

from bench.runs import load_runs, results_header, run_meta, run_pool, summarize
from bench.step_bench import ROUNDINGS as LIBRARY_ROUNDINGS
from bench.tasks import Digits, Hyper, OptimizerSpec, train
from lowbit_compile import lowbit_compile
from lowbit_compile.config import DEFAULT_MIN_8BIT_SIZE, NONNEG_STATES, Config
from lowbit_compile.formats import StateFormat, blockquant, decode, domain_bound, format_names
from lowbit_compile.formats.dynamic import dynamic_map
from lowbit_compile.options import Options

RESULTS = Path(__file__).resolve().parent / "results"
FORMATS = ("int8", "dynamic8", "sqrt8", "fp8_e4m3", "fp8_e5m2", "bf16")
ROUNDINGS = ("+nearest", "+sr", "+sr-v", "+nearest-proto", "+sr-proto", "+perturbed")
SEEDS = (0, 1, 2)
MakeStock = Callable[[list[nn.Parameter], Hyper], torch.optim.Optimizer]


def adamw(params: list[nn.Parameter], hyper: Hyper) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=hyper.lr, betas=hyper.betas, eps=hyper.eps, weight_decay=hyper.weight_decay)


def library_has_rounding() -> bool:
    return "rounding" in inspect.signature(lowbit_compile).parameters


def split_name(name: str) -> tuple[str, str]:
    """``dynamic8-b256-k0+sr-proto`` -> (``dynamic8-b256-k0``, ``+sr-proto``); no suffix -> (name, "")."""
    base, plus, suffix = name.partition("+")
    if plus and "+" + suffix not in ROUNDINGS:
        raise ValueError(f"unknown rounding suffix +{suffix} in {name!r}; expected one of {ROUNDINGS}")
    return base, plus + suffix


def check_name(name: str) -> None:
    """Fail now, not an hour into a grid, on a name no run could build."""
    base, rounding = split_name(name)
    spec = OptimizerSpec(base)
    if spec.kind == "ours":
        spec.lowbit_options()
    if rounding == "+perturbed":
        if spec.kind != "fp32":
            raise ValueError(f"{name!r}: +perturbed applies to fp32 (stock AdamW) only, not to {base!r}")
    elif rounding and spec.kind != "ours":
        raise ValueError(f"{name!r}: a rounding suffix applies to our formats only, not to {base!r}")
    if rounding.startswith("+sr") and not rounding.endswith("-proto") and not library_has_rounding():
        raise ValueError(f"{name!r}: lowbit_compile has no rounding= option yet; the plain-torch prototype is "
                         f"{base}+sr-proto")


def make_optimizer(name: str, make_stock: MakeStock = adamw, compile_peers: bool = False, seed: int = 0) -> MakeStock:
    """A builder ``(params, hyper) -> optimizer`` for the optimizer ``name`` (see the module docstring);
    ``make_stock`` builds the stock optimizer that ours rewrite (AdamW unless given)."""
    check_name(name)
    base, rounding = split_name(name)
    spec = OptimizerSpec(base, compile_peers)

    def build(params: list[nn.Parameter], hyper: Hyper) -> torch.optim.Optimizer:
        if spec.kind == "peer":
            return spec.build(params, hyper)
        if rounding == "+perturbed":
            beta1, beta2 = hyper.betas
            hyper = replace(hyper, betas=(beta1, torch.nextafter(torch.tensor(beta2), torch.tensor(1.0)).item()))
        opt = make_stock(params, hyper)
        if spec.kind == "fp32":
            return opt
        options = spec.lowbit_options()
        if rounding.endswith("-proto"):
            return emulate_states(opt, **options, stochastic=rounding == "+sr-proto", seed=seed)
        return lowbit_compile(opt, **options, rounding=LIBRARY_ROUNDINGS[rounding])

    return build


# the prototype -------------------------------------------------------------------------------------
@functools.cache
def code_values(fmt: StateFormat) -> torch.Tensor:
    """Every value a code of ``fmt`` decodes to (relative to the block scale), sorted, finite, within qmax."""
    if fmt.name == "int8" or fmt.spec.root_domain:  # codes -127..127 (0..255; sqrt4 -7..7, 0..15), monotone
        top = round(domain_bound(fmt, fmt.qmax))
        codes = torch.arange(0 if fmt.nonneg else -top, top + 1)
        return decode(codes.to(fmt.code_dtype), fmt)
    if fmt.name == "dynamic8":  # the signed map's spare code 255 decodes to 1 as code 254 does
        values = dynamic_map(fmt.nonneg)
        return values[values.abs() <= fmt.qmax].unique()
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.code_dtype).float()
    values = values[torch.isfinite(values) & (values.abs() <= fmt.qmax)].unique()
    return values[values >= 0] if fmt.nonneg else values


def stochastic_round(x: torch.Tensor, fmt: StateFormat, gen: torch.Generator) -> torch.Tensor:
    """``x`` (divided by its block scale, |x| <= qmax) rounded to one of the two neighbouring code values,
    up with probability (x - below) / (above - below): unbiased. A positive value of a non-negative state
    never becomes 0 (the library's zero-point rule), which biases values below the first code upwards."""
    u = torch.rand(x.shape, generator=gen)
    if fmt.name == "bf16":  # 16 random bits added below bf16's mantissa, then truncated
        bits = x.contiguous().view(torch.int32)
        noise = (u * 65536).to(torch.int32).clamp_(max=65535)
        out = ((bits + noise) & ~0xFFFF).view(torch.float32)
    else:
        values = code_values(fmt)
        hi_idx = torch.searchsorted(values, x.clamp(values[0], values[-1])).clamp_(1, len(values) - 1)
        lo, hi = values[hi_idx - 1], values[hi_idx]
        up = (x - lo) / (hi - lo)
        out = torch.where(u < up, hi, lo)
    if fmt.nonneg:
        smallest = out.new_tensor(fmt.min_positive if fmt.name == "bf16" else float(code_values(fmt)[1]))
        out = torch.where((x > 0) & (out <= 0), smallest, out)
    return out


def round_trip(state: torch.Tensor, fmt: StateFormat, gen: torch.Generator | None) -> torch.Tensor:
    """What ``state`` reads back as after being stored in ``fmt``: nearest (the library's reference) when
    ``gen`` is None, else stochastic rounding with block scales as the library computes them."""
    flat = state.reshape(-1)
    if gen is None:
        return blockquant.dequantize(blockquant.quantize(flat, fmt), fmt, numel=flat.numel()).view_as(state)
    if not fmt.blockwise:
        return stochastic_round(flat.float(), fmt, gen).view_as(state)
    if fmt.patches:
        raise ValueError(f"the stochastic-rounding prototype has no outlier patches; use -k0 (got {fmt.tag()})")
    blocks = blockquant._blocks(flat, fmt)
    absmax = blocks.abs().amax(dim=1)
    inv = torch.where(absmax > 0, fmt.qmax / absmax, 0.0)
    values = stochastic_round(blocks * inv[:, None], fmt, gen) * (absmax / fmt.qmax)[:, None]
    return values.reshape(-1)[: flat.numel()].view_as(state)


def emulate_states(opt: torch.optim.Optimizer, fmt: str | dict = "dynamic8", block_size: int | None = None,
                   outliers: int = 0, min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE, stochastic: bool = False,
                   seed: int = 0) -> torch.optim.Optimizer:
    """Prototype (bench only): after each step of the stock ``opt``, store every per-element state of a
    tensor of at least ``min_8bit_size`` elements in ``fmt`` (a name or a per-state dict) and read it
    back, rounding to nearest or stochastically; ``block_size`` None: the formats' own, as the library
    takes it (``Config.block_size_of``). Returns ``opt``."""
    steps = [0]
    blocks = Config.of(Options(block_size=block_size))

    def fmt_of(key: str) -> str:
        name = fmt.get(key, "fp32") if isinstance(fmt, dict) else fmt
        if name not in format_names():
            raise ValueError(f"unknown format {name!r}")
        return name

    def after_step(optimizer, args, kwargs) -> None:
        steps[0] += 1
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            state = optimizer.state.get(p, {})
            if p.numel() < min_8bit_size:
                continue
            kept = [k for k, v in state.items()
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == p.shape]
            block = blocks.block_size_of(fmt_of(k) for k in kept)
            for key in kept:
                value = state[key]
                f = StateFormat.make(fmt_of(key), block, outliers, key in NONNEG_STATES)
                if f.passthrough:
                    continue
                gen = torch.Generator().manual_seed((seed * 1_000_003 + steps[0]) * 10_007 + i) if stochastic else None
                with torch.no_grad():
                    value.copy_(round_trip(value, f, gen))

    opt.register_step_post_hook(after_step)
    return opt


# Lion on digits ------------------------------------------------------------------------------------
def lion_variants() -> list[str]:
    out = ["fp32"]
    for f in FORMATS:
        out += [f, f + "+nearest-proto", f + "+sr-proto"] + ([f + "+sr"] if library_has_rounding() else [])
    return out


def run_lion(job: tuple[str, int]) -> dict:
    """Lion (examples/lion.py, betas 0.9/0.99, the lr and weight decay of bench/other_optimizers.py) on digits."""
    from bench.other_optimizers import OPTIMIZERS

    variant, seed = job
    torch.set_num_threads(1)
    cls, kwargs, lrs = OPTIMIZERS["Lion (examples/lion.py)"]
    task = Digits()
    task.hyper = replace(task.hyper, lr=lrs["digits"])
    build = make_optimizer(variant, lambda params, hyper: cls(params, lr=hyper.lr, **kwargs), seed=seed)
    hist = train(task, build, seed)
    return {"task": "lion_digits", "variant": variant, "seed": seed, "steps": task.hyper.steps,
            "val_steps": hist.val_steps, "val": hist.val, "train_loss": hist.train_loss, "seconds": hist.seconds,
            "state_bytes_per_param": math.nan}


def markdown(lion: dict, others: dict[str, dict]) -> str:
    """One table per task: each format's paired gap to fp32 with the library (nearest), the nearest
    prototype and the stochastic prototype (and the library's stochastic rounding where it ran)."""
    lines = []
    for task, summary in {"lion_digits": lion, **others}.items():
        bases = list(dict.fromkeys(split_name(v)[0] for v in summary if v != "fp32" and "+" in v))
        if not bases:  # no rounding runs of this task
            continue
        fp32 = summary.get("fp32", {})
        lines += [f"### {task}: fp32 val loss {fp32.get('loss_mean', math.nan):.4f} (seed spread "
                  f"±{fp32.get('fp32_noise_pct', math.nan):.2f}%)", "",
                  "| format | library, nearest | prototype, nearest | prototype, stochastic | library, stochastic |",
                  "|---|---:|---:|---:|---:|"]
        for base in bases:
            cells = []
            for suffix in ("", "+nearest-proto", "+sr-proto", "+sr"):
                e = summary.get(base + suffix)
                cells.append("–" if e is None else f"{e['paired_gap_pct'][0]:+.2f} ± {e['paired_gap_pct'][1]:.2f}%"
                             + ("" if e["matches_fp32"] else " ✗"))
            lines.append(f"| {base} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append("Mean ± std over seeds of the paired gap of the final validation loss to stock fp32; ✗ where "
                 "the mean is farther than the fp32 seed spread or 0.5%. Prototype: the plain-torch emulation "
                 "of this file (not the library); its nearest column checks it against the library's. Library, "
                 "stochastic: lowbit_compile(..., rounding=\"stochastic\") (`<format>+sr`); – where not run.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", help="default: fp32 and every format with each rounding")
    ap.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--report", action="store_true", help="only rebuild the table from the JSON files")
    args = ap.parse_args(argv)
    json_path = args.out / "rounding.json"
    runs: list[dict] = []
    meta = run_meta(args.jobs, 1, False)
    if args.report or args.resume:
        if json_path.exists():
            runs, saved_meta = load_runs(json_path)
            meta = saved_meta if args.report else meta
    if not args.report:
        variants = args.variants or lion_variants()
        for v in variants:
            check_name(v)
        done = {(r["variant"], r["seed"]) for r in runs}
        jobs = [(v, s) for v in variants for s in args.seeds if (v, s) not in done]

        def save() -> None:
            json_path.write_text(json.dumps({"meta": meta, "runs": runs}))

        args.out.mkdir(parents=True, exist_ok=True)
        run_pool(run_lion, jobs, args.jobs, runs, meta, save)
    lion = summarize(runs).get("lion_digits", {}) if runs else {}
    others = {}
    for name, task in (("diffusion", "dit_digits"), ("long_run", "char_gpt_2m_long")):
        path = args.out / f"{name}.json"
        if path.exists():
            task_runs = [r for r in json.loads(path.read_text())["runs"] if r["task"] == task]
            others[task] = summarize(task_runs).get(task, {}) if task_runs else {}
    text = results_header(meta, runs) + markdown(lion, others)
    (args.out / "rounding.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
