"""PyTorch Lightning with low-bit Adam states, no change to the LightningModule.

``configure_optimizers`` returns a stock ``torch.optim.AdamW`` and a OneCycle schedule (which also
cycles beta1: a hyperparameter, so no retrace); Lightning steps it with a closure. The fit
function carries ``@lowbit_compile.enable``, which rewrites that optimizer on its first step.

    python examples/lightning_fit.py --steps 60 --fmt int8
    python examples/lightning_fit.py --steps 60 --fmt none    # stock AdamW, for comparison

Needs ``pip install -e '.[examples]'`` (lightning). Lightning draws its own tqdm progress bar.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import lightning as L
import torch

import lowbit_compile
from lowbit_compile import memory_report, trace_count


class Regression(L.LightningModule):
    """A two-layer MLP fitting a fixed random teacher network."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def teacher_data(n: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 32, generator=g)
    w1, w2 = torch.randn(32, 16, generator=g), torch.randn(16, 1, generator=g)
    return torch.utils.data.TensorDataset(x, torch.tanh(x @ w1) @ w2 / 4)


def fit(module: Regression, steps: int, progress: bool) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=progress, enable_model_summary=False, gradient_clip_val=1.0)
    loader = torch.utils.data.DataLoader(teacher_data(4096), batch_size=64, shuffle=True)
    trainer.fit(module, loader)
    return trainer


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--fmt", default="int8", help="a lowbit format, or 'none' for stock AdamW")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    module = Regression(args.steps)
    scope = lowbit_compile.enable(fmt=args.fmt, min_8bit_size=1024) if args.fmt != "none" else None
    traces_before = trace_count()
    trainer = (scope(fit) if scope else fit)(module, args.steps, not args.no_progress)
    opt = trainer.optimizers[0]
    print(memory_report(opt))
    print(f"loss: first {module.losses[0]:.4f}, last {module.losses[-1]:.4f}; "
          f"traces {trace_count() - traces_before}")
    if scope:
        print(scope.summary())
    return {"optimizer": opt, "losses": module.losses, "scope": scope, "traces": trace_count() - traces_before}


if __name__ == "__main__":
    main()
