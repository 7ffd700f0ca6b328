"""DPara: the backbone runs beside verification over every acceptance boundary at once.

While the target lane verifies [b, t1..td], the drafting backend runs one spine + branch backbone forward that
writes boundary logits for all d+1 outcomes into the draft's ring slot. When verification reveals (r, bonus), only
the Markov head runs on the critical path, reading branch r of that slot; it queues the next verify at once, then
the next backbone. Round 1 has no draft to verify yet. Greedy, the target verifies s_0 alone (an AR step) while the
drafter absorbs the prompt and fills a slot with the one branch of spine [s_0] (r = 0 is that round's only
outcome). Sampled, it is drafted serially, as a DSpark round: then a seeded request draws the same whether it
starts a decode or joins a running one, where its first round is the batch's next draft round. Neither is a
fallback, and none follows. With a target that verifies on its device, the host reads each round a round late
(``run_lagged``): the same drafts and tokens.
"""
from __future__ import annotations

from dpara_rt.round.decoder import Decoder, Draft, Outcome
from dpara_rt.round.lagged import LaggedRounds, can_lag


def run(dec: Decoder, first: Outcome):
    if lagged_ok(dec):
        return run_lagged(dec, first)
    drafting = dec.drafting

    def launch(prev: Outcome, tokens, q, absorb: bool):  # head lane: verify the draft, fill its slot meanwhile
        slot = dec.ring.acquire(dec.head_lane.core)
        nxt = dec.no_draft(prev, slot) if tokens is None else dec.send(prev, tokens, q, slot)
        # The backbone goes out before the verify link that queues this slot's Markov head: links run in the
        # order they were posted, so the drafter lane fills the slot (and marks it ready) first.
        drafting.start_boundary(prev if absorb else None, nxt)
        dec.post(dec.target_lane, "verify", lambda: verify(nxt))

    def verify(nxt: Draft):  # target lane
        out = dec.verify_and_accept(nxt)
        if not out.finished:
            absorbed = drafting.on_accept(out)  # a backend may start on the outcome before the head's link
            dec.post(dec.head_lane, "markov_head", lambda: markov_head(out, absorbed))

    def markov_head(out: Outcome, absorbed: bool):  # head lane: the only drafting on the critical path
        launch(out, *drafting.draft_from_boundary(out), absorb=not absorbed)

    dec.post(dec.head_lane, "context", lambda: drafting.absorb(first))
    if dec.opts.sampling:
        dec.post(dec.head_lane, "serial_draft", lambda: launch(first, *drafting.draft_serial(first), absorb=False))
    else:
        dec.post(dec.head_lane, "first_round", lambda: launch(first, None, None, absorb=False))


def lagged_ok(dec: Decoder) -> bool:
    """Whether DPara's rounds may be read a round late: can_lag, and the head on the drafter lane of a backend that
    drafts from device values."""
    return can_lag(dec) and dec.drafting.drafts_from_device and not dec.head_on_target


def run_lagged(dec: Decoder, first: Outcome):
    """DPara with round k read while round k+1 is queued (round/lagged.py). The head drafts from the device's
    (r, bonus) of round k as soon as its verify is queued; once the host has read round k it posts the drafter's
    context update with it and round k+1's backbone, before round k+1's head (links run in the order posted)."""
    drafting, lag = dec.drafting, LaggedRounds(dec)

    def launch(prev, tokens, q, boundary_now: bool):  # head lane: verify the draft; its slot fills meanwhile
        slot = dec.ring.acquire(dec.head_lane.core)
        nxt = dec.no_draft(prev, slot) if tokens is None else dec.send(prev, tokens, q, slot)
        if boundary_now:  # the first draft: its context is the prompt's, absorbed already
            drafting.start_boundary(None, nxt)
        dec.post(dec.target_lane, "verify", lambda: verify(nxt))

    def verify(nxt: Draft):  # target lane
        # once round k is read: its context update, then this draft's boundaries
        pending = lag.step(nxt, lambda out: drafting.start_boundary_on_device(out, nxt))
        if pending is not None:
            dec.post(dec.head_lane, "markov_head", lambda: launch(pending, *drafting.draft_from_device(pending),
                                                                  boundary_now=False))

    dec.post(dec.head_lane, "context", lambda: drafting.absorb(first))
    if dec.opts.sampling:
        dec.post(dec.head_lane, "serial_draft", lambda: launch(first, *drafting.draft_serial(first), True))
    else:
        dec.post(dec.head_lane, "first_round", lambda: launch(first, None, None, True))
