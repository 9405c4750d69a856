"""One rank of a multi-process check for tests/test_distributed.py (gloo on CPU, file rendezvous).

Run as ``python -m tests.dist_worker SCENARIO RANK WORLD WORKDIR``. A scenario asserts what it
checks and prints what it measured; the process then meets the others at a barrier, leaves the
process group and ends with ``os._exit`` (gloo can abort at interpreter exit otherwise).
"""

from __future__ import annotations

import copy
import datetime
import os
import sys
import traceback
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from bench.tasks import FP32MasterCopy
from lowbit_compile import QuantizedState, lowbit_compile, memory_report, restore
from lowbit_compile.checkpoint import stock_state_dict
from lowbit_compile.state import codec, sharding

LR = 1e-2
FLATTENS_PACKED_STATES = torch.__version__ >= "2.10"  # flatten_optimizer_state_dict takes dict states
# low-bit from 1000 elements: a.weight (129x10, shards of 650/640), extra (3001, shards 1501/1500) and
# wide (5x300, shards of 900/600) are quantized although no shard reaches 1000; c.weight (7x101 = 707)
# keeps fp32 on every rank. wide's rows span a block, so its checkpoint keeps records per row; the
# others' are narrower and gathered
CONFIG = {"fmt": "int8", "block_size": 256, "min_8bit_size": 1000}


class Net(torch.nn.Module):
    """Dim-0 sizes 129, 101, 7, 3001, 5: uneven shards at world size 2."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(10, 129)
        self.b = torch.nn.Linear(129, 101)
        self.c = torch.nn.Linear(101, 7)
        self.extra = torch.nn.Parameter(torch.randn(3001) * 0.1)
        self.wide = torch.nn.Parameter(torch.randn(5, 300) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return y.square().mean() + (self.extra.square() * x[0, 0]).mean() + (self.wide.square() * x[0, 1]).mean()


def fsdp_net() -> Net:
    net = Net()
    for layer in (net.a, net.b, net.c):
        fully_shard(layer)
    fully_shard(net)
    return net


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    """The same batches on every rank, so averaged gradients equal one process's (g + g) / 2 == g."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(16, 10, generator=gen)).backward()
        opt.step()
        opt.zero_grad()


def assert_grads_die(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """The optimizer keeps no grad shard past its step: ``zero_grad(set_to_none=True)`` frees each."""
    gen = torch.Generator().manual_seed(seed)
    model(torch.randn(16, 10, generator=gen)).backward()
    storages = [weakref.ref(p.grad._local_tensor.untyped_storage()) for p in model.parameters()]
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert all(r() is None for r in storages), "a grad shard outlived its step"


def full(model: torch.nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def dcp_load(model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path,
             options: StateDictOptions | None = None) -> None:
    """The recipe of torch.distributed.checkpoint: a template from get_state_dict, load, set."""
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)


def one_process(steps_before: int, steps_after: int) -> dict[str, list[torch.Tensor]]:
    """The parameters one process reaches with int8 and with fp32 states (computed on rank 0)."""
    runs: list = [None]
    if dist.get_rank() == 0:
        runs[0] = {}
        for fmt in ("int8", "fp32"):
            net = Net()
            opt = lowbit_compile(torch.optim.AdamW(net.parameters(), lr=LR), **{**CONFIG, "fmt": fmt})
            train(net, opt, steps_before, seed=1)
            train(net, opt, steps_after, seed=2)
            runs[0][fmt] = full(net)
            if fmt == "int8":
                runs[0]["bytes"] = memory_report(opt).total.bytes
    dist.broadcast_object_list(runs, src=0)
    return runs[0]


def tolerance(runs: dict[str, list[torch.Tensor]]) -> float:
    """How far int8 states take training from fp32 AdamW over the same steps: blocking the states
    differently (other shards) is an error of the same kind, so it must stay within this."""
    return max_diff(runs["int8"], runs["fp32"])


def shard_draws_are_local(net: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """A rank rounds its shard of v stochastically (the default) with the draws of the shard's own element
    indices, as its blocks are its own (docs/numerics.md): a plain parameter holding the shard, stepped
    from the same states and gradient, stores the same codes."""
    p = net.extra
    gen = torch.Generator().manual_seed(seed)
    net(torch.randn(16, 10, generator=gen)).backward()
    local = {k: (copy.deepcopy(v.to_local()) if isinstance(v, DTensor) else v.clone()) for k, v in opt.state[p].items()}
    twin = torch.nn.Parameter(p.to_local().detach().clone())
    twin.grad = p.grad.to_local().detach().clone()
    opt.step()
    opt.zero_grad()
    twin_opt = lowbit_compile(torch.optim.AdamW([twin], lr=LR), **{**CONFIG, "min_8bit_size": 0})
    twin_opt.state[twin] = local
    twin_opt.step()
    assert float(twin_opt.state[twin]["rounding_seed"]) == float(opt.state[p]["rounding_seed"])
    for key in ("exp_avg", "exp_avg_sq"):
        ours, theirs = opt.state[p][key].to_local().storage_parts, twin_opt.state[twin][key].storage_parts
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ours, theirs)), key


# scenarios -------------------------------------------------------------------------------------------
def fsdp(rank: int, world: int, workdir: Path) -> None:
    """FSDP2 at world size ``world``: formats by full shape, stock-exact fp32, single-process match,
    DCP states are DTensors, exact DCP and torch.save resume; saves a checkpoint for other sizes."""
    # fp32 through the rewritten step on local shards is stock AdamW bit for bit
    nets = [fsdp_net(), fsdp_net()]
    opts = [lowbit_compile(torch.optim.AdamW(nets[0].parameters(), lr=LR), "fp32"),
            torch.optim.AdamW(nets[1].parameters(), lr=LR)]
    for net, opt in zip(nets, opts):
        train(net, opt, 2, seed=1)
    assert bitwise(full(nets[0]), full(nets[1])), "fp32 on FSDP2 shards differs from stock AdamW"
    stock_dcp_into_wrapped(nets[1], opts[1], workdir)
    for _ in range(2):  # the first step prepares, the second replays the plan
        assert_grads_die(nets[0], opts[0], seed=3)

    net = fsdp_net()
    opt = lowbit_compile(torch.optim.AdamW(net.parameters(), lr=LR), **CONFIG)
    train(net, opt, 3, seed=1)
    layout = {}
    for name, p in net.named_parameters():
        value = opt.state[p]["exp_avg"]
        assert isinstance(value, DTensor) and value.shape == p.shape and value.placements == p.placements
        local = value.to_local()
        assert local.shape == p.to_local().shape
        layout[name] = isinstance(local, QuantizedState)
    assert layout == {"a.weight": True, "a.bias": False, "b.weight": True, "b.bias": False,
                      "c.weight": False, "c.bias": False, "extra": True, "wide": True}, layout
    every = [None] * world
    dist.all_gather_object(every, layout)
    assert all(x == layout for x in every)
    other = fsdp_net()
    other_opt = lowbit_compile(torch.optim.AdamW(other.parameters(), lr=LR), **CONFIG)
    train(other, other_opt, 2, seed=1)
    shard_draws_are_local(other, other_opt, seed=5)

    runs = one_process(3, 0)
    drift, allowed = max_diff(full(net), runs["int8"]), tolerance(runs)
    print(f"rank {rank}: FSDP2 vs one process after 3 steps {drift:.2e}, int8 vs fp32 {allowed:.2e}")
    assert drift <= allowed
    # each rank holds its shard's states only: together what one process holds, plus per extra rank
    # its own 4-byte step per parameter and at most one more partial block (12 bytes of scale and
    # patches) per quantized state (4 params x 2 states)
    held = torch.tensor(memory_report(opt).total.bytes)
    dist.all_reduce(held)
    print(f"rank {rank}: state bytes on this rank {memory_report(opt).total.bytes}, all ranks {held.item()}, "
          f"one process {runs['bytes']}")
    assert 0 <= held.item() - runs["bytes"] <= (world - 1) * (8 * 4 + 4 * 2 * 12)

    model_sd, optim_sd = get_state_dict(net, opt)
    for fqn in ("a.weight", "extra", "wide"):
        for key in ("exp_avg", "exp_avg_sq"):
            packed = optim_sd["state"][fqn][key]
            tables = [packed[name] for name in TABLES]
            # rows of a block or more: per-row records, sharded like the codes; narrower rows: every
            # shard's records in one plain table, the same on every rank (DCP writes it once)
            assert all(isinstance(t, DTensor) == (fqn == "wide") for t in tables), (fqn, key)
            if fqn != "wide":
                every = [None] * world
                dist.all_gather_object(every, tables)
                assert all(torch.equal(a, b) for x in every for a, b in zip(x, tables)), (fqn, key)
    for entry in optim_sd["state"].values():
        for key in ("exp_avg", "exp_avg_sq"):  # stock AdamW's states are DTensors; so are our codes
            assert isinstance(entry[key]["codes"] if isinstance(entry[key], dict) else entry[key], DTensor)
    if rank == 0:
        torch.save(dense_states(opt, net.extra), workdir / f"extra{world}.pt")
    else:
        dense_states(opt, net.extra)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(workdir / f"dcp{world}"))
    # torchtitan's way: states flattened to one level, which allows only tensors, ints, floats and (from
    # torch 2.10) dicts; torch 2.9 cannot flatten a packed state, and the resume below reads the plain layout
    flat = StateDictOptions(flatten_optimizer_state_dict=True) if FLATTENS_PACKED_STATES else None
    if flat is not None:
        dcp.save(dict(zip(("model", "optim"), get_state_dict(net, opt, options=flat))),
                 checkpoint_id=str(workdir / f"flat{world}"))
    path = workdir / f"rank{rank}.pt"
    torch.save(copy.deepcopy({"model": net.state_dict(), "optim": opt.state_dict()}), path)
    kept = opt.state_dict()  # a DTensor's packed state is a copy: it must not follow the steps below
    train(net, opt, 3, seed=2)
    snapshot = torch.load(path, weights_only=True)["optim"]["state"]
    for idx, entry in kept["state"].items():
        for key, packed in entry.items():
            if isinstance(packed, dict):
                assert all(torch.equal(t.to_local(), snapshot[idx][key][name].to_local())
                           for name, t in packed.items() if isinstance(t, DTensor)), (idx, key)
    expected = full(net)
    if rank == 0:
        torch.save(expected, workdir / f"continued{world}.pt")

    resumed = fsdp_net()
    resumed_opt = lowbit_compile(torch.optim.AdamW(resumed.parameters(), lr=LR), **CONFIG)
    dcp_load(resumed, resumed_opt, workdir / (f"flat{world}" if flat is not None else f"dcp{world}"), flat)
    train(resumed, resumed_opt, 3, seed=2)
    assert bitwise(full(resumed), expected), "DCP resume at the same world size is not exact"

    loaded = torch.load(path, weights_only=True)
    again = fsdp_net()
    again_opt = lowbit_compile(torch.optim.AdamW(again.parameters(), lr=LR), **CONFIG)
    again.load_state_dict(loaded["model"])
    again_opt.load_state_dict(loaded["optim"])
    train(again, again_opt, 3, seed=2)
    assert bitwise(full(again), expected), "per-rank torch.save resume is not exact"

    restore(again_opt)
    assert all(type(opt_state["exp_avg"].to_local()) is torch.Tensor for opt_state in again_opt.state.values())
    train(again, again_opt, 1, seed=3)

    compact_1d(rank, world, workdir)
    reblocked_1d(rank, world, workdir)


class Vector(torch.nn.Module):
    """One 1-D parameter, as a bias or a norm weight is, sharded by ``fully_shard``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, n))
        fully_shard(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).square().mean()


def train_vector(model: Vector, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(model.w.shape, generator=gen)).backward()
        opt.step()
        opt.zero_grad()


def compact_1d(rank: int, world: int, workdir: Path) -> None:
    """A 1e6-element 1-D DTensor parameter with int8 states and the default block: DCP writes its m
    and v in at most 2.05 bytes per parameter (stock: 8), and resumes from them bit for bit."""
    n, path = 1_000_000, workdir / f"vector{world}"

    def make() -> tuple[Vector, torch.optim.Optimizer]:
        model = Vector(n)
        return model, lowbit_compile(torch.optim.AdamW(model.parameters(), lr=LR), "int8")

    model, opt = make()
    train_vector(model, opt, 2, seed=1)
    dcp.save(dict(zip(("model", "optim"), get_state_dict(model, opt))), checkpoint_id=str(path))
    written = sum(info.length for index, info in dcp.FileSystemReader(str(path)).read_metadata().storage_data.items()
                  if ".exp_avg." in index.fqn or ".exp_avg_sq." in index.fqn)
    print(f"rank {rank}: DCP wrote m + v of a {n}-element 1-D DTensor in {written / n:.4f} B/param")
    assert written / n <= 2.05
    train_vector(model, opt, 2, seed=2)

    resumed, resumed_opt = make()
    dcp_load(resumed, resumed_opt, path)
    train_vector(resumed, resumed_opt, 2, seed=2)
    assert bitwise(full(resumed), full(model)), "DCP resume of a 1-D DTensor state is not exact"


def reblocked_1d(rank: int, world: int, workdir: Path) -> None:
    """Shards with more blocks than a gathered table holds (here: a table shrunk to one record per
    block, 300 + 300 elements in blocks of 256) are saved as the held values quantized as one tensor,
    and load from there within the format's resolution."""
    capacity = codec._capacity
    codec._capacity = lambda numel, block_size: -(-numel // block_size)
    try:
        model = Vector(600)
        opt = lowbit_compile(torch.optim.AdamW(model.parameters(), lr=LR), **{**CONFIG, "min_8bit_size": 0})
        train_vector(model, opt, 2, seed=1)
        held = dense_states(opt, model.w)
        model_sd, optim_sd = get_state_dict(model, opt)
        assert optim_sd["state"]["w"]["exp_avg"]["row_splits"] == codec._int("0,600")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(workdir / f"reblocked{world}"))
        resumed = Vector(600)
        resumed_opt = lowbit_compile(torch.optim.AdamW(resumed.parameters(), lr=LR), **{**CONFIG, "min_8bit_size": 0})
        dcp_load(resumed, resumed_opt, workdir / f"reblocked{world}")
        saved = {key: value.full_tensor() for key, value in stock_state_dict(optim_sd)["state"]["w"].items()
                 if key in held}
        for key, values in held.items():  # the held values, quantized as one tensor
            fmt = opt.state[model.w][key].to_local().fmt
            assert torch.equal(saved[key], QuantizedState.from_dense(values, fmt).dequantize()), key
        assert_within_resolution(resumed_opt, resumed.w, saved)
    finally:
        codec._capacity = capacity


TABLES = ("block_scales", "block_patch_values", "block_patch_index")


def dense_states(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """The full dequantized m and v of ``p`` (a collective)."""
    return {key: sharding.dequantize(opt.state[p][key]).full_tensor() for key in ("exp_avg", "exp_avg_sq")}


def assert_within_resolution(opt: torch.optim.Optimizer, p: torch.Tensor, saved: dict[str, torch.Tensor]) -> None:
    """This rank's m and v of ``p`` equal the ``saved`` full values within half a code step of the
    block they are in now (twice that, for rounding) or bf16 rounding of a patch."""
    start, stop = sharding.local_rows(p)
    for key, full in saved.items():
        held: QuantizedState = opt.state[p][key].to_local()
        expected = full[start:stop]
        error = (held.dequantize() - expected).abs()
        step = held.scales.repeat_interleave(held.fmt.block_size)[: error.numel()].view(error.shape)
        assert bool((error <= torch.maximum(step, expected.abs() * 2**-8)).all()), key


def stock_dcp_into_wrapped(stock_net: torch.nn.Module, stock_opt: torch.optim.Optimizer, workdir: Path) -> None:
    """A DCP checkpoint of stock FSDP2 AdamW loads into a wrapped optimizer through a stock-shaped
    template (stock_state_dict of the wrapped one's), and its states come out quantized."""
    dcp.save({"optim": get_state_dict(stock_net, stock_opt)[1]}, checkpoint_id=str(workdir / "stock"))
    net = fsdp_net()
    opt = lowbit_compile(torch.optim.AdamW(net.parameters(), lr=LR), **CONFIG)
    template = stock_state_dict(get_state_dict(net, opt)[1])
    dcp.load({"optim": template}, checkpoint_id=str(workdir / "stock"))
    set_optimizer_state_dict(net, opt, template)
    for (name, p), q in zip(net.named_parameters(), stock_net.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            local, stock = opt.state[p][key].to_local(), stock_opt.state[q][key].to_local()
            if isinstance(local, QuantizedState):
                expected = QuantizedState.from_dense(stock, local.fmt)
                assert all(torch.equal(a, b) for a, b in zip(local.storage_parts, expected.storage_parts))
            else:
                assert name in ("a.bias", "b.bias", "c.weight", "c.bias") and torch.equal(local, stock)


def reshard(rank: int, world: int, workdir: Path) -> None:
    """Resume from the DCP checkpoint of the other world size (1 or 2), re-quantizing the blocks the
    new shards cut differently; train on and compare with that size's run. The first leg at this
    size also saves its checkpoint and run for the way back."""
    other = 3 - world
    net = fsdp_net()
    opt = lowbit_compile(torch.optim.AdamW(net.parameters(), lr=LR), **CONFIG)
    dcp_load(net, opt, workdir / f"dcp{other}")
    assert isinstance(opt.state[net.a.weight]["exp_avg"].to_local(), QuantizedState)
    assert_within_resolution(opt, net.extra, torch.load(workdir / f"extra{other}.pt"))
    first_leg = not (workdir / f"dcp{world}").exists()
    if first_leg:
        dcp.save(dict(zip(("model", "optim"), get_state_dict(net, opt))), checkpoint_id=str(workdir / f"dcp{world}"))
        extra = dense_states(opt, net.extra)
        if rank == 0:
            torch.save(extra, workdir / f"extra{world}.pt")
    train(net, opt, 3, seed=2)
    reached = full(net)
    if first_leg and rank == 0:
        torch.save(reached, workdir / f"continued{world}.pt")
    drift, allowed = max_diff(reached, torch.load(workdir / f"continued{other}.pt")), tolerance(one_process(3, 3))
    print(f"rank {rank}: world {other} -> {world}, 3 steps on: {drift:.2e} from world {other}'s run, "
          f"int8 vs fp32 {allowed:.2e}")
    assert drift <= allowed


def ddp_and_zero(rank: int, world: int, workdir: Path) -> None:
    """DDP trains exactly like one process. ZeroRedundancyOptimizer (inner optimizer wrapped) does too
    where every state rounds to nearest; under the default each rank's inner optimizer numbers its own
    params, so v's stochastic draws are not one process's (docs/checkpoints-and-distributed.md). ZeRO's
    state_dict/load_state_dict (which bypasses the inner hooks) resumes its own run exactly."""
    expected = {}
    for rounding in ("auto", "nearest"):
        single = Net()
        single_opt = lowbit_compile(torch.optim.AdamW(single.parameters(), lr=LR), **CONFIG, rounding=rounding)
        train(single, single_opt, 3, seed=1)
        train(single, single_opt, 2, seed=2)
        expected[rounding] = full(single)

    ddp = DistributedDataParallel(Net())
    ddp_opt = lowbit_compile(torch.optim.AdamW(ddp.parameters(), lr=LR), **CONFIG)
    train(ddp, ddp_opt, 3, seed=1)
    train(ddp, ddp_opt, 2, seed=2)
    assert bitwise(full(ddp.module), expected["auto"]), "DDP differs from one process"

    def zero_run(rounding: str) -> tuple[torch.nn.Module, ZeroRedundancyOptimizer]:
        model = DistributedDataParallel(Net())
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
        lowbit_compile(zero.optim, **CONFIG, rounding=rounding)
        return model, zero

    model, zero = zero_run("nearest")
    train(model, zero, 3, seed=1)
    owned = [p for p in model.parameters() if p in zero.optim.state]
    assert owned and len(owned) < len(list(model.parameters())), "ZeRO should give each rank a part"
    train(model, zero, 2, seed=2)
    assert bitwise(full(model.module), expected["nearest"]), "ZeroRedundancyOptimizer differs from one process"

    model, zero = zero_run("auto")
    train(model, zero, 3, seed=1)
    zero.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save(zero.state_dict(), workdir / "zero.pt")
    snapshot = [p.detach().clone() for p in model.parameters()]
    train(model, zero, 2, seed=2)
    uninterrupted = full(model.module)

    dist.barrier()
    model, zero = zero_run("auto")
    with torch.no_grad():
        for p, value in zip(model.parameters(), snapshot):
            p.copy_(value)
    zero.load_state_dict(torch.load(workdir / "zero.pt", weights_only=True))
    train(model, zero, 2, seed=2)
    assert bitwise(full(model.module), uninterrupted), "ZeroRedundancyOptimizer resume is not exact"


def fsdp1_flat(rank: int, world: int, workdir: Path) -> None:
    """FSDP1 with use_orig_params=False hands the optimizer one flat 1-D shard per wrapped module:
    each rank saves its optimizer's state_dict compactly (8-bit m + v within 2.05 bytes per element
    of the flat shard) and resumes from it bit for bit."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = FullyShardedDataParallel(Net(), use_orig_params=False, device_id=torch.device("cpu"))
        return model, lowbit_compile(torch.optim.AdamW(model.parameters(), lr=LR), **{**CONFIG, "min_8bit_size": 0})

    model, opt = make()
    flat = list(model.parameters())
    assert all(p.dim() == 1 and not isinstance(p, DTensor) for p in flat)
    train(model, opt, 3, seed=1)
    assert all(isinstance(opt.state[p]["exp_avg"], QuantizedState) for p in flat)
    saved = {"params": [p.detach().clone() for p in flat], "optim": copy.deepcopy(opt.state_dict())}
    path = workdir / f"fsdp1-rank{rank}.pt"
    torch.save(saved, path)
    n = sum(p.numel() for p in flat)
    held = sum(t.numel() * t.element_size() for entry in saved["optim"]["state"].values()
               for key in ("exp_avg", "exp_avg_sq") for t in entry[key].values() if isinstance(t, torch.Tensor))
    print(f"rank {rank}: FSDP1 flat shard of {n} elements, m + v in the state_dict {held / n:.4f} B/param")
    assert held / n <= 2.05
    train(model, opt, 3, seed=2)
    expected = [p.detach().clone() for p in flat]

    model, opt = make()
    loaded = torch.load(path, weights_only=True)
    with torch.no_grad():
        for p, value in zip(model.parameters(), loaded["params"]):
            p.copy_(value)
    opt.load_state_dict(loaded["optim"])
    train(model, opt, 3, seed=2)
    assert bitwise(list(model.parameters()), expected), "FSDP1 flat-parameter resume is not exact"


# master weights ----------------------------------------------------------------------------------------
def fsdp_net16() -> torch.nn.Module:
    """``Net`` in bf16 (inputs cast to it), FSDP2-sharded like ``fsdp_net``."""
    net = Net().to(torch.bfloat16)
    for layer in (net.a, net.b, net.c):
        fully_shard(layer)
    fully_shard(net)
    return net


def train16(model: torch.nn.Module, opt, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(16, 10, generator=gen).to(torch.bfloat16)).float().backward()
        opt.step()
        opt.zero_grad()


MASTER = {"fmt": "fp32", "master_weights": "exact"}


def fsdp_master(rank: int, world: int, workdir: Path) -> None:
    """bf16 FSDP2 shards with exact master weights: the recipe on the same shards bit for bit, the
    residual a DTensor like its param, an exact DCP resume; saves a checkpoint for another world size."""
    from lowbit_compile import master_params

    net, recipe_net = fsdp_net16(), fsdp_net16()
    opt = lowbit_compile(torch.optim.AdamW(net.parameters(), lr=LR), **MASTER)
    recipe = FP32MasterCopy(list(recipe_net.parameters()), lambda ms: torch.optim.AdamW(ms, lr=LR, foreach=False))
    train16(net, opt, 3, seed=1)
    train16(recipe_net, recipe, 3, seed=1)
    assert bitwise(full(net), full(recipe_net)), "exact master weights on FSDP2 shards differ from the recipe"
    ours = [m.full_tensor() for m in master_params(opt)]
    assert bitwise(ours, [m.detach().full_tensor() for m in recipe.masters]), "the fp32 masters differ"
    for p in net.parameters():
        value = opt.state[p]["master_residual"]
        assert isinstance(value, DTensor) and value.shape == p.shape and value.placements == p.placements
    print(f"rank {rank}: residual bytes on this rank {memory_report(opt).per_state['master_residual'].bytes}")

    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(workdir / f"master{world}"))
    train16(net, opt, 3, seed=2)
    expected = full(net)
    if rank == 0:
        torch.save(expected, workdir / f"master_continued{world}.pt")
    resumed = fsdp_net16()
    resumed_opt = lowbit_compile(torch.optim.AdamW(resumed.parameters(), lr=LR), **MASTER)
    dcp_load(resumed, resumed_opt, workdir / f"master{world}")
    train16(resumed, resumed_opt, 3, seed=2)
    assert bitwise(full(resumed), expected), "DCP resume with master weights is not exact"


def reshard_master(rank: int, world: int, workdir: Path) -> None:
    """The master-weights checkpoint of the other world size, loaded here, steps on bit for bit like
    that size's own run: the residual and its tie bits are per element, whatever the shards."""
    other = 3 - world
    net = fsdp_net16()
    opt = lowbit_compile(torch.optim.AdamW(net.parameters(), lr=LR), **MASTER)
    dcp_load(net, opt, workdir / f"master{other}")
    train16(net, opt, 3, seed=2)
    assert bitwise(full(net), torch.load(workdir / f"master_continued{other}.pt")), (
        f"master weights resharded from world {other} to {world} step differently")


class MuonNet(torch.nn.Sequential):
    """Tall (129x10, 300x7: the step transposes them) and wide (7x129) matrices, uneven dim-0 shards."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(*(torch.nn.Linear(i, o, bias=False) for i, o in ((10, 129), (129, 7), (7, 300))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).square().mean()


def fsdp_muon_net(dtype: torch.dtype = torch.float32) -> MuonNet:
    net = MuonNet().to(dtype)
    for layer in net:
        fully_shard(layer)
    fully_shard(net)
    return net


def fsdp_muon(rank: int, world: int, workdir: Path) -> None:
    """Muon on FSDP2 shards: Newton-Schulz runs on the DTensors as stock's does, so fp32 states are
    stock Muon under the same sharding bit for bit (fp32 and bf16 params), exact master weights the
    recipe on the same shards; an int8 momentum is sharded like the param and resumes from a DCP
    checkpoint bit for bit."""
    from lowbit_compile import master_params

    ours, stock = fsdp_muon_net(), fsdp_muon_net()
    opt = lowbit_compile(torch.optim.Muon(ours.parameters(), lr=0.02), "fp32")
    train(ours, opt, 3, seed=1)
    train(stock, torch.optim.Muon(stock.parameters(), lr=0.02), 3, seed=1)
    assert bitwise(full(ours), full(stock)), "fp32 Muon on FSDP2 shards differs from stock Muon"

    ours16, stock16 = fsdp_muon_net(torch.bfloat16), fsdp_muon_net(torch.bfloat16)
    train16(ours16, lowbit_compile(torch.optim.Muon(ours16.parameters(), lr=0.02), "fp32"), 3, seed=1)
    train16(stock16, torch.optim.Muon(stock16.parameters(), lr=0.02), 3, seed=1)
    assert bitwise(full(ours16), full(stock16)), "fp32 Muon on bf16 FSDP2 shards differs from stock Muon"
    net16, recipe_net = fsdp_muon_net(torch.bfloat16), fsdp_muon_net(torch.bfloat16)
    opt16 = lowbit_compile(torch.optim.Muon(net16.parameters(), lr=0.02), **MASTER)
    recipe = FP32MasterCopy(list(recipe_net.parameters()), lambda ms: torch.optim.Muon(ms, lr=0.02))
    train16(net16, opt16, 3, seed=1)
    train16(recipe_net, recipe, 3, seed=1)
    assert bitwise(full(net16), full(recipe_net)), "exact master weights of Muon on FSDP2 differ from the recipe"
    assert bitwise([m.full_tensor() for m in master_params(opt16)], [m.detach().full_tensor() for m in recipe.masters])

    net = fsdp_muon_net()
    opt = lowbit_compile(torch.optim.Muon(net.parameters(), lr=0.02), **CONFIG)
    train(net, opt, 3, seed=1)
    for p in net.parameters():
        value = opt.state[p]["momentum_buffer"]
        assert isinstance(value, DTensor) and value.placements == p.placements
        assert isinstance(value._local_tensor, QuantizedState) == (p.numel() >= CONFIG["min_8bit_size"])
    print(f"rank {rank}: int8 Muon after 3 steps differs from fp32 by {max_diff(full(net), full(ours)):.2e}")
    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(workdir / f"muon{world}"))
    train(net, opt, 3, seed=2)
    resumed = fsdp_muon_net()
    resumed_opt = lowbit_compile(torch.optim.Muon(resumed.parameters(), lr=0.02), **CONFIG)
    dcp_load(resumed, resumed_opt, workdir / f"muon{world}")
    train(resumed, resumed_opt, 3, seed=2)
    assert bitwise(full(resumed), full(net)), "DCP resume of an int8 Muon on FSDP2 is not exact"


# gradient release --------------------------------------------------------------------------------------
def same_states(opt_a: torch.optim.Optimizer, opt_b: torch.optim.Optimizer, a: torch.nn.Module,
                b: torch.nn.Module) -> bool:
    """This rank's states of the two models' params equal bit for bit (a quantized shard's codes, scales
    and patches)."""
    for p, q in zip(a.parameters(), b.parameters()):
        if opt_a.state[p].keys() != opt_b.state[q].keys():
            return False
        for key, x in opt_a.state[p].items():
            x, y = sharding.local(x), sharding.local(opt_b.state[q][key])
            parts = (x.storage_parts, y.storage_parts) if isinstance(x, QuantizedState) else ([x], [y])
            if not all(torch.equal(s, t) for s, t in zip(*parts)):
                return False
    return True


def fsdp_release(rank: int, world: int, workdir: Path) -> None:
    """FSDP2 with release_grads: each rank's shard steps as its reduce-scattered grad lands (the grads
    are released before opt.step()), bit for bit the run without release (int8 and fp32 states, uneven
    shards); a DCP checkpoint taken with release resumes exactly."""
    from lowbit_compile.runtime.released_grad import is_released

    for config in (CONFIG, {**CONFIG, "fmt": "fp32"}):
        nets = [fsdp_net(), fsdp_net()]
        opts = [lowbit_compile(torch.optim.AdamW(n.parameters(), lr=LR), **config, release_grads=r)
                for n, r in zip(nets, (False, True))]
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(16, 10, generator=gen)
            for net in nets:
                net(x).backward()
            assert not any(is_released(p.grad) for p in nets[0].parameters())
            assert all(is_released(p.grad) and isinstance(p.grad, DTensor) for p in nets[1].parameters())
            for opt in opts:
                opt.step()
                opt.zero_grad()
        assert bitwise(full(nets[0]), full(nets[1])), f"FSDP2 with release differs from without ({config['fmt']})"
        assert same_states(*opts, *nets), f"FSDP2 states with release differ ({config['fmt']})"
    print(f"rank {rank}: FSDP2 at world {world} with release_grads is the run without, bit for bit")

    net = fsdp_net()
    opt = lowbit_compile(torch.optim.AdamW(net.parameters(), lr=LR), **CONFIG, release_grads=True)
    train(net, opt, 3, seed=1)
    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(workdir / f"release{world}"))
    train(net, opt, 3, seed=2)
    resumed = fsdp_net()
    resumed_opt = lowbit_compile(torch.optim.AdamW(resumed.parameters(), lr=LR), **CONFIG, release_grads=True)
    dcp_load(resumed, resumed_opt, workdir / f"release{world}")
    train(resumed, resumed_opt, 3, seed=2)
    assert bitwise(full(resumed), full(net)), "DCP resume with release_grads is not exact"
    assert same_states(opt, resumed_opt, net, resumed)


def ddp_release(rank: int, world: int, workdir: Path) -> None:
    """DDP would step each param on its local grad, before the all-reduce: refused at the first backward,
    before anything steps."""
    ddp = DistributedDataParallel(Net())
    lowbit_compile(torch.optim.AdamW(ddp.parameters(), lr=LR), **CONFIG, release_grads=True)
    before = full(ddp.module)
    try:
        ddp(torch.randn(16, 10)).backward()
    except RuntimeError as err:
        assert "before DDP (or an all-reduce after backward) averages it" in str(err), err
    else:
        raise AssertionError("DDP with release_grads was not refused")
    assert bitwise(full(ddp.module), before), "a parameter stepped before the refusal"
    print(f"rank {rank}: DDP with release_grads refused before any step")


# sqrt4 (two codes a byte) on the reference backend: a.weight 129x9 (odd rows: shards of 65 and 64 rows, 585
# and 576 codes), wide 5x301 (rows span blocks of 128; shards of 903 and 602 codes), extra 3001 (1-D, gathered),
# big 64x4096 (a model's width: records per row cost 33 x 4 bytes a row)
CONFIG4 = {"fmt": "sqrt4", "backend": "reference", "min_8bit_size": 100}


class Net4(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(9, 129)
        self.extra = torch.nn.Parameter(torch.randn(3001) * 0.1)
        self.wide = torch.nn.Parameter(torch.randn(5, 301) * 0.1)
        self.big = torch.nn.Parameter(torch.randn(64, 4096) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(self.a(x[:, :9])).square().mean() + (self.extra.square() * x[0, 0]).mean()
                + (self.wide.square() * x[0, 1]).mean() + (self.big.square() * x[0, 2]).mean())


def fsdp_net4() -> tuple[Net4, torch.optim.Optimizer]:
    net = Net4()
    fully_shard(net.a)
    fully_shard(net)
    return net, lowbit_compile(torch.optim.AdamW(net.parameters(), lr=LR), **CONFIG4)


def quantized4(opt: torch.optim.Optimizer, net: torch.nn.Module) -> dict[str, dict[str, QuantizedState]]:
    """Every sqrt4 state of ``net``'s params, this rank's shard."""
    out = {}
    for name, p in net.named_parameters():
        held = {k: sharding.local(v) for k, v in opt.state[p].items() if sharding.is_quantized(v)}
        assert sorted(held) == ["exp_avg", "exp_avg_sq"], name
        out[name] = held
        for value in held.values():
            assert value.fmt.name == "sqrt4" and value.fmt.block_size == 128, (name, value.fmt)
    return out


def fsdp_sqrt4(rank: int, world: int, workdir: Path) -> None:
    """sqrt4 states of FSDP2 shards (uneven, odd row widths, odd code counts) step on their own blocks, save
    through DCP and resume bit for bit at the same world size; loaded at the other world size (1 <-> 2), each
    held value is the saved one (a block both shardings share) or the saved values re-quantized."""
    net, opt = fsdp_net4()
    train(net, opt, 2, seed=1)
    for name, held in quantized4(opt, net).items():
        for key, value in held.items():
            n = value.shape.numel()  # this shard's elements: its blocks start at its first
            assert value.codes.numel() == -(-n // 2) and value.scales.numel() == -(-n // 128), (name, key, n)
    path = workdir / f"sqrt4_{world}"
    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    saved_bytes = sum(t.numel() * t.element_size() for key in ("exp_avg", "exp_avg_sq")
                      for t in optim_sd["state"]["big"][key].values() if isinstance(t, torch.Tensor))
    print(f"rank {rank}: the tensors DCP saves of big's m + v (64x4096, sqrt4) take "
          f"{saved_bytes / net.big.numel():.4f} B/param")
    assert saved_bytes / net.big.numel() <= 1.07
    saved = {name: dense_states(opt, p) for name, p in net.named_parameters()}
    if rank == 0:
        torch.save(saved, workdir / f"sqrt4_dense{world}.pt")
    train(net, opt, 3, seed=2)
    resumed, resumed_opt = fsdp_net4()
    dcp_load(resumed, resumed_opt, path)
    train(resumed, resumed_opt, 3, seed=2)
    assert bitwise(full(resumed), full(net)), "a DCP resume of sqrt4 states is not exact"
    for (name, a), b in zip(quantized4(opt, net).items(), quantized4(resumed_opt, resumed).values()):
        for key in a:
            assert all(torch.equal(x, y) for x, y in zip(a[key].storage_parts, b[key].storage_parts)), (name, key)
    other = 3 - world
    if not (workdir / f"sqrt4_{other}").exists():
        return
    moved, moved_opt = fsdp_net4()
    dcp_load(moved, moved_opt, workdir / f"sqrt4_{other}")
    for name, values in torch.load(workdir / f"sqrt4_dense{other}.pt").items():
        p = dict(moved.named_parameters())[name]
        start, stop = sharding.local_rows(p)
        for key, full_values in values.items():
            held = moved_opt.state[p][key].to_local()
            expected = full_values[start:stop]
            requantized = QuantizedState.from_dense(expected, held.fmt).dequantize()
            now = held.dequantize()
            assert bool(((now == expected) | (now == requantized)).all()), (name, key)
            print(f"rank {rank}: {name}.{key} from world {other}: {(now == expected).float().mean():.3f} of it "
                  "bit for bit")
    train(moved, moved_opt, 1, seed=3)


SCENARIOS = {"fsdp_sqrt4": fsdp_sqrt4, "fsdp": fsdp, "reshard": reshard, "ddp_and_zero": ddp_and_zero, "fsdp1_flat": fsdp1_flat,
             "fsdp_master": fsdp_master, "reshard_master": reshard_master, "fsdp_muon": fsdp_muon,
             "fsdp_release": fsdp_release, "ddp_release": ddp_release}


def main() -> None:
    scenario, rank, world, workdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{workdir / 'rendezvous'}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        SCENARIOS[scenario](rank, world, workdir)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
