"""DSpark: serial speculative decoding. Drafting (backbone + Markov head) sits on the critical path:
verify_k -> context update -> backbone(anchor = bonus_k) -> Markov head -> verify_{k+1}."""
from __future__ import annotations

from dpara_rt.round.decoder import Decoder, Draft, Outcome


def run(dec: Decoder, first: Outcome):
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
