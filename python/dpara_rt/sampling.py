"""Token selection shared by every decoding method: temperature, top-p (nucleus), seeded draws.

Draws go through `inverse_cdf(p, u)` with explicit uniforms so that a seeded torch.Generator makes runs
repeat. It is the verification kernels' own float64 rule (a float32 running sum drifts by more than a
token's mass at V ~ 150k), so AR sampling and lossless verification draw alike.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dpara_rt.kernels.verify import inverse_cdf


def check_sampling(temperature: float, top_p: float):
    if not temperature >= 0:
        raise ValueError(f"temperature = {temperature!r}; expected >= 0 (0 means greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p = {top_p!r}; expected 0 < top_p <= 1")


def top_p_filter(p: Tensor, top_p: float) -> Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches top_p, then renormalise."""
    if top_p >= 1:
        return p
    sorted_p, order = p.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    keep_sorted = mass_before < top_p  # the most likely token always survives (mass_before = 0)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    p = p * keep
    return p / p.sum(-1, keepdim=True)


def probs(logits: Tensor, temperature: float = 0.0, top_p: float = 1.0) -> Tensor:
    """The distribution tokens are drawn from, [..., V] fp32; one-hot at the argmax when temperature is 0."""
    check_sampling(temperature, top_p)
    logits = logits.float()
    if temperature == 0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return top_p_filter(torch.softmax(logits / temperature, dim=-1), top_p)


def sample(logits: Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> Tensor:
    """One token per row of logits [B, V]: argmax at temperature 0, else a draw from probs(...)."""
    check_sampling(temperature, top_p)
    if temperature == 0:
        return logits.argmax(-1)
    u = torch.rand(logits.shape[0], generator=generator, device=logits.device)
    return inverse_cdf(probs(logits, temperature, top_p), u)


def make_generator(seed: int, device="cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g
