"""The speculation-facing target: ragged prefill, multi-token verify at ragged positions, commit/rollback.

``TargetBase`` holds what every target shares (argument checks, the commit bookkeeping's rules, the feature
width); ``Target`` runs the native model over a preallocated KV cache, ``dpara_rt.models.hf_target.HFTarget``
runs any transformers causal LM.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from dpara_rt import ops
from dpara_rt.models.kv_cache import KVCache
from dpara_rt.models.qwen3 import Qwen3ForCausalLM, WeightPlaced
from dpara_rt.models.static_verify import STATIC_MODES, StaticVerify, pack_verified, unpack_verified
from dpara_rt.host.native import all_finite, argmax_if_finite


def argmax_on_host(logits: Tensor) -> Tensor | None:
    """logits.argmax(-1) [B, T] on the host, or None when a logit is NaN or infinite: the arg-max and the finiteness
    flag computed where the logits are and read back in one call (the host waits once, not three times)."""
    B, T = logits.shape[:2]
    return unpack_verified(pack_verified(logits), B, T, tokens=False)[1]


Judge = Callable[[Tensor, Tensor], Tensor]  # (logits [B, T, V], block [B, T]) -> 1-D long, on the logits' device


class TargetBase(WeightPlaced):
    """The interface the engine and the methods use, with the checks every implementation shares.

    A subclass sets ``model`` (a WeightPlaced model with ``.config``), ``layer_ids``, ``batch`` (rows in use since
    the last start()) and ``_last_t`` (T of the last verify: the most a commit may keep), and provides max_len,
    max_batch, lengths, start, verify, commit and reserve."""

    model = None
    layer_ids: list[int]
    batch = 0
    _last_t = 0

    @staticmethod
    def _layer_ids(layer_ids: Sequence[int], n_layers: int) -> list[int]:
        bad = [i for i in layer_ids if not 0 <= int(i) < n_layers]
        if bad:
            raise ValueError(f"layer_ids {list(layer_ids)} contain {bad}; expected indices in [0, {n_layers})")
        return [int(i) for i in layer_ids]

    @property
    def config(self):
        return self.model.config

    @property
    def anchor_weight(self) -> Tensor:
        return self.model.anchor_weight

    @property
    def feature_dim(self) -> int:
        return len(self.layer_ids) * self.config.hidden_size

    def check_prompts(self, prompts: list[list[int]]) -> list[int]:
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"prompts = {prompts!r}; expected a non-empty list of token-id lists")
        if len(prompts) > self.max_batch:
            raise ValueError(f"{len(prompts)} prompts exceed this target's max_batch {self.max_batch}")
        V = self.config.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every request needs at least one token")
            if len(p) > self.max_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens, more than max_len {self.max_len}")
            bad = [t for t in p if not 0 <= t < V]
            if bad:
                raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {V})")
        return [len(p) for p in prompts]

    def verify_argmax(self, tokens: Tensor, features_out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """verify(tokens) and the arg-max of every position's logits: (logits [B, T, V], features [B, T, F], argmax
        [B, T] long on the host, or None when a logit is NaN or infinite). features_out (contiguous [B, T, F] of the
        features' dtype, host memory; optional): where the features go (a staging region), then returned as them."""
        logits, feats = self.verify(tokens)
        if features_out is not None:
            features_out.copy_(feats)
            feats = features_out
        if ops.backend(logits.device) == "host":
            return logits, feats, argmax_if_finite(logits)
        return logits, feats, argmax_on_host(logits)

    block_on_device = False  # whether verify_block takes a block built on the target's device (a static verify)

    def verify_block(self, block: Tensor, features_out: Tensor | None = None, judge: Judge | None = None
                     ) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor | None]:
        """verify_argmax(block), the block on the host (the round state reads it) and ``judge(logits, block)`` read
        back (None without a judge, or when a logit is not finite): block [B, T] long, on the host, or where the
        target computes when ``block_on_device``. judge: a device function of the logits [B, T, V] and the block
        [B, T] (on the logits' device) to a 1-D long tensor (a sampled round's verdicts)."""
        logits, feats, argmax = self.verify_argmax(block, features_out)
        judged = None
        if judge is not None and argmax is not None:
            judged = judge(logits, ops.upload(block, logits.device))
            judged = judged if judged.device.type == "cpu" else judged.cpu()
        return logits, feats, argmax, block, judged

    @staticmethod
    def _finite_prefill(logits: Tensor, rows: Sequence[int]) -> Tensor:
        """The prefill's last logits ([len(rows), V] or [V] for one row), checked: each request's first token is
        taken from them, greedy or sampled (an arg-max of NaNs is token 0, often an EOS: a silent empty answer)."""
        if all_finite(logits):
            return logits
        finite = torch.isfinite(logits.reshape(len(rows), -1)).all(-1).tolist()
        bad = [rows[i] for i, ok in enumerate(finite) if not ok]
        raise FloatingPointError(f"prefill: the target's last logits of prompt(s) {bad} hold non-finite values (NaN "
                                 "or inf); expected finite logits (a damaged model or an overflow in its dtype)")

    def _check_verify(self, tokens, lengths) -> Tensor:
        """Checked verify tokens [batch, T] (long); `lengths` are the rows' committed lengths (a host tensor or
        numpy array)."""
        if self.batch == 0:
            raise RuntimeError("verify before start(): no requests are loaded")
        tokens = torch.as_tensor(tokens)
        if tokens.dim() != 2 or tokens.shape[0] != self.batch or tokens.shape[1] == 0:
            raise ValueError(f"verify tokens shape {tuple(tokens.shape)}; expected [{self.batch}, T >= 1]")
        if tokens.dtype != torch.long:
            raise ValueError(f"verify tokens dtype {tokens.dtype}; expected torch.long token ids")
        T = tokens.shape[1]
        lengths = lengths if isinstance(lengths, np.ndarray) else lengths.numpy()
        if int(lengths.max()) + T > self.max_len:
            r = int(np.flatnonzero(lengths + T > self.max_len)[0])
            raise ValueError(f"row {r}: length {int(lengths[r])} + {T} verify tokens exceeds max_len {self.max_len}")
        return tokens

    def _check_commit(self, n) -> np.ndarray:
        """Checked commit counts [batch] (int64 numpy). numpy: these checks run every round, right after a verify
        evicted the caches, where each small torch op costs tens of us."""
        a = n if isinstance(n, np.ndarray) and n.dtype == np.int64 else \
            torch.as_tensor(n, dtype=torch.long).cpu().numpy()
        if a.shape != (self.batch,):
            raise ValueError(f"commit counts shape {a.shape}; expected ({self.batch},)")
        counts = a.tolist()  # a batch's few counts: Python's min and max, not numpy's reductions
        if counts and (min(counts) < 0 or max(counts) > self._last_t):
            bad = np.flatnonzero((a < 0) | (a > self._last_t)).tolist()
            raise ValueError(f"commit counts {a.tolist()}: rows {bad} outside [0, {self._last_t}] "
                             "(the T of the last verify not yet committed)")
        return a

    def _check_row(self, b: int, prompt: list[int]) -> None:
        """prefill_row's arguments: a row in use and one prompt that fits."""
        if not isinstance(b, int) or not 0 <= b < self.batch:
            raise ValueError(f"row {b!r}: expected a row in use, 0..{self.batch - 1}")
        self.check_prompts([prompt])
        if self._last_t:
            raise RuntimeError(f"prefill_row({b}) while a verify of {self._last_t} tokens awaits its commit")

    def _check_grow(self, batch: int) -> None:
        if not isinstance(batch, int) or not self.batch <= batch <= self.max_batch:
            raise ValueError(f"grow to {batch!r} rows: expected {self.batch}..{self.max_batch} (max_batch)")
        if self._last_t:
            raise RuntimeError(f"grow({batch}) while a verify of {self._last_t} tokens awaits its commit")

    def _no_features(self, B: int, T: int) -> Tensor:
        return torch.zeros(B, T, 0, dtype=self.dtype, device=self.device)


VERIFY_MODES = ("auto", "eager", *STATIC_MODES)


class Target(TargetBase):
    """The native model as a target. ``verify_mode``: "eager" (positions uploaded by the host, the window the longest
    row needs), "static" / "graphs" (models/static_verify.py: static shapes, positions from device lengths; "graphs"
    captures a CUDA graph per shape on a CUDA device) or "auto" (graphs on CUDA, eager elsewhere)."""

    def __init__(self, model: Qwen3ForCausalLM, max_batch: int, max_len: int, layer_ids: Sequence[int] = (),
                 verify_mode: str = "auto"):
        if verify_mode not in VERIFY_MODES:
            raise ValueError(f"verify_mode {verify_mode!r}; expected one of {VERIFY_MODES}")
        self.layer_ids = self._layer_ids(layer_ids, model.config.num_hidden_layers)
        self.model = model
        self.verify_mode = ("graphs" if model.device.type == "cuda" else "eager") if verify_mode == "auto" \
            else verify_mode
        self._new_cache(max_batch, max_len)
        self._last_t = 0        # T of the last verify: the most a commit may keep
        self._plan = None       # this decode's verify as one core call (verify_argmax), bound by start()

    def _new_cache(self, max_batch: int, max_len: int) -> None:
        self.cache = KVCache.for_model(self.config, max_batch, max_len, self.model.dtype, self.model.device)
        self._lengths = self.cache.lengths.numpy()  # the committed lengths as numpy, made once (commit runs each round)
        self.batch = 0          # rows in use since the last start()
        # this cache's static verify steps (their graphs hold its storage); None when eager
        self._static = (StaticVerify(self.model, self.cache, self.layer_ids, self.verify_mode)
                        if self.verify_mode in STATIC_MODES else None)

    def _lengths_changed(self) -> None:
        if self._static is not None:
            self._static.lengths_changed()

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    @property
    def max_batch(self) -> int:
        return self.cache.batch

    def reserve(self, max_len: int) -> None:
        """Grow the KV cache to hold `max_len` tokens per row (no-op when it already does)."""
        if max_len > self.cache.max_len:
            self._new_cache(self.max_batch, max_len)
            self._last_t, self._plan = 0, None

    @property
    def lengths(self) -> Tensor:
        return self.cache.lengths[: self.batch].clone()

    @torch.no_grad()
    def start(self, prompts: list[list[int]]) -> tuple[Tensor, Tensor, Tensor]:
        """Prefill and commit ragged prompts (checked by check_prompts). Returns (last_logits [B, V],
        features [B, Tmax, F], prompt_lens [B]); features past a prompt's end are zeros."""
        lens = [len(p) for p in prompts]
        B, Tmax = len(prompts), max(lens)
        ids = torch.zeros(B, Tmax, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : lens[i]] = torch.as_tensor(p, dtype=torch.long)
        prompt_lens = torch.tensor(lens, dtype=torch.long)
        # Padding sits at positions len..Tmax-1: written to the cache but past the committed length.
        positions = torch.arange(Tmax).expand(B, Tmax)
        dev = self.device
        logits, feats = self.model(ids.to(dev), positions.to(dev), self.cache, self.layer_ids, kv_len=Tmax,
                                   logits_index=(prompt_lens - 1).to(dev))
        self.batch, self._last_t = B, 0
        self.cache.reset()
        self.cache.lengths[:B] = prompt_lens
        self._lengths_changed()
        # bound after the prefill's forward, which checked the layers against their packed copies
        self._plan = self.model.verify_plan(self.cache, self.layer_ids)
        valid = (positions < prompt_lens[:, None]).to(dev)
        feats = self._features(feats, B, Tmax) * valid[..., None]
        return self._finite_prefill(logits[:, 0], range(B)), feats, prompt_lens

    def grow(self, batch: int) -> None:
        """Continuous batching, between rounds: `batch` rows in use from now on; the new ones are empty."""
        self._check_grow(batch)
        self.cache.lengths[self.batch:batch] = 0
        self.batch = batch
        self._lengths_changed()

    @torch.no_grad()
    def prefill_row(self, b: int, prompt: list[int]) -> tuple[Tensor, Tensor]:
        """Continuous batching, between rounds: row b takes a new request whose prompt is prefilled and
        committed. Returns (last logits [V], features [T, F])."""
        self._check_row(b, prompt)
        T, dev = len(prompt), self.device
        ids = torch.as_tensor(prompt, dtype=torch.long, device=dev)[None]
        logits, feats = self.model(ids, torch.arange(T, device=dev)[None], self.cache.rows(b, b + 1), self.layer_ids,
                                   kv_len=T, logits_index=torch.tensor([T - 1], device=dev))
        self.cache.lengths[b] = T
        self._lengths_changed()
        self._plan = self.model.verify_plan(self.cache, self.layer_ids)  # the layers as this forward checked them
        return self._finite_prefill(logits[0, 0], [b]), self._features(feats, 1, T)[0]

    @torch.no_grad()
    def verify(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Run tokens [B, T] of each row at positions lengths[b]..lengths[b]+T-1 (lengths unchanged).
        Returns (logits [B, T, V] fp32, features [B, T, F])."""
        tokens = self._check_verify(tokens, self._lengths[: self.batch])
        B, T = tokens.shape
        if self._static is not None:
            logits, feats, _ = self._static.run(tokens, int(self._lengths[:B].max()))
            self._last_t = T
            return logits, self._features(feats, B, T)
        # numpy for these [B] vectors: this runs every round, right after the last round evicted the caches
        lengths = self._lengths[:B]
        positions = ops.upload(torch.from_numpy(lengths[:, None] + np.arange(T)), self.device)
        # the parameters were checked against their packed copies by this decode's start(): not again per round
        logits, feats = self.model(ops.upload(tokens, self.device), positions, self.cache, self.layer_ids,
                                   kv_len=int(lengths.max()) + T, recheck=False)
        self._last_t = T
        return logits, self._features(feats, B, T)

    def verify_argmax(self, tokens: Tensor, features_out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """TargetBase.verify_argmax; with the decode's verify plan, one core call from token ids to the logits, the
        features (straight into features_out) and the arg-max, the positions taken from the committed lengths."""
        if self._static is not None:
            return self.verify_block(tokens, features_out)[:3]
        plan = self._plan
        if plan is None or not (isinstance(tokens, Tensor) and tokens.dtype == torch.long and tokens.dim() == 2
                                and tokens.is_contiguous() and tokens.device.type == "cpu"):
            return super().verify_argmax(tokens, features_out)
        B, T = tokens.shape
        if B != self.batch:
            raise ValueError(f"verify tokens shape {tuple(tokens.shape)}; expected [{self.batch}, T >= 1]")
        F = plan.features_width
        if features_out is None:
            features_out = torch.empty(B, T, F) if F else self._no_features(B, T)
        elif tuple(features_out.shape) != (B, T, F) or features_out.dtype != torch.float32 \
                or not features_out.is_contiguous():
            raise ValueError(f"features_out {tuple(features_out.shape)} {features_out.dtype}; expected a contiguous "
                             f"float32 [{B}, {T}, {F}]")
        logits, argmax = torch.empty(B, T, plan.vocab), torch.empty(B, T, dtype=torch.long)
        finite = plan.core.run(tokens.data_ptr(), B, T, features_out.data_ptr() if F else 0, logits.data_ptr(),
                               argmax.data_ptr())
        self._last_t = T
        return logits, features_out, (argmax if finite else None)

    @property
    def block_on_device(self) -> bool:
        return self._static is not None

    def verify_block(self, block: Tensor, features_out: Tensor | None = None, judge: Judge | None = None
                     ) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor | None]:
        """TargetBase.verify_block; a static verify reads the block back with the arg-max and the judge's verdicts, in
        one copy."""
        if self._static is None:
            return super().verify_block(block, features_out, judge)
        B, T = block.shape
        logits, feats, read, judged = self.verify_queued(block, features_out, judge)
        host_block, argmax, judged = unpack_verified(read, B, T, tokens=True, extra=0 if judged is None else
                                                     judged.numel())
        return logits, feats, argmax, host_block, judged if argmax is not None else None

    def verify_queued(self, block: Tensor, features_out: Tensor | None = None, judge: Judge | None = None,
                      ahead: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """The static verify with nothing read: (logits [B, T, V], features [B, T, F], what the host reads back: the
        judge's verdicts then pack_verified's [judged, block, arg-max, finite] long on the device, the verdicts or
        None). `ahead`: slots the device's lengths may run ahead of the host's (a round the host has not read)."""
        if self._static is None:
            raise RuntimeError(f"verify_queued on a target with verify_mode {self.verify_mode!r}; expected a static "
                               "verify ('static' or 'graphs')")
        block = self._check_verify(block, self._lengths[: self.batch])
        B, T = block.shape
        logits, feats, packed = self._static.run(block, int(self._lengths[:B].max()) + ahead)
        self._last_t = T
        feats = self._features(feats, B, T)
        if features_out is not None:
            features_out.copy_(feats)
            feats = features_out
        judged = None if judge is None else judge(logits, block)  # runs on any logits: its verdicts go unread then
        return logits, feats, packed if judged is None else torch.cat([judged, packed]), judged

    def commit(self, n: Tensor | np.ndarray):
        """Keep the first n[b] tokens of the last verify for row b (lengths += n); the rest is rolled back."""
        self.commit_host(n)
        self._lengths_changed()

    def commit_host(self, n: Tensor | np.ndarray):
        """commit() of the host's lengths alone: the device's were advanced by commit_on_device already."""
        n = self._check_commit(n)
        self._lengths[: self.batch] += n
        self._last_t = 0

    def commit_on_device(self, keep: Tensor) -> None:
        """A static verify's device lengths += keep [B] (long, on the device), in the target lane's order, before the
        host knows keep: the host's lengths follow with commit_host once it has read the round."""
        self._static.dev_lengths[: self.batch] += keep

    def _features(self, feats: Tensor | None, B: int, T: int) -> Tensor:
        if feats is None:
            return self._no_features(B, T)
        return feats
