"""vLLM (CPU build) without speculation, with its ngram and dflash proposers, and with DPara (dpara_rt.engines.vllm),
on one target and one prompt set, in one run; prints tok/s, tau and the ratios to vLLM AR.

    ../vllm-env/bin/python bench/bench_vllm.py [--prompts 4] [--max-tokens 64] [--d 7] [--dtype bfloat16]
                                               [--native] [--split] [--dflash-drafter DIR]

Target: SmolLM2-135M-Instruct (GGUF, converted) with the trained drafter at
python/dpara_rt/assets/smollm2/drafter/ when that exists (or --drafter DIR), else the random pair of
dpara_rt.engines.random_pair (a nearly-bigram random Llama and its bigram drafter; prompts are random token ids).
vLLM's dflash method runs a DFlash-convention drafter exported with dpara_rt.models.convert.export_dflash: for
SmolLM2 --dflash-drafter DIR (the baseline `python -m dpara_rt.train.preset_smollm2 --dflash` trains; without it
no dflash rows), for the random pair a random one (lossless, rarely accepted).
Greedy, ignore_eos, enforce_eager, prefix caching off; every engine gets one warm-up generate before the timed one.
tok/s counts generated tokens over the timed generate's wall time. Each engine is checked to reproduce its own AR's
output (and vLLM AR's: dpara_rt's bf16 host math and vLLM's kernels round apart, so there they may part).
`--native` adds dpara_rt's own engine on the same prompts (AR, DPara, and its dflash method on the DFlash drafter).
The engines run one after another in this process (vLLM's engine core and worker in their own processes).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

import torch

SMOLLM2_DRAFTER = Path(__file__).resolve().parent.parent / "python/dpara_rt/assets/smollm2/drafter"
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
             "List three uses of a paperclip.", "How do I reverse a list in Python?", "What causes rain?",
             "Name the planets of the solar system.", "Give a recipe for pancakes."]


def pick_pair(args, tmp: str):
    """(target_dir, drafter_dir, the DFlash checkpoint or None, prompts as token-id lists, description)."""
    from dpara_rt.models.convert import export_dflash

    drafter = Path(args.drafter) if args.drafter else SMOLLM2_DRAFTER
    if not args.random and (drafter / "drafter_config.json").is_file():
        from transformers import AutoTokenizer

        from dpara_rt.models import smollm2_path
        from dpara_rt.models.gguf import gguf_to_dir
        target = str(gguf_to_dir(smollm2_path()))
        exported = None
        if args.dflash_drafter:
            exported = os.path.join(tmp, "dflash")
            layers = json.loads((Path(target) / "config.json").read_text())["num_hidden_layers"]
            export_dflash(args.dflash_drafter, exported, num_target_layers=layers)
        tok = AutoTokenizer.from_pretrained(target)
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
                   for q in QUESTIONS[:args.prompts]]
        return target, str(drafter), exported, [list(p) if not hasattr(p, "input_ids") else p.input_ids
                                                for p in prompts], f"SmolLM2-135M-Instruct + {drafter}"
    from dpara_rt.engines.random_pair import write_random_dflash, write_random_pair

    shape = dict(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers)
    target, drafter_dir = write_random_pair(tmp, **shape)
    dflash = write_random_dflash(tmp, **shape)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 40, (args.prompts,), generator=g)]
    return target, drafter_dir, dflash, prompts, (f"random Llama (hidden {args.hidden}, {args.layers} layers, "
                                                  "vocab 256) + its bigram drafter")


def run_engine(name: str, target: str, prompts, args, stats_path: str, bind: str | None = None, **spec) -> dict:
    """One engine's timed generate. bind: VLLM_CPU_OMP_THREADS_BIND for its worker (default: vLLM's auto)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if bind is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    llm = LLM(model=target, skip_tokenizer_init=True, dtype=args.dtype, enforce_eager=True, max_model_len=1024,
              max_num_seqs=args.max_num_seqs, enable_prefix_caching=False, disable_log_stats=False,
              gpu_memory_utilization=0.05, kv_cache_memory_bytes=256 << 20, seed=0, **spec)
    if bind is not None:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND") if old is None else os.environ.update(
            VLLM_CPU_OMP_THREADS_BIND=old)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(batch[:1], SamplingParams(max_tokens=8, temperature=0.0, detokenize=False), use_tqdm=False)
    before = _spec_counters(llm)
    t = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    wall = time.perf_counter() - t
    after = _spec_counters(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
    accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
    row = {"engine": name, "wall_s": wall, "tokens": sum(map(len, tokens)), "out": tokens,
           "tau": 1 + accepted / drafts if drafts else None}
    row["tok_s"] = row["tokens"] / wall
    if "additional_config" in spec and os.path.exists(stats_path):
        with open(stats_path) as f:
            row["dpara"] = json.load(f)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return row


def run_native(name: str, method: str, prompts, args, drafter_dir: str | None = None) -> dict:
    """dpara_rt's own engine on the same prompts (SmolLM2 as the demo loads it: the native Llama path, float32 weights,
    the host's bf16 math where it has it), max_num_seqs prompts per generate, EOS ignored as vLLM's runs do;
    ``drafter_dir``: a drafter other than the shipped one."""
    from dpara_rt.engine import Engine
    from dpara_rt.tools.compare import load_smollm2

    _, target, drafter = load_smollm2(None if drafter_dir is None else str(drafter_dir))
    B = args.max_num_seqs
    eng = Engine(target, drafter if method != "ar" else None, method=method, d=args.d, max_batch=B, eos_ids=[])
    try:
        eng.generate(prompts[:1], 8)
        tokens, tau_rounds = [], []
        t = time.perf_counter()
        for i in range(0, len(prompts), B):
            out = eng.generate(prompts[i:i + B], args.max_tokens)
            tokens += out.tokens
            tau_rounds.append(out.stats.tau)
        wall = time.perf_counter() - t
    finally:
        eng.close()
    row = {"engine": name, "wall_s": wall, "tokens": sum(map(len, tokens)), "out": tokens,
           "tau": sum(tau_rounds) / len(tau_rounds) if method != "ar" else None}
    row["tok_s"] = row["tokens"] / wall
    return row


def _spec_counters(llm) -> dict:
    return {m.name.removeprefix("vllm:spec_decode_"): m.value for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode") and getattr(m, "value", None) is not None}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--d", type=int, default=7, help="num_speculative_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--drafter", help="a drafter directory for SmolLM2 (default: the trained one, if present)")
    ap.add_argument("--dflash-drafter", help="a DFlash-convention drafter for SmolLM2 (preset_smollm2 --dflash); "
                    "adds vLLM DFlash (and, with --native, dpara_rt DFlash)")
    ap.add_argument("--random", action="store_true", help="use the random pair even if the SmolLM2 drafter exists")
    ap.add_argument("--hidden", type=int, default=512, help="random target's hidden size")
    ap.add_argument("--layers", type=int, default=8, help="random target's layers")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="vLLM's model dtype")
    ap.add_argument("--native", action="store_true", help="also: dpara_rt's own engine (ar, dpara) on the same "
                    "prompts (SmolLM2 only)")
    ap.add_argument("--split", action="store_true", help="also: AR and DPara with the target bound to core 0 "
                    "(VLLM_CPU_OMP_THREADS_BIND=0) and the drafter's lane pinned to core 1")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter, dflash, prompts, what = pick_pair(args, tmp)
        stats = os.path.join(tmp, "dpara_stats.json")
        print(f"target: {what}; {len(prompts)} prompts, {args.max_tokens} new tokens each, d={args.d}, "
              f"max_num_seqs={args.max_num_seqs}, vLLM dtype {args.dtype}, torch threads {torch.get_num_threads()}",
              flush=True)
        dpara = {"speculative_config": {"method": "dpara", "model": drafter, "num_speculative_tokens": args.d}}
        options = {"dpara_stats": stats, "dpara_max_requests": args.max_num_seqs}
        rows = [run_engine("vLLM AR", target, prompts, args, stats),
                run_engine("vLLM ngram", target, prompts, args, stats,
                           speculative_config={"method": "ngram", "num_speculative_tokens": args.d,
                                               "prompt_lookup_max": 3, "prompt_lookup_min": 2}),
                run_engine("vLLM + DPara", target, prompts, args, stats, **dpara, additional_config=options)]
        if dflash is not None:
            rows.insert(2, run_engine("vLLM DFlash", target, prompts, args, stats, speculative_config={
                "method": "dflash", "model": dflash, "num_speculative_tokens": args.d}))
        if args.split:  # the target's OpenMP threads on core 0, the drafter's lane on core 1
            rows.append(run_engine("AR core 0", target, prompts, args, stats, bind="0"))
            rows.append(run_engine("DPara split", target, prompts, args, stats, bind="0", **dpara,
                                   additional_config={**options, "dpara_cores": [1]}))
    if args.native:
        if args.random or not (Path(drafter) / "drafter_config.json").is_file():
            raise SystemExit("--native runs SmolLM2 with its drafter; drop --random")
        rows += [run_native("dpara_rt AR", "ar", prompts, args), run_native("dpara_rt DPara", "dpara", prompts, args)]
        if args.dflash_drafter:
            rows.append(run_native("dpara_rt DFlash", "dflash", prompts, args, args.dflash_drafter))
    ar = rows[0]
    own_ar = {r["engine"].split()[0]: r for r in rows if r["engine"].endswith(" AR")}  # each engine's own AR
    print(f"\n{'engine':<14} {'tok/s':>8} {'x AR':>6} {'tau':>6} {'wall s':>7}  same output as its AR, as vLLM AR")
    for r in rows:
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        mine = own_ar.get(r["engine"].split()[0], ar)
        print(f"{r['engine']:<14} {r['tok_s']:8.1f} {r['tok_s'] / ar['tok_s']:6.2f} {tau:>6} {r['wall_s']:7.2f}  "
              f"{r['out'] == mine['out']}, {r['out'] == ar['out']}")
    for r in rows:
        dp = r.get("dpara")
        if not dp:
            continue
        o = dp["overlap"]
        n = max(o.get("steps_timed", 0), 1)
        print(f"\n{r['engine']} lane (whole run, warm-up included): tau {dp['tau']:.2f}; {o['backbones']} backbones, "
              f"{o['backbone_ns'] / max(o['backbones'], 1) / 1e6:.2f} ms each; "
              f"{o['backbone_in_forward_ns'] / max(o['backbone_ns'], 1):.0%} of backbone time inside vLLM's target "
              f"forwards, {o['backbone_in_propose_ns'] / max(o['backbone_ns'], 1):.0%} inside the proposer's calls "
              f"(waited for); per step: target forward {o['forward_ns'] / n / 1e6:.2f} ms, propose call "
              f"{o['propose_ns'] / n / 1e6:.2f} ms, vLLM between propose and next forward "
              f"{o['gap_ns'] / n / 1e6:.2f} ms")


if __name__ == "__main__":
    main()
