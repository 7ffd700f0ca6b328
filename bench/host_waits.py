"""Host waits and op launches per steady-state round, per link, for ar / dspark / dpara, greedy and sampled, on the
device backend through the torch path (DPARA_RT_OPS=torch, native target off): what a GPU's host would wait for
and launch (dpara_rt.round.sync_guard). The pair is shaped like Qwen3-8B in depth (36 target layers, the drafter's
5 feature layers and 1 layer) at tiny widths with random weights. Last, the Markov head's factor bytes a step
reads at Qwen3-8B's vocabulary and the default rank, float32 against bf16 factors.

    python3 bench/host_waits.py [--layers 36] [--d 7] [--batch 2] [--tokens 48] [--sites]
"""
from __future__ import annotations

import argparse
import inspect
import os

os.environ["DPARA_RT_OPS"] = "torch"

import torch  # noqa: E402

from dpara_rt.engine import Engine  # noqa: E402
from dpara_rt.kernels.markov_head import factor_bytes_per_step  # noqa: E402
from dpara_rt.host.linear import native_target  # noqa: E402
from dpara_rt.models.drafter import Drafter, DrafterConfig  # noqa: E402
from dpara_rt.models.qwen3 import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from dpara_rt.round.sync_guard import HostWaits, Launches  # noqa: E402

METHODS = ("ar", "dspark", "dpara")


def tiny_pair(layers: int, d: int, vocab: int = 256, hidden: int = 64):
    cfg = Qwen3Config.from_dict(dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                     num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=hidden // 4, rms_norm_eps=1e-6, rope_theta=1e6,
                                     max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=[]))
    target = Qwen3ForCausalLM(cfg)
    target.init_weights(std=0.05, generator=torch.Generator().manual_seed(0))
    target.eval().requires_grad_(False)
    dcfg = DrafterConfig.for_target(cfg, num_layers=1, num_feature_layers=5, block_size=d, markov_rank=32)
    torch.manual_seed(1)
    drafter = Drafter(dcfg, target.embed_tokens, target.lm_head).eval().requires_grad_(False)
    return target, drafter


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=36, help="target layers (Qwen3-8B: 36)")
    p.add_argument("--d", type=int, default=7)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tokens", type=int, default=48, help="new tokens per request")
    p.add_argument("--sites", action="store_true", help="also print where each wait is called")
    p.add_argument("--verify-mode", default="static", choices=("static", "eager"),
                   help="the target's verify: static (what a CUDA device captures as graphs) or eager")
    args = p.parse_args(argv)
    native_target(False)
    torch.set_num_threads(1)
    target, drafter = tiny_pair(args.layers, args.d)
    prompts = [[3 + i, 17, 29 + i, 5] for i in range(args.batch)]
    print(f"target {args.layers} layers, drafter 1 layer, d = {args.d}, batch {args.batch}, verify {args.verify_mode}, "
          f"torch {torch.__version__}; steady-state rounds (past the first two, before the last)")
    summary = []
    for sampled in (False, True):
        for method in METHODS:
            eng = Engine(target, drafter if method != "ar" else None, method=method, d=args.d, drafting="device",
                         drafter_worker="thread", temperature=1.0 if sampled else 0.0, placement="colocated",
                         verify_mode=args.verify_mode)
            eng.generate(prompts, 8)
            with HostWaits(sites=args.sites) as w:
                eng.generate(prompts, args.tokens, seed=1)
            with Launches() as n:
                eng.generate(prompts, args.tokens, seed=1)
            mode = "sampled" if sampled else "greedy"
            print(f"\n== {method} {mode}: {w.steady_per_round():.1f} host waits, {n.steady_per_round():.0f} launches "
                  f"per round ({len(w.steady())} rounds)")
            launches = n.per_link()
            print(w.table())
            print("launches/round: " + ", ".join(f"{k} {v:.0f}" for k, v in launches.items()))
            if args.sites:
                for (link, what), where in sorted(w.where.items()):
                    print(f"  {link} {what}: " + "; ".join(f"{s} x{c}" for s, c in where.most_common()))
            summary.append((method, mode, w.steady_per_round(), n.steady_per_round()))
    print(f"\n{'method':<8}{'mode':<9}{'waits/round':>12}{'launches/round':>16}")
    for method, mode, waits, launches in summary:
        print(f"{method:<8}{mode:<9}{waits:>12.1f}{launches:>16.0f}")
    markov_bytes(args.batch)


QWEN3_VOCAB = 151936
MARKOV_RANK = inspect.signature(DrafterConfig.for_target).parameters["markov_rank"].default


def markov_bytes(batch: int, vocab: int = QWEN3_VOCAB, rank: int = MARKOV_RANK) -> None:
    """The Markov head's factor bytes a step reads at Qwen3-8B's shape: Triton and the torch path read the
    drafter's dtype (a float32 copy of bf16 factors reads twice as much)."""
    print(f"\nMarkov head factors read per step, batch {batch}, V = {vocab}, R = {rank}:")
    for dtype in (torch.float32, torch.bfloat16):
        w1 = torch.empty(vocab, rank, dtype=dtype, device="meta")
        w2 = torch.empty(rank, vocab, dtype=dtype, device="meta")
        n = factor_bytes_per_step(w1, w2, batch)
        print(f"  {str(dtype).replace('torch.', ''):<9}{n:>14,} bytes ({n / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
