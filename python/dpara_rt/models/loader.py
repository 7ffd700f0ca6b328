"""Load and save Qwen3 checkpoints in the Hugging Face layout (config.json + safetensors, single or sharded); Llama,
Qwen2 and Mistral checkpoints load the same way into the native decoder (models/decoder_config.py)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dpara_rt.models.config_check import check_eos
from dpara_rt.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
_FLOAT_STORAGE = {"F32", "F16", "BF16", "F64"}
# Buffers some older exports wrote; they are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file, tensor or value at fault."""


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"dtype {dtype!r} is not supported; expected one of float32, bfloat16, float16")


def resolve_device(device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a torch device: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} requested but CUDA is not available; use 'cpu'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r} is not supported; expected 'cpu' or 'cuda'")
    return device


def weight_files(root: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it (from the index when sharded)."""
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError(f"weight_map is a {type(weight_map).__name__}, not an object")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"index {str(index)!r} is not a safetensors index with a weight_map: {e!r}") from None
        files = {name: root / fname for name, fname in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise CheckpointError(f"shard {str(f)!r} listed in {INDEX_FILE} does not exist")
        return files
    found = sorted(root.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"no *.safetensors file in {str(root)!r}; expected {SINGLE_FILE} or a sharded set "
                              f"with {INDEX_FILE}")
    if len(found) > 1:
        raise CheckpointError(f"{len(found)} safetensors files in {str(root)!r} but no {INDEX_FILE} to say which "
                              f"tensor lives where: {[f.name for f in found]}")
    try:
        with safe_open(str(found[0]), "pt") as f:
            return {name: found[0] for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read safetensors file {str(found[0])!r}: {e}") from None


def read_tensors(files: dict[str, Path], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    out = {}
    for f, names in by_file.items():
        try:
            with safe_open(str(f), "pt") as handle:
                present = set(handle.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(f"tensor {name!r} is listed in {INDEX_FILE} but missing from {str(f)!r}")
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    stored = handle.get_slice(name).get_dtype()
                    if stored not in _FLOAT_STORAGE:
                        raise CheckpointError(f"tensor {name!r} in {str(f)!r} is stored as {stored}; expected a "
                                              f"floating dtype ({sorted(_FLOAT_STORAGE)}) to convert to {dtype}")
                    out[name] = handle.get_tensor(name).to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read safetensors file {str(f)!r}: {e}") from None
    return out


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else "model." + name


def load_qwen3(path, dtype=torch.float32, device="cpu") -> Qwen3ForCausalLM:
    """Load a Hugging Face Qwen3ForCausalLM directory (or a Llama, Qwen2, Mistral one that Qwen3Config.from_dict
    accepts) as our model, weights cast to `dtype` on `device`."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint path {str(root)!r} is not a directory; expected a Hugging Face model dir")
    dtype, device = resolve_dtype(dtype), resolve_device(device)
    config = Qwen3Config.from_json(root / "config.json")
    tensors = read_tensors(weight_files(root), dtype, device)
    model = Qwen3ForCausalLM(config, device="meta", dtype=dtype)  # no allocation until the weights arrive
    expected = {_hf_name(k): v for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
        tensors.pop("lm_head.weight", None)  # some exports keep the tied copy
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"checkpoint {str(root)!r} lacks weights {missing[:8]}"
                              f"{' ...' if len(missing) > 8 else ''} ({len(missing)} missing)")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"checkpoint {str(root)!r} has weights {unexpected[:8]} that a {config.model_type} model "
                              f"with {config.num_hidden_layers} layers does not use; does config.json match the weights?")
    for name, ref in expected.items():
        if not torch.isfinite(tensors[name]).all():  # a damaged checkpoint would decode to garbage silently
            raise CheckpointError(f"tensor {name!r} in {str(root)!r} holds non-finite values (NaN or inf); "
                                  "expected a finite checkpoint")
        if tensors[name].shape != ref.shape:
            raise CheckpointError(f"tensor {name!r} in {str(root)!r} has shape {tuple(tensors[name].shape)}; "
                                  f"the config expects {tuple(ref.shape)}")
    state = {k.removeprefix("model."): v for k, v in tensors.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.reset_rope()
    eos = generation_eos(root / "generation_config.json")
    config.eos_token_id = sorted(set(config.eos_token_id) | {e for e in eos if 0 <= e < config.vocab_size})
    return model.eval()


def generation_eos(path: Path) -> list[int]:
    """EOS ids from generation_config.json, which often lists more stop tokens than config.json."""
    if not path.is_file():
        return []
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{str(path)!r} is not a JSON object: {e}") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{str(path)!r} holds a JSON {type(d).__name__}; expected an object")
    return check_eos(d, path)


def save_qwen3(model: Qwen3ForCausalLM, path, max_shard_bytes: int | None = None):
    """Write config.json + model.safetensors (or shards + index when larger than max_shard_bytes);
    transformers' Qwen3ForCausalLM.from_pretrained reads the result."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    config = model.config
    cfg = config.to_dict()
    cfg["dtype"] = str(model.dtype).removeprefix("torch.")
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    state = {_hf_name(k): v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")  # safetensors refuses shared storage; readers re-tie
    for stale in [*root.glob("*.safetensors"), root / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    total = sum(t.numel() * t.element_size() for t in state.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(state, str(root / SINGLE_FILE), metadata={"format": "pt"})
        return
    shards, current, size = [], {}, 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = state[name]
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(root / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / INDEX_FILE).write_text(json.dumps(index, indent=2))
