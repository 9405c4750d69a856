"""``python -m lowbit_compile run``: an unmodified script runs with its AdamW rewritten, sees its own
argv, exits with its own code, and the runner prints what it rewrote and the bytes saved."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

from lowbit_compile.cli import _split_run_argv, main
from lowbit_compile.config import DEFAULT_BLOCK_SIZE, DEFAULT_FMT, DEFAULT_OUTLIERS

from .helpers import run_command

# A training script that knows nothing of lowbit-compile except to report what happened to it.
SCRIPT = '''
import os, signal, sys
import torch
from lowbit_compile import is_wrapped, memory_report

print("argv", sys.argv[1:], __name__)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(80, 64), torch.nn.Linear(64, 80))
opt = torch.optim.AdamW(model.parameters())
for i in range(int(sys.argv[1])):
    loss = model(torch.arange(8)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if i == 0 and os.environ.get("SEND_SIGNAL"):
        os.kill(os.getpid(), signal.SIGUSR2)
    print("step", i + 1, "wrapped", is_wrapped(opt))
print("formats", {n: getattr(opt.state[p]["exp_avg"], "fmt", None) and opt.state[p]["exp_avg"].fmt.name
                  for n, p in model.named_parameters()})
print("held", memory_report(opt).total.bytes)
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
'''
# fp32 m and v of 80*64 + 64*80 + 80 elements, and three 0-d fp32 step counters
STOCK_BYTES = (80 * 64 + 64 * 80 + 80) * 4 * 2 + 3 * 4


@pytest.fixture
def runner(tmp_path, monkeypatch, capsys):
    """``python -m lowbit_compile run ARGS`` in this process (the trace cache is warm, so it is quick):
    returns (exit code, stdout, stderr), and puts back argv, sys.path, logging and SIGUSR2."""
    (tmp_path / "train.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)

    def run(*args: str, **env: str) -> tuple[int, str, str]:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        code = run_command(monkeypatch, *args)
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def summary_row(stderr: str) -> list[str]:
    return next(line for line in stderr.splitlines() if line.strip().startswith("AdamW #1")).split()


@pytest.mark.slow
def test_a_fresh_interpreter_runs_the_script_with_its_adamw_rewritten(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    done = subprocess.run([sys.executable, "-m", "lowbit_compile", "run", "--min-8bit-size", "0", "train.py", "1"],
                          cwd=tmp_path, text=True, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "argv ['1'] __main__" in done.stdout and "step 1 wrapped True" in done.stdout
    assert "lowbit-compile: 1 optimizer(s) rewritten" in done.stderr and "AdamW #1" in done.stderr


@pytest.mark.slow
def test_runs_the_script_unmodified_with_its_adamw_rewritten(runner):
    code, out, err = runner("--min-8bit-size", "0", "--override", "0.*=fp32", "train.py", "2", "--fmt", "x")
    assert code == 0, err
    assert "argv ['2', '--fmt', 'x'] __main__" in out  # options after the script are the script's
    assert "step 1 wrapped True" in out and "step 2 wrapped True" in out
    assert f"formats {{'0.weight': None, '1.weight': '{DEFAULT_FMT}', '1.bias': '{DEFAULT_FMT}'}}" in out  # names learned
    held = int(re.search(r"held (\d+)", out).group(1))
    assert (f"lowbit-compile: 1 optimizer(s) rewritten (fmt={DEFAULT_FMT}, block_size=None, "
            f"outliers={DEFAULT_OUTLIERS})") in err
    saved = STOCK_BYTES - held
    assert summary_row(err)[2:] == ["10,320", "2", f"{STOCK_BYTES:,}", f"{held:,}", f"{saved:,}",
                                    f"{100 * saved / STOCK_BYTES:.1f}%"]


def test_restore_at_step_switches_back_mid_run(runner):
    code, out, err = runner("--restore-at-step", "1", "--min-8bit-size", "0", "train.py", "2")
    assert code == 0, err
    assert "step 1 wrapped False" in out and "step 2 wrapped False" in out
    assert "formats {'0.weight': None, '1.weight': None, '1.bias': None}" in out
    assert "switched AdamW #1 back to stock fp32 states after its step 1" in err
    assert "restored to fp32 after step 1" in err


def test_restore_on_signal_switches_back_at_the_next_step(runner):
    code, out, err = runner("--restore-on-signal", "USR2", "train.py", "3", SEND_SIGNAL="1")
    assert code == 0, err
    assert "step 1 wrapped True" in out and "step 2 wrapped False" in out
    assert "restored to fp32 after step 2" in err


def test_module_form_keeps_the_exit_code_and_still_reports(runner, tmp_path):
    (tmp_path / "train_module.py").write_text(SCRIPT)
    code, out, err = runner("--fmt", "exp_avg=bf16,exp_avg_sq=int8", "-m", "train_module", "1", EXIT_CODE="3")
    assert code == 3
    assert "argv ['1'] __main__" in out and "step 1 wrapped True" in out
    assert "fmt={'exp_avg': 'bf16', 'exp_avg_sq': 'int8'}" in err and "AdamW #1" in err


def test_only_rank_zero_prints_the_summary(runner):
    code, out, err = runner("train.py", "1", RANK="1")
    assert code == 0 and "step 1 wrapped True" in out
    assert "optimizer(s) rewritten" not in err


@pytest.mark.parametrize("args,error", [
    (["--fmt", "int4", "train.py"], "--fmt must be one of"),
    (["--block-size", "1000", "train.py"], "--block-size must be a positive power of two"),
    (["--min-8bit-size", "-1", "train.py"], "--min-8bit-size must be a non-negative int"),
    (["--backend", "gpu", "train.py"], "--backend must be one of"),
    (["--override", "embed", "train.py"], "PATTERN=FMT"),
    (["--override", "*embed*=q", "train.py"], "--override['*embed*'] must be one of"),
    (["--override", "=fp32", "train.py"], "an override pattern is empty"),
    (["--override", "re:(=fp32", "train.py"], "'re:(' is not a valid regular expression"),
    (["--fmt", "8bit", "train.py"], "did you mean 'sqrt8' (the default)?"),
    (["--fmt", "2bit", "train.py"], "2-bit formats are not available yet"),
    (["--restore-on-signal", "NOPE", "train.py"], "unknown signal"),
    (["--restore-on-signal", "KILL", "train.py"], "SIGKILL cannot be used"),
    (["--restore-on-signal", "SIGSTOP", "train.py"], "SIGSTOP cannot be used"),
    (["--restore-on-signal", "segv", "train.py"], "SIGSEGV cannot be used"),
    (["--restore-on-signal", "INT", "train.py"], "SIGINT cannot be used"),
    (["--restore-at-step", "0", "train.py"], "--restore-at-step must be a positive int"),
    (["--monitor", "0", "train.py"], "--monitor must be a positive int"),
    (["--log-every", "-1", "train.py"], "--log-every must be a non-negative int"),
    (["--fmt", "int8"], "give the script to run"),
    (["missing.py"], "no such script: 'missing.py'"),
    (["-m", "no_such_module_here"], "no module named 'no_such_module_here'"),
    (["-m", "no_such_package.train"], "no module named 'no_such_package.train'"),
])
def test_bad_options_fail_before_the_script_runs(runner, args, error):
    """A clean error in the terms the user typed (flags, not keyword names), exit code 2, no traceback."""
    code, out, err = runner(*args)
    assert code == 2 and error in err and "argv" not in out and "Traceback" not in err
    assert err.splitlines()[-1].startswith("python -m lowbit_compile run: error: ")


@pytest.mark.parametrize("args,error", [
    (["run", "missing.py"], "no such script: 'missing.py'"),
    (["run", "--block-size", "x", "train.py"], "--block-size: invalid int value: 'x'"),
    (["run", "--no-such-flag", "train.py"], "unrecognized arguments: --no-such-flag"),
    (["run", "-m", "no_such_module"], "no module named 'no_such_module'"),
    (["estimate", "--params", "7X"], "--params: not a parameter count: '7X' (examples: 7e9, 7B"),
    (["estimate", "--params", "1e21"], "--params: '1e21' is more parameters than can be sized (at most 1e18"),
    (["estimate", "--params", "1e30"], "--params: '1e30' is more parameters than can be sized"),
    (["estimate", "--params", "1e400"], "--params: '1e400' is more parameters than can be sized"),
    (["estimate", "--params", "7B", "--muon-params", "1e400"], "--muon-params: '1e400' is more parameters"),
])
def test_argument_errors_come_before_torch_loads_in_a_fresh_interpreter(tmp_path, args, error):
    """``python -m lowbit_compile`` with a bad command line exits 2 with argparse's message, without
    importing torch (which takes seconds): the check runs with torch made unimportable."""
    (tmp_path / "train.py").write_text("")
    (tmp_path / "torch.py").write_text("raise ImportError('torch was imported')")
    package = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "lowbit_compile", *args], cwd=tmp_path, text=True,
                          capture_output=True, timeout=300, env={**os.environ, "PYTHONPATH": f"{tmp_path}:{package}"})
    assert done.returncode == 2 and "Traceback" not in done.stderr and error in done.stderr, done.stderr


def test_an_override_that_matches_no_name_of_the_script_is_a_one_line_error(runner):
    """The names come from the modules the script runs, so the pattern is judged at the first step: a
    one-line error in the CLI's terms, exit code 2, no traceback, no summary; a regex pattern (after re:)
    gets the hint."""
    code, out, err = runner("--override", "*embd*=fp32", "train.py", "2")
    assert code == 2 and "Traceback" not in err and "step 1" not in out and "optimizer(s) rewritten" not in err
    assert err.strip().splitlines()[-1] == (
        "python -m lowbit_compile run: error: --override '*embd*' matches no parameter name of the modules the "
        "script ran (0.weight, 1.weight, 1.bias); fix or remove it.")
    code, out, err = runner("--override", "1\\.(weight|bias)=fp32", "train.py", "1")
    assert code == 2 and err.strip().endswith("for a regular expression write 're:1\\\\.(weight|bias)'.")
    code, out, err = runner("--override", "re:^1\\.=fp32", "--min-8bit-size", "0", "train.py", "1")
    assert code == 0, err
    assert f"formats {{'0.weight': '{DEFAULT_FMT}', '1.weight': None, '1.bias': None}}" in out


def test_estimate_refuses_a_count_no_tensor_holds():
    from lowbit_compile.estimate import estimate

    for params in (10**21, 0, 2.5e9):
        with pytest.raises(ValueError, match="the parameter count must be an int from 1 to 1e18"):
            estimate(params)


@pytest.mark.parametrize("args,error", [
    (["--params", "7B", "--master-weights", "fp32"], "pass --param-dtype 'bf16' or 'fp16'"),
    (["--params", "7B", "--shards", "0"], "--shards must be a positive int"),
    (["--params", "7B", "--muon-params", "8B"], "--muon-params must be an int between 0 and"),
])
def test_estimate_errors_name_the_flags(capsys, args, error):
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and error in err and "param_dtype" not in err


@pytest.mark.parametrize("command", [["run"], ["estimate", "--params", "7B", "--param-dtype", "bf16"]])
def test_both_master_weights_flags_take_a_mode(capsys, tmp_path, command):
    """``run`` and ``estimate`` spell --master-weights alike: a mode is required (exact or 8bit, which
    estimate counts as our residual)."""
    script = ["train.py"] if command == ["run"] else []
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--master-weights", "--fmt", "int8", *script])
    assert exit_.value.code == 2 and "--master-weights" in capsys.readouterr().err
    if command != ["run"]:
        assert main([*command, "--master-weights", "exact"]) == 0
        assert "master (exact residual)" in capsys.readouterr().out


def test_estimate_counts_muon_params_with_one_momentum(capsys):
    assert main(["estimate", "--params", "1B", "--muon-params", "900M"]) == 0
    out = capsys.readouterr().out
    assert "Muon (900,000,000 of them) + AdamW memory for 1,000,000,000 parameters" in out
    assert "Muon momentum (fp32)" in out


def test_progress_lines_and_the_monitor(runner):
    code, out, err = runner("--min-8bit-size", "0", "--log-every", "2", "--monitor", "2", "train.py", "4")
    assert code == 0, err
    progress = [line for line in err.splitlines() if "ms/step" in line]
    assert [line.split(",")[0] for line in progress] == ["lowbit-compile: AdamW #1: step 2",
                                                         "lowbit-compile: AdamW #1: step 4"]
    assert "states" in progress[0] and "MiB held" in progress[0] and "saved (" in progress[0]
    assert sum("worst zero flush" in line for line in err.splitlines()) == 2  # the monitor's samples at 2 and 4


@pytest.mark.parametrize("argv,split", [
    (["train.py", "--lr", "3"], ([], ("script", "train.py"), ["--lr", "3"])),
    (["--fmt", "fp8_e4m3", "--no-summary", "t.py", "-m", "x"], (["--fmt", "fp8_e4m3", "--no-summary"],
                                                                ("script", "t.py"), ["-m", "x"])),
    (["--fmt=bf16", "-m", "pkg.train", "--lr", "3"], (["--fmt=bf16"], ("module", "pkg.train"), ["--lr", "3"])),
    (["--override", "*embed*=fp32", "--", "-odd-name.py", "a"], (["--override", "*embed*=fp32"],
                                                                 ("script", "-odd-name.py"), ["a"])),
    (["--fmt", "int8"], (["--fmt", "int8"], None, [])),
])
def test_split_run_argv(argv, split):
    assert _split_run_argv(argv) == split


@pytest.mark.skipif(importlib.util.find_spec("tqdm") is None, reason="tqdm not installed")
def test_the_plain_example_runs_under_the_runner(runner):
    example = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train_plain.py"
    code, out, err = runner("--override", "*embed*=fp32", str(example), "--steps", "3")
    assert code == 0, err
    assert "final loss (EMA)" in out and "lowbit-compile: 1 optimizer(s) rewritten" in err


LIGHTNING_SCRIPT = '''
import lightning as L
import torch

class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.head = torch.nn.Linear(32, 64)

    def training_step(self, batch, batch_idx):
        return self.head(self.embed(batch[0])).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

model = Model()
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 64, (24, 8))), batch_size=8)
trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, data)
opt = trainer.optimizers[0]
print("formats", {n: getattr(opt.state[p]["exp_avg"], "fmt", None) and opt.state[p]["exp_avg"].fmt.name
                  for n, p in model.named_parameters()})
'''


@pytest.mark.slow
def test_lightning_closure_loop_takes_name_overrides_and_the_monitor_names_modules(runner, tmp_path):
    """The issue's command: Lightning steps a stock AdamW with a closure that runs the forward, so the
    names are learned inside the step; the override applies and the monitor names module parameters."""
    pytest.importorskip("lightning")
    (tmp_path / "fit.py").write_text(LIGHTNING_SCRIPT)
    code, out, err = runner("--override", "*embed*=fp32", "--min-8bit-size", "16", "--monitor", "1", "fit.py")
    assert code == 0, err
    line = next(line for line in out.splitlines() if line.startswith("formats"))
    assert line == f"formats {{'embed.weight': None, 'head.weight': '{DEFAULT_FMT}', 'head.bias': '{DEFAULT_FMT}'}}"
    samples = [line for line in err.splitlines() if "worst round-trip error" in line]
    assert len(samples) == 2 and all("of head." in s and "group0" not in s for s in samples), err


def test_the_help_states_the_library_defaults(capsys):
    """The runner's parser is built before torch loads, so it writes the defaults out; they are the library's."""
    from lowbit_compile.config import BACKENDS, DEFAULT_MIN_8BIT_SIZE

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"({DEFAULT_FMT}, the default;" in text and f"(default {DEFAULT_BLOCK_SIZE}; a 4-bit format's own, smaller)" in text
    assert f"(default {DEFAULT_OUTLIERS})" in text and f"(default {DEFAULT_MIN_8BIT_SIZE})" in text
    assert all(name in text for name in BACKENDS)
