"""The target's verify as a step of static shapes, captured as a CUDA graph per shape and replayed.

A verify launches a few kernels per layer (about 2,300 at Qwen3-8B's depth): on a GPU at small batch the host's
launches take longer than the device's work. A graph replays them in one launch, but only a forward whose shapes
and buffers do not change between calls can be captured. Here each (batch, T, window) gets such a step:

- the block's tokens go into a persistent input buffer;
- positions come from the committed lengths held in device memory (``dev_lengths``, uploaded after every commit
  without the host waiting), not from a host-built tensor;
- attention reads a window of the KV cache rounded up to ``WINDOW`` slots: a query sees the slots up to its own
  position and the causal mask hides the rest, so a longer window gives the same tokens; a decode's window grows
  a granule at a time, so it captures a graph per granule it reaches;
- the arg-max and the logits' finiteness are computed inside the step and packed with the verified tokens into one
  tensor: the host reads the round's greedy result, and a draft that the drafter left on the device, in one copy.

``mode``: "graphs" captures on CUDA (the first call of a shape warms up, captures and replays); "static" runs the
same step eagerly over the same buffers, on any device (debugging, and the CPU tests of this path). Captured
graphs share one memory pool: a replay may reuse another shape's outputs' memory, which holds because every
verify's outputs are read (staged, sampled, arg-maxed) before the next verify replays.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from dpara_rt import ops
from dpara_rt.models.kv_cache import WINDOW, KVCache  # WINDOW: a decode captures one graph per granule it reaches

STATIC_MODES = ("graphs", "static")


@dataclass
class _Step:
    tokens: Tensor                    # [B, T] long, the persistent input
    logits: Tensor | None = None      # [B, T, V] float32
    features: Tensor | None = None    # [B, T, F]
    packed: Tensor | None = None      # [B * T + 1] long: the arg-max, then 1 if every logit is finite
    graph: object = None              # torch.cuda.CUDAGraph once captured


class StaticVerify:
    """Verify steps of static shapes over one KV cache (a new cache needs a new StaticVerify: graphs hold its
    storage)."""

    def __init__(self, model, cache: KVCache, layer_ids: Sequence[int], mode: str):
        if mode not in STATIC_MODES:
            raise ValueError(f"static verify mode {mode!r}; expected one of {STATIC_MODES}")
        self.model, self.cache, self.layer_ids = model, cache, list(layer_ids)
        self.device = cache.k.device
        self.capture = mode == "graphs" and self.device.type == "cuda"
        with torch.inference_mode(False):  # updated in place by lanes under no_grad
            self.dev_lengths = torch.zeros(cache.batch, dtype=torch.long, device=self.device)
            self._offsets = torch.arange(64, dtype=torch.long, device=self.device)  # 0..T-1 of any block (T <= 33)
        self._steps: dict[tuple[int, int, int], _Step] = {}
        self._pool = None

    def lengths_changed(self) -> None:
        """The host's committed lengths -> dev_lengths, ordered on the current stream without the host waiting
        (after every start, commit, grow or row prefill)."""
        self.dev_lengths.copy_(ops.upload(self.cache.lengths, self.device), non_blocking=True)

    def window(self, longest: int, T: int) -> int:
        """The attention window for a verify of T tokens whose longest row holds `longest` committed tokens."""
        need = longest + T
        return min(-(-need // WINDOW) * WINDOW, self.cache.max_len)

    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        """(batch, T, window) of each step built so far."""
        return sorted(self._steps)

    @torch.no_grad()
    def run(self, tokens: Tensor, longest: int) -> tuple[Tensor, Tensor | None, Tensor]:
        """Verify tokens [B, T] (long, on the host or the device) at each row's committed length. Returns (logits
        [B, T, V] float32, features [B, T, F] or None, packed [2*B*T + 1] long on the device: pack_verified's tokens,
        arg-max and finiteness flag); the outputs are the step's own buffers, valid until the next run."""
        B, T = tokens.shape
        key = (B, T, self.window(longest, T))
        step = self._steps.get(key)
        if step is None:
            with torch.inference_mode(False):
                step = _Step(torch.zeros(B, T, dtype=torch.long, device=self.device))
            self._steps[key] = step
        step.tokens.copy_(ops.upload(tokens, self.device), non_blocking=True)
        if step.graph is not None:
            step.graph.replay()
        elif self.capture:
            self._capture(step, key[2])
        else:
            step.logits, step.features, step.packed = self._forward(step.tokens, key[2])
        return step.logits, step.features, step.packed

    def _forward(self, tokens: Tensor, window: int) -> tuple[Tensor, Tensor | None, Tensor]:
        B, T = tokens.shape
        # clamped: a finished row the host has not read yet runs on past its room (its tokens are never read)
        positions = (self.dev_lengths[:B, None] + self._offsets[:T]).clamp_(max=self.cache.max_len - 1)
        logits, features = self.model(tokens, positions, self.cache, self.layer_ids, kv_len=window, recheck=False)
        return logits, features, pack_verified(logits, tokens)

    def _capture(self, step: _Step, window: int) -> None:
        """Warm up on a side stream (lazy allocations and autotuning stay out of the graph), capture, replay."""
        cuda = torch.cuda
        side = cuda.Stream(self.device)
        side.wait_stream(cuda.current_stream(self.device))
        with cuda.stream(side):
            self._forward(step.tokens, window)
        cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = cuda.graph_pool_handle()
        graph = cuda.CUDAGraph()
        # thread-local: the drafter lane's thread keeps launching on its own stream while this lane captures
        with cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            step.logits, step.features, step.packed = self._forward(step.tokens, window)
        step.graph = graph
        graph.replay()


def pack_verified(logits: Tensor, tokens: Tensor | None = None) -> Tensor:
    """One long tensor where the logits [B, T, V] are: the verified tokens [B, T] (if given), the arg-max [B, T], then
    1 if every logit is finite; the host reads a verify's results back in one copy."""
    lo, hi = torch.aminmax(logits)
    finite = (torch.isfinite(lo) & torch.isfinite(hi)).to(torch.long).reshape(1)
    parts = [] if tokens is None else [tokens.reshape(-1).to(torch.long)]
    return torch.cat([*parts, logits.argmax(-1).reshape(-1), finite])


def unpack_verified(packed: Tensor, B: int, T: int, tokens: bool, extra: int = 0
                    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(tokens [B, T] or None, arg-max [B, T] or None when a logit is not finite, the `extra` values put before
    pack_verified's [extra] or None), host long, from the tensor read back in one call (the host waits once)."""
    both = np.asarray(packed.tolist(), dtype=np.int64)
    n = B * T
    head, packed_part = both[:extra], both[extra:]
    block = torch.from_numpy(packed_part[:n].reshape(B, T)) if tokens else None
    argmax = torch.from_numpy(packed_part[-1 - n:-1].reshape(B, T)) if packed_part[-1] else None
    return block, argmax, (torch.from_numpy(head) if extra else None)


__all__ = ["STATIC_MODES", "StaticVerify", "WINDOW", "pack_verified", "unpack_verified"]
