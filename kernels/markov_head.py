"""Fused Markov (AR) head: the d cheap sequential steps that turn boundary logits into the next draft.

For each request b: x_0 = bonus[b], and for j = 1..d
    z_j = boundary[b, r[b], j-1] + W1[x_{j-1}] @ W2          (rank-R bias from the previous token)
    x_j = argmax z_j                       (greedy, temperature 0; ties -> lowest index)
    x_j = argmax (z_j / T + Gumbel)        (sampling: Gumbel-max == a draw from softmax(z_j / T))
and, when sampling, q_j = softmax(z_j / T) for lossless verification (both sides scale by 1/T rounded
to float32, so they see the same scaled logits). The Gumbel noise of (b, j, v) is
Philox4x32-10 at counter ((b*d + j-1)*V + v, offset) keyed by seed, identical in Triton and torch.
The serial (DSpark) layout passes logits [B, d, V] as boundary [B, 1, d, V] with r = 0.
"""
from __future__ import annotations

import numpy as np
import torch

from ._argmax import argmax_update, reduce_split_argmax
from ._rng import as_int32_bits, gumbel, gumbel_noise, split_u64
from .triton_support import (cdiv, check_device, dot_options, interpreting, kernel, load, next_pow2, num_sms,
                              on_device)

tl = None  # bound to triton.language by triton_support.load()

# torch.mm(a, b, out_dtype=torch.float32) of 16-bit operands: CUDA's cuBLAS from torch 2.8 (not ROCm's)
_MM_TO_FLOAT32 = "dtype" in torch.ops.aten.mm.overloads() and torch.version.hip is None


def inverse_temperature(temperature: float) -> float:
    """1/T rounded to float32: both implementations scale logits by this exact multiplier."""
    return float(np.float32(1.0 / temperature))


def markov_head_reference(boundary, r, bonus, w1, w2, temperature: float = 0.0, seed: int = 0, offset: int = 0):
    """torch reference: (draft [B, d] long, q [B, d, V] float32 when temperature > 0 else None).

    The bias W1[x] @ W2 accumulates in float32 whatever the factors' dtype. 16-bit factors on CUDA stay 16-bit:
    one GEMM with a float32 output reads W2 at 2 bytes an entry a step; elsewhere (and before torch 2.8) they are
    widened once a call (16-bit products are exact in float32, so both agree up to summation order)."""
    batch, _, d, vocab = boundary.shape
    device = boundary.device
    rows = torch.arange(batch, device=device)
    slot_r = on_device(r, device, torch.long)
    x = on_device(bonus, device, torch.long)
    narrow = w2.dtype != torch.float32 and device.type == "cuda" and _MM_TO_FLOAT32
    w2f = w2 if narrow else w2.float()
    sample = temperature > 0
    inv_t = inverse_temperature(temperature) if sample else 1.0
    draft = torch.empty(batch, d, dtype=torch.long, device=device)
    q = torch.empty(batch, d, vocab, dtype=torch.float32, device=device) if sample else None
    cols = torch.arange(vocab, device=device)
    if sample:  # the noise does not depend on the drafted tokens: draw all d steps in one vectorised pass
        steps = torch.arange(d, device=device)
        noise = gumbel(((rows[:, None, None] * d + steps[None, :, None]) * vocab + cols), offset, seed)
    for j in range(d):
        bias = torch.mm(w1[x], w2f, out_dtype=torch.float32) if narrow else w1[x].float() @ w2f
        z = boundary[rows, slot_r, j].float() + bias
        if sample:
            z = z * inv_t
            q[:, j] = torch.softmax(z, dim=-1)
            z = z + noise[:, j]
        x = z.argmax(dim=-1)
        draft[:, j] = x
    return draft, q


def factor_bytes_per_step(w1, w2, batch: int) -> int:
    """Bytes of the factors one step of the head reads: all of W2 (every column's bias) and W1's rows of the
    batch's previous tokens. The boundary rows and q come on top."""
    return w2.numel() * w2.element_size() + batch * w1.shape[1] * w1.element_size()


# ---------------------------------------------------------------------------------------------- Triton

@kernel
def _markov_step(
        BOUNDARY, s_bb, s_br, s_bj, R, BONUS, W1, W2, DRAFT, PART_VAL, PART_IDX, PART_M, PART_S, QBUF,
        batch, n_slots, d, vocab, rank, j, chunk, n_splits, inv_t, seed, off_lo, off_hi,
        FIRST: tl.constexpr, SAMPLE: tl.constexpr, USE_DOT: tl.constexpr, UPCAST: tl.constexpr,
        PRECISION: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLITS: tl.constexpr):
    """Step j (0-based) for a block of requests over one vocabulary split: partial arg-max of z_{j+1}."""
    pid_s = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < batch
    if FIRST:
        x_prev = tl.load(BONUS + rows, mask=row_ok, other=0)
    else:  # finish step j-1: every split reduces the same partials, so all agree on x_j
        x_prev = reduce_split_argmax(PART_VAL, PART_IDX, (j - 1) * batch + rows, row_ok, n_splits, SPLITS)
        if pid_s == 0:
            tl.store(DRAFT + rows.to(tl.int64) * d + (j - 1), x_prev.to(tl.int64), mask=row_ok)
    # clamps keep every read in bounds even if validation was bypassed
    x_prev = tl.minimum(tl.maximum(x_prev.to(tl.int64), 0), vocab - 1)
    slot_r = tl.minimum(tl.maximum(tl.load(R + rows, mask=row_ok, other=0).to(tl.int64), 0), n_slots - 1)
    row_base = BOUNDARY + rows.to(tl.int64) * s_bb + slot_r * s_br + j * s_bj

    v_lo = pid_s * chunk
    v_hi = tl.minimum(v_lo + chunk, vocab)
    best_val = tl.full([BLOCK_B], -float("inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_B], tl.int32) + v_lo
    m_run = tl.full([BLOCK_B], -float("inf"), tl.float32)
    s_run = tl.zeros([BLOCK_B], tl.float32)
    for start in range(v_lo, v_hi, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        col_ok = cols < v_hi
        tile_ok = row_ok[:, None] & col_ok[None, :]
        bias = tl.zeros([BLOCK_B, BLOCK_V], tl.float32)
        for k0 in range(0, rank, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < rank
            a = tl.load(W1 + x_prev[:, None] * rank + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(W2 + ks[:, None].to(tl.int64) * vocab + cols[None, :], mask=k_ok[:, None] & col_ok[None, :],
                        other=0.0)
            if USE_DOT:
                if UPCAST:
                    bias = tl.dot(a.to(tl.float32), w.to(tl.float32), bias, input_precision=PRECISION)
                else:
                    bias = tl.dot(a, w, bias, input_precision=PRECISION)
            else:  # a GEMV for a handful of requests: no tensor-core padding to 16 rows
                bias += tl.sum(a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
        z = tl.load(row_base[:, None] + cols[None, :], mask=tile_ok, other=0.0).to(tl.float32) + bias
        if SAMPLE:
            z = z * inv_t
            qz = tl.where(tile_ok, z, -float("inf"))
            tl.store(QBUF + (rows.to(tl.int64) * d + j)[:, None] * vocab + cols[None, :], z, mask=tile_ok)
            m_new = tl.maximum(m_run, tl.max(qz, axis=1))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            s_run = s_run * tl.exp(m_run - m_safe) + tl.sum(tl.exp(qz - m_safe[:, None]), axis=1)
            m_run = m_new
            counter = ((rows.to(tl.int64) * d + j)[:, None] * vocab + cols[None, :]).to(tl.uint32)
            z = z + gumbel_noise(seed, counter, off_lo, off_hi)
        best_val, best_idx = argmax_update(best_val, best_idx, tl.where(tile_ok, z, -float("inf")), start)
    part = (j * batch + rows).to(tl.int64) * n_splits + pid_s
    tl.store(PART_VAL + part, best_val, mask=row_ok)
    tl.store(PART_IDX + part, best_idx, mask=row_ok)
    if SAMPLE:
        tl.store(PART_M + part, m_run, mask=row_ok)
        tl.store(PART_S + part, s_run, mask=row_ok)


@kernel
def _markov_finish(PART_VAL, PART_IDX, DRAFT, batch, d, n_splits, BLOCK_B: tl.constexpr, SPLITS: tl.constexpr):
    """Reduce the last step's partials into draft[:, d-1]."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < batch
    x = reduce_split_argmax(PART_VAL, PART_IDX, (d - 1) * batch + rows, row_ok, n_splits, SPLITS)
    tl.store(DRAFT + rows.to(tl.int64) * d + (d - 1), x.to(tl.int64), mask=row_ok)


@kernel
def _markov_normalize(QBUF, PART_M, PART_S, batch, d, vocab, n_splits, ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
                      SPLITS: tl.constexpr):
    """q[b, j] = softmax of the scaled logits stored by the steps, from the splits' (max, sum) partials."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # b * d + j
    row_ok = rows < batch * d
    split = tl.arange(0, SPLITS)
    part = ((rows % d) * batch + rows // d).to(tl.int64)[:, None] * n_splits + split[None, :]
    part_ok = row_ok[:, None] & (split[None, :] < n_splits)
    m_part = tl.load(PART_M + part, mask=part_ok, other=-float("inf"))
    s_part = tl.load(PART_S + part, mask=part_ok, other=0.0)
    m = tl.max(m_part, axis=1)
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    total = tl.sum(s_part * tl.exp(m_part - m_safe[:, None]), axis=1)
    total = tl.where(total > 0.0, total, 1.0)  # rows past the batch
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = row_ok[:, None] & (cols[None, :] < vocab)
    ptrs = QBUF + rows.to(tl.int64)[:, None] * vocab + cols[None, :]
    z = tl.load(ptrs, mask=ok, other=-float("inf"))
    tl.store(ptrs, tl.exp(z - m_safe[:, None]) / total[:, None], mask=ok)


def _config(batch: int, rank: int, vocab: int) -> dict:
    """Block sizes: a broadcast GEMV for up to 4 requests, tensor-core dots (16-row blocks) beyond.

    The interpreter pays per operation and per program, not per element: it takes the whole rank, up to
    64 requests and at most ~64 vocabulary tiles per step at once.
    """
    k_cap = max(16, next_pow2(rank))
    if batch <= 4:
        block_b, block_v = next_pow2(batch), 256
        block_k = min(k_cap, max(1, 8192 // (block_b * block_v)))
        cfg = dict(BLOCK_B=block_b, BLOCK_V=block_v, BLOCK_K=block_k, USE_DOT=False)
    else:
        cfg = dict(BLOCK_B=16, BLOCK_V=128, BLOCK_K=min(k_cap, 64), USE_DOT=True)
    if interpreting():
        cfg.update(BLOCK_V=max(cfg["BLOCK_V"], next_pow2(cdiv(vocab, 64))), BLOCK_K=k_cap)
        if cfg["USE_DOT"]:
            cfg.update(BLOCK_B=min(64, next_pow2(batch)))
    return cfg


def markov_head_triton(boundary, r, bonus, w1, w2, temperature: float = 0.0, seed: int = 0, offset: int = 0,
                       *, num_splits: int | None = None):
    """Triton Markov head (same contract as the reference; inputs validated by dpara_rt.ops).

    num_splits: programs sharing the vocabulary per request block (None: chosen from the device size).
    """
    load()
    check_device(boundary, w1, w2)
    batch, n_slots, d, vocab = boundary.shape
    rank = w1.shape[1]
    device = boundary.device
    sample = temperature > 0
    if batch == 0:
        return (torch.empty(0, d, dtype=torch.long, device=device),
                torch.empty(0, d, vocab, device=device) if sample else None)
    cfg = _config(batch, rank, vocab)
    b_blocks = cdiv(batch, cfg["BLOCK_B"])
    tiles = cdiv(vocab, cfg["BLOCK_V"])
    if num_splits is None:  # W2 streams from HBM once per step: enough programs to keep many loads in flight
        num_splits = cdiv(4 * num_sms(device), b_blocks)
    chunk = cdiv(tiles, max(1, min(num_splits, tiles))) * cfg["BLOCK_V"]
    num_splits = cdiv(vocab, chunk)
    splits_pow2 = next_pow2(num_splits)
    r_dev = on_device(r, device, torch.int32)
    bonus_dev = on_device(bonus, device, torch.int32)
    draft = torch.empty(batch, d, dtype=torch.long, device=device)
    part_val = torch.empty(d, batch, num_splits, dtype=torch.float32, device=device)
    part_idx = torch.empty(d, batch, num_splits, dtype=torch.int32, device=device)
    if sample:
        part_m, part_s = torch.empty_like(part_val), torch.empty_like(part_val)
        q = torch.empty(batch, d, vocab, dtype=torch.float32, device=device)
    else:
        part_m = part_s = q = None
    upcast, precision = dot_options(w2.dtype)
    off_lo, off_hi = (as_int32_bits(w) for w in split_u64(offset))
    for j in range(d):
        _markov_step[(num_splits, b_blocks)](
            boundary, boundary.stride(0), boundary.stride(1), boundary.stride(2), r_dev, bonus_dev, w1, w2, draft,
            part_val, part_idx, part_m if sample else part_val, part_s if sample else part_val,
            q if sample else part_val,
            batch, n_slots, d, vocab, rank, j, chunk, num_splits,
            inverse_temperature(temperature) if sample else 1.0, seed, off_lo, off_hi,
            FIRST=j == 0, SAMPLE=sample, UPCAST=upcast, PRECISION=precision, SPLITS=splits_pow2, **cfg,
            num_warps=4)
    _markov_finish[(b_blocks,)](part_val, part_idx, draft, batch, d, num_splits,
                                BLOCK_B=cfg["BLOCK_B"], SPLITS=splits_pow2, num_warps=1)
    if sample:
        # one row per program on a GPU; the interpreter pays per program, so it takes many rows at once
        n_rows, block_v = batch * d, min(1024, next_pow2(vocab))
        rows = min(next_pow2(n_rows), max(1, 16384 // block_v)) if interpreting() else 1
        _markov_normalize[(cdiv(n_rows, rows), cdiv(vocab, block_v))](
            q, part_m, part_s, batch, d, vocab, num_splits, ROWS=rows, BLOCK_V=block_v, SPLITS=splits_pow2,
            num_warps=4)
    return draft, q
