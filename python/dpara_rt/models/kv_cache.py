"""Preallocated KV cache for speculation: per-request lengths, writes at arbitrary positions, rollback.

Slots at or past a request's length hold uncommitted K/V (a verify block, or prefill padding). They are
never read before being overwritten, because every forward writes a row's positions contiguously from
its length and a query only sees slots up to its own position. Rolling back is therefore just lowering
the length.
"""
from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        for name, value in (("num_layers", num_layers), ("batch", batch), ("kv_heads", kv_heads),
                            ("max_len", max_len), ("head_dim", head_dim)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVCache {name} = {value!r}; expected a positive integer")
        shape = (num_layers, batch, kv_heads, max_len, head_dim)
        # Normal tensors even when made under a caller's inference mode: lanes update them in place under
        # no_grad, which inference tensors refuse.
        with torch.inference_mode(False):
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
            self.lengths = torch.zeros(batch, dtype=torch.long)  # committed tokens per request (host side)

    @classmethod
    def for_model(cls, config, batch: int, max_len: int, dtype: torch.dtype, device) -> "KVCache":
        return cls(config.num_hidden_layers, batch, config.num_key_value_heads, max_len,
                   config.head_dim, dtype, device)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    def check_compatible(self, batch: int, dtype: torch.dtype):
        if batch > self.batch:
            raise ValueError(f"batch of {batch} rows does not fit a KV cache of {self.batch} rows")
        if dtype != self.dtype:
            raise ValueError(f"model dtype {dtype} differs from KV cache dtype {self.dtype}")

    def write(self, layer: int, positions: Tensor, k: Tensor, v: Tensor):
        """Store k, v [B, T, kv_heads, head_dim] of rows 0..B-1 at slots positions [B, T]."""
        B, T = positions.shape
        rows = torch.arange(B, device=self.k.device)[:, None].expand(B, T)
        pos = positions.to(self.k.device)
        # Advanced indices around a slice put the indexed dims first: target view is [B, T, heads, dim].
        self.k[layer][rows, :, pos] = k
        self.v[layer][rows, :, pos] = v

    def window(self, layer: int, batch: int, kv_len: int) -> tuple[Tensor, Tensor]:
        """K, V views [batch, kv_heads, kv_len, head_dim] of the first kv_len slots."""
        return self.k[layer, :batch, :, :kv_len], self.v[layer, :batch, :, :kv_len]

    def rows(self, start: int, stop: int) -> "KVCache":
        """Rows start..stop-1 as a cache of their own, sharing this one's storage (lengths included)."""
        view = object.__new__(KVCache)
        view.k, view.v, view.lengths = self.k[:, start:stop], self.v[:, start:stop], self.lengths[start:stop]
        return view

    def reset(self):
        self.lengths.zero_()

    def crop(self, lengths: Tensor):
        """Roll rows back to `lengths` [batch] (each at most its current length)."""
        lengths = torch.as_tensor(lengths, dtype=torch.long).cpu()
        if lengths.shape != self.lengths.shape:
            raise ValueError(f"crop lengths shape {tuple(lengths.shape)}; expected {tuple(self.lengths.shape)}")
        bad = ((lengths < 0) | (lengths > self.lengths)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"crop to {lengths.tolist()} from {self.lengths.tolist()}: rows {bad} would grow "
                             "or go negative; crop only rolls back")
        self.lengths.copy_(lengths)
