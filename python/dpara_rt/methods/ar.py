"""AR: one target forward per token, chained on the target lane through the same round state as the
speculative methods (so EOS / max_new_tokens, streaming and the timeline work exactly as for them). With a target
that verifies on its device, the host reads each step while the next is queued (``run_lagged``)."""
from __future__ import annotations

from dpara_rt.round.decoder import Decoder, Outcome
from dpara_rt.round.lagged import LaggedRounds, can_lag


def run(dec: Decoder, first: Outcome):
    if can_lag(dec):
        return run_lagged(dec, first)

    def step(prev: Outcome):  # target lane
        out = dec.verify_and_accept(dec.no_draft(prev))
        if not out.finished:
            dec.post(dec.target_lane, "verify", lambda: step(out))

    dec.post(dec.target_lane, "verify", lambda: step(first))


def run_lagged(dec: Decoder, first: Outcome):
    """AR read a step late (round/lagged.py): step k+1 verifies the device's bonus of step k, queued before the
    host reads step k."""
    lag = LaggedRounds(dec)

    def step(prev):  # target lane
        pending = lag.step(dec.no_draft(prev))
        if pending is not None:
            dec.post(dec.target_lane, "verify", lambda: step(pending))

    dec.post(dec.target_lane, "verify", lambda: step(first))
