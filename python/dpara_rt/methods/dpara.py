"""DPara: the backbone runs beside verification over every acceptance boundary at once.

While the target lane verifies [b, t1..td], the drafter lane runs one spine + branch backbone forward that
writes boundary logits for all d+1 outcomes into a ring slot. When verification reveals (r, bonus), staged
to the drafter lane, only the Markov head runs on the critical path, reading branch r of that slot; it queues
the next verify at once, then the drafter lane absorbs the accepted features and starts the next backbone. A
drafter worker process gets the features as soon as verification accepts them, and absorbs them while the head
runs.
Round 1 has no draft to verify yet. Greedy, the target verifies s_0 alone (an AR step) while the drafter absorbs
the prompt and fills a slot with the one branch of spine [s_0] (r = 0 is that round's only outcome). Sampled, it
is drafted serially, as a DSpark round: then a seeded request draws the same whether it starts a decode or joins
a running one, where its first round is the batch's next draft round. Neither is a fallback, and none follows.
"""
from __future__ import annotations

from dpara_rt.round.decoder import Decoder, Draft, Outcome


def run(dec: Decoder, first: Outcome):
    def launch(prev: Outcome, tokens, q, absorb: bool):  # head lane: verify the draft, fill a slot meanwhile
        nxt = dec.no_draft(prev) if tokens is None else dec.send(prev, tokens, q)
        slot = dec.ring.acquire(dec.head_lane.core)
        # The backbone goes out before the verify link that queues this slot's Markov head: links run in the
        # order they were posted, so the drafter lane fills the slot (and marks it ready) first.
        dec.start_boundary(prev if absorb else None, nxt, slot)
        dec.post(dec.target_lane, "verify", lambda: verify(nxt, slot))

    def verify(nxt: Draft, slot: int):  # target lane
        out = dec.verify_and_accept(nxt, slot)
        if not out.finished:
            dec.project_ahead(out, slot)  # a worker shares the head's projection of branch r
            ahead = dec.absorb_ahead(out)  # a drafter worker absorbs while the head runs
            dec.post(dec.head_lane, "markov_head", lambda: markov_head(out, slot, ahead))

    def markov_head(out: Outcome, slot: int, absorbed: bool):  # head lane: the only drafting on the critical path
        launch(out, *dec.draft_from_boundary(out, slot), absorb=not absorbed)

    dec.post(dec.head_lane, "context", lambda: dec.absorb(first))
    if dec.opts.sampling:
        dec.post(dec.head_lane, "serial_draft", lambda: launch(first, *dec.draft_serial(first), absorb=False))
    else:
        dec.post(dec.head_lane, "first_round", lambda: launch(first, None, None, absorb=False))
