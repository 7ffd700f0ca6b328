"""The drafter: a DFlash backbone with KV injection plus a DSpark Markov head (docs/design.md §1).

Rows fed to the backbone are token ids, with ``MASK_ID`` (-1) standing for the learned mask embedding.
Context rows are the fused target features of committed tokens; row p sits at absolute position p.
Their per-layer K/V (after k-norm and RoPE) live in a :class:`ContextCache` that only ever grows by
the accepted tokens' features or is cropped on rollback, so the context is never recomputed.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpara_rt.host import qwen3 as host_qwen3
from dpara_rt.host.linear import HostLinear, native_target
from dpara_rt.host.qwen3 import HostQwen3
from dpara_rt.models.kv_cache import ContextCache, host_counts
from dpara_rt.models.layouts import host_tree_layout, serial_layout, tree_layout
from dpara_rt.models.qwen3 import RMSNorm, RopeTable, WeightPlaced, apply_rope, rope_inv_freq
from dpara_rt import ops
from dpara_rt.ops import MAX_DRAFT, tree_attention

MASK_ID = -1


class DrafterWarning(UserWarning):
    """Drafting outside what the drafter was trained for (still runs, with lower tau)."""


def default_layer_ids(num_target_layers: int, k: int) -> list[int]:
    """k target layers spread evenly from layer 1 to layer L-3 (36 layers, k=5 -> 1, 9, 17, 25, 33)."""
    if not 1 <= k <= num_target_layers:
        raise ValueError(f"cannot pick k={k} feature layers from a {num_target_layers}-layer target; "
                         f"expected 1 <= k <= {num_target_layers}")
    start, end = 1, num_target_layers - 3
    if end - start < k - 1:  # shallow targets: spread over every layer instead
        start, end = 0, num_target_layers - 1
    if k == 1:
        return [(start + end) // 2]
    return [int(round(start + i * (end - start) / (k - 1))) for i in range(k)]


@dataclass
class DrafterConfig:
    layer_ids: list[int]
    target_hidden_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    block_size: int
    markov_rank: int            # 0: no Markov head (a DFlash drafter); drafts are the backbone's own tokens
    mask_token_id: int | None = None  # mask rows embed this target token (DSpark, DFlash); None: a learned row
    draft_rows: str = "anchor"  # "anchor": d rows from the anchor (DSpark); "mask": the d rows after it (DFlash)

    def __post_init__(self):
        is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
        if not isinstance(self.layer_ids, (list, tuple)) or not all(is_int(i) for i in self.layer_ids):
            raise ValueError(f"layer_ids={self.layer_ids!r}: expected a list of int target layer indices")
        self.layer_ids = list(self.layer_ids)
        if not self.layer_ids or len(set(self.layer_ids)) != len(self.layer_ids) or min(self.layer_ids) < 0:
            raise ValueError(f"layer_ids={self.layer_ids}: expected distinct non-negative target layer indices")
        for name in ("target_hidden_size", "hidden_size", "num_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "block_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        if not is_int(self.markov_rank) or self.markov_rank < 0:
            raise ValueError(f"markov_rank={self.markov_rank!r}: expected an integer >= 0 (0: no Markov head)")
        if self.mask_token_id is not None and not (is_int(self.mask_token_id)
                                                   and 0 <= self.mask_token_id < self.vocab_size):
            raise ValueError(f"mask_token_id={self.mask_token_id!r}: expected None or a token id in "
                             f"[0, vocab_size={self.vocab_size})")
        if self.draft_rows not in ("anchor", "mask"):
            raise ValueError(f"draft_rows={self.draft_rows!r}: expected 'anchor' (DSpark) or 'mask' (DFlash)")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise ValueError(f"{name}={value!r}: expected a positive finite number")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    @property
    def feature_size(self) -> int:
        return len(self.layer_ids) * self.target_hidden_size

    @property
    def lead(self) -> int:
        """Rows a block holds before its first draft row: 1 under the DFlash convention (the anchor itself)."""
        return 1 if self.draft_rows == "mask" else 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        unknown, missing = sorted(set(d) - names), sorted(required - set(d))
        if unknown or missing:
            raise ValueError(f"drafter config: unknown keys {unknown}, missing keys {missing}")
        return cls(**d)

    @classmethod
    def for_target(cls, target_config, num_layers: int = 1, num_feature_layers: int = 5, block_size: int = 7,
                   markov_rank: int = 256, layer_ids: Sequence[int] | None = None, draft_rows: str = "anchor",
                   mask_token_id: int | None = None) -> "DrafterConfig":
        """A drafter shaped like one of the target's decoder layers (what DFlash/DSpark do); feature layers
        ``layer_ids`` or ``num_feature_layers`` spread evenly over the target's depth."""
        t = target_config
        if layer_ids is None:
            layer_ids = default_layer_ids(t.num_hidden_layers, min(num_feature_layers, t.num_hidden_layers))
        return cls(layer_ids=list(layer_ids), target_hidden_size=t.hidden_size,
                   hidden_size=t.hidden_size, num_layers=num_layers, num_attention_heads=t.num_attention_heads,
                   num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim,
                   intermediate_size=t.intermediate_size, rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta,
                   vocab_size=t.vocab_size, block_size=block_size, markov_rank=markov_rank,
                   mask_token_id=mask_token_id, draft_rows=draft_rows)


# ---------------------------------------------------------------- modules
class _Attention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = HostLinear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = HostLinear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = HostLinear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = HostLinear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def query(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.heads, self.head_dim))
        return apply_rope(q, cos, sin).transpose(1, 2)

    def key_value(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        return apply_rope(k, cos, sin).transpose(1, 2), v.transpose(1, 2)


class _Layer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gate_proj = HostLinear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = HostLinear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = HostLinear(c.intermediate_size, c.hidden_size, bias=False)

    def mlp(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


Attend = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def dense_attend(ctx_visible: Tensor, block_visible: Tensor, scale: float) -> Attend:
    """Attention over cat(context, block) with an explicit mask (ctx_visible [B,Q,Lc], block_visible [B|1,Q,Q])."""
    b = ctx_visible.shape[0]
    mask = torch.cat([ctx_visible, block_visible.expand(b, -1, -1)], dim=-1)[:, None]

    def attend(q, k_ctx, v_ctx, k_blk, v_blk):
        k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return attend


class Drafter(WeightPlaced, nn.Module):
    """DFlash backbone + DSpark Markov head. ``embed_tokens`` and ``lm_head`` are the target's, frozen,
    held by reference (not submodules: not in ``parameters()`` nor ``state_dict()``)."""

    def __init__(self, config: DrafterConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        c = config
        if tuple(embed_tokens.weight.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(f"embed_tokens has shape {tuple(embed_tokens.weight.shape)}; the drafter config "
                             f"expects (vocab_size, hidden_size) = ({c.vocab_size}, {c.hidden_size})")
        if tuple(lm_head.weight.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(f"lm_head has weight shape {tuple(lm_head.weight.shape)}; the drafter config "
                             f"expects (vocab_size, hidden_size) = ({c.vocab_size}, {c.hidden_size})")
        self.config = c
        self._shared = (embed_tokens, lm_head)  # a tuple keeps them out of the module tree
        self.fc = HostLinear(c.feature_size, c.hidden_size, bias=False)
        self.context_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.mask_token_id is None:
            self.mask_embedding = nn.Parameter(torch.empty(c.hidden_size))
        else:  # the mask row is the target's embedding of mask_token_id: nothing of the drafter's own
            self.register_parameter("mask_embedding", None)
        self.w1 = nn.Parameter(torch.empty(c.vocab_size, c.markov_rank))
        self.w2 = nn.Parameter(torch.empty(c.markov_rank, c.vocab_size))
        # RoPE frequencies stay fp32 whatever the weights' dtype; one copy per device
        self._inv_freq = {torch.device("cpu"): rope_inv_freq(c.head_dim, c.rope_theta)}
        self._rope_table = RopeTable()
        self.scale = c.head_dim ** -0.5
        self._host = HostQwen3()  # the backbone's native layers (float32 on the host), packed on first use
        self._warned_d: set[int] = set()
        self.reset_parameters()
        w = embed_tokens.weight
        self.to(device=w.device, dtype=w.dtype)

    def reset_parameters(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        with torch.no_grad():
            if self.mask_embedding is not None:
                self.mask_embedding.normal_(std=float(self.embed_tokens.weight.float().std()))
            nn.init.normal_(self.w1, std=0.02)
            nn.init.zeros_(self.w2)  # the Markov bias starts at zero: plain backbone logits

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Linear:
        return self._shared[1]

    @property
    def markov_parameters(self) -> tuple[nn.Parameter, nn.Parameter]:
        return self.w1, self.w2

    def markov_factors(self, enabled: bool = True, dtype: torch.dtype | None = torch.float32) -> tuple[Tensor, Tensor]:
        """(W1, W2) in `dtype` (None: the drafter's own, no copy) for the Markov head kernels, which need rank >= 1:
        without a head (rank 0, or ``enabled=False`` for plain DFlash drafting) a zero rank-1 pair, i.e. no bias."""
        dtype = dtype or self.dtype
        if enabled and self.config.markov_rank:
            return tuple(w.detach().to(dtype).contiguous() for w in self.markov_parameters)
        v, dev = self.config.vocab_size, self.device
        return torch.zeros(v, 1, dtype=dtype, device=dev), torch.zeros(1, v, dtype=dtype, device=dev)

    def __getstate__(self):  # pickled into a drafter worker process: the cached head is rebuilt where it is used
        state = self.__dict__.copy()
        state.pop("_markov_head", None)
        return state

    def markov_head(self, enabled: bool = True):
        """ops.markov_head_for(*markov_factors(enabled)): the head a decode drafts with, kept while the factors,
        their device and the ops backend stay the same (building it packs the host head's factors). The host
        head takes float32 factors; Triton and the torch reference take the drafter's own (no copy) and accumulate
        in float32, so a bf16 drafter's step reads W2 at half the bytes of a float32 copy."""
        key = (enabled, ops.backend(self.device), *((p.data_ptr(), p._version) for p in self.markov_parameters))
        cached = self.__dict__.get("_markov_head")
        if cached is None or cached[0] != key:
            host = key[1] == "host" and self.device.type == "cpu"
            factors = self.markov_factors(enabled, torch.float32 if host else None)
            cached = self.__dict__["_markov_head"] = (key, ops.markov_head_for(*factors))
        return cached[1]

    def move_to(self, device) -> "Drafter":
        """This drafter, in place, on `device`: its own weights moved, the target's embedding and output head copied
        there (the target keeps its own). A no-op on the device it is on."""
        device = torch.device(device)
        if device == self.device:
            return self
        self.to(device)
        self._shared = tuple(copy.deepcopy(m).to(device).requires_grad_(False) for m in self._shared)
        self.__dict__.pop("_markov_head", None)
        return self

    # ------------------------------------------------------------ building blocks
    @property
    def anchor_weight(self) -> Tensor:
        return self.fc.weight

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        dev = self.device
        if dev not in self._inv_freq:
            self._inv_freq[dev] = self._inv_freq[torch.device("cpu")].to(dev)
        return self._rope_table(ops.upload(positions, dev), self._inv_freq[dev], self.dtype)

    def embed_rows(self, tokens: Tensor) -> Tensor:
        """Embed row tokens [B, Q]; ``MASK_ID`` rows get the mask embedding (learned, or mask_token_id's)."""
        w = self.embed_tokens.weight.detach()
        if self.mask_embedding is None:
            return F.embedding(tokens.masked_fill(tokens == MASK_ID, self.config.mask_token_id), w).to(self.dtype)
        e = F.embedding(tokens.clamp(min=0), w).to(self.dtype)
        return torch.where((tokens == MASK_ID)[..., None], self.mask_embedding, e)

    def packed_head(self) -> tuple[Tensor, str] | None:
        """The output head as the core's host linear layer takes it (packed weight, dtype name), for a float32 host
        drafter whose head runs natively (HostMarkovHead.from_hidden projects with it); None otherwise."""
        head = self.lm_head
        if (isinstance(head, HostLinear) and head.bias is None and self.dtype == torch.float32
                and head.weight.dtype == torch.float32 and head.weight.device.type == "cpu" and native_target()):
            return head.packed()
        return None

    def logits(self, hidden: Tensor, out: Tensor | None = None) -> Tensor:
        head = self.lm_head
        if isinstance(head, HostLinear):  # float32 on the host: the core's projection, into the slot itself
            if out is None and head._native(hidden):
                return head(hidden)
            if out is not None and head.forward_into(hidden, out):
                return out
        w, b = head.weight.detach(), head.bias
        if out is not None and b is None and out.dtype == hidden.dtype and out.is_contiguous():
            # Written straight into the ring slot as one 2-D product: a batched matmul with out= would copy
            # the transposed output head on every call.
            torch.mm(hidden.reshape(-1, hidden.shape[-1]), w.t(), out=out.view(-1, out.shape[-1]))
            return out
        z = F.linear(hidden, w, None if b is None else b.detach())
        return z if out is None else out.copy_(z)

    def markov_bias(self, prev: Tensor) -> Tensor:
        """The Markov head's bias ``W1[prev] @ W2`` for previous tokens prev [...] -> [..., V]."""
        return self.w1[prev] @ self.w2

    def _check_feature_width(self, features: Tensor) -> None:
        if features.shape[-1] != self.config.feature_size:
            raise ValueError(f"features have width {features.shape[-1]}; expected len(layer_ids) * "
                             f"target_hidden_size = {self.config.feature_size}")

    def context_kv(self, features: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Fuse target features [B,T,F] (fc + RMSNorm) and project each layer's K/V at ``positions`` [B,T]."""
        self._check_feature_width(features)
        c = self.context_norm(self.fc(features.to(self.dtype)))
        cos, sin = self._rope(positions)
        return [layer.self_attn.key_value(c, cos, sin) for layer in self.layers]

    def backbone(self, tokens: Tensor, positions: Tensor, ctx_kv: Sequence[tuple[Tensor, Tensor]],
                 attend: Attend, keep_from: int = 0) -> Tensor:
        """Run the block rows through every layer (Q from the rows, K/V = cat(context, rows)); final-normed.
        Returns rows keep_from.. only: the rows before them (a spine, a prefix, an anchor) give every layer their
        K/V, but nothing reads their output past the last layer's attention, so its output projection and MLP
        skip them (an eighth of a d = 7 boundary's backbone)."""
        h = self.embed_rows(tokens)
        b = h.shape[0]
        cos, sin = self._rope(positions)
        last = len(self.layers) - 1
        for i, (layer, (k_ctx, v_ctx)) in enumerate(zip(self.layers, ctx_kv)):
            x = layer.input_layernorm(h)
            k, v = layer.self_attn.key_value(x, cos, sin)
            o = attend(layer.self_attn.query(x, cos, sin), k_ctx, v_ctx, k, v).transpose(1, 2)
            if i == last:
                o, h = o[:, keep_from:], h[:, keep_from:]
            h = h + layer.self_attn.o_proj(o.reshape(b, o.shape[1], -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def host_backbone(self, tokens: Tensor, positions: Tensor, cache: ContextCache, visible: Tensor,
                      keep_from: int) -> Tensor | None:
        """``backbone`` over the context cache and a block visibility [Q, Q] or [B, Q, Q] in one core call
        (HostQwen3.run_block: per layer the same maths, in a fixed order), for a float32 drafter on the host at
        inference: on the host the torch path's hundred-odd small operators cost more than its arithmetic.
        None where the torch path runs (training, other dtypes and devices)."""
        if self.dtype != torch.float32 or self.device.type != "cpu" or tokens.device.type != "cpu":
            return None
        h = self.embed_rows(tokens)
        if not host_qwen3.usable(self, h, cache):
            return None
        b, q = tokens.shape
        cos, sin = (t.reshape(b * q, -1).contiguous() for t in self._rope(positions))
        return self._host.run_block(self.layers, self.config, self.norm.weight.detach(), h.contiguous(),
                                    cache.lengths.contiguous(), visible.to(torch.uint8).contiguous(), cos, sin,
                                    cache, keep_from)

    def _host_context(self, cache: ContextCache, features: Tensor, n: Tensor, positions: Tensor) -> bool:
        """extend_context's K/V in one core call (HostQwen3.run_context: the same maths, per row in a fixed order)
        for a float32 drafter on the host at inference, where its torch path is a few dozen small operators a
        round; False (nothing written) where the torch path runs."""
        fc = self.fc
        if (self.dtype != torch.float32 or self.device.type != "cpu" or not isinstance(fc, HostLinear)
                or features.device.type != "cpu" or fc.bias is not None
                or not host_qwen3.usable(self, torch.empty(0), cache)
                or self.context_norm.weight.dtype != torch.float32):
            return False
        self._check_feature_width(features)
        b, t = positions.shape
        cos, sin = (x.reshape(b * t, -1).contiguous() for x in self._rope(positions))
        self._host.run_context(self.layers, self.config, fc.packed(), self.context_norm.weight.detach().contiguous(),
                               features.to(torch.float32).contiguous(), cache.lengths.contiguous(),
                               n.contiguous(), cos, sin, cache)
        return True

    def forward(self, features: Tensor, tokens: Tensor, positions: Tensor, ctx_visible: Tensor,
                block_visible: Tensor, logit_rows: Tensor | slice = slice(None)) -> Tensor:
        """Training forward: context = all of ``features`` [B,N,F] (row p at position p), rows ``tokens``
        [B,Q] at ``positions``; masks ctx_visible [B,Q,N], block_visible [B|1,Q,Q]. Logits of ``logit_rows``."""
        n = features.shape[1]
        ctx_pos = torch.arange(n, device=features.device).expand(features.shape[0], n)
        ctx_kv = self.context_kv(features, ctx_pos)
        h = self.backbone(tokens, positions, ctx_kv, dense_attend(ctx_visible, block_visible, self.scale))
        return self.logits(h[:, logit_rows])

    # ------------------------------------------------------------ context cache
    def new_context_cache(self, batch: int, max_len: int, dtype=None, device=None) -> ContextCache:
        if batch < 1 or max_len < 1:
            raise ValueError(f"context cache needs batch >= 1 and max_len >= 1, got batch={batch}, max_len={max_len}")
        c = self.config
        return ContextCache(c.num_layers, batch, c.num_key_value_heads, max_len, c.head_dim, dtype or self.dtype,
                            device or self.device)

    def _check_cache(self, cache: ContextCache, batch: int, what: str):
        if cache.batch != batch:
            raise ValueError(f"{what} has batch {batch} but the context cache holds {cache.batch} rows")

    @torch.inference_mode()  # inference mode is per thread: lanes call these from worker threads
    def extend_context(self, cache: ContextCache, features: Tensor, n: Tensor, on_device: bool = False) -> None:
        """Append the first n[b] rows of features[b] [B,T,F] at cache.lengths[b] (the accepted tokens).
        ``on_device``: at cache.dev_lengths[b], with n [B] in device memory (a round the host has not read): every
        row is written, those past n[b] beyond the new length (never read: the next extend overwrites them), and
        only dev_lengths advance."""
        if features.dim() != 3:
            raise ValueError(f"features must be [B, T, F], got shape {tuple(features.shape)}")
        b, t, _ = features.shape
        self._check_cache(cache, b, "features")
        if on_device:
            pos = (cache.dev_lengths[:, None] + torch.arange(t, device=cache.k.device)).clamp_(max=cache.max_len - 1)
            for i, (k, v) in enumerate(self.context_kv(ops.upload(features, cache.k.device), pos)):
                cache.write(i, pos, k.transpose(1, 2), v.transpose(1, 2))
            cache.dev_lengths += n
            return
        counts = host_counts(n)  # the counts and lengths are host memory: numpy, no torch op a round
        if counts.shape[0] != b or (counts < 0).any() or (counts > t).any():
            raise ValueError(f"n={counts.tolist()}: expected {b} counts in [0, {t}]")
        lengths = cache.host_lengths
        new_len = lengths + counts
        if (new_len > cache.max_len).any():
            raise ValueError(f"context cache overflow: lengths {new_len.tolist()} exceed max_len={cache.max_len}")
        pos = torch.from_numpy(np.minimum(lengths[:, None] + np.arange(t), cache.max_len - 1))  # rows >= n dropped
        if self._host_context(cache, features, torch.from_numpy(counts), pos):
            lengths[:] = new_len
            cache.lengths_changed()
            return
        dev = cache.k.device
        kv = self.context_kv(ops.upload(features, dev), pos)
        rows, cols = np.nonzero(np.arange(t)[None, :] < counts[:, None])
        dst = ops.upload(torch.from_numpy(lengths[rows] + cols), dev)
        rows, cols = ops.upload(torch.from_numpy(rows), dev), ops.upload(torch.from_numpy(cols), dev)
        for i, (k, v) in enumerate(kv):
            cache.k[i, rows, :, dst] = k[rows, :, cols].to(cache.k.dtype)
            cache.v[i, rows, :, dst] = v[rows, :, cols].to(cache.v.dtype)
        lengths[:] = new_len
        cache.lengths_changed()

    @torch.inference_mode()
    def crop(self, cache: ContextCache, lengths: Tensor | int) -> None:
        """Roll the context back to ``lengths`` (per row or one int); never grows it."""
        lengths = torch.as_tensor(lengths, dtype=torch.long).cpu().expand(cache.batch)
        if (lengths < 0).any() or (lengths > cache.lengths).any():
            raise ValueError(f"crop to {lengths.tolist()}: expected 0 <= length <= current "
                             f"{cache.lengths.tolist()} per row")
        cache.lengths.copy_(lengths)
        cache.lengths_changed()

    # ------------------------------------------------------------ the two layouts
    def _check_d(self, d: int, untrained_ok: bool = False) -> None:
        lead = self.config.lead
        if not 1 <= d <= MAX_DRAFT - lead:  # unsafe: the kernels (tree attention, Markov head) stop at MAX_DRAFT
            raise ValueError(f"draft length d={d}: expected 1 <= d <= {MAX_DRAFT - lead} (the kernels' limit of "
                             f"{MAX_DRAFT} rows a block{', less the anchor row' if lead else ''})")
        if not untrained_ok and d not in self._warned_d:
            self.warn_untrained(d, stacklevel=3)

    def warn_untrained(self, d: int, stacklevel: int = 1) -> None:
        """The one rule for a draft length past the trained block size: a DrafterWarning, from every Engine built
        with such a d (whatever its method) and from a direct call's first draft of that d; drafts of a d warned
        about stay silent after (a worker process's copy of this drafter too). `stacklevel`: as warnings.warn's,
        counted from the caller."""
        if d > self.config.block_size:
            self._warned_d.add(d)
            warnings.warn(f"draft length d={d} exceeds block_size={self.config.block_size} the drafter was "
                          f"trained for: positions past {self.config.block_size} are untrained (expect lower "
                          "tau); running anyway", DrafterWarning, stacklevel=stacklevel + 1)

    def _rows_tokens(self, tokens: Tensor, batch: int, what: str, checked: bool = False) -> Tensor:
        if tokens.dim() != 2 or tokens.shape[0] != batch:
            raise ValueError(f"{what} must be [B={batch}, n] token ids, got shape {tuple(tokens.shape)}")
        if tokens.dtype != torch.long:
            raise ValueError(f"{what} must be torch.long token ids, got {tokens.dtype}")
        if checked:  # the runtime's own ids (a round's bonus and draft): no value check, a host wait on a device
            return ops.upload(tokens, self.device)
        bad = (tokens < 0) | (tokens >= self.config.vocab_size)
        if bad.any():
            raise ValueError(f"{what} holds token id {int(tokens[bad][0])} outside [0, {self.config.vocab_size})")
        return tokens.to(self.device)

    @torch.inference_mode()
    def block_logits(self, cache: ContextCache, anchor: Tensor, d: int, prefix: Tensor | None = None,
                     mask_anchor: bool = False, prefix_seen: Tensor | None = None,
                     untrained_ok: bool = False, checked: bool = False, ahead: int | None = None) -> Tensor:
        """Layout (a): [anchor, MASK x (d-1)] at positions lengths[b].. -> d logits [B, d, V]. Under the DFlash
        convention (draft_rows "mask") the block is [anchor, MASK x d] and the logits are the mask rows'.

        ``prefix`` [B, P] puts P feature-less tokens (causal) before the anchor; the block sees the first
        ``prefix_seen[b]`` of them (default all) and stands right after them (a ragged prefix: PSD's guess
        that request b accepted prefix_seen[b] - 1 draft tokens). ``mask_anchor`` replaces the anchor by MASK
        (what branch r of layout (b) sees at the bonus position). ``untrained_ok``: a caller that knowingly
        reads past block_size (PSD's bonus guess) is not warned. ``checked``: anchor and prefix are the runtime's
        own token ids (a decode's), not checked again. ``ahead``: the block stands at cache.dev_lengths, which may
        run `ahead` slots past the host's lengths (a round the host has not read; no prefix then).
        """
        self._check_d(d, untrained_ok)
        b = cache.batch
        anchor = self._rows_tokens(torch.as_tensor(anchor).reshape(b, 1), b, "anchor", checked)
        prefix = anchor[:, :0] if prefix is None else self._rows_tokens(prefix, b, "prefix", checked)
        if mask_anchor:
            anchor = torch.full_like(anchor, MASK_ID)
        p, lead = prefix.shape[1], self.config.lead
        tokens = torch.cat([prefix, anchor, torch.full((b, d - 1 + lead), MASK_ID, device=anchor.device)], dim=1)
        offsets, visible = serial_layout(d + lead, p)
        dev = anchor.device
        if ahead is not None:
            if p:
                raise ValueError(f"a prefix of {p} tokens at the device's lengths; expected none (ahead={ahead})")
            ctx_kv = cache.layers(cache.window(ahead))
            positions = (cache.dev_lengths[:, None] + ops.upload(offsets, dev)).clamp_(max=cache.max_len - 1)
            attend = self._context_attend(ctx_kv, cache.dev_lengths, visible[None], tokens.shape[1])
            return self.logits(self.backbone(tokens, positions, ctx_kv, attend, keep_from=lead))
        positions = cache.lengths[:, None] + offsets
        visible = visible[None]
        if prefix_seen is not None:
            seen = torch.as_tensor(prefix_seen, dtype=torch.long).cpu().reshape(-1)
            if seen.shape != (b,) or (seen < 0).any() or (seen > p).any():
                raise ValueError(f"prefix_seen = {seen.tolist()}: expected {b} counts in [0, {p}]")
            visible = visible.repeat(b, 1, 1)
            visible[:, p:, :p] = torch.arange(p)[None, None, :] < seen[:, None, None]
            positions[:, p:] += seen[:, None] - p
        h = self.host_backbone(tokens, positions, cache, visible if visible.shape[0] > 1 else visible[0], p + lead)
        if h is None:
            ctx_kv = cache.layers()
            # built where attention runs from the uploaded lengths: no synchronous copy of a host mask
            attend = self._context_attend(ctx_kv, ops.upload(cache.lengths, dev), visible, tokens.shape[1])
            h = self.backbone(tokens, ops.upload(positions, dev), ctx_kv, attend, keep_from=p + lead)
        return self.logits(h)

    def _context_attend(self, ctx_kv, lens: Tensor, visible: Tensor, q: int) -> Attend:
        """dense_attend of q block rows over the context slots of ctx_kv below lens [B] (on the device) and the
        block's own visibility [B|1, q, q]."""
        lc, dev = ctx_kv[0][0].shape[2], lens.device
        ctx_visible = (torch.arange(lc, device=dev)[None, :] < lens[:, None])[:, None].expand(len(lens), q, lc)
        return dense_attend(ctx_visible, ops.upload(visible, dev), self.scale)

    @torch.inference_mode()
    def boundary_logits(self, cache: ContextCache, spine: Tensor, out: Tensor | None = None,
                        project: bool = True, d: int | None = None, checked: bool = False,
                        ahead: int | None = None) -> Tensor:
        """Layout (b): spine s_0..s_d at positions lengths[b]..; branch r = d MASK rows at lengths[b]+r+1..;
        one backbone forward with tree attention -> boundary logits [B, d+1, d, V] (into ``out`` if given).
        ``project=False`` stops before the output head: the branches' final hidden states [B, d+1, d, H], of
        which a caller projects only the branch it needs.

        A spine s_0..s_{k-1} shorter than d+1 (``d`` given) yields branches 0..k-1 alone, [B, k, d, V]: branch r
        sees the spine up to s_r only. ``out`` may then be a whole ring slot [B, d+1, d, V]; its branches k.. are
        left as they are. (DPara's first round verifies s_0 alone, whose one outcome is branch 0.)

        Under the DFlash convention a branch is d+1 rows (its bonus slot, then the d draft rows), so the tree is
        built for width w = d+1 with one spine entry past s_d; only the unused branch w sees that entry.
        ``checked``: the spine is the runtime's own token ids (a decode's), not checked again. ``ahead``: the tree
        stands at cache.dev_lengths, at most `ahead` slots past the host's lengths, and attends to a window of
        granules (ContextCache.window): shapes that change only when the window does."""
        b = cache.batch
        spine = self._rows_tokens(spine, b, "spine", checked)
        k = spine.shape[1]
        d = k - 1 if d is None else d
        self._check_d(d)
        if not 1 <= k <= d + 1:
            raise ValueError(f"spine of {k} tokens for d={d}; expected 1 to d+1 = {d + 1} (branches 0..k-1)")
        width = self.config.vocab_size if project else self.config.hidden_size
        shape = (b, k, d, width)
        if out is not None and k <= d and tuple(out.shape) == (b, d + 1, d, width):
            out = out[:, :k]  # branches 0..k-1 of a ring slot
        if out is not None and tuple(out.shape) != shape:
            raise ValueError(f"out has shape {tuple(out.shape)}; boundary {'logits' if project else 'hidden states'} "
                             f"for d={d} need {shape}" + (f" (a spine of {k}) or a whole slot" if k <= d else ""))
        lead, dev = self.config.lead, spine.device
        offsets, visible, keep_from = host_tree_layout(d, lead, k)
        tokens = torch.cat([spine, torch.full((b, len(offsets) - k), MASK_ID, device=dev)], dim=1)
        h = None if ahead is not None else self.host_backbone(tokens, ops.upload(cache.lengths[:, None] + offsets, dev),
                                                              cache, visible, keep_from)
        if h is None:  # the tree kernels' layout, padded past s_{k-1}: branches 0..k-1 never see the padding
            w = d + lead
            spine = torch.cat([spine, spine[:, -1:].expand(b, w + 1 - k)], dim=1)
            offsets, visible = tree_layout(w)
            tokens = torch.cat([spine, torch.full((b, (w + 1) * w), MASK_ID, device=dev)], dim=1)
            if ahead is None:
                positions = ops.upload(cache.lengths[:, None] + offsets, dev)
                ctx_lens, ctx_kv = ops.upload(cache.lengths, dev), cache.layers()
            else:
                ctx_lens, ctx_kv = cache.dev_lengths, cache.layers(cache.window(ahead))
                positions = (ctx_lens[:, None] + ops.upload(offsets, dev)).clamp_(max=cache.max_len - 1)

            def attend(q, k_ctx, v_ctx, k_tree, v_tree):  # the cache's lengths: checked as they grew
                return tree_attention(q, k_ctx, v_ctx, ctx_lens, k_tree, v_tree, w, self.scale, lens_checked=True)

            h = self.backbone(tokens, positions, ctx_kv, attend, keep_from=w + 1)
            h = h.view(b, w + 1, w, -1)[:, :k, lead:].reshape(b, k * d, -1)  # branches 0..k-1, their draft rows
        if not project:
            return h.reshape(shape) if out is None else out.copy_(h.view(shape))
        if out is None:
            return self.logits(h).view(shape)
        if out.is_contiguous():
            self.logits(h, out=out.view(b, k * d, -1))
        else:
            out.copy_(self.logits(h).view(shape))
        return out


__all__ = ["MASK_ID", "ContextCache", "Drafter", "DrafterConfig", "DrafterWarning", "default_layer_ids",
           "dense_attend", "host_tree_layout", "serial_layout", "tree_layout"]
