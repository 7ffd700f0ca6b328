"""The drafter's context cache and the work done on it in a drafter worker process (``WorkerContext``).

Two lanes that are threads of one process share one interpreter: a lane's torch ops wait for the other lane's
Python between them, and the target's verify slows by a fifth or more while the backbone runs beside it. A
worker process gives the drafter its own interpreter; what remains is the hardware's contention (shared cache
and memory bandwidth).

``dpara_rt.drafting.device.LocalContext`` runs the drafter in the calling thread. ``WorkerContext`` sends the
same calls (and a few only a worker has) to a ``DrafterWorker`` (``dpara_rt.host.worker``): a spawned process holding the drafter (its
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

import torch

from dpara_rt import _core
from dpara_rt.host.branch_split import BranchSplit
from dpara_rt.host.worker import DrafterWorker, scratch_view


WORKER_MODES = ("auto", "thread", "process")
# worker call -> timeline phase
_PHASES = {"absorb_prompt": "context", "absorb_staged": "context", "boundary": "backbone"}


class WorkerContext:
    """The same calls as LocalContext, made in a DrafterWorker, from one lane at a time. ``absorb``, ``boundary``
    and ``absorb_and_fill`` return at once: the caller neither waits nor holds the interpreter while the worker
    runs them, and ``settle`` waits for them, raising the first error; every other call waits for its result."""

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
        return scratch_view(self.worker.scratch["block"][1], shape, dtype).clone()

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
        scratch_view(raw, shape, dtype).copy_(features)
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


def _token_lists(ids: torch.Tensor | list[list[int]]) -> list[list[int]]:
    """Token ids [B, k] as the lists a call carries (Draft.spine_ids already gives them so)."""
    return ids if isinstance(ids, list) else ids.tolist()


__all__ = ["WORKER_MODES", "WorkerContext"]
