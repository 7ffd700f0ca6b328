"""The config of the native decoder (models/qwen3.py): Qwen3 and the Llama family (Llama, Qwen2, Mistral).

They share one layer: RMSNorm before attention and MLP, grouped-query attention with RoPE, a SiLU-gated MLP. Three
switches tell them apart: RMSNorm on each query and key head (Qwen3), a bias on q, k and v (Qwen2), and the RoPE
frequencies (scaled by "linear" or "llama3" rules). A config the native model does not implement (sliding windows,
other RoPE types, more biases) is refused with one line naming the field; ``hf_target.load_target`` then runs the
checkpoint through transformers.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from dpara_rt.jsonfile import read_json_object
from dpara_rt.models.config_check import FIELDS, POSITIVE_NUMBER, check_config, check_value

MODEL_TYPE = "qwen3"
ARCHITECTURE = "Qwen3ForCausalLM"
# model_type -> (architecture, q / k norms, bias on q, k, v)
FAMILY = {
    "qwen3": ("Qwen3ForCausalLM", True, False),
    "llama": ("LlamaForCausalLM", False, False),
    "qwen2": ("Qwen2ForCausalLM", False, True),
    "mistral": ("MistralForCausalLM", False, False),
}
NATIVE_MODEL_TYPES = tuple(FAMILY)
ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_inv_freq(head_dim: int, theta: float) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def check_rope_scaling(scaling: dict | None) -> None:
    """ValueError naming the field unless `scaling` is None or a "linear" / "llama3" rule with its numbers."""
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling = {scaling!r}; expected None or a dict")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"config rope_type = {kind!r}; the native model supports {', '.join(map(repr, ROPE_TYPES))}")
    keys = {"linear": ("factor",), "llama3": _LLAMA3_KEYS}.get(kind, ())
    for key in keys:
        check_value("config", f"rope_scaling.{key}", scaling.get(key), POSITIVE_NUMBER)
    if kind == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError(f"config rope_scaling.high_freq_factor = {scaling['high_freq_factor']}; expected more than "
                         f"low_freq_factor = {scaling['low_freq_factor']}")


def scaled_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> Tensor:
    """The RoPE frequencies of transformers' ROPE_INIT_FUNCTIONS for "default", "linear" and "llama3" (whose
    attention factor is 1, so the frequencies are all they change)."""
    inv_freq = rope_inv_freq(head_dim, theta)
    check_rope_scaling(scaling)
    kind = "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _refuse_unsupported(d: dict, model_type: str) -> None:
    """ValueError naming the first field that asks for something the native layer does not compute."""
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config hidden_act = {d['hidden_act']!r}; the native model computes 'silu'")
    if model_type != "qwen2" and d.get("attention_bias", False):
        raise ValueError(f"config attention_bias = true; the native {model_type} has no attention biases")
    if d.get("mlp_bias", False):
        raise ValueError("config mlp_bias = true; the native model's MLP has no biases")
    if d.get("use_sliding_window", False):
        raise ValueError("config use_sliding_window = true; only full attention is supported")
    if model_type == "mistral" and d.get("sliding_window") is not None:
        raise ValueError(f"config sliding_window = {d['sliding_window']!r}; only full attention is supported "
                         "(expected null)")
    windowed = [t for t in d.get("layer_types") or () if t != "full_attention"]
    if windowed:
        raise ValueError(f"config layer_types contains {windowed[0]!r}; only 'full_attention' is supported")
    partial = d.get("partial_rotary_factor")
    if partial is not None and partial != 1:
        raise ValueError(f"config partial_rotary_factor = {partial!r}; the native model rotates whole heads (1.0)")


def _rope(d: dict) -> tuple[float, dict | None]:
    """(rope_theta, the scaling rule or None) of a config dict: transformers 5 nests both in rope_parameters, 4.x
    keeps rope_theta at the top beside rope_scaling."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = rope.get("rope_theta")
    theta = d.get("rope_theta", 10000.0) if theta is None else theta
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return float(theta), None
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = kind
    check_rope_scaling(scaling)
    return float(theta), scaling


@dataclass
class DecoderShape:
    """The fields of a decoder-only LM's config that dpara_rt reads (drafter shapes, the engine, checks)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    eos_token_id: list[int] = field(default_factory=list)
    model_type: str = MODEL_TYPE


@dataclass
class Qwen3Config(DecoderShape):
    """A native decoder's config (the name is Qwen3's, the model it began with; model_type says which family)."""
    qk_norm: bool = True  # RMSNorm on each query and key head (Qwen3)
    qkv_bias: bool = False  # a bias on q_proj, k_proj, v_proj (Qwen2)
    rope_scaling: dict | None = None  # a "linear" or "llama3" rule, with its numbers

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                     "tie_word_embeddings", "eos_token_id", "model_type"):
            check_value("Qwen3Config", name, getattr(self, name), FIELDS[name][0])
        for name in ("qk_norm", "qkv_bias"):
            check_value("Qwen3Config", name, getattr(self, name), FIELDS["tie_word_embeddings"][0])
        if self.model_type not in FAMILY:
            raise ValueError(f"Qwen3Config.model_type = {self.model_type!r}; expected one of "
                             f"{', '.join(map(repr, NATIVE_MODEL_TYPES))}")
        check_rope_scaling(self.rope_scaling)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Qwen3Config: num_attention_heads = {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads = {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"Qwen3Config.head_dim = {self.head_dim}; RoPE needs an even head_dim")
        bad = [e for e in self.eos_token_id if not 0 <= e < self.vocab_size]
        if bad:
            raise ValueError(f"Qwen3Config.eos_token_id contains {bad}; expected ids in [0, {self.vocab_size})")

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def inv_freq(self) -> Tensor:
        """The RoPE frequencies (float32, CPU), scaled as rope_scaling says."""
        return scaled_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)

    @classmethod
    def from_dict(cls, d: dict) -> "Qwen3Config":
        """Parse a Hugging Face config.json dict of a Qwen3, Llama, Qwen2 or Mistral model (transformers 4.x and 5.x
        spellings); a null field is an absent one. ValueError names the first field the native model does not
        implement."""
        check_config(d)
        d = {k: v for k, v in d.items() if v is not None}
        model_type = d.get("model_type", MODEL_TYPE)
        if model_type not in FAMILY:
            raise ValueError(f"config model_type = {model_type!r}; expected one of "
                             f"{', '.join(map(repr, NATIVE_MODEL_TYPES))}")
        arch, qk_norm, qkv_bias = FAMILY[model_type]
        archs = d.get("architectures") or [arch]
        if arch not in archs:
            raise ValueError(f"config architectures = {archs!r}; expected {[arch]!r}")
        _refuse_unsupported(d, model_type)
        theta, scaling = _rope(d)
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in d]
        if missing:
            raise ValueError(f"config lacks required keys {missing}")
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            max_position_embeddings=d.get("max_position_embeddings", 40960),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), eos_token_id=eos,
            model_type=model_type, qk_norm=qk_norm, qkv_bias=qkv_bias, rope_scaling=scaling)

    @classmethod
    def from_json(cls, path) -> "Qwen3Config":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist; expected a Hugging Face config.json")
        d = check_config(read_json_object(path, "config file"), path)
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def to_dict(self) -> dict:
        """A config.json that both transformers 4.x (rope_theta) and 5.x (rope_parameters) read."""
        d = asdict(self)
        for name in ("qk_norm", "qkv_bias", "rope_scaling"):
            d.pop(name)
        scaling = dict(self.rope_scaling or {})
        kind = scaling.pop("type", scaling.pop("rope_type", "default"))
        rope = {**scaling, "rope_type": kind, "rope_theta": self.rope_theta}
        d.update(architectures=[FAMILY[self.model_type][0]], hidden_act="silu", attention_bias=False,
                 use_sliding_window=False, rope_parameters=rope)
        if self.model_type == "mistral":
            d["sliding_window"] = None
        return d
