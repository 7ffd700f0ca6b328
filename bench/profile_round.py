"""Where a round's time goes, per method: the per-phase time from the lanes' timeline and, inside each phase,
the operators that take it (torch.profiler, all lane threads). A hidden copy on the hot path shows up here
as an `aten::copy_` under `backbone` or `verify`.

    python bench/profile_round.py [--methods ar,dspark,psd-pearl,dpara] [--prompts 4] [--max-new-tokens 48]
                                  [--batch 1] [--d 7] [--top 6] [--out profile.json]

Uses the embedded pair as the demo runs it (target fp32, drafter in compare.host_drafter_dtype()) on HumanEval prompts. Run it on a
quiet machine: the lanes are pinned to cores, and anything else running halves them.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import torch

from dpara_rt.tools.compare import humaneval_prompts, load_pair
from dpara_rt.engine import Engine
from dpara_rt.methods import needs_drafter, variant

PHASES = ("verify", "context", "serial_draft", "backbone", "markov_head", "guess_draft", "resolve")


def _phase_of(event) -> str | None:
    """The chain link (a record_function named after its phase) an operator ran under."""
    node = event.cpu_parent
    while node is not None:
        if node.name in PHASES:
            return node.name
        node = node.cpu_parent
    return None


def _profile_lanes(eng: Engine, run) -> tuple[list, int]:
    """Operator events of every lane while `run()` runs, one lane per run: the profiler records only the thread
    that enables it, and two enabled at once are not supported. Returns (events, rounds profiled)."""
    events, rounds = [], 0
    for lane in eng.lanes:
        prof = torch.autograd.profiler.profile()
        lane.submit(prof.__enter__)
        lane.synchronize()
        try:
            rounds += run()
        finally:
            lane.submit(lambda: prof.__exit__(None, None, None))
            lane.synchronize()
        events += prof.function_events
    return events, rounds // len(eng.lanes)


def profile_method(name: str, target, drafter, prompts, batch: int, d: int, max_new_tokens: int, top: int,
                   **engine_kwargs) -> dict:
    kw = {**variant(name), **engine_kwargs}  # e.g. placement="colocated" on one GPU
    eng = Engine(target, drafter if needs_drafter(kw["method"]) else None, d=d, max_batch=batch, **kw)
    eng.generate([prompts[0]], 8)  # warm-up: lanes, allocator, caches
    batches = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    rounds, totals = 0, defaultdict(float)
    for chunk in batches:  # the timeline alone, without the profiler's overhead
        st = eng.generate(chunk, max_new_tokens).stats
        rounds += st.rounds
        totals["verify"] += st.verify_ms * st.rounds
        totals["markov_head"] += st.markov_head_ms * st.rounds
        totals["exposed_draft"] += st.exposed_draft_ms * st.rounds
    events, prof_rounds = _profile_lanes(
        eng, lambda: sum(eng.generate(chunk, max_new_tokens).stats.rounds for chunk in batches))
    phase_ms: dict[str, float] = defaultdict(float)
    ops: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for ev in events:
        if ev.name in PHASES:
            phase_ms[ev.name] += ev.cpu_time_total / 1e3
        elif (phase := _phase_of(ev)) is not None:
            ops[phase][ev.name] += ev.self_cpu_time_total / 1e3
    per_round = lambda ms: ms / max(prof_rounds, 1)
    return {
        "method": name,
        "rounds": rounds,
        "verify_ms": totals["verify"] / max(rounds, 1),
        "markov_head_ms": totals["markov_head"] / max(rounds, 1),
        "exposed_draft_ms": totals["exposed_draft"] / max(rounds, 1),
        "phases_ms_per_round": {p: per_round(ms) for p, ms in sorted(phase_ms.items(), key=lambda x: -x[1])},
        "top_ops_ms_per_round": {p: dict(sorted(((o, per_round(ms)) for o, ms in by_op.items()),
                                                key=lambda x: -x[1])[:top])
                                 for p, by_op in ops.items()},
    }


def report(row: dict) -> str:
    lines = [f"[{row['method']}] {row['rounds']} rounds; per round: verify {row['verify_ms']:.2f} ms, "
             f"Markov head {row['markov_head_ms']:.2f} ms, exposed draft {row['exposed_draft_ms']:.2f} ms "
             "(timeline, no profiler)"]
    for phase, ms in row["phases_ms_per_round"].items():
        lines.append(f"  {phase:<13}{ms:8.2f} ms/round (under the profiler)")
        for op, op_ms in row["top_ops_ms_per_round"].get(phase, {}).items():
            lines.append(f"      {op:<40}{op_ms:8.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="ar,dspark,psd-pearl,dpara")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--d", type=int, default=7)
    p.add_argument("--top", type=int, default=6)
    p.add_argument("--out", default=None, help="write the rows as JSON here too")
    args = p.parse_args(argv)
    tokenizer, target, drafter = load_pair()
    prompts = humaneval_prompts(tokenizer, args.prompts)
    rows = []
    for name in args.methods.split(","):
        rows.append(profile_method(name, target, drafter, prompts, args.batch, args.d, args.max_new_tokens,
                                   args.top))
        print(report(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
