"""DSpark: serial speculative decoding. Drafting (backbone + Markov head) sits on the critical path:
verify_k -> context update -> backbone(anchor = bonus_k) -> Markov head -> verify_{k+1}. With a target that
verifies on its device, the host reads each round a round late (``run_lagged``): the same drafts and tokens."""
from __future__ import annotations

from dpara_rt.round.decoder import Decoder, Draft, Outcome
from dpara_rt.round.lagged import LaggedRounds, can_lag


def run(dec: Decoder, first: Outcome):
    if can_lag(dec) and dec.drafting.drafts_from_device:
        return run_lagged(dec, first)

    def draft(prev: Outcome):  # drafter lane
        nxt = dec.send(prev, *dec.drafting.draft_serial(prev))
        dec.post(dec.target_lane, "verify", lambda: verify(nxt))

    def verify(nxt: Draft):  # target lane
        out = dec.verify_and_accept(nxt)
        if not out.finished:
            after(out)

    def after(prev: Outcome):  # the accepted tokens' features reach the drafter before it drafts again
        dec.post(dec.drafter_lane, "context", lambda: dec.drafting.absorb(prev))
        dec.post(dec.drafter_lane, "serial_draft", lambda: draft(prev))

    after(first)


def run_lagged(dec: Decoder, first: Outcome):
    """DSpark with round k read while round k+1 is queued (round/lagged.py): as soon as round k's verify is queued,
    the drafter absorbs its accepted rows and drafts round k+1 from the device's (keep, bonus); once the host has
    read round k, the context's host lengths follow (links run in the order posted)."""
    drafting, lag = dec.drafting, LaggedRounds(dec)

    def send(prev, tokens, q):  # drafter lane
        nxt = dec.send(prev, tokens, q)
        dec.post(dec.target_lane, "verify", lambda: verify(nxt))

    def verify(nxt: Draft):  # target lane
        pending = lag.step(nxt, lambda out: dec.post(dec.drafter_lane, "context",
                                                    lambda: drafting.follow_context(out)))
        if pending is not None:
            dec.post(dec.drafter_lane, "serial_draft",
                     lambda: send(pending, *drafting.draft_serial_from_device(pending, lag.ahead)))

    dec.post(dec.drafter_lane, "context", lambda: drafting.absorb(first))
    dec.post(dec.drafter_lane, "serial_draft", lambda: send(first, *drafting.draft_serial(first)))
