"""LoRA fine-tuning (peft) with stock AdamW and with low-bit states: the optimizer memory each holds
for the adapters, and the loss each reaches, paired per seed.

    python bench/lora.py                    # ranks 4, 16, 64; seeds 0, 1, 2; 200 steps
    python bench/lora.py --ranks 16 --seeds 0 --steps 50

A 4-layer Llama of width 256 (transformers, built from a config: no download) is first trained on
half of Python's pydoc text with stock AdamW; its adapters (every attention and MLP projection) are
then fine-tuned on the other half. An adapter matrix is rank x width (A) or width x rank (B), so at
width 256 the default ``min_8bit_size`` (4096 elements) keeps rank 4's states fp32 and makes rank 16's
and 64's 8-bit; the override ``{"*lora_*": "sqrt8"}`` makes every adapter 8-bit whatever its size (run
where the default leaves some fp32).
Every contender of a seed starts from the same adapters and sees the same batches. Results go to
bench/results/lora.json and lora.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from bench.tasks import pydoc_text
from lowbit_compile import QuantizedState, lowbit_compile, memory_report

RESULTS = Path(__file__).parent / "results"
WIDTH, LAYERS, CTX, BATCH = 256, 4, 64, 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STOCK, DEFAULT, OVERRIDE = "fp32 (stock AdamW)", "lowbit default", "lowbit, overrides={'*lora_*': 'sqrt8'}"
CONTENDERS = {STOCK: None, DEFAULT: {}, OVERRIDE: {"overrides": {"*lora_*": "sqrt8"}}}  # lowbit_compile options


class Text:
    """Characters of one text as token ids, split into training and held-out windows."""

    def __init__(self, text: str, chars: list[str]) -> None:
        lookup = {c: i for i, c in enumerate(chars)}
        data = torch.tensor([lookup[c] for c in text])
        split = int(0.9 * len(data))
        self.train, self.val = data[:split], data[split:]
        starts = torch.linspace(0, len(self.val) - CTX - 2, 64).long()
        self.val_ids = torch.stack([self.val[s: s + CTX + 1] for s in starts])

    def batch(self, gen: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, len(self.train) - CTX - 1, (BATCH,), generator=gen)
        return self.train[starts[:, None] + torch.arange(CTX + 1)]


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


@torch.no_grad()
def val_loss(model: torch.nn.Module, text: Text) -> float:
    return statistics.mean(loss_of(model, ids).item() for ids in text.val_ids.split(32))


def base_model(vocab: int, pretrain: Text, steps: int) -> dict[str, torch.Tensor]:
    """The base weights: a Llama of width WIDTH trained ``steps`` steps on ``pretrain`` (stock AdamW)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=WIDTH, intermediate_size=688,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=CTX)
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        loss_of(model, pretrain.batch(gen)).backward()
        opt.step()
        opt.zero_grad()
    return {"config": config, "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def fine_tune(base: dict, text: Text, rank: int, options: dict | None, seed: int, steps: int, lr: float) -> dict:
    """LoRA on every projection of ``base``: AdamW over the adapters, wrapped with ``options`` unless None."""
    import peft
    import transformers

    model = transformers.LlamaForCausalLM(base["config"])
    model.load_state_dict(base["weights"])
    torch.manual_seed(seed)
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                       target_modules=TARGETS))
    adapters = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(adapters, lr=lr, weight_decay=0.0)
    if options is not None:
        opt = lowbit_compile(opt, **options, model=model)
    gen = torch.Generator().manual_seed(1000 + seed)
    start = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20)
        loss_of(model, text.batch(gen)).backward()
        opt.step()
        opt.zero_grad()
    seconds = time.perf_counter() - start
    report = memory_report(opt)
    moments = sum(report.per_state[k].bytes for k in ("exp_avg", "exp_avg_sq"))
    low_bit = sum(p.numel() for p in adapters if isinstance(opt.state[p]["exp_avg"], QuantizedState))
    n = sum(p.numel() for p in adapters)
    return {"adapter_params": n, "low_bit_share": low_bit / n, "moment_bytes": moments,
            "moment_bytes_per_param": moments / n, "val_loss": val_loss(model, text), "seconds": seconds}


def table(results: dict, ranks: list[int], seeds: list[int]) -> str:
    lines = ["| rank | optimizer states | adapter params | 8-bit share | m + v B/param | m + v held | val loss | "
             "gap to fp32 (paired) |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for rank in ranks:
        stock = [results[str(rank)][STOCK][str(s)]["val_loss"] for s in seeds]
        for name in results[str(rank)]:
            runs = [results[str(rank)][name][str(s)] for s in seeds]
            losses = [r["val_loss"] for r in runs]
            gaps = [(a - b) / b for a, b in zip(losses, stock)]
            gap = "–" if CONTENDERS[name] is None else \
                f"{statistics.mean(gaps):+.2%}" + (f" ± {statistics.stdev(gaps):.2%}" if len(gaps) > 1 else "")
            r = runs[0]
            lines.append(f"| {rank} | {name} | {r['adapter_params']:,} | {r['low_bit_share']:.0%} | "
                         f"{r['moment_bytes_per_param']:.3f} | {r['moment_bytes'] / 2**10:,.0f} KiB | "
                         f"{statistics.mean(losses):.4f} | {gap} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lr", type=float, default=1e-3, help="peak lr (20 warmup steps), lora_alpha = 2 x rank")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=RESULTS / "lora.json")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from pydoc_data.topics import topics

    keys = sorted(topics)
    halves = ["".join(topics[k] for k in keys[: len(keys) // 2]), "".join(topics[k] for k in keys[len(keys) // 2:])]
    chars = sorted(set(pydoc_text()))
    pretrain, finetune = Text(halves[0], chars), Text(halves[1], chars)
    start = time.perf_counter()
    base = base_model(len(chars), pretrain, args.pretrain_steps)
    print(f"base: width {WIDTH}, {LAYERS} layers, {args.pretrain_steps} steps on half of pydoc's text "
          f"({time.perf_counter() - start:.0f} s); val loss on the other half {val_loss_of_base(base, finetune):.4f}")
    results: dict = {}
    for rank in args.ranks:
        for name, options in CONTENDERS.items():
            if name == OVERRIDE and min(r["low_bit_share"] for r in results[str(rank)][DEFAULT].values()) == 1:
                continue  # the default already holds every adapter in 8 bits
            for seed in args.seeds:
                run = fine_tune(base, finetune, rank, options, seed, args.steps, args.lr)
                results.setdefault(str(rank), {}).setdefault(name, {})[str(seed)] = run
                print(f"  rank {rank:>3} {name:<40} seed {seed}: val loss {run['val_loss']:.4f}, m + v "
                      f"{run['moment_bytes_per_param']:.3f} B/param ({run['seconds']:.0f} s)", flush=True)
    text = table(results, args.ranks, args.seeds)
    print("\n" + text)
    meta = {"width": WIDTH, "layers": LAYERS, "targets": TARGETS, "steps": args.steps, "lr": args.lr,
            "pretrain_steps": args.pretrain_steps, "seeds": args.seeds, "torch": torch.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(
        f"# LoRA fine-tuning: adapter optimizer states\n\n`python bench/lora.py` "
        f"(ranks {', '.join(map(str, args.ranks))}; seeds {', '.join(map(str, args.seeds))}; {args.steps} steps; "
        f"peak lr {args.lr}; torch {torch.__version__}). A {LAYERS}-layer "
        f"Llama of width {WIDTH} pretrained {args.pretrain_steps} steps on half of pydoc's text, its adapters on "
        f"every projection fine-tuned on the other half. m + v: the bytes `exp_avg` and `exp_avg_sq` hold over "
        f"the adapter params; 8-bit share: of the adapter params, those whose states are 8-bit.\n\n{text}\n")
    print(f"\nwrote {args.out} and {args.out.with_suffix('.md')}")


def val_loss_of_base(base: dict, text: Text) -> float:
    import transformers

    model = transformers.LlamaForCausalLM(base["config"])
    model.load_state_dict(base["weights"])
    return val_loss(model, text)


if __name__ == "__main__":
    main()
