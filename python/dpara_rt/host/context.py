"""The drafter's context cache and the work done on it, in this process or in a drafter worker process.

Two lanes that are threads of one process share one interpreter: a lane's torch ops wait for the other lane's
Python between them, and the target's verify slows by a fifth or more while the backbone runs beside it. A
worker process gives the drafter its own interpreter; what remains is the hardware's contention (shared cache
and memory bandwidth).

``LocalContext`` runs the drafter in the calling thread (every method, any device). ``WorkerContext`` sends
the same calls to a ``DrafterWorker`` (``dpara_rt.host.worker``): a spawned process holding the drafter (its
weights, and the target's embedding and output head, shared with this process, not copied) and the context cache. The boundary ring and
the features staging are the core's shared memory (memfds), mapped by both processes, so boundary logits and
features never cross the pipe; a call carries only token ids and row counts. A round's absorb and backbone go
out as one message (``absorb_and_fill``) that the caller does not wait for; the next Markov head ``settle``s it.
The ring's slot states and the lanes' events stay in this process, and so does the Markov head, which reads
branch r straight from the shared slot.
"""
from __future__ import annotations

import math
import mmap
import os
from typing import TYPE_CHECKING

import torch

from dpara_rt import _core

if TYPE_CHECKING:
    from dpara_rt.host.worker import DrafterWorker

WORKER_MODES = ("auto", "thread", "process")
# worker call -> timeline phase
_PHASES = {"absorb_prompt": "context", "absorb_staged": "context", "boundary": "backbone"}


class LocalContext:
    """The drafter and its context cache in this process: every call runs now, in the calling thread."""
    remote = False

    def __init__(self, drafter, batch: int, max_len: int):
        self.drafter = drafter
        self.cache = drafter.new_context_cache(batch, max_len)

    def map_buffers(self, staging, ring) -> None:
        """Nothing to map: the caller hands tensors over directly."""

    def absorb(self, features: torch.Tensor, keep: torch.Tensor) -> None:
        """Append the first keep[b] rows of features [B, T, F] to row b of the context."""
        self.drafter.extend_context(self.cache, features.to(self.drafter.device, non_blocking=True), keep)

    def block_logits(self, bonus: torch.Tensor, n: int, untrained_ok: bool) -> torch.Tensor:
        return self.drafter.block_logits(self.cache, bonus, n, untrained_ok=untrained_ok)

    def boundary(self, spine: torch.Tensor, slot: int, out: torch.Tensor, project: bool) -> None:
        """Boundary logits (or the branches' hidden states) of `spine` [B, k <= d+1] into ring slot `out` (its
        branches 0..k-1)."""
        self.drafter.boundary_logits(self.cache, spine, out=out, project=project, d=out.shape[2])

    def reset_row(self, b: int, features: torch.Tensor) -> None:
        """Row b of the context: emptied, then `features` [T, F] (a request joining a serving decode)."""
        _reset_row(self.drafter, self.cache, b, features)

    def grow(self, batch: int) -> None:
        """`batch` rows from now on: the cache is copied into a larger one, the new rows empty."""
        self.cache = _grown(self.drafter, self.cache, batch)

    def settle(self) -> list[tuple[str, int, int]]:
        """Wait for the calls still running (none here); their (phase, start_ns, end_ns) spans."""
        return []

    def shared_buffer(self, name: str, shape: tuple) -> torch.Tensor:
        """A float32 buffer both sides of the context use: the Markov head's noise drawn ahead ("noise",
        dpara_rt.host.noise_ahead). Here the drafter runs in this process: plain memory."""
        return torch.empty(shape, dtype=torch.float32)


class BranchSplit:
    """Where the Markov head's columns of branch r's projection end and the worker's begin (a panel edge), for one
    batch size of one worker. Each shared projection reports both sides' spans on the lanes' clock, and the split
    moves toward the column where the head finishes just as the worker's reply arrives: the two sides start at
    different times (the worker when verification posts its share, the head after settling the backbone) and run
    at different speeds (the head right after a verify that streamed the target's weights, the worker on its own
    cache), which a fixed share gets right on one host only (3/8 for the head on an AVX2 host, about half on an
    AVX-512 one). The reply's delivery (the worker's send, this process waking from its wait) is part of the
    worker's side. Where the split falls does not change the logits: every column gets the same FMA chain
    whichever side computes it."""
    SMOOTHING = 0.25  # of each projection's estimate: one round's spans are noisy

    def __init__(self, vocab: int, batch: int, panel: int):
        if not vocab > panel:
            raise ValueError(f"BranchSplit: vocab {vocab} must exceed one panel ({panel} columns) to be shared")
        self.vocab, self.panel = vocab, panel
        # before any span: (4B - 1) / 8B of the columns for the head (3/8 at batch 1, about half at batch 16)
        self._estimate = vocab * (4 * batch - 1) / (8 * batch)
        self.columns = self._edge(self._estimate)
        self.delivery_ns = 0.0  # from the worker's end to the head holding its reply, when the head waited

    def _edge(self, cols: float) -> int:
        """cols on a panel edge, leaving each side at least one panel."""
        return min(max(self.panel, int(round(cols / self.panel)) * self.panel), self.vocab - self.panel)

    def observe(self, head: tuple[int, int], worker: tuple[int, int], received_ns: int, columns: int) -> None:
        """The spans (start_ns, end_ns) of the head's projection of columns [0, columns) and the worker's of the
        rest, and when the head held the worker's reply. At its rate each side would be done with split c at
        h0 + c hc and w0 + (V - c) wc + delivery; equal at c = (w0 - h0 + delivery + V wc) / (hc + wc)."""
        (h0, h1), (w0, w1) = head, worker
        s = self.SMOOTHING
        if w1 > h1:  # the head was waiting when the worker finished: the reply's delivery shows
            self.delivery_ns += s * (max(received_ns - w1, 0) - self.delivery_ns)
        hc = max(h1 - h0, 1) / columns  # ns per column
        wc = max(w1 - w0, 1) / (self.vocab - columns)
        balanced = (w0 - h0 + self.delivery_ns + self.vocab * wc) / (hc + wc)
        self._estimate += s * (min(max(balanced, 0.0), float(self.vocab)) - self._estimate)
        self.columns = self._edge(self._estimate)


class WorkerContext:
    """The same calls as LocalContext, made in a DrafterWorker, from one lane at a time. ``absorb``, ``boundary``
    and ``absorb_and_fill`` return at once: the caller neither waits nor holds the interpreter while the worker
    runs them, and ``settle`` waits for them, raising the first error; every other call waits for its result."""
    remote = True

    def __init__(self, worker: "DrafterWorker", batch: int, max_len: int):
        self.worker = worker
        worker.discard()  # replies a cancelled decode left behind
        worker.post("new_cache", batch, max_len)  # an error in it is raised by the next reply collected
        self._staged_features: dict[int, int] = {}  # the features staging's address per phase -> phase
        self._early: list = []  # replies wait_q collected on its way to the q (an absorb sent ahead), to settle

    def map_buffers(self, staging, ring) -> None:
        """Map the core's shared staging and ring into the worker (they are rebuilt when a decode grows)."""
        for what in (staging, ring):
            if what.shared_fd < 0:
                raise ValueError(f"{type(what).__name__} is not in shared memory (shared_fd = -1); a drafter worker "
                                 "needs staging and ring built with shared=True")
        self._staged_features = {staging.data_ptr("features", p): p for p in (0, 1)}
        if self.worker.mapped == (staging, ring):  # the last decode's, which the worker still maps
            return
        self.worker.call("map_buffers", staging.nbytes, {p: staging.offset("features", p) for p in (0, 1)},
                         ring.nbytes, (ring.capacity, ring.batch, ring.d + 1, ring.d, ring.vocab), ring.dtype,
                         fds=(staging.shared_fd, ring.shared_fd))
        self.worker.mapped = (staging, ring)

    def _staged_phase(self, features: torch.Tensor) -> int | None:
        """The features staging phase `features` is (a round's features, staged by the target lane), or None."""
        return self._staged_features.get(features.data_ptr()) if features.is_contiguous() else None

    def absorb(self, features: torch.Tensor, keep: torch.Tensor) -> None:
        keep = torch.as_tensor(keep).tolist()
        phase = self._staged_phase(features)
        if phase is not None:  # a round's features: the worker reads them where the target lane staged them
            self.worker.post("absorb_staged", phase, tuple(features.shape), str(features.dtype), keep)
        else:  # a prefill's or a restart's features: once per decode or join
            self.worker.post("absorb_prompt", *self._to_scratch(features), keep)

    def block_logits(self, bonus: torch.Tensor, n: int, untrained_ok: bool) -> torch.Tensor:
        """A decode's first draft (and a restart's): the worker writes the logits into the "block" scratch."""
        self._scratch("block", len(bonus) * n * self.worker.vocab * 4)  # float32 at most
        dtype, shape = self.worker.call("block_logits", bonus.tolist(), n, untrained_ok)
        return _scratch_view(self.worker.scratch["block"][1], shape, dtype).clone()

    def _scratch(self, name: str, nbytes: int) -> torch.Tensor:
        """The worker's byte buffer `name` shared with this process (kept across decodes), grown to hold nbytes:
        a prefill's features ("prompt") and a first draft's logits ("block") cross through it, not the pipe,
        whose pickled bytes cost a decode's first round half a millisecond or more."""
        have = self.worker.scratch.get(name)
        if have is None or have[1].numel() < nbytes:
            size = max(1 << 20, 1 << max(nbytes - 1, 0).bit_length())
            mapping = self._post_mapping(name, size, "map_scratch", name, size)
            self._wait_for("map_scratch", f"the {name!r} scratch mapped")  # replies before it stay for settle
            self.worker.scratch[name] = (mapping, torch.frombuffer(mapping, dtype=torch.uint8))
        return self.worker.scratch[name][1]

    def _post_mapping(self, name: str, nbytes: int, op: str, *args) -> mmap.mmap:
        """A new memfd of nbytes, mapped here and posted to the worker with `op`(*args) to map there."""
        fd = os.memfd_create(f"dpara_rt-{name}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            mapping = mmap.mmap(fd, nbytes)
            self.worker.post(op, *args, fds=(fd,))
        finally:
            os.close(fd)
        return mapping

    def _to_scratch(self, features: torch.Tensor) -> tuple[tuple, str]:
        """features copied into the "prompt" scratch, once the worker has absorbed what it held; (shape, dtype)."""
        if "absorb_prompt" in self.worker.pending or "reset_row" in self.worker.pending:
            self._early += self._collect_through(("absorb_prompt", "reset_row"))
        features = features.detach().to("cpu")
        raw = self._scratch("prompt", features.numel() * features.element_size())
        shape, dtype = tuple(features.shape), str(features.dtype).removeprefix("torch.")
        _scratch_view(raw, shape, dtype).copy_(features)
        return shape, dtype

    def boundary(self, spine: torch.Tensor | list[list[int]], slot: int, out: torch.Tensor | None, project: bool,
                 noise: tuple | None = None) -> None:
        self.worker.post("boundary", _token_lists(spine), slot, project, noise)

    def absorb_and_fill(self, features: torch.Tensor, keep: torch.Tensor | None,
                        spine: torch.Tensor | list[list[int]], slot: int, project: bool,
                        noise: tuple | None = None) -> None:
        """absorb (unless keep is None) then boundary, as one message: a round's whole drafting beside its
        verification costs one send here and one reply to settle. `spine`: [B, k] token ids, or their lists
        (Draft.spine_ids: what the message carries). `noise`: (half, seed, offset) of the next head's noise, drawn
        after the backbone (dpara_rt.host.noise_ahead)."""
        spine = _token_lists(spine)
        if keep is None:
            return self.boundary(spine, slot, None, project, noise)
        phase = self._staged_phase(features)
        if phase is None:
            self.absorb(features, keep)
            return self.boundary(spine, slot, None, project, noise)
        self.worker.post("absorb_and_fill", phase, tuple(features.shape), str(features.dtype),
                         torch.as_tensor(keep).tolist(), spine, slot, project, noise)

    def shared_buffer(self, name: str, shape: tuple) -> torch.Tensor:
        """A float32 buffer in shared memory (a memfd mapped here and in the worker): the head's noise drawn
        ahead ("noise"), the q the worker computes for a draft ("q"), the hidden ring's projected branch
        ("branch")."""
        kept = self.worker.shared.get(name)
        if kept is not None and tuple(kept[1].shape) == tuple(shape):  # an earlier decode's, still mapped there
            return kept[1]
        mapping = self._post_mapping(name, 4 * math.prod(shape), "map_shared", name, tuple(shape))
        self.worker.collect()  # as a call: every reply before it too
        self.worker.shared[name] = (mapping, torch.frombuffer(mapping, dtype=torch.float32).view(shape))
        return self.worker.shared[name][1]

    def markov_q(self, source: tuple[str, int], r: torch.Tensor, bonus: torch.Tensor, draft: torch.Tensor,
                 temperature: float, markov: bool, half: int) -> None:
        """Have the worker compute the q of a draft the head made without it (HostMarkovHead.q, from ring slot i
        for ``("ring", i)``, from half i of the shared "branch" buffer for ``("branch", i)``) into half `half` of
        the shared "q" buffer, before its next call; ``wait_q`` waits for it."""
        self.worker.post("markov_q", *source, r.tolist(), bonus.tolist(), draft.tolist(), temperature, markov, half)

    def project_branch(self, slot: int, r: torch.Tensor, half: int, col_begin: int) -> None:
        """Have the worker project output columns [col_begin, V) of branch r[b]'s rows of ring slot `slot` (the
        hidden ring) into half `half` of the shared "branch" buffer, while the head projects the columns before
        them; ``wait_branch`` waits for it."""
        self.worker.post("project_branch", slot, r.tolist(), half, col_begin)

    def guess_branch(self, slot: int, r: list[int]) -> None:
        """Have the worker project branch r[b]'s rows of ring slot `slot` (all columns) into the shared "guess"
        buffer after what it has queued (dpara_rt.host.branch_guess); ``wait_guess`` waits for it."""
        self.worker.post("guess_branch", slot, r)

    def wait_guess(self) -> None:
        if "guess_branch" in self.worker.pending:  # else already collected on the way to another reply: done
            self._wait_for("guess_branch", "its guessed branch's projection")

    def _collect_through(self, ops: tuple[str, ...]) -> list:
        """The worker's replies in order, up to and including the first of `ops` (all pending ones if none is)."""
        done = []
        while not done or done[-1][0] not in ops:
            got = self.worker.collect(count=1)
            if not got:
                break
            done += got
        return done

    def _wait_for(self, op: str, what: str) -> tuple:
        """Wait for the `op` posted last; its reply (op, value, span). Replies before it (an absorb sent ahead) are
        kept for settle."""
        done = self._collect_through((op,))
        if not done or done[-1][0] != op:
            raise RuntimeError(f"the drafter worker answered {[o for o, _, _ in done]} where {what} was expected")
        self._early += done[:-1]
        return done[-1]

    def wait_q(self) -> None:
        self._wait_for("markov_q", "the draft's q")

    def wait_branch(self) -> tuple[int, int]:
        """Wait for the worker's share of branch r; its (start_ns, end_ns)."""
        return self._wait_for("project_branch", "its share of branch r's projection")[2]

    def branch_split(self, vocab: int, batch: int) -> BranchSplit:
        """The head's and the worker's shares of branch r at this batch size, learned across this worker's decodes."""
        key = (vocab, batch)
        if key not in self.worker.splits:
            self.worker.splits[key] = BranchSplit(vocab, batch, _core.HOST_LINEAR_PANEL)
        return self.worker.splits[key]

    def reset_row(self, b: int, features: torch.Tensor) -> None:
        self.worker.call("reset_row", b, *self._to_scratch(features))

    def grow(self, batch: int) -> None:
        self.worker.call("grow", batch)

    def rest(self) -> None:
        """The decode is over: the worker sleeps after its last call instead of spinning for the next (which would
        slow the next prefill's second thread on its core). The reply is dropped by the next decode."""
        self.worker.post("rest")

    def settle(self) -> list[tuple[str, int, int]]:
        """Wait for the replies through the round's boundary (an absorb sent ahead for the next round stays in
        flight); the timeline spans of those and of any collected early."""
        done, self._early = self._early + self._collect_through(("boundary", "absorb_and_fill")), []
        spans = []
        for op, value, (t0, t1) in done:
            if op == "absorb_and_fill":  # the boundary's start: the reply's value
                spans += [("context", t0, value), ("backbone", value, t1)]
            else:
                spans.append((_PHASES.get(op, op), t0, t1))
        return spans


def _reset_row(drafter, cache, b: int, features: torch.Tensor) -> None:
    lengths = cache.lengths.clone()
    lengths[b] = 0
    drafter.crop(cache, lengths)
    rows = torch.zeros(cache.batch, features.shape[0], features.shape[1], dtype=features.dtype, device=features.device)
    rows[b] = features
    n = torch.zeros(cache.batch, dtype=torch.long)
    n[b] = features.shape[0]
    drafter.extend_context(cache, rows.to(drafter.device), n)


def _grown(drafter, cache, batch: int):
    new = drafter.new_context_cache(batch, cache.max_len)
    B = cache.batch
    new.k[:, :B], new.v[:, :B] = cache.k, cache.v
    new.lengths[:B] = cache.lengths
    return new


def _token_lists(ids: torch.Tensor | list[list[int]]) -> list[list[int]]:
    """Token ids [B, k] as the lists a call carries (Draft.spine_ids already gives them so)."""
    return ids if isinstance(ids, list) else ids.tolist()


def _scratch_view(raw: torch.Tensor, shape: tuple, dtype: str) -> torch.Tensor:
    """The first bytes of the byte tensor `raw` as a tensor of `shape` and `dtype` (a torch dtype's name)."""
    dt = getattr(torch, dtype.removeprefix("torch."))
    return raw[:math.prod(shape) * dt.itemsize].view(dt).view(shape)


__all__ = ["BranchSplit", "LocalContext", "WORKER_MODES", "WorkerContext"]
