"""Resume through every framework and adoption path: Hugging Face Trainer
(``resume_from_checkpoint``), Lightning (``fit(ckpt_path=...)``) and accelerate (``load_state``),
each with the optimizer wrapped explicitly, rewritten by ``enable()`` and rewritten by
``python -m lowbit_compile run``. Each trains 6 steps with a checkpoint after step 3; a fresh
process resumes from it and must reach the uninterrupted run's parameters bit for bit.

The zero-code paths are the hard ones: the framework loads the checkpoint into its stock optimizer
before the first step rewrites it, so the stock loader has cast every packed tensor to float.

The runs happen in ``tests/resume_worker.py`` (its ``ADOPTION`` table names the paths), two
processes per leg, the legs' two processes side by side.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # training runs in fresh processes

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "resume_worker.py"
FRAMEWORKS = ("hf", "lightning", "accelerate")
IN_SCRIPT = ("explicit", "enable")  # adoption paths the worker applies itself
TIMEOUT_S = 600


def legs(phase: str, workdir: Path) -> list[list[str]]:
    """The commands of one leg: the in-script paths in one process, the CLI path in another."""
    return [[sys.executable, str(WORKER), phase, ",".join(IN_SCRIPT), str(workdir)],
            [sys.executable, "-m", "lowbit_compile", "run", "--no-summary", "--min-8bit-size", "0", str(WORKER),
             phase, "cli", str(workdir)]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("resume")
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for phase in ("first", "resume"):
        procs = [subprocess.Popen(cmd, cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for cmd in legs(phase, workdir)]
        outputs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
        for cmd, p, out in zip(legs(phase, workdir), procs, outputs):
            assert p.returncode == 0, f"{' '.join(cmd)} ended with {p.returncode}:\n{out[-6000:]}"
    return workdir


@pytest.mark.parametrize("path", [*IN_SCRIPT, "cli"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_resuming_in_a_fresh_process_matches_the_uninterrupted_run_bit_for_bit(runs, framework, path):
    first, resumed = (torch.load(runs / f"{framework}-{path}-{phase}.pt") for phase in ("first", "resume"))
    low_bit, states = resumed["low_bit"]
    assert resumed["wrapped"] and low_bit == states > 0, "the resumed run must step low-bit states"
    assert first["params"].keys() == resumed["params"].keys()
    for name, value in first["params"].items():
        assert torch.equal(value, resumed["params"][name]), name
