"""One process of tests/test_framework_resume.py: train, checkpoint and resume through a framework.

    python tests/resume_worker.py PHASE PATHS WORKDIR
    python -m lowbit_compile run --min-8bit-size 0 tests/resume_worker.py PHASE cli WORKDIR

``PHASE`` is ``first`` (train 6 steps uninterrupted, checkpointing after step 3) or ``resume``
(a fresh process: resume from that checkpoint and train to step 6). ``PATHS`` is a comma-separated
list of adoption paths (``ADOPTION``). For each framework and path the final parameters, and how
many per-element states were low-bit, are saved to ``WORKDIR/{framework}-{path}-{phase}.pt``.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

import lowbit_compile
from lowbit_compile import QuantizedState
from lowbit_compile.formats.rounding import SEED as ROUNDING_SEED

OPTIONS = {"min_8bit_size": 0}  # every state low-bit: 1-D biases and norms too
LR, WEIGHT_DECAY, STEPS, CHECKPOINT_AT = 1e-2, 0.01, 6, 3


@dataclass(frozen=True)
class Adoption:
    """How a user adopts lowbit_compile. ``optimizer``: builds the optimizer the framework is
    handed (``None``: the framework builds its own stock AdamW); ``scope``: what the run is inside."""

    optimizer: Callable[[Iterable, float, float], torch.optim.Optimizer] | None
    scope: Callable[[], contextlib.AbstractContextManager]


ADOPTION = {
    "explicit": Adoption(lambda params, lr, wd: lowbit_compile.lowbit_compile(
        torch.optim.AdamW(params, lr=lr, weight_decay=wd), **OPTIONS), contextlib.nullcontext),
    "enable": Adoption(None, lambda: lowbit_compile.enable(**OPTIONS)),
    # the script runs as is under `python -m lowbit_compile run`, which rewrites the framework's optimizer
    "cli": Adoption(None, contextlib.nullcontext),
    # (issue 15's importable classes go here: Adoption(lambda params, lr, wd: lowbit_compile.optim.AdamW(...), ...))
}


def low_bit_states(opt: torch.optim.Optimizer) -> tuple[int, int]:
    """(low-bit per-element states, all tensor states but ``step`` and the stochastic-rounding counter)."""
    values = [v for s in opt.state.values() for k, v in s.items()
              if k not in ("step", ROUNDING_SEED) and isinstance(v, torch.Tensor)]
    return sum(isinstance(v, QuantizedState) for v in values), len(values)


def record(workdir: Path, framework: str, path: str, phase: str, model: torch.nn.Module,
           opt: torch.optim.Optimizer) -> None:
    opt = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer
    torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "low_bit": low_bit_states(opt), "wrapped": lowbit_compile.is_wrapped(opt)},
               workdir / f"{framework}-{path}-{phase}.pt")


# Hugging Face Trainer ----------------------------------------------------------------------------
def hf(path: str, phase: str, workdir: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            start = torch.randint(0, 32, (24, 1), generator=torch.Generator().manual_seed(1))
            self.ids = (start + torch.arange(8)) % 32

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=str(workdir / f"hf-{path}"), max_steps=STEPS, save_strategy="steps", save_steps=CHECKPOINT_AT,
        per_device_train_batch_size=4, learning_rate=LR, weight_decay=WEIGHT_DECAY, lr_scheduler_type="linear",
        report_to=[], use_cpu=True, disable_tqdm=True, seed=0, logging_strategy="no")
    adoption = ADOPTION[path]
    optimizers = (adoption.optimizer(model.parameters(), LR, WEIGHT_DECAY), None) if adoption.optimizer else (None, None)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=optimizers)
    resume = str(workdir / f"hf-{path}" / f"checkpoint-{CHECKPOINT_AT}") if phase == "resume" else None
    with adoption.scope():
        trainer.train(resume_from_checkpoint=resume)
    record(workdir, "hf", path, phase, model, trainer.optimizer)


# Lightning ----------------------------------------------------------------------------------------
def lightning(path: str, phase: str, workdir: Path) -> None:
    import lightning as L

    adoption = ADOPTION[path]

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            build = adoption.optimizer or (lambda params, lr, wd: torch.optim.AdamW(params, lr=lr, weight_decay=wd))
            return build(self.parameters(), LR, WEIGHT_DECAY)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * CHECKPOINT_AT, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.tanh(x.sum(1, keepdim=True)))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)  # one epoch = the first leg
    torch.manual_seed(0)
    module = Regression()
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=workdir / f"lightning-{path}", filename="{epoch}",
                                                      save_top_k=-1, every_n_epochs=1)
    trainer = L.Trainer(accelerator="cpu", max_epochs=STEPS // CHECKPOINT_AT, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[checkpoints])
    resume = workdir / f"lightning-{path}" / "epoch=0.ckpt" if phase == "resume" else None
    with adoption.scope():
        trainer.fit(module, loader, ckpt_path=resume)
    record(workdir, "lightning", path, phase, module, trainer.optimizers[0])


# accelerate ---------------------------------------------------------------------------------------
def accelerate(path: str, phase: str, workdir: Path) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    adoption = ADOPTION[path]
    accelerator = Accelerator(cpu=True)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        build = adoption.optimizer or (lambda params, lr, wd: torch.optim.AdamW(params, lr=lr, weight_decay=wd))
        model, opt = accelerator.prepare(model, build(model.parameters(), LR, WEIGHT_DECAY))
        g = torch.Generator().manual_seed(1)
        batches = [torch.randn(4, 8, generator=g) for _ in range(STEPS)]
        with adoption.scope():
            first = 0
            if phase == "resume":
                accelerator.load_state(str(workdir / f"accelerate-{path}"))
                first = CHECKPOINT_AT
            for step in range(first, STEPS):
                if step == CHECKPOINT_AT and phase == "first":
                    accelerator.save_state(str(workdir / f"accelerate-{path}"))
                x = batches[step]
                accelerator.backward(torch.nn.functional.mse_loss(model(x), torch.tanh(x.sum(1, keepdim=True))))
                opt.step()
                opt.zero_grad()
        record(workdir, "accelerate", path, phase, model, opt)
    finally:
        AcceleratorState._reset_state(True)


FRAMEWORKS = {"hf": hf, "lightning": lightning, "accelerate": accelerate}


def main() -> None:
    phase, paths, workdir = sys.argv[1], sys.argv[2].split(","), Path(sys.argv[3])
    warnings.filterwarnings("ignore")  # the frameworks' advice about workers, logging and CPU
    for path in paths:
        for framework in FRAMEWORKS.values():
            framework(path, phase, workdir)


if __name__ == "__main__":
    main()
