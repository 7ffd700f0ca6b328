"""DSpark: serial speculative decoding. Drafting (backbone + Markov head) sits on the critical path:
verify_k -> context update -> backbone(anchor = bonus_k) -> Markov head -> verify_{k+1}."""
from __future__ import annotations

from dpara_rt.methods.common import Decoder


def run(dec: Decoder):
    def draft():  # drafter lane
        draft, q = dec.draft_serial()
        block = dec.block(draft)
        dec.post(dec.target_lane, "verify", lambda: verify(block, q))

    def verify(block, q):  # target lane
        if dec.verify_and_accept(block, q) is not None:
            # The accepted tokens' features must reach the drafter before it can draft again.
            dec.post(dec.drafter_lane, "context", dec.context_job())
            dec.post(dec.drafter_lane, "serial_draft", draft)

    dec.post(dec.drafter_lane, "serial_draft", draft)
    yield from dec.drain()
