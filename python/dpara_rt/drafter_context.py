"""The drafter's context cache and the work done on it, in this process or in a drafter worker process.

Two lanes that are threads of one process share one interpreter: a lane's torch ops wait for the other lane's
Python between them, and the target's verify slows by a fifth or more while the backbone runs beside it. A
worker process gives the drafter its own interpreter; what remains is the hardware's contention (shared cache
and memory bandwidth).

``LocalContext`` runs the drafter in the calling thread (every method, any device). ``WorkerContext`` sends
the same calls to a ``DrafterWorker``: a spawned process holding the drafter (its weights, and the target's
embedding and output head, shared with this process, not copied) and the context cache. The boundary ring and
the features staging are the core's shared memory (memfds), mapped by both processes, so boundary logits and
features never cross the pipe; a call carries only token ids and row counts. A round's absorb and backbone go
out as one message (``absorb_and_fill``) that the caller does not wait for; the next Markov head ``settle``s it.
The ring's slot states and the lanes' events stay in this process, and so does the Markov head, which reads
branch r straight from the shared slot.
"""
from __future__ import annotations

import contextlib
import math
import mmap
import multiprocessing
import os
import pickle
import sys
import threading
import traceback
from multiprocessing import reduction

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's shared-memory pickling of tensors for the pipe

from dpara_rt import _core
from dpara_rt._core import now_ns  # the lanes' timeline clock (steady), the same in every process
from dpara_rt.core import branch_rows
from dpara_rt.native import gumbel_noise

WORKER_MODES = ("auto", "thread", "process")
# Each direction's mailbox (dpara_rt._core.Mailbox): a call carries token lists, a reply a few numbers or an error.
_MAILBOX_BYTES = 1 << 20
_LIVENESS_S = 0.1  # a wait for a reply checks that the worker still lives this often
_PUSH_TIMEOUT_S = 30.0  # a worker that reads no call for this long is stuck
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
        dpara_rt.noise_ahead). Here the drafter runs in this process: plain memory."""
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
        after the backbone (dpara_rt.noise_ahead)."""
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
        buffer after what it has queued (dpara_rt.branch_guess); ``wait_guess`` waits for it."""
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


class DrafterWorker:
    """A spawned process that runs the drafter's calls (``WorkerContext``), pinned to the drafter lane's cores.

    Calls and replies cross through two mailboxes in shared memory (``_core.Mailbox``), pickled; the pipe carries
    only file descriptors (shared buffers to map) and tells each side when the other is gone. ``spin_s``: how long
    each side spins for the other's message before sleeping, for a worker on cores of its own (0 where it shares
    the caller's: spinning there would take the core from the side it waits for).

    An error in the worker is raised here, in the caller, with the worker's traceback as a note; the worker
    keeps serving. If the process dies, the call raises RuntimeError naming its exit code and ``alive`` turns
    False (the engine starts a new worker for its next decode)."""

    def __init__(self, drafter, cores, threads: int, spin_s: float = 0.0):
        if drafter.device.type != "cpu":
            raise ValueError(f"a drafter worker process runs on the host; the drafter is on {drafter.device}")
        ctx = multiprocessing.get_context("spawn")  # fork would copy the lanes' threads' locks mid-use
        self._conn, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(theirs, drafter, list(cores) if cores else None, threads),
                                 name="dpara_rt-drafter", daemon=True)
        with _without_main_script():
            self._proc.start()
        theirs.close()
        self._spin_s = spin_s
        self._calls, self._replies = self._mailboxes(spin_s)
        self._lock = threading.Lock()
        self._pending: list[str] = []  # ops posted and not yet answered, in order
        self._broken: str | None = None
        self.splits: dict[tuple[int, int], BranchSplit] = {}  # WorkerContext.branch_split's, per (vocab, batch)
        self.scratch: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}  # WorkerContext._scratch's byte buffers
        self.shared: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}  # WorkerContext.shared_buffer's, kept mapped
        self.mapped: tuple | None = None  # the (staging, ring) the worker maps, kept alive here
        self.vocab = drafter.config.vocab_size
        self.call("ping")

    def _mailboxes(self, spin_s: float) -> tuple:
        """The calls and replies mailboxes, laid out here in new memfds that the worker maps from its first message."""
        boxes, fds = [], []
        for name in ("calls", "replies"):
            fd = os.memfd_create(f"dpara_rt-{name}", os.MFD_CLOEXEC)
            os.ftruncate(fd, _core.Mailbox.bytes_for(_MAILBOX_BYTES))
            mapping = mmap.mmap(fd, _core.Mailbox.bytes_for(_MAILBOX_BYTES))
            view = torch.frombuffer(mapping, dtype=torch.uint8)  # its address; it keeps the mapping alive
            boxes.append((_core.Mailbox(view.data_ptr(), _MAILBOX_BYTES, True), view, mapping))
            fds.append(fd)
        try:
            self._conn.send(("attach", (_MAILBOX_BYTES, spin_s)))
            for fd in fds:
                reduction.send_handle(self._conn, fd, self._proc.pid)
        finally:
            for fd in fds:
                os.close(fd)
        return boxes[0], boxes[1]

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def pending(self) -> tuple[str, ...]:
        """The ops posted and not yet answered, in order."""
        return tuple(self._pending)

    @property
    def alive(self) -> bool:
        return self._broken is None and self._proc.is_alive()

    def post(self, op: str, *args, fds=()) -> None:
        """Start `op` in the worker without waiting; `fds` are file descriptors passed along (SCM_RIGHTS)."""
        with self._lock:
            if self._broken is not None:  # a worker that dies meanwhile shows at the next wait for a reply
                self._check_alive(op)
            # plain pickle: calls carry only numbers and lists (tensors cross in shared memory)
            if not self._calls[0].push(pickle.dumps((op, args), protocol=pickle.HIGHEST_PROTOCOL), _PUSH_TIMEOUT_S):
                raise self._died(op)
            try:
                for fd in fds:  # read by the call, in the worker, from the pipe
                    reduction.send_handle(self._conn, fd, self._proc.pid)
            except OSError as e:
                raise self._died(op) from e
            self._pending.append(op)

    def collect(self, errors: bool = True, count: int | None = None) -> list[tuple[str, object, tuple[int, int]]]:
        """Wait for every posted call (or the first `count`): (op, result, (start_ns, end_ns)) each, in order.
        The first error is raised once all of them have answered (`errors=False` drops errors)."""
        done, error = [], None
        with self._lock:
            seen = 0
            while self._pending and (count is None or seen < count):
                seen += 1
                op = self._pending.pop(0)
                while (raw := self._replies[0].pop(self._spin_s, _LIVENESS_S)) is None:
                    if not self._proc.is_alive():
                        self._pending.clear()
                        raise self._died(op)
                status, value, where = pickle.loads(raw)
                if status == "error":
                    if error is None:
                        if hasattr(value, "add_note"):
                            value.add_note(f"raised in the drafter worker process (pid {self._proc.pid}) during "
                                           f"{op!r}:\n{where}")
                        error = value
                else:
                    done.append((op, value, where))
        if error is not None and errors:
            raise error
        return done

    def call(self, op: str, *args, fds=()):
        """Run `op` in the worker (after any posted calls) and return its result."""
        self.post(op, *args, fds=fds)
        return self.collect()[-1][1]

    def discard(self) -> None:
        """Drop the answers of posted calls nobody waits for any more (a cancelled decode's)."""
        self.collect(errors=False)

    def _check_alive(self, op: str) -> None:
        if not self.alive:
            raise RuntimeError(f"the drafter worker process (pid {self._proc.pid}) is gone "
                               f"({self._broken or f'exit code {self._proc.exitcode}'}) before {op!r}; expected a "
                               "live worker")

    def _died(self, op: str) -> RuntimeError:
        self._proc.join(1.0)
        self._broken = f"exit code {self._proc.exitcode}"
        return RuntimeError(f"the drafter worker process (pid {self._proc.pid}) died during {op!r} ({self._broken})")

    def close(self) -> None:
        """Stop the worker (idempotent)."""
        with self._lock:
            if self._proc.is_alive():
                self._calls[0].push(pickle.dumps(("exit", ())), 1.0)
                self._proc.join(5.0)
                if self._proc.is_alive():
                    self._proc.kill()
                    self._proc.join()
            self._broken = self._broken or "closed"
            self._conn.close()


@contextlib.contextmanager
def _without_main_script():
    # spawn re-runs the caller's main script in the child unless it is hidden; the worker needs nothing from it,
    # and an unguarded script would start an engine (and a worker) of its own there.
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    if main is not None:
        main.__dict__.pop("__file__", None)
        main.__spec__ = None
    try:
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


class _Worker:
    """The worker process's side: the drafter, its context cache and the mapped shared buffers."""

    def __init__(self, drafter):
        self.drafter, self.cache = drafter, None
        self._maps: list[mmap.mmap] = []
        self._features: dict[int, torch.Tensor] = {}
        self._slots: list[torch.Tensor] = []
        self._shared: dict[str, torch.Tensor] = {}  # float32 buffers shared with the caller: "noise", "q"
        self._shared_maps: dict[str, mmap.mmap] = {}
        self._head = None  # the drafter's packed output head, for project_branch
        self._scratch: dict[str, torch.Tensor] = {}  # byte buffers the caller grows: "prompt", "block"
        self._scratch_maps: dict[str, mmap.mmap] = {}

    def ping(self):
        return os.getpid()

    def rest(self) -> None:
        """The decode is over: nothing to do but stop spinning (_SLEEP_AFTER)."""

    def new_cache(self, batch: int, max_len: int) -> None:
        self.cache = self.drafter.new_context_cache(batch, max_len)

    def map_buffers(self, staging_bytes: int, feature_offsets: dict, ring_bytes: int, ring_shape: tuple,
                    ring_dtype: str, conn) -> None:
        staging_fd, ring_fd = reduction.recv_handle(conn), reduction.recv_handle(conn)
        staging, ring = _map(staging_fd, staging_bytes), _map(ring_fd, ring_bytes)
        self._maps = [staging, ring]  # the tensors below alias these mappings
        raw = torch.frombuffer(staging, dtype=torch.uint8)
        self._features = {phase: raw[off:] for phase, off in feature_offsets.items()}
        slots = torch.frombuffer(ring, dtype=getattr(torch, ring_dtype)).view(ring_shape)
        self._slots = list(slots)

    def absorb_prompt(self, shape: tuple, dtype: str, keep: list[int]) -> None:
        self.drafter.extend_context(self.cache, _scratch_view(self._scratch["prompt"], shape, dtype),
                                    torch.tensor(keep))

    def absorb_staged(self, phase: int, shape: tuple, dtype: str, keep: list[int]) -> None:
        self.drafter.extend_context(self.cache, _scratch_view(self._features[phase], shape, dtype),
                                    torch.tensor(keep))

    def absorb_and_fill(self, phase: int, shape: tuple, dtype: str, keep: list[int], spine: list[list[int]],
                        slot: int, project: bool, noise: tuple | None) -> int:
        """absorb_staged then boundary; returns when the boundary started (now_ns), to split the span."""
        self.absorb_staged(phase, shape, dtype, keep)
        t = now_ns()
        self.boundary(spine, slot, project, noise)
        return t

    def block_logits(self, bonus: list[int], n: int, untrained_ok: bool) -> tuple:
        # A decode's first draft and restarts only, not every round.
        logits = self.drafter.block_logits(self.cache, torch.tensor(bonus), n, untrained_ok=untrained_ok)
        shape, dtype = tuple(logits.shape), str(logits.dtype).removeprefix("torch.")
        _scratch_view(self._scratch["block"], shape, dtype).copy_(logits)
        return dtype, shape

    def boundary(self, spine: list[list[int]], slot: int, project: bool, noise: tuple | None) -> None:
        out = self._slots[slot]
        self.drafter.boundary_logits(self.cache, torch.tensor(spine), out=out, project=project, d=out.shape[2])
        if noise is not None:  # the next head's Gumbel noise, while the target still verifies
            half, seed, offset = noise
            _, batch, d, vocab = self._shared["noise"].shape
            gumbel_noise(batch, d, vocab, seed, offset, out=self._shared["noise"][half])

    def markov_q(self, source: str, index: int, r: list[int], bonus: list[int], draft: list[list[int]],
                 temperature: float, markov: bool, half: int) -> None:
        # The same head (the drafter's fp32 factors) as the caller's: q bit for bit as its sampling call made it
        head = self.drafter.markov_head(markov)
        boundary = self._slots[index] if source == "ring" else self._shared["branch"][index][:, None]
        head.q(boundary, torch.tensor(r), torch.tensor(bonus), torch.tensor(draft), temperature,
               out=self._shared["q"][half])

    def project_branch(self, slot: int, r: list[int], half: int, col_begin: int) -> None:
        self._project(slot, r, self._shared["branch"][half], col_begin)

    def guess_branch(self, slot: int, r: list[int]) -> None:
        self._project(slot, r, self._shared["guess"], 0)

    def _project(self, slot: int, r: list[int], out: torch.Tensor, col_begin: int) -> None:
        """Branch r[b]'s rows of ring slot `slot` (the hidden ring's [B, d+1, d, H]) through the output head, columns
        col_begin.. of out [B, d, V]."""
        rows = branch_rows(self._slots[slot], r)
        if self._head is None:
            self._head = self.drafter.packed_head()
            if self._head is None:
                raise RuntimeError("the worker's drafter has no packed host output head to project branch r with (a "
                                   "float32 host drafter with the native core expected)")
        packed, dtype = self._head
        _core.host_linear(rows.data_ptr(), rows.numel() // rows.shape[-1], rows.shape[-1], packed.data_ptr(), dtype,
                          out.shape[-1], out.data_ptr(), col_begin)

    def map_shared(self, name: str, shape: tuple, conn) -> None:
        self._shared_maps[name] = _map(reduction.recv_handle(conn), 4 * math.prod(shape))
        self._shared[name] = torch.frombuffer(self._shared_maps[name], dtype=torch.float32).view(shape)

    def reset_row(self, b: int, shape: tuple, dtype: str) -> None:
        _reset_row(self.drafter, self.cache, b, _scratch_view(self._scratch["prompt"], shape, dtype))

    def map_scratch(self, name: str, size: int, conn) -> None:
        mapping = _map(reduction.recv_handle(conn), size)
        self._scratch[name] = torch.frombuffer(mapping, dtype=torch.uint8)
        self._scratch_maps[name] = mapping  # the tensor aliases it

    def grow(self, batch: int) -> None:
        self.cache = _grown(self.drafter, self.cache, batch)


def _token_lists(ids: torch.Tensor | list[list[int]]) -> list[list[int]]:
    """Token ids [B, k] as the lists a call carries (Draft.spine_ids already gives them so)."""
    return ids if isinstance(ids, list) else ids.tolist()


def _scratch_view(raw: torch.Tensor, shape: tuple, dtype: str) -> torch.Tensor:
    """The first bytes of the byte tensor `raw` as a tensor of `shape` and `dtype` (a torch dtype's name)."""
    dt = getattr(torch, dtype.removeprefix("torch."))
    return raw[:math.prod(shape) * dt.itemsize].view(dt).view(shape)


def _map(fd: int, nbytes: int) -> mmap.mmap:
    try:
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)  # the mapping keeps the memory


def _attach(conn) -> tuple:
    """The worker's side of DrafterWorker._mailboxes: (calls, replies, spin_s, what keeps their memory mapped)."""
    op, (capacity, spin_s) = conn.recv()
    if op != "attach":
        raise RuntimeError(f"the drafter worker's first message is {op!r}; expected 'attach'")
    boxes, keep = [], []
    for _ in range(2):
        mapping = _map(reduction.recv_handle(conn), _core.Mailbox.bytes_for(capacity))
        view = torch.frombuffer(mapping, dtype=torch.uint8)
        boxes.append(_core.Mailbox(view.data_ptr(), capacity, False))
        keep.append((view, mapping))
    return boxes[0], boxes[1], spin_s, keep


def _answer(replies, worker: _Worker, conn, op: str, args: tuple, parent: int) -> None:
    """Run one call and push its reply: ("ok", value, (start_ns, end_ns)) or ("error", exception, traceback)."""
    try:
        fn = getattr(worker, op)
        t0 = now_ns()
        value = fn(*args, conn) if op in ("map_buffers", "map_shared", "map_scratch") else fn(*args)
        reply = ("ok", value, (t0, now_ns()))
    except Exception as e:  # noqa: BLE001 - the caller raises it
        reply = ("error", e, traceback.format_exc())
    try:
        raw = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - an exception that does not pickle goes as its text
        raw = pickle.dumps(("error", RuntimeError(f"{type(reply[1]).__name__}: {reply[1]}"), reply[2] or repr(e)))
    while not replies.push(raw, 1.0):
        if os.getppid() != parent:  # the caller is gone: nobody will read it
            return


# Calls after which the next comes milliseconds later or never (a decode's prefill runs in between, whose second
# thread takes this core; `rest` ends a decode): the worker sleeps at once rather than spin.
_SLEEP_AFTER = frozenset({"new_cache", "ping", "map_buffers", "rest"})


def _serve(conn, drafter, cores, threads: int) -> None:
    """The worker process's loop: one call at a time from the calls mailbox, each answered in the replies one."""
    if cores is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(threads)
    worker = _Worker(drafter)
    parent = os.getppid()
    try:
        calls, replies, spin_s, _keep = _attach(conn)
    except (EOFError, OSError):
        os._exit(0)
    spin = 0.0
    with torch.inference_mode():
        while True:
            raw = calls.pop(spin, 1.0)
            if raw is None:
                if os.getppid() != parent:  # the caller died without an exit call
                    break
                continue
            op, args = pickle.loads(raw)
            if op == "exit":
                break
            _answer(replies, worker, conn, op, args, parent)
            spin = 0.0 if op in _SLEEP_AFTER else spin_s
    conn.close()
    os._exit(0)  # skip atexit handlers inherited through imports (the core's lane drain has no lanes here)


__all__ = ["BranchSplit", "DrafterWorker", "LocalContext", "WORKER_MODES", "WorkerContext"]
