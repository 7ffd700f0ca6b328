"""Triton kernels against their torch references on CUDA at Qwen3-8B shapes.

    python bench/bench_kernels.py --out FILE [--quick]

Shapes: 32 query / 8 KV heads, head_dim 128 (hidden 4096), V = 151,936, d = 7, Markov rank R = 256,
context 1k and 8k, batch 1 and 16, bf16 activations and weights, fp32 probabilities for verification.
Writes a JSON list of {"kernel", "shape", "triton_us", "torch_us", ...}; tree attention adds the
achieved HBM bandwidth (bytes that must be read or written once / time), the Markov head its time per
step. Each record also says whether Triton agreed with the reference on that input ("match").
The kernels are timed directly (dpara_rt.ops adds input validation and its host sync on top).
Issue targets on an H200: Markov head <= 30 us per step at batch 1; tree attention >= 70% of HBM
bandwidth (4.8 TB/s) at 8k context. Without a CUDA device this prints so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

HIDDEN, N_Q_HEADS, N_KV_HEADS, HEAD_DIM = 4096, 32, 8, 128
VOCAB, DRAFT, RANK = 151936, 7, 256
DEVICE = "cuda"


def _bench_us(fn) -> float:
    from triton.testing import do_bench

    return 1e3 * do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_tree_attention(batch: int, n_ctx: int) -> dict:
    from dpara_rt.kernels.tree_attention import tree_attention_reference, tree_attention_triton, tree_size

    dev, dt, n_tree = DEVICE, torch.bfloat16, tree_size(DRAFT)
    q = torch.randn(batch, N_Q_HEADS, n_tree, HEAD_DIM, device=dev, dtype=dt)
    k_ctx, v_ctx = (torch.randn(batch, N_KV_HEADS, n_ctx, HEAD_DIM, device=dev, dtype=dt) for _ in range(2))
    k_tree, v_tree = (torch.randn(batch, N_KV_HEADS, n_tree, HEAD_DIM, device=dev, dtype=dt) for _ in range(2))
    lens = torch.full((batch,), n_ctx, dtype=torch.long)
    args = (q, k_ctx, v_ctx, lens, k_tree, v_tree, DRAFT, HEAD_DIM ** -0.5)
    err = (tree_attention_triton(*args).float() - tree_attention_reference(*args).float()).abs().max().item()
    triton_us = _bench_us(lambda: tree_attention_triton(*args))
    torch_us = _bench_us(lambda: tree_attention_reference(*args))
    moved = 2 * q.nbytes + k_ctx.nbytes + v_ctx.nbytes + k_tree.nbytes + v_tree.nbytes  # q read + out written
    return dict(kernel="tree_attention", shape=dict(batch=batch, context=n_ctx, q_heads=N_Q_HEADS,
                                                    kv_heads=N_KV_HEADS, head_dim=HEAD_DIM, d=DRAFT, dtype="bf16"),
                triton_us=triton_us, torch_us=torch_us, triton_gbps=moved / triton_us / 1e3,
                torch_gbps=moved / torch_us / 1e3, max_abs_err=err, match=err < 3e-2)


def bench_markov_head(batch: int, temperature: float) -> dict:
    from dpara_rt.kernels.markov_head import markov_head_reference, markov_head_triton

    dev, dt = DEVICE, torch.bfloat16
    boundary = torch.randn(batch, DRAFT + 1, DRAFT, VOCAB, device=dev, dtype=dt) * 3
    r = torch.randint(0, DRAFT + 1, (batch,), device=dev)
    bonus = torch.randint(0, VOCAB, (batch,), device=dev)
    w1 = torch.randn(VOCAB, RANK, device=dev, dtype=dt) * 0.5
    w2 = torch.randn(RANK, VOCAB, device=dev, dtype=dt) / RANK ** 0.5
    args = (boundary, r, bonus, w1, w2, temperature, 1234, 1)
    draft, _ = markov_head_triton(*args)
    want, _ = markov_head_reference(*args)
    triton_us = _bench_us(lambda: markov_head_triton(*args))
    torch_us = _bench_us(lambda: markov_head_reference(*args))
    return dict(kernel="markov_head", shape=dict(batch=batch, vocab=VOCAB, rank=RANK, d=DRAFT, dtype="bf16",
                                                 temperature=temperature),
                triton_us=triton_us, torch_us=torch_us, triton_us_per_step=triton_us / DRAFT,
                torch_us_per_step=torch_us / DRAFT, match=bool(torch.equal(draft, want)),
                draft_agreement=(draft == want).float().mean().item())


def bench_verify(batch: int, sampling: bool) -> dict:
    from dpara_rt.kernels.verify import (verify_greedy_reference, verify_greedy_triton, verify_sample_reference,
                                         verify_sample_triton)

    dev = DEVICE
    if sampling:
        p = torch.softmax(torch.randn(batch, DRAFT + 1, VOCAB, device=dev) * 3, -1)
        q = torch.softmax(torch.randn(batch, DRAFT, VOCAB, device=dev) * 3, -1)
        draft = torch.multinomial(q.reshape(-1, VOCAB), 1).reshape(batch, DRAFT)
        args = (p, q, draft, torch.rand(batch, DRAFT, device=dev), torch.rand(batch, device=dev))
        triton_fn, torch_fn = verify_sample_triton, verify_sample_reference
    else:
        logits = torch.randn(batch, DRAFT + 1, VOCAB, device=dev)
        args = (logits, logits.argmax(-1)[:, :DRAFT].contiguous())
        triton_fn, torch_fn = verify_greedy_triton, verify_greedy_reference
    got, want = triton_fn(*args), torch_fn(*args)
    return dict(kernel="verify_sample" if sampling else "verify_greedy",
                shape=dict(batch=batch, vocab=VOCAB, d=DRAFT, dtype="fp32"),
                triton_us=_bench_us(lambda: triton_fn(*args)), torch_us=_bench_us(lambda: torch_fn(*args)),
                match=all(torch.equal(a, b) for a, b in zip(got, want)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file for the records")
    parser.add_argument("--quick", action="store_true", help="batch 1 and 1k context only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device on this machine; the Triton kernels are benchmarked on a GPU only "
              "(nothing written)")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench_kernels: triton is not installed (pip install 'dpara_rt[triton]'); nothing to compare")
        return 0
    batches = (1,) if args.quick else (1, 16)
    contexts = (1024,) if args.quick else (1024, 8192)
    jobs = [lambda b=b, c=c: bench_tree_attention(b, c) for b in batches for c in contexts]
    jobs += [lambda b=b, t=t: bench_markov_head(b, t) for b in batches for t in (0.0, 1.0)]
    jobs += [lambda b=b, s=s: bench_verify(b, s) for b in batches for s in (False, True)]
    records = []
    for job in jobs:
        rec = job()
        records.append(rec)
        extra = {k: round(v, 2) if isinstance(v, float) else v for k, v in rec.items()
                 if k not in ("kernel", "shape", "triton_us", "torch_us")}
        print(f"{rec['kernel']:15s} {json.dumps(rec['shape'])}: triton {rec['triton_us']:9.1f} us  "
              f"torch {rec['torch_us']:9.1f} us  {extra}", flush=True)
    with open(args.out, "w") as fh:
        json.dump(records, fh, indent=1)
    print(f"wrote {len(records)} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
