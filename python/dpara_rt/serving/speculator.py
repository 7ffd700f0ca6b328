"""A step-level speculator for engines that own their target (docs/speculator.md).

``Speculator`` owns only the drafter: its weights, one context cache with a row ("slot") per request, one
drafter lane (a worker thread on the CPU, a stream on CUDA) and, in DPara mode, the boundary ring. The host
engine owns the target, its KV cache, verification and the request lifecycle, and drives the speculator with
three calls per request and round:

    add_request(id, prompt_features [T, F], bonus)     once, after the host's prefill
    propose(ids)                 -> Proposal(tokens [B, d], q [B, d, V] | None)   the draft to verify
    commit(ids, r [B], bonus [B], features [B, >= max(r)+1, F])   what the verify accepted
    remove_request(id)                                   when the request ends (any time)

``F = len(drafter.config.layer_ids) * target_hidden_size``: the target's hidden states of the feature layers
concatenated on the last dimension (transformers' ``hidden_states[i + 1]`` for layer i).

DPara mode: ``propose`` returns the draft and queues the backbone over the spine ``[bonus, draft]`` (spine +
all d+1 branches, one forward) on the speculator's lane, so it runs while the host verifies; ``commit``
queues the Markov head on branch r of that forward's boundary logits (from x_0 = the new bonus) and then
the context update, so the next ``propose`` only waits for the head. DSpark mode: ``commit`` queues the
context update, ``propose`` runs backbone + head serially. In both modes a request's first round after
``add_request`` is drafted serially (the spine does not exist yet): that is not a fallback.

Errors raised by a lane job surface to the caller on its next call to the speculator (the requests that
were live then are lost: calls naming them raise until they are removed and added again); the speculator
itself stays usable.
"""
from __future__ import annotations

import collections
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Hashable, NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from dpara_rt import _core, ops
from dpara_rt.core import branch_rows, slot_tensor
from dpara_rt.drafting.device import branch_selected, markov_rows
from dpara_rt.round.lanes import Lane
from dpara_rt.round.decoder import is_int
from dpara_rt.models.drafter import ContextCache, Drafter

MODES = ("dpara", "dspark")
_SEED_LIMIT = 1 << 63


class Proposal(NamedTuple):
    """What ``propose`` returns, rows in the order of its ``ids``."""
    tokens: Tensor         # [B, d] long, on the drafter's device: the draft t_1..t_d
    q: Tensor | None       # [B, d, V] float32: the drafter's distribution of each draft token (None: all greedy)


class LaneJob(NamedTuple):
    """One job the speculator ran on its lane (``Speculator.jobs``)."""
    step: int              # the speculator's step counter when the job was queued
    phase: str             # "context", "serial_draft", "backbone", "markov_head" or "release"
    lane: str              # the lane's name
    thread_id: int         # threading.get_ident() of the thread that ran it
    ids: tuple             # the requests it served


@dataclass(eq=False)  # requests compare by identity
class _Request:
    id: Hashable
    slot: int
    bonus: int             # s_0 of the next draft
    length: int            # context rows the lane has been asked to absorb (host-side view)
    temperature: float
    seed: int
    draws: int = 0         # Markov head calls made for this request: its Philox offset
    pending: tuple[Future, int] | None = None  # DPara: (the head's future, this request's row in it)
    lost: BaseException | None = None          # a lane error took this request's state with it


@dataclass
class _Step:
    index: int
    ids: list
    reqs: list
    ring: dict = field(default_factory=dict)  # {"slot": ring slot}, written by the backbone job


def _as_list(value, name: str) -> list:
    if isinstance(value, Tensor):
        if value.dim() != 1:
            raise ValueError(f"{name} has shape {tuple(value.shape)}; expected a 1-D tensor [B]")
        return value.tolist()
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise ValueError(f"{name} has shape {value.shape}; expected a 1-D array [B]")
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"{name} = {value!r}; expected a sequence (list, tuple or 1-D tensor) with one entry per request")


class Speculator:
    """The drafter side of speculative decoding for an engine that owns its target (see the module docstring
    and docs/speculator.md for the contract).

    drafter: a dpara_rt ``Drafter`` (``load_drafter``); its device decides the lane (CPU thread or CUDA stream).
    d: draft length (default ``drafter.config.block_size``). mode: "dpara" or "dspark".
    max_requests: request slots (rows of the context cache and of the boundary ring).
    max_len: context positions per request (prompt + generated tokens).
    temperature, seed: drafting defaults, overridable per request in ``add_request`` (temperature 0: greedy
    drafts, q is None when every request of a step is greedy).
    markov: use the drafter's Markov head (False: plain backbone drafting, DFlash).
    threads: intra-op threads of the lane's worker thread (CPU).
    """

    def __init__(self, drafter: Drafter, d: int | None = None, mode: str = "dpara", max_requests: int = 8,
                 max_len: int = 2048, temperature: float = 0.0, seed: int = 0, markov: bool = True,
                 threads: int | None = None, ring_capacity: int = 2, lane_name: str = "speculator"):
        if not isinstance(drafter, Drafter):
            raise ValueError(f"drafter is a {type(drafter).__name__}; expected a dpara_rt Drafter")
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}; expected one of {MODES}")
        c = drafter.config
        d = c.block_size if d is None else d
        limit = ops.MAX_DRAFT - c.lead
        if not is_int(d) or not 1 <= d <= limit:
            raise ValueError(f"d = {d!r}; expected an int in 1..{limit}")
        for name, value in (("max_requests", max_requests), ("max_len", max_len), ("ring_capacity", ring_capacity)):
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} = {value!r}; expected a positive int")
        _check_temperature(temperature, "temperature")
        _check_seed(seed, "seed")
        threads = torch.get_num_threads() if threads is None else threads
        if not is_int(threads) or threads < 1:
            raise ValueError(f"threads = {threads!r}; expected a positive int")
        self.drafter, self.d, self.mode = drafter, d, mode
        self.max_requests, self.max_len = max_requests, max_len
        self.temperature, self.seed = float(temperature), int(seed)
        self.vocab_size, self.feature_size = c.vocab_size, c.feature_size
        dev = drafter.device
        self.lane = Lane(lane_name, dev, None, threads)
        ident: list[int] = []
        self.lane.submit(lambda: ident.append(threading.get_ident()))
        self.lane.synchronize()
        self.lane_thread_id = ident[0]
        self.metrics = _core.Metrics(d)  # the lane's timeline (add_event) and tau (record_round)
        self.jobs: collections.deque[LaneJob] = collections.deque(maxlen=4096)
        self.cache = drafter.new_context_cache(max_requests, max_len)
        self._head = drafter.markov_head(markov)  # the Decoder's head: factors converted (on the host bound) once
        self.ring = self._slots = None
        if mode == "dpara":
            self.ring = _core.BoundaryRing(ring_capacity, max_requests, d, c.vocab_size,
                                           str(drafter.dtype).removeprefix("torch."), self.lane.device_index)
            self._slots = [slot_tensor(self.ring, i) for i in range(ring_capacity)]  # [max_requests, d+1, d, V]
        self._requests: dict[Hashable, _Request] = {}
        self._free = list(range(max_requests))
        self._step: _Step | None = None
        self._steps = 0
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        if dev.type == "cuda":  # the cache and the head's factors were made on this thread's stream
            torch.cuda.synchronize(dev)

    # ------------------------------------------------------------------ public API
    @property
    def requests(self) -> list:
        """Ids of the requests the speculator holds, in the order they were added."""
        return list(self._requests)

    @property
    def tau(self) -> float:
        """Mean tokens committed per request-round (r + 1) over every ``commit`` so far."""
        return float(self.metrics.tau)

    def add_request(self, request_id: Hashable, prompt_features: Tensor, bonus: int,
                    temperature: float | None = None, seed: int | None = None) -> None:
        """A new request after the host's prefill: prompt_features [T, F] are the target's features of the T
        prompt tokens (positions 0..T-1), bonus the token the host picked after them (position T). The
        request's first ``propose`` drafts it serially."""
        self._surface()
        if not isinstance(request_id, Hashable) or isinstance(request_id, (list, Tensor)):
            raise ValueError(f"request id {request_id!r} is not hashable; expected an int or a str")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already added; remove_request it first")
        if not self._free:
            raise ValueError(f"cannot add request {request_id!r}: all max_requests={self.max_requests} slots are "
                             "in use (remove_request a finished one, or build the Speculator with more)")
        if not isinstance(prompt_features, Tensor) or prompt_features.dim() != 2:
            shape = tuple(prompt_features.shape) if isinstance(prompt_features, Tensor) else type(prompt_features)
            raise ValueError(f"prompt_features of request {request_id!r} has shape {shape}; expected [T, F] "
                             f"with F = {self.feature_size}")
        t, f = prompt_features.shape
        if f != self.feature_size or t < 1:
            raise ValueError(f"prompt_features of request {request_id!r} has shape {(t, f)}; expected [T >= 1, "
                             f"F = {self.feature_size}] (len(layer_ids) * target_hidden_size)")
        if not prompt_features.dtype.is_floating_point:
            raise ValueError(f"prompt_features of request {request_id!r} has dtype {prompt_features.dtype}; "
                             "expected a floating dtype")
        if t + 1 + 2 * self.d > self.max_len:
            raise ValueError(f"request {request_id!r}: a prompt of {t} tokens leaves no room to draft within "
                             f"max_len={self.max_len} (needs T + 1 + 2d <= max_len)")
        bonus = self._token(bonus, f"bonus of request {request_id!r}")
        temperature = self.temperature if temperature is None else temperature
        seed = self.seed if seed is None else seed
        _check_temperature(temperature, f"temperature of request {request_id!r}")
        _check_seed(seed, f"seed of request {request_id!r}")
        self._free.sort()
        req = _Request(request_id, self._free.pop(0), bonus, t, float(temperature), int(seed))
        self._requests[request_id] = req
        feats = self._to_lane(prompt_features)
        slot = req.slot

        def absorb():
            view = self._view([slot])
            view.lengths.zero_()  # a reused slot starts empty
            self.drafter.extend_context(view, feats[None].to(self.drafter.device), torch.tensor([t]))
        self._post("context", (request_id,), absorb)

    def remove_request(self, request_id: Hashable) -> None:
        """Forget a request and free its slot (any time, also between propose and commit: the commit then
        names the remaining requests of the step)."""
        with self._error_lock:
            error = self._error
        if error is None and request_id not in self._requests:
            raise ValueError(f"unknown request id {request_id!r}; known: {list(self._requests)}")
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._free.append(req.slot)  # lane jobs on the slot run before any later add_request's (FIFO)
            if self._step is not None and req in self._step.reqs:
                i = self._step.reqs.index(req)
                del self._step.reqs[i], self._step.ids[i]
                if not self._step.reqs:  # nothing left to commit: the step is over
                    self._abandon_step()
        self._surface()

    def propose(self, ids: Sequence[Hashable]) -> Proposal:
        """The draft for the next verify of each request in ``ids``: Proposal(tokens [B, d], q [B, d, V] or
        None). The host verifies [bonus, tokens] and then calls ``commit`` with the same ids. In DPara mode
        this also queues the backbone over [bonus, tokens] on the lane (it runs while the host verifies)."""
        self._surface()
        if self._step is not None:
            raise ValueError(f"propose called while step {self._step.index} (ids {self._step.ids}) waits for its "
                             "commit; call commit (or remove_request) first")
        reqs = self._lookup(ids, "propose")
        self._steps += 1
        step = _Step(self._steps, [r.id for r in reqs], reqs)
        fresh = [i for i, r in enumerate(reqs) if self.mode == "dspark" or r.pending is None]
        serial = None
        if fresh:  # round 1 of a new request (DPara), or every round (DSpark): backbone + head, serially
            serial = self._draft_serial([reqs[i] for i in fresh])
        rows: list[tuple[Future, int]] = [None] * len(reqs)  # type: ignore[list-item]
        for j, i in enumerate(fresh):
            rows[i] = (serial, j)
        for i, r in enumerate(reqs):
            if rows[i] is None:
                rows[i] = r.pending
        tokens, q = self._gather(rows)
        for r in reqs:
            r.pending = None
        self._step = step
        if self.mode == "dpara":
            self._queue_backbone(step, tokens)
        return Proposal(tokens, q)

    def commit(self, ids: Sequence[Hashable], r, bonus, features: Tensor) -> None:
        """What the host's verify accepted, per request of the last ``propose``: r [B] accepted draft tokens
        (0..d), bonus [B] the token after them, features [B, T, F] (T >= max(r) + 1) the target's features of
        the verified block [bonus_old, t_1..t_d]; rows 0..r[b] of request b are absorbed. Returns at once: the
        context update (and, in DPara mode, the Markov head on branch r) run on the lane."""
        self._surface()
        step = self._step
        if step is None:
            raise ValueError("commit without a propose: call propose(ids) for this round first")
        reqs = self._lookup(ids, "commit")
        if {id(x) for x in reqs} != {id(x) for x in step.reqs}:  # identity: an id re-added since is another request
            raise ValueError(f"commit ids {[x.id for x in reqs]} differ from the ids of the last propose "
                             f"{step.ids}; commit every proposed request that was not removed")
        B, d = len(reqs), self.d
        r_list = _as_list(r, "r")
        b_list = _as_list(bonus, "bonus")
        for name, values in (("r", r_list), ("bonus", b_list)):
            if len(values) != B:
                raise ValueError(f"{name} has {len(values)} entries for {B} requests; expected one per id")
        for req, rv in zip(reqs, r_list):
            if not is_int(rv) or not 0 <= rv <= d:
                raise ValueError(f"r = {rv!r} for request {req.id!r}; expected an int in 0..d={d}")
        b_list = [self._token(bv, f"bonus of request {req.id!r}") for req, bv in zip(reqs, b_list)]
        if not isinstance(features, Tensor) or features.dim() != 3:
            shape = tuple(features.shape) if isinstance(features, Tensor) else type(features).__name__
            raise ValueError(f"features has shape {shape}; expected [B={B}, T, F={self.feature_size}]")
        need = max(r_list) + 1
        if features.shape[0] != B or features.shape[1] < need or features.shape[2] != self.feature_size:
            raise ValueError(f"features has shape {tuple(features.shape)}; expected [B={B}, T >= max(r)+1 = "
                             f"{need}, F={self.feature_size}]")
        if not features.dtype.is_floating_point:
            raise ValueError(f"features has dtype {features.dtype}; expected a floating dtype")
        for req, rv in zip(reqs, r_list):
            if req.length + rv + 1 + 2 * d > self.max_len:
                raise ValueError(f"request {req.id!r} would reach {req.length + rv + 1} context positions; "
                                 f"max_len={self.max_len} leaves no room for its next draft (needs 2d more)")
        feats = self._to_lane(features[:, :need])
        ids_t = tuple(req.id for req in reqs)
        if self.mode == "dpara":
            self._queue_head(step, reqs, r_list, b_list)
        slots, n = [req.slot for req in reqs], torch.tensor(r_list) + 1

        def absorb():
            f = feats.to(self.drafter.device)
            for rows, view in self._runs(slots):
                self.drafter.extend_context(view, f[rows], n[rows])
        self._post("context", ids_t, absorb)
        for req, rv, bv in zip(reqs, r_list, b_list):
            req.length += rv + 1
            req.bonus = bv
        self.metrics.record_round(np.asarray(r_list, dtype=np.int64))
        self._step = None

    def synchronize(self) -> None:
        """Wait until the lane is idle; raise a lane error if one happened."""
        self.lane.synchronize()
        self._surface()

    def close(self) -> None:
        """Wait for the lane and drop every request (the lane's thread ends with the object)."""
        self.lane.synchronize()
        self._requests.clear()
        self._free = list(range(self.max_requests))
        self._step = None

    # ------------------------------------------------------------------ lane jobs
    def _post(self, phase: str, ids: tuple, fn: Callable[[], object], future: Future | None = None) -> None:
        """Queue fn on the lane. Once a job failed, later jobs are skipped (their futures get the error) until
        the error reached the caller."""
        step = self._steps

        def job():
            with self._error_lock:
                failed = self._error
            if failed is not None:
                if future is not None:
                    future.set_exception(failed)
                return
            t0 = _core.now_ns()
            try:
                with torch.profiler.record_function(f"speculator.{phase}"):
                    value = fn()
                if future is not None:
                    future.set_result(value)
            except BaseException as e:  # noqa: BLE001 - surfaced to the caller on its next call
                if hasattr(e, "add_note"):
                    e.add_note(f"(raised on the speculator's lane {self.lane.name!r} in its {phase!r} job of "
                               f"step {step}, requests {list(ids)})")
                with self._error_lock:
                    if self._error is None:
                        self._error = e
                if future is not None:
                    future.set_exception(e)
            finally:
                self.metrics.add_event(step, phase, self.lane.name, t0, _core.now_ns())
                self.jobs.append(LaneJob(step, phase, self.lane.name, threading.get_ident(), ids))
        self.lane.submit(job)

    def _draft_serial(self, reqs: list[_Request]) -> Future:
        """Queue DSpark drafting (backbone with the bonus as anchor, then the Markov head) for reqs."""
        fut: Future = Future()
        slots = [r.slot for r in reqs]
        bonus = torch.tensor([r.bonus for r in reqs])
        head = self._head_args(reqs)

        def draft():
            logits = self.drafter.block_logits(self._view(slots), bonus, self.d)  # [B, d, V]
            return self._markov(logits, bonus, head)
        self._post("serial_draft", tuple(r.id for r in reqs), draft, fut)
        return fut

    def _queue_backbone(self, step: _Step, tokens: Tensor) -> None:
        """DPara: one backbone forward over spine [bonus, draft] + every branch into a ring slot (the lane runs
        it while the host verifies)."""
        slots = [r.slot for r in step.reqs]
        spine = self._to_lane(torch.cat([torch.tensor([r.bonus for r in step.reqs], device=tokens.device)[:, None],
                                         tokens], 1))
        lane = self.lane

        def backbone():
            slot = self.ring.acquire(lane.core)
            step.ring["slot"] = slot
            buf = self._slots[slot]
            a = slots[0]
            if slots == list(range(a, a + len(slots))):  # contiguous rows: written in place
                self.drafter.boundary_logits(self._view(slots), spine, out=buf[a:a + len(slots)])
            else:
                logits = self.drafter.boundary_logits(self._view(slots), spine)
                buf[torch.tensor(slots, device=buf.device)] = logits
            self.ring.mark_ready(slot, lane.record())
        self._post("backbone", tuple(step.ids), backbone)

    def _queue_head(self, step: _Step, reqs: list[_Request], r: list[int], bonus: list[int]) -> None:
        """DPara: the Markov head on branch r of the step's ring slot, from x_0 = the new bonus."""
        fut: Future = Future()
        for i, req in enumerate(reqs):
            req.pending = (fut, i)
        slots = [req.slot for req in reqs]
        r_full = np.zeros(self.max_requests, dtype=np.int64)
        r_full[slots] = r
        head = self._head_args(reqs)
        bonus_t = torch.tensor(bonus)
        lane = self.lane

        def markov_head():
            slot = step.ring["slot"]
            with branch_selected(self.ring, slot, r_full, lane):
                buf = self._slots[slot]
                branch = branch_rows(buf[torch.tensor(slots, device=buf.device)], r)  # [B, d, V]: branch r of each
                return self._markov(branch, bonus_t, head)
        self._post("markov_head", tuple(req.id for req in reqs), markov_head, fut)

    def _head_args(self, reqs: list[_Request]) -> list[tuple[float, int, int]]:
        """(temperature, seed, Philox offset) per request; sampled requests advance their own offset."""
        args = []
        for req in reqs:
            if req.temperature > 0:
                req.draws += 1
            args.append((req.temperature, req.seed, req.draws))
        return args

    def _markov(self, logits: Tensor, bonus: Tensor, head: list[tuple[float, int, int]]):
        """The Markov head over logits [B, d, V] from x_0 = bonus [B]: (tokens [B, d], q [B, d, V] or None).
        All greedy: one batched call. Otherwise one call per request with its own temperature, seed and offset,
        so a request's draws do not depend on its batch-mates; greedy rows of a sampled step get a one-hot q."""
        boundary = logits[:, None].contiguous()  # [B, 1, d, V]
        zeros = torch.zeros(len(head), dtype=torch.long)
        sampling = any(t > 0 for t, _, _ in head)
        return (*markov_rows(self._head, boundary, zeros, bonus, head, sampling), self._lane_event())

    def _lane_event(self):
        """On CUDA, an event after what the lane's stream has queued so far (the host's stream waits for it
        before reading a draft); None on the CPU, where a job's results are complete when it returns."""
        return torch.cuda.current_stream().record_event() if self.lane.stream is not None else None

    # ------------------------------------------------------------------ helpers
    def _gather(self, rows: list[tuple[Future, int]]) -> tuple[Tensor, Tensor | None]:
        """Wait for the futures the rows come from and assemble (tokens [B, d], q [B, d, V] or None)."""
        values = {}
        for fut, _ in rows:
            if id(fut) not in values:
                try:
                    values[id(fut)] = fut.result()
                except BaseException:  # the lane error: surfaced with its recovery
                    self._surface()
                    raise
        if self.lane.stream is not None:  # the caller's stream reads what the lane's stream wrote
            stream = torch.cuda.current_stream(self.lane.device)
            for value in values.values():
                stream.wait_event(value[2])
                for t in value[:2]:
                    if t is not None:
                        t.record_stream(stream)
        tokens = torch.stack([values[id(f)][0][i] for f, i in rows])
        if all(values[id(f)][1] is None for f, _ in rows):
            return tokens, None
        q = [values[id(f)][1] for f, _ in rows]
        v = self.vocab_size
        q = torch.stack([qq[i] if qq is not None else
                         torch.nn.functional.one_hot(tokens[b], v).float()
                         for b, (qq, (_, i)) in enumerate(zip(q, rows))])
        return tokens, q

    def _lookup(self, ids, what: str) -> list[_Request]:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, Tensor, np.ndarray)):
            raise ValueError(f"{what}: ids = {ids!r}; expected a sequence of request ids (list, tuple or 1-D tensor)")
        ids = _as_list(ids, "ids")
        if not ids:
            raise ValueError(f"{what}: ids is empty; expected at least one request id")
        seen, reqs = set(), []
        for i in ids:
            req = self._requests.get(i)
            if req is None:
                raise ValueError(f"{what}: unknown request id {i!r}; known: {list(self._requests)}")
            if i in seen:
                raise ValueError(f"{what}: request id {i!r} appears twice in ids")
            if req.lost is not None:
                raise RuntimeError(f"request {i!r} lost its drafter state to an earlier lane error "
                                   f"({req.lost!r}); remove_request and add_request it again")
            seen.add(i)
            reqs.append(req)
        return reqs

    def _token(self, value, name: str) -> int:
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()
        elif isinstance(value, np.generic):
            value = value.item()
        if not is_int(value) or not 0 <= value < self.vocab_size:
            raise ValueError(f"{name} = {value!r}; expected a token id in [0, {self.vocab_size})")
        return int(value)

    def _view(self, slots: list[int]) -> ContextCache:
        """A ContextCache over these slots: a view of the shared cache when they are contiguous (writes go
        through), else a gathered read-only copy of their committed rows."""
        cache = self.cache
        view = ContextCache.__new__(ContextCache)
        a = slots[0]
        if slots == list(range(a, a + len(slots))):
            view.k, view.v, view.lengths = cache.k[:, a:a + len(slots)], cache.v[:, a:a + len(slots)], \
                cache.lengths[a:a + len(slots)]
            return view
        idx = torch.tensor(slots)
        n = max(int(cache.lengths[idx].max()), 1)
        dev_idx = idx.to(cache.k.device)
        view.k = cache.k[:, dev_idx, :, :n]
        view.v = cache.v[:, dev_idx, :, :n]
        view.lengths = cache.lengths[idx].clone()
        return view

    def _runs(self, slots: list[int]):
        """(row indices, writable view) per run of contiguous slots."""
        start = 0
        for i in range(1, len(slots) + 1):
            if i == len(slots) or slots[i] != slots[i - 1] + 1:
                yield torch.arange(start, i), self._view(slots[start:i])
                start = i

    def _to_lane(self, tensor: Tensor) -> Tensor:
        """A private copy of a caller's tensor for a lane job (the caller may reuse its buffer at once). On
        CUDA the lane waits for the caller's stream and the allocator learns that the lane uses the copy."""
        tensor = tensor.detach().clone()
        if tensor.device.type == "cuda" and self.lane.stream is not None:
            ev = torch.cuda.current_stream(tensor.device).record_event()
            self.lane.submit(lambda: torch.cuda.current_stream().wait_event(ev))
            tensor.record_stream(self.lane.stream)
        return tensor

    def _abandon_step(self) -> None:
        """The step's requests are all gone: its ring slot (if the backbone took one) goes back to free."""
        step = self._step
        self._step = None
        if self.ring is None:
            return
        lane = self.lane

        def free():
            if "slot" in step.ring:
                unread = np.zeros(self.max_requests, dtype=np.int64)
                with branch_selected(self.ring, step.ring["slot"], unread, lane):
                    pass  # nothing reads the slot: it only goes back to free
        self._post("release", (), free)

    def _surface(self) -> None:
        """Raise a lane error once: wait for the lane to stop, mark the live requests lost, reset the ring."""
        with self._error_lock:
            error = self._error
        if error is None:
            return
        self.lane.synchronize()
        for req in self._requests.values():
            req.lost = req.lost or error
            req.pending = None
        self._step = None
        if self.ring is not None:
            self.ring.reset()
        with self._error_lock:
            self._error = None
        raise error


def _check_temperature(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"{name} = {value!r}; expected a finite number >= 0 (0: greedy drafts)")


def _check_seed(value, name: str) -> None:
    if not is_int(value) or not 0 <= value < _SEED_LIMIT:
        raise ValueError(f"{name} = {value!r}; expected an int in [0, 2**63)")


__all__ = ["MODES", "LaneJob", "Proposal", "Speculator"]
