"""Why the CPU lowering emits its own C++: the same int8 AdamW step written in torch ops and compiled by
inductor, against lowbit-compile's kernel, on one 8M-element parameter (the issue's naive route).

    python bench/inductor_route.py [--threads 2] [--elements 8388608]

The torch formulation views each state as (-1, block), decodes codes times scale, runs the AdamW
update, and re-quantizes: per block absmax (of the values without their K largest magnitudes, which
become bf16 patches through topk and scatter, when --patches is given), divide, round, clamp, cast.
It prints each route's step time and GB/s of the minimal bytes (about 16 B/param), and what inductor
generated: its C++ kernels and whether they are vectorized, the ops it leaves to eager aten kernels,
and the full-size buffers it writes between kernels.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time

import torch

BLOCK = 2048


def step(p, g, m_codes, m_scale, v_codes, v_scale, lr: float, beta1: float, beta2: float, eps: float, wd: float,
         bc1: float, bc2_sqrt: float, patches: int):
    """One AdamW step on int8 states, in torch ops (the naive formulation inductor receives)."""
    m = m_codes.view(-1, BLOCK).float() * m_scale[:, None]
    v = v_codes.view(-1, BLOCK).float() * v_scale[:, None]
    g2 = g.view(-1, BLOCK)
    m = torch.lerp(m, g2, 1 - beta1)
    v = v * beta2 + (1 - beta2) * g2 * g2
    p2 = p.view(-1, BLOCK) * (1 - lr * wd)
    p.copy_((p2 - (lr / bc1) * m / (v.sqrt() / bc2_sqrt + eps)).view(-1))
    for x, codes, scale, qmax, lo in ((m, m_codes, m_scale, 127.0, -127.0), (v, v_codes, v_scale, 255.0, 0.0)):
        if patches:
            idx = x.abs().topk(patches, dim=1).indices
            x = x.scatter(1, idx, 0.0)
        absmax = x.abs().amax(dim=1)
        inv = torch.where(absmax > 0, qmax / absmax, 0.0)
        scale.copy_(absmax / qmax)
        codes.copy_(torch.round(x * inv[:, None]).clamp(lo, qmax).to(codes.dtype).view(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--elements", type=int, default=8 * 2**20)
    parser.add_argument("--patches", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = args.elements // BLOCK * BLOCK
    code_dir = tempfile.mkdtemp()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", code_dir)

    p, g = torch.randn(n), torch.randn(n)
    m_codes, v_codes = torch.zeros(n, dtype=torch.int8), torch.zeros(n, dtype=torch.uint8)
    m_scale, v_scale = torch.zeros(n // BLOCK), torch.zeros(n // BLOCK)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.01, bc1=0.1, bc2_sqrt=0.0316, patches=args.patches)
    compiled = torch.compile(step, dynamic=False)
    start = time.perf_counter()
    compiled(p, g, m_codes, m_scale, v_codes, v_scale, **hyper)
    compile_s = time.perf_counter() - start
    inductor = _median(lambda: compiled(p, g, m_codes, m_scale, v_codes, v_scale, **hyper), args.rounds)

    from lowbit_compile import lowbit_compile

    q = torch.nn.Parameter(torch.randn(n))
    q.grad = torch.randn(n)
    opt = lowbit_compile(torch.optim.AdamW([q], lr=1e-3, weight_decay=0.01), "int8", outliers=args.patches)
    opt.step()
    ours = _median(opt.step, args.rounds)

    minimal = n * (12 + 2 * (2 + (4 + 4 * args.patches) * 2 / BLOCK))
    print(f"{n} elements, {args.threads} thread(s), {args.patches} patches per block:")
    print(f"  inductor (torch.compile of the torch ops): {inductor * 1e3:.1f} ms, {minimal / inductor / 1e9:.1f} GB/s"
          f" (compile {compile_s:.0f} s)")
    print(f"  lowbit-compile CPU kernel:                 {ours * 1e3:.1f} ms, {minimal / ours / 1e9:.1f} GB/s")
    print(f"  inductor generated {_inspect(code_dir, n)}")


def _median(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _inspect(code_dir: str, n: int) -> str:
    """What inductor generated: its C++ kernels (vectorized or not), the aten ops it left to eager
    kernels (topk), and the full-size fp32 buffers it materializes between kernels."""
    kernels = vectorized = buffers = 0
    fallbacks: set[str] = set()
    for root, _, files in os.walk(code_dir):
        for name in files:
            if not name.endswith(".py"):
                continue
            text = open(os.path.join(root, name), errors="replace").read()
            bodies = re.findall(r"async_compile\.cpp_pybinding\(\[.*?\], r'''(.*?)'''", text, re.S)
            kernels += len(bodies)
            vectorized += sum("at::vec::Vectorized" in b for b in bodies)
            fallbacks |= set(re.findall(r"torch\.ops\.aten\.(\w+)", text))
            buffers += len(re.findall(rf"empty_strided_cpu\(\(({n}|{n // BLOCK}, {BLOCK})", text))
    return (f"{kernels} C++ kernels ({vectorized} vectorized), eager aten ops {sorted(fallbacks) or 'none'}, "
            f"{buffers} full-size intermediate buffers")


if __name__ == "__main__":
    main()
