"""The steps of a speculative round, shared by every method (``Decoder``); the values that travel between them
are in ``round_values`` (re-exported here)."""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Iterator

import numpy as np
import torch
from torch import Tensor

from dpara_rt import _core, ops
from dpara_rt.round.chain import Chain
from dpara_rt.host.branch_guess import BranchGuess
from dpara_rt.core import branch_rows, slot_tensor, stage_in, staging_tensor
from dpara_rt.host.context import LocalContext, WorkerContext
from dpara_rt.round.lanes import Lane
from dpara_rt.round.options import PSD_POLICIES, DecodeOptions, is_int  # noqa: F401 (re-exported)
from dpara_rt.round.values import Draft, Outcome, Verified
from dpara_rt.models.target import Target
from dpara_rt.host.native import HostMarkovHead, all_finite
from dpara_rt.host.noise_ahead import NoiseAhead, PendingQ, WorkerQ
from dpara_rt.sampling import make_generator, probs, sample, stop_at_non_finite, uniforms

_ROW_STREAM_SHIFT = 40  # per-row Markov head calls under one seed: row b's Philox offset is calls + (b << 40)


def _warn_non_finite_draft(dec: "Decoder") -> None:
    if not dec.warned_non_finite:  # once per call, not once per round
        dec.warned_non_finite = True
        warnings.warn("the drafter produced non-finite probabilities; those draft tokens are treated as rejected "
                      "and the target's own distribution picks the token (output stays exact; speed suffers)",
                      RuntimeWarning, stacklevel=3)


class Decoder:
    """One decode call: the target and its cache, the drafter and its context cache, the two lanes, the
    boundary ring, the staging buffers and the C++ round state, all built here for this batch."""

    def __init__(self, target: Target, drafter, lanes: tuple[Lane, Lane], opts: DecodeOptions,
                 prompts: list[list[int]], needs_drafter: bool, ring_capacity: int = 2,
                 markov: bool = True, admission=None, worker=None, kept: dict | None = None):
        self.target, self.opts, self.prompts = target, opts, prompts
        self._kept = kept  # the engine's: the last decode's staging and ring, reused when this one's are alike
        # Continuous batching (dpara_rt.serving.batching.Slots): rows are slots that requests take and leave between
        # rounds; None for a fixed batch.
        self.admission, self.paused = admission, None
        self.drafter = drafter if needs_drafter else None
        self.target_lane, self.drafter_lane = lanes
        # Where the Markov head and the draft's hand-off run: the drafter lane, or, when a worker process runs the
        # drafter's forwards, the target lane itself, right after verification (no thread hand-off either way)
        self.head_lane = self.target_lane if worker is not None else self.drafter_lane
        # On the target lane the head reads (r, bonus) from the round's Outcome and verification reads the draft
        # it was handed: no staging between two links of one thread.
        self._head_on_target = self.head_lane is self.target_lane
        self.d = opts.d if needs_drafter else 1
        B = len(prompts)
        opts.check_batch(B)
        self.chain = Chain(lanes, _core.Metrics(self.d))
        self.state = _core.RoundState(B, self.d, opts.max_new_tokens, list(opts.eos_ids), target.max_len)
        # One torch.Generator for the batch (a scalar seed), or one per request (per-request seeds): then a
        # request's uniforms come from its own stream, the very ones it would draw decoding alone.
        self.generator = ([make_generator(s) for s in opts.seed] if opts.per_request_seeds
                          else make_generator(opts.seed))
        self._head_options()
        self._markov_calls = 0
        self._zeros: Tensor | None = None  # _first_row's
        self._branch_logits: Tensor | None = None  # the hidden ring's projected branch r, when no worker reads it
        self._packed_head = None  # the hidden ring on the host: the output head for HostMarkovHead.from_hidden
        self._shared = None  # (slot, BranchSplit, head's columns): the worker is projecting the rest of branch r
        # The head call count when each row's request took it: a per-request seed's Markov offset is the calls
        # since then, so a request that joins a running decode draws what it draws alone (as from a fresh decode)
        self._row_origin = [0] * B
        self.warned_non_finite = False
        self.staging = self.context = self.ring = None
        self._in_worker: tuple[int, int, int | None] | None = None  # (round, slot, features phase) being filled
        self._absorbed_ahead: int | None = None  # features phase of an absorb sent ahead, not yet settled
        self._staged, self._slots = {}, []
        self._feature_views: dict | None = None  # _batch_buffers: the features staging as verifies write it
        # "hidden": the backbone skips the output head for all (d+1)*d rows; the head projects branch r alone.
        self.ring_logits = opts.dpara_ring == "logits"
        self._ring_capacity = ring_capacity
        self._markov_head = None  # the drafter's head (Drafter.markov_head: built once, not per decode)
        self.worker_q = self.guess = None
        if needs_drafter:
            # The drafter's context cache, here or in a drafter worker process (dpara_rt.host.context)
            self.context = (WorkerContext(worker, B, target.max_len) if worker is not None
                            else LocalContext(drafter, B, target.max_len))
            # The head accumulates in fp32: its rank-R factors are converted (on the host its bound built) once.
            self._markov_head, self._markov_enabled = drafter.markov_head(markov), markov
            if not self.ring_logits and isinstance(self._markov_head, HostMarkovHead):
                self._packed_head = drafter.packed_head()
            self.noise = NoiseAhead(self.context)  # sampled heads' noise, drawn beside verification
            self.worker_q = WorkerQ(self.context) if self.context.remote else None  # and their q, by the worker
            if self.worker_q is not None and self._packed_head is not None and not opts.sampling and B == 1:
                self.guess = BranchGuess(self.context, self.d, drafter.config.vocab_size)  # branch r ahead
            self._batch_buffers(B)
        # The last reader's event per staging region and phase: a writer waits for it before overwriting.
        self._released = {region: [_core.Event(), _core.Event()] for region in ("rb", "draft", "features")}

    def _batch_buffers(self, B: int) -> None:
        """The staging buffers and the boundary ring for B rows, with torch views of them made once (a DLPack
        round trip per use costs more than the head). The engine keeps the last decode's, and the next decode
        with the same shapes takes them (its ring reset; a worker keeps them mapped): made and mapped anew they
        cost a decode about a millisecond."""
        target, drafter = self.target, self.drafter
        feature_bytes = B * (self.d + 1) * target.feature_dim * target.dtype.itemsize
        shared = isinstance(self.context, WorkerContext)  # a worker process maps both
        row = drafter.config.vocab_size if self.ring_logits else drafter.config.hidden_size
        dtype = str(drafter.dtype).removeprefix("torch.")
        key = (B, self.d, feature_bytes, row, dtype, self._ring_capacity, self.target_lane.device_index,
               self.drafter_lane.device_index, shared)
        if self._kept is not None and self._kept.get("key") == key:
            self.staging, self.ring, self._staged, self._slots = self._kept["buffers"]
            self.ring.reset()
        else:
            self.staging = _core.Staging(B, self.d, feature_bytes, self.target_lane.device_index, shared=shared)
            self.ring = _core.BoundaryRing(self._ring_capacity, B, self.d, row, dtype, self.drafter_lane.device_index,
                                           shared=shared)
            self._staged = {(region, phase): staging_tensor(self.staging, region, phase).reshape(-1).view(torch.uint8)
                            for region in ("rb", "draft", "features") for phase in (0, 1)}
            self._slots = [slot_tensor(self.ring, i) for i in range(self._ring_capacity)]
            if self._kept is not None:  # one set: a decode of another shape replaces it
                self._kept.update(key=key, buffers=(self.staging, self.ring, self._staged, self._slots))
        self.context.map_buffers(self.staging, self.ring)
        # (phase, B, T) -> the features staging as the [B, T, F] float32 tensor a host verify writes into; None where
        # the features are staged by a copy (a device target, another dtype)
        direct = self.target_lane.device_index < 0 and target.dtype == torch.float32
        self._feature_views = {} if direct else None
        if self.worker_q is not None and self._packed_head is not None:
            # mapped now, before the decode posts what it waits for: a mapping is a call, which collects every reply
            self.worker_q.branch(B, self.d, drafter.config.vocab_size, 0)

    def grow(self, batch: int) -> None:
        """Continuous batching, lanes idle: `batch` rows from now on, the new ones free. The target and the round
        state grow in place; the drafter's context cache is copied into a larger one and the staging buffers and
        the ring are rebuilt (nothing in them is read again)."""
        B = self.state.batch()
        self.state.grow(batch)
        self.target.grow(batch)
        pad = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}
        self.opts = dataclasses.replace(self.opts, **{k: tuple(self.opts.per_row(k, B)) + (v,) * (batch - B)
                                                      for k, v in pad.items()})
        self._row_origin += [self._markov_calls] * (batch - B)
        if isinstance(self.generator, list):
            self.generator += [make_generator(0) for _ in range(batch - B)]
        else:
            self.generator = [self.generator] * batch  # rows draw from the batch's one stream, as before
        self._head_options()
        if self.drafter is not None:
            self.context.grow(batch)
            self._batch_buffers(batch)
            self._released = {region: [_core.Event(), _core.Event()] for region in self._released}

    def _head_options(self) -> None:
        # The Markov head takes one temperature and one seed: per-request ones run it once per row (greedy
        # drafts use no randomness, so an all-greedy batch keeps the batched call).
        temps = self.opts.per_row("temperature", self.state.batch())
        self._head_per_row = self.opts.sampling and (self.opts.per_request_seeds or len(set(temps)) > 1)
        self._head_temps = temps

    def set_row_options(self, b: int, temperature: float, top_p: float, top_k: int, seed: int) -> None:
        """Continuous batching: row b's sampling options for the request that takes it (between rounds)."""
        o = self.opts
        given = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        rows = {k: tuple(v if i == b else old for i, old in enumerate(o.per_row(k, self.state.batch())))
                for k, v in given.items()}
        self.opts = dataclasses.replace(o, **rows)
        self.generator[b] = make_generator(seed)
        self._row_origin[b] = self._markov_calls
        self._head_options()

    @property
    def metrics(self) -> _core.Metrics:
        return self.chain.metrics

    def post(self, lane: Lane, phase: str, fn) -> None:
        self.chain.post(lane, phase, fn)

    # ------------------------------------------------------------------ start
    def start(self) -> Outcome:
        """Prefill and pick each request's first token; the prompt's features go to the drafter directly."""
        logits, feats, prompt_lens = self.chain.run_now(self.target_lane, "prefill",
                                                        lambda: self.target.start(self.prompts))
        first = self.pick(logits)
        committed = np.zeros(len(self.prompts), dtype=np.int64)
        self.state.start(prompt_lens.numpy().astype(np.int64), first.numpy().astype(np.int64), committed)
        return Outcome(0, torch.zeros_like(first), first, [[int(t)] for t in first.tolist()], feats, prompt_lens,
                       self.running_mask(), _core.Event())

    def running_mask(self) -> Tensor:
        return torch.from_numpy(~np.asarray(self.state.finished(), dtype=bool))

    # ------------------------------------------------------------------ staging
    def _stage(self, lane: Lane, region: str, tensor: Tensor, phase: int) -> Tensor:
        """Copy `tensor` into a staging region in lane order once the region's last reader let go of the
        phase; returns the staged bytes viewed as `tensor`."""
        tensor = tensor.contiguous()
        lane.wait(self._released[region][phase])
        stage_in(self.staging, lane.core, region, tensor, phase)
        raw = self._staged[region, phase][:tensor.nbytes]
        return raw.view(tensor.dtype).view(tensor.shape)

    def _features_in_place(self, shape: torch.Size, phase: int) -> Tensor | None:
        """The features staging of `phase` as the [B, T, F] tensor a host verify writes into, once the region's last
        reader let go of it (the copy _stage makes, saved); None where the features are staged by a copy (a device
        target, no drafter). The views are made once a decode: this runs right after the last round's glue."""
        views = self._feature_views
        if views is None:
            return None
        view = views.get((phase, *shape))
        if view is None:
            B, T = shape
            F = self.target.feature_dim
            raw = self._staged["features", phase][:B * T * F * 4]
            view = views[phase, B, T] = raw.view(torch.float32).view(B, T, F)
        self.target_lane.wait(self._released["features"][phase])
        return view

    def _release(self, lane: Lane, region: str, phase: int) -> None:
        self._released[region][phase] = lane.record()

    # ------------------------------------------------------------------ drafting
    def absorb(self, out: Outcome) -> None:
        """Head lane: give the drafter's context cache the features of what `out` accepted."""
        self.head_lane.wait(out.ready)
        self.context.absorb(out.features, out.keep)
        if out.round > 0:
            self._release(self.head_lane, "features", out.phase)

    def absorb_ahead(self, out: Outcome) -> bool:
        """Target lane, right after accepting `out`: with a drafter worker, send it the accepted features now. The
        worker, idle while the Markov head link runs here (the head waited for its backbone), absorbs them then,
        and the next backbone starts as soon as the head sends it. In this process the head shares the drafter
        lane, where absorbing first would delay it: then nothing is sent (False)."""
        if not self.context.remote or out.finished:
            return False
        self.target_lane.wait(out.ready)
        self.context.absorb(out.features, out.keep)
        self._absorbed_ahead = out.phase if out.round > 0 else None  # settled with the next boundary
        return True

    def project_ahead(self, out: Outcome, slot: int) -> None:
        """Target lane, right after accepting `out`, before anything else goes to the drafter worker: with the hidden
        ring, have the worker project the last columns of branch r through the output head while the next Markov
        head projects the first ones (the worker's core is otherwise idle until the head sends the next spine).
        Both use the same packed head and kernel, so the logits are the bits one projection gives."""
        vocab = self.drafter.config.vocab_size
        # worker_q: a drafter worker; the packed head: the hidden ring on the host
        if (out.finished or self.worker_q is None or self._packed_head is None or self._head_per_row
                or vocab <= _core.HOST_LINEAR_PANEL):  # one panel: nothing to share
            return
        if self.guess is not None and self.guess.accepted(out.round, slot, out.r.tolist()):  # projected already
            return
        split = self.context.branch_split(vocab, self.state.batch())
        self.context.project_branch(slot, out.r, (self._markov_calls + 1) % 2, split.columns)
        self._shared = (slot, split, split.columns)

    def send(self, prev: Outcome, tokens: Tensor, q: Tensor | None) -> Draft:
        """Head lane (the drafter lane unless a worker process drafts): stage the draft for the round after `prev`."""
        rnd = prev.round + 1
        if self._head_on_target:
            return Draft(rnd, prev.bonus, tokens, tokens, q, _core.Event())
        staged = self._stage(self.head_lane, "draft", tokens.to(torch.int32), rnd % 2)
        return Draft(rnd, prev.bonus, tokens, staged, q, self.head_lane.record())

    def no_draft(self, prev: Outcome) -> Draft:
        """An AR round: the block is the last bonus alone."""
        return Draft(prev.round + 1, prev.bonus, None, None, None, _core.Event())

    def markov(self, boundary: Tensor, r: Tensor, bonus: Tensor, q_from: tuple[str, int] | None = None,
               branch: tuple | None = None) -> tuple[Tensor, Tensor | PendingQ | None]:
        """Draft from boundary logits [B, R1, n, V] at rows r, starting from the bonus: (draft [B, n], q).

        One batched head call when the batch shares one temperature and one seed. Otherwise (per-request
        temperatures or seeds) the head runs once per row with that row's temperature: with per-request seeds
        under the row's seed at the row's own call count (what the request alone would draw), with one seed at offset
        calls + (b << 40) (a stream of its own per row). A greedy row of a sampled batch gets q one-hot at its
        draft token, which verification against its one-hot p accepts exactly when AR greedy would. `q_from`: where
        a drafter worker finds `boundary` to compute q beside verification (noise_ahead.WorkerQ.post). `branch`
        (the hidden ring on the host, one head call for the batch): boundary holds hidden states, and (packed output
        head, logits buffer [B, d, V]) project branch r into that buffer inside the head's core call
        (HostMarkovHead.from_hidden)."""
        dev = boundary.device
        self._markov_calls += 1  # each call draws fresh Gumbel noise
        r, bonus = r.to(dev), bonus.to(dev)
        opts = self.opts
        if not self._head_per_row:  # one seed for the batch (or a greedy batch, which draws nothing)
            seed = opts.seed[0] if opts.per_request_seeds else opts.seed
            noise = self.noise.take(len(r), seed, self._markov_calls) if opts.sampling else None
            head = (self._markov_head if branch is None
                    else functools.partial(self._markov_head.from_hidden, head=branch[0], logits=branch[1]))
            if noise is not None and q_from is not None and self.worker_q is not None:
                draft, _ = head(boundary, r, bonus, self._head_temps[0], seed, self._markov_calls, noise, with_q=False)
                # the worker reads logits of one row per request: a branch projected for the head
                rows = r if branch is None else self._first_row(len(r))
                return draft, self.worker_q.post(q_from, rows, bonus, draft, self.drafter.config.vocab_size,
                                                 self._head_temps[0], self._markov_enabled, self._markov_calls)
            if noise is not None:
                return head(boundary, r, bonus, self._head_temps[0], seed, self._markov_calls, noise)
            return head(boundary, r, bonus, self._head_temps[0], seed, self._markov_calls)
        drafts, qs = [], []
        for b, temp in enumerate(self._head_temps):
            if opts.per_request_seeds:
                seed, offset = opts.seed[b], self._markov_calls - self._row_origin[b]
            else:
                seed, offset = opts.seed, self._markov_calls + (b << _ROW_STREAM_SHIFT)
            draft, q = self._markov_head(boundary[b:b + 1], r[b:b + 1], bonus[b:b + 1], temp, seed, offset)
            if q is None and opts.sampling:
                q = torch.nn.functional.one_hot(draft, boundary.shape[-1]).float()
            drafts.append(draft)
            qs.append(q)
        return torch.cat(drafts), (torch.cat(qs) if opts.sampling else None)

    def draft_serial(self, prev: Outcome, n: int | None = None, with_logits: bool = False):
        """DSpark drafting of n (default d) tokens after `prev`: backbone with the bonus as anchor, then the
        Markov head. Returns (draft, q), plus the backbone logits when asked. Only the d tokens a round
        verifies need to be within what the drafter was trained for (PSD's extra token is a guess)."""
        n = n or self.d
        logits = self.context.block_logits(prev.bonus, n, untrained_ok=n > self.d)
        draft, q = self.markov(logits[:, None], self._first_row(len(prev.bonus)), prev.bonus)
        return (draft, q, logits) if with_logits else (draft, q)

    def start_boundary(self, prev: Outcome | None, draft: Draft, slot: int) -> None:
        """Head lane, in the link that sent `draft`: absorb what `prev` accepted (None: nothing new), then fill
        ring slot `slot` with the boundary logits of every outcome of `draft`, beside its verification. In this
        process both are links of the drafter lane. With a drafter worker process both go out now as one
        message, so no thread of this process runs drafting Python while the target verifies, and the next
        Markov head's link settles them. A sampled decode's drafter also draws the next head's noise."""
        noise = None
        if self.opts.sampling and not self._head_per_row:  # the head reading this slot is the next call
            noise = self.noise.plan(self._markov_head, self.state.batch(), self.d, self.drafter.config.vocab_size,
                                    self.opts.seed, self._markov_calls + 1)
        if not self.context.remote:
            if prev is not None:
                self.post(self.drafter_lane, "context", lambda: self.absorb(prev))
            self.post(self.drafter_lane, "backbone", lambda: self.fill_boundary(draft, slot, noise))
            return
        features, keep = (None, None) if prev is None else (prev.features, prev.keep)
        if prev is not None:
            self.head_lane.wait(prev.ready)
        self.context.absorb_and_fill(features, keep, draft.spine_ids(), slot, self.ring_logits, noise)
        if self.guess is not None:  # not once the batch grows or a joining request brings sampling options
            # an AR round's one outcome is r = 0: its branch is no guess
            self.guess.post(slot, self.state.batch() == 1 and not self.opts.sampling,
                            known=[0] if draft.tokens is None else None)
        staged = prev is not None and prev.round > 0
        phase, self._absorbed_ahead = (prev.phase if staged else self._absorbed_ahead), None
        self._in_worker = (self.chain.round, slot, phase)

    def _settle(self) -> None:
        """Head lane: wait for what start_boundary sent to the worker, put its spans on the timeline, hand the
        features phase back and mark the slot ready."""
        if self._in_worker is None:
            return
        rnd, slot, phase = self._in_worker
        self._in_worker = None
        for name, t0, t1 in self.context.settle():
            self.metrics.add_event(rnd, name, self.drafter_lane.name, t0, t1)
        if phase is not None:
            self._release(self.head_lane, "features", phase)
        self.ring.mark_ready(slot, self.head_lane.record())

    def _rest(self) -> None:
        """The decode is over: a drafter worker stops spinning for a next call."""
        if self.context is not None and self.context.remote:
            self.context.rest()

    def fill_boundary(self, draft: Draft, slot: int, noise: tuple | None = None) -> None:
        """Drafter lane, beside verification: boundary logits of every outcome of `draft` into ring slot `slot`
        (and the planned noise of the head that reads it)."""
        boundary = self._slots[slot]
        self.context.boundary(draft.spine(boundary.device), slot, boundary, self.ring_logits)
        if noise is not None:
            self.noise.draw(noise)
        self.ring.mark_ready(slot, self.drafter_lane.record())

    def draft_from_boundary(self, out: Outcome, slot: int) -> tuple[Tensor, Tensor | None]:
        """Head lane: the Markov head on branch r of ring slot `slot`, from the staged (r, bonus)."""
        self._settle()
        if self._head_on_target:
            r, bonus = out.r, out.bonus
        else:
            out.ready.synchronize()  # (r, bonus) are read on the host: the ring selects rows by host r
            rb = self._staged["rb", out.phase].view(torch.int32).view(-1, 2).long()
            self._release(self.head_lane, "rb", out.phase)
            r, bonus = rb[:, 0], rb[:, 1]
        r_host = r.numpy()
        self.ring.select(slot, r_host, lane=self.head_lane.core)  # after the backbone's ready event
        try:
            boundary = self._slots[slot]
            if self.ring_logits:
                return self.markov(boundary, r, bonus, ("ring", slot))
            B, vocab = len(r_host), self.drafter.config.vocab_size
            guessed = self.guess.take(out.round, slot) if self.guess is not None else None
            if guessed is not None:
                return self.markov(guessed[:, None], self._first_row(B), bonus)
            if self._shared is not None and self._shared[0] == slot:  # the worker projects the last columns meanwhile
                _, split, columns = self._shared
                self._shared = None
                out, q_from = self.worker_q.branch(B, self.d, vocab, self._markov_calls + 1)
                rows = branch_rows(boundary, r_host)
                packed, dtype = self._packed_head
                t0 = _core.now_ns()
                _core.host_linear(rows.data_ptr(), B * self.d, rows.shape[-1], packed.data_ptr(), dtype, vocab,
                                  out.data_ptr(), 0, columns)
                t1 = _core.now_ns()
                split.observe((t0, t1), self.context.wait_branch(), _core.now_ns(), columns)
                return self.markov(out[:, None], self._first_row(B), bonus, q_from if self.opts.sampling else None)
            out = q_from = None
            if self.worker_q is not None and self.opts.sampling and not self._head_per_row:
                # projected where the worker reads it: it computes the draft's q from there (markov)
                out, q_from = self.worker_q.branch(B, self.d, vocab, self._markov_calls + 1)
            head = None if self._head_per_row else self._packed_head
            if head is not None:  # the projection and the head in one core call: each torch op here costs tens of us
                if out is None:
                    if self._branch_logits is None or len(self._branch_logits) != B:
                        self._branch_logits = torch.empty(B, self.d, vocab)
                    out = self._branch_logits
                return self.markov(boundary, r, bonus, q_from, branch=(head, out))
            rows = branch_rows(boundary, r_host)  # branch r's hidden states [B, d, H]
            with torch.inference_mode():  # grad mode is per thread: without this the host projection is torch's
                logits = self.drafter.logits(rows, out=out)
            return self.markov(logits[:, None], self._first_row(B), bonus, q_from)
        finally:
            self.ring.release(slot, self.head_lane.record())

    def _first_row(self, batch: int) -> Tensor:
        """r = 0 for every request: the row of a boundary that holds one outcome (a block, a projected branch)."""
        if self._zeros is None or len(self._zeros) != batch:
            self._zeros = torch.zeros(batch, dtype=torch.long)
        return self._zeros

    # ------------------------------------------------------------------ verification
    def pick(self, logits: Tensor) -> Tensor:
        o = self.opts
        return sample(logits, o.temperature, o.top_p, self.generator, o.top_k).cpu()

    def pick_row(self, b: int, logits: Tensor) -> int:
        """Row b's token from its logits [V], with that row's options and random stream (an admitted request's
        first token)."""
        o, B = self.opts, self.state.batch()
        gen = self.generator[b] if isinstance(self.generator, list) else self.generator
        row = {k: o.per_row(k, B)[b] for k in ("temperature", "top_p", "top_k")}
        return int(sample(logits[None], row["temperature"], row["top_p"], gen, row["top_k"])[0])

    def verify(self, draft: Draft) -> Verified:
        """Target lane: the target's forward over [b, t1..td] and what the acceptance rule needs."""
        draft.ready.synchronize()  # the staged tokens are read on the host (the round state takes host ids)
        self.chain.hand_over()  # the last round's tokens: the consumer takes them while the target computes
        phase = draft.round % 2
        if draft.tokens is None:
            block = draft.bonus[:, None]
        else:
            block = torch.cat([draft.bonus[:, None], draft.staged.long()], dim=1)
            if draft.staged is not draft.tokens:
                self._release(self.target_lane, "draft", phase)
        staged = self._features_in_place(block.shape, phase)
        logits, feats, argmax = self.target.verify_argmax(block, staged)
        if argmax is None:
            raise FloatingPointError(f"round {draft.round}: the target's logits hold non-finite values (NaN or inf); "
                                     "expected finite logits (a damaged model or an overflow in its dtype)")
        if self.drafter is not None and staged is None:
            feats = self._stage(self.target_lane, "features", feats, phase)
        greedy = draft.tokens is not None and not self.opts.sampling
        if draft.tokens is None:  # AR: the bonus is the target's own token
            tok = self.pick(logits[:, 0]) if self.opts.sampling else argmax[:, 0]
            return Verified(block, feats, r=torch.zeros_like(tok), bonus=tok)
        if greedy:
            return Verified(block, feats, argmax=argmax)
        # p is the truncated distribution AR draws from (temperature, top-k, top-p: sampling.probs), on every
        # ops backend; q stays the drafter's own, untruncated (tokens outside p's support are always rejected).
        o = self.opts
        p = probs(logits, o.temperature, o.top_p, o.top_k)
        B, d = block.shape[0], block.shape[1] - 1
        u_accept = uniforms(self.generator, B, d).to(p.device)
        u_bonus = uniforms(self.generator, B).to(p.device)
        q = (draft.q.take() if isinstance(draft.q, PendingQ) else draft.q).to(p.device)
        damaged = not all_finite(q)
        if damaged:
            finite = torch.isfinite(q).all(-1)  # [B, d]: a position whose q is not a distribution cannot be judged
            _warn_non_finite_draft(self)
            q = torch.where(finite[..., None], q, 0.0)
        r, bonus = ops.verify_sample(p, q, block[:, 1:].to(p.device), u_accept, u_bonus)
        if damaged:
            r, bonus = stop_at_non_finite(p, r, bonus, finite, u_bonus)
        return Verified(block, feats, r=r.cpu(), bonus=bonus.cpu())

    def accept(self, verified: Verified, slot: int = -1) -> Outcome:
        """Target lane: commit the round. The C++ round state accepts (greedy) or takes the drawn (r, bonus),
        stops at EOS or max_new_tokens inside the block, and records the round; the target keeps the KV of
        s_0..s_r."""
        for b in self.admission.retirements() if self.admission is not None else ():
            self.state.retire(b)  # a cancelled request leaves now: nothing of this round is committed for it
        # one core call: this runs every round, right after a verify, and each small array op costs microseconds
        greedy = verified.argmax is not None
        r, bonus, _, keep, tokens = self.state.accept(
            verified.block.numpy(), verified.argmax.numpy() if greedy else None,
            None if greedy else verified.r.numpy(), None if greedy else verified.bonus.numpy(), slot, self.metrics)
        r_t, keep_t = torch.from_numpy(r), torch.from_numpy(keep)
        self.target.commit(keep)
        # Finished requests keep their last bonus as s_0: their rows still run through the batched forwards.
        bonus_t = torch.from_numpy(bonus)
        rnd = self.state.rounds()
        if self.drafter is not None and not self._head_on_target:
            self._stage(self.target_lane, "rb", torch.stack([r_t, bonus_t], 1).to(torch.int32), rnd % 2)
        self.chain.round = rnd
        return Outcome(rnd, r_t, bonus_t, tokens, verified.features, keep_t, self.running_mask(),
                       self.target_lane.record(), any_running=self.state.num_running() > 0)

    def verify_and_accept(self, draft: Draft, slot: int = -1) -> Outcome:
        """Target-lane link: verify, commit, and hand the round's tokens to the consumer."""
        out = self.accept(self.verify(draft), slot)
        self.chain.emit(out.tokens, hold=True)  # the next verify hands them over, off the critical path
        if not out.finished and self.admission is not None and self.admission.should_pause(out):
            self.paused = out = dataclasses.replace(out, pause=True)
        if out.finished:
            self.chain.finish()
        return out

    def run(self, method) -> Iterator[list[list[int]]]:
        """Start the method's chain from the prefill's outcome; yields each round's commits. Under continuous
        batching, whenever the chain pauses (or every request finished) the admission fills free rows and the
        method starts again from a joint outcome: the running rows' last round and the new rows' prompts."""
        first = self.start()
        if self.admission is not None:  # the prefill's placeholder rows are free slots
            for b in range(self.state.batch()):
                self.state.retire(b)
            first = self.admission.readmit(self, None)
            if first is None:
                return
        yield first.tokens
        while True:
            if not first.finished:
                method(self, first)
                yield from self.chain.drain()
            if self.admission is None:
                return self._rest()
            self._settle()  # a backbone sent for the paused round: nobody reads its slot (readmit resets the ring)
            first, self.paused = self.admission.readmit(self, self.paused), None
            if first is None:
                return self._rest()
            self.chain.restart()
            yield first.tokens


__all__ = ["DecodeOptions", "Decoder", "Draft", "Outcome", "Verified", "PSD_POLICIES"]
