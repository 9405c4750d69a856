"""Helpers shared by several test modules: twin runs against stock (on ``bench/shapes.py``'s parameter
sets), optim_db's inputs, bit views, probe values of the state formats, the C++ prelude's test harness,
the parameter loop of one's own optimizers, checkpoint round trips, and ``python -m lowbit_compile run``
in this process. What the benchmarks share with the tests lives in bench/ (the tests import it; bench
never imports tests)."""

from __future__ import annotations

import ctypes
import io
import logging
import signal
import sys
from collections.abc import Callable

import pytest
import torch
from torch.testing._internal.common_optimizers import optim_db

from bench.shapes import model_params
from lowbit_compile import QuantizedState
from lowbit_compile.cli import main
from lowbit_compile.formats import StateFormat, decode, format_names, registered
from lowbit_compile.formats.dynamic import dynamic_map, dynamic_thresholds
from lowbit_compile.kernels import cpp_printer, cpu_build

# The registry's formats, as the tests list them: every one, those a kernel stores (blockwise and bf16),
# the blockwise ones, the fp8 ones.
FORMATS = list(format_names())
KERNEL_FORMATS = [f.name for f in registered() if not f.passthrough]
BLOCKWISE = [f.name for f in registered() if f.blockwise]
FP8 = [f.name for f in registered() if f.fp8_mantissa is not None]


# -- parameter sets, and twin runs against stock ----------------------------------------------------

def twin_params(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Copies of ``params``, keeping a non-contiguous param's layout."""
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, twin):
        if not p.is_contiguous():
            q.data = p.detach().t().clone().t()
    return twin


def three_groups(params: list[torch.nn.Parameter], kwargs: dict) -> list[dict]:
    """Three groups with different hyperparameters; tensor lr keeps each group's own tensor."""
    other = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items() if k != "betas"}
    if isinstance(other.get("lr"), torch.Tensor):
        other["lr"] = other["lr"] * 3
    else:
        other["lr"] = kwargs.get("lr", 1e-3) * 3
    return [
        {"params": params[:3]},
        {"params": params[3:5], **other, "eps": 1e-6},
        {"params": params[5:], "weight_decay": 0.5},
    ]


def twin_optimizers(cls: type[torch.optim.Optimizer], kwargs: dict, impl_a: dict, impl_b: dict) -> tuple:
    """``model_params`` and their twin, each in ``three_groups`` under its own ``cls(**kwargs, **impl)``:
    (a, b, opt_a, opt_b)."""
    a = model_params()
    b = twin_params(a)
    return a, b, cls(three_groups(a, kwargs), **kwargs, **impl_a), cls(three_groups(b, kwargs), **kwargs, **impl_b)


def step_twins(a: list[torch.nn.Parameter], b: list[torch.nn.Parameter], opt_a: torch.optim.Optimizer,
               opt_b: torch.optim.Optimizer, steps: int) -> None:
    """Steps both optimizers on the same grads; the second param has none every third step."""
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        for i, (p, q) in enumerate(zip(a, b)):
            if i == 1 and step % 3 == 0:  # this param sometimes has no grad
                p.grad = q.grad = None
                continue
            g = torch.randn(p.shape, generator=gen)
            # grads take their param's strides, as autograd's layout contract gives them
            p.grad, q.grad = torch.empty_like(p).copy_(g), torch.empty_like(q).copy_(g)
        opt_a.step()
        opt_b.step()


def optim_db_cases(classes) -> list[tuple[type[torch.optim.Optimizer], dict, str]]:
    """optim_db's CPU float32 inputs for ``classes`` (not capturable or differentiable ones), as
    (class, kwargs, id)."""
    cases = []
    for info in optim_db:
        if info.optim_cls not in classes:
            continue
        for inp in info.optim_inputs_func(device="cpu", dtype=torch.float32):
            kwargs = dict(inp.kwargs)
            if kwargs.get("capturable") or kwargs.get("differentiable"):
                continue
            cases.append((info.optim_cls, kwargs, f"{info.optim_cls.__name__}-{inp.desc}"))
    return cases


def optim_db_params(classes) -> list:
    """``optim_db_cases`` as pytest params of (cls, kwargs)."""
    return [pytest.param(cls, kwargs, id=name) for cls, kwargs, name in optim_db_cases(classes)]


def each_param(update: Callable[[torch.optim.Optimizer, dict, torch.nn.Parameter, dict], None]) -> Callable:
    """The ``step`` of an optimizer of one's own, from its update of one param: ``update(self, group,
    p, state)`` for every param of every group, without grad. A new function each time: the library
    keys what a step reads on the step function, so classes must not share one."""

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                update(self, group, p, self.state[p])

    return step


# -- bits and probe values of the state formats ------------------------------------------------------

CORNER_BLOCK = 64
CORNER_N = CORNER_BLOCK * 6 + 13  # corner_values: six blocks and a partial one


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``t``, so -0.0 vs 0.0 and NaN payloads count as differences."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def corner_values(fmt: StateFormat, dtype: torch.dtype) -> torch.Tensor:
    """Random values over many binades, then one block per rounding corner of ``fmt``."""
    x = torch.randn(CORNER_N, dtype=torch.float64) * torch.exp(torch.randn(CORNER_N, dtype=torch.float64) * 3)
    b = [slice(i * CORNER_BLOCK, (i + 1) * CORNER_BLOCK) for i in range(6)]
    x[b[1]] = 0.0  # an all-zero block: scale 0, patches at offsets 0 and 1
    x[b[2]] = torch.linspace(-1, 1, CORNER_BLOCK, dtype=torch.float64)
    # tied magnitudes: the lowest offsets patched
    x[2 * CORNER_BLOCK + 5] = x[2 * CORNER_BLOCK + 9] = x[2 * CORNER_BLOCK + 30] = -7.0
    x[2 * CORNER_BLOCK + 40] = 7.0
    # block 3: the non-patch absmax equals qmax, so inverse == 1 and codes see the values themselves
    qmax = fmt.qmax if fmt.blockwise else 1.0
    grid = _ties(fmt)
    x[b[3]] = grid[torch.arange(CORNER_BLOCK) % grid.numel()]
    x[3 * CORNER_BLOCK + 1] = x[3 * CORNER_BLOCK + 2] = 1e6  # two patches
    x[3 * CORNER_BLOCK + 3] = qmax
    # block 4: a huge patch over tiny values (the zero-point rule for nonneg states)
    x[b[4]] = torch.rand(CORNER_BLOCK, dtype=torch.float64) * 1e-6
    x[4 * CORNER_BLOCK] = 1e3
    if fmt.nonneg:
        x = x.abs()
    else:
        x[3 * CORNER_BLOCK + 4: 4 * CORNER_BLOCK: 3] *= -1
        x[3 * CORNER_BLOCK + 6] = -0.0
    return x.to(dtype)


def _ties(fmt: StateFormat) -> torch.Tensor:
    """Values (at inverse scale 1) exactly halfway between two codes, and ones just past a binade."""
    if fmt.name == "int8":
        return torch.arange(0, 60, dtype=torch.float64) + 0.5
    if fmt.name == "dynamic8":
        return dynamic_thresholds(fmt.nonneg).double()[::4]
    if fmt.name.startswith("fp8"):
        m = 3 if fmt.name == "fp8_e4m3" else 2
        e = torch.arange(-8, 8, dtype=torch.float64)
        halfway = (1 + 2.0**-(m + 1)) * 2.0**e  # ties to even (down)
        carry = (2 - 2.0**-(m + 2)) * 2.0**e  # rounds up into the next binade
        sub = 2.0 ** (-9 if m == 3 else -16) * torch.tensor([0.5, 1.5, 2.5], dtype=torch.float64)
        return torch.cat([halfway, carry, sub])
    return torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8, 1e-40, 3e-39, 2.0**-133], dtype=torch.float64)


def dynamic8_probes(nonneg: bool, seed: int = 0) -> torch.Tensor:
    """Every fp32 within 64 ulps of every encode threshold and of every map value, 3 * 10^5
    log-uniform magnitudes over 1e-9..2, zeros, saturating and non-finite values; both signs."""
    points = torch.cat([dynamic_thresholds(nonneg), dynamic_map(nonneg).abs()]).view(torch.int32)
    near = torch.cat([points + d for d in range(-64, 65)]).view(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    spread = torch.exp(torch.empty(3 * 10**5).uniform_(-9 * 2.3026, 0.7, generator=gen))
    special = torch.tensor([0.0, 1.0, 1.5, 1e30, float("inf"), 2.0**-149, 1e-38])
    x = torch.cat([near[near >= 0], spread, special])
    return torch.cat([x, -x])


# -- the C++ prelude's element formats, called on whole arrays from Python -------------------------

# dir 0: decode, 1: encode, 2: decode under a block scale (its sign bit set: a flagged block); fmt: the
# format's index in BLOCKWISE; codes as stored (a 4-bit format's two a byte)
FORMATS_HARNESS = r"""
template <int F, bool U> static void run(int dir, float scale, void* codes, float* x, int64_t n) {
  uint8_t* c = (uint8_t*)codes;
  for (int64_t i = 0; i < n; i += LB_W)
    if (dir == 1) lb_st_codes<F>(lb_codes_at<F>(c, i), lb_encode<F, U>(lb_ld(x + i)));
    else if (dir == 0) lb_st(x + i, lb_decode<F, U>(lb_ld_codes<F, U>(lb_codes_at<F>(c, i))));
    else lb_st(x + i, lb_decode_scaled<F, U>(lb_ld_codes<F, U>(lb_codes_at<F>(c, i)), lb_splat(__builtin_fabsf(scale)),
                                             __builtin_signbit(scale)));  // a block's scale, as the kernels
}
extern "C" void convert(int fmt, int nonneg, int dir, float scale, void* codes, float* x, int64_t n) {
  switch (fmt * 2 + nonneg) {
""" + "".join(f"    case {2 * i + u}: run<{f.cpp_name}, {'true' if u else 'false'}>(dir, scale, codes, x, n); break;\n"
              for i, f in enumerate(f for f in registered() if f.blockwise) for u in (0, 1)) + """  }
}
"""


# The prelude's builds: native (AVX-512 here), the generic code at 16 lanes, AVX2, and x86-64 without
# AVX (8 lanes through the generic code, what other architectures compile).
CPU_BUILDS = {"native": (), "16-lanes": ("-DLB_W=16",), "avx2": ("-mno-avx512f",), "x86-64-v2": ("-march=x86-64-v2",)}


def prelude_harness(build: str, source: str = FORMATS_HARNESS) -> ctypes.CDLL:
    """``source`` after the C++ prelude, built with the flags of ``build`` (a key of CPU_BUILDS)."""
    return cpu_build.load(cpp_printer.PRELUDE + source, CPU_BUILDS[build])


def probe_values(fmt: StateFormat) -> torch.Tensor:
    """Dense and random values over the whole code range, every code point and every midpoint
    between neighbours (exact ties), subnormals, and signed zeros."""
    points = decode(torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.code_dtype), fmt)
    points = points[torch.isfinite(points)].unique()
    mids = (points[1:] + points[:-1]) / 2
    if fmt.spec.root_domain:  # its ties are midpoints of the square roots, (c + 1/2)^2
        mids = torch.cat([mids, (torch.arange(256.0) + 0.5) ** 2])
        # and, rounding to the nearest value (sqrt4), the roots near sqrt(c^2 + c + 1/2), whose fp32 square can
        # be that midpoint of c^2 and (c + 1)^2 exactly: 64 ulps either side
        near = torch.sqrt(torch.arange(256.0, dtype=torch.float64) ** 2 + torch.arange(256.0) + 0.5).float()
        ulps = torch.arange(-64, 65, dtype=torch.int32)
        mids = torch.cat([mids, (near.view(torch.int32)[:, None] + ulps).flatten().view(torch.float32)])
    # the float32 neighbours of every tie, and of each power of two from 2^-32 to 2 (dynamic8's
    # encode splits magnitudes into buckets by exponent and top mantissa bits)
    edges = torch.cat([mids, 2.0 ** torch.arange(-32, 2.0)]).view(torch.int32)
    edges = torch.cat([edges + d for d in (-2, -1, 1, 2)]).view(torch.float32)
    x = torch.cat([
        torch.linspace(-fmt.qmax, fmt.qmax, 20011), torch.randn(20000) * fmt.qmax / 8,
        torch.randn(4000) * 1e-3, (torch.rand(2000) * 2 - 1) * 2.0**-12, points, mids, edges, -edges,
        torch.tensor([0.0, -0.0, 2.0**-20, -(2.0**-20), fmt.qmax, -fmt.qmax, 2.5 * fmt.qmax, -2.5 * fmt.qmax,
                      float("inf"), -float("inf"), 2.0**-40, -(2.0**-40)]),
    ])
    if fmt.nonneg:
        x = x.abs()
    return torch.nn.functional.pad(x, (0, -len(x) % 16)).contiguous()


# -- test tiers -------------------------------------------------------------------------------------

def slow_but(params: list, *fast_ids: str) -> list:
    """``params`` (pytest params) with every one whose id is not in ``fast_ids`` marked slow: the fast
    tier (``make test-fast``) keeps a few cases of a large family, the full suite runs them all."""
    missing = set(fast_ids) - {p.id for p in params}
    assert not missing, f"no such cases (renamed?): {sorted(missing)}"
    return [p if p.id in fast_ids else pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.slow])
            for p in params]


# -- checkpoints ------------------------------------------------------------------------------------
def train(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def text(value: str) -> int:
    """How a packed state stores its text fields (format, shape, dtype, row splits): one int each."""
    return int.from_bytes(value.encode(), "little")


def saved_and_loaded(obj: object) -> object:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def state_bits(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor that makes up the states of ``params``, quantized parts included."""
    out = []
    for p in params:
        for value in opt.state[p].values():
            out += list(value.storage_parts) if isinstance(value, QuantizedState) else [value]
    return out


def assert_same(a: object, b: object, where: str = "") -> None:
    """The same structure (lists, dicts) and values, tensors bit for bit (dtype, size and bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.numel() == b.numel(), where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# -- the run command in this process ----------------------------------------------------------------
def run_command(monkeypatch: pytest.MonkeyPatch, *args: str) -> int | str | None:
    """``python -m lowbit_compile run ARGS`` in this process, from the current directory (the trace
    cache is warm, so it is quick): its exit code; argv, sys.path, the logger and SIGUSR2 are put back."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    usr2, log = signal.getsignal(signal.SIGUSR2), logging.getLogger("lowbit_compile")
    handlers, level = list(log.handlers), log.level
    try:
        return main(["run", *args])
    except SystemExit as exit_:
        return exit_.code
    finally:
        signal.signal(signal.SIGUSR2, usr2)
        log.handlers[:], log.level = handlers, level
