"""The Gumbel noise of DPara's next sampled Markov head, drawn beside verification.

A sampling head call draws Gumbel noise for every drafted logit (d x V per request: about half of the call's
time on the host). The noise depends only on the call's counters (seed, offset, position), not on (r, bonus), so
the drafter draws it after its backbone, while the target verifies, into one of two buffers (the next call's
offset picks it), and the head on the critical path only reads it. The draws are the very bits the head would
make itself: drafts and q are unchanged. Used on the host (the native head) with one seed for the batch; any
other call, or one whose noise was not drawn, draws its own.
"""
from __future__ import annotations

import torch

from dpara_rt.native import HostMarkovHead, gumbel_noise


class NoiseAhead:
    def __init__(self, context):
        self.context = context
        self.buffer: torch.Tensor | None = None          # [2, B, d, V] float32, from context.noise_buffer
        self._drawn: list[tuple | None] = [None, None]   # (batch, seed, offset) each half holds or will hold

    def plan(self, head, batch: int, d: int, vocab: int, seed: int, offset: int) -> tuple | None:
        """Reserve the half for the head call at `offset`: (half, seed, offset) for the drafter to draw, or None
        when that head does not take drawn noise."""
        if not isinstance(head, HostMarkovHead):
            return None
        shape = (2, batch, d, vocab)
        if self.buffer is None or tuple(self.buffer.shape) != shape:
            self.buffer = self.context.noise_buffer(shape)
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
