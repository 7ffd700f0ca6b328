"""Verification of a draft block against the target's d+1 next-token distributions (docs/design.md §1).

Greedy: r = longest prefix with draft[i] == argmax(target_logits[i]); bonus = argmax(target_logits[r]).
Lossless sampling (speculative sampling): accept t_i while u_accept[i-1] * q_i(t_i) < p_{i-1}(t_i)
(i.e. u < min(1, p/q) without a division, so every implementation rounds alike); the bonus is drawn by
inverse CDF at u_bonus from norm(max(0, p_r - q_{r+1})) after a rejection, or from p_d when all d are
accepted. The CDF is a float64 running sum (a float32 one drifts by more than a token's mass at
V ~ 150k, so two summation orders would disagree); the drawn token is the first with a positive
weight whose running sum exceeds u_bonus * total. A residual that sums to 0 (p and q equal up to
rounding) falls back to p_r.
"""
from __future__ import annotations

import torch

from ._argmax import argmax_update, reduce_split_argmax
from .triton_support import cdiv, check_device, interpreting, kernel, load, next_pow2, num_sms, on_device

tl = None  # bound to triton.language by triton_support.load()


def verify_greedy_reference(target_logits, draft):
    """torch reference: (accepted r [B] long, bonus [B] long)."""
    d = draft.shape[1]
    best = target_logits.argmax(dim=-1)
    matched = (best[:, :d] == on_device(draft, best.device, draft.dtype)).long()
    r = matched.cumprod(dim=1).sum(dim=1)
    return r, best.gather(1, r[:, None]).squeeze(1)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """First index whose float64 running sum of `weights` [B, V] exceeds u * total, among positive weights."""
    cdf = weights.double().cumsum(dim=-1)
    hit = (cdf > u.double()[:, None] * cdf[:, -1:]) & (weights > 0)
    cols = torch.arange(weights.shape[-1], device=weights.device)
    last_positive = torch.where(weights > 0, cols, -1).amax(dim=-1).clamp(min=0)
    return torch.where(hit.any(dim=-1), hit.int().argmax(dim=-1), last_positive)


def verify_sample_reference(p, q, draft, u_accept, u_bonus):
    """torch reference: (accepted r [B] long, bonus [B] long)."""
    batch, d = draft.shape
    rows = torch.arange(batch, device=p.device)
    tokens = on_device(draft, p.device, torch.long)
    p_draft = p[:, :d].gather(-1, tokens[..., None]).squeeze(-1).float()
    q_draft = q.gather(-1, tokens[..., None]).squeeze(-1).float()
    accepted = u_accept.float() * q_draft < p_draft
    r = accepted.long().cumprod(dim=1).sum(dim=1)
    p_row = p[rows, r].float()
    q_row = torch.where((r < d)[:, None], q[rows, r.clamp(max=d - 1)].float(), 0.0)
    residual = torch.clamp(p_row - q_row, min=0.0)
    degenerate = (residual.double().sum(dim=-1) <= 0)[:, None]
    return r, inverse_cdf(torch.where(degenerate, p_row, residual), u_bonus)


# ---------------------------------------------------------------------------------------------- Triton

@kernel
def _row_argmax(LOGITS, s_b, s_t, PART_VAL, PART_IDX, n_pos, vocab, chunk, n_splits, BLOCK_V: tl.constexpr):
    """Partial arg-max of one logits row (b, position) over one vocabulary split."""
    row = tl.program_id(0)  # b * n_pos + position
    pid_s = tl.program_id(1)
    base = LOGITS + (row // n_pos).to(tl.int64) * s_b + (row % n_pos).to(tl.int64) * s_t
    v_lo = pid_s * chunk
    v_hi = tl.minimum(v_lo + chunk, vocab)
    best_val = tl.full([1], -float("inf"), tl.float32)
    best_idx = tl.zeros([1], tl.int32) + v_lo
    for start in range(v_lo, v_hi, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z = tl.load(base + cols, mask=cols < v_hi, other=-float("inf")).to(tl.float32)
        best_val, best_idx = argmax_update(best_val, best_idx, z[None, :], start)
    part = row.to(tl.int64) * n_splits + pid_s + tl.arange(0, 1)
    tl.store(PART_VAL + part, best_val)
    tl.store(PART_IDX + part, best_idx)


@kernel
def _greedy_accept(PART_VAL, PART_IDX, DRAFT, s_db, R_OUT, BONUS_OUT, d, n_splits,
                   POS: tl.constexpr, SPLITS: tl.constexpr):
    b = tl.program_id(0)
    pos = tl.arange(0, POS)
    pos_ok = pos <= d
    best = reduce_split_argmax(PART_VAL, PART_IDX, b * (d + 1) + pos, pos_ok, n_splits, SPLITS)
    drafted = tl.load(DRAFT + b.to(tl.int64) * s_db + pos, mask=pos < d, other=-1)
    mismatch = (pos < d) & (drafted != best.to(drafted.dtype))
    r = tl.min(tl.where(mismatch, pos, d), axis=0)
    tl.store(R_OUT + b, r.to(tl.int64))
    tl.store(BONUS_OUT + b, tl.sum(tl.where(pos == r, best, 0), axis=0).to(tl.int64))


@kernel
def _verify_sample(P, sp_b, sp_t, Q, sq_b, sq_t, DRAFT, s_db, U_ACCEPT, s_ub, U_BONUS, R_OUT, BONUS_OUT,
                   batch, d, vocab, BLOCK_B: tl.constexpr, D_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < batch
    b = rows.to(tl.int64)
    pos = tl.arange(0, D_BLOCK)
    drafted = row_ok[:, None] & (pos[None, :] < d)
    tokens = tl.load(DRAFT + b[:, None] * s_db + pos[None, :], mask=drafted, other=0)
    tokens = tl.minimum(tl.maximum(tokens.to(tl.int64), 0), vocab - 1)
    p_draft = tl.load(P + b[:, None] * sp_b + pos[None, :] * sp_t + tokens, mask=drafted, other=0.0).to(tl.float32)
    q_draft = tl.load(Q + b[:, None] * sq_b + pos[None, :] * sq_t + tokens, mask=drafted, other=0.0).to(tl.float32)
    u = tl.load(U_ACCEPT + b[:, None] * s_ub + pos[None, :], mask=drafted, other=1.0)
    rejected = drafted & ~(u * q_draft < p_draft)
    r = tl.min(tl.where(rejected, pos[None, :], d), axis=1)

    p_row = P + b * sp_b + r * sp_t
    q_row = Q + b * sq_b + tl.minimum(r, d - 1) * sq_t
    q_end = tl.where(r < d, vocab, 0)  # after a full acceptance the bonus comes from p_d itself: no q
    total_res = tl.zeros([BLOCK_B], tl.float64)
    total_p = tl.zeros([BLOCK_B], tl.float64)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        ok = row_ok[:, None] & (cols[None, :] < vocab)
        pv = tl.load(p_row[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        qv = tl.load(q_row[:, None] + cols[None, :], mask=ok & (cols[None, :] < q_end[:, None]), other=0.0)
        total_res += tl.sum(tl.maximum(pv - qv.to(tl.float32), 0.0).to(tl.float64), axis=1)
        total_p += tl.sum(pv.to(tl.float64), axis=1)
    use_p = total_res <= 0.0
    target = tl.load(U_BONUS + rows, mask=row_ok, other=0.0).to(tl.float64) * tl.where(use_p, total_p, total_res)
    running = tl.zeros([BLOCK_B], tl.float64)
    found = tl.zeros([BLOCK_B], tl.int64) + vocab
    last_positive = tl.zeros([BLOCK_B], tl.int64)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        ok = row_ok[:, None] & (cols[None, :] < vocab)
        pv = tl.load(p_row[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        qv = tl.load(q_row[:, None] + cols[None, :], mask=ok & (cols[None, :] < q_end[:, None]), other=0.0)
        w = tl.where(use_p[:, None], pv, tl.maximum(pv - qv.to(tl.float32), 0.0))
        cdf = running[:, None] + tl.cumsum(w.to(tl.float64), axis=1)
        positive = ok & (w > 0.0)
        hit = tl.min(tl.where(positive & (cdf > target[:, None]), cols[None, :], vocab), axis=1)
        found = tl.minimum(found, hit.to(tl.int64))
        last_positive = tl.maximum(last_positive, tl.max(tl.where(positive, cols[None, :], 0), axis=1).to(tl.int64))
        running = tl.max(tl.where(ok, cdf, 0.0), axis=1)
    tl.store(R_OUT + rows, r.to(tl.int64), mask=row_ok)
    tl.store(BONUS_OUT + rows, tl.where(found < vocab, found, last_positive), mask=row_ok)


def _vocab_block() -> int:
    return 4096 if interpreting() else 1024


def _sample_rows(batch: int, vocab: int) -> int:
    """Requests per program: one on a GPU (a row is long); the interpreter pays per program, so many."""
    if not interpreting():
        return 1
    return min(next_pow2(batch), max(1, 65536 // next_pow2(min(vocab, _vocab_block()))))


def verify_greedy_triton(target_logits, draft, *, num_splits: int | None = None):
    """Triton greedy verification (same contract as the reference; inputs validated by dpara_rt.ops)."""
    load()
    check_device(target_logits, draft)
    batch, n_pos, vocab = target_logits.shape
    device = target_logits.device
    if batch == 0:
        return (torch.empty(0, dtype=torch.long, device=device),) * 2
    block_v = _vocab_block()
    tiles = cdiv(vocab, block_v)
    if num_splits is None:
        num_splits = cdiv(2 * num_sms(device), batch * n_pos)
    chunk = cdiv(tiles, max(1, min(num_splits, tiles))) * block_v
    num_splits = cdiv(vocab, chunk)
    part_val = torch.empty(batch * n_pos, num_splits, dtype=torch.float32, device=device)
    part_idx = torch.empty(batch * n_pos, num_splits, dtype=torch.int32, device=device)
    _row_argmax[(batch * n_pos, num_splits)](target_logits, target_logits.stride(0), target_logits.stride(1),
                                            part_val, part_idx, n_pos, vocab, chunk, num_splits,
                                            BLOCK_V=block_v, num_warps=4)
    r = torch.empty(batch, dtype=torch.long, device=device)
    bonus = torch.empty(batch, dtype=torch.long, device=device)
    _greedy_accept[(batch,)](part_val, part_idx, draft, draft.stride(0), r, bonus, n_pos - 1, num_splits,
                             POS=next_pow2(n_pos), SPLITS=next_pow2(num_splits), num_warps=1)
    return r, bonus


def verify_sample_triton(p, q, draft, u_accept, u_bonus):
    """Triton lossless verification (same contract as the reference; inputs validated by dpara_rt.ops)."""
    load()
    check_device(p, q, draft, u_accept, u_bonus)
    batch, d = draft.shape
    vocab = p.shape[-1]
    r = torch.empty(batch, dtype=torch.long, device=p.device)
    bonus = torch.empty(batch, dtype=torch.long, device=p.device)
    u_accept = u_accept.float()
    rows = _sample_rows(batch, vocab)
    _verify_sample[(cdiv(batch, rows),)](p, p.stride(0), p.stride(1), q, q.stride(0), q.stride(1), draft,
                                         draft.stride(0), u_accept, u_accept.stride(0), u_bonus.float(), r, bonus,
                                         batch, d, vocab, BLOCK_B=rows, D_BLOCK=next_pow2(d),
                                         BLOCK_V=min(_vocab_block(), next_pow2(vocab)), num_warps=4)
    return r, bonus
