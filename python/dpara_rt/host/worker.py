"""The drafter worker process (``DrafterWorker``) and its side of the calls (``_Worker``, ``_serve``).

``dpara_rt.host.context.WorkerContext`` makes a decode's drafter calls to it: the same calls as
``LocalContext``, run in a spawned process with its own interpreter, pinned to the drafter lane's cores. Calls and
replies cross through two mailboxes in the core's shared memory; the pipe carries file descriptors (buffers to
map) and tells each side when the other is gone.
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
from dpara_rt.drafting.device import grown_context, reset_context_row
from dpara_rt.host.linear import project_columns
from dpara_rt.host.native import gumbel_noise
from dpara_rt.host.sharing import for_worker

# Each direction's mailbox (dpara_rt._core.Mailbox): a call carries token lists, a reply a few numbers or an error.
_MAILBOX_BYTES = 1 << 20
_LIVENESS_S = 0.1  # a wait for a reply checks that the worker still lives this often
_PUSH_TIMEOUT_S = 30.0  # a worker that reads no call for this long is stuck


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
        # for_worker: pickling moves no storage that a decode in this process reads through a raw pointer
        self._proc = ctx.Process(target=_serve, args=(theirs, for_worker(drafter), list(cores) if cores else None,
                                                      threads),
                                 name="dpara_rt-drafter", daemon=True)
        with _without_main_script():
            self._proc.start()
        theirs.close()
        self._spin_s = spin_s
        self._calls, self._replies = self._mailboxes(spin_s)
        self._lock = threading.Lock()
        self._pending: list[str] = []  # ops posted and not yet answered, in order
        self._broken: str | None = None
        self.splits: dict = {}  # (vocab, batch) -> host.branch_split.BranchSplit  # WorkerContext.branch_split's, per (vocab, batch)
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
        self.drafter.extend_context(self.cache, scratch_view(self._scratch["prompt"], shape, dtype),
                                    torch.tensor(keep))

    def absorb_staged(self, phase: int, shape: tuple, dtype: str, keep: list[int]) -> None:
        self.drafter.extend_context(self.cache, scratch_view(self._features[phase], shape, dtype),
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
        scratch_view(self._scratch["block"], shape, dtype).copy_(logits)
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
        project_columns(rows, self._head, out, col_begin)

    def map_shared(self, name: str, shape: tuple, conn) -> None:
        self._shared_maps[name] = _map(reduction.recv_handle(conn), 4 * math.prod(shape))
        self._shared[name] = torch.frombuffer(self._shared_maps[name], dtype=torch.float32).view(shape)

    def reset_row(self, b: int, shape: tuple, dtype: str) -> None:
        reset_context_row(self.drafter, self.cache, b, scratch_view(self._scratch["prompt"], shape, dtype))

    def map_scratch(self, name: str, size: int, conn) -> None:
        mapping = _map(reduction.recv_handle(conn), size)
        self._scratch[name] = torch.frombuffer(mapping, dtype=torch.uint8)
        self._scratch_maps[name] = mapping  # the tensor aliases it

    def grow(self, batch: int) -> None:
        self.cache = grown_context(self.drafter, self.cache, batch)


def scratch_view(raw: torch.Tensor, shape: tuple, dtype: str) -> torch.Tensor:
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


__all__ = ["DrafterWorker"]
