"""Reading the JSON objects that model directories hold (config.json, tokenizer_config.json, ...)."""
from __future__ import annotations

import json
import os
from pathlib import Path


def read_json_object(path: str | os.PathLike, what: str = "", error: type[Exception] = ValueError) -> dict:
    """The JSON object in file `path`; `error`, naming the file (as `what` 'path'), when the file is not valid
    JSON or holds something else than an object. A missing file raises FileNotFoundError (callers say what
    they expected instead)."""
    name = f"{what} {str(path)!r}".strip()
    try:
        blob = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{name} is not valid JSON: {e}") from None
    if not isinstance(blob, dict):
        raise error(f"{name} holds a {type(blob).__name__}; expected a JSON object")
    return blob
