"""Gradient release under the training frameworks: HF Trainer's accumulation (through accelerate's
``sync_gradients``) and accelerate's ``accumulate`` step bit for bit as without release, and so does a plain
Lightning fit (the step's closure runs the backward); the settings that need the grads after backward
(HF ``max_grad_norm``, Lightning ``gradient_clip_val`` and ``accumulate_grad_batches``) are refused at the
first backward, before any parameter steps."""

from __future__ import annotations

import tempfile

import pytest
import torch

import lowbit_compile
from lowbit_compile.runtime.released_grad import is_released

from .test_release import assert_same_run

transformers = pytest.importorskip("transformers")  # the `test` extra installs these: CI runs them
lightning = pytest.importorskip("lightning")
accelerate = pytest.importorskip("accelerate")

CONFIG = {"fmt": "int8", "min_8bit_size": 1024}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- Hugging Face Trainer ---------------------------------------------------------------------------
def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=64, n_layer=1, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def hf_train(release: bool, steps: int = 3, **args: object) -> tuple:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from examples.hf_trainer import CountingTokens

    model = tiny_gpt2()
    seen = []

    class Look(TrainerCallback):
        def on_pre_optimizer_step(self, *args: object, **kwargs: object) -> None:
            seen.append(is_released(model.transformer.h[0].mlp.c_fc.weight.grad))

    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=4,
                                     learning_rate=3e-3, weight_decay=0.1, save_strategy="no", report_to=[],
                                     use_cpu=True, disable_tqdm=True, logging_steps=1, seed=0, **args)
        trainer = Trainer(model=model, args=training, train_dataset=CountingTokens(64, seed=1),
                          optimizer_cls_and_kwargs=(lowbit_compile.optim.AdamW,
                                                    {**CONFIG, "release_grads": release}), callbacks=[Look()])
        trainer.train()
    return model, trainer.optimizer.optimizer, trainer.state.log_history, seen


@pytest.mark.slow
def test_hf_trainer_accumulation_steps_alike_with_release_and_logs_the_same_grad_norm():
    """gradient_accumulation_steps=2: accelerate's sync_gradients marks the backwards that accumulate."""
    a, opt_a, log_a, seen_a = hf_train(False, gradient_accumulation_steps=2, max_grad_norm=0)
    b, opt_b, log_b, seen_b = hf_train(True, gradient_accumulation_steps=2, max_grad_norm=0)
    assert seen_a == [False] * 3 and seen_b == [True] * 3  # stepped in the second backward of each step
    assert_same_run(a, b, opt_a, opt_b)
    norms = [[h["grad_norm"] for h in log if "grad_norm" in h] for log in (log_a, log_b)]
    assert len(norms[0]) == 3 and norms[0] == norms[1]


def test_hf_trainer_max_grad_norm_is_refused_before_any_step():
    initial = [p.detach().clone() for p in tiny_gpt2().parameters()]
    with pytest.raises(RuntimeError, match=r"TrainingArguments\(max_grad_norm=1\.0\).*set max_grad_norm=0"):
        hf_train(True)  # max_grad_norm defaults to 1.0
    model = tiny_gpt2()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), initial))


# -- accelerate -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_accelerate_accumulate_steps_alike_with_release():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from .test_release import Net, batches

    runs = []
    try:
        for release in (False, True):
            accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
            net = Net()
            opt = lowbit_compile.optim.AdamW(net.parameters(), lr=1e-2, release_grads=release, **CONFIG)
            model, prepared = accelerator.prepare(net, opt)
            for i, idx in enumerate(batches(9)):
                with accelerator.accumulate(model):
                    accelerator.backward(model(idx, 0))
                    assert is_released(net.up.weight.grad) == (release and i % 3 == 2)
                    prepared.step()
                    prepared.zero_grad()
            runs.append((net, opt))
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    (a, opt_a), (b, opt_b) = runs
    assert_same_run(a, b, opt_a, opt_b)


# -- Lightning --------------------------------------------------------------------------------------
class Regression(lightning.LightningModule):
    def __init__(self, release: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.release = release
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
        self.seen: list[bool] = []

    def on_after_backward(self) -> None:
        self.seen.append(is_released(self.net[0].weight.grad))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return lowbit_compile.optim.AdamW(self.parameters(), lr=1e-2, release_grads=self.release, **CONFIG)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(256, 32, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1].tanh()), batch_size=32)


def fit(release: bool, tmp_path, **trainer: object) -> tuple:
    module = Regression(release)
    run = lightning.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                            **trainer)
    run.fit(module)
    return module, run.optimizers[0]


@pytest.mark.slow
def test_a_lightning_fit_steps_alike_with_release(tmp_path):
    a, opt_a = fit(False, tmp_path)
    b, opt_b = fit(True, tmp_path)
    assert a.seen == [False] * 4 and b.seen == [True] * 4
    assert_same_run(a, b, opt_a, opt_b)


@pytest.mark.parametrize("setting,match", [
    ({"gradient_clip_val": 1.0}, r"Lightning's Trainer\(gradient_clip_val=1\.0\).*set gradient_clip_val=None"),
    ({"accumulate_grad_batches": 2}, r"Lightning's Trainer\(accumulate_grad_batches=2\).*accumulate_grad_batches=1"),
], ids=["gradient_clip_val", "accumulate_grad_batches"])
def test_lightning_settings_that_need_the_grads_are_refused_before_any_step(tmp_path, setting, match):
    initial = [p.detach().clone() for p in Regression(True).parameters()]
    module = Regression(True)
    with pytest.raises(RuntimeError, match=match):
        lightning.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                          **setting).fit(module)
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), initial))
