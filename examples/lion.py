"""One's own optimizer with low-bit states: Lion written in torch ops, rewritten by lowbit_compile.

Nothing in lowbit-compile knows Lion. Its ``step`` is traced like a stock optimizer's: the one state
(``exp_avg``) is found on a probe step, the traced update is checked to be elementwise, and the
state is stored in 8 bits with the same fused step as Adam's. Run it to train the same small
regression with stock fp32 Lion and with int8 states, and compare:

    python examples/lion.py --steps 300

Lion: Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2.
"""

from __future__ import annotations

import argparse

import torch

from lowbit_compile import lowbit_compile, memory_report


class Lion(torch.optim.Optimizer):
    """Lion: the sign of an interpolation of momentum and gradient is the update; one state per param."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss


def train(fmt: str | None, steps: int, seed: int = 0) -> tuple[float, int]:
    """Fit a small MLP to a fixed teacher; the validation loss at the end and the state bytes held."""
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(16, 32, generator=g) / 4, torch.randn(32, 1, generator=g) / 4
    x = torch.randn(1024, 16, generator=g)
    y = torch.tanh(x @ w1) @ w2 + 0.05 * torch.randn(1024, 1, generator=g)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    opt = Lion(model.parameters(), lr=3e-4, weight_decay=0.1)
    if fmt is not None:
        lowbit_compile(opt, fmt, min_8bit_size=0, block_size=256)
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x[:512]), y[:512])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        val = torch.nn.functional.mse_loss(model(x[512:]), y[512:]).item()
    return val, memory_report(opt).total.bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--fmt", default="int8")
    args = parser.parse_args()
    stock_loss, stock_bytes = train(None, args.steps)
    low_loss, low_bytes = train(args.fmt, args.steps)
    print(f"stock fp32 Lion : val loss {stock_loss:.5f}, state {stock_bytes:,} bytes")
    print(f"{args.fmt:<5} Lion      : val loss {low_loss:.5f}, state {low_bytes:,} bytes")


if __name__ == "__main__":
    main()
