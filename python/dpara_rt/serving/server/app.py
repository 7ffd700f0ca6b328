"""The FastAPI app: OpenAI's `/v1/completions` and `/v1/chat/completions` (SSE streaming), `/v1/models`,
`/health` and `/metrics` over a :class:`~dpara_rt.serving.scheduler.Scheduler`.

Each request is submitted to the scheduler; a small reader thread per request moves the handle's token chunks
(``RequestHandle.next`` blocks) into an asyncio queue, so the event loop never blocks. Token ids become text
through :class:`~dpara_rt.serving.text.StreamDecoder` (no broken UTF-8) and :class:`~dpara_rt.serving.text.StopStrings` (stop
strings caught across chunks; a hit cancels the handle, freeing the slot). A client that disconnects, streaming
or not, has its handle cancelled.

Extensions to OpenAI's request fields: ``top_k`` (0 or -1 = off), ``return_token_ids`` (the completion's token
ids as the scheduler committed them, the final stop id included, in ``choices[0].token_ids``, and the prompt's in
``prompt_token_ids``; per chunk when streaming) and ``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``).
"""
from __future__ import annotations

import asyncio
import json
import queue
import secrets
import threading
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dpara_rt.serving.server import metrics as prom
from dpara_rt.serving.server.protocol import (APIError, Params, bad, check_model, messages_of, new_id, now, parse_params,
                                     prompt_of, template_kwargs_of, usage)

DEFAULT_MAX_TOKENS = 16          # /v1/completions' default, as OpenAI's
DEFAULT_CHAT_MAX_TOKENS = 256    # /v1/chat/completions: this, clipped to the context left
MAX_BODY_BYTES = 1 << 20
MAX_JSON_DEPTH = 64              # far past any API request; deeper values would recurse in validation and messages
POLL_S = 0.25                    # how often a waiting request checks that its client is still there
_GONE = object()


def check_json_value(body) -> None:
    """400 for a parsed body nested deeper than MAX_JSON_DEPTH or holding a string that is not valid Unicode (a
    lone surrogate escape, which no tokenizer takes): walked with a stack, never recursing."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad(f"the JSON body of your request holds a string with {value[e.start:e.end]!a} ({e.reason}); "
                          "expected valid Unicode text", code="invalid_json") from None
            continue
        if isinstance(value, dict):
            items = [*value, *value.values()]
        elif isinstance(value, list):
            items = value
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise bad(f"the JSON body of your request is nested deeper than {MAX_JSON_DEPTH} levels; expected at "
                      f"most {MAX_JSON_DEPTH}", code="invalid_json")
        stack.extend((item, depth + 1) for item in items if isinstance(item, (str, list, dict)))


class ServerState:
    """What the endpoints share: the scheduler, the tokenizer, limits, live requests and server counters."""

    def __init__(self, scheduler, tokenizer, model_name: str, max_model_len: int | None,
                 default_max_tokens: int, max_body_bytes: int, aliases=()):
        from dpara_rt.serving.text import TextTokenizer
        if not isinstance(tokenizer, TextTokenizer):
            tokenizer = TextTokenizer.wrap(tokenizer)
        self.scheduler, self.tokenizer = scheduler, tokenizer
        self.names = (model_name, *[a for a in aliases if a != model_name])
        eng = scheduler.engine
        self.vocab = eng.model.config.vocab_size
        self.slack = 2 * (eng.defaults.d + 1)  # the engine's verify headroom (Engine.check_fits)
        cap = eng.fixed_max_len or getattr(eng.model.config, "max_position_embeddings", None)
        self.max_model_len = min(x for x in (max_model_len, cap) if x) if (max_model_len or cap) else None
        self.stop_ids = sorted({t for t in tokenizer.eos_ids if 0 <= t < self.vocab})
        self.halt = set(self.stop_ids) | set(eng.defaults.eos_ids)
        self.default_max_tokens, self.max_body_bytes = default_max_tokens, max_body_bytes
        self.created = now()
        self.draining = False
        self.live: set["Generation"] = set()
        self.finish = {}   # finish_reason -> count
        self.http_errors = {}   # status -> count
        self.ttft = prom.Histogram()
        self.e2e = prom.Histogram()

    def cancel_all(self) -> None:
        """Cancel every running request (shutdown past its grace period): their responses end with 'abort'."""
        for g in list(self.live):
            g.cancel()

    def error(self, e: APIError):
        self.http_errors[e.status] = self.http_errors.get(e.status, 0) + 1
        return JSONResponse(e.body(), status_code=e.status)

    def budget(self, prompt_len: int, asked: int | None, default: int) -> int:
        """max_tokens for a prompt: what the client asked, else `default` clipped to the context left; 400 when
        the prompt plus max_tokens does not fit the context."""
        cap = self.max_model_len
        room = None if cap is None else cap - prompt_len - self.slack
        if room is not None and room < 1:
            raise bad(f"This model's maximum context length is {cap} tokens; the prompt has {prompt_len} tokens "
                      f"(plus {self.slack} reserved for speculation), which leaves no room for output",
                      "prompt", code="context_length_exceeded")
        if asked is None:
            return default if room is None else min(default, room)
        if room is not None and asked > room:
            raise bad(f"This model's maximum context length is {cap} tokens; the prompt has {prompt_len} tokens "
                      f"and max_tokens is {asked} (plus {self.slack} reserved for speculation): "
                      f"{prompt_len + asked + self.slack} > {cap}", "max_tokens", code="context_length_exceeded")
        return asked


class Generation:
    """One request's run: submit, bridge the handle's chunks to the event loop, turn them into text pieces."""

    def __init__(self, state: ServerState, prompt_ids: list[int], max_tokens: int, p: Params):
        from dpara_rt.serving.scheduler import QueueFull
        from dpara_rt.serving.text import StopStrings
        self.state, self.prompt_ids, self.params = state, prompt_ids, p
        # no seed: greedy needs none, sampling gets a fresh one (as OpenAI's API samples anew each call)
        seed = p.seed if p.seed is not None else (0 if p.temperature == 0 else secrets.randbits(63))
        try:
            self.handle = state.scheduler.submit(prompt_ids, max_tokens, temperature=p.temperature, top_p=p.top_p,
                                                 top_k=p.top_k, seed=seed, stop_ids=state.stop_ids)
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        except ValueError as e:
            raise bad(str(e)) from None
        except RuntimeError as e:
            raise APIError(503, f"the server is shutting down: {e}", type="server_error",
                           code="shutting_down") from None
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.gone = False  # the client disconnected
        self._polled = time.perf_counter()
        self._stops = StopStrings(p.stop)
        self._decoder = state.tokenizer.decoder(prompt_ids)
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._quit = threading.Event()
        state.live.add(self)
        threading.Thread(target=self._pump, name=f"dpara-rt-serve-{self.handle.id}", daemon=True).start()

    def _pump(self) -> None:
        """Reader thread: the handle's chunks (then None, or the error) into the asyncio queue."""
        put = lambda item: self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        try:
            while True:
                try:
                    chunk = self.handle.next(timeout=1.0)
                except queue.Empty:
                    if self._quit.is_set():
                        return
                    continue
                except BaseException as e:  # the request's error
                    put(e)
                    return
                put(chunk)
                if chunk is None:
                    return
        except RuntimeError:  # the event loop is gone (server stopped)
            return

    def cancel(self) -> None:
        self.handle.cancel()

    def close(self) -> None:
        if self.finish_reason is None:  # left early: client gone, or an error on our side
            self.handle.cancel()
            self.finish_reason = "abort"
        self._quit.set()
        if self in self.state.live:
            self.state.live.discard(self)
            f = self.state.finish
            f[self.finish_reason] = f.get(self.finish_reason, 0) + 1
            self.state.e2e.observe(time.perf_counter() - self.t0)

    async def _next(self, request) -> object:
        """The next queue item; checks every POLL_S that the client is still there (cancelling the request if
        it went away)."""
        getter = asyncio.ensure_future(self._queue.get())
        try:
            while True:
                wait = self._polled + POLL_S - time.perf_counter()
                if wait > 0:
                    done, _ = await asyncio.wait({getter}, timeout=wait)
                    if done:
                        return getter.result()
                self._polled = time.perf_counter()
                if request is not None and await request.is_disconnected():
                    self.handle.cancel()
                    self.gone = True
                    return _GONE
        finally:
            if not getter.done():
                getter.cancel()

    async def pieces(self, request) -> AsyncIterator[tuple[str, list[int]]]:
        """(text, token ids) as chunks are committed; `finish_reason` is set when this ends."""
        halt = self.state.halt
        while True:
            item = await self._next(request)
            if item is _GONE:
                self.finish_reason = "abort"
                return
            if isinstance(item, BaseException):
                self.finish_reason, self.error = "error", item
                return
            if item is None:
                text = self._stops.feed(self._decoder.flush())[0]
                if self._stops.hit is None:
                    text += self._stops.flush()
                if text:
                    yield text, []
                reason = self.handle.finish_reason
                self.finish_reason = "stop" if self._stops.hit else {"stop": "stop", "length": "length"}.get(
                    reason, "abort")
                return
            if self.t_first is None:
                self.t_first = time.perf_counter()
                self.state.ttft.observe(self.t_first - self.t0)
            self.token_ids += item
            visible = [t for t in item if t not in halt]
            text, stopped = self._stops.feed(self._decoder.push(visible))
            if text or stopped:
                yield text, item
            else:
                yield "", item
            if stopped:
                self.handle.cancel()  # frees the slot now; the text past the stop string is dropped
                self.finish_reason = "stop"
                return

    @property
    def usage(self) -> dict:
        return usage(len(self.prompt_ids), len(self.token_ids))


# ---------------------------------------------------------------------------------------------- the app
def create_app(scheduler, tokenizer, model_name: str = "dpara-rt", *, max_model_len: int | None = None,
               default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS, max_body_bytes: int = MAX_BODY_BYTES,
               chat_template: str | None = None, aliases=()):
    """An OpenAI-compatible FastAPI app over `scheduler` (which the caller owns and closes).

    `tokenizer` is a TextTokenizer or anything TextTokenizer.wrap takes (the embedded pair's CodeTokenizer).
    `chat_template` (Jinja source) replaces the tokenizer's; without any, chat requests get a 400 saying so.
    ``app.state.server`` is the :class:`ServerState` (``draining``, ``cancel_all()``)."""
    state = ServerState(scheduler, tokenizer, model_name, max_model_len, default_max_tokens, max_body_bytes, aliases)
    if chat_template is not None:
        state.tokenizer.chat_template, state.tokenizer._compiled = chat_template, None
    app = FastAPI(title="dpara-rt", description="OpenAI-compatible server over a DPara speculative decoder",
                  docs_url=None, redoc_url=None)
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return state.error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        msg = f"{request.method} {request.url.path}: {e.detail}"
        return state.error(APIError(e.status_code, msg, type=kind))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e):
        return state.error(bad(f"invalid request: {e.errors()!r:.300}"))

    @app.exception_handler(Exception)
    async def _internal(request, e):
        return state.error(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    async def read_json(request: Request) -> dict:
        if state.draining:
            raise APIError(503, "the server is shutting down; it takes no new requests", type="server_error",
                           code="shutting_down")
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > state.max_body_bytes:
            raise APIError(413, f"request body of {size} bytes exceeds {state.max_body_bytes}",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():  # a body sent without a length stops at the limit, not in memory
            size += len(chunk)
            if size > state.max_body_bytes:
                raise APIError(413, f"request body of more than {state.max_body_bytes} bytes; expected at most "
                               f"{state.max_body_bytes}", code="request_too_large")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad(f"We could not parse the JSON body of your request: {e}", code="invalid_json") from None
        except RecursionError:
            raise bad(f"the JSON body of your request is nested too deeply; expected at most {MAX_JSON_DEPTH} "
                      "levels", code="invalid_json") from None
        if not isinstance(body, dict):
            raise bad(f"the request body is a JSON {type(body).__name__}; expected an object", code="invalid_json")
        check_json_value(body)
        return body

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = lambda name: {"id": name, "object": "model", "created": state.created, "owned_by": "dpara-rt",
                             "max_model_len": state.max_model_len}
        return {"object": "list", "data": [card(n) for n in state.names]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model not in state.names:
            raise APIError(404, f"The model `{model}` does not exist", param="model", code="model_not_found")
        return {"id": model, "object": "model", "created": state.created, "owned_by": "dpara-rt",
                "max_model_len": state.max_model_len}

    @app.get("/metrics")
    async def metrics():
        sched = scheduler.metrics()
        derived = {}
        if sched.get("drafts"):
            derived["tau"] = 1 + sched.get("accepted_tokens", 0) / sched["drafts"]
        last = getattr(scheduler.engine, "last_stats", None)
        derived["overlap_efficiency"] = getattr(last, "overlap_efficiency", float("nan"))
        derived["running"] = len(state.live)
        server = {
            "server_requests_total": ("counter", "Requests the HTTP server finished, by finish_reason.",
                                      {(("finish_reason", k),): v for k, v in state.finish.items()}),
            "server_http_errors_total": ("counter", "Error responses, by HTTP status.",
                                         {(("status", str(k)),): v for k, v in state.http_errors.items()}),
            "server_requests_in_flight": ("gauge", "Requests the HTTP server is serving now.", len(state.live)),
        }
        hists = {"time_to_first_token_seconds": (state.ttft, "Time from submission to the first token."),
                 "e2e_request_latency_seconds": (state.e2e, "Time from submission to the end of the request.")}
        return PlainTextResponse(prom.render(sched, server, hists, state.names[0], derived),
                                 media_type=prom.CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        model_name = check_model(body, state.names)
        p = parse_params(body, chat=False)
        ids, text = prompt_of(body, state.vocab, state.tokenizer.encode)
        max_tokens = state.budget(len(ids), p.max_tokens, DEFAULT_MAX_TOKENS)
        gen = Generation(state, ids, max_tokens, p)
        echo = (text if text is not None else state.tokenizer.decode(ids)) if p.echo else ""
        return await respond(request, gen, model_name, chat=False, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        from dpara_rt.serving.text import TextError
        body = await read_json(request)
        model_name = check_model(body, state.names)
        p = parse_params(body, chat=True)
        msgs = messages_of(body)
        kwargs = template_kwargs_of(body)
        if state.tokenizer.chat_template is None:
            raise bad(f"model `{model_name}` has no chat template, so /v1/chat/completions cannot format messages; "
                      "use /v1/completions with a text prompt, or start the server with --chat-template FILE",
                      "messages", code="chat_template_missing")
        try:
            ids = state.tokenizer.encode_chat(msgs, **kwargs)
        except (TextError, TypeError) as e:
            raise bad(str(e), "messages") from None
        if not ids:
            raise bad("the messages render to no tokens", "messages")
        max_tokens = state.budget(len(ids), p.max_tokens, state.default_max_tokens)
        gen = Generation(state, ids, max_tokens, p)
        return await respond(request, gen, model_name, chat=True)

    async def respond(request, gen: Generation, model_name: str, chat: bool, echo: str = ""):
        rid, created = new_id("chatcmpl" if chat else "cmpl"), now()
        obj = "chat.completion" if chat else "text_completion"
        p = gen.params
        if not p.stream:
            try:
                parts = [t async for t, _ in gen.pieces(request)]
            finally:
                gen.close()
            if gen.gone:
                return Response(status_code=499)  # nobody reads it
            if gen.finish_reason == "error":
                raise APIError(500, f"generation failed: {gen.error}", type="server_error")
            text = echo + "".join(parts)
            choice = {"index": 0, "finish_reason": gen.finish_reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if p.return_token_ids:
                choice["token_ids"] = list(gen.token_ids)
            out = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice],
                   "usage": gen.usage}
            if p.return_token_ids:
                out["prompt_token_ids"] = list(gen.prompt_ids)
            return JSONResponse(out)

        def chunk(text: str | None, ids: list[int] | None, finish: str | None, role: bool = False) -> str:
            c = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                c["delta"] = {} if text is None else ({"role": "assistant", "content": text} if role else
                                                      {"content": text})
            else:
                c["text"] = text or ""
            if p.return_token_ids and ids is not None:
                c["token_ids"] = ids
            out = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created, "model": model_name,
                   "choices": [c]}
            if p.include_usage:
                out["usage"] = None
            return f"data: {json.dumps(out)}\n\n"

        async def events():
            try:
                if chat:
                    yield chunk("", [], None, role=True)
                elif echo:
                    yield chunk(echo, [], None)
                async for text, ids in gen.pieces(request):
                    if text or (ids and p.return_token_ids):
                        yield chunk(text, ids, None)
                gen.close()
                if gen.gone:
                    return
                if gen.finish_reason == "error":
                    err = APIError(500, f"generation failed: {gen.error}", type="server_error")
                    state.http_errors[500] = state.http_errors.get(500, 0) + 1
                    yield f"data: {json.dumps(err.body())}\n\n"
                else:
                    yield chunk(None if chat else "", None, gen.finish_reason)
                    if p.include_usage:
                        last = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
                                "model": model_name, "choices": [], "usage": gen.usage}
                        yield f"data: {json.dumps(last)}\n\n"
                yield "data: [DONE]\n\n"
            finally:  # also on a disconnect (the response task is cancelled) or a failed send
                gen.close()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


__all__ = ["Generation", "ServerState", "create_app"]
