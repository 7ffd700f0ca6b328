"""Continuous batching: a decode whose rows are slots that requests take and leave between rounds.

A serving decode has B rows (sized when it starts; it grows, in powers of two up to the engine's max_batch,
when more requests wait than rows are free). Every row starts free;
``Slots.readmit`` fills free rows from the scheduler's queue, each with its own prompt, sampling options,
max_new_tokens and stop ids, and builds the outcome the method starts from: the running rows' last round
(their features not yet absorbed) and the new rows' first tokens (their prompts absorbed here). The method's
chain pauses at a round whose commit left a row free while requests wait (``should_pause``), so a join costs
one chain restart: the next round starts as a decode's first does, for every row (DPara greedy: an AR step beside
branch 0; otherwise a serial draft; not a fallback: nothing was guessed), and a DPara backbone already under way for the paused round is dropped. A cancelled
request is retired at the next commit and its row is free from then on.
"""
from __future__ import annotations

import numpy as np
import torch

from dpara_rt import _core
from dpara_rt.round.decoder import Decoder, Outcome

# The round state's finish reasons as OpenAI's: a stop id or EOS is "stop"; a full cache counts as length.
_REASONS = {"eos": "stop", "length": "length", "max_len": "length", "cancelled": "cancelled"}


class Slots:
    """The admission side of one serving decode (``Decoder.admission``), between the decoder and a
    scheduler (``take(n, fits)``, ``finished(req, reason)``, ``should_cancel(req)``, ``waiting()``)."""

    def __init__(self, scheduler, batch: int, max_batch: int | None = None):
        self.scheduler, self.batch, self.max_batch = scheduler, batch, max_batch or batch
        self.fits = lambda req: True  # set by readmit: a request fits this decode's KV cache
        self.rows: dict[int, object] = {}   # row -> its request; changed only by readmit (lanes idle)
        self._ended: set[int] = set()       # requests already told they ended (by id)
        self.joins = 0                      # requests admitted while others were running

    # ------------------------------------------------------------------ target lane, every round
    def retirements(self) -> list[int]:
        return [b for b, req in list(self.rows.items()) if self.scheduler.should_cancel(req)]

    def should_pause(self, out: Outcome) -> bool:
        """Pause when a request that fits waits and a row is free (or the batch may still grow)."""
        room = not bool(out.running.all()) or self.batch < self.max_batch
        return room and self.scheduler.waiting(self.fits) > 0

    # ------------------------------------------------------------------ the consumer
    def route(self, new: list[list[int]]) -> None:
        """Hand one round's commits to their requests; a request whose commits end at one of its stop ids
        or reach its max_new_tokens ends now (the round state stops it exactly there)."""
        for b, tokens in enumerate(new):
            req = self.rows.get(b)
            if req is None or not tokens or req.id in self._ended:
                continue
            req.handle._push(tokens)
            if tokens[-1] in req.stops:
                self._end(req, "stop")
            elif req.handle.completion_tokens >= req.max_new_tokens:
                self._end(req, "length")

    def _end(self, req, reason: str, error: BaseException | None = None) -> None:
        if req.id not in self._ended:
            self._ended.add(req.id)
            self.scheduler.finished(req, reason, error)

    def fail(self, error: BaseException) -> None:
        """The decode failed: every request it holds ends with the error."""
        for req in self.rows.values():
            self._end(req, "error", error)

    def readmit(self, dec: Decoder, paused: Outcome | None) -> Outcome | None:
        """Lanes idle: end the requests of finished rows, fill free rows from the queue, and return the outcome
        the method restarts from (None when no request runs or waits)."""
        state = dec.state
        finished = np.asarray(state.finished(), dtype=bool)
        for b in [b for b in self.rows if finished[b]]:
            self._end(self.rows.pop(b), _REASONS.get(state.reason(b), "stop"))
        self.fits = lambda req: dec.target.max_len >= req.cache_need
        B = self.batch
        bonus = paused.bonus.clone() if paused is not None else torch.zeros(B, dtype=torch.long)
        keep = paused.keep.clone() if paused is not None else torch.zeros(B, dtype=torch.long)
        features = paused.features.clone() if paused is not None else torch.zeros(B, 1, dec.target.feature_dim)
        want = len(self.rows) + self.scheduler.waiting(self.fits)
        if want > B and B < self.max_batch:  # grow to the next power of two that holds them, at most max_batch
            B = self.batch = min(self.max_batch, 1 << (want - 1).bit_length())
            dec.grow(B)
            grown = B - len(bonus)
            bonus, keep = (torch.cat([t, t.new_zeros(grown)]) for t in (bonus, keep))
            features = torch.cat([features, features.new_zeros(grown, *features.shape[1:])])
        free = [b for b in range(B) if b not in self.rows]
        new = self.scheduler.take(len(free), fits=self.fits)
        if not new and not self.rows:
            return None
        if dec.ring is not None:
            dec.ring.reset()  # a backbone filled a slot for the paused round: no one reads it now
        tokens: list[list[int]] = [[] for _ in range(B)]
        if self.rows:
            self.joins += len(new)
        self.rows.update(zip(free, new))  # held before admission: if it fails, fail() tells these requests too
        for b, req in zip(free, new):
            tokens[b] = [self._admit(dec, b, req)]
            bonus[b], keep[b] = tokens[b][0], 0
        running = dec.running_mask()
        return Outcome(int(state.rounds()), torch.zeros(B, dtype=torch.long), bonus, tokens, features,
                       keep * running.long(), running, _core.Event())

    def _admit(self, dec: Decoder, b: int, req) -> int:
        """Row b takes `req`: prefill, first token, round state, and the drafter's context of the prompt."""
        dec.set_row_options(b, req.temperature, req.top_p, req.top_k, req.seed)
        logits, feats = dec.chain.run_now(dec.target_lane, "prefill", lambda: dec.target.prefill_row(b, req.prompt))
        first = dec.pick_row(b, logits)
        dec.state.admit(b, len(req.prompt), first, req.max_new_tokens, list(req.stop_ids))
        if dec.drafter is not None:
            dec.chain.run_now(dec.drafter_lane, "context", lambda: dec.drafting.reset_row(b, feats))
        return first


__all__ = ["Slots"]
