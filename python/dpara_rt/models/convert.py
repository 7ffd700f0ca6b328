"""Published drafters mapped onto ours: DSpark (DeepSpec's Qwen3 DSpark model) and DFlash (z-lab's
``DFlashDraftModel``). Both are a Qwen3-layer backbone with K/V injection of fused target features, exactly
our backbone; they differ in where the drafts are read and in the head after the backbone:

- DSpark reads d rows starting at the anchor and adds a low-rank ("vanilla") Markov bias, as we do.
- DFlash reads the d mask rows after the anchor (``draft_rows = "mask"``) and has no Markov head (rank 0).

Both embed mask rows with the target's embedding of ``mask_token_id``. What has no counterpart is refused
with one line naming the field; a standalone confidence head is dropped with a warning.

:func:`export_dflash` goes the other way for a drafter of DFlash's convention (mask rows, a target-token mask,
no Markov head): a ``DFlashDraftModel`` checkpoint that DFlash's reference code and vLLM's ``dflash`` method
load, so engines can run the same drafter as a baseline.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from dpara_rt.jsonfile import read_json_object
from dpara_rt.models.drafter import DrafterConfig
from dpara_rt.models.qwen3 import ARCHITECTURE, Qwen3Config

KINDS = ("dspark", "dflash")
_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
          "self_attn.k_norm", "input_layernorm", "post_attention_layernorm")
_MLP = ("gate_proj", "up_proj", "down_proj")


class UnsupportedCheckpoint(ValueError):
    """A published checkpoint that uses something dpara_rt has no counterpart for."""


def _read_config(path) -> dict:
    file = Path(path) / "config.json"
    try:
        return read_json_object(file)
    except FileNotFoundError:
        raise ValueError(f"no drafter checkpoint at {path}: expected drafter_config.json (dpara_rt) or a "
                         "DSpark / DFlash config.json") from None


def source_format(path) -> str:
    """'dspark' or 'dflash' for a published drafter directory."""
    return _kind(_read_config(path), path)


def _kind(d: dict, path) -> str:
    archs = " ".join(d.get("architectures") or [])
    if "DSpark" in archs or "markov_rank" in d:
        return "dspark"
    if "DFlash" in archs or "dflash_config" in d:
        return "dflash"
    raise ValueError(f"{Path(path) / 'config.json'} is neither a DSpark nor a DFlash drafter config "
                     f"(architectures {d.get('architectures')!r}); expected a dpara_rt, DSpark or DFlash checkpoint")


def _refuse(field: str, value, why: str):
    raise UnsupportedCheckpoint(f"unsupported drafter field {field}={value!r}: {why}")


def _draft_field(d: dict, name: str, default=None):
    """DFlash keeps its own fields in ``dflash_config``, older exports at the top level."""
    return (d.get("dflash_config") or {}).get(name, d.get(name, default))


def _backbone(d: dict, kind: str) -> Qwen3Config:
    """The backbone's shape from a Qwen3-style config, refusing what our layer does not compute."""
    for field in ("layer_types",):
        kinds = set(d.get(field) or ["full_attention"])
        if kinds != {"full_attention"}:
            _refuse(field, sorted(kinds), "only full-attention drafter layers are supported (no sliding window)")
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        if d.get(field) or _draft_field(d, field):
            _refuse(field, d.get(field) or _draft_field(d, field), "logit soft-capping is not implemented")
    for field in ("input_embedding_scale", "output_multiplier"):
        if float(_draft_field(d, field, 1.0)) != 1.0:
            _refuse(field, _draft_field(d, field), "expected 1.0 (scaled embeddings or logits are not implemented)")
    if _draft_field(d, "is_causal"):
        _refuse("is_causal", _draft_field(d, "is_causal"), "the block attends bidirectionally in dpara_rt")
    try:
        return Qwen3Config.from_dict({**d, "model_type": "qwen3", "architectures": [ARCHITECTURE]})
    except ValueError as e:
        raise UnsupportedCheckpoint(f"{kind} drafter backbone: {e}") from None


def _dflash_default_layers(num_target_layers: int, k: int) -> list[int]:
    """DFlash's own default when a config omits target_layer_ids."""
    if k == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (k - 1)) for i in range(k)]


def source_config(path) -> tuple[str, DrafterConfig, dict]:
    """(kind, our config, the raw config.json) of a DSpark or DFlash directory."""
    d = _read_config(path)
    kind = _kind(d, path)
    c = _backbone(d, kind)
    if kind == "dspark":
        rank = int(d.get("markov_rank", 0))
        head = str(d.get("markov_head_type", "vanilla")).lower()
        if rank > 0 and head not in ("vanilla", "classical"):
            _refuse("markov_head_type", head, "only the vanilla low-rank Markov head (W1[prev] @ W2) has a counterpart")
        if d.get("enable_confidence_head") and d.get("confidence_head_with_markov"):
            _refuse("confidence_head_with_markov", True, "a confidence head fed by the Markov state has no counterpart")
        block, rows, layers, mask = int(d["block_size"]), "anchor", d.get("target_layer_ids"), d.get("mask_token_id")
    else:
        for field in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if _draft_field(d, field) is not None:
                _refuse(field, _draft_field(d, field), "DFlash2's convolutions and candidate selector are not "
                        "implemented")
        if "DFlash2" in " ".join(d.get("architectures") or []):
            _refuse("architectures", d["architectures"], "DFlash2 is not implemented")
        rank, rows, mask = 0, "mask", _draft_field(d, "mask_token_id")
        block = int(_draft_field(d, "block_size", 16)) - 1  # the anchor row drafts nothing
        layers = _draft_field(d, "target_layer_ids")
        if layers is None:
            layers = _dflash_default_layers(int(d["num_target_layers"]), c.num_hidden_layers)
    if layers is None or any(int(i) < 0 for i in layers):
        _refuse("target_layer_ids", layers, "expected decoder-layer indices >= 0 (-1, the embedding output, is "
                "not exported by dpara_rt targets)")
    if mask is None:
        _refuse("mask_token_id", None, "expected the target token whose embedding fills the mask rows")
    try:
        config = DrafterConfig(
            layer_ids=[int(i) for i in layers], target_hidden_size=c.hidden_size, hidden_size=c.hidden_size,
            num_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, intermediate_size=c.intermediate_size,
            rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, vocab_size=c.vocab_size, block_size=max(block, 1),
            markov_rank=rank, mask_token_id=int(mask), draft_rows=rows)
    except ValueError as e:
        raise UnsupportedCheckpoint(f"{kind} drafter config: {e}") from None
    return kind, config, d


def _our_name(name: str, kind: str) -> str | None:
    """Our tensor name for a published one; None for tensors we drop; KeyError for unknown ones."""
    if name in ("fc.weight", "norm.weight"):
        return name
    if name == "hidden_norm.weight":
        return "context_norm.weight"
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) >= 4 and name.endswith(".weight"):
        i, rest = parts[1], ".".join(parts[2:-1])
        if rest in _LAYER:
            return f"layers.{i}.{rest}.weight"
        if rest in tuple(f"mlp.{m}" for m in _MLP):
            return f"layers.{i}.{rest.removeprefix('mlp.')}.weight"
    if kind == "dspark":
        if name == "markov_head.markov_w1.weight":
            return "w1"
        if name == "markov_head.markov_w2.weight":
            return "w2"
        if name.startswith(("confidence_head.", "embed_tokens.", "lm_head.")):
            return None
    if name.endswith("rotary_emb.inv_freq"):
        return None
    raise KeyError(name)


def read_source(path, with_weights: bool = False):
    """(config, state in our names, the checkpoint's own embed_tokens/lm_head) of a DSpark or DFlash
    directory; only the config when ``with_weights`` is False."""
    kind, config, raw = source_config(path)
    if not with_weights:
        return config, None, {}
    from dpara_rt.models.loader import read_tensors, weight_files

    files = weight_files(Path(path))
    tensors = read_tensors(files, None, "cpu")
    state, own, dropped = {}, {}, []
    for name, t in tensors.items():
        try:
            ours = _our_name(name, kind)
        except KeyError:
            _refuse("tensor", name, f"no counterpart in a dpara_rt drafter (a {kind} checkpoint with extra modules)")
        if ours is None:
            if name.split(".")[0] in ("embed_tokens", "lm_head"):
                own[name.split(".")[0]] = t
            elif not name.endswith("inv_freq"):
                dropped.append(name)
            continue
        state[ours] = t.t().contiguous() if ours == "w2" else t  # DSpark's W2 is Linear(R, V): weight [V, R]
    if dropped:
        warnings.warn(f"{kind} checkpoint {path}: dropped its standalone confidence head ({', '.join(dropped)}); "
                      "dpara_rt verifies every drafted token", stacklevel=3)
    if config.markov_rank == 0:  # no head: empty factors keep the state dict shape-complete
        like = next(iter(tensors.values()))
        state["w1"], state["w2"] = like.new_zeros(config.vocab_size, 0), like.new_zeros(0, config.vocab_size)
    return config, state, own


def _published_name(ours: str) -> str:
    """DFlash's tensor name for one of ours (the inverse of _our_name for a DFlash checkpoint)."""
    if ours == "context_norm.weight":
        return "hidden_norm.weight"
    parts = ours.split(".")
    if parts[0] == "layers" and ".".join(parts[2:-1]) in _MLP:
        return f"layers.{parts[1]}.mlp.{'.'.join(parts[2:])}"
    return ours


def export_dflash(src, dst, num_target_layers: int) -> dict:
    """Write the drafter at ``src`` (dpara_rt format) as a DFlash checkpoint at ``dst`` (config.json +
    model.safetensors, DFlash's tensor names) for a target of ``num_target_layers`` decoder layers. Only DFlash's
    own convention exports exactly: draft_rows 'mask', a target-token mask row, no Markov head. Returns the
    config written."""
    from safetensors.torch import load_file, save_file

    from dpara_rt.models.drafter_io import WEIGHTS_NAME, read_drafter_config
    c = read_drafter_config(src)
    if c.draft_rows != "mask":
        _refuse("draft_rows", c.draft_rows, "a DFlash checkpoint drafts from the mask rows after the anchor; train a "
                "draft_rows 'mask' drafter (python -m dpara_rt.train.preset_smollm2 --dflash)")
    if c.markov_rank:
        _refuse("markov_rank", c.markov_rank, "DFlash has no Markov head; expected 0 (exporting would drop the head)")
    if c.mask_token_id is None:
        _refuse("mask_token_id", None, "DFlash embeds its mask rows as a target token; expected a token id")
    if not 0 < num_target_layers or max(c.layer_ids) >= num_target_layers:
        raise ValueError(f"num_target_layers={num_target_layers}: expected more than the drafter's largest feature "
                         f"layer {max(c.layer_ids)}")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError(f"export destination {dst} is the source directory; expected a new directory")
    state = load_file(os.path.join(src, WEIGHTS_NAME))
    tensors = {_published_name(n): t.contiguous() for n, t in state.items() if n not in ("w1", "w2")}
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"}, "vocab_size": c.vocab_size,
        "max_position_embeddings": 32768, "attention_bias": False, "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * c.num_layers, "target_hidden_size": c.target_hidden_size,
        "torch_dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch."),
        "block_size": c.block_size + 1, "num_target_layers": int(num_target_layers),
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.layer_ids)},
    }
    Path(dst).mkdir(parents=True, exist_ok=True)
    (Path(dst) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return config


def convert(kind: str, src, dst) -> DrafterConfig:
    """Rewrite a published ``kind`` ('dspark' or 'dflash') drafter at ``src`` as a dpara_rt drafter at ``dst``."""
    if kind not in KINDS:
        raise ValueError(f"convert kind {kind!r}; expected one of {KINDS}")
    found = source_format(src)
    if found != kind:
        raise ValueError(f"{src} holds a {found} drafter, not a {kind} one; run `dpara-rt convert {found} ...`")
    config, state, _ = read_source(src, with_weights=True)
    from dpara_rt.models.drafter_io import write_drafter
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError(f"convert destination {dst} is the source directory; expected a new directory")
    write_drafter(config, state, dst)
    return config


__all__ = ["KINDS", "UnsupportedCheckpoint", "convert", "export_dflash", "read_source", "source_config",
           "source_format"]
