"""The values a speculative round hands between lanes.

A round's data are values, not decoder state: a ``Draft`` goes from the drafter lane to the target lane, an
``Outcome`` from the target lane back to the drafter lane. Between lanes they travel through the core: the
tokens and the verified block's features through a phase of the double-buffered staging (round k uses phase
k % 2), boundary logits through a ring slot, each hand-off guarded by the producer's lane event, and each phase
or slot handed back with the consumer's event; ``(r, bonus)`` are the round state's own host arrays. On host
lanes the same code is correct because a job that records or waits on its own lane does so at its current point,
as a stream does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dpara_rt import _core, ops


@dataclass(frozen=True)
class Draft:
    """A draft on its way to verification (head lane -> target lane)."""
    round: int               # the round that verifies it
    bonus: Tensor            # [B] long: s_0, the last round's bonus (host; the target's device in a lagged round)
    tokens: Tensor | None    # [B, d] long on the drafter's device: t_1..t_d (None: an AR round)
    staged: Tensor | None    # what the target lane reads: the tokens in staging (int32 [B, d]), or `tokens`
    #                          themselves (the head on the target lane, a block built on the target's device)
    q: object                # the drafter's distributions [B, d, V] when sampling, as the drafting backend
    #                          hands them (DraftingBackend.resolve_q gives the tensor); None when greedy
    ready: _core.Event       # drafter lane, after the tokens and q were written
    slot: int = -1           # the ring slot filled with this draft's boundary logits beside its verify (DPara)

    def spine(self, device) -> Tensor:
        """[b, t1..td] on `device`, for the drafter's own use (no staging round trip); [b] alone for an AR round."""
        if self.tokens is None:
            return ops.upload(self.bonus[:, None], device)
        return torch.cat([ops.upload(self.bonus[:, None], device), self.tokens], dim=1)

    def spine_ids(self) -> list[list[int]]:
        """spine() as token lists, what a message to a drafter worker carries (without a tensor built on the way)."""
        if self.tokens is None:
            return [[b] for b in self.bonus.tolist()]
        return [[b, *t] for b, t in zip(self.bonus.tolist(), self.tokens.tolist())]


@dataclass(frozen=True)
class Verified:
    """The target's forward over a block: greedy rounds carry its argmax (the round state accepts); sampled
    rounds and AR carry (r, bonus) as lossless verification drew them."""
    block: Tensor                # [B, 1+d] long, host
    features: Tensor             # [B, 1+d, F], staged for the drafter (the target's own tensor without one)
    slot: int                    # the draft's ring slot (-1: none)
    argmax: Tensor | None = None
    r: Tensor | None = None
    bonus: Tensor | None = None


@dataclass(frozen=True)
class Outcome:
    """A committed round (round 0 is the prefill), on its way back to the drafter lane."""
    round: int
    r: Tensor                 # [B] long: accepted draft tokens (0 for finished requests)
    bonus: Tensor             # [B] long: the next s_0 (finished requests keep their last one)
    tokens: list[list[int]]   # what this round committed per request
    features: Tensor          # [B, T, F] target features of the verified block (of the prompt at round 0)
    keep: Tensor              # [B] long: rows of `features` the drafter absorbs (r+1 for running requests)
    running: Tensor           # [B] bool, after this round
    ready: _core.Event        # target lane, after the verify wrote the features (and staged them)
    slot: int = -1            # the ring slot holding this round's boundary logits (DPara; -1: none)
    pause: bool = False       # continuous batching: the chain stops here so that waiting requests join
    any_running: bool | None = None  # running.any(), where the caller knows it (None: computed when asked)

    @property
    def phase(self) -> int:
        return self.round % 2

    @property  # asked by several links of a round, right after a verify: a field, not a numpy reduction
    def finished(self) -> bool:
        """Whether the method's chain ends at this round (every request finished, or a pause to admit)."""
        live = self.running.numpy().any() if self.any_running is None else self.any_running
        return self.pause or not live


__all__ = ["Draft", "Outcome", "Verified"]
