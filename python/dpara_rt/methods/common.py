"""Shared primitives of the decoding methods.

A :class:`Decoder` holds one batch's state: the target and its KV cache, the drafter and its context cache,
the two lanes, the boundary ring, the staging buffers, the C++ round state and the round timeline. Each
method (ar, dspark, psd, dpara) is a short generator over these steps that yields, every round, the tokens
it committed per request.
"""
from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from dpara_rt import _core, ops
from dpara_rt.core import slot_tensor, staging_tensor
from dpara_rt.models.target import Target
from dpara_rt.sampling import make_generator, probs, sample


@dataclass
class DecodeOptions:
    d: int = 7
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 64
    eos_ids: Sequence[int] = ()
    psd_policy: str = "pearl"
    ssd_fanout: int = 4


@dataclass
class Span:
    """One timed piece of work on a lane."""
    round: int
    phase: str
    lane: str
    start_ns: int
    end_ns: int


class Lane:
    """A core lane plus the CPU cores its worker thread is pinned to (host lanes only)."""

    def __init__(self, name: str, device: torch.device, cores: Sequence[int] | None, threads: int):
        self.name, self.device = name, device
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device=device)
            self.core = _core.CudaLane(device.index or 0, self.stream.cuda_stream, name)
        else:
            self.stream = None
            self.core = _core.HostLane(name)
        if cores is not None or device.type == "cpu":
            self.core.submit(lambda: _pin_thread(cores, threads))

    def submit(self, fn: Callable[[], None]):
        if self.stream is None:
            self.core.submit(fn)
        else:
            stream = self.stream
            self.core.submit(lambda: _on_stream(stream, fn))

    def record(self):
        return self.core.record()

    def synchronize(self):
        self.core.synchronize()


def _pin_thread(cores: Sequence[int] | None, threads: int):
    # sched_setaffinity(0) binds only the calling thread: each lane gets its own core(s), like a device.
    if cores is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(threads)


def _on_stream(stream, fn):
    with torch.cuda.stream(stream):
        fn()


class Decoder:
    """One generate call's state and the steps the methods share."""

    def __init__(self, target: Target, drafter, target_lane: Lane, drafter_lane: Lane, opts: DecodeOptions,
                 needs_drafter: bool = True, ring_capacity: int = 2):
        self.target, self.drafter, self.opts = target, drafter, opts
        self.target_lane, self.drafter_lane = target_lane, drafter_lane
        self.d = opts.d
        self.sampling = opts.temperature > 0
        self.needs_drafter = needs_drafter
        self.ring_capacity = ring_capacity
        self.generator = make_generator(opts.seed)
        self.spans: list[Span] = []
        self.round = 0
        self.accepted: list[np.ndarray] = []   # r per request per round (-1 for requests not running)
        self.fallbacks = 0
        self._markov_offset = 0
        self._markov_weights: tuple[Tensor, Tensor] | None = None
        self.results: queue.SimpleQueue = queue.SimpleQueue()   # per-round commits, None at the end, or an error
        self.stopped = False
        self._deferred = threading.local()   # links queued by a running link, submitted once its span closed

    # ------------------------------------------------------------------ timing
    def timed(self, phase: str, lane: Lane, fn: Callable[[], object]) -> Callable[[], object]:
        rnd = self.round

        def run():
            t0 = _core.now_ns()
            try:
                return fn()
            finally:
                self.spans.append(Span(rnd, phase, lane.name, t0, _core.now_ns()))
        return run

    def on_lane(self, lane: Lane, phase: str, fn: Callable[[], object]) -> dict:
        """Submit fn to a lane; the returned dict receives its result under 'value' once the lane ran it."""
        box: dict = {}
        job = self.timed(phase, lane, fn)
        lane.submit(lambda: box.__setitem__("value", job()))
        return box

    @staticmethod
    def wait(lane: Lane, box: dict):
        lane.record().synchronize()
        if "value" not in box:  # the job raised: synchronize re-raises it
            lane.synchronize()
        return box["value"]

    # ------------------------------------------------------------------ round chains
    # A method runs as a chain of lane jobs, each queueing the next one (verify on the target lane, drafting on
    # the drafter lane), so no round waits for the caller's thread; the caller only drains `results`.
    def post(self, lane: Lane, phase: str, fn: Callable[[], None]):
        """Queue a chain link on a lane. An error ends the decode and reaches the consumer of drain()."""
        job = self.timed(phase, lane, fn)

        def guarded():
            if self.stopped:
                return
            self._deferred.links = []
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
                self.stopped = True
                self.results.put(e)
            # Links this one queued go out after its span closed, so spans never include the next link's start.
            for target_lane, link in self._deferred.links:
                target_lane.submit(link)
            self._deferred.links = None

        if getattr(self._deferred, "links", None) is not None:
            self._deferred.links.append((lane, guarded))
        else:
            lane.submit(guarded)

    def emit(self, new: list[list[int]]):
        self.results.put(new)
        if not self.running():
            self.results.put(None)

    def drain(self):
        """Yield each round's commits as the chain produces them; re-raise a chain error."""
        try:
            while (item := self.results.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.stopped = True  # an abandoned stream stops the chain at its next link
            self.target_lane.synchronize()
            self.drafter_lane.synchronize()

    # ------------------------------------------------------------------ start
    def start(self, prompts: list[list[int]]) -> list[list[int]]:
        """Prefill, pick each request's first token, load the drafter's context. Returns the first tokens."""
        opts, target = self.opts, self.target
        B = len(prompts)
        lens = target.check_prompts(prompts)
        need = max(lens) + opts.max_new_tokens + 2 * self.d + 2
        if need > target.max_len:
            raise ValueError(f"longest prompt ({max(lens)} tokens) + max_new_tokens {opts.max_new_tokens} + "
                             f"2*(d+1) needs {need} cache slots, more than max_len {target.max_len}")
        self.state = _core.RoundState(B, max(self.d, 1), opts.max_new_tokens, list(opts.eos_ids), target.max_len)
        logits, feats, prompt_lens = self.wait(self.target_lane, self.on_lane(
            self.target_lane, "prefill", lambda: target.start(prompts)))
        first = self.pick(logits)
        committed = np.zeros(B, dtype=np.int64)
        self.state.start(prompt_lens.numpy().astype(np.int64), first.numpy().astype(np.int64), committed)
        self.bonus = first
        if self.needs_drafter:
            # Pinned staging (plain aligned memory on the CPU) carries (r, bonus), draft tokens and accepted
            # features between the lanes; two phases so round k+1 never overwrites what round k's jobs read.
            feature_bytes = B * (self.d + 1) * target.feature_dim * feats.element_size()
            self.staging = _core.Staging(B, self.d, max(feature_bytes, 1),
                                         -1 if target.device.type == "cpu" else target.device.index or 0)
            self.cache = self.drafter.new_context_cache(B, target.max_len)
            self.ring = _core.BoundaryRing(self.ring_capacity, B, self.d, self.drafter.config.vocab_size,
                                           _dtype_name(self.drafter.fc.weight.dtype),
                                           -1 if target.device.type == "cpu" else self.drafter_device_index())
            self.wait(self.drafter_lane, self.on_lane(
                self.drafter_lane, "context", lambda: self.drafter.extend_context(self.cache, feats, prompt_lens)))
        return [self.state.output(b)[:int(committed[b])] for b in range(B)]

    def drafter_device_index(self) -> int:
        return self.drafter.fc.weight.device.index or 0

    # ------------------------------------------------------------------ state
    def running(self) -> bool:
        return self.state.num_running() > 0

    def running_mask(self) -> Tensor:
        return torch.from_numpy(~np.asarray(self.state.finished(), dtype=bool))

    def block(self, draft: Tensor) -> Tensor:
        """The verify block [b, t1..td] per request."""
        return torch.cat([self.bonus[:, None], draft.cpu()], dim=1)

    # ------------------------------------------------------------------ token choice
    def pick(self, logits: Tensor) -> Tensor:
        return sample(logits, self.opts.temperature, self.opts.top_p, self.generator).cpu()

    def markov(self, boundary: Tensor, r: Tensor, bonus: Tensor):
        """Draft from boundary logits [B, R1, n, V] at rows r, starting from the bonus."""
        if self._markov_weights is None:
            # The head accumulates in fp32: convert its rank-R factors once per call, not once per round.
            self._markov_weights = tuple(w.detach().float() for w in self.drafter.markov_parameters)
        w1, w2 = self._markov_weights
        dev = boundary.device
        self._markov_offset += 1
        draft, q = ops.markov_head(boundary, r.to(dev), bonus.to(dev), w1, w2,
                                   self.opts.temperature, self.opts.seed, self._markov_offset)
        return draft.cpu(), q

    def draft_serial(self, n: int | None = None, with_logits: bool = False):
        """DSpark drafting of n (default d) tokens, run on the drafter lane by the caller: backbone with the real
        bonus as anchor, then the Markov head. Returns (draft, q), plus the backbone logits when asked."""
        logits = self.drafter.block_logits(self.cache, self.bonus, n or self.d)
        draft, q = self.markov(logits[:, None], torch.zeros_like(self.bonus), self.bonus)
        return (draft, q, logits) if with_logits else (draft, q)

    def verify_and_accept(self, block: Tensor, q: Tensor | None, slot: int = -1):
        """Target-lane link: verify the block, commit the round and hand its tokens to the consumer.
        Returns (r, bonus), or None once every request has finished."""
        verified = self.verify(block, q)
        r, bonus, new = self.accept(verified, block, slot)
        self.emit(new)
        return (r, bonus) if self.running() else None

    # ------------------------------------------------------------------ verification
    def verify(self, block: Tensor, q: Tensor | None) -> tuple:
        """Target forward over the block plus the acceptance inputs (argmax, or the sampled (r, bonus))."""
        logits, feats = self.target.verify(block)
        feats = self.stage_features(feats, self.round % 2)
        if not self.sampling:
            return logits.argmax(-1).cpu(), feats, None
        p = probs(logits, self.opts.temperature, self.opts.top_p)
        d = block.shape[1] - 1
        u_accept = torch.rand(block.shape[0], d, generator=self.generator)
        u_bonus = torch.rand(block.shape[0], generator=self.generator)
        draft = block[:, 1:]
        r, bonus = ops.verify_sample(p, q.to(p.device), draft.to(p.device), u_accept.to(p.device),
                                     u_bonus.to(p.device))
        return None, feats, (r.cpu(), bonus.cpu())

    def stage_features(self, feats: Tensor, phase: int) -> Tensor:
        """Copy the verified block's features into a staging phase (device -> pinned host on CUDA)."""
        view = staging_tensor(self.staging, "features", phase, dtype=feats.dtype)[:feats.numel()].view(feats.shape)
        view.copy_(feats, non_blocking=True)
        return view

    def stage_outcome(self, r: Tensor, bonus: Tensor) -> Tensor:
        """(r, bonus) per request into the staging buffer the drafter lane reads; returns that int32 [B, 2] view."""
        rb = staging_tensor(self.staging, "rb", self.round % 2)
        rb[:, 0], rb[:, 1] = r, bonus
        return rb

    def stage_draft(self, draft: Tensor) -> Tensor:
        """Draft tokens into staging, where the next verify reads them; returns them as long [B, d]."""
        view = staging_tensor(self.staging, "draft", self.round % 2)
        view.copy_(draft)
        return view.long()

    def accept(self, verified: tuple, block: Tensor, slot: int = -1) -> tuple[Tensor, Tensor, list[list[int]]]:
        """Commit the round: the C++ round state accepts (greedy) or takes the sampled (r, bonus), stops at EOS or
        max_new_tokens inside the block, and the target keeps the KV of s_0..s_r of running requests."""
        argmax, feats, sampled = verified
        B = block.shape[0]
        running = self.running_mask()
        draft = block[:, 1:] if block.shape[1] > 1 else torch.zeros(B, self.state.d(), dtype=torch.long)  # ar
        self.state.set_draft(np.ascontiguousarray(draft.numpy(), dtype=np.int64))
        r = np.zeros(B, dtype=np.int64)
        bonus = np.zeros(B, dtype=np.int64)
        committed = np.zeros(B, dtype=np.int64)
        if sampled is None:
            self.state.step(np.ascontiguousarray(argmax.numpy(), dtype=np.int64), slot, r, bonus, committed)
        else:
            r[:], bonus[:] = sampled[0].numpy(), sampled[1].numpy()
            self.state.commit(r, bonus, slot, committed)
        r_t, bonus_t = torch.from_numpy(r), torch.from_numpy(bonus)
        keep = (r_t + 1) * running.long()
        self.target.commit(keep)
        self.accepted.append(np.where(running.numpy(), r, -1))
        self.bonus = torch.where(running, bonus_t, self.bonus)
        self.last_r = r_t
        self.feats, self.keep = feats, keep
        # What a round commits is a prefix of t1..tr, bonus (cut at EOS / max_new_tokens).
        rows, rl, cl = draft.tolist(), r.tolist(), committed.tolist()
        new = [(rows[b][:rl[b]] + [int(bonus[b])])[:cl[b]] for b in range(B)]
        self.round += 1
        return r_t, self.bonus, new

    def context_job(self) -> Callable[[], None]:
        """A drafter-lane job giving the drafter the features of the tokens the last round accepted (bound now:
        the next round overwrites them before a busy lane may get to it)."""
        cache, feats, keep = self.cache, self.feats, self.keep
        dev = self.drafter.fc.weight.device
        return lambda: self.drafter.extend_context(cache, feats.to(dev, non_blocking=True), keep)


def _dtype_name(dtype: torch.dtype) -> str:
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype not in names:
        raise ValueError(f"drafter dtype {dtype}; the boundary ring holds float32, bfloat16 or float16")
    return names[dtype]


__all__ = ["DecodeOptions", "Decoder", "Lane", "Span", "slot_tensor"]
