"""The one set of rules for the fields of a model's config.json (and generation_config.json) that dpara_rt reads.

Every loader (``loader.load_qwen3`` through ``Qwen3Config.from_json``, ``hf_target.load_target``,
``serving.text.model_eos_ids``, ``loader.generation_eos``, the CLI's ``info``) checks a file's fields here before
it uses one, so a wrong type or an impossible value ends in one line naming the field and the file:
``config.json in DIR: hidden_size = '64' (str); expected a positive int``.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, NamedTuple

__all__ = ["ConfigError", "check_config", "check_eos", "check_value", "describe"]


class ConfigError(ValueError):
    """A config field of the wrong type or an impossible value; the message names the field and the file."""


class _Rule(NamedTuple):
    ok: Callable[[object], bool]
    expected: str


def _positive_int(v) -> bool:
    return type(v) is int and v > 0


def _positive_number(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and v > 0


def _token_ids(v) -> bool:
    ids = v if type(v) is list else [v]
    return all(type(t) is int and t >= 0 for t in ids)


POSITIVE_INT = _Rule(_positive_int, "a positive int")
POSITIVE_NUMBER = _Rule(_positive_number, "a finite number > 0")
BOOL = _Rule(lambda v: type(v) is bool, "true or false")
STRING = _Rule(lambda v: type(v) is str, "a string")
STRINGS = _Rule(lambda v: type(v) is list and all(type(s) is str for s in v), "a list of strings")
OBJECT = _Rule(lambda v: type(v) is dict, "an object")
TOKEN_IDS = _Rule(_token_ids, "a token id (an int >= 0) or a list of them")

# field: (rule, whether null stands for "absent": the loaders take their default then)
FIELDS: dict[str, tuple[_Rule, bool]] = {
    **dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
                    (POSITIVE_INT, False)),
    **dict.fromkeys(("num_key_value_heads", "head_dim", "moe_intermediate_size", "max_position_embeddings",
                     "sliding_window"), (POSITIVE_INT, True)),
    **dict.fromkeys(("rms_norm_eps", "layer_norm_eps", "rope_theta", "partial_rotary_factor"), (POSITIVE_NUMBER, True)),
    **dict.fromkeys(("tie_word_embeddings", "attention_bias", "use_sliding_window", "mlp_bias"), (BOOL, True)),
    **dict.fromkeys(("hidden_act", "dtype", "torch_dtype"), (STRING, True)),
    **dict.fromkeys(("rope_parameters", "rope_scaling", "text_config"), (OBJECT, True)),
    "eos_token_id": (TOKEN_IDS, True),
    "model_type": (STRING, False),
    "architectures": (STRINGS, True),
}
ROPE_FIELDS: dict[str, tuple[_Rule, bool]] = {
    "rope_theta": (POSITIVE_NUMBER, True),
    "rope_type": (STRING, True),
    "type": (STRING, True),
    "factor": (POSITIVE_NUMBER, True),
    "low_freq_factor": (POSITIVE_NUMBER, True),
    "high_freq_factor": (POSITIVE_NUMBER, True),
    "original_max_position_embeddings": (POSITIVE_INT, True),
}


def describe(path) -> str:
    """How a message names a file: "config.json in DIR"."""
    p = Path(path)
    return f"{p.name} in {p.parent}"


def check_value(source: str, name: str, value, rule: _Rule, nullable: bool = False) -> None:
    """ConfigError unless `value` follows `rule` (or is None where `nullable`)."""
    if (value is None and nullable) or rule.ok(value):
        return
    raise ConfigError(f"{source}: {name} = {value!r:.80} ({type(value).__name__}); expected {rule.expected}"
                      f"{' or null' if nullable else ''}")


def _check_fields(d: dict, source: str, prefix: str, inner: dict) -> None:
    for name, (rule, nullable) in FIELDS.items():
        if name in d and name != "text_config":  # a null that text_config fills is a multimodal config's way
            check_value(source, prefix + name, d[name], rule, nullable or name in inner)
    for rope in ("rope_parameters", "rope_scaling"):
        if isinstance(d.get(rope), dict):
            for name, (rule, nullable) in ROPE_FIELDS.items():
                if name in d[rope]:
                    check_value(source, f"{prefix}{rope}.{name}", d[rope][name], rule, nullable)
    heads, kv = d.get("num_attention_heads"), d.get("num_key_value_heads")
    if heads is not None and kv is not None and heads % kv:
        raise ConfigError(f"{source}: {prefix}num_attention_heads = {heads} is not a multiple of "
                          f"{prefix}num_key_value_heads = {kv}; expected query heads in whole groups")


def check_config(d: dict, path=None) -> dict:
    """`d` (config.json read from `path`, or a dict given as such) with every field dpara_rt reads checked,
    text_config's too; returns d."""
    source = describe(path) if path is not None else "config"
    if not isinstance(d, dict):
        raise ConfigError(f"{source} holds a JSON {type(d).__name__}; expected an object")
    text = d.get("text_config")
    check_value(source, "text_config", text, OBJECT, True)
    _check_fields(d, source, "", text or {})
    if text is not None:
        _check_fields(text, source, "text_config.", {})
    return d


def check_eos(d: dict, path, name: str = "eos_token_id") -> list[int]:
    """The eos_token_id of a config or generation config dict read from `path`, checked, as a list (`name`: how
    the message names the field)."""
    eos = d.get("eos_token_id")
    check_value(describe(path), name, eos, TOKEN_IDS, True)
    return [] if eos is None else [eos] if type(eos) is int else list(eos)
