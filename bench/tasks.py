"""The three CPU-sized training tasks of the quality evidence, and the one training loop they share.

``examples/train.py`` runs one task with one optimizer; ``bench/quality.py`` runs all of them with
every state format and the peer 8-bit optimizers. Each task fixes its data, model, step count and
AdamW hyperparameters (the learning rate is the best of three, 3x apart, for fp32 AdamW), so every
optimizer sees the same initial weights and the same batches for a given seed and only the
optimizer differs:

* ``char_gpt``: a character-level GPT (0.36M parameters: what 2 busy CPU cores train ~60 times in
  half an hour) on the English text that ships with Python
  (``pydoc_data.topics``), the last 10% held out for validation.
* ``digits``: an MLP on scikit-learn's 8x8 handwritten digits, 30% held out, accuracy reported.
* ``zipf``: the stress case. An embedding table whose rows are used with Zipf-distributed
  frequencies (token ids shuffled, so every quantization block mixes frequent and rare rows): a
  few rows get large gradients every step, most get rare, small ones, and a linear 8-bit grid
  scaled by a block's absmax flushes them. The label of a bag of tokens is a fixed random
  function of the tokens' hidden teacher vectors, so validation loss falls only as far as the rare
  rows are learned.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Hyper:
    """What the training loop needs from a task: length, AdamW settings, evaluation cadence."""

    steps: int
    lr: float
    weight_decay: float
    warmup: int
    eval_every: int
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip: float | None = None  # max global gradient norm


class Task:
    """One training problem: data, model, loss. Subclasses fill in the four methods."""

    name: str
    hyper: Hyper
    metric: str | None = None  # a second validation metric (higher is better), if any

    def model(self, seed: int) -> nn.Module:
        raise NotImplementedError

    def batch(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """One training batch drawn with ``gen`` (the same sequence for every optimizer)."""
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Validation ``loss`` (and ``self.metric`` where the task has one) on held-out data."""
        raise NotImplementedError


# character-level GPT -------------------------------------------------------------------------------
def pydoc_text() -> str:
    """The help-topic text of the standard library's ``pydoc_data`` (~465k characters of English)."""
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics))


def docstring_text() -> str:
    """English prose the installed packages ship: the docstrings of the standard library, numpy and
    scikit-learn in printable ASCII (~6.7M characters, more than 2,000 steps of 2,048 characters
    read), in a fixed order."""
    import ast
    import importlib.util
    import string
    import sysconfig
    from pathlib import Path

    roots = [Path(sysconfig.get_paths()["stdlib"])]
    roots += [Path(importlib.util.find_spec(m).origin).parent for m in ("numpy", "sklearn")]
    parts = []
    for root in roots:
        for f in sorted(root.rglob("*.py")):
            if {"test", "tests", "site-packages", "_vendor"} & set(f.relative_to(root).parts):
                continue
            try:
                tree = ast.parse(f.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            parts += [d for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and (d := ast.get_docstring(node))]
    keep = set(string.printable) - set("\r\x0b\x0c")
    return "".join(c for c in "\n\n".join(parts) if c in keep)


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, ctx: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # GPT-2 init: N(0, 0.02), residual projections scaled down by depth
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos.weight[: idx.shape[1]]
        return self.head(self.ln(self.blocks(x)))


class CharGPT(Task):
    name = "char_gpt"

    def __init__(self, d: int = 96, layers: int = 3, heads: int = 4, ctx: int = 64, batch: int = 8,
                 hyper: Hyper | None = None, val_windows: int = 128, text: str | None = None) -> None:
        text = pydoc_text() if text is None else text
        chars = sorted(set(text))
        self.vocab = len(chars)
        lookup = {c: i for i, c in enumerate(chars)}
        data = torch.tensor([lookup[c] for c in text], dtype=torch.long)
        split = int(0.9 * len(data))
        self.train_data, self.val_data = data[:split], data[split:]
        self.d, self.layers, self.heads, self.ctx, self.batch_size = d, layers, heads, ctx, batch
        self.hyper = hyper or Hyper(steps=150, lr=2e-3, weight_decay=0.1, warmup=15, eval_every=30, clip=1.0)
        # a fixed validation set: evenly spaced windows over the held-out text
        starts = torch.linspace(0, len(self.val_data) - ctx - 2, val_windows).long()
        self.val_x = torch.stack([self.val_data[s: s + ctx] for s in starts])
        self.val_y = torch.stack([self.val_data[s + 1: s + ctx + 1] for s in starts])

    def model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return GPT(self.vocab, self.ctx, self.d, self.layers, self.heads)

    def batch(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.train_data) - self.ctx - 1, (self.batch_size,), generator=gen)
        offsets = torch.arange(self.ctx)
        x = self.train_data[starts[:, None] + offsets]
        y = self.train_data[starts[:, None] + offsets + 1]
        return x, y

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        losses = [self.loss(model, (x, y)).item() for x, y in zip(self.val_x.split(64), self.val_y.split(64))]
        return {"loss": sum(losses) / len(losses)}


class Classification(Task):
    """A task scored by cross-entropy and accuracy on the held-out ``val_x``, ``val_y``."""

    metric = "acc"
    val_x: torch.Tensor
    val_y: torch.Tensor

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        logits = model(self.val_x)
        return {"loss": F.cross_entropy(logits, self.val_y).item(),
                "acc": (logits.argmax(1) == self.val_y).float().mean().item()}


# digits classifier ---------------------------------------------------------------------------------
class Digits(Classification):
    name = "digits"

    def __init__(self, hidden: int = 256, batch: int = 64, hyper: Hyper | None = None) -> None:
        from sklearn.datasets import load_digits

        data = load_digits()
        x = torch.tensor(data.data, dtype=torch.float32) / 16.0
        y = torch.tensor(data.target, dtype=torch.long)
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))  # one fixed split
        n_val = int(0.3 * len(y))
        self.val_x, self.val_y = x[perm[:n_val]], y[perm[:n_val]]
        self.train_x, self.train_y = x[perm[n_val:]], y[perm[n_val:]]
        mean, std = self.train_x.mean(0), self.train_x.std(0) + 0.1
        self.train_x, self.val_x = (self.train_x - mean) / std, (self.val_x - mean) / std
        self.hidden, self.batch_size = hidden, batch
        self.hyper = hyper or Hyper(steps=300, lr=3e-3, weight_decay=0.01, warmup=20, eval_every=25)

    def model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        h = self.hidden
        return nn.Sequential(nn.Linear(64, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, 10))

    def batch(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(self.train_y), (self.batch_size,), generator=gen)
        return self.train_x[idx], self.train_y[idx]


# Zipf embedding stress case ------------------------------------------------------------------------
class BagModel(nn.Module):
    """Mean of the bag's token embeddings, then a small MLP to class logits."""

    def __init__(self, vocab: int, d: int, classes: int) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, d, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(d, 128), nn.GELU(), nn.Linear(128, classes))
        nn.init.normal_(self.emb.weight, std=0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(tokens))


class ZipfEmbedding(Classification):
    name = "zipf"

    def __init__(self, vocab: int = 8192, d: int = 32, classes: int = 16, bag: int = 8, exponent: float = 1.1,
                 batch: int = 256, hyper: Hyper | None = None, val_bags: int = 8192) -> None:
        gen = torch.Generator().manual_seed(1234)  # the problem itself is fixed; seeds vary the model
        ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
        by_rank = ranks.pow(-exponent)
        # token id -> probability; ids are a random permutation of frequency ranks
        self.probs = torch.empty(vocab, dtype=torch.float64)
        self.probs[torch.randperm(vocab, generator=gen)] = by_rank / by_rank.sum()
        teacher = torch.randn(vocab, 16, generator=gen)
        readout = torch.randn(16, classes, generator=gen)
        self.teacher_logits = teacher @ readout
        self.vocab, self.d, self.classes, self.bag, self.batch_size = vocab, d, classes, bag, batch
        self.hyper = hyper or Hyper(steps=300, lr=3e-2, weight_decay=0.0, warmup=20, eval_every=25)
        self.val_x, self.val_y = self._sample(val_bags, torch.Generator().manual_seed(4321))

    def _sample(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.multinomial(self.probs, n * self.bag, replacement=True, generator=gen).view(n, self.bag)
        return tokens, self.teacher_logits[tokens].mean(1).argmax(1)

    def model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return BagModel(self.vocab, self.d, self.classes)

    def batch(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sample(self.batch_size, gen)


def char_gpt_2m(text: str | None = None) -> CharGPT:
    """The character-level GPT at 1.8M params (4 layers of width 192, 128-character context): what a
    few minutes on one core train, 250 steps of 2048 characters (of ``text``, the pydoc topics if None)."""
    task = CharGPT(d=192, layers=4, heads=6, ctx=128, batch=16, val_windows=256, text=text,
                   hyper=Hyper(steps=250, lr=2e-3, weight_decay=0.1, warmup=25, eval_every=50, clip=1.0))
    task.name = "char_gpt_2m"
    return task


# DiT-style diffusion on digits --------------------------------------------------------------------
def timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of integer timesteps (DDPM / DiT), ``dim`` of them per timestep."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, dtype=torch.float32) / half)
    angles = t.float()[:, None] * freqs
    return torch.cat([angles.cos(), angles.sin()], dim=1)


class AdaLNBlock(nn.Module):
    """A DiT block (Peebles & Xie 2023, adaLN-Zero): attention and MLP, each behind a LayerNorm whose
    shift, scale and output gate are regressed from the conditioning; the gates start at 0, so every
    block starts as the identity."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.ada = nn.Linear(d, 6 * d)
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(F.silu(c))[:, None].chunk(6, dim=2)
        b, t, d = x.shape
        h = self.norm1(x) * (1 + scale1) + shift1
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + gate1 * self.proj(y.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.fc2(F.gelu(self.fc1(h), approximate="tanh"))


class DiT(nn.Module):
    """A class-conditional diffusion transformer: the image cut into ``patch`` x ``patch`` patches (one
    token each, learned positions), conditioning = an MLP of the timestep's sinusoidal features plus
    a label embedding, adaLN-Zero blocks, and a zero-initialized linear read-out of each patch's noise."""

    def __init__(self, image: int = 8, patch: int = 2, d: int = 64, layers: int = 4, heads: int = 4,
                 classes: int = 10) -> None:
        super().__init__()
        self.image, self.patch, self.d = image, patch, d
        tokens = (image // patch) ** 2
        self.embed = nn.Linear(patch * patch, d)
        self.pos = nn.Parameter(0.02 * torch.randn(tokens, d))
        self.t_mlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.label = nn.Embedding(classes, d)
        self.blocks = nn.ModuleList(AdaLNBlock(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.final_ada, self.out = nn.Linear(d, 2 * d), nn.Linear(d, patch * patch)
        for layer in (self.final_ada, self.out):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, p, g = x.shape[0], self.patch, self.image // self.patch
        patches = x.view(b, g, p, g, p).permute(0, 1, 3, 2, 4).reshape(b, g * g, p * p)
        h = self.embed(patches) + self.pos
        c = self.t_mlp(timestep_features(t, self.d)) + self.label(y)
        for block in self.blocks:
            h = block(h, c)
        shift, scale = self.final_ada(F.silu(c))[:, None].chunk(2, dim=2)
        out = self.out(self.norm(h) * (1 + scale) + shift)
        return out.view(b, g, g, p, p).permute(0, 1, 3, 2, 4).reshape(b, self.image, self.image)


class DiffusionDigits(Task):
    """DDPM (Ho et al. 2020: 1000 steps, linear betas 1e-4..0.02, epsilon objective) with a small DiT
    on scikit-learn's 8x8 digits scaled to [-1, 1], 30% held out.

    ``timesteps_per_batch`` noise levels are drawn per step, each shared by an equal slice of the
    batch. The default, 1, is the regime of the reports of 8-bit states failing on diffusion models
    (batch-size-1 fine-tuning): every step's gradient comes from one noise level, so its size swings
    with the timestep. ``timesteps_per_batch=batch`` is DDPM's per-image draw, which averages it out.
    Validation is the denoising loss over a fixed set of held-out images, timesteps and noises:
    overall and per third of the timesteps (``loss_low``: t < 333, little noise; ``loss_high``: t >= 666).
    """

    T = 1000
    BANDS = {"loss_low": (0, 333), "loss_mid": (333, 666), "loss_high": (666, 1000)}

    def __init__(self, d: int = 64, layers: int = 4, heads: int = 4, batch: int = 16, timesteps_per_batch: int = 1,
                 hyper: Hyper | None = None, val_images: int = 128, val_timesteps: int = 4) -> None:
        from sklearn.datasets import load_digits

        if batch % timesteps_per_batch:
            raise ValueError(f"timesteps_per_batch={timesteps_per_batch} must divide batch={batch}")
        data = load_digits()
        x = torch.tensor(data.images, dtype=torch.float32) / 8.0 - 1.0  # pixels 0..16 -> [-1, 1]
        y = torch.tensor(data.target, dtype=torch.long)
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))  # the split of ``Digits``
        n_val = int(0.3 * len(y))
        self.val_images, self.val_labels = x[perm[:n_val]], y[perm[:n_val]]
        self.train_x, self.train_y = x[perm[n_val:]], y[perm[n_val:]]
        self.d, self.layers, self.heads = d, layers, heads
        self.batch_size, self.timesteps_per_batch = batch, timesteps_per_batch
        self.hyper = hyper or Hyper(steps=2000, lr=3e-3, weight_decay=0.0, warmup=100, eval_every=100)
        betas = torch.linspace(1e-4, 0.02, self.T, dtype=torch.float64)
        self.alpha_bar = torch.cumprod(1 - betas, 0).float()
        # the fixed validation set: val_timesteps evenly spaced timesteps in each band, for every image
        gen = torch.Generator().manual_seed(4321)
        ts = [lo + (hi - lo) * (i + 0.5) / val_timesteps
              for lo, hi in self.BANDS.values() for i in range(val_timesteps)]
        n = min(val_images, n_val)
        self.val_t = torch.tensor(ts).long().repeat_interleave(n)
        self.val_x0 = self.val_images[:n].repeat(len(ts), 1, 1)
        self.val_y = self.val_labels[:n].repeat(len(ts))
        self.val_noise = torch.randn(self.val_x0.shape, generator=gen)

    def model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return DiT(d=self.d, layers=self.layers, heads=self.heads)

    def batch(self, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        """Images, labels, timesteps and noise."""
        idx = torch.randint(0, len(self.train_y), (self.batch_size,), generator=gen)
        t = torch.randint(0, self.T, (self.timesteps_per_batch,), generator=gen)
        t = t.repeat_interleave(self.batch_size // self.timesteps_per_batch)
        noise = torch.randn((self.batch_size, 8, 8), generator=gen)
        return self.train_x[idx], self.train_y[idx], t, noise

    def noisy(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """x_t = sqrt(alpha_bar_t) x_0 + sqrt(1 - alpha_bar_t) noise."""
        ab = self.alpha_bar[t][:, None, None]
        return ab.sqrt() * x0 + (1 - ab).sqrt() * noise

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x0, y, t, noise = batch
        return F.mse_loss(model(self.noisy(x0, t, noise), t, y), noise)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        per_image = []
        for x0, y, t, noise in zip(*(v.split(512) for v in (self.val_x0, self.val_y, self.val_t, self.val_noise))):
            per_image.append((model(self.noisy(x0, t, noise), t, y) - noise).pow(2).mean((1, 2)))
        errors = torch.cat(per_image)
        out = {"loss": errors.mean().item()}
        for band, (lo, hi) in self.BANDS.items():
            out[band] = errors[(self.val_t >= lo) & (self.val_t < hi)].mean().item()
        return out

    @torch.no_grad()
    def sample(self, model: nn.Module, labels: torch.Tensor, gen: torch.Generator, steps: int = 50) -> torch.Tensor:
        """Images of the given labels by DDIM (eta = 0, ``steps`` evenly spaced timesteps) from noise
        drawn with ``gen``, clamped to [-1, 1]."""
        x = torch.randn((len(labels), 8, 8), generator=gen)
        ts = torch.linspace(self.T - 1, 0, steps).round().long()
        for i, t in enumerate(ts):
            ab = self.alpha_bar[t]
            ab_next = self.alpha_bar[ts[i + 1]] if i + 1 < steps else torch.tensor(1.0)
            eps = model(x, t.repeat(len(labels)), labels)
            x0 = ((x - (1 - ab).sqrt() * eps) / ab.sqrt()).clamp(-1, 1)
            eps = (x - ab.sqrt() * x0) / (1 - ab).sqrt()  # the noise consistent with the clamped x_0
            x = ab_next.sqrt() * x0 + (1 - ab_next).sqrt() * eps
        return x.clamp(-1, 1)


TASKS: dict[str, Callable[[], Task]] = {"char_gpt": CharGPT, "char_gpt_2m": char_gpt_2m, "digits": Digits,
                                        "zipf": ZipfEmbedding, "dit_digits": DiffusionDigits}


# the shared training loop --------------------------------------------------------------------------
@dataclass
class History:
    """What one run produced: the training loss of every step and the validation curve."""

    train_loss: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def final(self) -> dict[str, float]:
        return self.val[-1]


def lr_at(step: int, hyper: Hyper) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < hyper.warmup:
        return hyper.lr * (step + 1) / hyper.warmup
    progress = (step - hyper.warmup) / max(1, hyper.steps - hyper.warmup)
    return hyper.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate; a tensor lr (torchao keeps one) is filled in place."""
    for group in opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def train(task: Task, make_optimizer: Callable[[list[nn.Parameter], Hyper], torch.optim.Optimizer], seed: int,
          steps: int | None = None, on_step: Callable[[int, float], None] | None = None,
          param_dtype: torch.dtype = torch.float32) -> History:
    """Train ``task``'s model from seed ``seed`` with the optimizer ``make_optimizer(params, hyper)``
    builds; the data order depends on ``seed`` only. Evaluates every ``eval_every`` steps and at the end.
    ``param_dtype`` bf16/fp16 trains the model's params in that dtype (``LowPrecision``)."""
    import time

    hyper = task.hyper if steps is None else replace(task.hyper, steps=steps)
    steps = hyper.steps
    model = task.model(seed)
    if param_dtype != torch.float32:
        model = LowPrecision(model, param_dtype)
    opt = make_optimizer(list(model.parameters()), hyper)
    gen = torch.Generator().manual_seed(10_000 + seed)
    hist = History()
    start = time.perf_counter()
    for step in range(steps):
        set_lr(opt, lr_at(step, hyper))
        loss = task.loss(model, task.batch(gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if hyper.clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), hyper.clip)
        opt.step()
        hist.train_loss.append(loss.item())
        if (step + 1) % hyper.eval_every == 0 or step + 1 == steps:
            model.eval()
            hist.val_steps.append(step + 1)
            hist.val.append(task.evaluate(model))
            model.train()
        if on_step is not None:
            on_step(step, hist.train_loss[-1])
    hist.seconds = time.perf_counter() - start
    return hist


# optimizers by name --------------------------------------------------------------------------------
PEERS = {
    "bnb-AdamW8bit": ("bitsandbytes.optim", "AdamW8bit"),
    "ao-AdamW8bit": ("torchao.optim", "AdamW8bit"),
    "ao-AdamWFp8": ("torchao.optim", "AdamWFp8"),
    "ao-AdamW4bit": ("torchao.optim", "AdamW4bit"),
}


def torchao_eager() -> None:
    """Make torchao's optimizers run their step eagerly in this process. They ``torch.compile`` the
    step once per parameter shape, which on a busy 2-core CPU costs about a minute per shape and
    optimizer class; the quantization code that runs is the same."""
    import types

    import torchao.optim.adam as ao_adam

    if getattr(ao_adam.torch, "compile", None) is torch.compile:
        eager = types.ModuleType("torch")
        eager.__dict__.update(torch.__dict__)
        eager.compile = lambda fn, **kwargs: fn
        ao_adam.torch = eager


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer by name: ``fp32`` (stock AdamW), one of ours such as ``int8`` or ``int8-b256-k0``
    (format, then optional ``-b<block_size>`` and ``-k<outliers>``; ``fp8_e4m3/dynamic8`` gives the
    first moment one format and the second moments another), or a peer from ``PEERS``.
    ``compile_peers=False`` runs torchao eagerly (see ``torchao_eager``); ``backend`` and ``rounding`` (the
    ``rounding=`` option) are ours."""

    name: str
    compile_peers: bool = False
    backend: str = "auto"
    rounding: str | None = None  # None: the library's default

    @property
    def kind(self) -> str:
        if self.name == "fp32":
            return "fp32"
        if master_spec(self.name) is not None:
            return "bf16 params"
        return "peer" if self.name in PEERS else "ours"

    @property
    def param_dtype(self) -> torch.dtype:
        """bf16 for the ``bf16p-`` names (see ``master_spec``), fp32 otherwise."""
        return torch.bfloat16 if self.kind == "bf16 params" else torch.float32

    def lowbit_options(self) -> dict:
        """``lowbit_compile`` keyword arguments of one of ours (defaults left out)."""
        spec = master_spec(self.name)
        if spec is not None:
            _, ours, mode = spec
            options = OptimizerSpec(ours).lowbit_options() if ours else {}
            return {**options, **({"master_weights": mode} if mode else {})}
        fmt, *opts = self.name.split("-")
        if "/" in fmt:
            m, v = fmt.split("/")
            fmt = {"exp_avg": m, "exp_avg_sq": v, "max_exp_avg_sq": v}
        out: dict = {"fmt": fmt}
        for opt in opts:
            key = {"b": "block_size", "k": "outliers"}.get(opt[:1])
            if key is None or not opt[1:].isdigit():
                raise ValueError(f"bad option {opt!r} in optimizer {self.name!r}; expected -b<int> or -k<int>")
            out[key] = int(opt[1:])
        return out

    def build(self, params: list[nn.Parameter], hyper: Hyper) -> torch.optim.Optimizer:
        kwargs = {"lr": hyper.lr, "betas": hyper.betas, "eps": hyper.eps, "weight_decay": hyper.weight_decay}
        if self.kind == "peer":
            import importlib

            module, cls = PEERS[self.name]
            if module.startswith("torchao") and not self.compile_peers:
                torchao_eager()
            return getattr(importlib.import_module(module), cls)(params, **kwargs)
        from lowbit_compile import lowbit_compile

        spec = master_spec(self.name)
        if spec is not None and spec[0] in ("adamw", "master"):
            kind, ours, _ = spec
            if kind == "adamw":
                return torch.optim.AdamW(params, **kwargs)
            options = OptimizerSpec(ours).lowbit_options() if ours else None
            return FP32MasterCopy(params, lambda copies: torch.optim.AdamW(copies, **kwargs) if options is None
                                  else lowbit_compile(torch.optim.AdamW(copies, **kwargs), **options,
                                                      backend=self.backend))
        opt = torch.optim.AdamW(params, **kwargs)
        if self.kind == "fp32":
            return opt

        rounding = {} if self.rounding is None else {"rounding": self.rounding}
        return lowbit_compile(opt, **self.lowbit_options(), backend=self.backend, **rounding)


# 16-bit params and fp32 master weights (bench/quality.py's master grid) ---------------------------------
class LowPrecision(nn.Module):
    """A task's model with its params in ``dtype``: float inputs cast to it, outputs back to fp32 (the loss
    and the metrics are computed in fp32, as mixed-precision training does)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.model = model.to(dtype)
        self.dtype = dtype

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        args = tuple(a.to(self.dtype) if a.is_floating_point() else a for a in args)
        return self.model(*args).float()


class FP32MasterCopy:
    """The fp32 master recipe around any optimizer: fp32 copies of the 16-bit params, stepped by
    ``make(copies)`` on the 16-bit grads cast to fp32, the params refreshed from them after each step
    (``param.copy_(master)``). ``state`` shows each copy's states and the copy itself (its bytes)."""

    def __init__(self, params: list[nn.Parameter], make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.params = list(params)
        self.masters = [nn.Parameter(p.detach().float()) for p in self.params]
        self.inner = make(self.masters)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        return {p: {**self.inner.state.get(m, {}), "master": m} for p, m in zip(self.params, self.masters)}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)


class DigitsFinetune(Digits):
    """Fine-tuning below the bf16 spacing of the weights: the ``digits`` MLP pretrained in fp32 (AdamW,
    300 steps at 3e-3 on the digits as they are), then fine-tuned at lr 3e-5 on the digits transposed
    (the same labels, a new layout of the inputs). Adam moves each weight by about lr a step, 1/4 to
    1/16 of half the bf16 spacing of most weights (0.03-0.2: half spacings of 2**-13 to 2**-11), so
    bf16 params without an fp32 master keep little of what fp32 learns."""

    name = "digits_ft"

    def __init__(self, hidden: int = 256, pretrain_steps: int = 300) -> None:
        super().__init__(hidden=hidden, hyper=Hyper(steps=600, lr=3e-5, weight_decay=0.0, warmup=20, eval_every=50))
        self.pre_x, self.pre_y, self.pretrain_steps = self.train_x, self.train_y, pretrain_steps
        transpose = (lambda x: x.view(-1, 8, 8).transpose(1, 2).reshape(-1, 64))
        self.train_x, self.val_x = transpose(self.train_x), transpose(self.val_x)
        self._pretrained: dict[int, dict] = {}

    def model(self, seed: int) -> nn.Module:
        if seed not in self._pretrained:
            model = super().model(seed)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
            gen = torch.Generator().manual_seed(20_000 + seed)
            for _ in range(self.pretrain_steps):
                idx = torch.randint(0, len(self.pre_y), (self.batch_size,), generator=gen)
                loss = F.cross_entropy(model(self.pre_x[idx]), self.pre_y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            self._pretrained[seed] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model = super().model(seed)
        model.load_state_dict(self._pretrained[seed])
        return model


TASKS["digits_ft"] = DigitsFinetune


def master_spec(name: str) -> tuple[str, str | None, str | None] | None:
    """``bf16p-<kind>[-<ours>]``: bf16 params stepped by stock AdamW (``adamw``), by the fp32 master recipe
    (``master``: stock AdamW on the copies, or ``master-<ours>``: ours on them), by ours with master
    weights (``exact[-<ours>]``, ``8bit[-<ours>]``), or by ours without (``<ours>``), ``<ours>`` an
    optimizer name of ours (the default format when left out). Returns (kind, ours, master_weights)."""
    if not name.startswith("bf16p-"):
        return None
    kind, _, rest = name.removeprefix("bf16p-").partition("-")
    if kind in ("adamw", "master"):
        return kind, rest or None, None
    if kind in ("exact", "8bit"):
        return "ours", rest or None, kind
    return "ours", name.removeprefix("bf16p-"), None
