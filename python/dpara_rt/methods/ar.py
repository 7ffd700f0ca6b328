"""AR: one target forward per token, chained on the target lane through the same round state as the
speculative methods (so EOS / max_new_tokens, streaming and the timeline work exactly as for them)."""
from __future__ import annotations

from dpara_rt.round.decoder import Decoder, Outcome


def run(dec: Decoder, first: Outcome):
    def step(prev: Outcome):  # target lane
        out = dec.verify_and_accept(dec.no_draft(prev))
        if not out.finished:
            dec.post(dec.target_lane, "verify", lambda: step(out))

    dec.post(dec.target_lane, "verify", lambda: step(first))
