"""Token selection shared by every decoding method: temperature, top-k, top-p (nucleus), seeded draws.

The distribution a token is drawn from (``probs``) is built in this order, as in transformers and vLLM:

1. temperature: softmax(logits / T) (T = 0: one-hot at the argmax, lowest index on ties; nothing else applies);
2. top-k (0 = off): keep every token whose probability is at least the k-th largest one (tokens tied with
   the k-th are all kept, so more than k may survive), renormalise;
3. top-p (1 = off): of what top-k left, keep the smallest set of most likely tokens whose mass reaches top_p
   (ties ordered by token id, a stable sort), renormalise. The most likely token always survives.

AR draws from this distribution, and lossless speculative verification uses the very same function for the
target side p (the drafter's q stays untruncated: draft tokens outside p's support have p = 0 and are always
rejected, and the residual max(p - q, 0) is zero outside it), so every method samples from one law.

Each parameter is a scalar for the whole batch or one value per row of the logits (a sequence or a tensor of
length B); a row's result depends only on its own logits and parameters, never on its batch-mates.

Draws go through `inverse_cdf(p, u)` with explicit uniforms so that a seeded torch.Generator makes runs
repeat. It is the verification kernels' own float64 rule (a float32 running sum drifts by more than a
token's mass at V ~ 150k), so AR sampling and lossless verification draw alike. ``uniforms`` takes either one
generator for the batch or one generator per row (each row then draws from its own stream only).
"""
from __future__ import annotations

import math
import numbers
from typing import Sequence, Union

import torch
from torch import Tensor

from dpara_rt.kernels.verify import inverse_cdf
from dpara_rt.host.native import inverse_cdf_native

Param = Union[float, int, Sequence, Tensor]
Generators = Union[torch.Generator, Sequence[torch.Generator], None]


def _values(value) -> tuple[list, bool]:
    """(the values, whether `value` was given per row)."""
    if isinstance(value, Tensor):
        return value.reshape(-1).tolist(), value.dim() > 0
    if isinstance(value, (list, tuple)):
        return list(value), True
    return [value], False


def _named(name: str, i: int, per_row: bool) -> str:
    return f"{name}[{i}]" if per_row else name


def check_sampling(temperature: Param, top_p: Param, top_k: Param = 0):
    """ValueError naming the offending value unless 0 <= temperature, 0 < top_p <= 1 and top_k an int >= 0;
    each may be a scalar or one value per row."""
    values, per_row = _values(temperature)
    for i, t in enumerate(values):
        if not (isinstance(t, numbers.Real) and not isinstance(t, bool) and math.isfinite(t) and t >= 0):
            raise ValueError(f"{_named('temperature', i, per_row)} = {t!r}; expected a finite number >= 0 "
                             "(0 means greedy)")
    values, per_row = _values(top_p)
    for i, p in enumerate(values):
        if not (isinstance(p, numbers.Real) and not isinstance(p, bool) and 0 < p <= 1):
            raise ValueError(f"{_named('top_p', i, per_row)} = {p!r}; expected 0 < top_p <= 1")
    values, per_row = _values(top_k)
    for i, k in enumerate(values):
        if not (isinstance(k, numbers.Integral) and not isinstance(k, bool) and k >= 0):
            raise ValueError(f"{_named('top_k', i, per_row)} = {k!r}; expected an int >= 0 (0 = off)")


def _rows(value: Param, like: Tensor, dtype: torch.dtype) -> Tensor:
    """`value` as a tensor broadcastable against `like` [B, ..., V]: a scalar, or [B, 1, ..., 1] per row."""
    if not isinstance(value, (Tensor, list, tuple)):
        return torch.tensor(value, dtype=dtype, device=like.device)
    t = torch.as_tensor(value, dtype=dtype).to(like.device)
    if t.dim() == 0:
        return t
    if t.dim() != 1 or t.shape[0] != like.shape[0]:
        raise ValueError(f"a per-row sampling parameter has {t.numel()} values for {like.shape[0]} rows; "
                         "expected one per row")
    return t.view(-1, *([1] * (like.dim() - 1)))


def _renormalise(p: Tensor, keep: Tensor, active: Tensor) -> Tensor:
    """p restricted to `keep` and renormalised, on rows where `active`; other rows unchanged (bit for bit)."""
    kept = p * keep
    return torch.where(active, kept / kept.sum(-1, keepdim=True), p)


def top_k_filter(p: Tensor, top_k: Param) -> Tensor:
    """Zero every token below the k-th largest probability (ties with it are kept), then renormalise.
    top_k: an int (0 = off) or one per row; k >= V keeps everything."""
    check_sampling(0.0, 1.0, top_k)
    vocab = p.shape[-1]
    active_ks = [k for k in _values(top_k)[0] if 0 < k < vocab]
    if not active_ks:
        return p
    k_max = max(active_ks)
    k = _rows(top_k, p, torch.long)
    largest = p.topk(k_max, dim=-1).values  # sorted, descending
    kth = largest.gather(-1, (k.clamp(1, k_max) - 1).expand(*p.shape[:-1], 1))
    return _renormalise(p, p >= kth, (k > 0) & (k < vocab))


def top_p_filter(p: Tensor, top_p: Param) -> Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches top_p, then renormalise.
    top_p: a float in (0, 1] (1 = off) or one per row."""
    check_sampling(0.0, top_p)
    if all(v >= 1 for v in _values(top_p)[0]):
        return p
    limit = _rows(top_p, p, torch.float32)
    sorted_p, order = p.sort(dim=-1, descending=True, stable=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    keep_sorted = mass_before < limit  # the most likely token always survives (mass_before = 0)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return _renormalise(p, keep, limit < 1)


def _all_greedy(temperature: Param) -> bool:
    return all(t == 0 for t in _values(temperature)[0])


def probs(logits: Tensor, temperature: Param = 0.0, top_p: Param = 1.0, top_k: Param = 0) -> Tensor:
    """The distribution tokens are drawn from, [..., V] fp32: temperature, then top-k, then top-p (see the
    module docstring); one-hot at the argmax on rows whose temperature is 0. Per-row parameters index dim 0."""
    check_sampling(temperature, top_p, top_k)
    logits = logits.float()
    one_hot = lambda: torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)  # noqa: E731
    temperatures = _values(temperature)[0]
    if all(v == 0 for v in temperatures):
        return one_hot()
    t = _rows(temperature, logits, torch.float32)
    if all(v > 0 for v in temperatures) and _untruncated(top_p, top_k, logits.shape[-1]):
        # The common sampled call (every row drawn, nothing truncated) is a softmax: the general path below
        # gives these bits after several small ops of a few us each, paid per token by AR.
        return torch.softmax(logits / t, dim=-1)
    greedy = t == 0
    p = torch.softmax(logits / torch.where(greedy, 1.0, t), dim=-1)
    p = top_p_filter(top_k_filter(p, top_k), top_p)
    if any(v == 0 for v in temperatures):
        p = torch.where(greedy, one_hot(), p)
    return p


def _untruncated(top_p: Param, top_k: Param, vocab: int) -> bool:
    """Whether top-p and top-k leave every row's distribution as it is (top_k_filter's and top_p_filter's no-op)."""
    return all(v >= 1 for v in _values(top_p)[0]) and all(k == 0 or k >= vocab for k in _values(top_k)[0])


def uniforms(generator: Generators, rows: int, *shape: int, device=None) -> Tensor:
    """Uniforms [rows, *shape] in [0, 1): from one generator for the batch, or from one generator per row
    (row b's values come from generator[b] alone, exactly what that row would draw in a batch of one)."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != rows:
            raise ValueError(f"{len(generator)} generators for {rows} rows; expected one per row")
        if not rows:
            return torch.empty(0, *shape, device=device)
        u = torch.cat([torch.rand(1, *shape, generator=g, device=g.device) for g in generator])
        return u if device is None else u.to(device)
    return torch.rand(rows, *shape, generator=generator, device=device)


def sample(logits: Tensor, temperature: Param = 0.0, top_p: Param = 1.0, generator: Generators = None,
           top_k: Param = 0) -> Tensor:
    """One token per row of logits [B, V]: argmax at temperature 0, else a draw from probs(...).
    generator: one for the batch or one per row; nothing is drawn when every row is greedy."""
    check_sampling(temperature, top_p, top_k)
    if _all_greedy(temperature):
        return logits.argmax(-1)
    u = uniforms(generator, logits.shape[0], device=logits.device)
    return draw(probs(logits, temperature, top_p, top_k), u)


def draw(weights: Tensor, u: Tensor) -> Tensor:
    """inverse_cdf(weights [B, V], u [B]): in the native core for host float32 rows (the same bits; torch's
    float64 cumsum and the reductions around it took about 85 us a row at V = 8192, AR's every sampled token)."""
    if weights.is_cpu and weights.dtype == torch.float32 and weights.dim() == 2 and weights.is_contiguous() \
            and u.is_cpu and u.dtype == torch.float32 and u.dim() == 1 and u.is_contiguous():
        return inverse_cdf_native(weights, u)
    return inverse_cdf(weights, u)


def stop_at_non_finite(p: Tensor, r: Tensor, bonus: Tensor, finite: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """Where acceptance reached a draft position k whose q is not finite, stop there: keep t_1..t_k's verdicts
    (each made with its own uniform, independent of position k) and draw the bonus from p_k itself, which is
    exactly what AR would draw, so the round stays lossless whatever the drafter did."""
    d = finite.shape[1]
    first_bad = torch.where(finite.all(-1), d, (~finite).int().argmax(-1))
    hit = r >= first_bad
    rows = torch.arange(len(r), device=r.device)
    k = torch.where(hit, first_bad, r)
    redrawn = draw(p[rows, k], u)
    return k, torch.where(hit, redrawn, bonus)


def make_generator(seed: int, device="cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g
