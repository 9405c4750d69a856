"""A plain PyTorch training script that knows nothing about lowbit-compile.

Run it stock, then unchanged with low-bit optimizer states, and compare the last lines:

    python examples/train_plain.py --steps 200
    python -m lowbit_compile run --fmt int8 --override '*embed*=fp32' examples/train_plain.py --steps 200

The task: predict the next token of random sequences from a fixed random bigram table (so the loss
has a known floor, the table's entropy), with a tiny embedding + MLP model, AdamW, a cosine schedule,
gradient clipping and a tqdm progress bar.
"""

from __future__ import annotations

import argparse
import math

import torch
from tqdm import tqdm

VOCAB, WIDTH, CONTEXT = 96, 64, 4


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(CONTEXT * WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH),
        )
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.mlp(self.embed(tokens).flatten(1))))


def batches(generator: torch.Generator, table: torch.Tensor, batch: int):
    while True:
        context = torch.randint(0, VOCAB, (batch, CONTEXT), generator=generator)
        target = torch.multinomial(table[context[:, -1]], 1, generator=generator).squeeze(1)
        yield context, target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    table = torch.softmax(3 * torch.randn(VOCAB, VOCAB, generator=generator), dim=1)
    floor = -(table * table.log()).sum(1).mean().item()
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    data = batches(generator, table, args.batch)
    ema = None
    bar = tqdm(range(args.steps), desc="train", unit="step")
    for _ in bar:
        context, target = next(data)
        loss = torch.nn.functional.cross_entropy(model(context), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        bar.set_postfix(loss=f"{ema:.4f}")
    print(f"final loss (EMA) {ema:.4f}   floor (table entropy) {floor:.4f}")


if __name__ == "__main__":
    main()
