"""The DPara kernels behind one interface: Triton for CUDA tensors; for CPU tensors the C++ core's native
Markov head and sampled verification, and the torch reference for the rest ('host').

The environment variable DPARA_RT_OPS=triton|torch|host forces a backend (triton on CPU tensors runs under
TRITON_INTERPRET=1; torch runs every reference). Every entry point validates its inputs before any launch and raises ValueError
naming the offending argument; value checks on device tensors (r, bonus, draft, uniforms, ctx_lens)
cost one host synchronisation per call.
"""
from __future__ import annotations

import math
import numbers
import os

import torch

from dpara_rt import _core
from dpara_rt.kernels import triton_support
from dpara_rt.host.native import HostMarkovHead, all_finite, markov_head_native, verify_sample_native  # noqa: F401
from dpara_rt.kernels.markov_head import markov_head_reference, markov_head_triton
from dpara_rt.kernels.tree_attention import tree_attention_reference, tree_attention_triton, tree_size
from dpara_rt.kernels.verify import (verify_greedy_reference, verify_greedy_triton, verify_sample_reference,
                                     verify_sample_triton)

__all__ = ["backend", "upload", "tree_attention", "markov_head", "markov_head_for", "BoundMarkovHead",
           "verify_greedy", "verify_sample", "MAX_DRAFT"]

MAX_DRAFT = _core.MAX_DRAFT  # largest draft length d: the core owns the limit, the kernels follow it
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_SEED_LIMIT = 1 << 63
_COUNTER_LIMIT = 1 << 32  # Gumbel counters (b*d + j)*V + v are 32-bit
_BACKENDS = ("triton", "torch", "host")


def backend(device: torch.device) -> str:
    """'triton', 'host' (native where the core has the op, else the torch reference) or 'torch' for tensors on
    `device`, honouring DPARA_RT_OPS."""
    forced = os.environ.get("DPARA_RT_OPS", "").strip().lower()
    if forced in _BACKENDS:
        return forced
    if forced not in ("", "auto"):
        raise ValueError(f"DPARA_RT_OPS={forced!r}: expected one of {_BACKENDS} or unset")
    if device.type == "cuda":
        return "triton" if triton_support.available() else "torch"
    return "host"


# ------------------------------------------------------------------------------------------ validation

def _tensor(name: str, t, ndim: int, kind: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if kind == "float" and t.dtype not in _FLOATS:
        raise ValueError(f"{name} must be float32/bfloat16/float16, got {t.dtype}")
    if kind == "int" and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        raise ValueError(f"{name} must hold integer token ids or counts, got {t.dtype}")


def _shape(name: str, t: torch.Tensor, expected: tuple, layout: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {layout} = {tuple(expected)}")


def _rows_contiguous(*named: tuple[str, torch.Tensor]) -> None:
    for name, t in named:
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)}, expected 1)")


def _contiguous(*named: tuple[str, torch.Tensor]) -> None:
    for name, t in named:
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")


def _same_device(*named: tuple[str, torch.Tensor]) -> None:
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def _draft_length(d: int, what: str) -> None:
    if not isinstance(d, numbers.Integral) or isinstance(d, bool) or not 1 <= d <= MAX_DRAFT:
        raise ValueError(f"draft length d = {d} ({what}) is out of range, expected 1..{MAX_DRAFT}")


def _in_range(*checks: tuple[str, torch.Tensor, float, float]) -> None:
    """Each (name, tensor, lo, hi): every value in [lo, hi) (NaN fails). One host sync for all of them."""
    flags = [~((t >= lo) & (t < hi)).all() for _, t, lo, hi in checks]
    bad = torch.stack([f.to(flags[0].device) for f in flags]).tolist()
    for (name, t, lo, hi), is_bad in zip(checks, bad):
        if is_bad:
            value = t[~((t >= lo) & (t < hi))][0].item()
            raise ValueError(f"{name} holds {value}, expected values in [{lo}, {hi})")


def _triton_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim = {head_dim} is not supported by the Triton kernel, expected a power of two "
                         "in 16..256 (64 and 128 are the tuned ones)")


# ---------------------------------------------------------------------------------------------- ops

def upload(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without the host waiting for the device's queue: to CUDA through pinned memory
    and a copy ordered on the current stream (a copy from pageable memory waits for the stream first); torch's
    pinned-memory cache keeps the buffer until that copy ran. `t` itself where it is on `device` already."""
    device = torch.device(device)
    if t.device == device or device.type == t.device.type == "cpu":
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def tree_attention(q, k_ctx, v_ctx, ctx_lens, k_tree, v_tree, d: int, scale: float,
                   lens_checked: bool = False) -> torch.Tensor:
    """Attention of the spine + branch rows over context + tree (see dpara_rt.kernels.tree_attention).

    ctx_lens may stay on the CPU (the convention for per-request counts): then checking it costs no
    device sync and the Triton launcher sizes its context splits from it. ``lens_checked``: the caller checked
    ctx_lens in [0, Lmax] already (a context cache's lengths, checked as it grew): no value check here, where a
    device tensor's would make the host wait once per layer.
    """
    _tensor("q", q, 4, "float")
    for name, t in (("k_ctx", k_ctx), ("v_ctx", v_ctx), ("k_tree", k_tree), ("v_tree", v_tree)):
        _tensor(name, t, 4, "float")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}")
    _tensor("ctx_lens", ctx_lens, 1, "int")
    _draft_length(d, "argument d")
    batch, n_q_heads, n_tree, head_dim = q.shape
    if n_tree != tree_size(d):
        raise ValueError(f"q has {n_tree} query rows, expected (d+1)**2 = {tree_size(d)} for d = {d}")
    n_kv_heads, max_ctx = k_ctx.shape[1], k_ctx.shape[2]
    if n_kv_heads < 1 or n_q_heads % n_kv_heads:
        raise ValueError(f"q has {n_q_heads} heads, expected a multiple of the {n_kv_heads} kv heads of k_ctx")
    _shape("k_ctx", k_ctx, (batch, n_kv_heads, max_ctx, head_dim), "[B, Hkv, Lmax, D]")
    _shape("v_ctx", v_ctx, (batch, n_kv_heads, max_ctx, head_dim), "[B, Hkv, Lmax, D]")
    _shape("k_tree", k_tree, (batch, n_kv_heads, n_tree, head_dim), "[B, Hkv, Q, D]")
    _shape("v_tree", v_tree, (batch, n_kv_heads, n_tree, head_dim), "[B, Hkv, Q, D]")
    _shape("ctx_lens", ctx_lens, (batch,), "[B]")
    _same_device(("q", q), ("k_ctx", k_ctx), ("v_ctx", v_ctx), ("k_tree", k_tree), ("v_tree", v_tree))
    _rows_contiguous(("q", q), ("k_ctx", k_ctx), ("v_ctx", v_ctx), ("k_tree", k_tree), ("v_tree", v_tree))
    if not (isinstance(scale, numbers.Real) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale = {scale!r}, expected a positive finite float")
    if batch and not lens_checked:
        _in_range(("ctx_lens", ctx_lens, 0, max_ctx + 1))
    if backend(q.device) == "triton":
        _triton_head_dim(head_dim)
        return tree_attention_triton(q, k_ctx, v_ctx, ctx_lens, k_tree, v_tree, int(d), float(scale))
    return tree_attention_reference(q, k_ctx, v_ctx, ctx_lens, k_tree, v_tree, int(d), float(scale))


def markov_head(boundary, r, bonus, w1, w2, temperature: float = 0.0, seed: int = 0, offset: int = 0,
                checked: bool = False):
    """Draft d tokens from boundary[b, r[b]] with the Markov head; (draft [B, d], q [B, d, V] or None).
    ``checked``: the caller knows r and bonus in range (a round's own outcome): no value check, which on a device
    would wait for them."""
    _tensor("boundary", boundary, 4, "float")
    _tensor("r", r, 1, "int")
    _tensor("bonus", bonus, 1, "int")
    _tensor("w1", w1, 2, "float")
    _tensor("w2", w2, 2, "float")
    batch, n_slots, d, vocab = boundary.shape
    _draft_length(d, "boundary.shape[2]")
    rank = w1.shape[1]
    if n_slots < 1 or rank < 1 or vocab < 1:
        raise ValueError(f"boundary has {n_slots} acceptance rows and vocab {vocab}, w1 rank {rank}; "
                         "expected at least 1 each")
    _shape("r", r, (batch,), "[B]")
    _shape("bonus", bonus, (batch,), "[B]")
    _shape("w1", w1, (vocab, rank), "[V, R]")
    _shape("w2", w2, (rank, vocab), "[R, V]")
    if w2.dtype != w1.dtype:
        raise ValueError(f"w2 has dtype {w2.dtype} but w1 has {w1.dtype}")
    _same_device(("boundary", boundary), ("w1", w1), ("w2", w2))
    for name, t in (("r", r), ("bonus", bonus)):
        if t.device != boundary.device and t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}, expected the CPU or boundary's device {boundary.device}")
    _rows_contiguous(("boundary", boundary))
    _contiguous(("w1", w1), ("w2", w2))
    if not (isinstance(temperature, numbers.Real) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature = {temperature!r}, expected a finite float >= 0 (0 = greedy)")
    for name, value in (("seed", seed), ("offset", offset)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not 0 <= value < _SEED_LIMIT:
            raise ValueError(f"{name} = {value!r}, expected an int in [0, 2**63)")
    if temperature > 0 and batch * d * vocab > _COUNTER_LIMIT:
        raise ValueError(f"B*d*V = {batch * d * vocab} exceeds the 2**32 random counters of one call; "
                         "split the batch")
    chosen = backend(boundary.device)
    native = chosen == "host" and boundary.device.type == "cpu" and w1.dtype == w2.dtype == torch.float32
    if batch and not native and not checked:  # the native head checks every index itself, naming the value
        _in_range(("r", r, 0, n_slots), ("bonus", bonus, 0, vocab))
    if native:
        return markov_head_native(boundary.contiguous(), r.cpu(), bonus.cpu(), w1.contiguous(), w2.contiguous(),
                                  float(temperature), int(seed), int(offset))
    r, bonus = upload(r, boundary.device), upload(bonus, boundary.device)  # a round's outcome, from the host
    if chosen == "triton":
        return markov_head_triton(boundary, r, bonus, w1, w2, float(temperature), int(seed), int(offset))
    return markov_head_reference(boundary, r, bonus, w1, w2, float(temperature), int(seed), int(offset))


# The host head's bias rows (native.HostMarkovHead): every token's, computed once as the head is built, where the
# table fits in MARKOV_BIAS_TABLE_BYTES (V <= 8192; about 0.3 s at V = 8192); else a cache of the rows drafted
# from lately, MARKOV_BIAS_CACHE_BYTES (1024 rows at V = 8192, 55 at V = 151936). At V = 8192 the cache alone
# left about 0.3 rows a call to compute on the critical path, each about 175 us right after a verify.
MARKOV_BIAS_TABLE_BYTES = 256 << 20
MARKOV_BIAS_CACHE_BYTES = 32 << 20


def markov_bias_bytes(vocab: int) -> int:
    """The bias rows' budget of a host head over `vocab` tokens: the whole table where it fits, else the cache."""
    table = 4 * vocab * vocab
    return table if table <= MARKOV_BIAS_TABLE_BYTES else MARKOV_BIAS_CACHE_BYTES


class BoundMarkovHead:
    """markov_head with its factors bound (Triton or the torch reference): they stay in the dtype given, and
    a step reads W2 once at that width (``w2.nbytes``)."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor):
        self.w1, self.w2 = w1, w2

    def __call__(self, boundary, r, bonus, temperature: float = 0.0, seed: int = 0, offset: int = 0,
                 checked: bool = False):
        return markov_head(boundary, r, bonus, self.w1, self.w2, temperature, seed, offset, checked)


def markov_head_for(w1, w2):
    """markov_head(boundary, r, bonus, temperature, seed, offset) with these factors, for a caller that drafts
    with them every round (a decode). On the host it is the native head with the factors checked once and a bias
    cache kept across calls (native.HostMarkovHead). No greedy bound: every step of a head with a cache takes its
    bias from the cache, so the bound would never be read. Elsewhere markov_head itself (BoundMarkovHead)."""
    if backend(w1.device) == "host" and w1.device.type == "cpu" and w1.dtype == w2.dtype == torch.float32:
        return HostMarkovHead(w1.contiguous(), w2.contiguous(), cache_bytes=markov_bias_bytes(w1.shape[0]))
    return BoundMarkovHead(w1, w2)


def _check_draft(draft, batch: int, d: int, vocab: int) -> None:
    _draft_length(d, "target rows - 1")
    if vocab < 1:
        raise ValueError(f"vocab size V = {vocab}, expected at least 1")
    _tensor("draft", draft, 2, "int")
    _shape("draft", draft, (batch, d), "[B, d]")


def verify_greedy(target_logits, draft):
    """Greedy verification: (accepted r [B] long, bonus [B] long)."""
    _tensor("target_logits", target_logits, 3, "float")
    batch, n_pos, vocab = target_logits.shape
    _check_draft(draft, batch, n_pos - 1, vocab)
    _same_device(("target_logits", target_logits), ("draft", draft))
    _rows_contiguous(("target_logits", target_logits), ("draft", draft))
    if batch:
        _in_range(("draft", draft, 0, vocab))
    if backend(target_logits.device) == "triton":
        return verify_greedy_triton(target_logits, draft)
    return verify_greedy_reference(target_logits, draft)


def _host(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous `dtype` tensor for the native core; t itself (no torch op) when it already is one."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def verify_sample(p, q, draft, u_accept, u_bonus, checked: bool = False):
    """Lossless rejection-sampling verification: (accepted r [B] long, bonus [B] long). ``checked``: the caller
    knows the draft ids in [0, V) and the uniforms in [0, 1) (a decode's own): no value check of device tensors.

    On the host (CPU tensors) this is the native core (native.verify_sample_native): the reference's decisions,
    bit for bit, with no torch reduction on the way."""
    _tensor("p", p, 3, "float")
    _tensor("q", q, 3, "float")
    batch, n_pos, vocab = p.shape
    d = n_pos - 1
    _check_draft(draft, batch, d, vocab)
    _shape("q", q, (batch, d, vocab), "[B, d, V]")
    _tensor("u_accept", u_accept, 2, "float")
    _tensor("u_bonus", u_bonus, 1, "float")
    _shape("u_accept", u_accept, (batch, d), "[B, d]")
    _shape("u_bonus", u_bonus, (batch,), "[B]")
    _same_device(("p", p), ("q", q), ("draft", draft), ("u_accept", u_accept), ("u_bonus", u_bonus))
    _rows_contiguous(("p", p), ("q", q), ("draft", draft), ("u_accept", u_accept))
    chosen = backend(p.device)
    if chosen == "host" and p.device.type == "cpu":
        # The core checks every draft id and uniform itself, naming the value: no torch reductions here. Other
        # float dtypes widen to float32 exactly, as the reference's .float() does.
        return verify_sample_native(_host(p, torch.float32), _host(q, torch.float32), _host(draft, torch.long),
                                    _host(u_accept, torch.float32), _host(u_bonus, torch.float32))
    if batch and not checked:
        _in_range(("draft", draft, 0, vocab), ("u_accept", u_accept, 0.0, 1.0), ("u_bonus", u_bonus, 0.0, 1.0))
    if chosen == "triton":
        return verify_sample_triton(p, q, draft, u_accept, u_bonus)
    return verify_sample_reference(p, q, draft, u_accept, u_bonus)
