"""Held-out tau: simulated greedy speculative rounds against the target's greedy continuation.

Round semantics (docs/design.md §1): with tokens 0..c-1 committed, the anchor is token c-1 (the last bonus),
the drafter's context holds features 0..c-2, and the draft proposes tokens c..c+d-1. The target's
greedy continuation is the ground truth, so r = matching prefix length, the bonus is token c+r and
the round commits r+1 tokens. tau = mean(r + 1).

``mode="dspark"``: every round drafts from layout (a) with the bonus as anchor.
``mode="dpara"``: round k+1 drafts from branch r_k of the boundary logits computed over the spine
[anchor_k, draft_k] before round k's outcome was known (the first round uses layout (a)).
"""
from __future__ import annotations

import warnings

import torch

from dpara_rt.models.drafter import Drafter
from dpara_rt.train.data import TrainData
from dpara_rt.train.objectives import greedy_match

MODES = ("dspark", "dpara")


def _markov_greedy(drafter: Drafter, boundary, r, bonus):
    """Greedy Markov-head walk from x_0 = bonus over boundary[:, r] (the fused op; torch on the CPU); without a
    head (rank 0) the argmax of the branch."""
    from dpara_rt.ops import markov_head

    draft, _ = markov_head(boundary, r, bonus, *drafter.markov_factors(dtype=None), temperature=0.0)
    return draft


def _serial_draft(drafter: Drafter, cache, anchor, d: int):
    """Layout (a) + Markov head: what DSpark drafts for ``anchor`` on the current context."""
    r0 = torch.zeros(1, dtype=torch.long, device=anchor.device)
    return _markov_greedy(drafter, drafter.block_logits(cache, anchor, d)[:, None], r0, anchor)


@torch.no_grad()
def estimate_tau(drafter: Drafter, data: TrainData, d: int, mode: str = "dspark",
                 max_sequences: int | None = None) -> float:
    """Mean committed tokens per round (bonus included) over the held-out sequences of ``data``."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {MODES}")
    if data.layer_ids != drafter.config.layer_ids:
        raise ValueError(f"held-out data captured layers {data.layer_ids}; the drafter uses {drafter.config.layer_ids}")
    if data.temperature != 0:
        warnings.warn(f"held-out data was sampled at temperature {data.temperature}: tau against it "
                      "is not the greedy acceptance length", RuntimeWarning, stacklevel=2)
    dev = drafter.device
    committed, rounds = 0, 0
    n_seq = len(data) if max_sequences is None else min(len(data), max_sequences)
    for s in range(n_seq):
        length, c = int(data.lengths[s]), int(data.prompt_lens[s])
        truth, feats = data.tokens[s].to(dev), data.features[s:s + 1].to(dev)
        cache = drafter.new_context_cache(1, length)
        drafter.extend_context(cache, feats[:, :c - 1], torch.tensor([c - 1]))
        anchor = truth[c - 1:c]
        draft = _serial_draft(drafter, cache, anchor, d)
        while c + d < length:  # the ground truth covers the draft and the bonus
            if mode == "dpara":  # runs while the target would be verifying [anchor, draft]
                boundary = drafter.boundary_logits(cache, torch.cat([anchor, draft[0]])[None])
            r = int(greedy_match(draft, truth[None, c:c + d]))
            committed, rounds = committed + r + 1, rounds + 1
            drafter.extend_context(cache, feats[:, c - 1:c + r], torch.tensor([r + 1]))
            c += r + 1
            anchor = truth[c - 1:c]
            if mode == "dpara":
                draft = _markov_greedy(drafter, boundary, torch.tensor([r], device=dev), anchor)
            else:
                draft = _serial_draft(drafter, cache, anchor, d)
    if rounds == 0:
        raise ValueError(f"no held-out sequence has room for a round of d={d} past its prompt")
    return committed / rounds
