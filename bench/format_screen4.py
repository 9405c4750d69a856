"""Screen 4-bit state formats on the reference lowering before any kernel work (issue 51 item 3; results in
``bench/results/format_screen4.{md,json}``): which map, block size and rounding of v train closest to fp32
AdamW, run side by side with torchao's ``AdamW4bit``.

Each 4-bit map is registered in this process as a bench-only element format (``registry.register``; the
library's shipped formats are untouched) whose codes are the indices of a table of at most 16 values (a
byte per code here: packing two codes a byte changes the memory, not what trains). A map's name gives a
table for m (signed) and one for v (unsigned), values relative to the block's absmax (qmax 1):

- ``lin4``: ``k / 7`` (k = -7..7) for m, ``k / 15`` (0..15) for v;
- ``sqrt4t``, ``cbrt4``, ``qrt4``: ``sign |k|^p / 7^p``, ``k^p / 15^p`` with p = 2, 3, 4 (the code is the
  nearest table value to the value, as ``sqrt8`` at 4 bits; ``sqrt4t`` was ``sqrt4`` in the results, a name
  the library's shipped ``sqrt4`` now has: the same map, its nearest rounding on the root);
- ``fp4``: floats without subnormals (code 0 is zero, the top binade [1, 2) scaled to 1): 2 exponent and 1
  mantissa bit with a sign for m (0.125 .. 1, 8 magnitudes), 3 exponent and 1 mantissa bit for v (2^-7 .. 1);
- ``ao4``: torchao ``AdamW4bit``'s maps (``torchao/optim/subclass_4bit.py``): its 4-bit dynamic map
  ``create_dynamic_map(True, 3, 4)`` for m (-0.8875 .. 1, asymmetric, scaled by the absmax as torchao does)
  and the zero-free linear ``linspace(0, 1, 17)[1:]`` for v.

Encode is to the nearest table value (a tie to the lower one), or stochastic and unbiased between the two
table values around the value with the library's 16-bit draws (``formats.rounding.threshold``, the rule of
``formats.round_stochastic``). A positive v never decodes to 0: it rounds up to the smallest positive code
(the zero-point rule of the 8-bit formats). Optimizer names as ``bench/tasks.py``'s ``OptimizerSpec``:
``<m map>/<v map>-b<block>-k0`` (``sqrt8/sqrt4-b128-k0``: the shipped 8-bit sqrt8 for m, 4-bit v), the
library's default rounding (v stochastic, m to nearest) or with ``+nearest`` every state to nearest;
``fp32``; ``ao-AdamW4bit``.

    python bench/format_screen4.py --tasks zipf --seeds 0 1 --variants fp32 ao-AdamW4bit 'sqrt4/sqrt4-b128-k0'
    python bench/format_screen4.py --report          # rebuild the tables from the JSON

Runs one at a time in this process with 1 thread; every run is saved as it ends (``--resume`` skips them).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: find bench/

import torch

from bench.quality import _task, state_bytes
from bench.rounding import split_name
from bench.runs import run_meta, summarize
from bench.step_bench import ROUNDINGS as LIBRARY_ROUNDINGS
from bench.tasks import OptimizerSpec, train
from bench.zero_point import SMALL, zero_point_check
from lowbit_compile.formats import ElementFormat, StateFormat, format_names, registry
from lowbit_compile.formats.registry import register
from lowbit_compile.formats.rounding import threshold

RESULTS = Path(__file__).resolve().parent / "results"
SPECIAL = (253, 254, 255)  # +inf, -inf, NaN of a flagged block: bytes no 4-bit index takes


# the maps ------------------------------------------------------------------------------------------------
def power_map(p: int, qmax: int, signed: bool) -> list[float]:
    """``sign |k|^p / qmax^p`` for k = -qmax..qmax (signed) or 0..qmax: the code is the value's p-th root."""
    ks = range(-qmax if signed else 0, qmax + 1)
    return [math.copysign(abs(k) ** p / qmax**p, k) for k in ks]


def float_map(e_bits: int, m_bits: int, signed: bool) -> list[float]:
    """A float of ``e_bits`` exponent and ``m_bits`` mantissa bits (and a sign bit where ``signed``), no
    subnormals: code 0 is zero, the others ``2^(e - 2^e_bits + 1) (1 + f)``, the largest scaled to 1."""
    emin = 1 - 2**e_bits
    mags = [2.0 ** (emin + (k >> m_bits)) * (1 + (k & (2**m_bits - 1)) / 2**m_bits)
            for k in range(1, 2 ** (e_bits + m_bits))]
    mags = [0.0] + [m / mags[-1] for m in mags]
    return sorted({*mags, *(-m for m in mags)}) if signed else mags


def torchao_maps() -> tuple[list[float], list[float]]:
    """torchao ``AdamW4bit``'s signed and unsigned 4-bit maps, from torchao itself."""
    from torchao.optim.quant_utils import create_dynamic_map
    from torchao.optim.subclass_4bit import get_qmap_unsigned

    return create_dynamic_map(True, 3, 4), list(get_qmap_unsigned())


def maps() -> dict[str, tuple[list[float], list[float]]]:
    """Every 4-bit map of the screen: name -> (table of m, table of v), sorted, largest magnitude 1."""
    out = {"lin4": (power_map(1, 7, True), power_map(1, 15, False))}
    for name, p in (("sqrt4t", 2), ("cbrt4", 3), ("qrt4", 4)):
        out[name] = (power_map(p, 7, True), power_map(p, 15, False))
    out["fp4"] = (float_map(2, 1, True), float_map(3, 1, False))
    out["ao4"] = torchao_maps()
    return out


@dataclass(frozen=True)
class Table:
    """One map's values (sorted, at most 16) and its nearest-rounding boundaries, as fp32 tensors."""

    values: torch.Tensor
    mids: torch.Tensor
    padded: torch.Tensor  # values padded to 256 entries with the largest: any byte decodes (special codes too)


@functools.cache
def table(name: str, nonneg: bool) -> Table:
    values = torch.tensor(maps()[name][nonneg], dtype=torch.float32)
    if len(values) > 16 or not bool((values[1:] > values[:-1]).all()) or float(values.abs().max()) != 1.0:
        raise ValueError(f"map {name!r} ({'v' if nonneg else 'm'}) is not 16 sorted values of largest magnitude 1")
    padded = torch.cat([values, values[-1:].expand(256 - len(values))])
    return Table(values, (values[1:] + values[:-1]) / 2, padded)


def lift_zero(codes: torch.Tensor, x: torch.Tensor, t: Table, fmt: StateFormat) -> torch.Tensor:
    """A positive value of a non-negative state never takes a code of value 0: the next code instead."""
    if not fmt.nonneg:
        return codes
    return torch.where((x > 0) & (t.padded[codes] == 0), codes + 1, codes)


def encode4(x: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """Normalized values (``|x| <= 1``) to the index of the nearest table value (a tie to the lower; NaN to
    the top, as a value out of range saturates)."""
    t = table(fmt.name, fmt.nonneg)
    codes = torch.bucketize(x.float().contiguous(), t.mids)
    return lift_zero(codes, x, t, fmt).to(torch.uint8)


def decode4(codes: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    return table(fmt.name, fmt.nonneg).padded[codes.long()]


def round_stochastic4(x: torch.Tensor, codes: torch.Tensor, fmt: StateFormat, draws: torch.Tensor) -> torch.Tensor:
    """Unbiased stochastic rounding between the two table values around ``x`` (clamped into the table's
    range): the outer one (larger magnitude) where ``threshold(draw) * gap < |x - inner|``, the rule of
    ``formats.round_stochastic``; a non-finite ``x`` keeps its nearest ``codes``; a positive v never 0."""
    t = table(fmt.name, fmt.nonneg)
    n = len(t.values)
    y = x.float().clamp(float(t.values[0]), float(t.values[-1]))
    lo = (torch.searchsorted(t.values, y.contiguous(), right=True) - 1).clamp(0, n - 2)
    w_lo, w_hi = t.values[lo], t.values[lo + 1]
    inner_is_lo = w_lo.abs() <= w_hi.abs()
    w_in = torch.where(inner_is_lo, w_lo, w_hi)
    outward = threshold(draws) * (w_hi - w_lo) < (y - w_in).abs()
    out = torch.where(inner_is_lo ^ outward, lo, lo + 1)
    out = torch.where(torch.isfinite(x), out, codes.long())
    return lift_zero(out, x, t, fmt).to(torch.uint8)


def register_maps() -> list[str]:
    """Register every map of :func:`maps` not registered yet as a bench-only format of this process (uint8
    codes, qmax 1); returns the names it registered. Only the screen's own process does it for good (the
    fused backends have no kernel for them); tests use :func:`maps_registered`."""
    added = []
    for name in maps():
        if name in format_names():
            continue
        m, v = table(name, False).values, table(name, True).values
        register(ElementFormat(
            name, (torch.uint8, torch.uint8), qmax=(1.0, 1.0),
            min_positive=(float(m[m > 0].min()), float(v[v > 0].min())), encode=encode4, decode=decode4,
            unsigned_map=True, special_codes=(SPECIAL, SPECIAL), round_stochastic=round_stochastic4))
        added.append(name)
    return added


@contextlib.contextmanager
def maps_registered():
    """The maps registered for the block only, then taken out of the registry again (the registry has no
    public removal: the library's completeness tests must not see bench-only formats)."""
    added = register_maps()
    try:
        yield
    finally:
        for name in added:
            registry._REGISTRY.pop(name, None)


# building and running --------------------------------------------------------------------------------------
def spec(name: str) -> OptimizerSpec:
    """The optimizer ``name`` (see the module docstring): ours on the reference lowering with the rounding
    its suffix names, or ``fp32`` / a peer as ``OptimizerSpec`` builds them."""
    base, suffix = split_name(name)
    optimizer = OptimizerSpec(base)
    if optimizer.kind != "ours":
        if suffix:
            raise ValueError(f"{name!r}: a rounding suffix applies to ours only")
        return optimizer
    optimizer.lowbit_options()  # a bad -b/-k option fails here, before any run
    return OptimizerSpec(base, backend="reference", rounding=LIBRARY_ROUNDINGS[suffix])


def nominal_bytes(name: str) -> float:
    """m + v bytes per element of a quantized tensor, packed (4-bit codes two a byte) with fp32 scales."""
    base, _ = split_name(name)
    spec = OptimizerSpec(base)
    if spec.kind != "ours":
        return {"fp32": 8.0, "ao-AdamW4bit": 1.0 + 8 / 128}.get(name, math.nan)
    options = spec.lowbit_options()
    fmt = options["fmt"]
    fmts = [fmt["exp_avg"], fmt["exp_avg_sq"]] if isinstance(fmt, dict) else [fmt, fmt]
    return sum((1.0 if f.endswith("8") else 0.5) + 4 / options.get("block_size", 512) for f in fmts)


def run_one(task_name: str, variant: str, seed: int, step_scale: float) -> dict:
    """Train one (task, optimizer, seed): the record ``bench/quality.py`` writes, so its summary applies."""
    task = _task(task_name, step_scale)
    built: list[torch.optim.Optimizer] = []
    make = spec(variant).build

    def remember(params, hyper):
        built.append(make(params, hyper))
        return built[-1]

    hist = train(task, remember, seed)
    n_params = sum(p.numel() for g in built[0].param_groups for p in g["params"])
    return {"task": task_name, "variant": variant, "seed": seed, "steps": task.hyper.steps, "step_scale": step_scale,
            "val_steps": hist.val_steps, "val": hist.val, "seconds": hist.seconds,
            "state_bytes_per_param": state_bytes(built[0]) / n_params}


def zero_point(variant: str) -> dict:
    """``bench/zero_point.py``'s check on its 0.5M set (20 steps, gradient seed 1) for one of ours or a peer."""
    optimizer = spec(variant)
    r = zero_point_check([optimizer], SMALL, backend="reference")[optimizer]
    return {"zeros_ppm": r.zeros_ppm, "max_lr": r.max_off_lr, "mean_lr": r.mean_off_lr, "seconds": r.seconds}


# the report --------------------------------------------------------------------------------------------------
def _gap(e: dict | None) -> str:
    if e is None:
        return "–"
    gap, sd = e["paired_gap_pct"]
    return f"{gap:+.2f} ± {sd:.2f}%" + ("" if e["matches_fp32"] else " ✗")


def markdown(data: dict) -> str:
    """A zero-point table, then one table per task: each optimizer's paired gap to fp32."""
    runs, zps, meta = data["runs"], data["zero_point"], data["meta"]
    summary = summarize(runs) if runs else {}
    lines = ["# 4-bit state formats: a screen on the reference lowering (issue 51 item 3)", ""]
    if meta.get("notes"):
        lines += [meta["notes"], ""]
    stages = meta.get("stages", [])
    wall = sum(st.get("wall_seconds") or 0 for st in stages) / 60
    lines += [f"Measured from {stages[0]['date'] if stages else meta['date']} (UTC), {wall:.0f} minutes in all, torch "
              f"{meta['torch']}, one run at a time with 1 thread on {meta['cpus']} shared CPUs (other work ran beside "
              "it); torchao run eagerly; ours on the reference lowering. Stages (commit, load average at start, wall "
              "time):", ""]
    for st in stages:
        wall = f", {st['wall_seconds'] / 60:.1f} min" if "wall_seconds" in st else ""
        load = " ".join(f"{x:.2f}" for x in st["loadavg"]) if st.get("loadavg") else "unrecorded"
        lines.append(f"- {st['date']} at {st['commit']}, load {load}{wall}: `{st['command']}`")
    if zps:
        lines += ["", "### Zero-point check (`bench/zero_point.py`, 0.5M set, 20 AdamW steps, lr 1e-3, N(0, 1) grads)",
                  "", "| optimizer | v stored as 0 where fp32 v > 0 | max \\|p - p_fp32\\| / lr | mean / lr |",
                  "|---|---:|---:|---:|"]
        for v, zp in zps.items():
            lines.append(f"| {v} | {zp['zeros_ppm']:.1f} ppm | {zp['max_lr']:.3f} | {zp['mean_lr']:.4f} |")
    for task, entries in summary.items():
        fp32 = entries.get("fp32")
        head = "no fp32 runs" if fp32 is None else (f"fp32 loss {fp32['loss_mean']:.4f}, seed sd "
                                                   f"±{fp32['fp32_noise_pct']:.2f}% over seeds {fp32['seeds']}")
        lines += ["", f"### {task} ({head})", "",
                  "| optimizer | B/param (m+v) | paired gap to fp32 | seeds | final loss |", "|---|---:|---:|---|---:|"]
        order = sorted(entries, key=lambda v: (v != "fp32", v != "ao-AdamW4bit", entries[v]["paired_gap_pct"][0]))
        for v in order:
            e = entries[v]
            lines.append(f"| {v} | {nominal_bytes(v):.3f} | {_gap(e) if v != 'fp32' else '0 (reference)'} | "
                         f"{','.join(map(str, e['seeds']))} | {e['loss_mean']:.4f} |")
    lines += ["", "Paired gap: final validation loss over fp32 AdamW's of the same seed - 1, mean ± sd over the "
              "seeds; ✗ where the mean is farther than 0.5% or fp32's own seed sd (`bench/quality.py`'s rule). "
              "B/param: m + v of a quantized tensor, packed (4-bit codes two a byte) with fp32 scales: what the "
              "format would store (the screen stores a byte per code; tensors under 4096 elements stay fp32)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", nargs="*", default=["zipf"])
    ap.add_argument("--variants", nargs="+", default=["fp32", "ao-AdamW4bit", "sqrt4/sqrt4-b128-k0"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--step-scale", type=float, default=1.0)
    ap.add_argument("--zero-point", action="store_true", help="also the zero-point check of each optimizer but fp32")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--resume", action="store_true", help="keep the runs already in the JSON and skip them")
    ap.add_argument("--report", action="store_true", help="only rebuild the table from the JSON")
    ap.add_argument("--notes", type=Path, help="with --report: keep this text (what it says) in the JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    register_maps()
    path = args.out / "format_screen4.json"
    command = " ".join(["python", "bench/format_screen4.py", *sys.argv[1:]])
    meta = run_meta(1, 1, False)
    stage = {"command": command, "date": meta["date"], "commit": meta["commit"], "loadavg": os.getloadavg()}
    data = {"runs": [], "zero_point": {}, "meta": {**meta, "stages": []}}
    if (args.resume or args.report) and path.exists():
        data = json.loads(path.read_text())
    if not args.report:
        data["meta"].setdefault("stages", []).append(stage)
    elif args.notes:
        data["meta"]["notes"] = args.notes.read_text().strip()
    for v in args.variants:  # a bad name fails here, before an hour of runs
        spec(v)

    def save() -> None:
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))
        (args.out / "format_screen4.md").write_text(markdown(data) + "\n")

    if not args.report:
        start = time.perf_counter()
        if args.zero_point:
            for v in args.variants:
                if OptimizerSpec(split_name(v)[0]).kind != "fp32" and v not in data["zero_point"]:
                    data["zero_point"][v] = {**zero_point(v), "command": command}
                    print("zero-point", v, data["zero_point"][v], flush=True)
                    save()
        done = {(r["task"], r["variant"], r["seed"]) for r in data["runs"]}
        for task in args.tasks:
            for seed in args.seeds:
                for v in args.variants:
                    if (task, v, seed) in done:
                        continue
                    record = run_one(task, v, seed, args.step_scale)
                    record["command"] = command
                    data["runs"].append(record)
                    print(task, v, seed, f"{record['val'][-1]['loss']:.4f}", f"{record['seconds']:.0f}s", flush=True)
                    save()
        stage["wall_seconds"] = time.perf_counter() - start
    save()
    print(markdown(data))


if __name__ == "__main__":
    main()
