"""Chains of lane jobs: how a decode runs without the caller's thread on the critical path.

A method is a chain of links: each link runs on a lane (verify on the target lane, drafting on the drafter
lane) and queues the next ones. The caller's thread only drains what the links emit. This module knows
nothing about rounds: it queues links, times them into the core's ``Metrics`` timeline, carries results
and errors to the consumer, and stops the chain when the consumer goes away.
"""
from __future__ import annotations

import contextlib
import functools
import queue
import threading
from typing import Callable, Iterator

import torch

from dpara_rt import _core
from dpara_rt.round.lanes import Lane


# Context managers entered around every link, each made by hook(phase, round) (dpara_rt.round.sync_guard attributes
# host waits and op launches to links with them); empty in a decode nobody inspects, which then pays one check a link.
LINK_HOOKS: list = []

# Whether torch's profiler records this thread (it is enabled per thread: bench/profile_round.py enables it on a
# lane's thread, which keeps it across that lane's jobs).
_profiling = torch._C._autograd._profiler_enabled


def _hooked(phase: str, rnd: int, fn: Callable[[], object]) -> object:
    with contextlib.ExitStack() as stack:
        for hook in list(LINK_HOOKS):
            stack.enter_context(hook(phase, rnd))
        return fn()


class Chain:
    def __init__(self, lanes: tuple[Lane, ...], metrics: _core.Metrics):
        self.lanes, self.metrics = lanes, metrics
        self.round = 0                         # the timeline's round label for links queued from now on
        self._results: queue.SimpleQueue = queue.SimpleQueue()  # emitted items, None at the end, or an error
        self._stopped = False
        self._deferred = threading.local()     # links queued by a running link, submitted once its span closed
        self._held: list = []                  # emitted with hold=True, not yet handed to the consumer
        # whether the consumer takes the rounds' items as they come (a stream) or all at the end (generate): waking
        # it every round costs the lanes interpreter time
        self.stream = True
        self._held_lock = threading.Lock()     # a failing link of either lane flushes them

    def timed(self, phase: str, lane: Lane, fn: Callable[[], object]) -> Callable[[], object]:
        """fn wrapped so that each run adds one (round, phase, lane) span to the timeline."""
        rnd = self.round

        def run():
            if LINK_HOOKS:
                return _hooked(phase, rnd, run_timed)
            return run_timed()

        def run_timed():
            t0 = _core.now_ns()
            try:
                if not _profiling():  # entering a record_function costs ~9 us a link with no profiler to see it
                    return fn()
                with torch.profiler.record_function(phase):  # names the link for torch.profiler's op tree
                    return fn()
            finally:
                self.metrics.add_event(rnd, phase, lane.name, t0, _core.now_ns())
        return run

    def run_now(self, lane: Lane, phase: str, fn: Callable[[], object]) -> object:
        """Run fn on a lane, wait for it, return its result (or raise its error) on the caller's thread."""
        box: dict = {}
        job = self.timed(phase, lane, fn)
        lane.submit(lambda: box.__setitem__("value", job()))
        lane.synchronize()  # re-raises the job's error
        return box["value"]

    def post(self, lane: Lane, phase: str, fn: Callable[[], None]) -> None:
        """Queue a link on a lane. An error ends the chain and reaches the consumer of drain().

        A link that a running link queues on its own lane runs on that thread right after it, without a trip
        through the lane's queue (a host lane's record() there still marks that very point): DPara's verify and
        Markov head links alternate on the target lane every round, and each trip through the queue cost the
        round tens of microseconds of interpreter time."""
        job = self.timed(phase, lane, fn)

        def guarded():
            if self._stopped:
                return
            self._deferred.links = []
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
                self._stopped = True
                self.flush()
                self._results.put(e)
            # Links this one queued go out after its span closed, so spans never include the next link's start.
            links, self._deferred.links = self._deferred.links, None
            for target_lane, link in links:
                if target_lane is lane:
                    self._deferred.next.append(link)  # run_links runs it next, on this thread
                else:
                    target_lane.submit(functools.partial(self._run_links, link))

        if getattr(self._deferred, "links", None) is not None:
            self._deferred.links.append((lane, guarded))
        else:
            lane.submit(functools.partial(self._run_links, guarded))

    def _run_links(self, first: Callable[[], None]) -> None:
        """One job of a lane: `first`, then the links it (and they) queued on the same lane, in order."""
        self._deferred.next = [first]
        try:
            while self._deferred.next:
                self._deferred.next.pop(0)()
        finally:
            self._deferred.next = []

    def emit(self, item, hold: bool = False) -> None:
        """Hand `item` to the consumer; with hold=True at the next hand_over() (or the chain's end or error). Waking
        the consumer's thread costs the waking link interpreter time: a link on the critical path holds its
        items, and the next link that spends most of its time in native ops (verification) flushes them."""
        with self._held_lock:
            if hold or not self.stream:
                self._held.append(item)
                return
        self.flush()
        self._results.put(item)

    def hand_over(self) -> None:
        """Where a link hands the held items to a streaming consumer (a verify, which spends most of its time in
        native ops); a consumer that is not streaming gets them at the chain's end or error."""
        if self.stream:
            self.flush()

    def flush(self) -> None:
        """Hand the held items to the consumer, in order."""
        with self._held_lock:
            held, self._held = self._held, []
        for item in held:
            self._results.put(item)

    def finish(self) -> None:
        self.flush()
        self._results.put(None)

    def cancel(self, error: BaseException) -> None:
        """Stop the chain from outside (its consumer is suspended): queued links are skipped, the one running
        finishes, and the consumer gets `error` when it resumes."""
        self._stopped = True
        self._results.put(error)
        for lane in self.lanes:
            lane.synchronize()

    def restart(self) -> None:
        """Take links again after drain() returned at finish() (continuous batching resumes the decode)."""
        self._stopped = False

    def drain(self) -> Iterator:
        """Yield what the links emit until finish(); re-raise a link's error. Leaving early (an abandoned
        stream) stops the chain at its next link and waits for the lanes to go idle."""
        try:
            while (item := self._results.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._stopped = True
            for lane in self.lanes:
                lane.synchronize()
