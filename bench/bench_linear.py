"""One thread of the host linear layer with bf16 host math (HostLinear) against torch's own bfloat16 F.linear, on
SmolLM2-135M's shapes (random weights), at 1, 8 and 32 rows: microseconds and GFLOP/s. It tells whether a verify
of d + 1 tokens is bound by reading the weights (rows 1) or by the products (rows 8 and more).

    python bench/bench_linear.py [--reps 200]
"""
from __future__ import annotations

import argparse
import time

import torch

from dpara_rt.host.linear import HostLinear, set_host_math

SHAPES = ((1536, 576), (576, 1536), (49152, 576))  # (out, in): up/gate, down, the tied output head


def median_us(fn, reps: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for n, k in SHAPES:
        layer = torch.nn.Sequential(HostLinear(k, n, bias=False))
        torch.nn.init.normal_(layer[0].weight, std=0.02)
        set_host_math(layer, "bf16")
        w16 = layer[0].weight.detach().bfloat16()
        reps = max(args.reps // 10, 5) if n > 10_000 else args.reps
        for rows in (1, 8, 32):
            x = torch.randn(rows, k)
            x16 = x.bfloat16()
            with torch.no_grad():
                native = median_us(lambda: layer(x), reps)
                torch_bf16 = median_us(lambda: torch.nn.functional.linear(x16, w16), reps)
            flop = 2 * rows * n * k / 1e3  # per us: GFLOP/s
            print(f"[{n}x{k}] rows {rows:2d}: native bf16 {native:8.1f} us ({flop / native:6.1f} GFLOP/s)  "
                  f"torch bf16 {torch_bf16:8.1f} us ({flop / torch_bf16:6.1f} GFLOP/s)")


if __name__ == "__main__":
    main()
