"""Sampled Markov head work moved beside verification: the next head's Gumbel noise (NoiseAhead) and, with a
drafter worker process, the q of the draft it made (WorkerQ).

A sampling head call draws Gumbel noise for every drafted logit (d x V per request: about half of the call's
time on the host). The noise depends only on the call's counters (seed, offset, position), not on (r, bonus), so
the drafter draws it after its backbone, while the target verifies, into one of two buffers (the next call's
offset picks it), and the head on the critical path only reads it. The draws are the very bits the head would
make itself: drafts and q are unchanged. Used on the host (the native head) with one seed for the batch; any
other call, or one whose noise was not drawn, draws its own.
"""
from __future__ import annotations

import torch

from dpara_rt.host.native import HostMarkovHead, gumbel_noise


class NoiseAhead:
    def __init__(self, context):
        self.context = context
        self.buffer: torch.Tensor | None = None          # [2, B, d, V] float32: context.shared_buffer("noise")
        self._drawn: list[tuple | None] = [None, None]   # (batch, seed, offset) each half holds or will hold

    def plan(self, head, batch: int, d: int, vocab: int, seed: int, offset: int) -> tuple | None:
        """Reserve the half for the head call at `offset`: (half, seed, offset) for the drafter to draw, or None
        when that head does not take drawn noise."""
        if not isinstance(head, HostMarkovHead):
            return None
        shape = (2, batch, d, vocab)
        if self.buffer is None or tuple(self.buffer.shape) != shape:
            self.buffer = self.context.shared_buffer("noise", shape)
            self._drawn = [None, None]
        half = offset % 2
        self._drawn[half] = (batch, seed, offset)
        return half, seed, offset

    def draw(self, planned: tuple) -> None:
        """Drafter (in this process): draw the planned noise."""
        half, seed, offset = planned
        _, batch, d, vocab = self.buffer.shape
        gumbel_noise(batch, d, vocab, seed, offset, out=self.buffer[half])

    def take(self, batch: int, seed: int, offset: int) -> torch.Tensor | None:
        """The noise drawn for this call (once the drafter's work on it has been waited for), or None."""
        half = offset % 2
        if self.buffer is None or self._drawn[half] != (batch, seed, offset):
            return None
        self._drawn[half] = None
        return self.buffer[half]


class WorkerQ:
    """q [B, d, V] of a sampled DPara draft, computed by the drafter worker beside verification. With its noise
    drawn ahead, the head on the critical path only drafts (the arg-max of z + g, with the bias from the head's
    cache as a greedy step takes it), and the worker computes q from the logits the head drafted from, (r, bonus) and the draft
    (HostMarkovHead.q): bit for bit the q the head would have returned, ready long before the target's forward
    ends. Those logits are a ring slot's (the logits ring) or, with the hidden ring, branch r's rows as the head
    projected them into a buffer the worker maps too (``branch``)."""

    def __init__(self, context):
        self.context = context
        self.buffer: torch.Tensor | None = None  # [2, B, d, V] float32, from context.shared_buffer("q", ...)
        self._branch: torch.Tensor | None = None  # [2, B, d, V] float32: the hidden ring's projected branch r

    def branch(self, batch: int, d: int, vocab: int, call: int) -> tuple[torch.Tensor, tuple[str, int]]:
        """Hidden ring: where head call `call` projects branch r's rows ([B, d, V], mapped by the worker too), and
        that place as ``post`` takes it."""
        shape = (2, batch, d, vocab)
        if self._branch is None or tuple(self._branch.shape) != shape:
            self._branch = self.context.shared_buffer("branch", shape)
        half = call % 2  # read by the worker before this call's verify ends; written again two calls later
        return self._branch[half], ("branch", half)

    def post(self, source: tuple[str, int], r: torch.Tensor, bonus: torch.Tensor, draft: torch.Tensor, vocab: int,
             temperature: float, markov: bool, call: int) -> "PendingQ":
        """Have the worker compute the q of `draft`, drafted from ``("ring", slot)`` or ``("branch", half)``."""
        shape = (2, *draft.shape, vocab)
        if self.buffer is None or tuple(self.buffer.shape) != shape:
            self.buffer = self.context.shared_buffer("q", shape)
        half = call % 2  # the verify reading this half ends before the call after next writes it again
        self.context.markov_q(source, r, bonus, draft, temperature, markov, half)
        return PendingQ(self, half)


class PendingQ:
    """A draft's q that the worker is computing: ``take()`` (on the target lane, after the target's forward)
    waits for it and returns the shared buffer's half."""

    def __init__(self, owner: WorkerQ, half: int):
        self.owner, self.half = owner, half

    def take(self) -> torch.Tensor:
        self.owner.context.wait_q()
        return self.owner.buffer[self.half]
