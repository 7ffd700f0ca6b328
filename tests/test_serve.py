"""`dpara-rt serve`: the OpenAI-compatible server, driven by the official `openai` client against 127.0.0.1.

Greedy responses are checked token for token against the same request run alone through a plain
``Engine.generate``; 32 concurrent clients must each get their own answer (none lost, none duplicated); bad
requests get OpenAI-shaped 4xx errors and leave the server serving; a client that disconnects frees its slot;
SIGTERM drains `dpara-rt serve` and exits 0.
"""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from dpara_rt.engine import Engine
from dpara_rt.serving.scheduler import Scheduler
from dpara_rt.serving.server import ServerThread, create_app

MODEL = "tiny"
TEXT = "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n"
D = 7


@pytest.fixture(scope="module")
def pair():
    from dpara_rt.tools.compare import load_pair
    return load_pair()


@pytest.fixture(scope="module")
def ref(pair):
    """A plain Engine (its own lanes and caches) to run each request alone."""
    tok, target, drafter = pair
    return Engine(target, drafter, method="dpara", d=D, max_batch=1)


@pytest.fixture(scope="module")
def server(pair):
    tok, target, drafter = pair
    sched = Scheduler(Engine(target, drafter, method="dpara", d=D, max_batch=8))
    srv = ServerThread(create_app(sched, tok, MODEL)).start()
    srv.scheduler = sched
    yield srv
    srv.stop()
    sched.close(cancel=True, timeout=30)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def alone(ref, ids, max_tokens):
    """What the request gives alone: the Engine's greedy tokens, cut after the first EOS, and their text."""
    toks = ref.generate([list(ids)], max_tokens, temperature=0.0).tokens[0][:max_tokens]
    eos = set(ref.defaults.eos_ids)
    cut = next((i + 1 for i, t in enumerate(toks) if t in eos), len(toks))
    return toks[:cut]


def text_of(tok, ids, eos):
    return tok.decode([t for t in ids if t not in eos])


def extra(obj, name):
    return (obj.model_extra or {}).get(name)


# ------------------------------------------------------------------------------------------ basics
def test_health_models_and_unknown_path(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_completion_matches_the_request_alone(pair, ref, client):
    tok = pair[0]
    ids = tok.encode(TEXT)
    want = alone(ref, ids, 24)
    r = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=24, temperature=0,
                                  extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert extra(c, "token_ids") == want and extra(r, "prompt_token_ids") == ids
    assert c.text == text_of(tok, want, set(ref.defaults.eos_ids))
    assert c.finish_reason == ("stop" if want[-1] in ref.defaults.eos_ids else "length")
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (len(ids), len(want), len(ids) + len(want))
    # a token-id prompt gives the same completion
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
    assert r2.choices[0].text == c.text


def test_streaming_completion_equals_non_streaming(pair, ref, client, server):
    tok = pair[0]
    want = alone(ref, tok.encode(TEXT), 24)
    chunks = list(client.completions.create(model=MODEL, prompt=TEXT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    body = [c for c in chunks if c.choices]
    assert len(body) >= 2  # speculative rounds arrive as several chunks
    assert "".join(c.choices[0].text for c in body) == text_of(tok, want, set(ref.defaults.eos_ids))
    assert [t for c in body for t in (extra(c.choices[0], "token_ids") or [])] == want
    assert [c.choices[0].finish_reason for c in body][-1] in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want)
    assert len({c.id for c in chunks}) == 1
    # the wire format: server-sent events ending in [DONE]
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"model": MODEL, "prompt": TEXT, "max_tokens": 8, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_stop_strings_and_echo(pair, ref, client):
    tok = pair[0]
    eos = set(ref.defaults.eos_ids)
    full = text_of(tok, alone(ref, tok.encode(TEXT), 32), eos)
    assert len(full) > 12
    stop = full[6:10]
    cut = full[:full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=32, temperature=0, stop=[stop, "\x00never"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    streamed = list(client.completions.create(model=MODEL, prompt=TEXT, max_tokens=32, temperature=0, stop=stop,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=32, temperature=0, echo=True, stop=stop)
    assert r.choices[0].text == TEXT + cut


def test_sampled_requests_with_a_seed_repeat(client):
    kw = dict(model=MODEL, prompt=TEXT, max_tokens=16, temperature=0.8, top_p=0.95, seed=1234,
              extra_body={"top_k": 50})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text


# ------------------------------------------------------------------------------------------ chat
def test_chat_without_a_template_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "chat_template_missing"


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    """A tiny pair whose tokenizer has a Qwen3-like chat template (as in test_text.py)."""
    from engine_pairs import predictable_pair
    from test_text import EOS, IM_END, VOCAB, write_tokenizer

    from dpara_rt.serving.text import TextTokenizer
    tok = TextTokenizer.from_dir(write_tokenizer(tmp_path_factory.mktemp("chat-tok")))
    target, drafter = predictable_pair(vocab=VOCAB, eos=EOS)
    eng = Engine(target, drafter, method="dpara", d=4, max_batch=4, eos_ids=[EOS, IM_END])
    ref = Engine(target, drafter, method="dpara", d=4, max_batch=1, eos_ids=[EOS, IM_END])
    sched = Scheduler(eng)
    srv = ServerThread(create_app(sched, tok, "chat-tiny")).start()
    srv.tok, srv.ref = tok, ref
    yield srv
    srv.stop()
    sched.close(cancel=True, timeout=30)


def test_chat_completion_streaming_and_not(chat_server):
    tok, ref = chat_server.tok, chat_server.ref
    client = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="-", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def fib(n):"}]
    ids = tok.encode_chat(messages)
    want = alone(ref, ids, 20)
    want_text = text_of(tok, want, set(ref.defaults.eos_ids))
    r = client.chat.completions.create(model="chat-tiny", messages=messages, max_tokens=20, temperature=0,
                                       extra_body={"return_token_ids": True})
    m = r.choices[0].message
    assert (m.role, m.content) == ("assistant", want_text) and extra(r.choices[0], "token_ids") == want
    assert r.object == "chat.completion" and r.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model="chat-tiny", messages=messages, max_tokens=20,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want_text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    # content as text parts, and a template kwarg (the template adds an empty think block)
    parts = [{"role": "user", "content": [{"type": "text", "text": "def "}, {"type": "text", "text": "fib(n):"}]}]
    r2 = client.chat.completions.create(model="chat-tiny", messages=parts, max_tokens=4, temperature=0,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                    "return_token_ids": True})
    assert extra(r2, "prompt_token_ids") == tok.encode_chat("def fib(n):", enable_thinking=False)


# ------------------------------------------------------------------------------------------ concurrency
def test_32_concurrent_clients_each_get_their_own_greedy_answer(pair, ref, server):
    from dpara_rt.tools.compare import humaneval_prompts
    tok = pair[0]
    base = humaneval_prompts(tok, 8)
    cases = []
    for i in range(32):
        p = base[i % 8]
        ids = p[: [6, 24, 60, len(p)][i % 4]]
        prompt = ids
        if i % 3 == 0:  # a text prompt: the reference runs what the server encodes it to
            prompt = tok.decode(ids)
            ids = tok.encode(prompt)
        cases.append(dict(ids=ids, prompt=prompt, max_tokens=[3, 9, 17, 30][(i // 4) % 4], stream=i % 2 == 1))
    eos = set(ref.defaults.eos_ids)
    wants = [alone(ref, c["ids"], c["max_tokens"]) for c in cases]
    before = server.scheduler.metrics()
    start = threading.Barrier(32)

    def one(i):
        c = cases[i]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=300)
        kw = dict(model=MODEL, prompt=c["prompt"], max_tokens=c["max_tokens"], temperature=0,
                  extra_body={"return_token_ids": True, "user": f"client-{i}"})
        start.wait()
        if c["stream"]:
            chunks = list(client.completions.create(stream=True, **kw))
            ids = [t for ch in chunks for t in (extra(ch.choices[0], "token_ids") or [])]
            return i, {ch.id for ch in chunks}, "".join(ch.choices[0].text for ch in chunks), ids
        r = client.completions.create(**kw)
        assert extra(r, "prompt_token_ids") == c["ids"]
        return i, {r.id}, r.choices[0].text, extra(r.choices[0], "token_ids")

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert sorted(r[0] for r in results) == list(range(32))
    ids_seen = [next(iter(r[1])) for r in results]
    assert all(len(r[1]) == 1 for r in results) and len(set(ids_seen)) == 32  # one response id each, all distinct
    for (i, _, text, toks), want in zip(results, wants):
        assert toks == want, f"client {i} got {toks}, alone {want}"
        assert text == text_of(tok, want, eos), f"client {i}"
    after = server.scheduler.metrics()
    assert after["requests"] - before["requests"] == 32
    assert after["completion_tokens"] - before["completion_tokens"] == sum(map(len, wants))


# ------------------------------------------------------------------------------------------ bad requests
BAD = [  # (body, status, param)
    ("{not json", 400, None),
    ("[1, 2]", 400, None),
    ({"model": "no-such-model", "prompt": "x"}, 404, "model"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "top_k": -5}, 400, "top_k"),
    ({"model": MODEL, "prompt": "x", "n": 2}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ({"model": MODEL, "prompt": "x", "stop": 7}, 400, "stop"),
    ({"model": MODEL, "prompt": "x", "seed": -1}, 400, "seed"),
    ({"model": MODEL, "prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, 2, 10 ** 9]}, 400, "prompt"),
    ({"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x" * 20000, "max_tokens": 4}, 400, "prompt"),   # over-long prompt
    ({"model": MODEL, "prompt": "x", "max_tokens": 10 ** 6}, 400, "max_tokens"),  # over the context
]


def test_a_burst_of_malformed_requests_leaves_the_server_serving(server, client):
    before = server.scheduler.metrics()["requests"]

    def send(case):
        body, status, param = case
        content = body if isinstance(body, str) else json.dumps(body)
        r = httpx.post(server.url + "/v1/completions", content=content,
                       headers={"content-type": "application/json"}, timeout=60)
        return r, status, param

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(send, BAD * 3))
    for r, status, param in results:
        assert r.status_code == status, (r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["param"] == param, (param, err)
    assert server.scheduler.metrics()["requests"] == before  # none reached the scheduler
    big = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "' + b"x" * (2 << 20) + b'"}',
                     headers={"content-type": "application/json"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    bad_chat = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "x"}]})
    assert bad_chat.status_code == 400 and bad_chat.json()["error"]["param"] == "messages[0].role"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=3)
    r = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0)  # still serving
    assert r.usage.completion_tokens >= 1
    assert httpx.get(server.url + "/health").status_code == 200


def _huge_chunks(total: int, piece: int = 1 << 16):
    """A JSON body of `total` bytes sent chunked, without a content-length."""
    yield b'{"prompt": "'
    for _ in range(total // piece):
        yield b"x" * piece
    yield b'"}'


HOSTILE = {  # name: (body, or None for a chunked one over the limit; status; code or param)
    "nested 100000 deep": (b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json"),
    "nested objects": (b'{"prompt": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_001, 400, "invalid_json"),
    "nested under the parser's limit": (b'{"prompt": ' + b"[" * 900 + b"]" * 900 + b"}", 400, "invalid_json"),
    "nested in messages": (b'{"messages": [{"role": "user", "content": [' + b"[" * 500 + b"]" * 500 + b"]}]}", 400,
                           "invalid_json"),
    "over 1 MiB with a length": (b'{"prompt": "' + b"x" * ((1 << 20) + 1) + b'"}', 413, "request_too_large"),
    "over 1 MiB chunked": (None, 413, "request_too_large"),
    "not UTF-8": (b'{"model": "tiny", "prompt": "\xff\xfe\xfa"}', 400, "invalid_json"),
    "Latin-1": ('{"model": "tiny", "prompt": "caf\u00e9"}'.encode("latin-1"), 400, "invalid_json"),
    "a lone surrogate": (b'{"model": "tiny", "prompt": "\\ud800 x"}', 400, "invalid_json"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_body_is_a_4xx_and_the_server_keeps_serving(server, client, name):
    content, status, code = HOSTILE[name]
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = _huge_chunks(2 << 20) if content is None else content
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == status, (name, path, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"] and "\n" not in err["message"]
        assert code in (err["code"], err["param"]), (name, path, err)
    r = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0)  # still serving
    assert r.usage.completion_tokens >= 1


# ------------------------------------------------------------------------------------------ disconnects
def _wait(pred, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_a_client_that_disconnects_frees_its_slot(server, client):
    sched, state = server.scheduler, server.app.state.server
    before = sched.metrics()["cancelled"]
    # streaming: read one event, then hang up
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"model": MODEL, "prompt": TEXT, "max_tokens": 3500, "temperature": 0, "stream": True}) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    assert _wait(lambda: sched.metrics()["cancelled"] >= before + 1), sched.metrics()
    # non-streaming: the client gives up waiting
    try:
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": TEXT, "max_tokens": 3500, "temperature": 0},
                       timeout=httpx.Timeout(10.0, read=1.0))
    except httpx.ReadTimeout:
        pass
    else:
        pytest.fail(f"a 3500-token request answered within 1 s: {r.status_code} {r.text[:300]}")
    assert _wait(lambda: sched.metrics()["cancelled"] >= before + 2), sched.metrics()
    assert _wait(lambda: not state.live)
    t0 = time.monotonic()
    r = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and time.monotonic() - t0 < 30


# ------------------------------------------------------------------------------------------ metrics
LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? '
                  r'(-?[0-9.e+-]+|NaN|[+-]Inf)$')


def parse_metrics(text: str) -> dict:
    out, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name not in types, f"TYPE twice for {name}"
            types[name] = kind
            continue
        if not line or line.startswith("#"):
            continue
        m = LINE.match(line)
        assert m, f"not Prometheus text: {line!r}"
        key = line.rsplit(" ", 1)[0]
        assert key not in out, f"duplicate series {key}"
        out[key] = float(m.group(4))
    return out


def test_metrics_parse_and_carry_the_spec_decode_counters(server, client):
    client.completions.create(model=MODEL, prompt=TEXT, max_tokens=16, temperature=0)
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = parse_metrics(r.text)
    get = lambda name, **labels: m[name + "{" + ",".join(f'{k}="{v}"' for k, v in
                                                         {"model_name": MODEL, **labels}.items()) + "}"]
    sched = server.scheduler.metrics()
    assert get("dpara_rt_spec_decode_num_drafts_total") > 0
    assert get("dpara_rt_spec_decode_num_draft_tokens_total") >= get("dpara_rt_spec_decode_num_accepted_tokens_total")
    assert get("dpara_rt_spec_decode_num_accepted_tokens_total") > 0
    assert get("dpara_rt_spec_decode_num_accepted_tokens_per_pos_total", position="1") >= \
        get("dpara_rt_spec_decode_num_accepted_tokens_per_pos_total", position="2")
    assert get("dpara_rt_requests_total") >= sched["requests"] - 1
    assert get("dpara_rt_tau") >= 1
    for name in ("dpara_rt_fallbacks_total", "dpara_rt_overlap_efficiency", "dpara_rt_num_requests_waiting",
                 "dpara_rt_num_requests_running", "dpara_rt_generation_tokens_total"):
        get(name)
    assert get("dpara_rt_time_to_first_token_seconds_count") >= 1
    assert get("dpara_rt_server_requests_total", finish_reason="length") >= 1


# ------------------------------------------------------------------------------------------ shutdown
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sigterm_drains_then_cancels_and_exits_0(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "dpara_rt.tools.cli", "serve", "--port", str(port), "--grace", "1.5",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert _wait(lambda: _ok(url + "/health"), timeout=120), "server did not come up"
        events, first = [], threading.Event()

        def stream():
            with httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={"model": MODEL, "prompt": TEXT, "max_tokens": 3500, "temperature": 0, "stream": True}) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert not t.is_alive()
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "abort"  # cut at the grace period
        rc = proc.wait(60)
        out = proc.stdout.read()
        assert rc == 0, out
        assert "stopped" in out
        assert not _ok(url + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _ok(url) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
