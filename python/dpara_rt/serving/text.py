"""Text in, text out: the target's tokenizer and chat template around an :class:`~dpara_rt.engine.Engine`.

    gen = TextGenerator.load("Qwen3-8B", "Qwen3-8B-dspark", method="dpara")
    print(gen.generate_text("Write a haiku about rain.", chat=True, enable_thinking=False))
    for piece in gen.generate_text("def fib(n):", max_new_tokens=64, stop=["\\n\\n"], stream=True):
        print(piece, end="", flush=True)

The tokenizer comes from the target's directory: ``tokenizer.json`` read with `tokenizers` (or, when a
directory has none, whatever transformers' ``AutoTokenizer`` builds from it), ``tokenizer_config.json`` for
the special tokens and the chat template (or ``chat_template.jinja`` / ``chat_template.json``). Chat templates
are rendered with jinja2 the way transformers renders them (a sandboxed environment with ``trim_blocks``,
``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now``, a non-escaping ``tojson`` and the
``{% generation %}`` tag; the special tokens as variables; ``add_generation_prompt=True``).

Streaming never emits a broken character: tokens are decoded in a sliding window and text that ends in
U+FFFD (an incomplete multi-byte sequence) is held back until the next tokens complete it. Generation stops
at a stop id (the model's EOS ids from config.json / generation_config.json / tokenizer_config.json plus
the caller's) or as soon as the text contains a stop string; neither appears in the returned text, and a stop
string that arrives split over several rounds is caught (text that could be the start of one is held back).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from dpara_rt.jsonfile import read_json_object
from dpara_rt.models.config_check import check_eos

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first new ones (leading-space rules of some decoders)


class TextError(ValueError):
    """A tokenizer, template or text option that cannot be used; the message names the file or value."""


# ---------------------------------------------------------------------------------------------- files
def _read_json(path: Path) -> dict:
    return read_json_object(path, error=TextError)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def model_eos_ids(model_dir) -> list[int]:
    """EOS ids a model directory declares: config.json (or its text_config) and generation_config.json."""
    root = Path(model_dir)
    out: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        f = root / name
        if f.is_file():
            blob = _read_json(f)
            out.update(check_eos(blob, f))
            if isinstance(blob.get("text_config"), dict):
                out.update(check_eos(blob["text_config"], f, "text_config.eos_token_id"))
    return sorted(out)


def _read_chat_template(root: Path, config: dict) -> str | None:
    template = config.get("chat_template")
    for name in CHAT_TEMPLATE_FILES:  # transformers writes the template beside the config nowadays
        f = root / name
        if template is None and f.is_file():
            if name.endswith(".jinja"):
                template = f.read_text(encoding="utf-8")
            else:
                template = _read_json(f).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise TextError(f"chat template in {str(root)!r} is a {type(template).__name__}; expected a string")
    return template


# ---------------------------------------------------------------------------------------------- templates
def _compile_template(source: str):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        from datetime import datetime
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TextError(f"chat template does not compile: {e.message} (line {e.lineno})") from None


def _messages(prompt, system: str | None = None) -> list[dict]:
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt) and prompt:
        messages = [dict(m) for m in prompt]
    else:
        raise TextError(f"chat input {prompt!r:.60}; expected a string or a non-empty list of message dicts")
    for i, m in enumerate(messages):
        if "role" not in m:
            raise TextError(f"message {i} {m!r:.60} has no 'role'")
    if system is not None:
        if messages[0]["role"] == "system":
            raise TextError("system= given but the messages already start with a system message")
        messages.insert(0, {"role": "system", "content": system})
    return messages


# ---------------------------------------------------------------------------------------------- tokenizer
class TextTokenizer:
    """A `tokenizers.Tokenizer` with the model directory's special tokens, EOS ids and chat template."""

    def __init__(self, backend, config: dict | None = None, chat_template: str | None = None,
                 eos_ids: Iterable[int] = (), name: str = "tokenizer"):
        self.backend = backend
        self.config = dict(config or {})
        self.chat_template = chat_template
        self.name = name
        self.special_tokens = {k: t for k in _SPECIAL_KEYS if (t := _token_text(self.config.get(k))) is not None}
        ids = set(_ids(list(eos_ids)))
        eos = self.special_tokens.get("eos_token")
        if eos is not None and backend.token_to_id(eos) is not None:
            ids.add(backend.token_to_id(eos))
        self.eos_ids: list[int] = sorted(ids)
        self._compiled = None

    # --------------------------------------------------------------- loading
    @classmethod
    def from_dir(cls, path, eos_ids: Iterable[int] | None = None) -> "TextTokenizer":
        """The tokenizer of a model directory; EOS ids default to the directory's (config, generation config)."""
        root = Path(path)
        if not root.is_dir():
            raise TextError(f"model directory {str(root)!r} does not exist")
        config = _read_json(root / TOKENIZER_CONFIG) if (root / TOKENIZER_CONFIG).is_file() else {}
        file = root / TOKENIZER_FILE
        if file.is_file():
            backend = _read_tokenizer_file(file)
        else:
            backend = _auto_backend(root)
        eos = model_eos_ids(root) if eos_ids is None else list(eos_ids)
        return cls(backend, config, _read_chat_template(root, config), eos, name=str(root))

    @classmethod
    def from_file(cls, file, eos_ids: Iterable[int] = ()) -> "TextTokenizer":
        """A bare tokenizer.json (no template); beside a tokenizer_config.json, that is read as well."""
        file = Path(file)
        if not file.is_file():
            raise TextError(f"tokenizer file {str(file)!r} does not exist; expected a tokenizer.json")
        root = file.parent
        config = _read_json(root / TOKENIZER_CONFIG) if (root / TOKENIZER_CONFIG).is_file() else {}
        return cls(_read_tokenizer_file(file), config, _read_chat_template(root, config), eos_ids, name=str(file))

    @classmethod
    def wrap(cls, tokenizer, eos_ids: Iterable[int] = ()) -> "TextTokenizer":
        """From a `tokenizers.Tokenizer` or an object with ``to_str()`` (the embedded pair's CodeTokenizer)."""
        from tokenizers import Tokenizer
        if not isinstance(tokenizer, Tokenizer):
            extra = _ids(getattr(tokenizer, "eos_token_id", None))
            tokenizer = Tokenizer.from_str(tokenizer.to_str())
            eos_ids = [*eos_ids, *extra]
        return cls(tokenizer, eos_ids=eos_ids)

    # --------------------------------------------------------------- text <-> ids
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TextError(f"text {text!r:.60} is a {type(text).__name__}; expected a string")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decoder(self, context: Sequence[int] = (), skip_special_tokens: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, context, skip_special_tokens)

    # --------------------------------------------------------------- chat
    def apply_chat(self, prompt, enable_thinking: bool | None = None, system: str | None = None,
                   add_generation_prompt: bool = True, **template_kwargs) -> str:
        """The chat template rendered for `prompt` (a user message string, or a list of message dicts) with the
        generation prompt appended; ``enable_thinking`` reaches the template only when given."""
        if self.chat_template is None:
            raise TextError(f"{self.name} has no chat template (no chat_template in {TOKENIZER_CONFIG}, no "
                            f"{' / '.join(CHAT_TEMPLATE_FILES)}); use plain text prompts")
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        kwargs = {**self.special_tokens, **template_kwargs}
        if enable_thinking is not None:
            kwargs["enable_thinking"] = bool(enable_thinking)
        import jinja2
        try:
            return self._compiled.render(messages=_messages(prompt, system), tools=kwargs.pop("tools", None),
                                         documents=kwargs.pop("documents", None),
                                         add_generation_prompt=add_generation_prompt, **kwargs)
        except jinja2.TemplateError as e:
            raise TextError(f"chat template of {self.name} failed: {e}") from None

    def encode_chat(self, prompt, enable_thinking: bool | None = None, system: str | None = None,
                    **template_kwargs) -> list[int]:
        # the template writes the special tokens (BOS included) itself, as transformers encodes it
        return self.encode(self.apply_chat(prompt, enable_thinking, system, **template_kwargs),
                           add_special_tokens=False)


def _read_tokenizer_file(file: Path):
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise TextError(f"tokenizer file {str(file)!r} cannot be read: {str(e).splitlines()[0] if str(e) else e!r}"
                        ) from None


def _auto_backend(root: Path):
    """A directory without tokenizer.json: let transformers build the fast tokenizer (sentencepiece, vocab +
    merges) and take its `tokenizers` backend."""
    sources = ("tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
    if not any((root / name).is_file() for name in sources):
        raise TextError(f"no {TOKENIZER_FILE} in {str(root)!r}, nor any of {', '.join(sources)} to build one from; "
                        "expected a Hugging Face model directory with its tokenizer")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TextError(f"no {TOKENIZER_FILE} in {str(root)!r} (and transformers, which could build one from "
                        "other tokenizer files, is not installed)") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(root))
        backend = getattr(tok, "backend_tokenizer", None)
    except Exception as e:
        raise TextError(f"no {TOKENIZER_FILE} in {str(root)!r} and transformers cannot build a tokenizer from it: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if backend is None:
        raise TextError(f"no {TOKENIZER_FILE} in {str(root)!r} and transformers gives only a slow tokenizer for it")
    return backend


# ---------------------------------------------------------------------------------------------- streaming
class StreamDecoder:
    """Incremental detokenization: ``push(ids)`` returns the new text, never a partial character.

    Tokens are decoded in a window that starts a few tokens back (so decoders that drop a leading space, or
    merge pieces, see the same context as a full decode); text ending in U+FFFD is held until completed.
    """

    def __init__(self, tokenizer: TextTokenizer, context: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        context = [int(t) for t in context]
        n = len(context)
        start = n
        for p in range(max(0, n - _CONTEXT_TOKENS), n):  # a window start that is a character boundary
            if not self._decode(context[p:]).startswith("\ufffd"):
                start = p
                break
        self.ids = context[start:]
        self.prefix = 0               # window start
        self.read = len(self.ids)     # tokens whose text has been emitted

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, ids: Iterable[int]) -> str:
        self.ids.extend(int(t) for t in ids)
        if len(self.ids) == self.read:
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""  # no text yet, or a character still incomplete: wait for the next tokens
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]

    def flush(self) -> str:
        """What is still held back (a truly incomplete character at the end of generation)."""
        if len(self.ids) == self.read:
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


class StopStrings:
    """Finds stop strings in streamed text: ``feed(piece)`` -> (text safe to emit, stopped). Text that could be
    the beginning of a stop string is held back, so a stop string split over several pieces is still caught
    and none of it is ever emitted."""

    def __init__(self, stops: Iterable[str] = ()):
        stops = list(stops or ())
        for s in stops:
            if not isinstance(s, str) or not s:
                raise TextError(f"stop string {s!r}; expected a non-empty string")
        self.stops = stops
        self.pending = ""
        self.hit: str | None = None

    def feed(self, piece: str) -> tuple[str, bool]:
        self.pending += piece
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        found = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if found:
            i, self.hit = min(found)
            out, self.pending = self.pending[:i], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:k]):
                    hold = k
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# ---------------------------------------------------------------------------------------------- models
# ---------------------------------------------------------------------------------------------- front end
class TextGenerator:
    """Text generation over an Engine: encode (optionally through the chat template), decode the stream.

    ``stop_ids`` are added to the model's and the tokenizer's EOS ids; when this class builds the Engine
    (``load`` / ``build``) they are the Engine's ``eos_ids`` too, so the decode itself ends there (with an Engine
    built elsewhere, the stream is closed at them). After a call: ``last_tokens`` (the committed
    ids, stop id excluded), ``finish_reason`` ("stop_id", "stop_string" or "length"), ``last_stats`` (the
    Engine's statistics; None when a stop string ended the stream early), ``last_wall_s``.
    """

    def __init__(self, engine, tokenizer: TextTokenizer, stop_ids: Iterable[int] = ()):
        if not isinstance(tokenizer, TextTokenizer):
            tokenizer = TextTokenizer.wrap(tokenizer)
        self.engine, self.tokenizer = engine, tokenizer
        model_eos = _ids(getattr(engine.model.config, "eos_token_id", None))
        self.stop_ids = sorted(set(tokenizer.eos_ids) | set(model_eos) | set(_check_ids(stop_ids)))
        self.last_tokens: list[int] = []
        self.last_stats = None
        self.last_wall_s = 0.0
        self.finish_reason: str | None = None

    @classmethod
    def load(cls, target_dir, drafter_dir=None, method: str = "dpara", device="cpu", dtype=None,
             stop_ids: Iterable[int] = (), top_k: int | None = None, drafter_device=None,
             **engine_kwargs) -> "TextGenerator":
        """Target (and drafter) from directories, tokenizer from the target's directory, an Engine over them.
        `method` is a variant name (dpara_rt.methods.VARIANTS); ``engine_kwargs`` go to the Engine.
        ``drafter_device``: where the drafter runs (default: the target's device)."""
        from dpara_rt.methods import needs_drafter, variant
        from dpara_rt.round.lanes import parse_device

        kw = variant(method)
        if drafter_device is not None:
            drafter_device = parse_device(drafter_device, "drafter_device")  # before any weights load
        tokenizer = TextTokenizer.from_dir(target_dir)
        from dpara_rt.models.drafter_io import load_drafter
        from dpara_rt.models.hf_target import load_target

        target = load_target(target_dir, device=device, dtype=dtype)
        drafter = None
        if needs_drafter(kw["method"]):
            if drafter_dir is None:
                raise TextError(f"method {method!r} needs a drafter directory; give one, or use method 'ar'")
            drafter = load_drafter(drafter_dir, target, device=drafter_device)
        return cls.build(target, drafter, tokenizer, method=method, stop_ids=stop_ids, top_k=top_k, **engine_kwargs)

    @classmethod
    def build(cls, target, drafter, tokenizer, method: str = "dpara", stop_ids: Iterable[int] = (),
              top_k: int | None = None, drafter_device=None, **engine_kwargs) -> "TextGenerator":
        """An Engine over loaded models whose eos_ids are the model's, the tokenizer's and `stop_ids`;
        ``drafter_device`` moves the drafter there first (Drafter.move_to)."""
        from dpara_rt.engine import Engine
        from dpara_rt.methods import needs_drafter, variant
        from dpara_rt.round.lanes import parse_device

        if drafter_device is not None:
            drafter_device = parse_device(drafter_device, "drafter_device")
            if drafter is not None:
                drafter.move_to(drafter_device)

        if not isinstance(tokenizer, TextTokenizer):
            tokenizer = TextTokenizer.wrap(tokenizer)
        kw = variant(method)
        eos = sorted(set(_ids(getattr(target.config, "eos_token_id", None))) | set(tokenizer.eos_ids)
                     | set(_check_ids(stop_ids)))
        eos = [e for e in eos if 0 <= e < target.config.vocab_size]
        if top_k is not None:
            engine_kwargs["top_k"] = top_k
        engine = Engine(target, drafter if needs_drafter(kw["method"]) else None, eos_ids=eos, **kw, **engine_kwargs)
        return cls(engine, tokenizer, stop_ids)

    # --------------------------------------------------------------- prompts
    def prompt_ids(self, prompt, chat: bool = False, enable_thinking: bool | None = None,
                   system: str | None = None) -> list[int]:
        """The token ids of a prompt: a string as is, or (chat, or a list of messages) through the template."""
        if chat or not isinstance(prompt, str):
            ids = self.tokenizer.encode_chat(prompt, enable_thinking, system)
        else:
            if enable_thinking is not None or system is not None:
                raise TextError("enable_thinking / system apply to chat prompts; pass chat=True")
            ids = self.tokenizer.encode(prompt)
        if not ids:
            raise TextError("the prompt encodes to no tokens; give some text")
        return ids

    # --------------------------------------------------------------- generation
    def generate_text(self, prompt, max_new_tokens: int = 256, *, chat: bool = False,
                      enable_thinking: bool | None = None, system: str | None = None,
                      stop: str | Sequence[str] | None = None, stop_ids: Iterable[int] = (),
                      temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                      seed: int | None = None, stream: bool = False):
        """The completion of `prompt` as text (``stream=True``: an iterator of text pieces as they are
        committed). Stop ids and stop strings end it and are not part of the text. Sampling arguments left
        None keep the Engine's defaults."""
        ids = self.prompt_ids(prompt, chat, enable_thinking, system)
        stops = StopStrings([stop] if isinstance(stop, str) else stop or ())
        halt = set(self.stop_ids) | set(_check_ids(stop_ids))
        overrides = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        pieces = self._pieces(ids, max_new_tokens, overrides, stops, halt)
        return pieces if stream else "".join(pieces)

    def _pieces(self, ids, max_new_tokens, overrides, stops: StopStrings, halt: set[int]) -> Iterator[str]:
        eng = self.engine
        before = getattr(eng, "last_stats", None)
        self.last_tokens, self.last_stats, self.finish_reason = [], None, None
        dec = self.tokenizer.decoder(ids)
        engine_eos = set(getattr(getattr(eng, "defaults", None), "eos_ids", ()) or ())
        t0 = time.perf_counter()
        rounds = eng.stream([ids], max_new_tokens, **overrides)
        try:
            for new in rounds:
                toks = list(new[0])
                cut = next((i for i, t in enumerate(toks) if t in halt), None)
                if cut is not None:
                    toks = toks[:cut]
                self.last_tokens += toks
                text, stopped = stops.feed(dec.push(toks))
                if text:
                    yield text
                if stopped:
                    self.finish_reason = "stop_string"
                    return
                if cut is not None:
                    self.finish_reason = "stop_id"
                    if new[0][cut] in engine_eos:  # the decode ends here by itself: let it, for its stats
                        for _ in rounds:
                            pass
                    break
            text, stopped = stops.feed(dec.flush())
            if stopped:
                self.finish_reason = "stop_string"
            else:
                text += stops.flush()
            if text:
                yield text
            self.finish_reason = self.finish_reason or "length"
        finally:
            rounds.close()  # an early stop ends the decode (the engine stops its chain)
            self.last_wall_s = time.perf_counter() - t0
            stats = getattr(eng, "last_stats", None)
            self.last_stats = stats if stats is not before else None


def _check_ids(ids) -> list[int]:
    ids = list(ids or ())
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise TextError(f"stop id {t!r}; expected a non-negative int token id")
    return ids


def generate_text(engine, tokenizer, prompt, max_new_tokens: int = 256, **kwargs):
    """One call without keeping a TextGenerator: ``generate_text(engine, TextTokenizer.from_dir(d), "Hi")``."""
    return TextGenerator(engine, tokenizer).generate_text(prompt, max_new_tokens, **kwargs)


__all__ = ["StopStrings", "StreamDecoder", "TextError", "TextGenerator", "TextTokenizer", "generate_text",
           "load_drafter", "load_target", "model_eos_ids"]
