"""How far an optimizer's stored Adam moments drift from the fp32 moments of the same gradients.

A ``ShadowProbe`` keeps fp32 AdamW moments ``m``, ``v`` of every gradient a run's optimizer steps
with (the gradients of the low-bit trajectory itself), so what it measures is the error the stored
states have accumulated, not the difference of two trajectories. Every ``every`` steps it records,
per moment, the stored / shadow ratios (quantiles of ``log2``; the shares above x1.5 and below x2/3),
the share stored as 0 where the shadow is not, and for the second moment the share at its
format's smallest positive code (where the zero-point lift raised it); and the Adam direction
``m / (sqrt(v) + eps)`` (bias-corrected) of the stored moments against the shadow's: the norm ratio
and the cosine. For ours it also records ``lowbit_compile.stats`` (the monitor's round-trip error,
zero-flush share and rounding bias of the next step), numel-weighted over parameters.

Used by ``bench/long_run.py --diagnose``; reads ours, stock AdamW, torchao and bitsandbytes states.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lowbit_compile.options import DEFAULT_MIN_8BIT_SIZE

BNB_BLOCK = 256


def stored_moment(opt: torch.optim.Optimizer, p: torch.Tensor, key: str) -> torch.Tensor:
    """The moment ``key`` (``exp_avg`` or ``exp_avg_sq``) ``opt`` holds for ``p``, decoded to fp32 and
    shaped like ``p`` (ours and torchao dequantize; bitsandbytes' uint8 codes index its dynamic maps,
    blocks of 256)."""
    state = opt.state[p]
    bnb = {"exp_avg": "1", "exp_avg_sq": "2"}[key]
    if f"state{bnb}" in state:
        s = state[f"state{bnb}"]
        if s.dtype == torch.uint8:
            absmax = state[f"absmax{bnb}"].repeat_interleave(BNB_BLOCK)[: p.numel()]
            s = state[f"qmap{bnb}"][s.reshape(-1).long()] * absmax
    else:
        s = state[key]
        s = s.dequantize() if hasattr(s, "dequantize") else s
    return s.reshape(p.shape).float()


def _smallest_code_share(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> float | None:
    """Of ours' quantized second moments, the share of elements stored at the smallest positive code."""
    from lowbit_compile.state import QuantizedState

    hit = total = 0
    for p in params:
        v = opt.state[p].get("exp_avg_sq")
        if not isinstance(v, QuantizedState) or not v.fmt.blockwise:
            continue
        hit += int((v.codes.view(torch.uint8) == 1).sum())  # every format's smallest positive code
        total += v.codes.numel()
    return hit / total if total else None


class ShadowProbe:
    """fp32 AdamW moments of the gradients ``opt`` steps with, and the drift figures of its stored ones."""

    def __init__(self, opt: torch.optim.Optimizer, every: int, min_numel: int = DEFAULT_MIN_8BIT_SIZE) -> None:
        group = opt.param_groups[0]
        self.opt = opt
        self.every = every
        self.betas = tuple(float(b) for b in group["betas"])
        self.eps = float(group["eps"])
        self.params = [p for g in opt.param_groups for p in g["params"] if p.numel() >= min_numel]
        self.m = {p: torch.zeros_like(p, dtype=torch.float32) for p in self.params}
        self.v = {p: torch.zeros_like(p, dtype=torch.float32) for p in self.params}
        self.t = 0
        self.records: list[dict] = []
        self.monitor: dict[str, float] = {}
        opt.register_step_pre_hook(self._pre_step)

    def _pre_step(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """On a recorded step, the monitor's figures of what that step will store (ours only)."""
        from lowbit_compile import is_wrapped, stats

        if (self.t + 1) % self.every or not is_wrapped(opt):
            return

        weighted: dict[str, list[float]] = {}  # "figure/state" -> [sum of figure * numel, numel]
        for s in stats(opt):
            for figure in ("rel_error", "zero_flush", "rounding_bias"):
                value = getattr(s, figure)
                if value is not None:  # no gradient; the bias of a signed state
                    acc = weighted.setdefault(f"{figure}/{s.state}", [0.0, 0.0])
                    acc[0] += value * s.numel
                    acc[1] += s.numel
        self.monitor = {key: total / numel for key, (total, numel) in weighted.items()}

    @torch.no_grad()
    def after_step(self) -> None:
        """Fold this step's gradients into the shadow; on every ``every``-th step record the figures."""
        b1, b2 = self.betas
        self.t += 1
        for p in self.params:
            g = p.grad.float()
            self.m[p].lerp_(g, 1 - b1)
            self.v[p].mul_(b2).addcmul_(g, g, value=1 - b2)
        if self.t % self.every == 0:
            self.records.append(self.figures())

    @torch.no_grad()
    def figures(self) -> dict:
        b1, b2 = self.betas
        c1, c2 = 1 - b1**self.t, 1 - b2**self.t
        stored = {p: {key: stored_moment(self.opt, p, key) for key in ("exp_avg", "exp_avg_sq")}
                  for p in self.params}
        rec: dict = {"step": self.t, **self.monitor}
        for key, shadow in (("exp_avg", self.m), ("exp_avg_sq", self.v)):
            s = torch.cat([stored[p][key].reshape(-1) for p in self.params])
            t = torch.cat([shadow[p].reshape(-1) for p in self.params])
            live = t != 0
            ratio = s[live] / t[live]
            positive = ratio > 0
            logs = ratio[positive].log2()
            q = torch.quantile(logs[:: max(1, logs.numel() // 1_000_000)], torch.tensor([0.1, 0.5, 0.9]))
            rec[key] = {"log2_ratio_p10_p50_p90": [round(float(x), 4) for x in q],
                        "over_1.5x": float((ratio > 1.5).float().mean()),
                        "under_0.67x": float((ratio < 2 / 3).float().mean()),
                        "flipped_sign": float((ratio < 0).float().mean()),
                        "zero_where_shadow_not": float((s[live] == 0).float().mean()),
                        "rel_error": float((s - t).norm() / t.norm())}
        smallest = _smallest_code_share(self.opt, self.params)
        if smallest is not None:
            rec["exp_avg_sq"]["smallest_code"] = smallest
        dots = norms_s = norms_t = 0.0
        for p in self.params:
            u_s = (stored[p]["exp_avg"] / c1) / ((stored[p]["exp_avg_sq"] / c2).sqrt() + self.eps)
            u_t = (self.m[p] / c1) / ((self.v[p] / c2).sqrt() + self.eps)
            dots += float((u_s * u_t).sum())
            norms_s += float(u_s.square().sum())
            norms_t += float(u_t.square().sum())
        rec["update"] = {"norm_ratio": (norms_s / norms_t) ** 0.5, "cosine": dots / (norms_s * norms_t) ** 0.5}
        return rec


def summary(records: Iterable[dict]) -> list[str]:
    """Markdown rows: one per recorded step."""
    lines = ["| step | v p10/p50/p90 log2(stored/fp32) | v >1.5x | v <0.67x | v smallest code | m rel err "
             "| m zero | update norm ratio | update cosine | monitor v err / flush / bias per step |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in records:
        v, m, u = r["exp_avg_sq"], r["exp_avg"], r["update"]
        mon = (f"{r['rel_error/exp_avg_sq']:.3f} / {r['zero_flush/exp_avg_sq']:.2e}"
               + (f" / {r['rounding_bias/exp_avg_sq']:+.1e}" if "rounding_bias/exp_avg_sq" in r else "")
               if "rel_error/exp_avg_sq" in r else "–")
        lines.append(f"| {r['step']} | {' / '.join(f'{x:+.3f}' for x in v['log2_ratio_p10_p50_p90'])} "
                     f"| {v['over_1.5x']:.3%} | {v['under_0.67x']:.3%} | "
                     f"{format(v['smallest_code'], '.3%') if 'smallest_code' in v else '–'} "
                     f"| {m['rel_error']:.3f} | {m['zero_where_shadow_not']:.3%} | {u['norm_ratio']:.4f} "
                     f"| {u['cosine']:.4f} | {mon} |")
    return lines


def plot(runs: list[dict], path) -> None:
    """The drift figures of the runs that recorded them (``drift``), along training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in runs if r.get("drift") and r["variant"] != "fp32"]  # fp32 is its own shadow
    fig, axes = plt.subplots(1, 3, figsize=(19, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(runs):
        color, label = colors[i % len(colors)], f"{r['variant']} s{r['seed']}"
        steps = [d["step"] for d in r["drift"]]
        q = [d["exp_avg_sq"]["log2_ratio_p10_p50_p90"] for d in r["drift"]]
        axes[0].plot(steps, [x[1] for x in q], color=color, label=f"{label} median")
        axes[0].fill_between(steps, [x[0] for x in q], [x[2] for x in q], color=color, alpha=0.15)
        axes[1].plot(steps, [d["update"]["norm_ratio"] for d in r["drift"]], color=color, label=f"{label} norm ratio")
        axes[1].plot(steps, [d["update"]["cosine"] for d in r["drift"]], color=color, ls="--", label=f"{label} cosine")
        axes[2].plot(steps, [d["exp_avg"]["rel_error"] for d in r["drift"]], color=color, label=f"{label} m")
        axes[2].plot(steps, [d["exp_avg_sq"]["rel_error"] for d in r["drift"]], color=color, ls="--",
                     label=f"{label} v")
    axes[0].set(title="v stored / v fp32 of the same gradients: log2, median and p10-p90", xlabel="step")
    axes[1].set(title="Adam direction m/(sqrt(v)+eps), stored vs fp32 moments", xlabel="step")
    axes[2].set(title="||stored - fp32|| / ||fp32|| per moment", xlabel="step", yscale="log")
    axes[0].axhline(0, color="black", lw=0.8)
    axes[1].axhline(1, color="black", lw=0.8)
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
