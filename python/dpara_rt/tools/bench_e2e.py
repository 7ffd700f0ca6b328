"""End-to-end benchmark grid on the embedded pair and HumanEval prompts (also `dpara-rt bench`).

Methods x batch x temperature x d, in two resource settings:
- ``paper``: the drafter has its own lane (core); ar and dspark run on one core;
- ``matched``: ar and dspark may use both cores (two intra-op threads); the parallel methods are unchanged.
Every figure is a ratio against the AR run made in the same configuration of the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from dpara_rt.tools.compare import anatomy_png, humaneval_prompts, load_pair, record, run_methods, table
from dpara_rt.host.linear import HOST_MATHS
from dpara_rt.methods import METHODS, VARIANTS

GRID_METHODS = ("ar", "dspark", "psd-pearl", "psd-ssd", "dpara-logits", "dpara-hidden", "dpara-single", "auto")
# serial methods never run both lanes at once: in the matched setting they may use both cores
SERIAL = tuple(n for n in VARIANTS if VARIANTS[n]["method"] in METHODS and not METHODS[VARIANTS[n]["method"]].parallel)


def _engine_kwargs(name: str, resources: str, d: int, temperature: float) -> dict:
    kw = dict(d=d, temperature=temperature)
    if resources == "matched" and name in SERIAL:
        kw["threads_per_lane"] = 2
    return kw


def run_config(target, drafter, prompts, batch, temperature, d, resources, max_new_tokens, methods, log):
    t0 = time.perf_counter()
    results = run_methods(list(methods), target, drafter, prompts, batch, max_new_tokens,
                          engine_kwargs=lambda name: _engine_kwargs(name, resources, d, temperature))
    log(f"  {len(methods)} methods interleaved {time.perf_counter() - t0:6.1f} s")
    rows = []
    for name, res in results.items():
        row = record(res, results["ar"])
        if temperature > 0:
            row["identical_to_ar"] = None  # sampled outputs differ by design; losslessness is tested instead
        row.update(batch=batch, temperature=temperature, d=d, resources=resources)
        rows.append(row)
    return rows


def plot(rows: list[dict], out: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for metric, ylabel, fname in (("speedup", "speedup over ar", "speedup_vs_batch.png"),
                                  ("fallback_rate", "fallback rate", "fallback_vs_batch.png")):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
        for ax, resources in zip(axes, ("paper", "matched")):
            sel = [r for r in rows if r["resources"] == resources and r["temperature"] == 0 and r["d"] == max(x["d"] for x in rows)]
            for method in dict.fromkeys(r["method"] for r in sel):
                pts = sorted((r["batch"], r[metric]) for r in sel if r["method"] == method)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch")
            ax.set_title(f"{resources} resources, greedy")
        axes[0].set_ylabel(ylabel)
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    b1 = [r for r in rows if r["batch"] == min(x["batch"] for x in rows) and r["temperature"] == 0
          and r["resources"] == "paper" and r["d"] == max(x["d"] for x in rows)]
    if b1:
        path = os.path.join(out, "anatomy.png")
        anatomy_png(b1, path, f"Per-round anatomy, batch {b1[0]['batch']}, d = {b1[0]['d']}")
        files.append(path)
    return files


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="dpara-rt bench", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output directory (e2e.json and PNG plots)")
    p.add_argument("--quick", action="store_true", help="greedy, d = 7, batch 1 and 16 only (CI smoke run)")
    p.add_argument("--prompts", type=int, default=None, help="HumanEval prompts per configuration")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--methods", default=",".join(GRID_METHODS))
    p.add_argument("--host-math", choices=HOST_MATHS, default=None,
                   help="the host projections' arithmetic: float32, or bf16 (bfloat16 dot products into float32); "
                        "default bf16 where the CPU has AVX512-BF16, else float32")
    args = p.parse_args(argv)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        print(f"bench_e2e: error: --out {args.out} is a file; expected a directory", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in VARIANTS]
    if unknown or "ar" not in methods:
        print(f"bench_e2e: error: methods {unknown} unknown or 'ar' missing; expected variant names from "
              f"{tuple(VARIANTS)} that include ar (default: {','.join(GRID_METHODS)})", file=sys.stderr)
        return 2
    if args.quick:
        batches, temps, ds, resources = (1, 16), (0.0,), (7,), ("paper", "matched")
        n_prompts, max_new = args.prompts or 16, args.max_new_tokens or 48
    else:
        batches, temps, ds, resources = (1, 2, 4, 8, 16), (0.0, 1.0), (4, 7), ("paper", "matched")
        n_prompts, max_new = args.prompts or 32, args.max_new_tokens or 64

    tokenizer, target, drafter = load_pair(host_math=args.host_math)
    math = target.lm_head.host_math
    prompts = humaneval_prompts(tokenizer, n_prompts)
    rows = []
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    log(f"host math {math}")
    for res in resources:
        for temperature in temps:
            for d in ds:
                for batch in batches:
                    # The matched setting changes only the serial methods: re-run those alone.
                    ms = [m for m in methods if m in SERIAL] if res == "matched" else methods
                    log(f"[{res}] batch {batch}, temperature {temperature}, d {d}")
                    cfg_rows = [dict(r, host_math=math)
                                for r in run_config(target, drafter, prompts, batch, temperature, d, res, max_new, ms,
                                                    log)]
                    rows += cfg_rows
                    print(f"\n[{res} resources] batch {batch}, temperature {temperature}, d {d}")
                    print(table(cfg_rows))
    _add_matched_comparisons(rows)
    with open(os.path.join(args.out, "e2e.json"), "w") as f:
        json.dump(rows, f, indent=1)
    files = plot(rows, args.out)
    print(f"\nwrote {os.path.join(args.out, 'e2e.json')} and {', '.join(files)}")
    return 0


def _add_matched_comparisons(rows: list[dict]) -> None:
    """In the matched setting only ar and dspark are re-run; the parallel methods' rows from the paper setting
    are re-expressed against the two-core ar of the same configuration."""
    key = lambda r: (r["batch"], r["temperature"], r["d"])
    matched_ar = {key(r): r for r in rows if r["resources"] == "matched" and r["method"] == "ar"}
    paper_ar = {key(r): r for r in rows if r["resources"] == "paper" and r["method"] == "ar"}
    extra = []
    for r in rows:
        k = key(r)
        if r["resources"] == "paper" and r["method"] not in SERIAL and k in matched_ar and k in paper_ar:
            m = dict(r, resources="matched")
            # Same prompts, same outputs: the ratio of throughputs is the ratio of wall times.
            m["speedup"] = r["tokens_per_s"] / matched_ar[k]["tokens_per_s"]
            extra.append(m)
    rows += extra


if __name__ == "__main__":
    sys.exit(main())
