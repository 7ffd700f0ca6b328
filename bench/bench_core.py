"""Per-round bookkeeping cost: the C++ core vs the same logic in plain Python.

One round = acquire a ring slot and mark it ready, set the spine's draft, the fused acceptance + commit
(greedy acceptance, EOS / length checks, spine and position update, slot history), select the slot's rows
for the Markov head and release the slot. The C++ side is
called from Python exactly as an engine calls it (numpy arrays in, caller-owned outputs).

    python bench/bench_core.py --out core.json [--rounds 2000] [--repeats 15]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from dpara_rt.testing import RefRing, RefRoundState
from dpara_rt.core import BoundaryRing, RoundState

VOCAB = 32  # the ring's memory is never touched by bookkeeping; a small vocab keeps allocation cheap
POOL = 64   # distinct pre-generated rounds, cycled


def make_rounds(batch: int, d: int, seed: int):
    """Per-round drafts [batch, d] and target argmaxes [batch, d+1] whose acceptance lengths spread over
    0..d (no EOS: requests keep running), as lists of arrays: both sides index a list per round."""
    rng = np.random.default_rng(seed)
    drafts = rng.integers(0, 1000, size=(POOL, batch, d))
    argmax = rng.integers(0, 1000, size=(POOL, batch, d + 1))
    keep = rng.integers(0, d + 1, size=(POOL, batch))
    for k in range(POOL):
        for b in range(batch):
            argmax[k, b, :keep[k, b]] = drafts[k, b, :keep[k, b]]
    return list(drafts), list(argmax)


def time_block(run_round, first: int, rounds: int) -> float:
    """Mean time per round over `rounds` consecutive rounds, in microseconds."""
    t = time.perf_counter_ns()
    for k in range(first, first + rounds):
        run_round(k)
    return (time.perf_counter_ns() - t) / rounds / 1e3


def cpp_round(batch: int, d: int, total: int):
    drafts, argmax = make_rounds(batch, d, seed=batch)
    state = RoundState(batch, d, max_new_tokens=total * (d + 1) + 1, eos_ids=[], max_len=10 ** 9)
    state.start(np.full(batch, 16, dtype=np.int64), np.ones(batch, dtype=np.int64))
    ring = BoundaryRing(2, batch, d, VOCAB)
    # Caller-owned outputs, reused every round as an engine does.
    r, bonus, committed, offsets = (np.zeros(batch, dtype=np.int64) for _ in range(4))

    def run_round(k: int) -> None:
        slot = ring.acquire()
        ring.mark_ready(slot)
        state.set_draft(drafts[k % POOL])
        state.step(argmax[k % POOL], slot, r, bonus, committed)
        ring.select(slot, r, offsets)
        ring.release(slot)

    return run_round


def python_round(batch: int, d: int, total: int):
    drafts, argmax = make_rounds(batch, d, seed=batch)
    drafts, argmax = [x.tolist() for x in drafts], [x.tolist() for x in argmax]
    state = RefRoundState(batch, d, max_new_tokens=total * (d + 1) + 1, eos_ids=[], max_len=10 ** 9)
    state.start([16] * batch, [1] * batch)
    ring = RefRing(2, batch, d, VOCAB)

    def run_round(k: int) -> None:
        slot = ring.acquire()
        ring.mark_ready(slot)
        state.set_draft(drafts[k % POOL])
        r, _, _ = state.step(argmax[k % POOL], slot)
        ring.select(slot, r)
        ring.release(slot)

    return run_round


def bench(batch: int, d: int, rounds: int, repeats: int) -> tuple[float, float]:
    """Best-of-repeats (C++, Python) microseconds per round; the two sides alternate so that both see the
    same load on a shared machine. Python runs a tenth of the rounds (it is that much slower)."""
    py_rounds = max(rounds // 10, 1)
    cpp, py = cpp_round(batch, d, rounds * repeats + 1), python_round(batch, d, py_rounds * repeats + 1)
    best_cpp = best_py = float("inf")
    for i in range(repeats):
        best_cpp = min(best_cpp, time_block(cpp, i * rounds, rounds))
        best_py = min(best_py, time_block(py, i * py_rounds, py_rounds))
    return best_cpp, best_py


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file for the records")
    ap.add_argument("--d", type=int, default=7)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=2000, help="rounds per timed repeat")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    records = []
    for batch in args.batches:
        cpp, py = bench(batch, args.d, args.rounds, args.repeats)
        records.append({"batch": batch, "d": args.d, "cpp_us_per_round": round(cpp, 3),
                        "python_us_per_round": round(py, 3)})
    print(f"{'batch':>5} {'d':>3} {'C++ us/round':>13} {'Python us/round':>16} {'speedup':>8}")
    for rec in records:
        print(f"{rec['batch']:>5} {rec['d']:>3} {rec['cpp_us_per_round']:>13.2f} {rec['python_us_per_round']:>16.2f} "
              f"{rec['python_us_per_round'] / rec['cpp_us_per_round']:>7.1f}x")
    with open(args.out, "w") as f:
        json.dump(records, f, indent=2)
    return records


if __name__ == "__main__":
    main()
