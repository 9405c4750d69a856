"""Distributed training on CPU with gloo: FSDP2 (uneven shards), torch.distributed.checkpoint at the
same and at another world size, DDP and ZeroRedundancyOptimizer, FSDP1's flat parameters, gradient
release on FSDP2 (and DDP's refusal).

Each test launches the ranks of one scenario of ``tests/dist_worker.py`` as processes that meet
through a file rendezvous (no TCP listener; gloo on the loopback interface), and fails with the
ranks' output if one fails or the whole run passes its time limit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow,  # multi-process runs
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")]

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240  # a 2-rank launch takes ~3 s of imports on an idle machine; shared CI cores are slower


def launch(scenario: str, world: int, workdir: Path) -> str:
    """Run ``world`` ranks of ``scenario``; return their output, or fail with it."""
    (workdir / "rendezvous").unlink(missing_ok=True)
    environ = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    logs = [workdir / f"{scenario}-{world}-{rank}.log" for rank in range(world)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as out:
            cmd = [sys.executable, "-m", "tests.dist_worker", scenario, str(rank), str(world), str(workdir)]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=environ, stdout=out, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            failed = any(p.returncode not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    output = "\n".join(f"--- rank {rank}\n{log.read_text()}" for rank, log in enumerate(logs))
    codes = [p.returncode for p in procs]
    assert codes == [0] * world, f"{scenario} at world size {world} ended with {codes}:\n{output}"
    return output


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist")


def test_fsdp2_trains_checkpoints_and_resumes_exactly(workdir):
    print(launch("fsdp", 2, workdir))


def test_checkpoints_move_between_world_sizes(workdir):
    """2 ranks -> 1 process (FSDP2 on one rank) -> 2 ranks, training between."""
    if not (workdir / "dcp2").exists():
        pytest.skip("needs the checkpoint of test_fsdp2_trains_checkpoints_and_resumes_exactly")
    print(launch("reshard", 1, workdir))
    print(launch("reshard", 2, workdir))


def test_fsdp2_sqrt4_states_shard_resume_exactly_and_move_between_world_sizes(workdir):
    """2 ranks (save, resume exactly) -> 1 process (loads the 2 ranks' checkpoint) -> 2 ranks (loads it back)."""
    print(launch("fsdp_sqrt4", 2, workdir))
    print(launch("fsdp_sqrt4", 1, workdir))
    print(launch("fsdp_sqrt4", 2, workdir))


def test_ddp_and_zero_redundancy_optimizer_train_like_one_process(workdir):
    print(launch("ddp_and_zero", 2, workdir))


def test_fsdp1_flat_parameters_checkpoint_compactly_and_resume_exactly(workdir):
    print(launch("fsdp1_flat", 2, workdir))


def test_fsdp2_master_weights_are_the_recipe_and_resume_exactly_at_any_world_size(workdir):
    """bf16 FSDP2 with exact master weights at 2 ranks (against the recipe on the same shards, DCP
    resume), then its checkpoint resumed on 1 rank, bit for bit."""
    print(launch("fsdp_master", 2, workdir))
    print(launch("reshard_master", 1, workdir))


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp2_muon_is_stock_and_resumes_exactly(workdir, world):
    """Muon's staged step on FSDP2 shards (Newton-Schulz on the DTensors) at 1 and 2 ranks."""
    print(launch("fsdp_muon", world, workdir))


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp2_with_release_grads_is_the_run_without_and_resumes_exactly(workdir, world):
    print(launch("fsdp_release", world, workdir))


def test_ddp_with_release_grads_is_refused_before_any_step(workdir):
    print(launch("ddp_release", 2, workdir))
