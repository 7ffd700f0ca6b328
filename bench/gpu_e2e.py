"""End-to-end check on a CUDA machine: CUDA lanes (streams + events) with a target and drafter of realistic
width. The weights are RANDOM (no checkpoint is reachable from the device machine), so tau is meaningless here;
what this measures is the schedule: verify time, exposed draft time and backbone/verify overlap per method.

    python bench/gpu_e2e.py --out FILE [--hidden 2048 --layers 28 --vocab 151936]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from dpara_rt.engine import Engine
from dpara_rt.methods import needs_drafter, variant
from dpara_rt.models.drafter import Drafter, DrafterConfig
from dpara_rt.models.qwen3 import Qwen3Config, Qwen3ForCausalLM


def build(hidden: int, layers: int, vocab: int, device: str, dtype: torch.dtype):
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_e2e: no CUDA device; nothing to measure")
        return 0
    print("gpu_e2e: RANDOM weights of realistic width; tau is not meaningful, the schedule is", flush=True)
    target, drafter = build(args.hidden, args.layers, args.vocab, "cuda:0", torch.bfloat16)
    rows = []
    g = torch.Generator().manual_seed(0)
    for batch in map(int, args.batches.split(",")):
        prompts = [torch.randint(1, args.vocab, (256,), generator=g).tolist() for _ in range(batch)]
        for name in ("ar", "dspark", "dpara-single"):  # one GPU: both lanes are streams of it
            kw = dict(variant(name), placement="colocated")
            eng = Engine(target, drafter if needs_drafter(kw["method"]) else None, d=7, max_batch=batch, **kw)
            eng.generate(prompts, 8)
            torch.cuda.synchronize()
            st = eng.generate(prompts, args.max_new_tokens).stats
            row = dict(method=name, batch=batch, tokens_per_s=st.tokens_per_s, tau=st.tau, verify_ms=st.verify_ms,
                       exposed_draft_ms=st.exposed_draft_ms, backbone_ms=st.backbone_ms,
                       markov_head_ms=st.markov_head_ms, overlap_efficiency=st.overlap_efficiency)
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
