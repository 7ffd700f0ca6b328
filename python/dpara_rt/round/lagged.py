"""Rounds the host reads one round late: a target that verifies on its device (a static verify), DPara with its
head on the drafter lane (methods/dpara.run_lagged), DSpark (methods/dspark.run_lagged) and AR
(methods/ar.run_lagged).

Round k's verify also accepts where the logits are: (r, bonus) from the arg-max (greedy) or the judge's draw
(sampled), and the target's device lengths advance by keep = r + 1. DPara's head drafts round k+1 from those
device values at once, DSpark's drafter absorbs the keep rows into its context on the device and drafts serially
after them (AR verifies the bonus); the host copies round k's packed result into host memory in the target lane's
order and reads it while round k+1 is queued, then runs the round state (stops, metrics, streaming) and the
drafter's context update (DSpark's: the context's host lengths follow) on it. Nothing is guessed: the device's
(r, bonus) are the round state's for every running request, so the drafts and the output are the unlagged
round's, bit for bit. A request the host finds finished is frozen on the device from the next verify on
(``alive``); until then its rows run on, clamped inside the cache, and are never read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dpara_rt import _core, ops
from dpara_rt.models.static_verify import unpack_verified
from dpara_rt.round.values import Draft, Outcome


class HostCopy:
    """A device tensor copied into pinned host memory in the current stream's order; ``get()`` waits for that copy
    alone (on CPU tensors the copy is the tensor, read by get)."""

    def __init__(self, t: Tensor):
        self.event = None
        if t.is_cuda:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = t

    def get(self) -> Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host


@dataclass(frozen=True)
class Pending:
    """A verified round the host has not read: what the head needs, on the target's device."""
    draft: Draft           # what was verified (round, slot)
    r: Tensor              # [B] long: accepted draft tokens (0 for frozen rows)
    bonus: Tensor          # [B] long: the next s_0
    keep: Tensor           # [B] long: rows of `features` the drafter absorbs (r + 1; 0 for frozen rows)
    features: Tensor       # [B, T, F] staged for the drafter
    read: HostCopy         # the judge's verdicts, then the block, the arg-max and the finiteness flag
    judged: int            # how many verdicts lead the read-back (0: greedy)
    shape: tuple[int, int]  # the block's (B, T)
    ready: _core.Event     # target lane, after the verify, its acceptance and the features' staging

    def for_lane(self, lane) -> tuple[Tensor, Tensor]:
        """(r, bonus) for a job of `lane`: ordered after `ready`, and on CUDA marked in use on the lane's stream (the
        target lane's next allocations cannot take their memory before this lane has read them; keep too)."""
        lane.wait(self.ready)
        for t in (self.r, self.bonus, self.keep):
            if t.is_cuda:
                t.record_stream(torch.cuda.current_stream(t.device))
        return self.r, self.bonus

    @property
    def round(self) -> int:
        return self.draft.round

    @property
    def slot(self) -> int:
        return self.draft.slot


def can_lag(dec) -> bool:
    """Whether a decode's rounds may be read a round late: its target verifies a block built on its device, and its
    batch is fixed (continuous batching changes rows between rounds, which needs every round read)."""
    return dec.target.block_on_device and dec.admission is None


def accept_on_device(tokens: Tensor, argmax: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy acceptance where the logits are: (r [B], bonus [B]) of a block tokens [B, T] and its arg-max [B, T]:
    r is the longest prefix of t_1..t_d that the arg-max predicted, the bonus the arg-max after it."""
    if tokens.shape[1] == 1:
        return torch.zeros_like(argmax[:, 0]), argmax[:, 0]
    r = (tokens[:, 1:] == argmax[:, :-1]).long().cumprod(1).sum(1)
    return r, argmax.gather(1, r[:, None])[:, 0]


class LaggedRounds:
    """One decode's lagged rounds: ``verify`` queues round k and its acceptance, ``settle`` reads a queued round."""

    def __init__(self, dec):
        self.dec = dec
        # slots a device length may run ahead of the host's: a round in flight, and one more for a row that
        # finished in the round the host reads last
        self.ahead = 2 * (dec.d + 1)
        B = dec.state.batch()
        with torch.inference_mode(False):
            self.alive = torch.ones(B, dtype=torch.long, device=dec.target.device)
        self.unread: Pending | None = None  # the round queued last, not read yet

    def step(self, draft: Draft, on_read=None) -> Pending | None:
        """Target lane: queue the verify of `draft`, then read the round queued before it (the one wait) and hand
        what the host read to `on_read`, unless that finished the decode. Returns the round just queued, or None
        when the decode finished (that round is never read)."""
        pending = self.verify(draft)
        unread, self.unread = self.unread, pending
        if unread is not None:
            out = self.settle(unread)
            if out.finished:
                return None
            if on_read is not None:
                on_read(out)
        return pending

    def verify(self, draft: Draft) -> Pending:
        """Target lane: queue the verify of `draft` and its acceptance; the target's device lengths advance."""
        dec = self.dec
        block, staged = dec.block_for(draft)
        B, T = block.shape
        judge = dec.judge_for(draft)
        logits, feats, read, judged = dec.target.verify_queued(block, staged, judge, ahead=self.ahead)
        feats = dec.features_staged(feats, staged, draft.round % 2)
        n = 0 if judged is None else judged.numel()
        block = read[n:n + B * T].view(B, T)
        if judged is None:
            r, bonus = accept_on_device(block, read[n + B * T:n + 2 * B * T].view(B, T))
        elif T == 1:
            r, bonus = torch.zeros_like(judged), judged
        else:
            r, bonus = judged[:B], judged[B:2 * B]
        alive = self.alive
        bonus = torch.where(alive.bool(), bonus, block[:, 0])  # a frozen row keeps its s_0, as the round state does
        r, keep = r * alive, (r + 1) * alive
        dec.target.commit_on_device(keep)
        return Pending(draft, r, bonus, keep, feats, HostCopy(read), n, (B, T), dec.target_lane.record())

    def settle(self, p: Pending) -> Outcome:
        """Target lane: read round p (the one wait) and run the round state on it; the rows it finished stop
        advancing on the device from the next verify on."""
        dec = self.dec
        B, T = p.shape
        host_block, argmax, judged = unpack_verified(p.read.get(), B, T, tokens=True, extra=p.judged)
        verified = dec.verified(p.draft, host_block, p.features, argmax, judged)  # raises where argmax is None
        out = dec.accept(verified, queued=p.ready)
        self.alive.copy_(ops.upload(out.running.long(), self.alive.device), non_blocking=True)
        return dec.conclude(out)


__all__ = ["HostCopy", "LaggedRounds", "Pending", "accept_on_device", "can_lag"]
