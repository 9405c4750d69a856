"""Screen companding maps for 8-bit states on the reference lowering (``bench/results/format_screen.md``,
how ``sqrt8`` was chosen): each candidate replaces the encode and decode of format ``int8`` (qmax 127
signed, 255 unsigned) in this process, then the zero-point check and the quality tasks run on it.

A candidate is ``<map of m (signed)>/<map of v (unsigned)>``; Q = qmax, rne = round half to even:

- ``lin``: int8, ``c = rne(x)``;
- ``sqrt``, ``cbrt``, ``qrt``: ``c = rne(root(Q^p |x|))`` with the square (p = 1), cube (2) or fourth
  (3) root taken in float64, decode ``|c|^(p+1) / Q^p``, the sign apart;
- ``flEM``: a float of E exponent and M mantissa bits without subnormals (code 0 is zero, top binade
  [1, 2)), rounded in the fp32 bit domain: ``fl43``, ``fl34`` signed, ``fl44``, ``fl53`` unsigned.

A positive v never gets code 0 (lifted to 1); a signed value under half the smallest code is 0.

    python bench/format_screen.py --candidates sqrt/sqrt cbrt/cbrt fl43/fl44 --sizes small --tasks zipf digits
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: find bench/ and tests/

import torch

import lowbit_compile.formats.blockquant as bq
import lowbit_compile.formats.element as fm
from bench.runs import mean_std
from bench.tasks import TASKS, OptimizerSpec, train
from bench.zero_point import FULL, SMALL, zero_point_check

_STOCK_ENCODE, _STOCK_DECODE = fm.encode, fm.decode
ROOTS = {"sqrt": 1, "cbrt": 2, "qrt": 3}


def _float_layout(scheme: str, nonneg: bool) -> tuple[int, int, int, float]:
    """(mantissa bits, largest magnitude code, smallest exponent, largest value) of a ``flEM`` map."""
    e_bits, m_bits = int(scheme[2]), int(scheme[3])
    kmax = 2 ** (e_bits + m_bits) - 1
    if kmax != (255 if nonneg else 127):
        raise ValueError(f"{scheme} has {kmax + 1} magnitudes; {'v' if nonneg else 'm'} needs {256 if nonneg else 128}")
    emin = 1 - 2**e_bits
    return m_bits, kmax, emin, 2.0 ** (emin + (kmax >> m_bits)) * (1 + (kmax & (2**m_bits - 1)) / 2**m_bits)


def encode_magnitude(a: torch.Tensor, scheme: str, nonneg: bool) -> torch.Tensor:
    """|x| (fp32, in units of the block scale) to a code magnitude (int32)."""
    q = 255.0 if nonneg else 127.0
    if scheme == "lin":
        return torch.round(a).clamp(0, q).to(torch.int32)
    if scheme in ROOTS:
        p = ROOTS[scheme]
        t = (a * torch.tensor(q**p, dtype=torch.float32)).double()
        root = t.sqrt() if p == 1 else t.sqrt().sqrt() if p == 3 else t.pow(1 / 3)
        if p == 2:  # pow(1/3) is within an ulp: exact cubes stay exact
            r = torch.round(root)
            root = torch.where(r**3 == t, r, root)
        return torch.round(root.float()).clamp(0, q).to(torch.int32)
    m_bits, kmax, emin, top = _float_layout(scheme, nonneg)
    bits = (a * torch.tensor(top / q, dtype=torch.float32)).contiguous().view(torch.int32).to(torch.int64)
    k = ((bits + (1 << (22 - m_bits))) >> (23 - m_bits)) - ((127 + emin) << m_bits)
    return k.clamp(0, kmax).to(torch.int32)


def decode_magnitude(k: torch.Tensor, scheme: str, nonneg: bool) -> torch.Tensor:
    """A code magnitude (int) back to its value in units of the block scale (fp32)."""
    q = 255.0 if nonneg else 127.0
    if scheme == "lin":
        return k.float()
    if scheme in ROOTS:
        p = ROOTS[scheme]
        return (k.double() ** (p + 1) / q**p).float()
    m_bits, _, emin, top = _float_layout(scheme, nonneg)
    k = k.to(torch.int64)
    v = torch.ldexp(1 + (k & (2**m_bits - 1)).double() / 2**m_bits, (emin + (k >> m_bits)).double())
    return torch.where(k > 0, v * (q / top), 0.0).float()


def install(candidate: str) -> None:
    """Make format int8 encode m with the first map of ``candidate`` and v with the second."""
    signed, unsigned = candidate.split("/")
    for nonneg, scheme in ((False, signed), (True, unsigned)):  # a bad name fails here, before anything runs
        encode_magnitude(torch.ones(1), scheme, nonneg)

    def encode(x, fmt, flagged=None, bits=None):
        if fmt.name != "int8" or flagged is not None or bits is not None:
            return _STOCK_ENCODE(x, fmt, flagged, bits)
        x = torch.nan_to_num(x.float(), nan=0.0)
        if fmt.nonneg:
            k = encode_magnitude(x.clamp(min=0), unsigned, True)
            return torch.where((x > 0) & (k == 0), 1, k).to(torch.uint8)
        k = encode_magnitude(x.abs(), signed, False)
        return torch.where(x < 0, -k, k).to(torch.int8)

    def decode(codes, fmt, flagged=None):
        if fmt.name != "int8" or flagged is not None:
            return _STOCK_DECODE(codes, fmt, flagged)
        c = codes.to(torch.int32)
        v = decode_magnitude(c.abs(), unsigned if fmt.nonneg else signed, fmt.nonneg)
        return torch.where(c < 0, -v, v)

    fm.encode, fm.decode = encode, decode
    bq.encode, bq.decode = encode, decode  # blockquant binds them by name
    top = fm.StateFormat("int8", 512, 0, True)
    assert float(bq.decode(bq.encode(torch.tensor([top.qmax]), top), top)) == top.qmax


def final_loss(task: str, variant: str, seed: int) -> float:
    """The final validation loss of one run, our optimizers on the reference lowering (which the
    monkeypatch reaches; the fused kernels have their own encode)."""
    spec = OptimizerSpec(variant, backend="reference")
    return train(TASKS[task](), spec.build, seed).val[-1]["loss"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--candidates", nargs="+", default=["lin/lin", "sqrt/sqrt", "cbrt/cbrt", "fl43/fl44"])
    ap.add_argument("--sizes", nargs="*", default=["small"], choices=["small", "full"], help="zero-point sets")
    ap.add_argument("--tasks", nargs="*", default=["zipf", "digits"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "format_screen.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    fp32 = {(t, s): final_loss(t, "fp32", s) for t in args.tasks for s in args.seeds}
    results = {}
    for candidate in ["dynamic8", *args.candidates]:
        if candidate != "dynamic8":
            install(candidate)
        variant = "dynamic8" if candidate == "dynamic8" else "int8"
        row = {}
        for size in args.sizes:
            zp = zero_point_check([variant], SMALL if size == "small" else FULL, backend="reference")[variant]
            row[f"zero_point_{size}"] = {"max_lr": zp.max_off_lr, "mean_lr": zp.mean_off_lr, "zeros_ppm": zp.zeros_ppm}
        for task in args.tasks:
            gaps = [100 * (final_loss(task, f"{variant}-b512-k0", s) / fp32[(task, s)] - 1) for s in args.seeds]
            row[task] = mean_std(gaps)
        results[candidate] = row
        print(candidate, json.dumps(row), flush=True)
    args.out.write_text(json.dumps({"seeds": args.seeds, "results": results}, indent=1))


if __name__ == "__main__":
    main()
