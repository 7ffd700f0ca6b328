"""Any transformers causal LM as the target: Llama, Qwen2, Mistral, Qwen3-MoE, ... through `AutoModelForCausalLM`.

``HFCausalLM`` wraps a transformers model and exposes what the rest of dpara_rt reads from a target model (a
config with the fields the drafter and the engine use, dtype, device, the shared ``embed_tokens`` / ``lm_head``).
``HFTarget`` has the interface and the semantics of ``Target``: ragged prefill, verify of T tokens per row at
positions lengths[b].., commit that keeps a prefix of the verified block and rolls the rest back by cropping the
transformers cache. Features are transformers' ``hidden_states[i + 1]`` for each layer id i (the last layer's is
after the final norm), as the native model computes them.

Rows have ragged lengths, so each row owns a ``DynamicCache`` and the rows of a batch run one after another
(batch 1 is the main case; a batched path would need per-row cache cropping).

``load_target`` picks the native decoder (the fast path) for Qwen3, Llama, Qwen2 and Mistral checkpoints whose
every field it implements, and this adapter for the others; it reads a GGUF file too (models/gguf.py).
``make_target`` builds the matching speculation-facing target.
"""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from dpara_rt.jsonfile import read_json_object
from dpara_rt.models.config_check import check_config
from dpara_rt.models.decoder_config import DecoderShape
from dpara_rt.models.loader import CheckpointError, generation_eos, load_qwen3, resolve_device, resolve_dtype
from dpara_rt.models.gguf import gguf_to_dir, is_gguf
from dpara_rt.models.qwen3 import NATIVE_MODEL_TYPES, Qwen3Config, WeightPlaced
from dpara_rt.models.target import Target, TargetBase

DEFAULT_MAX_POSITIONS = 4096  # when a config names no max_position_embeddings


@dataclass
class HFTargetConfig(DecoderShape):
    """A transformers config's fields that dpara_rt reads (any model_type: from_hf sets it)."""

    @classmethod
    def from_hf(cls, config, vocab_size: int, extra_eos: Sequence[int] = ()) -> "HFTargetConfig":
        """From a transformers PretrainedConfig (its text config for multimodal models); `vocab_size` is the
        width of the model's logits, `extra_eos` the generation config's stop ids."""
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads")
                   if not isinstance(getattr(c, k, None), int)]
        if missing:
            raise ValueError(f"transformers config {type(c).__name__} lacks integer {missing}; expected a decoder-only "
                             "causal LM config")
        heads = c.num_attention_heads
        rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        theta = theta or getattr(c, "rope_theta", None) or 10000.0
        inter = (getattr(c, "intermediate_size", None) or getattr(c, "moe_intermediate_size", None)
                 or 4 * c.hidden_size)
        eos = [*_ids(c.eos_token_id if hasattr(c, "eos_token_id") else None), *extra_eos]
        return cls(model_type=str(getattr(c, "model_type", "")), vocab_size=int(vocab_size),
                   hidden_size=c.hidden_size, intermediate_size=int(inter), num_hidden_layers=c.num_hidden_layers,
                   num_attention_heads=heads, num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                   rms_norm_eps=float(getattr(c, "rms_norm_eps", None) or getattr(c, "layer_norm_eps", None) or 1e-6),
                   rope_theta=float(theta),
                   max_position_embeddings=getattr(c, "max_position_embeddings", None) or DEFAULT_MAX_POSITIONS,
                   tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
                   eos_token_id=sorted({int(e) for e in eos if 0 <= int(e) < vocab_size}))


def _ids(value) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


class HFCausalLM(WeightPlaced, nn.Module):
    """A transformers causal LM seen as a dpara_rt target model. ``hf`` is the wrapped model."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        for name in ("get_input_embeddings", "get_output_embeddings"):
            if not callable(getattr(hf_model, name, None)):
                raise ValueError(f"{type(hf_model).__name__} has no {name}(); expected a transformers "
                                 "AutoModelForCausalLM model")
        self.hf = hf_model
        embed, head = hf_model.get_input_embeddings(), hf_model.get_output_embeddings()
        if not isinstance(embed, nn.Embedding):
            raise ValueError(f"{type(hf_model).__name__}'s input embeddings are a {type(embed).__name__}; expected "
                             "an nn.Embedding (shared with the drafter)")
        if not isinstance(head, nn.Linear):
            raise ValueError(f"{type(hf_model).__name__}'s output embeddings are a {type(head).__name__}; expected "
                             "an nn.Linear lm_head (shared with the drafter)")
        gen = getattr(hf_model, "generation_config", None)
        self.config = HFTargetConfig.from_hf(hf_model.config, head.out_features,
                                             _ids(getattr(gen, "eos_token_id", None)))
        params = inspect.signature(hf_model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5 renamed it
        self._keep_kw = "logits_to_keep" if "logits_to_keep" in params else None

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.hf.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        """The output projection; with tied embeddings its weight is the embedding's."""
        return self.hf.get_output_embeddings()

    @property
    def anchor_weight(self) -> Tensor:
        return self.embed_tokens.weight

    def new_cache(self):
        """An empty cache for one row, able to roll back (sliding-window layers keep what a rollback needs)."""
        from transformers import DynamicCache
        try:
            cache = DynamicCache(config=self.hf.config)
        except TypeError:  # older transformers: no per-layer types
            cache = DynamicCache()
        for layer in getattr(cache, "layers", ()):
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()
        return cache

    def forward(self, input_ids: Tensor, position_ids: Tensor, cache, layer_ids: Sequence[int] = (),
                logits_to_keep: int = 0) -> tuple[Tensor, Tensor | None]:
        """Logits [B, T', V] fp32 (T' = logits_to_keep last positions, or all when 0) and the features
        [B, T, len(layer_ids) * H] (None without layer ids). The new K/V are appended to `cache`."""
        kw = {self._cache_kw: cache}
        if self._keep_kw:
            kw[self._keep_kw] = logits_to_keep
        out = self.hf(input_ids=input_ids, position_ids=position_ids, use_cache=True,
                      output_hidden_states=bool(layer_ids), **kw)
        feats = None
        if layer_ids:
            hs = out.hidden_states
            feats = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
        logits = out.logits if self._keep_kw or not logits_to_keep else out.logits[:, -logits_to_keep:]
        return logits.float(), feats


class HFTarget(TargetBase):
    """``Target``'s interface over an ``HFCausalLM``: one transformers cache per row, cropped on rollback."""

    def __init__(self, model: HFCausalLM, max_batch: int, max_len: int, layer_ids: Sequence[int] = ()):
        for name, value in (("max_batch", max_batch), ("max_len", max_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"HFTarget {name} = {value!r}; expected a positive integer")
        self.layer_ids = self._layer_ids(layer_ids, model.config.num_hidden_layers)
        self.model = model
        self._max_batch, self._max_len = max_batch, max_len
        self.caches: list = []
        self._lengths = torch.zeros(max_batch, dtype=torch.long)  # committed tokens per row (host side)
        self.batch = 0
        self._last_t = 0

    @property
    def max_len(self) -> int:
        return self._max_len

    @property
    def max_batch(self) -> int:
        return self._max_batch

    def reserve(self, max_len: int) -> None:
        """Allow `max_len` tokens per row (the caches grow as needed; what they hold is kept)."""
        self._max_len = max(self._max_len, int(max_len))

    @property
    def lengths(self) -> Tensor:
        return self._lengths[: self.batch].clone()

    @torch.no_grad()
    def start(self, prompts: list[list[int]]) -> tuple[Tensor, Tensor, Tensor]:
        """Prefill and commit ragged prompts (checked by check_prompts). Returns (last_logits [B, V],
        features [B, Tmax, F], prompt_lens [B]); features past a prompt's end are zeros."""
        lens = [len(p) for p in prompts]
        B, Tmax = len(prompts), max(lens)
        dev = self.device
        self.batch, self._last_t, self.caches = 0, 0, []
        logits = []
        feats = torch.zeros(B, Tmax, self.feature_dim, dtype=self.dtype, device=dev)
        for b, p in enumerate(prompts):
            cache, z, f = self._prefill(p)
            self.caches.append(cache)
            logits.append(z)
            feats[b, : len(p)] = f
        prompt_lens = torch.tensor(lens, dtype=torch.long)
        self._lengths.zero_()
        self._lengths[:B] = prompt_lens
        self.batch = B
        return self._finite_prefill(torch.stack(logits), range(B)), feats, prompt_lens

    def _prefill(self, p: list[int]) -> tuple[object, Tensor, Tensor]:
        """A new cache holding prompt p: (cache, last logits [V], features [T, F])."""
        dev = self.device
        cache = self.model.new_cache()
        ids = torch.as_tensor(p, dtype=torch.long, device=dev)[None]
        z, f = self.model(ids, torch.arange(len(p), device=dev)[None], cache, self.layer_ids, logits_to_keep=1)
        cache.crop(0)  # sliding-window layers drop what no later query can see
        return cache, z[0, -1], (f[0] if f is not None else self._no_features(1, len(p))[0])

    def grow(self, batch: int) -> None:
        """Continuous batching, between rounds: `batch` rows in use from now on; the new ones are empty."""
        self._check_grow(batch)
        self.caches += [self.model.new_cache() for _ in range(batch - self.batch)]
        self._lengths[self.batch:batch] = 0
        self.batch = batch

    @torch.no_grad()
    def prefill_row(self, b: int, prompt: list[int]) -> tuple[Tensor, Tensor]:
        """Continuous batching, between rounds: row b takes a new request (last logits [V], features [T, F])."""
        self._check_row(b, prompt)
        self.caches[b], logits, feats = self._prefill(prompt)
        self._lengths[b] = len(prompt)
        return self._finite_prefill(logits, [b]), feats

    @torch.no_grad()
    def verify(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Run tokens [B, T] of each row at positions lengths[b]..lengths[b]+T-1 (lengths unchanged).
        Returns (logits [B, T, V] fp32, features [B, T, F])."""
        tokens = self._check_verify(tokens, self._lengths[: self.batch])
        B, T = tokens.shape
        if self._last_t:  # a verify not committed yet: it is replaced, as the native target overwrites it
            self._rollback(torch.zeros(B, dtype=torch.long))
        dev = self.device
        tokens = tokens.to(dev)
        logits, feats = [], []
        for b in range(B):
            pos = (int(self._lengths[b]) + torch.arange(T, device=dev))[None]
            z, f = self.model(tokens[b: b + 1], pos, self.caches[b], self.layer_ids)
            logits.append(z[0])
            feats.append(f[0] if f is not None else None)
        self._last_t = T
        feats = torch.stack(feats) if self.layer_ids else self._no_features(B, T)
        return torch.stack(logits), feats

    def commit(self, n: Tensor | np.ndarray):
        """Keep the first n[b] tokens of the last verify for row b (lengths += n); the rest is rolled back."""
        n = self._check_commit(n)
        self._rollback(n)
        self._lengths[: self.batch] += torch.from_numpy(n)
        self._last_t = 0

    def _rollback(self, keep: Tensor) -> None:
        """Crop each row's cache to its committed length + keep[b] (dropping the rest of the last verify)."""
        for b, cache in enumerate(self.caches[: self.batch]):
            extra = cache.get_seq_length() - int(self._lengths[b]) - int(keep[b])
            cache.crop(-extra)  # crop(-k) drops the last k tokens (crop(0) trims sliding-window layers)


def _read_config(root: Path) -> dict:
    if not root.is_dir():
        raise CheckpointError(f"checkpoint path {str(root)!r} is not a directory; expected a Hugging Face model "
                              "directory with config.json and weights")
    file = root / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{str(root)!r} has no config.json; expected a Hugging Face model directory")
    return read_json_object(file, "config file", CheckpointError)


def _checkpoint_dtype(d: dict) -> torch.dtype:
    """The checkpoint's stored dtype (config "dtype" or "torch_dtype"), float32 when absent or unsupported."""
    stored = d.get("dtype") or d.get("torch_dtype")
    try:
        return resolve_dtype(stored)
    except ValueError:
        return torch.float32


def load_target(path, device="cpu", dtype=None, native: bool = True):
    """A target model from a Hugging Face checkpoint directory or a GGUF file (read by transformers into a cached
    directory: gguf_to_dir): the native Qwen3ForCausalLM for a Qwen3, Llama, Qwen2 or Mistral checkpoint (the fast
    path), else an HFCausalLM over `AutoModelForCausalLM`. `dtype` None keeps the checkpoint's dtype (float32 when
    it names none). `native=False` loads those through transformers too; a config that the native model does not
    implement (a sliding window, YaRN RoPE, ...) also goes through transformers."""
    root = gguf_to_dir(path) if is_gguf(path) else Path(path)
    d = check_config(_read_config(root), root / "config.json")  # before either loader reads a field
    dtype = _checkpoint_dtype(d) if dtype is None else resolve_dtype(dtype)
    device = resolve_device(device)
    if native and d.get("model_type") in NATIVE_MODEL_TYPES:
        try:
            Qwen3Config.from_dict(d)
        except ValueError:
            pass  # a variant the native model does not implement: transformers runs it
        else:
            return load_qwen3(root, dtype=dtype, device=device)
    if "model_type" not in d:
        raise CheckpointError(f"config file {str(root / 'config.json')!r} has no model_type; expected a Hugging "
                              "Face causal LM config")
    from transformers import AutoModelForCausalLM
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(root), dtype=dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"transformers cannot load {str(root)!r} as a causal LM: {e}") from None
    hf = hf.to(device).eval().requires_grad_(False)
    model = HFCausalLM(hf)
    model.config.eos_token_id = sorted(set(model.config.eos_token_id) | {
        e for e in generation_eos(root / "generation_config.json") if 0 <= e < model.config.vocab_size})
    return model


def make_target(model, max_batch: int, max_len: int, layer_ids: Sequence[int] = (), verify_mode: str = "auto"):
    """The speculation-facing target for `model`: HFTarget for an HFCausalLM, Target for the native model (whose
    verify runs in `verify_mode`, Target's; a transformers model runs its own forward: "auto" or "eager")."""
    if isinstance(model, HFCausalLM):
        if verify_mode not in ("auto", "eager"):
            raise ValueError(f"verify_mode {verify_mode!r} needs the native model; {model.config.model_type!r} "
                             "runs through transformers (expected 'auto' or 'eager')")
        return HFTarget(model, max_batch, max_len, layer_ids)
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        raise ValueError(f"target is a bare transformers {type(model).__name__}; expected it wrapped as "
                         "HFCausalLM(model) (or loaded with dpara_rt.models.hf_target.load_target)")
    return Target(model, max_batch, max_len, layer_ids, verify_mode)


__all__ = ["HFCausalLM", "HFTarget", "HFTargetConfig", "load_target", "make_target"]
