"""Training layouts and the DSpark distillation loss, shared by stage 1 and stage 2 (M-DFlash).

Many layouts are packed per sequence into one backbone forward: layout m starts at anchor position
A[m], sees context rows p < A[m] only, and is block-diagonal with the other layouts. Every predicting
row at position P is scored against the target's distribution ``logits[P]`` (the token at P+1), with
the Markov head applied teacher-forced: its previous token is the true token at P (x_0 = the anchor
in stage 1, the true bonus in stage 2). Under DFlash's convention (a layout's ``lead`` of 1) a mask row
drafts its own position: the row at position P is scored against ``logits[P - 1]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpara_rt.host.linear import HostLinear
from dpara_rt.models.drafter import MASK_ID, Drafter, dense_attend, serial_layout, tree_layout
from dpara_rt.train.data import TrainData


@dataclass(frozen=True, eq=False)  # hashed by identity: cached per (d, packing)
class Layout:
    """One training layout: row offsets from its anchor, row visibility, which rows carry true tokens
    (the rest are MASK), which rows predict (groups of d consecutive rows, one per block/branch) and how
    far a predicting row stands past the position whose next token it drafts (``lead``)."""
    name: str
    d: int
    offsets: Tensor
    visible: Tensor
    token_rows: Tensor
    logit_rows: Tensor
    lead: int = 0

    @property
    def rows(self) -> int:
        return self.offsets.numel()

    @property
    def reach(self) -> int:
        """Largest offset of a scored position: the anchor needs the token at anchor + reach + 1."""
        return int(self.offsets[self.logit_rows].max()) - self.lead


@lru_cache(maxsize=16)
def dspark_layout(d: int) -> Layout:
    """Stage 1: the serial block [anchor, MASK x (d-1)]."""
    offsets, visible = serial_layout(d, 0)
    return Layout("dspark", d, offsets, visible, torch.arange(d) == 0, torch.arange(d))


@lru_cache(maxsize=16)
def dflash_layout(d: int) -> Layout:
    """Stage 1 of a DFlash drafter (draft_rows "mask"): the block [anchor, MASK x d], the mask rows draft."""
    offsets, visible = serial_layout(d + 1, 0)
    return Layout("dflash", d, offsets, visible, torch.arange(d + 1) == 0, torch.arange(1, d + 1), lead=1)


@lru_cache(maxsize=16)
def mdflash_layout(d: int) -> Layout:
    """Stage 2: spine s_0..s_d (the true continuation) plus branches r = 0..d."""
    offsets, visible = tree_layout(d)
    q = offsets.numel()
    return Layout("mdflash", d, offsets, visible, torch.arange(q) <= d, torch.arange(d + 1, q))


def anchor_range(data: TrainData, layout: Layout) -> tuple[Tensor, Tensor]:
    """Per sequence, the first and last anchor whose layout fits inside the continuation and its targets."""
    lo = (data.prompt_lens - 1).clamp(min=1)  # at least one context row before the anchor
    hi = data.lengths - 2 - layout.reach
    return lo, hi


def position_weights(d: int, device=None) -> Tensor:
    """exp(-(k-1)/d) for k = 1..d: early positions matter most, every later one needs them accepted."""
    return torch.exp(-torch.arange(d, device=device, dtype=torch.float32) / d)


@lru_cache(maxsize=16)
def _packed_visible(layout: Layout, m: int) -> Tensor:
    return torch.block_diag(*[layout.visible] * m)


def sample_anchors(data: TrainData, index: Tensor, layout: Layout, m: int, generator: torch.Generator) -> Tensor:
    """m anchors per sequence, uniform over each sequence's valid range -> [len(index), m]."""
    lo, hi = anchor_range(data, layout)
    lo, hi = lo[index], hi[index]
    if (hi < lo).any():
        bad = int(index[(hi < lo).nonzero()[0]])
        raise ValueError(f"sequence {bad} (length {int(data.lengths[bad])}, prompt {int(data.prompt_lens[bad])}) "
                         f"is too short for a {layout.name} layout with d={layout.d}")
    u = torch.rand(len(index), m, generator=generator)
    return lo[:, None] + (u * (hi - lo + 1)[:, None]).long()


def layout_loss(drafter: Drafter, data: TrainData, index: Tensor, anchors: Tensor, layout: Layout,
                ce_weight: float, tv_weight: float, temperature: float = 1.0) -> Tensor:
    """The weighted 0.1 CE + 0.9 TV loss of the drafter (backbone + teacher-forced Markov head) on
    ``anchors`` [B, M] of sequences ``index`` [B], all layouts of a sequence in one forward."""
    dev = drafter.device
    b, m = anchors.shape
    q, d = layout.rows, layout.d
    tokens = data.tokens[index]
    pos = (anchors[:, :, None] + layout.offsets).reshape(b, m * q)
    true_tok = tokens.gather(1, pos)
    rows = torch.where(layout.token_rows.repeat(m), true_tok, torch.full_like(true_tok, MASK_ID))
    n_ctx = int(anchors.max())  # no layout sees context at or beyond its anchor
    ctx_visible = (torch.arange(n_ctx) < anchors[:, :, None]).repeat_interleave(q, dim=1)
    logit_rows = (torch.arange(m)[:, None] * q + layout.logit_rows).reshape(-1)
    pred_pos = pos[:, logit_rows] - layout.lead  # the positions whose next token the rows draft
    prev_tok = tokens.gather(1, pred_pos)  # the Markov head's teacher-forced previous token
    if data.cache == "hidden":  # a large vocabulary: head, Markov bias and loss fused per row chunk
        feats = data.features[index, :n_ctx].to(dev)
        ctx_kv = drafter.context_kv(feats, torch.arange(n_ctx, device=dev).expand(b, n_ctx))
        attend = dense_attend(ctx_visible.to(dev), _packed_visible(layout, m).to(dev)[None], drafter.scale)
        h = drafter.backbone(rows.to(dev), pos.to(dev), ctx_kv, attend)[:, logit_rows.to(dev)]
        target_h = data.hidden[index[:, None], pred_pos].to(dev)
        return head_distill_loss(h, prev_tok.to(dev), target_h, drafter, d, ce_weight, tv_weight, temperature)
    z = drafter(data.features[index, :n_ctx].to(dev), rows.to(dev), pos.to(dev), ctx_visible.to(dev),
                _packed_visible(layout, m).to(dev)[None], logit_rows.to(dev))
    z = z + drafter.markov_bias(prev_tok.to(dev))
    target = data.target_logits(index[:, None], pred_pos, drafter.lm_head, dev)
    return distill_loss(z.view(b, -1, d, z.shape[-1]), target.view(b, -1, d, z.shape[-1]),
                        ce_weight, tv_weight, temperature)


def distill_loss(z: Tensor, target_logits: Tensor, ce_weight: float, tv_weight: float,
                 temperature: float = 1.0) -> Tensor:
    """z, target_logits [..., d, V]: position-weighted ce_weight * CE(p, q) + tv_weight * TV(p, q),
    p = softmax(target / temperature) the target's distribution, q = softmax(z) the drafter's."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: the target distribution needs temperature > 0")
    log_q = F.log_softmax(z.float(), dim=-1)
    p = F.softmax(target_logits.float() / temperature, dim=-1)
    ce = -(p * log_q).sum(-1)
    tv = 0.5 * (p - log_q.exp()).abs().sum(-1)
    w = position_weights(z.shape[-2], z.device)
    per_block = ((ce_weight * ce + tv_weight * tv) * w).sum(-1) / w.sum()
    return per_block.mean()


_TRANSPOSED: dict[int, tuple] = {}


def transposed_head(head: nn.Linear) -> HostLinear:
    """A frozen HostLinear computing ``x @ W`` for the output head's W [V, H] (the gradient's way back through it),
    kept while the head's weight and host math stay the same."""
    w = head.weight
    key = (w.data_ptr(), w._version, getattr(head, "host_math", "float32"))
    cached = _TRANSPOSED.get(id(head))
    if cached is None or cached[0] != key:
        t = HostLinear(w.shape[0], w.shape[1], bias=False, device=w.device, dtype=w.dtype).requires_grad_(False)
        t.weight.data = w.detach().t().contiguous()
        t.host_math = key[2]
        cached = _TRANSPOSED[id(head)] = (key, t)
    return cached[1]


class _HeadDistill(torch.autograd.Function):
    """sum_r row_w[r] * (ce_w CE(p_r, q_r) + tv_w TV(p_r, q_r)) with q_r = softmax(head(h_r) + a_r @ W2) and
    p_r = softmax(head(target_h_r) / T), row chunk by row chunk: no [R, V] tensor outlives its chunk and the
    gradients (dz = ce_w (q - p) + tv_w q (s - <q, s>), s = sign(q - p) / 2) are taken in the same pass."""

    @staticmethod
    def forward(ctx, h, a, w2, target_h, row_w, head, ce_w, tv_w, temperature, chunk):
        head_t = transposed_head(head)
        markov_grad = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        gh, ga, gw2 = torch.empty_like(h), torch.empty_like(a), torch.zeros_like(w2)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        for i in range(0, h.shape[0], chunk):
            sl = slice(i, i + chunk)
            z = head(h[sl].contiguous()).float().addmm_(a[sl], w2)
            log_q = torch.log_softmax(z, dim=-1)
            q = log_q.exp()
            p = torch.softmax(head(target_h[sl].contiguous()).float().div_(temperature), dim=-1)
            ce = -(p * log_q).sum(-1)
            diff = q - p
            tv = 0.5 * diff.abs().sum(-1)
            w = row_w[sl]
            loss += (w * (ce_w * ce + tv_w * tv)).sum()
            s = diff.sign_().mul_(0.5)
            dz = s.sub_((q * s).sum(-1, keepdim=True)).mul_(q).mul_(tv_w)
            dz.add_(q.sub_(p), alpha=ce_w).mul_(w[:, None])
            gh[sl] = head_t(dz)
            if markov_grad:
                ga[sl] = dz @ w2.t()
                gw2.addmm_(a[sl].t(), dz)
        ctx.save_for_backward(gh, ga, gw2)
        return loss

    @staticmethod
    def backward(ctx, grad):
        gh, ga, gw2 = ctx.saved_tensors
        need = ctx.needs_input_grad
        return (gh * grad, ga * grad if need[1] else None, gw2 * grad if need[2] else None,
                None, None, None, None, None, None, None)


def head_distill_loss(h: Tensor, prev: Tensor, target_h: Tensor, drafter: Drafter, d: int, ce_weight: float,
                      tv_weight: float, temperature: float = 1.0, chunk: int = 64) -> Tensor:
    """distill_loss over the drafter's logits head(h) + markov_bias(prev) against the target's head(target_h),
    for h, target_h [B, R, H] (R = blocks * d rows) and prev [B, R]: the same loss and gradients, computed without
    [B, R, V] tensors (the target's logits are recomputed from its final-normed hidden state)."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: the target distribution needs temperature > 0")
    b, r, hid = h.shape
    if r % d:
        raise ValueError(f"{r} predicting rows per sequence are not whole blocks of d={d}")
    w = position_weights(d, h.device)
    row_w = (w / w.sum()).repeat(r // d).expand(b, r).reshape(-1) / (b * (r // d))
    head = drafter.lm_head
    return _HeadDistill.apply(h.reshape(-1, hid).float(), drafter.w1[prev.reshape(-1)].float(), drafter.w2.float(),
                              target_h.reshape(-1, hid).float(), row_w, head, ce_weight, tv_weight,
                              float(temperature), chunk)


def greedy_match(draft: Tensor, truth: Tensor) -> Tensor:
    """Accepted length r per row: the longest prefix where draft == truth ([B, d] each)."""
    return (draft == truth).long().cumprod(dim=1).sum(dim=1)


__all__ = ["Layout", "anchor_range", "dflash_layout", "distill_loss", "dspark_layout", "greedy_match",
           "head_distill_loss", "layout_loss", "mdflash_layout", "position_weights", "sample_anchors",
           "transposed_head"]
