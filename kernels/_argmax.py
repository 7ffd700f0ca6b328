"""Triton device helpers for arg-max over a vocabulary split into tiles and into programs ("splits").

Ties resolve to the lowest index everywhere (as torch.argmax does): within a tile via tie_break_left,
across tiles by replacing only on a strictly larger value, across splits by taking the lowest split,
which covers the lowest vocabulary range.
"""
from __future__ import annotations

from .triton_support import kernel

tl = None  # bound to triton.language by triton_support.load()


@kernel
def argmax_update(best_val, best_idx, score, start):
    """Fold a [ROWS, BLOCK] tile of scores whose column 0 is index `start` (invalid entries -inf)."""
    tile_val = tl.max(score, axis=1)
    tile_idx = start + tl.argmax(score, axis=1, tie_break_left=True).to(tl.int32)
    better = tile_val > best_val
    return tl.where(better, tile_val, best_val), tl.where(better, tile_idx, best_idx)


@kernel
def reduce_split_argmax(val_ptr, idx_ptr, rows, row_mask, n_splits, SPLITS: tl.constexpr):
    """Combine the partial (value, index) pairs stored row-major at [row, split] into one index per row."""
    split = tl.arange(0, SPLITS)
    offs = rows[:, None].to(tl.int64) * n_splits + split[None, :]
    mask = row_mask[:, None] & (split[None, :] < n_splits)
    vals = tl.load(val_ptr + offs, mask=mask, other=-float("inf"))
    idxs = tl.load(idx_ptr + offs, mask=mask, other=0)
    best = tl.argmax(vals, axis=1, tie_break_left=True)
    return tl.sum(tl.where(split[None, :] == best[:, None], idxs, 0), axis=1)
