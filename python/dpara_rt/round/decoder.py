"""The steps of a speculative round, shared by every method and every device (``Decoder``): prefill, verify,
accept, and the hand-offs between lanes. Drafting goes through the decode's ``DraftingBackend``
(``dec.drafting``, ``dpara_rt.drafting``); the values that travel between the steps are in ``round.values``
(re-exported here)."""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Iterator

import numpy as np
import torch
from torch import Tensor

from dpara_rt import _core, ops
from dpara_rt.core import slot_tensor, stage_in, staging_tensor
from dpara_rt.models.target import Target
from dpara_rt.round.chain import Chain
from dpara_rt.round.lanes import Lane
from dpara_rt.round.options import PSD_POLICIES, DecodeOptions, is_int  # noqa: F401 (re-exported)
from dpara_rt.round.values import Draft, Outcome, Verified
from dpara_rt.sampling import make_generator, probs, sample, stop_at_non_finite, uniforms


def _warn_non_finite_draft(dec: "Decoder") -> None:
    if not dec.warned_non_finite:  # once per call, not once per round
        dec.warned_non_finite = True
        warnings.warn("the drafter produced non-finite probabilities; those draft tokens are treated as rejected "
                      "and the target's own distribution picks the token (output stays exact; speed suffers)",
                      RuntimeWarning, stacklevel=3)


def _read_here(t: Tensor, device: torch.device) -> Tensor:
    """`t`, made on another lane, read by this lane's next ops on `device`: on CUDA the caching allocator is told it
    is in use on this stream too, so the other lane's next allocation cannot reuse its memory before the read."""
    if t.is_cuda:
        t.record_stream(torch.cuda.current_stream(t.device))
    return t.to(device, non_blocking=True)


def _no_acceptance(batch: int) -> Tensor:
    """r = 0 for every row (an AR round), in host memory as the round state's arrays are."""
    return torch.from_numpy(np.zeros(batch, dtype=np.int64))


class Decoder:
    """One decode call: the target and its cache, the two lanes, the staging buffers, the boundary ring and the C++
    round state, all built here for this batch; the drafter behind ``drafting``, a backend built by
    ``drafting_backend(dec, drafter, markov)`` (None for AR)."""

    def __init__(self, target: Target, drafter, lanes: tuple[Lane, Lane], opts: DecodeOptions,
                 prompts: list[list[int]], drafting_backend=None, ring_capacity: int = 2,
                 markov: bool = True, admission=None, kept: dict | None = None):
        self.target, self.opts, self.prompts = target, opts, prompts
        self._kept = kept  # the engine's: the last decode's staging and ring, reused when this one's are alike
        # Continuous batching (dpara_rt.serving.batching.Slots): rows are slots that requests take and leave between
        # rounds; None for a fixed batch.
        self.admission, self.paused = admission, None
        self.drafter = drafter if drafting_backend is not None else None
        self.target_lane, self.drafter_lane = lanes
        self.d = opts.d if self.drafter is not None else 1
        B = len(prompts)
        opts.check_batch(B)
        self.chain = Chain(lanes, _core.Metrics(self.d))
        self.state = _core.RoundState(B, self.d, opts.max_new_tokens, list(opts.eos_ids), target.max_len)
        # One torch.Generator for the batch (a scalar seed), or one per request (per-request seeds): then a
        # request's uniforms come from its own stream, the very ones it would draw decoding alone.
        self.generator = ([make_generator(s) for s in opts.seed] if opts.per_request_seeds
                          else make_generator(opts.seed))
        self.warned_non_finite = False
        self.staging = self.ring = None
        self.staged, self.slots = {}, []  # torch views of the staging regions and of the ring's slots
        self._feature_views: dict | None = None  # _batch_buffers: the features staging as verifies write it
        # "hidden": the backbone skips the output head for all (d+1)*d rows; the head projects branch r alone.
        self.ring_logits = opts.dpara_ring == "logits"
        self._ring_capacity = ring_capacity
        self.drafting = drafting_backend(self, drafter, markov) if self.drafter is not None else None
        # Where the Markov head and the draft's hand-off run: the drafter lane, or the target lane right after
        # verification (a backend whose drafter runs in another process). On the target lane the head reads
        # (r, bonus) from the round's Outcome and verification reads the draft it was handed: no staging between two
        # links of one thread.
        self.head_on_target = self.drafting is not None and self.drafting.head_on_target
        self.head_lane = self.target_lane if self.head_on_target else self.drafter_lane
        if self.drafting is not None:
            self._batch_buffers(B)
        # The last reader's event per staging region and phase: a writer waits for it before overwriting.
        self._released = {region: [_core.Event(), _core.Event()] for region in ("draft", "features")}

    def _batch_buffers(self, B: int) -> None:
        """The staging buffers and the boundary ring for B rows, with torch views of them made once (a DLPack
        round trip per use costs more than the head). The engine keeps the last decode's, and the next decode
        with the same shapes takes them (its ring reset; a worker keeps them mapped): made and mapped anew they
        cost a decode about a millisecond."""
        target, drafter = self.target, self.drafter
        feature_bytes = B * (self.d + 1) * target.feature_dim * target.dtype.itemsize
        shared = self.drafting.shared_buffers  # another process maps both
        row = drafter.config.vocab_size if self.ring_logits else drafter.config.hidden_size
        dtype = str(drafter.dtype).removeprefix("torch.")
        key = (B, self.d, feature_bytes, row, dtype, self._ring_capacity, self.target_lane.device_index,
               self.drafter_lane.device_index, shared)
        if self._kept is not None and self._kept.get("key") == key:
            self.staging, self.ring, self.staged, self.slots = self._kept["buffers"]
            self.ring.reset()
        else:
            self.staging = _core.Staging(B, self.d, feature_bytes, self.target_lane.device_index, shared=shared)
            self.ring = _core.BoundaryRing(self._ring_capacity, B, self.d, row, dtype, self.drafter_lane.device_index,
                                           shared=shared)
            self.staged = {(region, phase): staging_tensor(self.staging, region, phase).reshape(-1).view(torch.uint8)
                           for region in ("draft", "features") for phase in (0, 1)}
            self.slots = [slot_tensor(self.ring, i) for i in range(self._ring_capacity)]
            if self._kept is not None:  # one set: a decode of another shape replaces it
                self._kept.update(key=key, buffers=(self.staging, self.ring, self.staged, self.slots))
        # (phase, B, T) -> the features staging as the [B, T, F] float32 tensor a host verify writes into; None where
        # the features are staged by a copy (a device target, another dtype)
        direct = self.target_lane.device_index < 0 and target.dtype == torch.float32
        self._feature_views = {} if direct else None
        self.drafting.map_buffers(self.staging, self.ring)

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
        if isinstance(self.generator, list):
            self.generator += [make_generator(0) for _ in range(batch - B)]
        else:
            self.generator = [self.generator] * batch  # rows draw from the batch's one stream, as before
        if self.drafting is not None:
            self.drafting.grow(batch)
            self.drafting.options_changed()
            self._batch_buffers(batch)
            self._released = {region: [_core.Event(), _core.Event()] for region in self._released}

    def set_row_options(self, b: int, temperature: float, top_p: float, top_k: int, seed: int) -> None:
        """Continuous batching: row b's sampling options for the request that takes it (between rounds)."""
        o = self.opts
        given = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        rows = {k: tuple(v if i == b else old for i, old in enumerate(o.per_row(k, self.state.batch())))
                for k, v in given.items()}
        self.opts = dataclasses.replace(o, **rows)
        self.generator[b] = make_generator(seed)
        if self.drafting is not None:
            self.drafting.row_joined(b)
            self.drafting.options_changed()

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
        first = self.pick(logits).cpu()
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
        raw = self.staged[region, phase][:tensor.nbytes]
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
            raw = self.staged["features", phase][:B * T * F * 4]
            view = views[phase, B, T] = raw.view(torch.float32).view(B, T, F)
        self.target_lane.wait(self._released["features"][phase])
        return view

    def release(self, lane: Lane, region: str, phase: int) -> None:
        self._released[region][phase] = lane.record()

    # ------------------------------------------------------------------ hand-offs to and from the head
    def send(self, prev: Outcome, tokens: Tensor, q, slot: int = -1) -> Draft:
        """Head lane: the draft for the round after `prev`, staged for the target lane unless the head runs there;
        `slot`: the ring slot its boundary logits fill beside its verification (DPara)."""
        rnd = prev.round + 1
        if self.head_on_target:
            return Draft(rnd, prev.bonus, tokens, tokens, q, _core.Event(), slot)
        if self.target.block_on_device:  # the verify reads the head's tokens where they are, after this event
            return Draft(rnd, prev.bonus, tokens, tokens, q, self.head_lane.record(), slot)
        staged = self._stage(self.head_lane, "draft", tokens.to(torch.int32), rnd % 2)
        return Draft(rnd, prev.bonus, tokens, staged, q, self.head_lane.record(), slot)

    def no_draft(self, prev: Outcome, slot: int = -1) -> Draft:
        """An AR round: the block is the last bonus alone."""
        return Draft(prev.round + 1, prev.bonus, None, None, None, _core.Event(), slot)

    # ------------------------------------------------------------------ verification
    def pick(self, logits: Tensor) -> Tensor:
        """Each row's token from its logits [B, V], drawn where they are, with the decode's options."""
        o = self.opts
        return sample(logits, o.temperature, o.top_p, self.generator, o.top_k)

    def pick_row(self, b: int, logits: Tensor) -> int:
        """Row b's token from its logits [V], with that row's options and random stream (an admitted request's
        first token)."""
        o, B = self.opts, self.state.batch()
        gen = self.generator[b] if isinstance(self.generator, list) else self.generator
        row = {k: o.per_row(k, B)[b] for k in ("temperature", "top_p", "top_k")}
        return int(sample(logits[None], row["temperature"], row["top_p"], gen, row["top_k"])[0])

    def verify(self, draft: Draft) -> Verified:
        """Target lane: the target's forward over [b, t1..td] and what the acceptance rule needs."""
        block, staged = self.block_for(draft)
        logits, feats, argmax, block, judged = self.target.verify_block(block, staged, self.judge_for(draft))
        return self.verified(draft, block, self.features_staged(feats, staged, draft.round % 2), argmax, judged)

    def block_for(self, draft: Draft) -> tuple[Tensor, Tensor | None]:
        """Target lane: the block [B, T] to verify, and the features staging a host verify writes into (None where the
        features are staged by a copy: features_staged)."""
        phase = draft.round % 2
        if self.target.block_on_device and draft.tokens is not None:
            # the block is built where the target computes, after the head lane's event: the host reads it back
            # with the arg-max, in the verify's one copy, and never waits for the head
            self.target_lane.wait(draft.ready)
            self.chain.hand_over()  # the last round's tokens: the consumer takes them while the target computes
            dev = self.target.device
            block = torch.cat([ops.upload(draft.bonus[:, None], dev), _read_here(draft.tokens, dev).long()], dim=1)
        else:
            if draft.tokens is not None and draft.staged is not draft.tokens:
                draft.ready.synchronize()  # the staged tokens are read on the host (the round state takes host ids)
            self.chain.hand_over()
            block = draft.bonus[:, None] if draft.tokens is None else \
                torch.cat([draft.bonus[:, None], draft.staged.long().to(draft.bonus.device)], dim=1)
        if draft.tokens is not None and draft.staged is not draft.tokens:
            self.release(self.target_lane, "draft", phase)
        return block, self._features_in_place(block.shape, phase)

    def judge_for(self, draft: Draft):
        """verify_block's judge of `draft` (None: a greedy round, which the round state accepts from the arg-max)."""
        if not self.opts.sampling:
            return None
        return self._pick_bonus if draft.tokens is None else functools.partial(self._judge, draft.q)

    def features_staged(self, feats: Tensor, staged: Tensor | None, phase: int) -> Tensor:
        """The verify's features where the drafter reads them: the staging it wrote into, else a staged copy."""
        if self.drafter is not None and staged is None:
            return self._stage(self.target_lane, "features", feats, phase)
        return feats

    def verified(self, draft: Draft, block: Tensor, feats: Tensor, argmax: Tensor | None,
                 judged: Tensor | None) -> Verified:
        """What the round state accepts from, out of a verify's read-back (host block, arg-max, judge's verdicts)."""
        if argmax is None:
            raise FloatingPointError(f"round {draft.round}: the target's logits hold non-finite values (NaN or inf); "
                                     "expected finite logits (a damaged model or an overflow in its dtype)")
        if judged is None:  # greedy: the round state accepts from the arg-max
            if draft.tokens is None:  # AR: the bonus is the target's own token
                return Verified(block, feats, draft.slot, r=_no_acceptance(argmax.shape[0]), bonus=argmax[:, 0])
            return Verified(block, feats, draft.slot, argmax=argmax)
        if draft.tokens is None:
            return Verified(block, feats, draft.slot, r=_no_acceptance(len(judged)), bonus=judged)
        B = block.shape[0]
        if judged[2 * B]:
            _warn_non_finite_draft(self)
        return Verified(block, feats, draft.slot, r=judged[:B], bonus=judged[B:2 * B])

    def _pick_bonus(self, logits: Tensor, block: Tensor) -> Tensor:
        """An AR round's sampled token [B], where the logits are (verify_block's judge)."""
        return self.pick(logits[:, 0])

    def _judge(self, q, logits: Tensor, block: Tensor) -> Tensor:
        """verify_block's judge of a sampled round, where the logits are: [r (B), bonus (B), 1 if the drafter's q held
        a non-finite value] by lossless rejection sampling. p is the truncated distribution AR draws from
        (temperature, top-k, top-p: sampling.probs); q stays the drafter's own, untruncated (tokens outside p's
        support are always rejected). On a device nothing is read here: a damaged q is handled by selects."""
        o = self.opts
        p = probs(logits, o.temperature, o.top_p, o.top_k)
        B, d = block.shape[0], block.shape[1] - 1
        u_accept = ops.upload(uniforms(self.generator, B, d), p.device)
        u_bonus = ops.upload(uniforms(self.generator, B), p.device)
        q = self.drafting.resolve_q(q)
        q = q.to(p.device, non_blocking=True)  # a drafter on another device: a copy between devices
        # on the host the finiteness check is a cheap read; a device skips it and always takes the selects below
        finite = None if ops.backend(p.device) == "host" and ops.all_finite(q) else torch.isfinite(q).all(-1)
        if finite is not None:  # [B, d]: a position whose q is not a distribution cannot be judged
            q = torch.where(finite[..., None], q, 0.0)
        # the draft is the head's own ids and the uniforms are in [0, 1) by construction: no value check
        r, bonus = ops.verify_sample(p, q, block[:, 1:], u_accept, u_bonus, checked=True)
        if finite is None:
            return torch.cat([r, bonus, r.new_zeros(1)])
        damaged = ~finite.all()
        stopped_r, stopped_bonus = stop_at_non_finite(p, r, bonus, finite, u_bonus)
        return torch.cat([torch.where(damaged, stopped_r, r), torch.where(damaged, stopped_bonus, bonus),
                          damaged.long().reshape(1)])

    def accept(self, verified: Verified, queued: _core.Event | None = None) -> Outcome:
        """Target lane: commit the round. The C++ round state accepts (greedy) or takes the drawn (r, bonus),
        stops at EOS or max_new_tokens inside the block, and records the round; the target keeps the KV of
        s_0..s_r. `queued`: a round read a round late (round/lagged.py): the target lane's event right after its
        verify, which the drafter's reads of it wait for (not the rounds queued since); the device's lengths
        advanced already."""
        for b in self.admission.retirements() if self.admission is not None else ():
            self.state.retire(b)  # a cancelled request leaves now: nothing of this round is committed for it
        # one core call: this runs every round, right after a verify, and each small array op costs microseconds
        greedy = verified.argmax is not None
        r, bonus, _, keep, tokens = self.state.accept(
            verified.block.numpy(), verified.argmax.numpy() if greedy else None,
            None if greedy else verified.r.numpy(), None if greedy else verified.bonus.numpy(), verified.slot,
            self.metrics)
        r_t, keep_t = torch.from_numpy(r), torch.from_numpy(keep)
        if queued is not None:
            self.target.commit_host(keep)
        else:
            self.target.commit(keep)
        # Finished requests keep their last bonus as s_0: their rows still run through the batched forwards.
        bonus_t = torch.from_numpy(bonus)
        rnd = self.state.rounds()
        self.chain.round = rnd
        return Outcome(rnd, r_t, bonus_t, tokens, verified.features, keep_t, self.running_mask(),
                       self.target_lane.record() if queued is None else queued, verified.slot,
                       any_running=self.state.num_running() > 0)

    def verify_and_accept(self, draft: Draft) -> Outcome:
        """Target-lane link: verify, commit, and hand the round's tokens to the consumer."""
        return self.conclude(self.accept(self.verify(draft)))

    def conclude(self, out: Outcome) -> Outcome:
        """Target lane: hand a committed round's tokens to the consumer; the chain ends (or pauses) there."""
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
            if self.drafting is not None:
                # a backbone sent for a paused round: nobody reads its slot (readmit resets the ring)
                self.drafting.settle()
            if self.admission is not None:
                first, self.paused = self.admission.readmit(self, self.paused), None
            if self.admission is None or first is None:
                if self.drafting is not None:
                    self.drafting.rest()  # the decode is over
                return
            self.chain.restart()
            yield first.tokens


__all__ = ["DecodeOptions", "Decoder", "Draft", "Outcome", "Verified", "PSD_POLICIES"]
