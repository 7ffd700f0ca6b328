"""The device backend: the drafter in this process, on whatever device holds its weights (torch and Triton
kernels through ``dpara_rt.ops``; the same code runs on CPU tensors). Its forwards are links of the drafter lane:
on CUDA a lane is a stream, so the backbone beside verification is a second stream's work."""
from __future__ import annotations

import inspect
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor

from dpara_rt import ops
from dpara_rt.core import branch_rows
from dpara_rt.drafting.backend import DraftingBackend
from dpara_rt.round.values import Draft, Outcome

ROW_STREAM_SHIFT = 40  # per-row Markov head calls under one seed: row b's Philox offset is calls + (b << 40)


class LocalContext:
    """The drafter and its context cache in this process: every call runs now, in the calling thread."""

    def __init__(self, drafter, batch: int, max_len: int):
        self.drafter = drafter
        self.cache = drafter.new_context_cache(batch, max_len)

    def map_buffers(self, staging, ring) -> None:
        """Nothing to map: the caller hands tensors over directly."""

    def absorb(self, features: Tensor, keep: Tensor, on_device: bool = False) -> None:
        """Append the first keep[b] rows of features [B, T, F] to row b of the context (`on_device`: keep in device
        memory, at the device's lengths; the first such call starts keeping them, from the host's)."""
        if on_device and self.cache.dev_lengths is None:
            self.cache.track_on_device()
        self.drafter.extend_context(self.cache, features.to(self.drafter.device, non_blocking=True), keep, on_device)

    def follow(self, keep) -> None:
        """The host's lengths += keep [B] (host), after rows the device absorbed already."""
        lengths = self.cache.host_lengths
        lengths[:] = np.minimum(lengths + keep, self.cache.max_len)

    def block_logits(self, bonus: Tensor, n: int, untrained_ok: bool, prefix: Tensor | None = None,
                     prefix_seen: Tensor | None = None, ahead: int | None = None) -> Tensor:
        """A serial block's logits [B, n, V] (`prefix` / `prefix_seen`: PSD's feature-less spine before it; `ahead`:
        at the device's lengths, at most that far past the host's)."""
        return self.drafter.block_logits(self.cache, bonus, n, prefix=prefix, prefix_seen=prefix_seen,
                                         untrained_ok=untrained_ok, checked=True, ahead=ahead)

    def boundary(self, spine: Tensor, slot: int, out: Tensor, project: bool, ahead: int | None = None) -> None:
        """Boundary logits (or the branches' hidden states) of `spine` [B, k <= d+1] into ring slot `out` (its
        branches 0..k-1); `ahead`: at the device's lengths, over a window of granules."""
        self.drafter.boundary_logits(self.cache, spine, out=out, project=project, d=out.shape[2], checked=True,
                                     ahead=ahead)

    def reset_row(self, b: int, features: Tensor) -> None:
        """Row b of the context: emptied, then `features` [T, F] (a request joining a serving decode)."""
        reset_context_row(self.drafter, self.cache, b, features)

    def grow(self, batch: int) -> None:
        """`batch` rows from now on: the cache is copied into a larger one, the new rows empty."""
        self.cache = grown_context(self.drafter, self.cache, batch)

    def shared_buffer(self, name: str, shape: tuple) -> Tensor:
        """A float32 buffer both sides of the context use; here both are this process: plain memory."""
        return torch.empty(shape, dtype=torch.float32)


def reset_context_row(drafter, cache, b: int, features: Tensor) -> None:
    """Row b of a context cache emptied, then filled with `features` [T, F]."""
    lengths = cache.lengths.clone()
    lengths[b] = 0
    drafter.crop(cache, lengths)
    rows = torch.zeros(cache.batch, features.shape[0], features.shape[1], dtype=features.dtype, device=features.device)
    rows[b] = features
    n = torch.zeros(cache.batch, dtype=torch.long)
    n[b] = features.shape[0]
    drafter.extend_context(cache, rows.to(drafter.device), n)


def grown_context(drafter, cache, batch: int):
    """A context cache of `batch` rows holding `cache`'s rows first."""
    new = drafter.new_context_cache(batch, cache.max_len)
    B = cache.batch
    new.k[:, :B], new.v[:, :B] = cache.k, cache.v
    new.lengths[:B] = cache.lengths
    return new


def markov_rows(head, logits: Tensor, r: Tensor, bonus: Tensor, rows, sampling: bool) -> tuple[Tensor, Tensor | None]:
    """A Markov head (``Drafter.markov_head``) over logits [B, R1, n, V] at rows r [B] from bonus [B], with rows[b] =
    (temperature, seed, Philox offset) of row b: (draft [B, n], q [B, n, V] when `sampling`, else None). Each row
    draws what it would draw alone: one batched call when every row is greedy (no randomness), else one call per
    row. A greedy row of a sampled batch gets q one-hot at its draft token, which verification against its one-hot
    p accepts exactly when AR greedy would. The device backend's per-request options and the Speculator's
    per-request streams both draft through it."""
    if all(temp == 0 for temp, _, _ in rows):
        draft, _ = head(logits, r, bonus, 0.0, 0, 0)
        q = torch.nn.functional.one_hot(draft, logits.shape[-1]).float() if sampling else None
        return draft, q
    drafts, qs = [], []
    for b, (temp, seed, offset) in enumerate(rows):
        draft, q = head(logits[b:b + 1], r[b:b + 1], bonus[b:b + 1], temp, seed, offset)
        if q is None and sampling:
            q = torch.nn.functional.one_hot(draft, logits.shape[-1]).float()
        drafts.append(draft)
        qs.append(q)
    return torch.cat(drafts), (torch.cat(qs) if sampling else None)


@contextmanager
def branch_selected(ring, slot: int, r, lane):
    """Lane `lane`: ring slot `slot` with branch r [B] selected (after the backbone's ready event), released once the
    body has read it. The round's head and the Speculator's both read a slot this way."""
    ring.select(slot, r, lane=lane.core)
    try:
        yield
    finally:
        ring.release(slot, lane.record())


class DeviceBackend(DraftingBackend):
    """Drafting in this process: the context cache here, the backbone as a drafter-lane link beside verification,
    branch r projected (the hidden ring) and the Markov head on the drafter lane."""

    drafts_from_device = True

    def __init__(self, dec, drafter, markov: bool = True):
        self.dec, self.drafter, self.d = dec, drafter, dec.d
        self.vocab = drafter.config.vocab_size
        B = dec.state.batch()
        self.context = self.new_context(B, dec.target.max_len)
        # The head accumulates in fp32: its rank-R factors are converted (on the host its bound built) once.
        self.head, self.markov_enabled = drafter.markov_head(markov), markov
        # r and bonus are the round state's own (r in 0..d, bonus a token id): a head that can skip their value
        # check skips it, which on a device would wait for their copies
        self.head_checked = {"checked": True} if _takes(self.head, "checked") else {}
        self.calls = 0  # head calls this decode: each draws fresh noise at offset `calls`
        # The head call count when each row's request took it: a per-request seed's offset is the calls since then,
        # so a request that joins a running decode draws what it draws alone (as from a fresh decode)
        self.row_origin = [0] * B
        self._zeros: Tensor | None = None
        self.options_changed()

    def new_context(self, batch: int, max_len: int):
        return LocalContext(self.drafter, batch, max_len)

    # -------------------------------------------------------------- the decode's shape
    def map_buffers(self, staging, ring) -> None:
        self.context.map_buffers(staging, ring)

    def options_changed(self) -> None:
        # The Markov head takes one temperature and one seed: per-request ones run it once per row (greedy drafts
        # use no randomness, so an all-greedy batch keeps the batched call).
        o = self.dec.opts
        self.head_temps = o.per_row("temperature", self.dec.state.batch())
        self.head_per_row = o.sampling and (o.per_request_seeds or len(set(self.head_temps)) > 1)

    def grow(self, batch: int) -> None:
        self.row_origin += [self.calls] * (batch - len(self.row_origin))
        self.context.grow(batch)

    def reset_row(self, b: int, features: Tensor) -> None:
        self.context.reset_row(b, features)

    def row_joined(self, b: int) -> None:
        self.row_origin[b] = self.calls

    # -------------------------------------------------------------- a round's calls
    def absorb(self, out: Outcome, on_device: bool = False) -> None:
        dec = self.dec
        dec.head_lane.wait(out.ready)
        if on_device:  # at the device's lengths (static shapes); the host's follow at once, keep being known
            self.context.absorb(out.features, ops.upload(out.keep, self.drafter.device), on_device=True)
            self.follow_context(out)
        else:
            self.context.absorb(out.features, out.keep)
        if out.round > 0:
            dec.release(dec.head_lane, "features", out.phase)

    def on_accept(self, out: Outcome) -> bool:
        return False  # the head's link absorbs, on the drafter lane

    def draft_serial(self, prev: Outcome, n: int | None = None, with_logits: bool = False):
        # Only the d tokens a round verifies need be within what the drafter was trained for (PSD's extra is a guess)
        n = n or self.d
        logits = self.context.block_logits(prev.bonus, n, untrained_ok=n > self.d)
        draft, q = self.markov(logits[:, None], self.first_row(len(prev.bonus)), prev.bonus)
        return (draft, q, logits) if with_logits else (draft, q)

    def draft_serial_from_device(self, pending, ahead: int) -> tuple[Tensor, object]:
        """draft_serial for a round the host has not read (round/lagged.py): its keep rows absorbed at the
        context's device lengths, then the block anchored at its device bonus; the host's lengths follow with
        ``follow_context``. `ahead`: how far the device's lengths may run past the host's."""
        dec = self.dec
        _, bonus = pending.for_lane(dec.drafter_lane)
        self.context.absorb(pending.features, pending.keep, on_device=True)
        dec.release(dec.drafter_lane, "features", pending.round % 2)
        logits = self.context.block_logits(bonus, self.d, untrained_ok=False, ahead=ahead)
        return self.markov(logits[:, None], self.first_row(len(bonus)), bonus)

    def follow_context(self, out: Outcome) -> None:
        """Drafter lane: the context's host lengths catch up with a round the device absorbed already."""
        self.context.follow(out.keep.numpy())

    def block_logits(self, bonus: Tensor, n: int, prefix: Tensor | None = None,
                     prefix_seen: Tensor | None = None) -> Tensor:
        return self.context.block_logits(bonus, n, untrained_ok=True, prefix=prefix, prefix_seen=prefix_seen)

    def start_boundary(self, prev: Outcome | None, draft: Draft) -> None:
        dec = self.dec
        if prev is not None:
            dec.post(dec.drafter_lane, "context", lambda: self.absorb(prev))
        dec.post(dec.drafter_lane, "backbone", lambda: self.fill_boundary(draft))

    def start_boundary_on_device(self, prev: Outcome, draft: Draft) -> None:
        """start_boundary in a lagged round: the context grows at its device lengths and the backbone attends to a
        window of them, in shapes that change only when the window does (what a captured graph needs)."""
        dec = self.dec
        dec.post(dec.drafter_lane, "context", lambda: self.absorb(prev, on_device=True))
        dec.post(dec.drafter_lane, "backbone", lambda: self.fill_boundary(draft, ahead=0))

    def fill_boundary(self, draft: Draft, *, ahead: int | None = None) -> None:
        """Drafter lane, beside verification: the boundary logits of every outcome of `draft` into its ring slot
        (`ahead`: at the context's device lengths)."""
        dec = self.dec
        boundary = dec.slots[draft.slot]
        self.context.boundary(draft.spine(boundary.device), draft.slot, boundary, dec.ring_logits, ahead)
        dec.ring.mark_ready(draft.slot, dec.drafter_lane.record())

    def draft_from_boundary(self, out: Outcome) -> tuple[Tensor, object]:
        dec = self.dec
        self.settle()
        r, bonus = out.r, out.bonus  # the round state's host arrays: this link is posted after they exist
        with branch_selected(dec.ring, out.slot, r.numpy(), dec.head_lane):
            return self.draft_branch(out, dec.slots[out.slot], r, bonus)

    def draft_from_device(self, pending) -> tuple[Tensor, object]:
        """draft_from_boundary for a round the host has not read (round/lagged.py): branch pending.r of its slot from
        pending.bonus, both in device memory, so the ring hands the slot over without host r."""
        dec = self.dec
        r, bonus = pending.for_lane(dec.head_lane)
        dec.ring.take(pending.slot, lane=dec.head_lane.core)
        try:
            return self.draft_branch(pending, dec.slots[pending.slot], r, bonus, r_on_host=False)
        finally:
            dec.ring.release(pending.slot, dec.head_lane.record())

    def draft_branch(self, out: Outcome, boundary: Tensor, r: Tensor, bonus: Tensor,
                     r_on_host: bool = True) -> tuple[Tensor, object]:
        """The one way this backend drafts from a slot [B, d+1, d, row]: branch r's logits (the ring's rows, or the
        hidden ring's rows projected through the output head), then the head. `r_on_host`: r may be read on the
        host (else the hidden ring's rows are gathered by r where it is)."""
        if self.dec.ring_logits:
            return self.markov(boundary, r, bonus)
        if r_on_host:
            rows = branch_rows(boundary, r.numpy())
        else:
            r = r.to(boundary.device, non_blocking=True)
            rows = boundary[torch.arange(len(r), device=boundary.device), r]
        with torch.inference_mode():  # grad mode is per thread: without this the host projection is torch's
            logits = self.drafter.logits(rows)  # [B, d, V]
        return self.markov(logits[:, None], self.first_row(len(r)), bonus)

    def markov(self, logits: Tensor, r: Tensor, bonus: Tensor) -> tuple[Tensor, Tensor | None]:
        if self.head_per_row:
            return self.markov_per_row(logits, r, bonus)
        self.calls += 1
        dev = logits.device
        return self.head(logits, ops.upload(r, dev), ops.upload(bonus, dev), self.head_temps[0], self.batch_seed(),
                         self.calls, **self.head_checked)

    def batch_seed(self) -> int:
        o = self.dec.opts
        return o.seed[0] if o.per_request_seeds else o.seed

    def markov_per_row(self, logits: Tensor, r: Tensor, bonus: Tensor) -> tuple[Tensor, Tensor | None]:
        """Per-request temperatures or seeds: the head once per row with that row's temperature, under the row's
        seed at the row's own call count (what the request alone would draw), or with one seed at offset
        calls + (b << 40) (a stream of its own per row)."""
        self.calls += 1
        dev, o = logits.device, self.dec.opts
        if o.per_request_seeds:
            streams = [(o.seed[b], self.calls - self.row_origin[b]) for b in range(len(self.head_temps))]
        else:
            streams = [(o.seed, self.calls + (b << ROW_STREAM_SHIFT)) for b in range(len(self.head_temps))]
        rows = [(temp, seed, offset) for temp, (seed, offset) in zip(self.head_temps, streams)]
        return markov_rows(self.head, logits, ops.upload(r, dev), ops.upload(bonus, dev), rows, o.sampling)

    def resolve_q(self, q):
        return q

    def settle(self) -> None:
        pass  # every call ran in this process, ordered by the lanes' events

    def rest(self) -> None:
        pass

    def first_row(self, batch: int) -> Tensor:
        """r = 0 for every request: the row of a boundary that holds one outcome (a block, a projected branch)."""
        if self._zeros is None or len(self._zeros) != batch:
            self._zeros = torch.zeros(batch, dtype=torch.long)
        return self._zeros


def _takes(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a native callable without a signature
        return False


__all__ = ["DeviceBackend", "LocalContext", "ROW_STREAM_SHIFT", "branch_selected", "grown_context", "markov_rows",
           "reset_context_row"]
