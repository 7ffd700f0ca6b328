"""DSpark: serial speculative decoding. Drafting (backbone + Markov head) sits on the critical path:
verify_k -> context update -> backbone(anchor = bonus_k) -> Markov head -> verify_{k+1}."""
from __future__ import annotations

from dpara_rt.methods.common import Decoder


def run(dec: Decoder):
    while dec.running():
        draft, q = dec.draft_serial()
        block = dec.block(draft)
        verified = dec.wait(dec.target_lane, dec.on_lane(dec.target_lane, "verify", dec.verify_job(block, q)))
        _, _, new = dec.accept(verified, block)
        # The accepted tokens' features must reach the drafter before it can draft again.
        dec.wait(dec.drafter_lane, dec.on_lane(dec.drafter_lane, "context", dec.context_job()))
        yield new
