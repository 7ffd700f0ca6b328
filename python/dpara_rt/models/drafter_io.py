"""Drafter checkpoints: dpara_rt's own format, and the published DSpark / DFlash formats read in place.

Ours is ``drafter_config.json`` + ``drafter.safetensors`` without the target's embedding and output head,
which the drafter shares. A DSpark or DFlash directory (Hugging Face ``config.json`` + safetensors) loads
directly through :mod:`dpara_rt.models.convert`, or is rewritten in our format by ``dpara-rt convert``.
"""
from __future__ import annotations

import copy
import json
import os
import warnings

import torch
from torch import Tensor, nn

from dpara_rt.models.drafter import Drafter, DrafterConfig

CONFIG_NAME = "drafter_config.json"
WEIGHTS_NAME = "drafter.safetensors"
_FORMAT = "dpara_rt.drafter"


def checkpoint_format(path: str | os.PathLike) -> str:
    """'dpara_rt', 'dspark' or 'dflash' (what the directory holds); a ValueError names what is missing."""
    if os.path.isfile(os.path.join(path, CONFIG_NAME)):
        return "dpara_rt"
    from dpara_rt.models.convert import source_format
    return source_format(path)


def write_drafter(config: DrafterConfig, state: dict[str, Tensor], path: str | os.PathLike) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump({"format": _FORMAT, "version": 1, "config": config.to_dict()}, f, indent=2)
    state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    save_file(state, os.path.join(path, WEIGHTS_NAME), metadata={"format": _FORMAT})


def save_drafter(drafter: Drafter, path: str | os.PathLike) -> None:
    """Write ``drafter_config.json`` + ``drafter.safetensors`` (shared embed/lm_head excluded) into ``path``."""
    write_drafter(drafter.config, drafter.state_dict(), path)


def _read_own_config(path) -> DrafterConfig:
    file = os.path.join(path, CONFIG_NAME)
    try:
        with open(file) as f:
            blob = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"corrupt drafter config {file}: {e}") from None
    if not isinstance(blob, dict) or blob.get("format") != _FORMAT or not isinstance(blob.get("config"), dict):
        raise ValueError(f"{file} is not a dpara_rt drafter config (expected format '{_FORMAT}')")
    try:
        return DrafterConfig.from_dict(blob["config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad drafter config {file}: {e}") from None


def read_drafter_config(path: str | os.PathLike) -> DrafterConfig:
    """The drafter config of a dpara_rt, DSpark or DFlash checkpoint directory."""
    if checkpoint_format(path) == "dpara_rt":
        return _read_own_config(path)
    from dpara_rt.models.convert import read_source
    return read_source(path)[0]


def check_target_compatible(config: DrafterConfig, target_model: nn.Module) -> None:
    """Refuse a target whose vocab size, hidden size or depth does not fit the drafter (names both values)."""
    problems = pair_problems(config, target_model.config)
    if problems:
        raise ValueError(problems[0])


def pair_problems(config: DrafterConfig, tc) -> list[str]:
    """Why a drafter does not fit a target config (empty when it does), one line per reason."""
    out = []
    if tc.vocab_size != config.vocab_size:
        out.append(f"vocab size mismatch: drafter vocab_size={config.vocab_size}, target vocab_size={tc.vocab_size}")
    if tc.hidden_size != config.target_hidden_size or tc.hidden_size != config.hidden_size:
        out.append(f"hidden size mismatch: drafter target_hidden_size={config.target_hidden_size} / "
                   f"hidden_size={config.hidden_size}, target hidden_size={tc.hidden_size}")
    bad = [i for i in config.layer_ids if i >= tc.num_hidden_layers]
    if bad:
        out.append(f"drafter layer_ids {config.layer_ids} include {bad}, beyond the target's "
                   f"num_hidden_layers={tc.num_hidden_layers} (valid ids: 0..{tc.num_hidden_layers - 1})")
    return out


def _shared_on(module: nn.Module, device, dtype) -> nn.Module:
    w = module.weight
    if (device is None or torch.device(device) == w.device) and (dtype is None or dtype == w.dtype):
        return module
    return copy.deepcopy(module).to(device=device, dtype=dtype).requires_grad_(False)


def load_drafter(path: str | os.PathLike, target_model: nn.Module, device=None, dtype=None) -> Drafter:
    """Load a drafter checkpoint (dpara_rt, DSpark or DFlash) for ``target_model``; it shares the target's
    embed_tokens / lm_head (copied only when ``device``/``dtype`` differ from the target's)."""
    fmt, config, state, own_head = _checkpoint_state(path)
    check_target_compatible(config, target_model)
    embed, head = target_model.embed_tokens, target_model.lm_head
    for name, mine in own_head.items():  # DSpark keeps frozen copies of the target's; the target's are used
        theirs = (embed if name == "embed_tokens" else head).weight.detach()
        if mine.shape != theirs.shape or not torch.equal(mine.to(theirs.dtype), theirs):
            warnings.warn(f"the {fmt} checkpoint's own {name} differs from the target's; dpara_rt drafts with the "
                          "target's (lossless either way; acceptance may drop)", stacklevel=2)
    drafter = Drafter(config, _shared_on(embed, device, dtype), _shared_on(head, device, dtype))
    _load_state(drafter, state, os.path.join(path, WEIGHTS_NAME) if fmt == "dpara_rt" else path)
    return drafter


def load_drafter_weights(drafter: Drafter, path: str | os.PathLike) -> None:
    """Load a dpara_rt checkpoint's weights into an existing drafter of the same config (training resume)."""
    config = read_drafter_config(path)
    if config != drafter.config:
        raise ValueError(f"drafter checkpoint {path} has config {config.to_dict()}, "
                         f"the drafter has {drafter.config.to_dict()}")
    _load_state(drafter, _read_own_weights(path), os.path.join(path, WEIGHTS_NAME))


def _read_own_weights(path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = os.path.join(path, WEIGHTS_NAME)
    try:
        return load_file(file)
    except FileNotFoundError:
        raise ValueError(f"drafter checkpoint {path} has a config but no {WEIGHTS_NAME}") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"corrupt drafter weights {file}: {e}") from None


def copy_backbone(drafter: Drafter, path: str | os.PathLike) -> list[str]:
    """Start ``drafter``'s backbone from the drafter checkpoint at ``path`` (any format) for another draft
    convention or head: every tensor but the Markov head's and the learned mask row, which must match in name
    and shape. Returns the names copied."""
    _, config, state, _ = _checkpoint_state(path)
    if config.layer_ids != drafter.config.layer_ids:
        raise ValueError(f"drafter checkpoint {path} reads target layers {config.layer_ids}; this drafter reads "
                         f"{drafter.config.layer_ids}")
    own = drafter.state_dict()
    names = sorted(n for n in own if n not in ("w1", "w2", "mask_embedding"))
    bad = [f"{n} {tuple(state[n].shape) if n in state else 'missing'} (expected {tuple(own[n].shape)})"
           for n in names if n not in state or state[n].shape != own[n].shape]
    if bad:
        raise ValueError(f"drafter checkpoint {path} does not fit this drafter's backbone: {', '.join(bad)}")
    with torch.no_grad():
        for n in names:
            own[n].copy_(state[n])
    return names


def _checkpoint_state(path) -> tuple[str, DrafterConfig, dict[str, Tensor], dict]:
    """(checkpoint_format, config, tensors in our names, a published checkpoint's own embed_tokens/lm_head) of any
    drafter format."""
    fmt = checkpoint_format(path)
    if fmt != "dpara_rt":
        from dpara_rt.models.convert import read_source
        return (fmt, *read_source(path, with_weights=True))
    return fmt, _read_own_config(path), _read_own_weights(path), {}


def _load_state(drafter: Drafter, state: dict[str, Tensor], where) -> None:
    expected = drafter.state_dict()
    missing, unknown = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unknown:
        raise ValueError(f"corrupt drafter weights {where}: missing tensors {missing}, unexpected tensors {unknown}")
    for name, t in state.items():
        if t.shape != expected[name].shape:
            raise ValueError(f"corrupt drafter weights {where}: {name} has shape {tuple(t.shape)}, "
                             f"the config implies {tuple(expected[name].shape)}")
        if not torch.isfinite(t.float()).all():
            raise ValueError(f"corrupt drafter weights {where}: {name} holds non-finite values")
    drafter.load_state_dict(state)


__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "check_target_compatible", "checkpoint_format", "copy_backbone",
           "load_drafter", "load_drafter_weights", "pair_problems", "read_drafter_config", "save_drafter",
           "write_drafter"]
