"""Continuous batching: requests join a running decode at chosen rounds, leave when they finish (inside a block
too) or are cancelled, and each greedy output equals the same request decoded alone, for every method."""
from __future__ import annotations

import random
import time
import zlib

import pytest
import torch

from dpara_rt.serving.batching import Slots
from dpara_rt.engine import Engine
from dpara_rt.serving.scheduler import Request, RequestHandle, Scheduler
from engine_pairs import predictable_pair

VARIANTS = ["ar", "dspark", "dflash", "psd-pearl", "psd-ssd", "dpara", "dpara-single", "dpara-logits", "auto"]


@pytest.fixture(scope="module")
def pair():
    return predictable_pair()


def _engine(pair, name, max_batch=4, **kw):
    from dpara_rt.methods import variant
    target, drafter = pair
    return Engine(target, drafter, d=4, max_batch=max_batch, **variant(name), **kw)


class Timeline:
    """A scheduler stand-in whose requests become visible at given rounds of the running decode (the decode's
    own count: the consumer's lags the lanes by a round or more), or once every earlier request has ended."""

    def __init__(self, eng, plan):
        self.eng, self.plan = eng, sorted(plan, key=lambda p: p[0])
        self.ended: dict[int, str] = {}

    def visible(self):
        dec = getattr(self.eng._open, "decoder", None)
        rounds = int(dec.state.rounds()) if dec is not None else 0
        idle = rounds > 0 and not bool(dec.running_mask().any())  # every request ended before the next arrived
        return [req for when, req in self.plan if when <= rounds or idle]

    def waiting(self, fits=None):
        return len([r for r in self.visible() if fits is None or fits(r)])

    def take(self, n, fits=lambda r: True):
        out = [r for r in self.visible() if fits(r)][:n]
        self.plan = [(w, r) for w, r in self.plan if r not in out]
        return out

    def finished(self, req, reason, error=None):
        self.ended[req.id] = reason
        req.handle._end(reason, error)

    def should_cancel(self, req):
        return req.handle.cancelled


def _request(i, prompt, max_new, stop_ids=(), eos=(2,)):
    req = Request(prompt, max_new, id=i, stop_ids=tuple(stop_ids), seed=0)
    req.handle, req.stops, req.cache_need = RequestHandle(req), frozenset(eos) | frozenset(stop_ids), 256
    return req


def _run(eng, timeline, batch, cancel_after: dict | None = None, max_batch: int | None = None):
    """Drive Engine.serve; `cancel_after` {request id: chunks}: cancel once that many chunks arrived."""
    slots = Slots(timeline, batch, max_batch)
    chunks = {}
    for new in eng.serve(slots, 256):
        slots.route(new)
        for b, req in slots.rows.items():
            if new[b]:
                chunks[req.id] = chunks.get(req.id, 0) + 1
                if cancel_after and chunks[req.id] == cancel_after.get(req.id):
                    req.handle.cancel()
    return slots


@pytest.mark.parametrize("name", VARIANTS)
def test_joins_and_leaves_keep_every_greedy_output(pair, name):
    eng = _engine(pair, name)
    rng = random.Random(zlib.crc32(name.encode()))  # not hash(): str hashes change with every process
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 64, (rng.randint(2, 12),), generator=g).tolist() for _ in range(7)]
    max_new = [rng.randint(6, 24) for _ in prompts]
    max_new[6] = 60  # still running when it is cancelled
    alone = [eng.generate([p], n).tokens[0] for p, n in zip(prompts, max_new)]
    while len(alone[6]) < 12:  # request 6 must still run when it is cancelled: a prompt without an early EOS
        prompts[6] = torch.randint(3, 64, (5,), generator=g).tolist()
        alone[6] = eng.generate([prompts[6]], max_new[6]).tokens[0]
    # request 3 stops at a stop id of its own that it commits inside a block (not at the block's end)
    stop_at = 5 if len(alone[3]) > 6 else len(alone[3]) - 1
    stop_id = alone[3][stop_at]
    want = list(alone)
    want[3] = alone[3][:alone[3].index(stop_id) + 1]
    plan = [(0, _request(0, prompts[0], max_new[0])), (0, _request(1, prompts[1], max_new[1]))]
    plan += [(rng.randint(1, 6), _request(i, prompts[i], max_new[i], stop_ids=(stop_id,) if i == 3 else ()))
             for i in range(2, 7)]
    reqs = [r for _, r in plan]
    timeline = Timeline(eng, plan)
    slots = _run(eng, timeline, batch=4, cancel_after={6: 2})
    got = {r.id: [t for c in r.handle for t in c] for r in reqs}
    for i in range(6):
        assert got[i] == want[i], (name, i)
    assert got[6] == alone[6][:len(got[6])] and timeline.ended[6] == "cancelled"
    assert timeline.ended[3] == "stop"
    assert slots.joins >= 2  # requests did join a running decode
    assert eng.last_stats.fallback_rate == 0 or name.startswith("psd")


@pytest.mark.parametrize("name", ["ar", "dspark", "psd-pearl", "dpara", "dpara-logits"])
def test_the_batch_grows_while_a_decode_runs(pair, name):
    """A decode that started with one row grows (1 -> 2 -> 4) as requests arrive; every output is unchanged."""
    eng = _engine(pair, name, max_batch=4)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (6, 3, 9, 4, 7)]
    alone = [eng.generate([p], 24).tokens[0] for p in prompts]
    reqs = [_request(i, p, 24) for i, p in enumerate(prompts)]
    timeline = Timeline(eng, [(0, reqs[0]), (2, reqs[1]), (3, reqs[2]), (3, reqs[3]), (4, reqs[4])])
    slots = _run(eng, timeline, batch=1, max_batch=4)
    assert [[t for c in r.handle for t in c] for r in reqs] == alone
    assert slots.batch == 4 and slots.joins >= 3


def test_a_request_alone_in_a_serving_decode_equals_generate(pair):
    eng = _engine(pair, "dpara", max_batch=2)
    prompt = [5, 9, 13, 7]
    req = _request(0, prompt, 30)
    timeline = Timeline(eng, [(0, req)])
    slots = _run(eng, timeline, batch=2)
    assert [t for c in req.handle for t in c] == eng.generate([prompt], 30).tokens[0]
    assert timeline.ended[0] in ("length", "stop") and slots.joins == 0


@pytest.mark.parametrize("name", ["dspark", "dpara"])
def test_scheduler_threads_clients_and_cancels(pair, name):
    eng = _engine(pair, name)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (3, 8, 5, 11, 2, 6, 9, 4)]
    alone = [eng.generate([p], 16).tokens[0] for p in prompts]
    sched = Scheduler(eng)
    try:
        handles = []
        for p in prompts:
            handles.append(sched.submit(p, 16))
            time.sleep(0.005)
        doomed = sched.submit(prompts[0], 200)
        next(iter(doomed))
        doomed.cancel()
        outs = [[t for c in h for t in c] for h in handles]
        assert outs == alone
        assert [t for c in doomed for t in c] is not None and doomed.finish_reason == "cancelled"
        m = sched.metrics()
        assert m["finished"] == len(prompts) and m["cancelled"] == 1 and m["waiting"] == 0
        with pytest.raises(ValueError, match="max_new_tokens"):
            sched.submit([1, 2], 0)
        with pytest.raises(ValueError, match="stop_ids"):
            sched.submit([1, 2], 4, stop_ids=[10 ** 6])
    finally:
        sched.close()
    with pytest.raises(RuntimeError, match="closed"):
        sched.submit([1, 2], 4)


def test_sampled_requests_keep_their_own_stream(pair):
    """A sampled request with a seed draws what it draws alone, whoever joins beside it."""
    eng = _engine(pair, "dpara")
    prompts = [[4, 8, 15], [16, 23, 42, 7]]
    alone = eng.generate([prompts[0]], 20, temperature=1.0, seed=11).tokens[0]
    sched = Scheduler(eng)
    try:
        h = sched.submit(prompts[0], 20, temperature=1.0, seed=11)
        other = sched.submit(prompts[1], 20, temperature=0.7, seed=3)
        assert [t for c in h for t in c] == alone
        list(other)
    finally:
        sched.close()


@pytest.mark.parametrize("name", ["dspark", "dpara-logits", "dpara-hidden"])
def test_a_seeded_request_joining_a_running_decode_draws_what_it_draws_alone(pair, name):
    """The Markov head's random stream of a per-request seed counts the request's own head calls, not the
    decode's: a request that joins after several rounds samples exactly its output alone."""
    eng = _engine(pair, name)
    prompt = [5, 9, 33, 12]
    alone = eng.generate([prompt], 16, temperature=1.0, seed=21).tokens[0]
    g = torch.Generator().manual_seed(7)
    long_prompt = [7, 3, 40]
    while len(eng.generate([long_prompt], 40).tokens[0]) < 30:  # still running when the other joins
        long_prompt = torch.randint(3, 64, (4,), generator=g).tolist()
    early = _request(0, long_prompt, 40)
    late = _request(1, prompt, 16)
    late.temperature, late.seed = 1.0, 21
    timeline = Timeline(eng, [(0, early), (4, late)])
    slots = _run(eng, timeline, batch=2)
    assert slots.joins == 1  # it joined a decode already 4 rounds in
    assert [t for c in late.handle for t in c] == alone


def test_batch_limit_comes_from_memory(pair):
    """Per row: the target's KV cache and the drafter's context cache at max_len, plus two ring slots."""
    from dpara_rt.engine import batch_for_memory
    target, drafter = pair
    c, dc = target.config, drafter.config
    row = (2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4 * 1000
           + 2 * dc.num_layers * dc.num_key_value_heads * dc.head_dim * 4 * 1000 + 2 * 8 * 7 * dc.vocab_size * 4)
    assert batch_for_memory(target, drafter, 1000, d=7, fraction=0.5, available=10 * row) == 5
    assert batch_for_memory(target, None, 1000, available=1) == 1  # always at least one request
    assert batch_for_memory(target, drafter, 1000) >= 1             # from what the machine reports
    with pytest.raises(ValueError, match="fraction = 0"):
        batch_for_memory(target, drafter, 1000, fraction=0)
    eng = _engine(pair, "dpara", max_batch=20)  # no fixed ceiling on the batch
    assert eng.target.max_batch == 20


def test_a_failed_admission_ends_its_request_with_the_error(pair, monkeypatch):
    """An error while a request joins reaches that request's handle (and the others'), not a hang."""
    eng = _engine(pair, "dpara")
    reqs = [_request(0, [5, 6, 7], 20), _request(1, [8, 9], 20)]
    timeline = Timeline(eng, [(0, reqs[0]), (2, reqs[1])])
    prefill = type(eng.target).prefill_row

    def failing(self, b, prompt):
        if prompt == [8, 9]:
            raise RuntimeError("prefill failed for row %d" % b)
        return prefill(self, b, prompt)
    monkeypatch.setattr(type(eng.target), "prefill_row", failing)
    slots = Slots(timeline, 2)
    with pytest.raises(RuntimeError, match="prefill failed"):
        try:
            for new in eng.serve(slots, 256):
                slots.route(new)
        except RuntimeError as e:
            slots.fail(e)
            raise
    assert timeline.ended == {0: "error", 1: "error"}
    with pytest.raises(RuntimeError, match="prefill failed"):
        list(reqs[1].handle)
    assert eng.generate([[5, 6, 7]], 4).tokens  # the engine stays usable
