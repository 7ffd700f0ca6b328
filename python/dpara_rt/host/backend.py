"""The host backend: drafting on a CPU host, where two lanes are two cores and one interpreter would serialise
them (see README.md beside this file for each mechanism, why it exists and how to switch it off).

Beyond the device backend it adds, with a drafter worker process (``worker``): the drafter's forwards in the
worker, a round's absorb and backbone sent as one message and settled by the next head, the accepted features sent
to the worker right after verification, branch r's projection shared with the worker (``BranchSplit``) or taken
from its guess (``BranchGuess``), and a sampled draft's q computed there (``WorkerQ``); with or without a worker:
the sampled head's Gumbel noise drawn beside verification (``NoiseAhead``) and the hidden ring's projection and
head in one core call (``HostMarkovHead.from_hidden``). Every one of them gives the device backend's drafts, bit
for bit.
"""
from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from dpara_rt import _core
from dpara_rt.core import branch_rows
from dpara_rt.drafting.device import DeviceBackend, LocalContext
from dpara_rt.host.branch_guess import BranchGuess
from dpara_rt.host.context import WorkerContext
from dpara_rt.host.linear import project_columns
from dpara_rt.host.native import HostMarkovHead
from dpara_rt.host.noise_ahead import NoiseAhead, PendingQ, WorkerQ
from dpara_rt.round.values import Draft, Outcome


# The host's optional mechanisms, each switched off by naming it in DPARA_RT_HOST_OFF (comma-separated): the drafts
# are the same either way (README.md beside this file says what each is worth).
MECHANISMS = ("absorb_ahead", "split", "guess", "noise_ahead", "worker_q", "fused_head")


def switched_off() -> frozenset[str]:
    """The mechanisms DPARA_RT_HOST_OFF names, read per decode."""
    names = frozenset(n.strip() for n in os.environ.get("DPARA_RT_HOST_OFF", "").split(",") if n.strip())
    unknown = sorted(names - set(MECHANISMS))
    if unknown:
        raise ValueError(f"DPARA_RT_HOST_OFF names {unknown}; expected a comma-separated subset of {MECHANISMS}")
    return names


class HostBackend(DeviceBackend):
    """Drafting on the host, in this process or (``worker``: a ``DrafterWorker``) in a worker process."""

    drafts_from_device = False  # its head reads host r (branch guesses, the shared projection)

    def __init__(self, dec, drafter, markov: bool = True, worker=None):
        self.worker, self.off = worker, switched_off()
        super().__init__(dec, drafter, markov)
        # With a worker the head runs on the target lane right after verification: no thread hand-off, no second
        # interpreter thread on the critical path; the worker maps staging and ring.
        self.head_on_target = self.shared_buffers = worker is not None
        # the hidden ring's output head, packed for the core (HostMarkovHead.from_hidden projects through it)
        self.packed_head = (drafter.packed_head() if not dec.ring_logits and isinstance(self.head, HostMarkovHead)
                            and "fused_head" not in self.off else None)
        self.noise = NoiseAhead(self.context)  # a sampled head's noise, drawn beside verification
        self.worker_q = None  # a sampled draft's q computed by the worker; also where it projects its share of r
        if worker is not None and not {"worker_q", "split"} <= self.off:
            self.worker_q = WorkerQ(self.context)
        self.guess = None
        if (self.worker_q is not None and self.packed_head is not None and not dec.opts.sampling
                and len(self.row_origin) == 1 and "guess" not in self.off):
            self.guess = BranchGuess(self.context, self.d, self.vocab)  # branch r projected ahead
        self._branch_logits: Tensor | None = None  # the hidden ring's projected branch r, when no worker reads it
        # What the worker does for the round in flight (it lives from one link to the next, never across rounds):
        self._in_worker: tuple[int, int, int | None] | None = None  # (round, slot, features phase) being filled
        self._absorbed_ahead: int | None = None  # features phase of an absorb sent ahead, not yet settled
        self._shared: tuple | None = None  # (slot, BranchSplit, head's columns): the worker projects the rest

    def new_context(self, batch: int, max_len: int):
        if self.worker is None:
            return LocalContext(self.drafter, batch, max_len)
        return WorkerContext(self.worker, batch, max_len)

    def map_buffers(self, staging, ring) -> None:
        self.context.map_buffers(staging, ring)
        if self.worker_q is not None and self.packed_head is not None:
            # mapped now, before the decode posts what it waits for: a mapping is a call, which collects every reply
            self.worker_q.branch(len(self.row_origin), self.d, self.vocab, 0)

    # -------------------------------------------------------------- right after verification
    def on_accept(self, out: Outcome) -> bool:
        if out.finished:
            return False
        self.project_ahead(out)
        return self.absorb_ahead(out)

    def project_ahead(self, out: Outcome) -> None:
        """Target lane, before anything else goes to the worker: with the hidden ring, have the worker project the
        last columns of branch r while the next head projects the first ones (the worker's core is idle until the
        head sends the next spine)."""
        if (self.worker_q is None or self.packed_head is None or self.head_per_row or "split" in self.off
                or self.vocab <= _core.HOST_LINEAR_PANEL):  # one panel: nothing to share
            return
        if self.guess is not None and self.guess.accepted(out.round, out.slot, out.r.tolist()):  # projected already
            return
        split = self.context.branch_split(self.vocab, len(self.row_origin))
        self.context.project_branch(out.slot, out.r, (self.calls + 1) % 2, split.columns)
        self._shared = (out.slot, split, split.columns)

    def absorb_ahead(self, out: Outcome) -> bool:
        """Target lane: send the worker the accepted features now; it absorbs them while the head runs here (it
        would idle then). Without a worker the head shares the drafter lane, where absorbing first would delay it."""
        if self.worker is None or "absorb_ahead" in self.off:
            return False
        self.dec.target_lane.wait(out.ready)
        self.context.absorb(out.features, out.keep)
        self._absorbed_ahead = out.phase if out.round > 0 else None  # settled with the next boundary
        return True

    def block_logits(self, bonus: Tensor, n: int, prefix: Tensor | None = None,
                     prefix_seen: Tensor | None = None) -> Tensor:
        if self.worker is None:
            return super().block_logits(bonus, n, prefix, prefix_seen)
        if prefix is not None:
            raise ValueError("a drafter worker drafts blocks without a spine prefix (PSD's guesses run their drafter "
                             "in this process: Method.worker is False for psd)")
        return self.context.block_logits(bonus, n, untrained_ok=True)

    # -------------------------------------------------------------- the backbone beside verification
    def start_boundary(self, prev: Outcome | None, draft: Draft) -> None:
        """With a worker, the absorb and the backbone go out as one message: no thread of this process runs drafting
        Python while the target verifies, and the next head's link settles them. A sampled decode's drafter also
        draws the next head's noise."""
        dec, noise = self.dec, None
        if dec.opts.sampling and not self.head_per_row and "noise_ahead" not in self.off:  # read by the next call
            noise = self.noise.plan(self.head, len(self.row_origin), self.d, self.vocab, self.batch_seed(),
                                    self.calls + 1)
        if self.worker is None:
            if prev is not None:
                dec.post(dec.drafter_lane, "context", lambda: self.absorb(prev))
            dec.post(dec.drafter_lane, "backbone", lambda: self.fill_boundary(draft, noise))
            return
        features, keep = (None, None) if prev is None else (prev.features, prev.keep)
        if prev is not None:
            dec.head_lane.wait(prev.ready)
        self.context.absorb_and_fill(features, keep, draft.spine_ids(), draft.slot, dec.ring_logits, noise)
        if self.guess is not None:  # not once the batch grows or a joining request brings sampling options
            # an AR round's one outcome is r = 0: its branch is no guess
            self.guess.post(draft.slot, len(self.row_origin) == 1 and not dec.opts.sampling,
                            known=[0] if draft.tokens is None else None)
        staged = prev is not None and prev.round > 0
        phase, self._absorbed_ahead = (prev.phase if staged else self._absorbed_ahead), None
        self._in_worker = (dec.chain.round, draft.slot, phase)

    def fill_boundary(self, draft: Draft, noise: tuple | None = None) -> None:
        dec = self.dec
        boundary = dec.slots[draft.slot]
        self.context.boundary(draft.spine(boundary.device), draft.slot, boundary, dec.ring_logits)
        if noise is not None:
            self.noise.draw(noise)
        dec.ring.mark_ready(draft.slot, dec.drafter_lane.record())

    def settle(self) -> None:
        """Head lane: wait for what start_boundary sent the worker, put its spans on the timeline, hand the features
        phase back and mark the slot ready."""
        if self._in_worker is None:
            return
        dec, (rnd, slot, phase) = self.dec, self._in_worker
        self._in_worker = None
        for name, t0, t1 in self.context.settle():
            dec.metrics.add_event(rnd, name, dec.drafter_lane.name, t0, t1)
        if phase is not None:
            dec.release(dec.head_lane, "features", phase)
        dec.ring.mark_ready(slot, dec.head_lane.record())

    def rest(self) -> None:
        """The decode is over: the worker stops spinning for a next call."""
        if self.worker is not None:
            self.context.rest()

    # -------------------------------------------------------------- the head on branch r
    def draft_branch(self, out: Outcome, boundary: Tensor, r: Tensor, bonus: Tensor) -> tuple[Tensor, object]:
        """Branch r's logits come from the ring (the logits ring), the worker's guess, a projection shared with the
        worker, or the head's own projection inside its core call; then the head, once."""
        if self.dec.ring_logits:
            return self.markov(boundary, r, bonus, ("ring", out.slot))
        B, sampling = len(r), self.dec.opts.sampling
        guessed = self.guess.take(out.round, out.slot) if self.guess is not None else None
        if guessed is not None:
            return self.markov(guessed[:, None], self.first_row(B), bonus)
        shared, self._shared = self._shared, None
        logits = q_from = None
        worker_q = self.worker_q is not None and sampling and not self.head_per_row and "worker_q" not in self.off
        if (shared is not None and shared[0] == out.slot) or worker_q:
            # projected where the worker reads it (its share of the columns, or the draft's q)
            logits, q_from = self.worker_q.branch(B, self.d, self.vocab, self.calls + 1)
        if shared is not None and shared[0] == out.slot:  # the worker projects the last columns meanwhile
            _, split, columns = shared
            t0 = _core.now_ns()
            project_columns(branch_rows(boundary, r.numpy()), self.packed_head, logits, 0, columns)
            t1 = _core.now_ns()
            split.observe((t0, t1), self.context.wait_branch(), _core.now_ns(), columns)
            return self.markov(logits[:, None], self.first_row(B), bonus, q_from if worker_q else None)
        if self.packed_head is not None and not self.head_per_row:  # projection and head in one core call
            if logits is None:
                if self._branch_logits is None or len(self._branch_logits) != B:
                    self._branch_logits = torch.empty(B, self.d, self.vocab)
                logits = self._branch_logits
            return self.markov(boundary, r, bonus, q_from, branch=(self.packed_head, logits))
        with torch.inference_mode():  # grad mode is per thread: without this the host projection is torch's
            logits = self.drafter.logits(branch_rows(boundary, r.numpy()), out=logits)
        return self.markov(logits[:, None], self.first_row(B), bonus, q_from)

    def markov(self, logits: Tensor, r: Tensor, bonus: Tensor, q_from: tuple[str, int] | None = None,
               branch: tuple | None = None) -> tuple[Tensor, object]:
        """The device backend's head, plus: noise drawn ahead (sampled), q left to the worker where it reads the
        logits (`q_from`: ``("ring", slot)`` or ``("branch", half)``; then q is a PendingQ), and `branch`: (packed
        output head, logits buffer [B, d, V]) when `logits` holds the hidden ring's slot, projected inside the head's
        core call (HostMarkovHead.from_hidden)."""
        if self.head_per_row:
            return self.markov_per_row(logits, r, bonus)
        self.calls += 1
        dev, sampling = logits.device, self.dec.opts.sampling
        r, bonus, seed = r.to(dev), bonus.to(dev), self.batch_seed()
        noise = self.noise.take(len(r), seed, self.calls) if sampling else None
        head = (self.head if branch is None
                else functools.partial(self.head.from_hidden, head=branch[0], logits=branch[1]))
        args = (logits, r, bonus, self.head_temps[0], seed, self.calls)
        if noise is None:
            return head(*args)
        if q_from is None or self.worker_q is None or "worker_q" in self.off:
            return head(*args, noise)
        draft, _ = head(*args, noise, with_q=False)
        rows = r if branch is None else self.first_row(len(r))  # the worker reads one row per request of a branch
        return draft, self.worker_q.post(q_from, rows, bonus, draft, self.vocab, self.head_temps[0],
                                         self.markov_enabled, self.calls)

    def resolve_q(self, q):
        return q.take() if isinstance(q, PendingQ) else q


__all__ = ["HostBackend"]
