"""The reference round: one prompt decoded greedily in plain torch, one round at a time (docs/design.md §1).

No KV cache, lanes or ring: each round runs the target over the whole sequence and the drafter's forward (fc,
backbone, output head) over every target feature known so far (the models pick their own kernels; the tests run
them on the torch path). Slow on purpose, and meant to be
read: AR, DSpark's serial draft and DPara's spine + branches tree side by side. tests/test_reference_round.py uses
it as the oracle that the engine's methods must match, token for token and round for round.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from dpara_rt.models.drafter import MASK_ID, serial_layout, tree_layout

METHODS = ("ar", "dspark", "dpara")


def target_forward(model, seq: list[int], layer_ids: Sequence[int]) -> tuple[Tensor, Tensor | None]:
    """The target over the whole sequence, causal, no cache: logits [T, V] and the feature layers' outputs [T, F]."""
    logits, feats = model(torch.tensor([seq]), torch.arange(len(seq))[None], layer_ids=layer_ids)
    return logits[0], None if feats is None else feats[0]


def drafter_rows(drafter, context: Tensor, rows: list[int], offsets: Tensor, visible: Tensor) -> Tensor:
    """The drafter's logits [Q, V] for block rows ``rows`` (token ids, MASK_ID for a mask row) standing at positions
    len(context) + offsets. Each row sees all of the context (KV injection: the target features [N, F] through fc
    give every layer extra keys and values) and the rows that ``visible`` [Q, Q] marks."""
    n, q = context.shape[0], len(rows)
    return drafter(context[None], torch.tensor([rows]), (n + offsets)[None], torch.ones(1, q, n, dtype=torch.bool),
                   visible[None])[0]


def markov_walk(drafter, logits: Tensor, x0: int) -> list[int]:
    """DSpark's Markov head, greedy: z_j = L_j + W1[x_{j-1}] @ W2 and x_j = argmax z_j, walked j = 1..d from x_0."""
    w1, w2 = drafter.markov_factors()  # a zero pair without a head (markov_rank 0): the backbone's own tokens
    walk = [x0]
    for row in logits.float():
        walk.append(int((row + w1[walk[-1]] @ w2).argmax()))
    return walk[1:]


def reference_decode(target_model, drafter, prompt: list[int], max_new_tokens: int, d: int, method: str = "dpara",
                     eos_ids=()) -> tuple[list[int], list[int]]:
    """Greedy decode of ``prompt`` -> (new tokens, the accepted length r of every round). The prefill's token is
    s_0 of round 1; AR rounds verify s_0 alone (r = 0). ``target_model``: a Qwen3ForCausalLM (or a Target)."""
    if method not in METHODS:
        raise ValueError(f"method {method!r}; expected one of {METHODS}")
    if drafter is None and method != "ar":
        raise ValueError(f"method {method!r} drafts: it needs a drafter")
    model = getattr(target_model, "model", target_model)
    with torch.inference_mode():
        return _decode(model, drafter, list(prompt), max_new_tokens, d, method, set(eos_ids))


def _decode(model, drafter, prompt, max_new_tokens, d, method, eos):
    layer_ids = [] if method == "ar" else drafter.config.layer_ids  # the target layers the drafter reads
    lead = 0 if method == "ar" else drafter.config.lead  # 1 under DFlash's "mask" rows: the anchor row drafts nothing
    logits, feats = target_forward(model, prompt, layer_ids)
    out, accepted, draft = [int(logits[-1].argmax())], [], []
    while out[-1] not in eos and len(out) < max_new_tokens:
        seq = prompt + out  # committed; the last token, s_0 (the last bonus), has no target features yet
        context = None if feats is None else feats[:len(seq) - 1]
        if method == "dspark":  # serial: the backbone over [anchor = s_0, MASK x (d-1)], then the Markov head
            offsets, visible = serial_layout(d + lead)
            rows = drafter_rows(drafter, context, [seq[-1]] + [MASK_ID] * (d - 1 + lead), offsets, visible)
            draft = markov_walk(drafter, rows[lead:], seq[-1])
        elif method == "dpara":  # beside the verify: spine s_0..s_d (feature-less, causal) + branch r = 0..d
            w = d + lead
            offsets, visible = tree_layout(w)  # branch r: w MASK rows from s_0 + r + 1, seeing spine 0..r and itself
            spine = [seq[-1]] + draft
            spine += spine[-1:] * (w + 1 - len(spine))  # round 1's lone s_0, padded: branch 0 never sees the pad
            rows = drafter_rows(drafter, context, spine + [MASK_ID] * ((w + 1) * w), offsets, visible)
            branches = rows[w + 1:].view(w + 1, w, -1)[:, lead:]  # [r, j, V]: the boundary logits
        # verify [s_0, t_1..t_k] (k = d, or 0: AR, DPara's round 1): p_0..p_k, and the next round's context
        logits, feats = target_forward(model, seq + draft, layer_ids)
        best = logits[len(seq) - 1:].argmax(-1).tolist()  # argmax p_0..p_k
        r = 0
        while r < len(draft) and draft[r] == best[r]:
            r += 1
        accepted.append(r)
        for t in draft[:r] + [best[r]]:  # commit t_1..t_r and the bonus, cut at EOS or max_new_tokens
            out.append(t)
            if t in eos or len(out) == max_new_tokens:
                break
        if method == "dpara":  # (r, bonus) known: only the Markov head, on branch r from x_0 = bonus
            draft = markov_walk(drafter, branches[r], best[r])
    return out, accepted


__all__ = ["METHODS", "drafter_rows", "markov_walk", "reference_decode", "target_forward"]
