"""Qwen3-architecture causal LM in plain torch, numerically equal to transformers' Qwen3ForCausalLM, and with the
config's switches (decoder_config.py) its Llama, Qwen2 and Mistral relatives: no q / k norms, a bias on q, k, v,
scaled RoPE frequencies.

Every row of a batch carries its own positions, so one forward serves ragged prefill, single-token
decoding and multi-token verification. With a KVCache the new K/V are written at `positions` and each
query attends to cache slots 0..its own position; the caller decides what is committed.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpara_rt import ops
from dpara_rt.host import qwen3 as host_qwen3
from dpara_rt.host.linear import HostLinear
from dpara_rt.models.decoder_config import (ARCHITECTURE, MODEL_TYPE, NATIVE_MODEL_TYPES, Qwen3Config,
                                            rope_inv_freq)
from dpara_rt.models.kv_cache import KVCache

__all__ = ["ARCHITECTURE", "MODEL_TYPE", "NATIVE_MODEL_TYPES", "Qwen3Config", "Qwen3ForCausalLM", "RMSNorm",
           "RopeTable", "WeightPlaced", "apply_rope", "rope_cos_sin", "rope_inv_freq"]

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32, scale in the model dtype: the same rounding as transformers.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin [B, T, 1, head_dim] for per-row positions [B, T]."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, :, None, :], emb.sin().to(dtype)[:, :, None, :]


class RopeTable:
    """rope_cos_sin by lookup on the host: each position's cos / sin computed once (by rope_cos_sin itself) and
    gathered afterwards. A forward of a few tokens otherwise spends a handful of small ops (tens of us each right
    after a verify has evicted the caches) recomputing them. The table grows by doubling and follows the
    frequencies and dtype it was built for. Only the host backend looks up: sizing the table reads the positions
    on the host, which a captured (or compiled) step cannot do; other backends and devices, and positions that are
    not non-negative integers, compute directly."""

    def __init__(self):
        self._for: tuple = ()  # (inv_freq, dtype) of the table
        self._cos = self._sin = None  # [n, head_dim]

    def __getstate__(self):  # pickled with its model (a drafter worker): rebuilt where it is used
        return {}

    def __setstate__(self, state):
        self.__init__()

    def __call__(self, positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if (positions.device.type != "cpu" or positions.dtype != torch.long or not positions.numel()
                or ops.backend(positions.device) != "host"):
            return rope_cos_sin(positions, inv_freq, dtype)
        lo, hi = positions.aminmax()
        lo, hi = int(lo), int(hi)
        if lo < 0:
            return rope_cos_sin(positions, inv_freq, dtype)
        cos, sin = self.table(hi, inv_freq, dtype)
        return cos[positions][..., None, :], sin[positions][..., None, :]

    def table(self, hi: int, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The tables (cos, sin) [n, head_dim], contiguous, with a row for every position 0..hi (n > hi)."""
        if not self._for or self._for[0] is not inv_freq or self._for[1] != dtype or hi >= len(self._cos):
            n = max(256, hi + 1, 2 * len(self._cos) if self._for and self._for[0] is inv_freq else 0)
            cos, sin = rope_cos_sin(torch.arange(n)[None], inv_freq, dtype)
            self._cos, self._sin = cos[0, :, 0].contiguous(), sin[0, :, 0].contiguous()
            self._for = (inv_freq, dtype)
        return self._cos, self._sin


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        qkv = dict(kw, bias=cfg.qkv_bias)
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = HostLinear(cfg.hidden_size, self.n_heads * self.head_dim, **qkv)
        self.k_proj = HostLinear(cfg.hidden_size, self.n_kv * self.head_dim, **qkv)
        self.v_proj = HostLinear(cfg.hidden_size, self.n_kv * self.head_dim, **qkv)
        self.o_proj = HostLinear(self.n_heads * self.head_dim, cfg.hidden_size, **kw)
        if cfg.qk_norm:  # Qwen3's; the Llama family has none (no parameters, so the state dicts match)
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, device, dtype)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, device, dtype)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, positions: Tensor,
                cache: KVCache | None, layer: int, kv_len: int) -> Tensor:
        B, T, _ = x.shape
        D, Hkv = self.head_dim, self.n_kv
        G = self.n_heads // Hkv
        q = apply_rope(self.q_norm(self.q_proj(x).view(B, T, self.n_heads, D)), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).view(B, T, Hkv, D)), cos, sin)
        v = self.v_proj(x).view(B, T, Hkv, D)
        if cache is not None:
            cache.write(layer, positions, k, v)
            k, v = cache.window(layer, B, kv_len)
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        # GQA without repeating K/V: the G query heads sharing a KV head become G*T query rows of it
        # (head h uses KV head h // G, as in transformers' repeat_kv).
        q = q.view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(D))
        o = o.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, self.n_heads * D)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = HostLinear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.up_proj = HostLinear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.down_proj = HostLinear(cfg.intermediate_size, cfg.hidden_size, **kw)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, device=None, dtype=None):
        super().__init__()
        self.self_attn = Attention(cfg, device, dtype)
        self.mlp = MLP(cfg, device, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)

    def forward(self, h: Tensor, *attn_args) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), *attn_args)
        return h + self.mlp(self.post_attention_layernorm(h))


def _feature_columns(layer_ids: Sequence[int], rows: int, hidden: int,
                     dtype: torch.dtype) -> tuple[Tensor | None, dict[int, int]]:
    """A native forward's features buffer [rows, len(layer_ids) * hidden] (None without layer ids) and the column
    where the core writes each captured layer: its first listing (_copy_repeated_layers fills the others)."""
    capture: dict[int, int] = {}
    for j, i in enumerate(layer_ids):
        capture.setdefault(i, j * hidden)
    return (torch.empty(rows, len(layer_ids) * hidden, dtype=dtype) if layer_ids else None), capture


def _copy_repeated_layers(features: Tensor | None, layer_ids: Sequence[int], capture: dict[int, int],
                          hidden: int) -> None:
    """A layer listed twice in layer_ids: its later columns copied from the one the core wrote."""
    for j, i in enumerate(layer_ids):
        if capture[i] != j * hidden:
            features[:, j * hidden:(j + 1) * hidden] = features[:, capture[i]:capture[i] + hidden]


class WeightPlaced:
    """A module whose parameters share one dtype and device, read off `anchor_weight`."""

    @property
    def anchor_weight(self) -> Tensor:
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        return self.anchor_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.anchor_weight.device


class Qwen3ForCausalLM(WeightPlaced, nn.Module):
    def __init__(self, config: Qwen3Config, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, device, dtype) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.lm_head = HostLinear(config.hidden_size, config.vocab_size, bias=False, device=device, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self._host = None  # host_qwen3.HostQwen3, made on the first native forward
        self._rope = RopeTable()
        self.reset_rope()

    def reset_rope(self):
        """(Re)compute the RoPE frequencies in fp32 on the embedding's device (also after meta init)."""
        device = self.embed_tokens.weight.device
        device = torch.device("cpu") if device.type == "meta" else device
        self.inv_freq = self.config.inv_freq().to(device)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None):
        """Fresh random weights as transformers initialises Qwen3: N(0, std) matrices, unit norms, zero biases."""
        for name, p in self.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=generator).mul_(std))
            else:
                p.fill_(0.0 if name.endswith(".bias") else 1.0)

    @property
    def anchor_weight(self) -> Tensor:
        return self.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Tensor, cache: KVCache | None = None,
                layer_ids: Sequence[int] = (), *, kv_len: int | None = None,
                logits_index: Tensor | None = None, recheck: bool = True) -> tuple[Tensor, Tensor | None]:
        """Logits [B, T, V] (fp32) and the captured layers' outputs concatenated, [B, T, len(layer_ids) * H]
        (layer i's output is transformers' hidden_states[i + 1]: the last layer's is after the final norm).

        input_ids, positions: [B, T]. With `cache`, K/V are written at `positions` (row b of the cache is
        batch row b) and query (b, t) sees cache slots 0..positions[b, t]; the caller must make each row's
        positions contiguous from its committed length so that no stale slot is visible. cache.lengths is
        left alone. `kv_len` (optional) is max(positions) + 1, passed by callers that know it to avoid a
        device sync. `logits_index` [B] picks one position per row: logits are then [B, 1, V]. `recheck=False`
        lets the native layers skip checking the parameters against their packed copies when nothing about the
        call's cache changed since the last forward that checked them (a decode's verifies after its prefill:
        the check reads every parameter's storage and version, a tenth of a one-token decode step).
        Without a cache, token t' is visible to t when positions[b, t'] <= positions[b, t].
        """
        if input_ids.dim() != 2 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} "
                             "must both be [B, T]")
        n_layers = self.config.num_hidden_layers
        bad = [i for i in layer_ids if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"layer_ids {list(layer_ids)} contain {bad}; expected indices in [0, {n_layers})")
        B = input_ids.shape[0]
        if self.inv_freq.dtype != torch.float32 or self.inv_freq.device != self.device:
            self.reset_rope()  # module.to(dtype) casts buffers too; RoPE frequencies must stay fp32
        if positions.device != self.inv_freq.device:
            positions = positions.to(self.inv_freq.device)
        if cache is not None:
            cache.check_compatible(B, self.dtype)
            kv_len = int(positions.max()) + 1 if kv_len is None else kv_len
            if kv_len > cache.max_len:
                raise ValueError(f"position {kv_len - 1} is past the KV cache's max_len {cache.max_len}")
        if cache is not None and logits_index is None:
            out = self._host_forward(input_ids, positions, cache, layer_ids, kv_len, recheck)
            if out is not None:
                return out
        h = self.embed_tokens(input_ids)
        cos, sin = self._rope(positions, self.inv_freq, h.dtype)
        if host_qwen3.usable(self, h, cache):
            h, features = self._host_layers(h, positions, cos, sin, cache, layer_ids, recheck)
        else:
            G = self.config.num_kv_groups
            key_pos = positions if cache is None else torch.arange(kv_len, device=positions.device).expand(B, kv_len)
            # One boolean mask for all layers; rows are (group, query) pairs to match the GQA reshape.
            q_pos = positions.repeat(1, G)
            mask = (key_pos[:, None, :] <= q_pos[:, :, None]).unsqueeze(1)
            wanted = {i: None for i in layer_ids}
            for i, layer in enumerate(self.layers):
                h = layer(h, cos, sin, mask, positions, cache, i, kv_len)
                if i in wanted:
                    wanted[i] = h
            h = self.norm(h)
            # Features are transformers' hidden_states[i + 1], whose last entry is taken after the final norm.
            if n_layers - 1 in wanted:
                wanted[n_layers - 1] = h
            features = torch.cat([wanted[i] for i in layer_ids], dim=-1) if layer_ids else None
        if logits_index is not None:
            h = h[torch.arange(B, device=h.device), logits_index.to(h.device)].unsqueeze(1)
        return self.lm_head(h).float(), features

    def _native_ends(self, cache: KVCache, rope_len: int) -> tuple | None:
        """HostQwen3.run_tokens's ends (embedding, RoPE tables with rows for positions below rope_len, final norm and
        eps, packed output head); None where the whole native forward does not apply."""
        emb, norm, head = self.embed_tokens.weight, self.norm.weight, self.lm_head
        if not (host_qwen3.usable(self, emb, cache) and isinstance(head, HostLinear) and head._native(emb)
                and emb.is_contiguous() and norm.dtype == torch.float32 and norm.is_contiguous()):
            return None
        if self._host is None:
            self._host = host_qwen3.HostQwen3()
        cos, sin = self._rope.table(rope_len - 1, self.inv_freq, torch.float32)
        return emb, cos, sin, norm, self.norm.eps, head.packed()

    def _host_forward(self, input_ids: Tensor, positions: Tensor, cache: KVCache, layer_ids: Sequence[int],
                      kv_len: int, recheck: bool) -> tuple[Tensor, Tensor | None] | None:
        """The whole forward in one core call (HostQwen3.run_tokens: embedding, RoPE rows, layers, final norm, output
        head), with the bits of the steps taken one by one; None where it does not apply (then forward takes them)."""
        if input_ids.device.type != "cpu" or positions.dtype != torch.long:
            return None
        ends = self._native_ends(cache, kv_len)
        if ends is None:
            return None
        B, T = input_ids.shape
        H = self.config.hidden_size
        features, capture = _feature_columns(layer_ids, B * T, H, torch.float32)
        logits = torch.empty(B, T, self.lm_head.weight.shape[0])
        self._host.run_tokens(self.layers, self.config, ends, input_ids.contiguous(), positions.contiguous(), cache,
                              capture, features, logits, recheck)
        _copy_repeated_layers(features, layer_ids, capture, H)
        return logits, (features.view(B, T, -1) if features is not None else None)

    def verify_plan(self, cache: KVCache, layer_ids: Sequence[int]) -> host_qwen3.VerifyPlan | None:
        """The verifies of a decode over `cache` as one core call each (Target.verify_argmax), bound once right after
        the forward that checked the layers (its prefill); None where the native forward does not apply, or where a
        layer is listed twice (its copy is the Python path's)."""
        if len(set(layer_ids)) != len(layer_ids):
            return None
        ends = self._native_ends(cache, cache.max_len)
        if ends is None:
            return None
        H = self.config.hidden_size
        _, capture = _feature_columns(layer_ids, 0, H, torch.float32)
        return self._host.verify_plan(self.layers, self.config, ends, cache, capture, len(layer_ids) * H,
                                      self.lm_head.weight.shape[0])

    def _host_layers(self, h: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, cache: KVCache,
                     layer_ids: Sequence[int], recheck: bool = True) -> tuple[Tensor, Tensor | None]:
        """The decoder layers in one native call (host/qwen3.py) and the final norm: (h, features), the
        captured layers written into the features by the core (the last one after the norm, as forward's)."""
        if self._host is None:
            self._host = host_qwen3.HostQwen3()
        B, T, H = h.shape
        flat = h.reshape(B * T, H).contiguous()
        positions = positions.to(torch.long).contiguous()
        cos, sin = cos.reshape(B * T, -1).contiguous(), sin.reshape(B * T, -1).contiguous()
        last = len(self.layers) - 1
        features, capture = _feature_columns(layer_ids, B * T, H, flat.dtype)
        self._host.run_all(self.layers, self.config, flat, positions, cos, sin, cache, capture, features, recheck)
        h = self._host.norm(self.norm, flat.view(B, T, H))
        if last in capture:  # the last layer's feature is taken after the final norm
            features[:, capture[last]:capture[last] + H] = h.view(B * T, H)
        _copy_repeated_layers(features, layer_ids, capture, H)
        return h, (features.view(B, T, -1) if features is not None else None)
