"""DPara: the backbone runs beside verification over every acceptance boundary at once.

While the target lane verifies [b, t1..td], the drafter lane runs one spine + branch backbone forward that
writes boundary logits for all d+1 outcomes into a ring slot. When verification reveals (r, bonus), staged
to the drafter lane, only the Markov head runs on the critical path, reading branch r of that slot; it queues
the next verify at once, then the drafter lane absorbs the accepted features and starts the next backbone.
Round 1 has no spine yet and is drafted serially; that is not a fallback, and there is none afterwards.
"""
from __future__ import annotations

from dpara_rt.methods.common import Decoder, slot_tensor


def run(dec: Decoder):
    def launch(draft, q):  # drafter lane: verify the draft, fill a ring slot for every outcome meanwhile
        block = dec.block(draft)
        slot = dec.ring.acquire()
        boundary = slot_tensor(dec.ring, slot)
        dec.post(dec.target_lane, "verify", lambda: verify(block, q, slot, boundary))
        return block, slot, boundary

    def backbone(block, slot, boundary):  # drafter lane, overlapping verify
        dec.drafter.boundary_logits(dec.cache, block.to(boundary.device), out=boundary)
        dec.ring.mark_ready(slot)

    def verify(block, q, slot, boundary):  # target lane
        if dec.verify_and_accept(block, q, slot) is None:
            return
        rb = dec.stage_outcome(dec.last_r, dec.bonus)
        context = dec.context_job()
        dec.post(dec.drafter_lane, "markov_head", lambda: markov_head(slot, boundary, rb, context))

    def markov_head(slot, boundary, rb, context):  # drafter lane: the only drafting on the critical path
        r, bonus = rb[:, 0].long(), rb[:, 1].long()
        dec.ring.select(slot, r.numpy())
        try:
            draft, q = dec.markov(boundary, r, bonus)
        finally:
            dec.ring.release(slot)
        nxt = launch(dec.stage_draft(draft), q)
        dec.post(dec.drafter_lane, "context", context)
        dec.post(dec.drafter_lane, "backbone", lambda: backbone(*nxt))

    def first_round():  # drafter lane
        nxt = launch(*dec.draft_serial())
        dec.post(dec.drafter_lane, "backbone", lambda: backbone(*nxt))

    dec.post(dec.drafter_lane, "serial_draft", first_round)
    yield from dec.drain()
