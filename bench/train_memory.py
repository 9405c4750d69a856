"""Peak memory of a real training step: a transformers Llama built from a small LlamaConfig, bf16
autocast, trained a few steps with stock AdamW (fused where the device has it, else foreach), ours
(default states; and bf16 params, with and without ``master_weights="exact"``, beside stock AdamW on bf16
params), ours with ``release_grads=True`` (each of those), and bitsandbytes AdamW8bit when it imports, one
after the other in one process, each from the same weights on the same batches.

The peak covers the whole step (forward, backward, ``opt.step()``, ``opt.zero_grad()``). On CPU it is
the peak of live tensor bytes, each storage counted once: the storages alive when a step starts
(every tensor the garbage collector finds: params, grads, optimizer states, and whatever else still
holds a tensor) plus every storage an op makes during it, counted until the last tensor that holds it
dies (``LiveBytes``); on CUDA ``torch.cuda.max_memory_allocated``. Memory a
kernel allocates outside torch (our CPU kernel's per-thread block scratch, a few KB) is not counted.

The forward and the rest of the step (backward, ``opt.step()``, ``zero_grad``) are measured apart: the
forward's peak holds autocast's bf16 weight copies and the activations, and release changes only the
rest. Expected figure for the backward and step: params + optimizer states + the grads alive at that
peak + what backward holds then (the activations left, temporaries). The grads alive at the peak are
measured (on CPU) at the moment of the peak: every grad when it falls in ``opt.step()``; with release,
the grads that landed and still wait for their step (the small params' bucket and the param
stepping). What backward holds is measured on the stock run (one per param dtype): at its peak (its
peak minus its params, grads at its peak and states), and, for a release run, the most it holds besides
its landed grads at any moment (release moves the peak to where that is largest, earlier in backward,
where more activations are left and the grad in flight is the largest's). Ours is expected at its params
+ grads at its peak + its states + that, and the ratio of measured to expected is printed, as is the
footprint per parameter outside activations, (backward and step peak - what backward holds) / params.
The step's peak is the larger of the two phases'.

    python bench/train_memory.py                       # 27M params, 4 x 256 tokens, CPU
    python bench/train_memory.py --hidden 2048 --layers 16 --device cuda --batch 8 --seq 512
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import platform
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

RESULTS = Path(__file__).parent / "results"


class LiveBytes(TorchDispatchMode):
    """Live tensor bytes and their peak: each storage counted once (by its data pointer), from the
    first tensor seen holding it until the last such tensor dies; also the peak of each phase
    (:meth:`phase`) and what ``at_peak()`` gave at it."""

    def __init__(self, at_peak: Callable[[], int] | None = None) -> None:
        super().__init__()
        self.storages: dict[int, list[int]] = {}  # data pointer -> [tensors holding it, bytes]
        self.tensors: set[int] = set()
        self.live = 0
        self.peak = 0
        self.at_peak = at_peak  # measured whenever live bytes rise in a phase: its value at the phase's peak
        # phase -> [its peak, at_peak() then, the most bytes live besides at_peak()'s at any moment of it]
        self.phases: dict[str, list[int]] = {}
        self.current = self.phases.setdefault("", [0, 0, 0])

    def phase(self, name: str) -> None:
        """From now on the peak of phase ``name`` is measured (from what is live now)."""
        held = self.at_peak() if self.at_peak is not None else 0
        self.current = self.phases[name] = [self.live, held, self.live - held]

    def track_all_live(self) -> None:
        """Every tensor alive now with a Python object (params, grads, states, and anything that still
        holds one, such as an optimizer's reference to a grad), each storage once."""
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and not isinstance(obj, FakeTensor):
                self.track(obj)

    def track(self, t: object) -> None:
        if not isinstance(t, torch.Tensor) or id(t) in self.tensors or t.is_meta or isinstance(t, FakeTensor):
            return
        if hasattr(t, "__tensor_flatten__"):  # a wrapper (a quantized state): its inner tensors hold the bytes
            for name in t.__tensor_flatten__()[0]:
                self.track(getattr(t, name))
            return
        if _holds_nothing(t):  # a released grad's placeholder
            return
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if not nbytes:
            return
        self.tensors.add(id(t))
        weakref.finalize(t, self._drop, id(t), key)
        held = self.storages.get(key)
        if held is None:
            self.storages[key] = [1, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            if self.at_peak is not None:
                held = self.at_peak()
                self.current[2] = max(self.current[2], self.live - held)
                if self.live > self.current[0]:
                    self.current[:2] = self.live, held
            elif self.live > self.current[0]:
                self.current[0] = self.live
        else:
            held[0] += 1

    def _drop(self, tid: int, key: int) -> None:
        self.tensors.discard(tid)
        held = self.storages[key]
        held[0] -= 1
        if not held[0]:
            del self.storages[key]
            self.live -= held[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self.track(t)
        return out


def _holds_nothing(t: torch.Tensor) -> bool:
    """A wrapper tensor without storage of its own (``release_grads``' placeholder of a freed grad)."""
    try:
        t.untyped_storage().data_ptr()
    except RuntimeError:
        return True
    return False


def live_grad_bytes(params: list[torch.nn.Parameter]) -> int:
    """Bytes of the grads alive now (a released grad's placeholder holds none), each storage once."""
    return unique_bytes([p.grad for p in params if p.grad is not None and not _holds_nothing(p.grad)])


def inner(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``t``'s bytes (a quantized state's codes, scales and patches)."""
    if hasattr(t, "__tensor_flatten__"):
        return [x for name in t.__tensor_flatten__()[0] for x in inner(getattr(t, name))]
    return [t]


def state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor the optimizer's state holds."""
    return [x for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)
            for x in inner(v)]


def unique_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@dataclass
class Contender:
    name: str
    param_dtype: torch.dtype
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
    stock: bool = False  # the stock run of its param dtype: gives the forward/backward figure
    release: bool = False  # release_grads=True: the grads term of its expected peak is measured at the peak


def contenders(device: str, lr: float) -> list[Contender]:
    from lowbit_compile import lowbit_compile

    fused = device == "cuda" or hasattr(torch._C, "_has_mkldnn")  # torch's CPU fused AdamW (>= 2.4)
    flag = {"fused": True} if fused else {"foreach": True}
    label = "fused" if fused else "foreach"
    def ours(**options: object) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
        return lambda p: lowbit_compile(torch.optim.AdamW(p, lr=lr), **options)

    exact = {"master_weights": "exact"}
    out = [
        Contender(f"stock AdamW ({label})", torch.float32, lambda p: torch.optim.AdamW(p, lr=lr, **flag), True),
        Contender("ours (default)", torch.float32, ours()),
        Contender("ours, release_grads", torch.float32, ours(release_grads=True), release=True),
        Contender(f"stock AdamW ({label}), bf16 params", torch.bfloat16,
                  lambda p: torch.optim.AdamW(p, lr=lr, **flag), True),
        Contender("ours, bf16 params", torch.bfloat16, ours()),
        Contender("ours, bf16 params, release_grads", torch.bfloat16, ours(release_grads=True), release=True),
        Contender('ours, bf16 params, master_weights="exact"', torch.bfloat16, ours(**exact)),
        Contender('ours, bf16 params, master_weights="exact", release_grads', torch.bfloat16,
                  ours(**exact, release_grads=True), release=True),
    ]
    try:
        import bitsandbytes as bnb

        out.append(Contender("bitsandbytes AdamW8bit", torch.float32, lambda p: bnb.optim.AdamW8bit(p, lr=lr)))
    except ImportError:
        print("bitsandbytes not importable: its row is left out")
    return out


def build_model(args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=args.seq,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(args.device, dtype)
    model.config.use_cache = False
    return model


def run(c: Contender, args: argparse.Namespace, batches: list[torch.Tensor]) -> dict:
    gc.collect()  # the previous contender's model and optimizer, if a cycle held them
    model = build_model(args, c.param_dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = c.make(params)
    cuda = args.device == "cuda"
    # per measured step: the phases' peaks, the grads alive at backward's, the most alive besides grads in it
    losses, forward, backward, alive, besides = [], [], [], [], []

    def step(x: torch.Tensor, mark: Callable[[], None] = lambda: None) -> None:
        with torch.autocast(args.device, dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        mark()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    def cuda_mark() -> None:
        torch.cuda.synchronize()
        forward.append(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()

    step(batches[0])  # the states exist from here on
    for x in batches[1:]:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step(x, cuda_mark)
            torch.cuda.synchronize()
            backward.append(torch.cuda.max_memory_allocated())
        else:
            gc.collect()
            mode = LiveBytes(lambda: live_grad_bytes(params))
            mode.track_all_live()
            mode.phase("forward")
            with mode:
                step(x, functools.partial(mode.phase, "backward"))
            mode.at_peak = None  # its finalizers outlive it: they must not keep the params alive
            forward.append(mode.phases["forward"][0])
            backward.append(mode.phases["backward"][0])
            alive.append(mode.phases["backward"][1])
            besides.append(mode.phases["backward"][2])
            del mode
    n = sum(p.numel() for p in params)
    states = unique_bytes(state_tensors(opt))
    pbytes = unique_bytes(params)
    worst = max(range(len(backward)), key=backward.__getitem__)
    return {"name": c.name, "param_dtype": str(c.param_dtype).removeprefix("torch."), "params": n,
            "param_bytes": pbytes, "grad_bytes": pbytes, "state_bytes": states, "state_b_per_param": states / n,
            "peak_bytes": max(map(max, zip(forward, backward))), "forward_peak_bytes": max(forward),
            "backward_peak_bytes": backward[worst], "forward_peaks": forward, "backward_peaks": backward,
            "losses": losses, "stock": c.stock, "release": c.release,
            "grads_at_peak_bytes": alive[worst] if alive else None,  # None on CUDA: not measured
            "besides_grads_peak_bytes": max(besides) if besides else None,
            "largest_grad_bytes": max(p.numel() * p.element_size() for p in params)}


def grads_at_peak(row: dict) -> int:
    """The grads alive at the peak of a run's backward and step: measured on CPU, every grad on CUDA (a
    release run's peak then counts them too, so its measured / expected reads the grads it saved)."""
    return row["grads_at_peak_bytes"] if row["grads_at_peak_bytes"] is not None else row["grad_bytes"]


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The flags that shape the Llama and its batches (defaults: 27.4M params, 4 x 256 tokens)."""
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1376)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_model_args(ap)
    ap.add_argument("--steps", type=int, default=3, help="measured steps, after one that creates the states")
    ap.add_argument("--only", default="", help="comma-separated substrings of contender names to run")
    ap.add_argument("--out", default=str(RESULTS / "train_memory.json"))
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device)
               for _ in range(args.steps + 1)]
    rows = []
    for c in contenders(args.device, 1e-4):
        if args.only and not any(s in c.name for s in args.only.split(",")):
            continue
        rows.append(run(c, args, batches))
        r = rows[-1]
        print(f"{r['name']}: peak {r['peak_bytes'] / 1e6:.1f} MB (forward {r['forward_peak_bytes'] / 1e6:.1f}, "
              f"backward and step {r['backward_peak_bytes'] / 1e6:.1f}), states {r['state_b_per_param']:.3f} B/param",
              flush=True)
    for r in rows:
        stock = next((s for s in rows if s["stock"] and s["param_dtype"] == r["param_dtype"]), None)
        if stock is None:
            continue
        # what backward and the step hold besides params, states and grads: stock's, at its peak; with release
        # the peak moves to where backward holds most besides its grads (earlier: more activations left)
        base = stock["param_bytes"] + stock["state_bytes"]
        fwd_bwd = stock["backward_peak_bytes"] - base - grads_at_peak(stock)
        if r["release"] and stock["besides_grads_peak_bytes"] is not None:
            fwd_bwd = stock["besides_grads_peak_bytes"] - base
        r["expected_bytes"] = r["param_bytes"] + grads_at_peak(r) + r["state_bytes"] + fwd_bwd
        r["fwd_bwd_bytes"] = fwd_bwd
        r["ratio_to_expected"] = r["backward_peak_bytes"] / r["expected_bytes"]
        r["b_per_param_outside_activations"] = (r["backward_peak_bytes"] - fwd_bwd) / r["params"]
    head = ("| optimizer | param dtype | states B/param | forward peak MB | backward + step peak MB | grads alive "
            "then MB | expected MB | measured / expected | step peak MB | x stock | B/param outside activations |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        stock = next((s for s in rows if s["stock"] and s["param_dtype"] == "float32"), rows[0])
        at_peak = r["grads_at_peak_bytes"]
        lines.append(f"| {r['name']} | {r['param_dtype']} | {r['state_b_per_param']:.3f} | "
                     f"{r['forward_peak_bytes'] / 1e6:.1f} | {r['backward_peak_bytes'] / 1e6:.1f} | "
                     + (f"{at_peak / 1e6:.1f} | " if at_peak is not None else "- | ")
                     + (f"{r['expected_bytes'] / 1e6:.1f} | {r['ratio_to_expected']:.4f} | " if "expected_bytes" in r
                        else "- | - | ")
                     + f"{r['peak_bytes'] / 1e6:.1f} | {r['peak_bytes'] / stock['peak_bytes']:.3f} | "
                     + (f"{r['b_per_param_outside_activations']:.2f} |" if "expected_bytes" in r else "- |"))
    n = rows[0]["params"]
    print(f"\nLlama {n / 1e6:.1f}M params ({args.layers} layers, hidden {args.hidden}), batch {args.batch} x "
          f"{args.seq} tokens, bf16 autocast, {args.device}; peaks of a step's phases (max over {args.steps} steps)")
    print("\n".join(lines))
    write_results(args, rows, lines, threads=torch.get_num_threads())


def write_results(args: argparse.Namespace, rows: list, lines: list[str], **machine: object) -> None:
    """The run's arguments, machine, rows and printed table as JSON at ``args.out``."""
    out = {"args": vars(args), "machine": {"torch": torch.__version__, "cpu": platform.processor(), **machine},
           "rows": rows, "table": lines}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
