"""Host Markov head: native (C++ core, dpara_rt.host.native) against the torch reference on one CPU thread.

    python bench/bench_markov_head.py

Prints ms per call (median of 50 after 3 warm-up calls) at d = 7, V = 8192, rank R = 128 (the demo's
head), batch 1 and 4, greedy and sampling (temperature 1). Issue 12's target: native greedy <= 0.5 ms
at batch 1.
"""
from __future__ import annotations

import statistics
import time

import torch

from dpara_rt.kernels.markov_head import markov_head_reference
from dpara_rt.host.native import markov_head_native

D, VOCAB, RANK, N_ROWS = 7, 8192, 128, 8
CALLS, WARMUP = 50, 3


def _ms_per_call(fn) -> float:
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    print(f"d = {D}, V = {VOCAB}, R = {RANK}, float32, 1 thread; ms per call, median of {CALLS}")
    print(f"{'batch':>5} {'mode':>8} {'native':>8} {'reference':>10} {'speed-up':>9}  same draft")
    for batch in (1, 4):
        boundary = torch.randn(batch, N_ROWS, D, VOCAB, generator=g) * 3
        r = torch.randint(0, N_ROWS, (batch,), generator=g)
        bonus = torch.randint(0, VOCAB, (batch,), generator=g)
        w1 = torch.randn(VOCAB, RANK, generator=g)
        w2 = torch.randn(RANK, VOCAB, generator=g) / RANK ** 0.5
        for mode, temperature in (("greedy", 0.0), ("sampling", 1.0)):
            args = (boundary, r, bonus, w1, w2, temperature, 5, 9)
            same = torch.equal(markov_head_native(*args)[0], markov_head_reference(*args)[0])
            native = _ms_per_call(lambda: markov_head_native(*args))
            reference = _ms_per_call(lambda: markov_head_reference(*args))
            print(f"{batch:>5} {mode:>8} {native:>8.3f} {reference:>10.3f} {reference / native:>8.1f}x  {same}")


if __name__ == "__main__":
    main()
