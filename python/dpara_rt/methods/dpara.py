"""DPara: the backbone runs beside verification over every acceptance boundary at once.

While the target lane verifies [b, t1..td], the drafter lane runs one spine + branch backbone forward that
writes boundary logits for all d+1 outcomes into a ring slot. When verification reveals (r, bonus), only the
Markov head runs on the critical path, reading branch r of that slot. Round 1 has no spine yet and is
drafted serially; that is not a fallback, and there is none afterwards.
"""
from __future__ import annotations

import torch

from dpara_rt.methods.common import Decoder, slot_tensor


def run(dec: Decoder):
    draft, q = dec.draft_serial()
    while dec.running():
        block = dec.block(draft)
        slot = dec.ring.acquire()
        boundary = slot_tensor(dec.ring, slot)

        def backbone(block=block, slot=slot, boundary=boundary):
            dec.drafter.boundary_logits(dec.cache, block.to(boundary.device), out=boundary)
            dec.ring.mark_ready(slot)

        dec.on_lane(dec.drafter_lane, "backbone", backbone)
        verified = dec.wait(dec.target_lane, dec.on_lane(dec.target_lane, "verify", dec.verify_job(block, q)))
        r, bonus, new = dec.accept(verified, block, slot)

        def markov_head(slot=slot, boundary=boundary, r=r, bonus=bonus):
            dec.ring.select(slot, r.clamp(max=dec.d).numpy())
            try:
                return dec.markov(boundary, r, bonus)
            finally:
                dec.ring.release(slot)

        drafted = dec.on_lane(dec.drafter_lane, "markov_head", markov_head)
        head_done = dec.drafter_lane.record()
        # Queued behind the head: the next backbone needs the accepted features, the next verify does not.
        dec.on_lane(dec.drafter_lane, "context", dec.context_job())
        head_done.synchronize()
        if "value" not in drafted:
            dec.drafter_lane.synchronize()  # re-raises the head's error
        draft, q = drafted["value"]
        yield new
    dec.drafter_lane.synchronize()
