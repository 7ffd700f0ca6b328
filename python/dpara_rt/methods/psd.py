"""PSD with fallback (PEARL / SSD family): guess the verification outcome, draft for the guess while the
target verifies, fall back to serial drafting when the guess misses.

The guessed draft for an outcome (r, b) is a DSpark block [b, MASK x d] behind the feature-less spine
s_0..s_r (the target's features for the spine are being computed at that moment). Policies:
- ``pearl``: all d accepted, bonus = the drafter's own next token after t_d (one guess);
- ``ssd``: the top-F outcomes (r, b) by the drafter's own probabilities.
A round hits when every running request's outcome is among its guesses; one miss stalls the whole batch.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dpara_rt.methods.common import Decoder
from dpara_rt.models.drafter import MASK_ID, dense_attend, serial_layout

POLICIES = ("pearl", "ssd")


def draft_probs(dec: Decoder, logits: Tensor, anchor: Tensor, draft: Tensor) -> Tensor:
    """The drafter's distribution at each drafted position, softmax(L_j + W1[x_{j-1}] W2), [B, n, V]."""
    prev = torch.cat([anchor[:, None], draft[:, :-1]], dim=1).to(logits.device)
    return torch.softmax((logits + dec.drafter.markov_bias(prev)).float(), dim=-1)


def guesses(dec: Decoder, draft: Tensor, q_all: Tensor, policy: str, fanout: int) -> list[tuple[Tensor, Tensor]]:
    """Guessed outcomes as a list of (r [B], bonus [B]); draft and q_all cover d+1 positions."""
    d = dec.d
    B = draft.shape[0]
    if policy == "pearl":
        return [(torch.full((B,), d, dtype=torch.long), draft[:, d].clone())]
    # log P(r, b) = sum_{i<=r} log q_i(t_i) + log q_{r+1}(b), with b != t_{r+1} when r < d.
    q = q_all.cpu()
    logq_draft = torch.log(q.gather(-1, draft[:, :, None]).squeeze(-1).clamp_min(1e-30))  # [B, d+1]
    prefix = torch.cat([torch.zeros(B, 1), logq_draft[:, :d].cumsum(1)], dim=1)            # [B, d+1]
    logq_next = torch.log(q.clamp_min(1e-30))                                             # [B, d+1, V]
    rejected = draft[:, :d, None]
    logq_next[:, :d].scatter_(-1, rejected, float("-inf"))  # rejecting t_{r+1} means the bonus differs from it
    k = min(fanout, q.shape[-1])
    top_lp, top_b = logq_next.topk(k, dim=-1)                                             # [B, d+1, k]
    score = (prefix[:, :, None] + top_lp).reshape(B, -1)
    best = score.topk(min(fanout, score.shape[1]), dim=1).indices                          # [B, F]
    r_idx = best // k
    bonus = top_b.reshape(B, -1).gather(1, best)
    return [(r_idx[:, i], bonus[:, i]) for i in range(best.shape[1])]


def guessed_block_logits(dec: Decoder, spine: Tensor, r: Tensor, anchor: Tensor, n: int) -> Tensor:
    """Layout (a) behind a ragged feature-less prefix: row b sees context, spine s_0..s_{r_b}, and its block
    [anchor_b, MASK x (n-1)] at positions L+r_b+1... Returns [B, n, V]."""
    drafter, cache = dec.drafter, dec.cache
    B, S = spine.shape
    dev = drafter.fc.weight.device
    tokens = torch.cat([spine, anchor[:, None], torch.full((B, n - 1), MASK_ID, dtype=torch.long)], dim=1)
    offsets, visible = serial_layout(n, S)
    visible = visible[None].repeat(B, 1, 1)
    visible[:, S:, :S] = torch.arange(S)[None, None, :] <= r[:, None, None]  # the block sees spine 0..r
    positions = cache.lengths[:, None] + offsets
    positions[:, S:] += r[:, None] + 1 - S                                    # the block stands right after s_r
    ctx_kv = [cache.layer(i) for i in range(drafter.config.num_layers)]
    lc = ctx_kv[0][0].shape[2]
    ctx_visible = (torch.arange(lc)[None, :] < cache.lengths[:, None])[:, None].expand(B, S + n, lc)
    attend = dense_attend(ctx_visible.to(dev), visible.to(dev), drafter.scale)
    with torch.no_grad():
        return drafter.logits(drafter.backbone(tokens.to(dev), positions.to(dev), ctx_kv, attend)[:, S:])


def prepare(dec: Decoder, block: Tensor, draft: Tensor, q_all: Tensor, policy: str, fanout: int) -> list[tuple]:
    """Drafter-lane job during verification: the guesses and a (d+1)-token draft for each."""
    out = []
    for r, b in guesses(dec, draft, q_all, policy, fanout):
        logits = guessed_block_logits(dec, block, r, b, dec.d + 1)
        g_draft, g_q = dec.markov(logits[:, None], torch.zeros_like(b), b)
        out.append((r, b, g_draft, g_q, draft_probs(dec, logits, b, g_draft)))
    return out


def serial(dec: Decoder):
    """Serial (d+1)-token draft: the extra token is the drafter's guess of the bonus after t_d."""
    draft, q, logits = dec.draft_serial(dec.d + 1, with_logits=True)
    return draft, q, draft_probs(dec, logits, dec.bonus, draft)


def resolve(cands: list[tuple], r: Tensor, bonus: Tensor, running: Tensor):
    """The prepared (draft, q, q_all) for the revealed outcome, or None when any running request missed."""
    hit = torch.zeros_like(running)
    src = torch.zeros(len(running), dtype=torch.long)
    for i, (g_r, g_b, *_prepared) in enumerate(cands):
        match = (g_r == r) & (g_b == bonus) & ~hit
        src[match] = i
        hit |= match
    if not bool((hit | ~running).all()):
        return None
    rows = torch.arange(len(running))
    pick = lambda k: None if cands[0][k] is None else torch.stack([c[k] for c in cands])[src, rows]
    return pick(2), pick(3), pick(4)


def run(dec: Decoder, policy: str = "pearl", fanout: int = 4):
    d = dec.d

    def launch(draft, q, q_all):  # drafter lane: verify the draft, draft for the guesses meanwhile
        block = dec.block(draft[:, :d])
        prepared: dict = {}
        dec.post(dec.target_lane, "verify", lambda: verify(block, None if q is None else q[:, :d], prepared))
        dec.post(dec.drafter_lane, "guess_draft",
                 lambda: prepared.update(cands=prepare(dec, block, draft, q_all, policy, fanout)))

    def verify(block, q, prepared):  # target lane
        outcome = dec.verify_and_accept(block, q)
        if outcome is not None:
            running = dec.running_mask()
            dec.post(dec.drafter_lane, "context", dec.context_job())
            dec.post(dec.drafter_lane, "resolve", lambda: next_round(prepared, *outcome, running))

    def next_round(prepared, r, bonus, running):  # drafter lane, after the guesses and the context update
        nxt = resolve(prepared["cands"], r, bonus, running)
        if nxt is None:  # a miss stalls the whole batch: serial drafting on the critical path
            dec.fallbacks += 1
            nxt = dec.timed("serial_draft", dec.drafter_lane, lambda: serial(dec))()
        launch(*nxt)

    dec.post(dec.drafter_lane, "serial_draft", lambda: launch(*serial(dec)))
    yield from dec.drain()
