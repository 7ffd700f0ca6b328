"""Training layouts and the DSpark distillation loss, shared by stage 1 and stage 2 (M-DFlash).

Many layouts are packed per sequence into one backbone forward: layout m starts at anchor position
A[m], sees context rows p < A[m] only, and is block-diagonal with the other layouts. Every predicting
row at position P is scored against the target's distribution ``logits[P]`` (the token at P+1), with
the Markov head applied teacher-forced: its previous token is the true token at P (x_0 = the anchor
in stage 1, the true bonus in stage 2).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor

from dpara_rt.models.drafter import MASK_ID, Drafter, serial_layout, tree_layout
from dpara_rt.train.data import TrainData


@dataclass(frozen=True, eq=False)  # hashed by identity: cached per (d, packing)
class Layout:
    """One training layout: row offsets from its anchor, row visibility, which rows carry true tokens
    (the rest are MASK) and which rows predict (groups of d consecutive rows, one per block/branch)."""
    name: str
    d: int
    offsets: Tensor
    visible: Tensor
    token_rows: Tensor
    logit_rows: Tensor

    @property
    def rows(self) -> int:
        return self.offsets.numel()

    @property
    def reach(self) -> int:
        """Largest offset of a row whose target is needed: the anchor needs the token at anchor + reach + 1."""
        return int(self.offsets[self.logit_rows].max())


@lru_cache(maxsize=16)
def dspark_layout(d: int) -> Layout:
    """Stage 1: the serial block [anchor, MASK x (d-1)]."""
    offsets, visible = serial_layout(d, 0)
    return Layout("dspark", d, offsets, visible, torch.arange(d) == 0, torch.arange(d))


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
    z = drafter(data.features[index, :n_ctx].to(dev), rows.to(dev), pos.to(dev), ctx_visible.to(dev),
                _packed_visible(layout, m).to(dev)[None], logit_rows.to(dev))
    pred_pos = pos[:, logit_rows]
    z = z + drafter.markov_bias(true_tok[:, logit_rows].to(dev))
    target = data.logits[index[:, None], pred_pos].to(dev)
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


def greedy_match(draft: Tensor, truth: Tensor) -> Tensor:
    """Accepted length r per row: the longest prefix where draft == truth ([B, d] each)."""
    return (draft == truth).long().cumprod(dim=1).sum(dim=1)


__all__ = ["Layout", "anchor_range", "distill_loss", "dspark_layout", "greedy_match", "layout_loss",
           "mdflash_layout", "position_weights", "sample_anchors"]
