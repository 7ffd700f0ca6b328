"""The evaluation prompt sets shipped with dpara_rt (assets/evalsets/: code, math, chat; see its README.md).

    from dpara_rt.evalsets import load_evalset
    prompts = load_evalset("math")          # 48 user messages, in file order
"""
from __future__ import annotations

import json
from pathlib import Path

EVALSETS = ("code", "math", "chat")
EVALSET_DIR = Path(__file__).resolve().parent / "assets" / "evalsets"


def evalset_records(name: str) -> list[dict]:
    """Every record of set `name` ({"id", "prompt", ...}), in file order."""
    if name not in EVALSETS:
        raise ValueError(f"unknown evaluation set {name!r}; expected one of {', '.join(EVALSETS)}")
    path = EVALSET_DIR / f"{name}.jsonl"
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {n} is not valid JSON ({e}); expected one object per line") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str) or not rec["prompt"].strip():
                raise ValueError(f"{path} line {n} holds {line.strip()[:60]!r}; expected an object with a "
                                 "non-empty string 'prompt'")
            records.append(rec)
    return records


def load_evalset(name: str) -> list[str]:
    """The prompts of set `name` (one of EVALSETS), in file order."""
    return [rec["prompt"] for rec in evalset_records(name)]


__all__ = ["EVALSETS", "EVALSET_DIR", "evalset_records", "load_evalset"]
