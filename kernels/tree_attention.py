"""Tree-mask attention: the DPara backbone forward over the spine and the d+1 branches (docs/design.md §1).

Query rows (Q = (d+1) + (d+1)*d = (d+1)**2): spine rows 0..d, then branch r's d rows for r = 0..d.
Keys: the cached context (ragged length per batch row) followed by the same Q tree tokens.
Spine row i sees the context and spine 0..i; a branch-r row sees the context, spine 0..r and all of
branch r. The Triton kernel derives this from indices (row -> branch id / spine limit, key -> spine
index / branch id) and never builds the mask; the torch reference builds it densely for one SDPA call.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .. import _core
from .triton_support import cdiv, check_device, dot_options, kernel, load, num_sms

tl = None  # bound to triton.language by triton_support.load()

LOG2E = 1.4426950408889634


def tree_size(d: int) -> int:
    """Query rows of the spine + branch tree for draft length d."""
    return (d + 1) * (d + 1)


def tree_mask(d: int, device: str = "cpu") -> torch.Tensor:
    """Dense [Q, Q] bool mask of the tree part (True = may attend), from the core's tree metadata, which owns
    the layout. Cached: do not modify it. Under torch.compile it is derived from indices instead (as the Triton
    kernel derives it): the core's array is a host object a traced graph cannot hold."""
    if torch.compiler.is_compiling():
        return tree_mask_from_indices(d, device)
    return _core_tree_mask(d, device)


@functools.lru_cache(maxsize=64)
def _core_tree_mask(d: int, device: str) -> torch.Tensor:
    return torch.from_numpy(_core.tree_mask(d)).to(device=device, dtype=torch.bool)


def tree_mask_from_indices(d: int, device=None) -> torch.Tensor:
    """tree_mask from torch ops alone: spine row i sees spine 0..i, a branch-r row spine 0..r and all of branch r."""
    i = torch.arange(tree_size(d), device=device)
    is_branch = i > d
    branch = torch.where(is_branch, torch.div(i - d - 1, d, rounding_mode="floor"), -1)
    limit = torch.where(is_branch, branch, i)  # the last spine index a row sees
    return torch.where(is_branch[None, :], branch[None, :] == branch[:, None], i[None, :] <= limit[:, None])


def tree_position_offsets(d: int, device=None) -> torch.Tensor:
    """Position of each tree row relative to the first spine token: spine i at i, branch r's j-th token at r+1+j."""
    return torch.from_numpy(_core.tree_metadata(d)["query_pos_offset"]).to(device=device, dtype=torch.long)


def _sdpa(q, k, v, mask, scale):
    if q.shape[1] == k.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    try:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    except TypeError:  # torch < 2.5 has no enable_gqa: repeat the kv heads
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _host_lengths(ctx_lens: torch.Tensor, q: torch.Tensor) -> bool:
    from .. import ops  # ops imports this module

    return ctx_lens.device.type == "cpu" and ops.backend(q.device) == "host"


def tree_attention_reference(q, k_ctx, v_ctx, ctx_lens, k_tree, v_tree, d: int, scale: float) -> torch.Tensor:
    """torch reference: one SDPA call over cat(context[:max ctx_len], tree) with a dense boolean mask."""
    batch, _, n_tree, _ = q.shape
    same = ctx_lens.device == q.device and ctx_lens.dtype == torch.long
    lens = ctx_lens if same else ctx_lens.to(device=q.device, dtype=torch.long)
    # only the host backend reads host lengths (to skip unused columns): on a device, as in the Triton launcher or
    # a captured step, the whole cache is read and the mask hides the columns past each row's length
    n_ctx = (int(ctx_lens.max()) if _host_lengths(ctx_lens, q) else k_ctx.shape[2]) if batch else 0
    keys = torch.cat([k_ctx[:, :, :n_ctx], k_tree], dim=2)
    values = torch.cat([v_ctx[:, :, :n_ctx], v_tree], dim=2)
    ctx_visible = torch.arange(n_ctx, device=q.device)[None, :] < lens[:, None]
    mask = torch.cat([ctx_visible[:, None, None, :].expand(batch, 1, n_tree, n_ctx),
                      tree_mask(d, str(q.device))[None, None].expand(batch, 1, n_tree, n_tree)], dim=-1)
    return _sdpa(q, keys, values, mask, scale)


# ---------------------------------------------------------------------------------------------- Triton

@kernel
def _attend(q, k, v, visible, m_i, l_i, acc, qk_scale, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step over a key tile (k is [HEAD_DIM, BLOCK_N], scores in the log2 domain)."""
    if UPCAST:
        s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision=PRECISION)
    else:
        s = tl.dot(q, k, input_precision=PRECISION)
    s = tl.where(visible, s * qk_scale, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # rows that have seen no visible key yet keep m = -inf; subtract 0 instead to avoid inf - inf
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(v.dtype)
    if UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision=PRECISION)
    else:
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@kernel
def _tree_attention_fwd(
        Q, KC, VC, KT, VT, CTX_LENS, O, O_PART, LSE_PART,
        sq_b, sq_h, sq_m, skc_b, skc_h, skc_n, svc_b, svc_h, svc_n,
        skt_b, skt_h, skt_n, svt_b, svt_h, svt_n, so_b, so_h, so_m,
        n_kv_heads, group, d, n_tree, chunk, qk_scale,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
        UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # program = (batch row x kv head, block of the group's query rows, context split)
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    h = (pid_bh % n_kv_heads).to(tl.int64)
    n_rows = group * n_tree
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    i = rows % n_tree  # tree row; rows of the GQA group's query heads are stacked
    head = h * group + rows // n_tree
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * sq_b + head[:, None] * sq_h + i[:, None] * sq_m + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    row_is_branch = i > d
    row_branch = tl.where(row_is_branch, (i - d - 1) // d, -1)
    row_limit = tl.where(row_is_branch, row_branch, i)

    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    ctx_len = tl.load(CTX_LENS + b)
    n_lo = pid_s * chunk
    n_hi = tl.minimum(n_lo + chunk, ctx_len)
    for start in range(n_lo, n_hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < n_hi
        k = tl.load(KC + b * skc_b + h * skc_h + keys[None, :] * skc_n + dims[:, None],
                    mask=key_ok[None, :], other=0.0)
        v = tl.load(VC + b * svc_b + h * svc_h + keys[:, None] * svc_n + dims[None, :],
                    mask=key_ok[:, None], other=0.0)
        m_i, l_i, acc = _attend(q, k, v, key_ok[None, :], m_i, l_i, acc, qk_scale, UPCAST, PRECISION)

    if pid_s == 0:  # the first split also covers the tree keys
        for start in range(0, n_tree, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            key_ok = keys < n_tree
            key_is_branch = keys > d
            key_branch = tl.where(key_is_branch, (keys - d - 1) // d, -1)
            visible = tl.where(key_is_branch[None, :], key_branch[None, :] == row_branch[:, None],
                               keys[None, :] <= row_limit[:, None]) & key_ok[None, :]
            k = tl.load(KT + b * skt_b + h * skt_h + keys[None, :] * skt_n + dims[:, None],
                        mask=key_ok[None, :], other=0.0)
            v = tl.load(VT + b * svt_b + h * svt_h + keys[:, None] * svt_n + dims[None, :],
                        mask=key_ok[:, None], other=0.0)
            m_i, l_i, acc = _attend(q, k, v, visible, m_i, l_i, acc, qk_scale, UPCAST, PRECISION)

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if SPLIT:
        part = (pid_s * tl.num_programs(0) + pid_bh).to(tl.int64) * n_rows + rows
        tl.store(O_PART + part[:, None] * HEAD_DIM + dims[None, :], out, mask=row_ok[:, None])
        tl.store(LSE_PART + part, tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), -float("inf")),
                 mask=row_ok)
    else:
        tl.store(O + b * so_b + head[:, None] * so_h + i[:, None] * so_m + dims[None, :],
                 out.to(O.dtype.element_ty), mask=row_ok[:, None])


@kernel
def _tree_attention_combine(O_PART, LSE_PART, O, so_b, so_h, so_m, n_kv_heads, group, n_tree, n_splits,
                            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """Merge the context splits' normalised partial outputs by their log-sum-exp (flash-decoding)."""
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    n_bh = tl.num_programs(0)
    n_rows = group * n_tree
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    dims = tl.arange(0, HEAD_DIM)
    m_run = tl.full([BLOCK_M], -float("inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for s in range(0, n_splits):
        part = (s * n_bh + pid_bh).to(tl.int64) * n_rows + rows
        lse = tl.load(LSE_PART + part, mask=row_ok, other=-float("inf"))
        o = tl.load(O_PART + part[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None], other=0.0)
        m_new = tl.maximum(m_run, lse)
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_run - m_safe)
        w = tl.math.exp2(lse - m_safe)
        den = den * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o
        m_run = m_new
    b = (pid_bh // n_kv_heads).to(tl.int64)
    head = (pid_bh % n_kv_heads).to(tl.int64) * group + rows // n_tree
    out = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    tl.store(O + b * so_b + head[:, None] * so_h + (rows % n_tree)[:, None] * so_m + dims[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None])


_BLOCK_M, _BLOCK_N = 64, 64


def _pick_splits(programs: int, n_ctx: int, device: torch.device) -> int:
    """Split long contexts until the grid fills the device about twice (flash-decoding)."""
    wanted = cdiv(2 * num_sms(device), max(programs, 1))
    return max(1, min(wanted, cdiv(n_ctx, 4 * _BLOCK_N)))


def tree_attention_triton(q, k_ctx, v_ctx, ctx_lens, k_tree, v_tree, d: int, scale: float,
                          *, num_splits: int | None = None) -> torch.Tensor:
    """Triton tree attention (same contract as the reference; inputs validated by dpara_rt.ops).

    num_splits: how many programs share one context (None: chosen from the device size).
    """
    load()
    check_device(q, k_ctx, v_ctx, k_tree, v_tree)
    batch, n_q_heads, n_tree, head_dim = q.shape
    n_kv_heads = k_ctx.shape[1]
    group = n_q_heads // n_kv_heads
    lens = ctx_lens.to(device=q.device, dtype=torch.int32)
    # a host-side length bounds the splits without a device sync; else the cache capacity does
    n_ctx = int(ctx_lens.max()) if ctx_lens.device.type == "cpu" and batch else k_ctx.shape[2]
    m_blocks = cdiv(group * n_tree, _BLOCK_M)
    if num_splits is None:
        num_splits = _pick_splits(batch * n_kv_heads * m_blocks, n_ctx, q.device)
    chunk = max(1, cdiv(cdiv(n_ctx, num_splits), _BLOCK_N)) * _BLOCK_N  # whole key tiles per split
    num_splits = max(1, cdiv(n_ctx, chunk))
    out = torch.empty_like(q)
    split = num_splits > 1
    if split:
        o_part = torch.empty(num_splits, batch * n_kv_heads, group * n_tree, head_dim, device=q.device,
                             dtype=torch.float32)
        lse_part = torch.empty(num_splits, batch * n_kv_heads, group * n_tree, device=q.device, dtype=torch.float32)
    else:
        o_part = lse_part = out  # unused
    upcast, precision = dot_options(q.dtype)
    grid = (batch * n_kv_heads, m_blocks, num_splits)
    _tree_attention_fwd[grid](
        q, k_ctx, v_ctx, k_tree, v_tree, lens, out, o_part, lse_part,
        q.stride(0), q.stride(1), q.stride(2), k_ctx.stride(0), k_ctx.stride(1), k_ctx.stride(2),
        v_ctx.stride(0), v_ctx.stride(1), v_ctx.stride(2), k_tree.stride(0), k_tree.stride(1), k_tree.stride(2),
        v_tree.stride(0), v_tree.stride(1), v_tree.stride(2), out.stride(0), out.stride(1), out.stride(2),
        n_kv_heads, group, d, n_tree, chunk, scale * LOG2E,
        HEAD_DIM=head_dim, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, SPLIT=split, UPCAST=upcast, PRECISION=precision,
        num_warps=4, num_stages=2)
    if split:
        _tree_attention_combine[(batch * n_kv_heads, m_blocks)](
            o_part, lse_part, out, out.stride(0), out.stride(1), out.stride(2), n_kv_heads, group, n_tree, num_splits,
            HEAD_DIM=head_dim, BLOCK_M=_BLOCK_M, num_warps=4)
    return out
