"""What a model holds outside activations per parameter (params + master + optimizer states + grads) for AdamW:
stock, bitsandbytes AdamW8bit, ours at 8 bits (sqrt8) and at 4 bits (sqrt4), with and without gradient release,
for bf16 params (fp32 master for stock and bitsandbytes, our exact residual for ours) and for fp32 params; every
figure from ``lowbit_compile.estimate``, each row with the ``python -m lowbit_compile estimate`` flags that print
it. Stock and bitsandbytes "with release" step in backward as PyTorch's optimizer-in-backward recipe does.

    python -m bench.footprint
"""

from __future__ import annotations

from dataclasses import dataclass

from lowbit_compile.estimate import GB, Estimate, estimate

SIZES = (7 * 10**9, 70 * 10**9)


@dataclass(frozen=True)
class Setup:
    """One row: what is trained, and the estimate's arguments that count it (its low-bit column)."""

    label: str
    param_dtype: str
    master: str | None  # estimate's master_weights
    fmt: str
    block_size: int | None = None
    outliers: int | None = None

    def estimate(self, params: int, release: bool) -> Estimate:
        extra = {k: v for k, v in (("block_size", self.block_size), ("outliers", self.outliers)) if v is not None}
        return estimate(params, param_dtype=self.param_dtype, master_weights=self.master or False, fmt=self.fmt,
                        release_grads=release, **extra)

    def flags(self, params: int, release: bool) -> str:
        out = [f"--params {params // 10**9}B", f"--param-dtype {self.param_dtype}", f"--fmt {self.fmt}"]
        out += [f"--master-weights {self.master}"] if self.master else []
        out += [f"--block-size {self.block_size}"] if self.block_size is not None else []
        out += [f"--outliers {self.outliers}"] if self.outliers is not None else []
        return " ".join(out + (["--release-grads"] if release else []))


SETUPS = [
    Setup("stock AdamW, fp32 master", "bf16", "fp32", "fp32"),
    Setup("bitsandbytes AdamW8bit, fp32 master", "bf16", "fp32", "dynamic8", 256, 0),
    Setup('ours 8-bit (sqrt8), master_weights="exact"', "bf16", "exact", "sqrt8"),
    Setup('ours 4-bit (sqrt4), master_weights="exact"', "bf16", "exact", "sqrt4"),
    Setup("stock AdamW", "fp32", None, "fp32"),
    Setup("bitsandbytes AdamW8bit", "fp32", None, "dynamic8", 256, 0),
    Setup("ours 8-bit (sqrt8)", "fp32", None, "sqrt8"),
    Setup("ours 4-bit (sqrt4)", "fp32", None, "sqrt4"),
]


def components(est: Estimate, params: int) -> dict[str, float]:
    """Bytes per parameter of the low-bit column, by kind: params, master, states (with scales), grads."""
    kinds = {"params": 0, "master": 0, "states": 0, "grads": 0}
    for row in est.rows:
        kind = next((k for k in ("params", "master", "grads") if row.component.startswith(k)), "states")
        kinds[kind] += row.lowbit
    return {k: v / params for k, v in kinds.items()}


def table() -> str:
    n = SIZES[0]
    lines = ["| setup | params | release_grads | params B | master B | m + v B | grads B | B/param | 7B | 70B |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    commands = []
    for setup in SETUPS:
        for release in (False, True):
            parts = components(setup.estimate(n, release), n)
            totals = [setup.estimate(size, release).lowbit_total for size in SIZES]
            lines.append(f"| {setup.label} | {setup.param_dtype} | {'yes' if release else 'no'} | "
                         f"{parts['params']:.3f} | {parts['master']:.3f} | {parts['states']:.4f} | "
                         f"{parts['grads']:.3f} | {sum(parts.values()):.4f} | "
                         f"{totals[0] / GB:,.1f} GB | {totals[1] / GB:,.1f} GB |")
            commands += [f"python -m lowbit_compile estimate {setup.flags(size, release)}" for size in SIZES]
    return "\n".join(lines + ["", "Each row's totals, as `estimate` prints them:", "", *commands])


if __name__ == "__main__":
    print(table())
