"""Request scheduling for serving: requests arrive and leave at any time; one worker thread runs the engine.

    sched = Scheduler(engine)
    h = sched.submit([1, 2, 3], max_new_tokens=32, temperature=0.0)
    for chunk in h:            # lists of new token ids, as rounds commit them
        ...
    h.finish_reason            # "stop" (an EOS / stop id), "length", "cancelled" or "error"
    sched.close()

Requests join the running batch between rounds and leave it when they finish or are cancelled (their slot
is free at the next round); see ``Engine.serve`` for how a decode admits them.
"""
from __future__ import annotations

import collections
import itertools
import logging
import queue
import secrets
import threading
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from dpara_rt.serving.batching import Slots
from dpara_rt.round.decoder import is_int

_END = object()
_log = logging.getLogger("dpara_rt.serving.scheduler")


class QueueFull(RuntimeError):
    """The scheduler's queue holds max_queue requests already."""


@dataclass
class Request:
    """One request in token ids, with its own sampling parameters and stop conditions."""
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    id: int = -1
    handle: "RequestHandle | None" = field(default=None, repr=False)
    stops: frozenset = frozenset()  # the engine's EOS ids and this request's stop ids
    cache_need: int = 0             # KV cache slots a row needs for this request


class RequestHandle:
    """The caller's side of a request: iterate it for new-token chunks; cancel() frees its slot."""

    def __init__(self, request: Request):
        self.request = request
        self.id = request.id
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.completion_tokens = 0
        self._chunks: queue.Queue = queue.Queue()
        self._cancelled = threading.Event()

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop this request: it leaves the batch at the next round (a no-op once it finished)."""
        self._cancelled.set()

    def next(self, timeout: float | None = None) -> list[int] | None:
        """The next chunk of new token ids, or None once the request ended; raises the request's error.
        queue.Empty after `timeout` seconds without news."""
        item = self._chunks.get(timeout=timeout)
        if item is _END:
            self._chunks.put(_END)  # later calls see the end too
            if self.error is not None:
                raise self.error
            return None
        return item

    def __iter__(self) -> Iterator[list[int]]:
        while (chunk := self.next()) is not None:
            yield chunk

    # the worker's side
    def _push(self, tokens: list[int]) -> None:
        if tokens:
            self.completion_tokens += len(tokens)
            self._chunks.put(list(tokens))

    def _end(self, reason: str, error: BaseException | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.error = reason, error
            self._chunks.put(_END)


class Scheduler:
    """A queue of requests in front of one Engine, drained by a worker thread that keeps the engine's batch
    full: waiting requests take free slots between rounds (``Engine.serve``)."""

    def __init__(self, engine, max_queue: int = 256):
        if not is_int(max_queue) or max_queue < 1:
            raise ValueError(f"max_queue = {max_queue!r}; expected an int >= 1")
        self.engine, self.max_queue = engine, max_queue
        self._waiting: collections.deque[Request] = collections.deque()
        self._queue_lock = threading.Lock()
        self._ids = itertools.count()
        self._closed = threading.Event()
        self._cancel_all = False
        self._wake = threading.Event()
        self.running = 0  # requests in the current decode
        self.overlap_efficiency = 0.0  # of the last decode
        self.counters = dict(requests=0, finished=0, cancelled=0, errors=0, prompt_tokens=0, completion_tokens=0)
        self.spec = dict(rounds=0, drafts=0, draft_tokens=0, accepted_tokens=0, accepted_per_position=[],
                         fallbacks=0)
        self._worker = threading.Thread(target=self._loop, name="dpara-rt-scheduler", daemon=True)
        self._worker.start()

    @property
    def max_batch(self) -> int:
        return self.engine.target.max_batch

    def submit(self, prompt: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int | None = None, stop_ids: Sequence[int] = ()) -> RequestHandle:
        """Queue a request (validated now: a bad one raises ValueError naming the value)."""
        if self._closed.is_set():
            raise RuntimeError("the scheduler is closed; it takes no new requests")
        if self.waiting() >= self.max_queue:
            raise QueueFull(f"{self.waiting()} requests are waiting, the most this scheduler queues "
                            f"(max_queue = {self.max_queue}); retry later")
        req = Request(list(prompt), max_new_tokens, temperature, top_p, top_k, seed, tuple(stop_ids), next(self._ids))
        self._check(req)
        req.handle = RequestHandle(req)
        with self._queue_lock:
            self.counters["requests"] += 1
            self._waiting.append(req)
        self._wake.set()
        return req.handle

    def waiting(self, fits=None) -> int:
        """Requests waiting (those `fits` accepts, when given)."""
        if fits is None:
            return len(self._waiting)
        with self._queue_lock:
            return sum(1 for req in self._waiting if fits(req))

    def close(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Take no new requests; finish the queued and running ones (or cancel them), then stop the worker."""
        self._cancel_all = cancel
        self._closed.set()
        self._wake.set()
        self._worker.join(timeout)

    def _check(self, req: Request) -> None:
        eng = self.engine
        [req.prompt] = eng._prompts([req.prompt])
        eng.target.check_prompts([req.prompt])
        eng.options(req.max_new_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed)
        req.cache_need = eng.check_fits([req.prompt], req.max_new_tokens)[0]
        bad = [t for t in req.stop_ids if not is_int(t) or not 0 <= t < eng.model.config.vocab_size]
        if bad:
            raise ValueError(f"stop_ids holds {bad[0]!r}; expected token ids in [0, {eng.model.config.vocab_size})")
        req.stops = frozenset(eng.defaults.eos_ids) | frozenset(req.stop_ids)
        if req.seed is None:  # a request without a seed still gets its own random stream
            req.seed = secrets.randbits(63)

    def metrics(self) -> dict:
        """Counters for /metrics: requests and tokens, plus the speculation counters of every decode so far."""
        s = self.spec
        tau = 1 + s["accepted_tokens"] / s["drafts"] if s["drafts"] else float("nan")
        return {**self.counters, "waiting": self.waiting(), "running": self.running, **s, "tau": tau,
                "overlap_efficiency": self.overlap_efficiency}

    # ------------------------------------------------------------------ worker
    def take(self, free: int, fits=lambda req: True) -> list[Request]:
        """Up to `free` waiting requests, oldest first, that `fits` accepts (the others keep their place);
        cancelled ones end here. Called by the decode between rounds."""
        out, kept = [], []
        with self._queue_lock:
            while self._waiting and len(out) < free:
                req = self._waiting.popleft()
                if self.should_cancel(req):
                    self.finished(req, "cancelled")
                elif fits(req):
                    out.append(req)
                else:
                    kept.append(req)
            self._waiting.extendleft(reversed(kept))
        return out

    def finished(self, req: Request, reason: str, error: BaseException | None = None) -> None:
        key = {"cancelled": "cancelled", "error": "errors"}.get(reason, "finished")
        self.counters[key] += 1
        self.counters["prompt_tokens"] += len(req.prompt)
        self.counters["completion_tokens"] += req.handle.completion_tokens
        req.handle._end(reason, error)

    def should_cancel(self, req: Request) -> bool:
        return req.handle.cancelled or self._cancel_all

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if not self.waiting():
                if self._closed.is_set():
                    return
                continue
            try:
                self._serve()
            except Exception:  # noqa: BLE001 - every request the decode held has its error; serve the next ones
                _log.exception("a decode failed; its requests ended with the error, the scheduler goes on")
            if self.waiting():
                self._wake.set()

    def _serve(self) -> None:
        """One continuous-batching decode: rows for the requests waiting now (rounded up to a power of two, at
        most max_batch), growing when more wait than rows are free; it ends when no request runs or waits."""
        with self._queue_lock:
            waiting = list(self._waiting)
        if not waiting:
            return
        eng = self.engine
        batch = min(self.max_batch, 1 << (len(waiting) - 1).bit_length())
        slots = Slots(self, batch, self.max_batch)
        try:
            for new in eng.serve(slots, max(r.cache_need for r in waiting)):
                slots.route(new)
                self.running = len(slots.rows)
        except Exception as e:
            slots.fail(e)
            raise
        finally:
            self.running = 0
        self._count(eng.last_stats)

    def _count(self, st) -> None:
        if st is None:
            return
        hist = st.acceptance_histogram
        s = self.spec
        s["rounds"] += st.rounds
        if hist:
            s["drafts"] += sum(hist)
            s["draft_tokens"] += sum(hist) * st.d
            s["accepted_tokens"] += sum(r * n for r, n in enumerate(hist))
            per_pos = [sum(hist[i:]) for i in range(1, len(hist))]
            acc = s["accepted_per_position"]
            s["accepted_per_position"] = [a + b for a, b in itertools.zip_longest(acc, per_pos, fillvalue=0)]
        s["fallbacks"] += round(st.fallback_rate * st.rounds)
        self.overlap_efficiency = st.overlap_efficiency


__all__ = ["QueueFull", "Request", "RequestHandle", "Scheduler"]
