"""Serving benchmark: `dpara-rt serve`'s app under a bounded open-loop load, per decoding method.

For each method (ar, dspark, dpara by default) the server is started in-process (uvicorn in a background
thread, 127.0.0.1, a free port) over ``Scheduler(Engine(...))`` on the embedded pair, and streaming
``/v1/completions`` requests arrive as a Poisson process at ``--rate`` requests/s. The load is open-loop (the
arrival times are drawn up front and do not wait on responses) but bounded: at most ``--max-inflight``
requests are outstanding, and an arrival beyond that waits for a slot; that wait counts in its time to first
token, which is measured from the scheduled arrival. Prompts are HumanEval prompts (token ids), greedy.

Reported per method: output throughput (tokens/s over the whole run), request rate, p50/p99 time to first
token (TTFT), p50/p99 inter-token latency (ITL: the gap between successive streamed chunks; speculative
decoding commits several tokens per chunk, so each chunk's gap is spread over its tokens) and p50/p99 time per
output token (TPOT: (end - first token) / (tokens - 1) per request), plus tau from /metrics.

    python bench/bench_serve.py --quick                 # a smoke run
    python bench/bench_serve.py --rate 4 --requests 128 --max-tokens 128 --out out/bench_serve

Writes ``serve.json`` and ``serve.png`` under ``--out``. Client and server share one process (and its GIL),
so absolute numbers are a lower bound for a separate-process server; the methods are compared like for like.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

DEFAULT_METHODS = ("ar", "dspark", "dpara")


def percentile(xs, q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def one_request(client, url: str, prompt: list[int], max_tokens: int, arrival: float, sem, rec: list):
    async with sem:
        sent = time.perf_counter()
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "return_token_ids": True}
        chunks, tokens, err = [], 0, None
        try:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    err = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        ev = json.loads(line[6:])
                        if "error" in ev:
                            err = ev["error"]["message"]
                            break
                        n = len(ev["choices"][0].get("token_ids") or [])
                        if n:
                            chunks.append((time.perf_counter(), n))
                            tokens += n
        except Exception as e:  # a failed request is counted, not fatal
            err = f"{type(e).__name__}: {e}"
        rec.append(dict(arrival=arrival, sent=sent, end=time.perf_counter(), chunks=chunks, tokens=tokens, error=err))


async def drive(url: str, prompts, args, rng: random.Random) -> tuple[list[dict], float]:
    import httpx
    gaps = [rng.expovariate(args.rate) for _ in range(args.requests)]
    sem = asyncio.Semaphore(args.max_inflight)
    rec: list[dict] = []
    limits = httpx.Limits(max_connections=args.max_inflight + 4, max_keepalive_connections=args.max_inflight + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        due, tasks = t0, []
        for i, gap in enumerate(gaps):
            due += gap
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.create_task(one_request(client, url, prompts[i % len(prompts)], args.max_tokens,
                                                         due, sem, rec)))
        await asyncio.gather(*tasks)
    return rec, t0


def summarize(method: str, rec: list[dict], t0: float, metrics_text: str) -> dict:
    ok = [r for r in rec if r["error"] is None and r["chunks"]]
    ttft = [(r["chunks"][0][0] - r["arrival"]) * 1e3 for r in ok]
    ttft_sent = [(r["chunks"][0][0] - r["sent"]) * 1e3 for r in ok]
    itl, tpot = [], []
    for r in ok:
        for (a, _), (b, n) in zip(r["chunks"], r["chunks"][1:]):
            itl += [(b - a) * 1e3 / n] * n  # the chunk's gap spread over the tokens it carried
        if r["tokens"] > 1:
            tpot.append((r["end"] - r["chunks"][0][0]) * 1e3 / (r["tokens"] - 1))
    end = max((r["end"] for r in rec), default=t0)
    tokens = sum(r["tokens"] for r in ok)
    tau = next((float(line.split()[-1]) for line in metrics_text.splitlines()
                if line.startswith("dpara_rt_tau{")), float("nan"))
    return {
        "method": method,
        "requests": len(rec),
        "completed": len(ok),
        "errors": [r["error"] for r in rec if r["error"] is not None][:5],
        "duration_s": end - t0,
        "output_tokens": tokens,
        "throughput_tok_s": tokens / (end - t0) if end > t0 else 0.0,
        "request_rate_s": len(ok) / (end - t0) if end > t0 else 0.0,
        "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
        "ttft_from_send_p50_ms": percentile(ttft_sent, 50),
        "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99),
        "tpot_p50_ms": percentile(tpot, 50), "tpot_p99_ms": percentile(tpot, 99),
        "mean_tokens_per_chunk": tokens / max(sum(len(r["chunks"]) for r in ok), 1),
        "tau": tau,
    }


def run_method(method: str, pair, prompts, args) -> dict:
    import httpx

    from dpara_rt.engine import Engine
    from dpara_rt.methods import needs_drafter, variant
    from dpara_rt.serving.scheduler import Scheduler
    from dpara_rt.serving.server import ServerThread, create_app

    tok, target, drafter = pair
    kw = variant(method)
    engine = Engine(target, drafter if needs_drafter(kw["method"]) else None, d=args.d, max_batch=args.max_batch,
                    **kw)
    sched = Scheduler(engine, max_queue=max(256, args.requests))
    srv = ServerThread(create_app(sched, tok, "tiny")).start()
    try:
        for p in prompts[: min(2, len(prompts))]:  # warm-up: lanes, allocator, caches
            httpx.post(srv.url + "/v1/completions", json={"prompt": p, "max_tokens": 4, "temperature": 0},
                       timeout=120).raise_for_status()
        rec, t0 = asyncio.run(drive(srv.url, prompts, args, random.Random(args.seed)))
        metrics_text = httpx.get(srv.url + "/metrics", timeout=30).text
    finally:
        srv.stop()
        sched.close(cancel=True, timeout=30)
    return summarize(method, rec, t0, metrics_text)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["method"] for r in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    axes[0].bar(names, [r["throughput_tok_s"] for r in rows], color="#4c72b0")
    axes[0].set_ylabel("output tokens/s")
    axes[0].set_title("throughput")
    for ax, key, label in ((axes[1], "ttft", "time to first token"), (axes[2], "itl", "inter-token latency")):
        w = 0.38
        ax.bar([i - w / 2 for i in x], [r[f"{key}_p50_ms"] for r in rows], w, label="p50", color="#55a868")
        ax.bar([i + w / 2 for i in x], [r[f"{key}_p99_ms"] for r in rows], w, label="p99", color="#c44e52")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("ms")
        ax.set_title(label)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(rows: list[dict]) -> str:
    head = f"{'method':<8}{'done':>6}{'tok/s':>9}{'req/s':>7}{'TTFT p50':>10}{'p99':>9}{'ITL p50':>9}{'p99':>8}" \
           f"{'TPOT p50':>10}{'tau':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['method']:<8}{r['completed']:>3}/{r['requests']:<2}{r['throughput_tok_s']:>9.1f}"
                     f"{r['request_rate_s']:>7.2f}{r['ttft_p50_ms']:>10.1f}{r['ttft_p99_ms']:>9.1f}"
                     f"{r['itl_p50_ms']:>9.2f}{r['itl_p99_ms']:>8.2f}{r['tpot_p50_ms']:>10.2f}{r['tau']:>6.2f}")
    return "\n".join(lines) + "\n(latencies in ms)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated variant names")
    p.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-inflight", type=int, default=16, help="bound on outstanding requests")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--d", type=int, default=7)
    p.add_argument("--prompts", type=int, default=32, help="distinct HumanEval prompts, cycled")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival process")
    p.add_argument("--out", default="out/bench_serve")
    p.add_argument("--quick", action="store_true", help="a smoke run: 8 requests of 16 tokens at 4/s")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.max_tokens, args.prompts, args.max_inflight, args.rate = 8, 16, 8, 4, 4.0
    for name in ("rate", "requests", "max_inflight", "max_tokens", "max_batch", "d", "prompts"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    from dpara_rt.tools.compare import humaneval_prompts, load_pair
    from dpara_rt.methods import variant
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        try:
            variant(m)
        except ValueError as e:
            p.error(str(e))
    os.makedirs(args.out, exist_ok=True)
    pair = load_pair()
    prompts = humaneval_prompts(pair[0], args.prompts)
    rows = []
    for m in methods:
        print(f"[bench_serve] {m}: {args.requests} requests at {args.rate}/s, <= {args.max_inflight} in flight, "
              f"max_tokens {args.max_tokens}, max_batch {args.max_batch}", file=sys.stderr, flush=True)
        rows.append(run_method(m, pair, prompts, args))
    config = {k: v for k, v in vars(args).items() if k != "out"}
    print(table(rows))
    with open(os.path.join(args.out, "serve.json"), "w") as f:
        json.dump({"config": config, "results": rows}, f, indent=1)
    plot(rows, os.path.join(args.out, "serve.png"),
         f"dpara-rt serve, embedded pair: {args.requests} req at {args.rate}/s (<= {args.max_inflight} in flight), "
         f"{args.max_tokens} tokens, batch {args.max_batch}")
    print(f"wrote {os.path.join(args.out, 'serve.json')} and {os.path.join(args.out, 'serve.png')}")
    failed = sum(r["requests"] - r["completed"] for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
