"""Preallocated KV cache for speculation: per-request lengths, writes at arbitrary positions, rollback.

Slots at or past a request's length hold uncommitted K/V (a verify block, or prefill padding). They are
never read before being overwritten, because every forward writes a row's positions contiguously from
its length and a query only sees slots up to its own position. Rolling back is therefore just lowering
the length.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from dpara_rt import ops

WINDOW = 256  # attention window granule (KV slots) of a forward over lengths in device memory: few shapes a decode


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
    def host_lengths(self) -> np.ndarray:
        """lengths as a numpy array sharing their memory: checks and sums of a few host counts without torch ops
        (each a call a host-wait count takes for a device read). Made once per lengths tensor."""
        held = self.__dict__.get("_host_lengths")
        if held is None or held[0] is not self.lengths:
            held = self._host_lengths = (self.lengths, self.lengths.numpy())
        return held[1]

    def longest(self) -> int:
        """The longest row's length, read from host memory."""
        lengths = self.host_lengths
        return int(lengths.max()) if lengths.size else 0

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
        rows = self.row_index(B, T)
        # positions come uploaded (a verify's, ahead of its forward): no per-layer copy, nor a call naming the device
        pos = positions if positions.device == self.k.device else positions.to(self.k.device)
        # Advanced indices around a slice put the indexed dims first: target view is [B, T, heads, dim].
        self.k[layer][rows, :, pos] = k
        self.v[layer][rows, :, pos] = v

    def row_index(self, batch: int, t: int) -> Tensor:
        """Rows 0..batch-1 as an index [batch, t] on the cache's device, made once per shape: a forward writes
        every layer with the same one (a launch a layer otherwise)."""
        held = self.__dict__.get("_row_index")
        if held is None or held.shape != (batch, t) or held.device != self.k.device:
            with torch.inference_mode(False):  # usable outside inference mode too, as k and v are
                held = self._row_index = torch.arange(batch, device=self.k.device)[:, None].expand(batch, t)
        return held

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


class ContextCache(KVCache):
    """The drafter's per-layer K/V of the injected context: k, v [layers, B, kv_heads, max_len, head_dim]; lengths
    [B] (cpu). A decode whose host reads rounds late also keeps ``dev_lengths`` [B] on the cache's device
    (``track_on_device``): the drafter's context then grows there before the host knows by how much, and the
    host's lengths follow a round behind."""

    dev_lengths: Tensor | None = None

    def layers(self, n: int | None = None) -> list[tuple[Tensor, Tensor]]:
        """Every layer's K/V trimmed to the first n slots (default the longest row, the lengths read once)."""
        n = self.longest() if n is None else n
        return [(self.k[i, :, :, :n], self.v[i, :, :, :n]) for i in range(self.k.shape[0])]

    def track_on_device(self) -> None:
        """Keep dev_lengths from now on, starting from the host's lengths."""
        with torch.inference_mode(False):  # updated in place by lanes under no_grad
            self.dev_lengths = torch.zeros(self.batch, dtype=torch.long, device=self.k.device)
        self.lengths_changed()

    def lengths_changed(self) -> None:
        """The host's lengths -> dev_lengths (when kept), in the current stream's order, without the host waiting."""
        if self.dev_lengths is not None:
            self.dev_lengths.copy_(ops.upload(self.lengths, self.k.device), non_blocking=True)

    def window(self, ahead: int) -> int:
        """Slots a forward over dev_lengths attends to: the host's longest row plus `ahead` (what the device's
        lengths may run ahead of the host's), rounded up to WINDOW, at most max_len."""
        return min(-(-(self.longest() + ahead) // WINDOW) * WINDOW, self.max_len)


def host_counts(n) -> np.ndarray:
    """Per-row counts (a tensor, array or sequence) as int64 numpy [B]: host memory read in place, a device
    tensor copied back once."""
    if isinstance(n, Tensor):
        n = n.numpy() if n.device.type == "cpu" else n.cpu().numpy()
    return np.asarray(n, dtype=np.int64).reshape(-1)
