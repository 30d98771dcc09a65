"""Micro-benchmarks behind two CPU choices in aiayn.model (numbers quoted in attention.py, layers.py
and BENCHMARKS.md): attention forward+backward, fused ``F.scaled_dot_product_attention`` vs the explicit
matmul + softmax path, and dropout mask draws, ``bernoulli_`` vs ``rand_like``.

    python -m benchmarks.cpu_kernels                 # default thread setting
    python -m benchmarks.cpu_kernels --set-threads 2 # after an explicit torch.set_num_threads(2)
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = [(227, 4, 9, 32), (150, 4, 25, 64), (64, 4, 64, 64), (32, 4, 128, 64), (8, 4, 512, 64)]


def bench(fn, n: int = 20) -> float:
    """Mean milliseconds of ``fn()`` after 3 warm-up calls."""
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set-threads", type=int, default=None, help="call torch.set_num_threads(N) first")
    args = p.parse_args()
    if args.set_threads:
        torch.set_num_threads(args.set_threads)
    print(f"threads {torch.get_num_threads()} (set explicitly: {bool(args.set_threads)})")
    from aiayn.model.attention import scaled_dot_product_attention

    for B, H, T, K in SHAPES:
        q, k, v = (torch.randn(B, H, T, K, requires_grad=True) for _ in range(3))
        g = torch.randn(B, H, T, K)
        row = []
        for causal in (False, True):
            lengths = torch.randint(1, T + 1, (B,))
            mask = None if causal else (torch.arange(T)[None, :] < lengths[:, None])[:, None, None]
            times = {}
            for name in ("fused", "explicit"):
                times[name] = bench(lambda q=q, k=k, v=v, m=mask, c=causal, g=g, f=name == "fused":
                                    torch.autograd.backward(scaled_dot_product_attention(q, k, v, m, is_causal=c,
                                                                                         fused=f)[0], g))
            row.append(f"{'causal' if causal else 'padding'}: fused {times['fused']:.2f} ms, explicit "
                       f"{times['explicit']:.2f} ms ({times['fused'] / times['explicit']:.2f}x)")
        print(f"attention fwd+bwd {(B, H, T, K)}  " + " | ".join(row))
    x = torch.randn(227, 9, 128)
    print(f"dropout mask (227, 9, 128): bernoulli_ {bench(lambda: torch.empty_like(x).bernoulli_(0.9), 100):.3f} ms, "
          f"rand_like {bench(lambda: torch.rand_like(x), 100):.3f} ms")


if __name__ == "__main__":
    main()
