"""OpenAI request validation and response shapes for `dpara-rt serve`.

Every bad request becomes an :class:`APIError` with an HTTP status and OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``. Fields the runtime cannot honour (logprobs, penalties,
n > 1, tools, ...) are refused with a 400 naming the field rather than silently ignored; fields that change
nothing (user, metadata, ...) are accepted.
"""
from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

SEED_LIMIT = 2 ** 63
MAX_STOP_STRINGS = 16
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An error for the client: `status` and OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


# ------------------------------------------------------------------------------------------ field checks
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v) or v > hi or (v <= lo if lo_open else v < lo):
        left = "(" if lo_open else "["
        raise bad(f"{name} = {v!r}; expected a number in {left}{lo:g}, {hi:g}]", name)
    return float(v)


def _int(body: dict, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        want = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        raise bad(f"{name} = {v!r}; expected {want}", name)
    return v


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{name} = {v!r}; expected true or false", name)
    return v


def _unsupported(body: dict, name: str, neutral: tuple = (None,), why: str = "") -> None:
    v = body.get(name)
    if any(v == n and type(v) is type(n) for n in neutral):
        return
    raise bad(f"{name} = {v!r} is not supported by this server{why}", name, code="unsupported_parameter")


@dataclass
class Params:
    """A request's generation parameters, validated."""
    max_tokens: int | None          # None: the endpoint's default (clipped to the context left)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    echo: bool = False


def parse_params(body: dict, chat: bool) -> Params:
    """The sampling / stopping / streaming fields shared by both endpoints."""
    if chat:
        if body.get("max_completion_tokens") is not None and body.get("max_tokens") is not None:
            raise bad("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    else:
        name = "max_tokens"
    max_tokens = _int(body, name, None, 1)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = body.get("top_k")  # an extension (vLLM's): 0 or -1 = off
    if top_k is None:
        top_k = 0
    elif not _is_int(top_k) or top_k < -1:
        raise bad(f"top_k = {top_k!r}; expected an integer >= 1, or 0 / -1 for off", "top_k")
    top_k = max(top_k, 0)
    seed = _int(body, "seed", None, 0, SEED_LIMIT - 1)
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad(f"n = {n!r}; this server returns one choice per request (n = 1)", "n", code="unsupported_parameter")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or \
            not all(isinstance(s, str) and s for s in stop):
        raise bad(f"stop = {body.get('stop')!r:.100}; expected a non-empty string or a list of at most "
                  f"{MAX_STOP_STRINGS} non-empty strings", "stop")
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad(f"stream_options = {opts!r:.100}; expected an object", "stream_options")
    include_usage = bool(opts and opts.get("include_usage"))
    for name, neutral in (("presence_penalty", (None, 0, 0.0)), ("frequency_penalty", (None, 0, 0.0)),
                          ("repetition_penalty", (None, 1, 1.0)), ("logit_bias", (None, {})),
                          ("best_of", (None, 1))):
        _unsupported(body, name, neutral)
    if chat:
        _unsupported(body, "logprobs", (None, False), " (no log-probabilities)")
        _unsupported(body, "top_logprobs", (None, 0), " (no log-probabilities)")
        _unsupported(body, "tools", (None, []), " (no tool calling)")
        _unsupported(body, "tool_choice", (None, "none", "auto"), " (no tool calling)")
        fmt = body.get("response_format")
        if fmt is not None and fmt != {"type": "text"}:
            raise bad(f"response_format = {fmt!r:.100} is not supported (only {{'type': 'text'}})",
                      "response_format", code="unsupported_parameter")
        echo = False
    else:
        _unsupported(body, "logprobs", (None,), " (no log-probabilities)")
        _unsupported(body, "suffix", (None, ""))
        echo = _bool(body, "echo")
    return Params(max_tokens, temperature, top_p, top_k, seed, stop, stream, include_usage,
                  _bool(body, "return_token_ids"), echo)


def check_model(body: dict, names: tuple[str, ...]) -> str:
    model = body.get("model")
    if model is None:
        return names[0]
    if not isinstance(model, str):
        raise bad(f"model = {model!r:.100}; expected a string", "model")
    if model not in names:
        raise APIError(404, f"The model `{model}` does not exist; this server serves {', '.join(names)}",
                       param="model", code="model_not_found")
    return model


def prompt_of(body: dict, vocab: int, encode) -> tuple[list[int], str | None]:
    """(token ids, the prompt text or None) of /v1/completions' `prompt`: a string, a list of token ids, or a
    one-element list of either (one prompt per request)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and (isinstance(p[0], str) or isinstance(p[0], list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise bad("prompt is empty; expected some text", "prompt")
        ids = encode(p)
        if not ids:
            raise bad("prompt encodes to no tokens; expected some text", "prompt")
        return ids, p
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        outside = [t for t in p if not 0 <= t < vocab]
        if outside:
            raise bad(f"prompt holds token id {outside[0]}; expected ids in [0, {vocab})", "prompt")
        return list(p), None
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise bad(f"prompt is a batch of {len(p)} prompts; this server takes one prompt per request", "prompt",
                  code="unsupported_parameter")
    if p is None:
        raise bad("prompt is missing", "prompt")
    raise bad(f"prompt = {p!r:.100}; expected a string or a non-empty list of token ids", "prompt")


def messages_of(body: dict) -> list[dict]:
    """Chat messages as the template sees them: role and string content (text parts joined; developer -> system)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise bad(f"messages[{i}] role {role!r:.60}; expected one of {', '.join(CHAT_ROLES)}",
                      f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content holds {part!r:.60}; only text parts are supported",
                              f"messages[{i}].content")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content = {content!r:.60}; expected a string or a list of text parts",
                      f"messages[{i}].content")
        msg = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def template_kwargs_of(body: dict) -> dict[str, Any]:
    kw = body.get("chat_template_kwargs")  # an extension (vLLM's), e.g. {"enable_thinking": false}
    if kw is None:
        return {}
    if not isinstance(kw, dict) or not all(isinstance(k, str) for k in kw):
        raise bad(f"chat_template_kwargs = {kw!r:.100}; expected an object", "chat_template_kwargs")
    return dict(kw)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


__all__ = ["APIError", "Params", "bad", "check_model", "messages_of", "new_id", "now", "parse_params", "prompt_of",
           "template_kwargs_of", "usage"]
