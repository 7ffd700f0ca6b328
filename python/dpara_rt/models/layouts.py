"""The drafter's two layouts, shared by the runtime and training: (a) a serial block after an anchor, (b) the
spine and its d+1 branches (docs/design.md §1)."""
from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from dpara_rt.kernels.tree_attention import tree_mask, tree_position_offsets


@lru_cache(maxsize=64)
def serial_layout(d: int, prefix_len: int = 0) -> tuple[Tensor, Tensor]:
    """Layout (a): ``prefix_len`` feature-less tokens (causal), then the block ``[anchor, MASK x (d-1)]``.

    Returns position offsets (relative to the cache length) [P+d] and visibility [P+d, P+d]
    (row attends to column). Block rows see the whole prefix and the block bidirectionally.
    """
    q = prefix_len + d
    visible = torch.ones(q, q, dtype=torch.bool).tril_()
    visible[prefix_len:, prefix_len:] = True
    return torch.arange(q), visible


@lru_cache(maxsize=64)
def tree_layout(d: int) -> tuple[Tensor, Tensor]:
    """Layout (b): spine s_0..s_d then branch r = 0..d (d rows each); offsets [Q] and visibility [Q, Q]
    (cached: do not modify). The core's tree metadata owns the layout; this is its torch form.

    Spine i sits at offset i and sees spine 0..i; branch r row j sits at offset r+1+j (its first row
    stands where the unknown bonus will be) and sees spine 0..r plus all of branch r.
    """
    return tree_position_offsets(d), tree_mask(d)


@lru_cache(maxsize=64)
def host_tree_layout(d: int, lead: int, branches: int | None = None) -> tuple[Tensor, Tensor, int]:
    """Layout (b) as the host backbone runs it for branches 0..branches-1 (default all d+1): offsets [Q'],
    visibility [Q', Q'] (uint8) and keep_from. The host backbone takes its rows in any order, so it skips what
    the output never depends on: the spine past s_{branches-1} and the branches after it (with a lead, DFlash's
    bonus slot, w = d + lead, that is at least branch w and the spine entry only it sees), and past the last
    layer's attention every row but the branches' draft rows, which come last: the output is the draft rows of
    the branches [branches d]. Each kept row sees the same rows in the same order as in tree_layout(w), so its
    outputs are the same bits."""
    k = d + 1 if branches is None else branches
    w = d + lead
    offsets, visible = tree_layout(w)
    first = w + 1  # branch r's row j is tree row first + r w + j
    rows = (list(range(k)) + [first + r * w + j for r in range(k) for j in range(lead)]
            + [first + r * w + j for r in range(k) for j in range(lead, w)])
    rows = torch.tensor(rows)
    return offsets[rows], visible[rows][:, rows].to(torch.uint8).contiguous(), k * (1 + lead)


__all__ = ["host_tree_layout", "serial_layout", "tree_layout"]
