"""What each host mechanism is worth here: DPara on the embedded pair with every mechanism on, with each one
switched off (DPARA_RT_HOST_OFF), with all off, with the drafter in a thread instead of a worker process, and on
the device backend; every configuration runs every prompt in turn (interleaved), so they share the machine's drift.

    python3 bench/host_mechanisms.py [--prompts 16] [--max-new-tokens 96] [--temperature 0] [--turns 2]
"""
from __future__ import annotations

import argparse
import os
import time

from dpara_rt import Engine, load_pair
from dpara_rt.host.backend import MECHANISMS
from dpara_rt.tools.compare import humaneval_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--turns", type=int, default=2, help="passes over the prompts (each config once a prompt)")
    args = ap.parse_args()
    tok, target, drafter = load_pair()
    prompts = humaneval_prompts(tok, args.prompts)
    engines = {"process": Engine(target, drafter, method="dpara", drafter_worker="process"),
               "thread": Engine(target, drafter, method="dpara", drafter_worker="thread"),
               "device": Engine(target, drafter, method="dpara", drafting="device")}
    configs = [("all on", "process", ""), *((f"{m} off", "process", m) for m in MECHANISMS),
               ("all off", "process", ",".join(MECHANISMS)), ("thread, all on", "thread", ""),
               ("device backend", "device", "")]
    spent = {name: 0.0 for name, _, _ in configs}
    made = {name: 0 for name, _, _ in configs}
    outputs: dict[str, list] = {name: [] for name, _, _ in configs}
    try:
        for eng in engines.values():  # warm-up: a worker's first calls, the caches
            eng.generate(prompts[:1], 16, temperature=args.temperature, seed=0)
        for turn in range(args.turns):
            for i, prompt in enumerate(prompts):
                for k in range(len(configs)):
                    name, engine, off = configs[(k + i + turn) % len(configs)]  # the first config rotates
                    os.environ["DPARA_RT_HOST_OFF"] = off
                    t0 = time.perf_counter()
                    out = engines[engine].generate([prompt], args.max_new_tokens, temperature=args.temperature,
                                                   seed=i)
                    spent[name] += time.perf_counter() - t0
                    made[name] += len(out.tokens[0])
                    if turn == 0:
                        outputs[name].append(out.tokens[0])
    finally:
        os.environ.pop("DPARA_RT_HOST_OFF", None)
        for eng in engines.values():
            eng.close()
    base = made["all on"] / spent["all on"]
    same = all(outputs[name] == outputs["all on"] for name in outputs)
    print(f"dpara, {args.prompts} HumanEval prompts x {args.turns} turns, batch 1, temperature {args.temperature}, "
          f"max_new_tokens {args.max_new_tokens}; outputs identical across configurations: {'yes' if same else 'NO'}")
    print(f"{'configuration':<18} {'tok/s':>8} {'vs all on':>10}")
    for name, _, _ in configs:
        rate = made[name] / spent[name]
        print(f"{name:<18} {rate:8.1f} {rate / base:9.3f}x")


if __name__ == "__main__":
    main()
