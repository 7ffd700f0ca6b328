"""What one decode call runs with: ``DecodeOptions`` (the engine's defaults overridden per call) and its checks."""
from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from dpara_rt import ops
from dpara_rt.sampling import check_sampling

PSD_POLICIES = ("pearl", "ssd")
MAX_SSD_FANOUT = 64  # each guess costs one serial backbone forward per round
RING_CONTENTS = ("logits", "hidden")  # what DPara's ring holds per branch row: boundary logits, or hidden states

_SEED_LIMIT = 1 << 63


def is_int(value) -> bool:
    """An integer argument: any Integral but bool (True would pass as 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def ring_for(drafter) -> str:
    """DPara's ring contents for a drafter, when the caller leaves them to us ("auto"). The logits ring projects
    all (d+1) d branch rows through the output head beside verification; the hidden ring keeps their states
    and projects the d rows of branch r once r is known, on the critical path. On a GPU the projection is cheap
    matrix-unit work and the logits ring keeps the head's critical path to the Markov steps. On the host the 56
    rows outlast the verify beside them whatever the drafter's dtype: batch 1, 16 HumanEval prompts, side by
    side, hidden against logits was 1455.7 vs 1046.0 tok/s with a float32 drafter and 1370.7 vs 1164.5 with a
    bf16 one on an AVX-512 BF16 host, 303.7 vs 250.3 (float32) on an AVX2 host."""
    return "hidden" if drafter.device.type == "cpu" else "logits"


_PER_REQUEST = ("temperature", "top_p", "top_k", "seed")  # options a call may give one value per prompt


def _per_request(value):
    """A per-request value (a sequence: one per prompt) as a tuple; a scalar as it is."""
    if isinstance(value, (str, bytes)):
        return value
    if isinstance(value, torch.Tensor):
        return tuple(value.tolist()) if value.dim() > 0 else value.item()
    if isinstance(value, np.ndarray):
        return tuple(value.tolist()) if value.ndim > 0 else value.item()
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


@dataclass(frozen=True)
class DecodeOptions:
    """What one decode call runs with (the engine's defaults overridden per call).

    temperature, top_p, top_k and seed are each one value for the whole batch or a tuple with one value per
    prompt (``check_batch`` checks the count). Sampling applies temperature, then top-k (0 = off), then top-p
    (1 = off): see dpara_rt.sampling."""
    d: int = 7
    temperature: float | tuple[float, ...] = 0.0
    top_p: float | tuple[float, ...] = 1.0
    top_k: int | tuple[int, ...] = 0
    seed: int | tuple[int, ...] = 0
    max_new_tokens: int = 64
    eos_ids: tuple[int, ...] = ()
    psd_policy: str = "pearl"
    ssd_fanout: int = 4
    dpara_ring: str = "logits"

    def __post_init__(self):
        for name in _PER_REQUEST:
            object.__setattr__(self, name, _per_request(getattr(self, name)))
        if not is_int(self.d) or not 1 <= self.d <= ops.MAX_DRAFT:
            raise ValueError(f"d = {self.d!r}; expected an int in 1..{ops.MAX_DRAFT}")
        for name in _PER_REQUEST:
            if getattr(self, name) == ():
                raise ValueError(f"{name} = (); expected a value, or one value per prompt")
        check_sampling(self.temperature, self.top_p, self.top_k)
        seeds = self.seed if isinstance(self.seed, tuple) else (self.seed,)
        for i, seed in enumerate(seeds):
            if not is_int(seed) or not 0 <= seed < _SEED_LIMIT:
                name = f"seed[{i}]" if isinstance(self.seed, tuple) else "seed"
                raise ValueError(f"{name} = {seed!r}; expected an int in [0, 2**63)")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {self.max_new_tokens!r}; expected a positive integer")
        if self.psd_policy not in PSD_POLICIES:
            raise ValueError(f"psd_policy {self.psd_policy!r}; expected one of {PSD_POLICIES}")
        if not is_int(self.ssd_fanout) or not 1 <= self.ssd_fanout <= MAX_SSD_FANOUT:
            raise ValueError(f"ssd_fanout = {self.ssd_fanout!r}; expected an int in 1..{MAX_SSD_FANOUT} (each guess "
                             "costs a backbone forward per round)")
        bad_eos = [e for e in self.eos_ids if not is_int(e) or e < 0]
        if bad_eos:
            raise ValueError(f"eos_ids holds {bad_eos[0]!r}; expected non-negative int token ids")
        if self.dpara_ring not in RING_CONTENTS:
            raise ValueError(f"dpara_ring {self.dpara_ring!r}; expected one of {RING_CONTENTS}")

    @functools.cached_property  # asked several times a round; the options are frozen
    def sampling(self) -> bool:
        """Whether any request samples (the others are greedy rows of a sampled batch)."""
        temps = self.temperature if isinstance(self.temperature, tuple) else (self.temperature,)
        return any(t > 0 for t in temps)

    @property
    def per_request_seeds(self) -> bool:
        return isinstance(self.seed, tuple)

    def check_batch(self, batch: int) -> None:
        """ValueError unless every per-request option has one value per prompt."""
        for name in _PER_REQUEST:
            value = getattr(self, name)
            if isinstance(value, tuple) and len(value) != batch:
                raise ValueError(f"{name} has {len(value)} values for {batch} prompts; expected one per prompt "
                                 "(or a single value for all)")

    def per_row(self, name: str, batch: int) -> list:
        """Option `name` as one value per row."""
        value = getattr(self, name)
        return list(value) if isinstance(value, tuple) else [value] * batch


__all__ = ["DecodeOptions", "MAX_SSD_FANOUT", "PSD_POLICIES", "RING_CONTENTS", "is_int"]
