"""The embedded "tiny" model pair (tokenizer, target, drafter) and its manifest.

``tiny/manifest.json`` lists every file with its sha256; :func:`load_tiny` checks them all before
loading anything, so a missing or damaged file gives one clear line naming it. The pair is made by
``dpara-rt train --preset tiny`` (:func:`dpara_rt.train.preset_tiny.run_tiny_preset`).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

TINY_DIR = Path(__file__).resolve().parent / "tiny"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "dpara_rt.tiny/1"
REGENERATE_HINT = "regenerate it with `dpara-rt train --preset tiny`"


class AssetError(ValueError):
    """An embedded model file that is missing, damaged or not listed as expected; the message names it."""


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def describe_files(root: str | os.PathLike, relpaths) -> dict[str, dict]:
    """{relpath: {"sha256", "bytes"}} for the manifest, in sorted order."""
    root = Path(root)
    return {rel: {"sha256": file_sha256(root / rel), "bytes": (root / rel).stat().st_size} for rel in sorted(relpaths)}


def read_manifest(root: str | os.PathLike = TINY_DIR, fmt: str = MANIFEST_FORMAT,
                  what: str = "embedded model manifest", hint: str = REGENERATE_HINT) -> dict:
    """root's manifest.json, checked to be a `fmt` manifest with a 'files' table (its files are not read here)."""
    path = Path(root) / MANIFEST_NAME
    if not path.is_file():
        raise AssetError(f"{what} {path} is missing; {hint}")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AssetError(f"{what} {path} is not valid JSON ({e}); {hint}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt or not isinstance(manifest.get("files"), dict):
        raise AssetError(f"{what} {path} is not a {fmt!r} manifest with a 'files' table; {hint}")
    return manifest


def verify_assets(root: str | os.PathLike = TINY_DIR) -> dict:
    """Check every file the manifest lists against its sha256, and that nothing unlisted lies beside them (an
    entry removed from the manifest must not let an unchecked file load); return the manifest."""
    root = Path(root)
    manifest = read_manifest(root)
    listed = {Path(rel) for rel in manifest["files"]} | {Path(MANIFEST_NAME)}
    unlisted = sorted(str(p.relative_to(root)) for p in root.rglob("*")
                      if p.is_file() and p.relative_to(root) not in listed and "__pycache__" not in p.parts)
    if unlisted:
        raise AssetError(f"embedded model files {unlisted} in {root} are not listed in the manifest, so they "
                         f"cannot be checked; {REGENERATE_HINT}")
    check_files(root, manifest["files"], "embedded model file", REGENERATE_HINT)
    return manifest


def check_files(root: Path, files: dict, what: str, hint: str) -> None:
    """Every file a manifest lists ({relative path: {"sha256": ...}}) present and matching its digest; AssetError
    naming the first one that is not (`what` names the kind of file, `hint` how to make it again)."""
    for rel, entry in files.items():
        path = root / rel
        if not path.is_file():
            raise AssetError(f"{what} {path} is missing; {hint}")
        digest = file_sha256(path)
        if digest != entry.get("sha256"):
            raise AssetError(f"{what} {path} is damaged: sha256 {digest[:16]}... differs from the "
                             f"manifest's {str(entry.get('sha256'))[:16]}...; {hint}")


def load_tiny(device="cpu", dtype="float32", root: str | os.PathLike | None = None, drafter_dtype=None):
    """Verify and load the embedded pair -> (CodeTokenizer, Qwen3ForCausalLM target, Drafter), in eval mode.

    The weights are stored in bf16; ``dtype`` is what the target computes in (fp32 by default, so that a
    verify block and single-token decoding round alike and greedy outputs match AR exactly) and
    ``drafter_dtype`` what the drafter computes in (default: the target's). The drafter's precision only
    changes which tokens are proposed, never what is committed."""
    from dpara_rt.models.drafter_io import load_drafter
    from dpara_rt.models.loader import load_qwen3, resolve_dtype
    from dpara_rt.train.tokenizer import CodeTokenizer

    root = TINY_DIR if root is None else Path(root)
    manifest = verify_assets(root)
    layout = manifest.get("layout", {})
    try:
        tokenizer = CodeTokenizer.from_file(root / layout["tokenizer"])
        target = load_qwen3(root / layout["target"], dtype=dtype, device=device)
        drafter = load_drafter(root / layout["drafter"], target,
                               dtype=None if drafter_dtype is None else resolve_dtype(drafter_dtype))
    except KeyError as e:
        raise AssetError(f"embedded model manifest in {root} has no layout entry {e}; {REGENERATE_HINT}") from None
    if tokenizer.vocab_size != target.config.vocab_size:
        raise AssetError(f"embedded tokenizer has vocab {tokenizer.vocab_size} but the target has "
                         f"{target.config.vocab_size}; {REGENERATE_HINT}")
    return tokenizer, target, drafter.eval()


__all__ = ["AssetError", "MANIFEST_NAME", "TINY_DIR", "check_files", "describe_files", "file_sha256", "load_tiny",
           "read_manifest", "verify_assets"]
