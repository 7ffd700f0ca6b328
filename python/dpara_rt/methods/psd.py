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

from dpara_rt.round.decoder import Decoder, Draft, Outcome


def draft_probs(dec: Decoder, logits: Tensor, anchor: Tensor, draft: Tensor) -> Tensor:
    """The drafter's distribution at each drafted position, softmax(L_j + W1[x_{j-1}] W2), [B, n, V]."""
    # the anchor (a bonus) is a host tensor, the draft lives where the Markov head ran
    prev = torch.cat([anchor[:, None].to(draft.device), draft[:, :-1]], dim=1).to(logits.device)
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


def prepare(dec: Decoder, spine: Tensor, draft: Tensor, q_all: Tensor) -> list[tuple]:
    """Drafter-lane job during verification: the guesses and a (d+1)-token draft for each. The guessed block
    for (r, b) stands behind the feature-less spine s_0..s_r (the target is computing its features now)."""
    out = []
    for r, b in guesses(dec, draft, q_all, dec.opts.psd_policy, dec.opts.ssd_fanout):
        logits = dec.drafting.block_logits(b, dec.d + 1, prefix=spine, prefix_seen=r + 1)
        g_draft, g_q = dec.drafting.markov(logits[:, None], torch.zeros_like(b), b)
        out.append((r, b, g_draft, g_q, draft_probs(dec, logits, b, g_draft)))
    return out


def serial(dec: Decoder, prev: Outcome):
    """Serial (d+1)-token draft: the extra token is the drafter's guess of the bonus after t_d."""
    draft, q, logits = dec.drafting.draft_serial(prev, dec.d + 1, with_logits=True)
    return draft, q, draft_probs(dec, logits, prev.bonus, draft)


def resolve(cands: list[tuple], out: Outcome):
    """The prepared (draft, q, q_all) for the revealed outcome, or None when any running request missed."""
    running = out.running
    hit = torch.zeros_like(running)
    src = torch.zeros(len(running), dtype=torch.long)
    for i, (g_r, g_b, *_prepared) in enumerate(cands):
        match = (g_r.cpu() == out.r) & (g_b.cpu() == out.bonus) & ~hit
        src[match] = i
        hit |= match
    if not bool((hit | ~running).all()):
        return None
    rows = torch.arange(len(running))
    pick = lambda k: None if cands[0][k] is None else torch.stack([c[k] for c in cands])[src, rows]
    return pick(2), pick(3), pick(4)


def run(dec: Decoder, first: Outcome):
    d = dec.d

    def launch(prev: Outcome, draft, q, q_all):  # drafter lane: verify the draft, draft for the guesses meanwhile
        nxt = dec.send(prev, draft[:, :d], None if q is None else q[:, :d])
        prepared: dict = {}
        dec.post(dec.target_lane, "verify", lambda: verify(nxt, prepared))
        dec.post(dec.drafter_lane, "guess_draft",
                 lambda: prepared.update(cands=prepare(dec, nxt.spine(dec.drafter.device), draft, q_all)))

    def verify(nxt: Draft, prepared: dict):  # target lane
        out = dec.verify_and_accept(nxt)
        if not out.finished:
            dec.post(dec.drafter_lane, "context", lambda: dec.drafting.absorb(out))
            dec.post(dec.drafter_lane, "resolve", lambda: next_round(prepared, out))

    def next_round(prepared: dict, out: Outcome):  # drafter lane, after the guesses and the context update
        nxt = resolve(prepared["cands"], out)
        if nxt is None:  # a miss stalls the whole batch: serial drafting on the critical path
            dec.metrics.record_fallback()
            nxt = dec.chain.timed("serial_draft", dec.drafter_lane, lambda: serial(dec, out))()
        launch(out, *nxt)

    dec.post(dec.drafter_lane, "context", lambda: dec.drafting.absorb(first))
    dec.post(dec.drafter_lane, "serial_draft", lambda: launch(first, *serial(dec, first)))
