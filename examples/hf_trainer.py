"""Hugging Face ``transformers.Trainer`` with low-bit AdamW states, no change to the Trainer.

A tiny randomly initialized GPT-2 (nothing is downloaded) learns a synthetic next-token task. The
Trainer builds its own (fused) AdamW and LR schedule; ``lowbit_compile.enable`` around
``trainer.train()`` rewrites that optimizer on its first step. The token and position embeddings
keep stock fp32 states through a name-pattern override (names come from the model's forward).

    python examples/hf_trainer.py --steps 60 --fmt int8
    python examples/hf_trainer.py --steps 60 --fmt none      # stock AdamW, for comparison

Needs ``pip install -e '.[examples]'`` (transformers). The Trainer draws its own tqdm progress bar.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Sequence

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import lowbit_compile
from lowbit_compile import memory_report

VOCAB, CONTEXT = 64, 16


class CountingTokens(torch.utils.data.Dataset):
    """Sequences that count up modulo VOCAB from a random start: easy to learn, quick to see."""

    def __init__(self, n: int, seed: int) -> None:
        start = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(seed))
        self.ids = (start + torch.arange(CONTEXT)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--fmt", default="int8", help="a lowbit format, or 'none' for stock AdamW")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=16, learning_rate=3e-3,
            weight_decay=0.1, lr_scheduler_type="cosine", warmup_steps=args.steps // 10, max_grad_norm=1.0,
            logging_steps=max(1, args.steps // 6), save_strategy="no", report_to=[], use_cpu=True,
            disable_tqdm=args.no_progress, seed=0,
        )
        trainer = Trainer(model=model, args=training, train_dataset=CountingTokens(512, seed=1))
        scope = (lowbit_compile.enable(fmt=args.fmt, min_8bit_size=1024, overrides={"*wte*": "fp32", "*wpe*": "fp32"})
                 if args.fmt != "none" else contextlib.nullcontext())
        with scope:
            result = trainer.train()
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    report = memory_report(opt)
    print(report)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(f"training loss by log step: {' '.join(f'{x:.3f}' for x in losses)}")
    if args.fmt != "none":
        print(scope.summary())
    return {"model": model, "optimizer": opt, "losses": losses, "train_loss": result.training_loss, "scope": scope}


if __name__ == "__main__":
    main()
