"""Native (C++ core) implementations of the kernels for CPU tensors.

``markov_head_native`` has the contract of ``dpara_rt.kernels.markov_head.markov_head_reference`` (same
drafts, same q, the same Philox stream as the Triton kernel) at a fraction of its cost: one call into
``_core.markov_head_host``, which runs without the GIL. ``verify_sample_native`` makes the decisions of
``dpara_rt.kernels.verify.verify_sample_reference`` bit for bit through ``_core.verify_sample_host``, and
``inverse_cdf_native`` the draw of ``dpara_rt.kernels.verify.inverse_cdf`` (AR's sampling) likewise. This
module checks the tensors (the core validates every extent, index and value again, naming it);
``dpara_rt.ops`` decides when to use them.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np
import torch

from dpara_rt import _core

__all__ = ["HostMarkovHead", "MarkovBound", "all_finite", "argmax_finite", "argmax_if_finite", "gumbel_noise",
           "inverse_cdf_native", "markov_bound", "markov_head_native", "verify_sample_native"]

_BOUNDARY_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_U64_LIMIT = 1 << 64


def _cpu_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}, expected a CPU tensor (the native kernels run on the host)")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


def _describe(t) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_stream(seed, offset) -> None:
    """seed and offset of a Philox stream: ints in [0, 2**64)."""
    if type(seed) is int and type(offset) is int and 0 <= seed < _U64_LIMIT and 0 <= offset < _U64_LIMIT:
        return
    for name, value in (("seed", seed), ("offset", offset)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not 0 <= value < _U64_LIMIT:
            raise ValueError(f"{name} = {value!r}, expected an int in [0, 2**64)")


def _check_temperature(temperature) -> None:
    """A head call's temperature: a finite real >= 0 (0 = greedy)."""
    if type(temperature) is float and 0 <= temperature < math.inf:
        return  # the per-round case, without the numbers ABC check
    if not (isinstance(temperature, numbers.Real) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature = {temperature!r}, expected a finite float >= 0 (0 = greedy)")


def _index_array(name: str, t: torch.Tensor, batch: int):
    """r / bonus as a contiguous int64 numpy array of [batch] (a view when they already are one)."""
    if type(t) is torch.Tensor and t.dtype == torch.long and t.shape == (batch,) and t.is_cpu and t.is_contiguous():
        return t.numpy()  # the per-round case: the head runs on the critical path, where each torch op counts
    _cpu_tensor(name, t, 1)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer indices, got {t.dtype}")
    if t.shape[0] != batch:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [B] = ({batch},)")
    return t.to(torch.long).contiguous().numpy()


class MarkovBound(NamedTuple):
    """What a greedy native head needs to skip tokens out of reach: W2 transposed [V, R] (bfloat16 when that
    holds W2 exactly, as a bf16 drafter's factors do: half the bytes) and its column norms [V], rounded up.
    Built once per W2 (``markov_bound``); the drafts are the same with or without it."""
    w2: torch.Tensor
    w2t: torch.Tensor
    norms: torch.Tensor


def markov_bound(w2: torch.Tensor) -> MarkovBound:
    """The MarkovBound of a float32 W2 [R, V] on the CPU."""
    _cpu_tensor("w2", w2, 2)
    if w2.dtype != torch.float32:
        raise ValueError(f"w2 must be float32, got {w2.dtype}")
    norms = torch.linalg.vector_norm(w2.double(), dim=0).float()
    w2t = w2.t().contiguous()
    if torch.equal(w2t.bfloat16().float(), w2t):
        w2t = w2t.bfloat16()
    return MarkovBound(w2, w2t, torch.nextafter(norms, torch.tensor(float("inf"))))


class HostMarkovHead:
    """The native head bound to one pair of factors, checked once: a decode drafts with the same W1 / W2 every
    round, so each call checks only the boundary, indices and sampling arguments it is given (the core checks
    every extent and index again). ``bound`` (``markov_bound(w2)``, or True to build it) lets greedy steps
    compute exact values only for the tokens in reach of the arg-max: same drafts, less work. ``cache_bytes``: room
    for bias rows kept across calls (0: none); room for all V rows makes them a table, computed here."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, bound: MarkovBound | bool | None = None,
                 cache_bytes: int = 0):
        for name, w in (("w1", w1), ("w2", w2)):
            _cpu_tensor(name, w, 2)
            if w.dtype != torch.float32 or not w.is_contiguous():
                raise ValueError(f"{name} must be a contiguous float32 tensor, got {w.dtype} with strides {w.stride()}")
        vocab, rank = w1.shape
        if tuple(w2.shape) != (rank, vocab):
            raise ValueError(f"w1 has shape {tuple(w1.shape)} and w2 {tuple(w2.shape)}, expected [V, R] and [R, V]")
        if bound is True:
            bound = markov_bound(w2)
        if bound and bound.w2 is not w2:
            raise ValueError("bound was built for another W2 (markov_bound(w2) of this head's w2 expected)")
        self.w1, self.w2, self.bound, self.vocab, self.rank = w1, w2, bound or None, vocab, rank
        if not isinstance(cache_bytes, numbers.Integral) or cache_bytes < 0:
            raise ValueError(f"cache_bytes = {cache_bytes!r}, expected an int >= 0 (0: no bias cache)")
        # Bias rows W1[x] @ W2 kept across calls (a step from a kept token skips its W2 product): at least a
        # block of rows (32) per call, so that every request of a batch can hold its own. Room for every token's
        # row makes it a table, computed here: no step of a decode computes one then.
        rows = max(32, cache_bytes // (4 * vocab)) if cache_bytes else 0
        table = rows >= vocab
        if table:
            rows = max(32, vocab)
        self.cache = _core.MarkovBiasCache(w1.data_ptr(), w2.data_ptr(), vocab, rank, rows) if rows else None
        if table:
            self.cache.fill(np.arange(vocab, dtype=np.int64))

    def __call__(self, boundary: torch.Tensor, r: torch.Tensor, bonus: torch.Tensor, temperature: float = 0.0,
                 seed: int = 0, offset: int = 0, noise: torch.Tensor | None = None, with_q: bool = True):
        """(draft [B, d], q [B, d, V] or None). ``noise``: this call's Gumbel noise, drawn ahead of time by
        ``gumbel_noise`` with the same seed and offset (sampling only): the same draft, without drawing here.
        ``with_q=False`` (sampling with noise): the draft alone, its steps taken like greedy ones (from the cache, or pruned by the bound);
        ``q(...)`` gives its q later, bit for bit."""
        batch, d, vocab, r_np, bonus_np = self._check(boundary, r, bonus, temperature)
        draft, q, rest = self._outputs(batch, d, temperature, seed, offset, noise, with_q)
        _core.markov_head_host(boundary.data_ptr(), _BOUNDARY_DTYPES[boundary.dtype], batch, boundary.shape[1], d,
                               vocab, r_np, bonus_np, *rest)
        return draft, q

    def from_hidden(self, hidden: torch.Tensor, r: torch.Tensor, bonus: torch.Tensor, temperature: float = 0.0,
                    seed: int = 0, offset: int = 0, noise: torch.Tensor | None = None, with_q: bool = True, *,
                    head: tuple[torch.Tensor, str], logits: torch.Tensor):
        """The hidden ring's head in one core call: branch r[b]'s hidden states (hidden [B, n_rows, d, H] float32)
        through the output head (``head``: its packed weight and format, ``HostLinear.packed()``) into ``logits``
        [B, d, V] float32, then this head over those logits; (draft, q) as ``__call__`` returns them."""
        if not (type(hidden) is torch.Tensor and hidden.is_cpu and hidden.dtype == torch.float32 and hidden.dim() == 4
                and hidden.is_contiguous()):
            raise ValueError(f"hidden is {_describe(hidden)}, expected a contiguous float32 CPU tensor [B, n_rows, d, H]")
        batch, n_rows, d, width = hidden.shape
        packed, fmt = head
        if packed.numel() != _core.host_linear_packed_elems(self.vocab, width, fmt):
            raise ValueError(f"head holds {packed.numel()} packed elements, expected host_linear_packed_elems(V = "
                             f"{self.vocab}, H = {width}, {fmt!r}) = "
                             f"{_core.host_linear_packed_elems(self.vocab, width, fmt)}")
        _host_buffer("logits", logits, torch.float32, (batch, d, self.vocab), "[B, d, V]")
        _check_temperature(temperature)
        r_np, bonus_np = _index_array("r", r, batch), _index_array("bonus", bonus, batch)
        draft, q, rest = self._outputs(batch, d, temperature, seed, offset, noise, with_q)
        _core.markov_head_hidden_host(hidden.data_ptr(), batch, n_rows, d, width, r_np, packed.data_ptr(), fmt,
                                      self.vocab, logits.data_ptr(), bonus_np, *rest)
        return draft, q

    def _outputs(self, batch: int, d: int, temperature: float, seed: int, offset: int, noise, with_q: bool):
        """A head call's (draft, q or None, the core's arguments from w1 on), its sampling arguments checked."""
        _check_stream(seed, offset)
        if noise is not None:
            if temperature == 0:
                raise ValueError("noise is given with temperature 0; greedy drafting draws no noise")
            _host_buffer("noise", noise, torch.float32, (batch, d, self.vocab), "[B, d, V]")
        if not with_q and (temperature == 0 or noise is None):
            raise ValueError(f"with_q=False with temperature {temperature} and noise "
                             f"{'given' if noise is not None else None}: expected a sampling call with its noise "
                             "drawn ahead (greedy calls have no q anyway)")
        sampled_q = temperature > 0 and with_q
        pruned = self.bound if not sampled_q else None
        draft = torch.empty(batch, d, dtype=torch.long)
        q = torch.empty(batch, d, self.vocab, dtype=torch.float32) if sampled_q else None
        return draft, q, (self.w1.data_ptr(), self.w2.data_ptr(), self.rank, float(temperature), int(seed), int(offset),
                          draft.numpy(), 0 if q is None else q.data_ptr(), pruned.w2t.data_ptr() if pruned else 0,
                          _BOUNDARY_DTYPES[pruned.w2t.dtype] if pruned else "float32",
                          pruned.norms.data_ptr() if pruned else 0, 0 if noise is None else noise.data_ptr(),
                          self.cache)

    def q(self, boundary: torch.Tensor, r: torch.Tensor, bonus: torch.Tensor, draft: torch.Tensor,
          temperature: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, d, V] of the sampling call on (boundary, r, bonus, temperature) that drafted ``draft`` [B, d]
        (into ``out`` when given): what that call returns as q, bit for bit, without its sequential draws."""
        batch, d, vocab, r_np, bonus_np = self._check(boundary, r, bonus, temperature)
        if temperature == 0:
            raise ValueError("q(...) with temperature 0: greedy drafting has no q")
        _cpu_tensor("draft", draft, 2)
        if draft.dtype != torch.long or tuple(draft.shape) != (batch, d):
            raise ValueError(f"draft is {draft.dtype} {tuple(draft.shape)}, expected int64 [B, d] = ({batch}, {d})")
        if out is None:
            out = torch.empty(batch, d, vocab, dtype=torch.float32)
        _host_buffer("out", out, torch.float32, (batch, d, vocab), "[B, d, V]")
        _core.markov_q_host(boundary.data_ptr(), _BOUNDARY_DTYPES[boundary.dtype], batch, boundary.shape[1], d, vocab,
                            r_np, bonus_np, draft.contiguous().numpy(), self.w1.data_ptr(), self.w2.data_ptr(),
                            self.rank, float(temperature), out.data_ptr(), self.cache)
        return out

    def _check(self, boundary: torch.Tensor, r: torch.Tensor, bonus: torch.Tensor, temperature):
        """(batch, d, vocab, r, bonus as int64 arrays) of a call's boundary [B, n_rows, d, V] and indices."""
        if (type(boundary) is torch.Tensor and boundary.is_cpu and boundary.dim() == 4 and boundary.shape[3] == self.vocab
                and boundary.dtype in _BOUNDARY_DTYPES and boundary.is_contiguous() and type(temperature) is float
                and 0 <= temperature < math.inf):  # the per-round case in one expression; below, what is wrong
            batch, _, d, vocab = boundary.shape
            return batch, d, vocab, _index_array("r", r, batch), _index_array("bonus", bonus, batch)
        _cpu_tensor("boundary", boundary, 4)
        if boundary.dtype not in _BOUNDARY_DTYPES:
            raise ValueError(f"boundary must be float32/bfloat16/float16, got {boundary.dtype}")
        if not boundary.is_contiguous():
            raise ValueError(f"boundary with strides {boundary.stride()} is not contiguous; pass boundary.contiguous()")
        batch, _, d, vocab = boundary.shape
        if vocab != self.vocab:
            raise ValueError(f"boundary's last dimension is {vocab}; expected V = {self.vocab} (w1 has shape "
                             f"{tuple(self.w1.shape)}, w2 {tuple(self.w2.shape)})")
        _check_temperature(temperature)
        return batch, d, vocab, _index_array("r", r, batch), _index_array("bonus", bonus, batch)


def gumbel_noise(batch: int, d: int, vocab: int, seed: int, offset: int, out: torch.Tensor | None = None):
    """The Gumbel noise [batch, d, vocab] float32 that a sampling head call with this seed and offset draws
    (into ``out`` when given): the noise depends only on the call's counters, so it can be drawn ahead."""
    _check_stream(seed, offset)
    if out is None:
        out = torch.empty(batch, d, vocab, dtype=torch.float32)
    _host_buffer("out", out, torch.float32, (batch, d, vocab), "[B, d, V]")
    _core.gumbel_noise_host(out.data_ptr(), batch, d, vocab, int(seed), int(offset))
    return out


def markov_head_native(boundary: torch.Tensor, r: torch.Tensor, bonus: torch.Tensor, w1: torch.Tensor,
                       w2: torch.Tensor, temperature: float = 0.0, seed: int = 0, offset: int = 0,
                       bound: MarkovBound | None = None):
    """(draft [B, d] long, q [B, d, V] float32 when temperature > 0 else None) for CPU tensors.

    boundary [B, n_rows, d, V] float32/bfloat16/float16, contiguous; r, bonus [B] integer; w1 [V, R] and
    w2 [R, V] float32, contiguous. seed and offset: ints in [0, 2**64). ``bound``: see HostMarkovHead.
    """
    return HostMarkovHead(w1, w2, bound)(boundary, r, bonus, temperature, seed, offset)


def _host_buffer(name: str, t, dtype: torch.dtype, shape: tuple, layout: str) -> None:
    """t: a contiguous CPU tensor of exactly this dtype and shape (attribute reads only: no torch ops)."""
    if isinstance(t, torch.Tensor) and t.is_cpu and t.dtype == dtype and t.shape == shape and t.is_contiguous():
        return  # the per-round case, in one expression; the checks below name what is wrong
    _cpu_tensor(name, t, len(shape))
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {str(dtype).removeprefix('torch.')}, got {t.dtype}")
    if t.shape != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {layout} = {shape}")
    if not t.is_contiguous():
        raise ValueError(f"{name} with strides {t.stride()} is not contiguous; pass {name}.contiguous()")


def argmax_finite(x: torch.Tensor) -> torch.Tensor | None:
    """x.argmax(-1) (long, on the CPU) of a contiguous float32 CPU tensor [..., V], or None when x holds a NaN or
    an infinity: the check and the arg-max in one pass of the core."""
    if not (isinstance(x, torch.Tensor) and x.is_cpu and x.dtype == torch.float32 and x.dim() >= 1
            and x.is_contiguous()):
        raise ValueError(f"x is {type(x).__name__ if not isinstance(x, torch.Tensor) else (x.dtype, x.device)}"
                         ", expected a contiguous float32 CPU tensor [..., V]")
    out = torch.empty(x.shape[:-1], dtype=torch.long)
    finite = _core.argmax_finite_host(x.data_ptr(), out.numel(), x.shape[-1], out.view(-1).numpy())
    return out if finite else None


def all_finite(x: torch.Tensor) -> bool:
    """Whether x holds no NaN or inf: its min and max in one pass (NaN propagates to both), an eighth of the
    time of isfinite(x).all() on a round's logits."""
    lo, hi = torch.aminmax(x)
    return math.isfinite(lo.item()) and math.isfinite(hi.item())


def argmax_if_finite(x: torch.Tensor) -> torch.Tensor | None:
    """x.argmax(-1) on the host, or None when x holds a NaN or an infinity; host float32 logits in one native
    pass (greedy verification reads the target's logits for nothing else)."""
    if x.is_cpu and x.dtype == torch.float32 and x.is_contiguous():
        return argmax_finite(x)
    return x.argmax(-1).cpu() if all_finite(x) else None


def verify_sample_native(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, u_accept: torch.Tensor,
                         u_bonus: torch.Tensor):
    """(r [B] long, bonus [B] long): verify_sample_reference's decisions for CPU tensors, bit for bit.

    p [B, d+1, V], q [B, d, V], u_accept [B, d], u_bonus [B] float32; draft [B, d] int64; all contiguous.
    The core checks the values (draft ids in [0, V), uniforms in [0, 1)) before writing anything.
    """
    _cpu_tensor("p", p, 3)
    batch, n_pos, vocab = p.shape
    d = n_pos - 1
    if not 1 <= d <= _core.MAX_DRAFT:
        raise ValueError(f"p has {n_pos} rows per request, expected d+1 with draft length d in 1..{_core.MAX_DRAFT}")
    _host_buffer("p", p, torch.float32, (batch, n_pos, vocab), "[B, d+1, V]")
    _host_buffer("q", q, torch.float32, (batch, d, vocab), "[B, d, V]")
    _host_buffer("draft", draft, torch.long, (batch, d), "[B, d]")
    _host_buffer("u_accept", u_accept, torch.float32, (batch, d), "[B, d]")
    _host_buffer("u_bonus", u_bonus, torch.float32, (batch,), "[B]")
    r = torch.empty(batch, dtype=torch.long)
    bonus = torch.empty(batch, dtype=torch.long)
    _core.verify_sample_host(p.data_ptr(), q.data_ptr(), draft.data_ptr(), u_accept.data_ptr(), u_bonus.data_ptr(),
                             batch, d, vocab, r.data_ptr(), bonus.data_ptr())
    return r, bonus


def inverse_cdf_native(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """inverse_cdf(weights, u) [B] long, bit for bit, for contiguous float32 CPU weights [B, V] and uniforms u [B]
    (float32, in [0, 1): the core checks each and names the first that is not)."""
    _cpu_tensor("weights", weights, 2)
    batch, vocab = weights.shape
    _host_buffer("weights", weights, torch.float32, (batch, vocab), "[B, V]")
    _host_buffer("u", u, torch.float32, (batch,), "[B]")
    out = torch.empty(batch, dtype=torch.long)
    _core.inverse_cdf_host(weights.data_ptr(), u.data_ptr(), batch, vocab, out.data_ptr())
    return out
