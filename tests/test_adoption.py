"""Selecting the low-bit optimizer from a config, as frameworks do: HF Trainer ``optimizer_cls_and_kwargs``
(keeping the Trainer's weight-decay groups), Lightning CLI ``class_path``, Hydra ``_target_``; and the
monitor's HF and Lightning callbacks in a real ``fit``."""

from __future__ import annotations

import tempfile

import pytest
import torch

import lowbit_compile
from lowbit_compile import QuantizedState, is_wrapped

transformers = pytest.importorskip("transformers")  # the `test` extra installs these: CI runs them
lightning = pytest.importorskip("lightning")
hydra_utils = pytest.importorskip("hydra.utils")


# -- Hugging Face Trainer ---------------------------------------------------------------------------
def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=64, n_layer=1, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def hf_train(optimizer_cls_and_kwargs, steps: int = 3, callbacks=None):
    from transformers import Trainer, TrainingArguments

    from examples.hf_trainer import CountingTokens

    model = tiny_gpt2()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=8, learning_rate=3e-3,
                                 weight_decay=0.1, save_strategy="no", report_to=[], use_cpu=True,
                                 disable_tqdm=True, logging_steps=1, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=CountingTokens(64, seed=1),
                          optimizer_cls_and_kwargs=optimizer_cls_and_kwargs, callbacks=callbacks)
        trainer.train()
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    return trainer, model, opt


@pytest.mark.slow
def test_hf_trainer_optimizer_cls_and_kwargs_keeps_its_decay_groups():
    trainer, model, opt = hf_train((lowbit_compile.optim.AdamW, {"fmt": "int8", "min_8bit_size": 1024}))
    assert type(opt) is lowbit_compile.optim.AdamW and is_wrapped(opt)
    names = {p: n for n, p in model.named_parameters()}  # the tied lm_head.weight is wte's
    decay = set(trainer.get_decay_parameter_names(model)) & set(names.values())
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert {names[p] for p in opt.param_groups[0]["params"]} == decay
    assert {names[p] for p in opt.param_groups[1]["params"]} == set(names.values()) - decay
    assert any("bias" in names[p] or "ln" in names[p] for p in opt.param_groups[1]["params"])
    wte = model.transformer.wte.weight
    assert isinstance(opt.state[wte]["exp_avg"], QuantizedState) and opt.state[wte]["step"].item() == 3


@pytest.mark.slow
def test_hf_trainer_with_name_patterns_through_with_options():
    """The Trainer takes ``model`` out of ``optimizer_kwargs`` (it is LOMO's argument) and calls
    anything that is not an optimizer class as a factory, so the model that names the parameters
    for name patterns comes in a preset class."""
    from transformers import Trainer, TrainingArguments

    from examples.hf_trainer import CountingTokens

    model = tiny_gpt2()
    cls = lowbit_compile.optim.AdamW.with_options(model=model, overrides={"*wte*": "fp32"}, min_8bit_size=1024)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=2, per_device_train_batch_size=8, save_strategy="no",
                                 report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=CountingTokens(32, seed=1),
                          optimizer_cls_and_kwargs=(cls, {"lr": 1e-3}))
        trainer.train()
    opt = trainer.optimizer.optimizer
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.0]  # the Trainer's two groups
    assert type(opt.state[model.transformer.wte.weight]["exp_avg"]) is torch.Tensor
    assert isinstance(opt.state[model.transformer.h[0].mlp.c_fc.weight]["exp_avg"], QuantizedState)


def test_hf_monitor_callback_samples_and_records_in_the_log_history():  # the fast tier's one HF test
    from lowbit_compile.hf_callback import LowbitMonitorCallback

    seen = []
    callback = LowbitMonitorCallback(every=2, log=lambda metrics, step: seen.append(step))
    trainer, _, _ = hf_train((lowbit_compile.optim.AdamW, {"fmt": "int8", "min_8bit_size": 1024}), steps=4,
                             callbacks=[callback])
    assert seen == [2, 4]
    recorded = [h for h in trainer.state.log_history if "lowbit/zero_flush" in h]
    assert [h["step"] for h in recorded] == [2, 4]
    assert callback.monitor is None  # removed at the end of training


@pytest.mark.slow
def test_hf_monitor_callback_under_enable_sees_the_optimizer_rewritten_on_its_first_step():
    from transformers import Trainer, TrainingArguments

    from examples.hf_trainer import CountingTokens
    from lowbit_compile.hf_callback import LowbitMonitorCallback

    callback = LowbitMonitorCallback(every=1)
    model = tiny_gpt2()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=3, per_device_train_batch_size=8, save_strategy="no",
                                 report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=CountingTokens(32, seed=1), callbacks=[callback])
        with lowbit_compile.enable(fmt="int8", min_8bit_size=1024):
            trainer.train()
    recorded = [h for h in trainer.state.log_history if "lowbit/zero_flush" in h]
    assert [h["step"] for h in recorded] == [2, 3]  # the first step makes the states the next ones sample


# -- Lightning -------------------------------------------------------------------------------------
class Regression(lightning.LightningModule):
    """No configure_optimizers: the CLI adds one from the config's optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(256, 32, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1].tanh()), batch_size=32)


def test_lightning_cli_selects_the_optimizer_by_class_path(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = {
        "optimizer": {"class_path": "lowbit_compile.optim.AdamW",
                      "init_args": {"lr": 1e-2, "weight_decay": 0.01, "fmt": "int8", "min_8bit_size": 1024}},
        "trainer": {"accelerator": "cpu", "max_steps": 4, "logger": False, "enable_checkpointing": False,
                    "enable_progress_bar": False, "enable_model_summary": False, "default_root_dir": str(tmp_path),
                    "callbacks": [{"class_path": "lowbit_compile.lightning_callback.LowbitMonitor",
                                   "init_args": {"every": 2}}]},
    }
    cli = LightningCLI(Regression, run=False, args=config, save_config_callback=None)
    cli.trainer.fit(cli.model)
    opt = cli.trainer.optimizers[0]
    assert type(opt) is lowbit_compile.optim.AdamW and isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["lr"] == 1e-2 and opt._lowbit.options["fmt"] == "int8"
    weight = cli.model.net[0].weight
    assert isinstance(opt.state[weight]["exp_avg"], QuantizedState) and opt.state[weight]["step"].item() == 4
    monitor_cb = next(c for c in cli.trainer.callbacks if type(c).__name__ == "LowbitMonitor")
    assert not monitor_cb.monitors  # removed at the end of fit


def test_lightning_monitor_callback_samples_closure_steps_and_logs_to_the_trainer_loggers(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from lowbit_compile.lightning_callback import LowbitMonitor

    class WithOptimizer(Regression):
        def configure_optimizers(self):
            return lowbit_compile.optim.AdamW(self.parameters(), lr=1e-2, min_8bit_size=1024)

    callback = LowbitMonitor(every=2)
    trainer = lightning.Trainer(accelerator="cpu", max_steps=4, logger=CSVLogger(str(tmp_path), name="run"),
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                callbacks=[callback])
    module = WithOptimizer()
    trainer.fit(module)
    text = (tmp_path / "run" / "version_0" / "metrics.csv").read_text()
    header = text.splitlines()[0].split(",")
    assert "lowbit/update_ratio" in header and "lowbit/zero_flush/exp_avg" in header
    rows = [dict(zip(header, line.split(","))) for line in text.splitlines()[1:]]
    ratios = [float(r["lowbit/update_ratio"]) for r in rows if r.get("lowbit/update_ratio")]
    assert len(ratios) == 2 and all(r > 0 for r in ratios)  # the closure's gradients were seen


# -- Hydra ------------------------------------------------------------------------------------------
def test_hydra_target_instantiates_the_low_bit_optimizer():
    model = torch.nn.Linear(64, 96)
    config = {"_target_": "lowbit_compile.optim.Adam", "lr": 1e-3, "fmt": "fp8_e4m3", "block_size": 256,
              "min_8bit_size": 0}
    opt = hydra_utils.instantiate(config, params=model.parameters())
    assert type(opt) is lowbit_compile.optim.Adam and is_wrapped(opt)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    state = opt.state[model.weight]["exp_avg"]
    assert isinstance(state, QuantizedState) and state.fmt.name == "fp8_e4m3" and state.fmt.block_size == 256
