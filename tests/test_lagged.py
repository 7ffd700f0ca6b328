"""Lagged rounds (round/lagged.py; DPara, DSpark and AR): with a static verify the host reads round k while round k+1 is
queued, and the output is the unlagged round's, bit for bit, greedy and sampled, with requests stopping at
different rounds."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dpara_rt import _core
from dpara_rt.core import slot_tensor
from dpara_rt.engine import Engine
from dpara_rt.methods import dpara
from dpara_rt.models import kv_cache
from dpara_rt.round import lagged
from dpara_rt.round.sync_guard import HostWaits
from engine_pairs import predictable_pair

PROMPTS = [[1, 5, 9, 3], [4, 4, 7], [9, 2], [6, 1, 1, 8, 3]]


@pytest.fixture(scope="module")
def pair():
    return predictable_pair(eos=2)


def _engine(pair, temperature: float, verify_mode: str, method: str = "dpara") -> Engine:
    target, drafter = pair
    return Engine(target, drafter if method != "ar" else None, method=method, d=4, drafting="device",
                  drafter_worker="thread", temperature=temperature, verify_mode=verify_mode)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", ["ar", "dspark", "dflash", "dpara"])
def test_lagged_rounds_give_the_unlagged_tokens_and_stats(pair, torch_path, monkeypatch, method, temperature):
    monkeypatch.setattr(kv_cache, "WINDOW", 1)  # the drafter's context window: the host's longest + ahead, exactly
    settled = []
    settle = lagged.LaggedRounds.settle
    monkeypatch.setattr(lagged.LaggedRounds, "settle", lambda self, p: settled.append(p.round) or settle(self, p))
    runs = {}
    for mode in ("static", "eager"):
        eng = _engine(pair, temperature, mode, method)
        out = eng.generate(PROMPTS, 37, seed=5)  # 37: max_new_tokens lands inside a block
        runs[mode] = out.tokens, out.stats.rounds, out.stats.acceptance_histogram, out.stats.fallback_rate
        eng.close()
        if mode == "static":
            assert settled == list(range(1, out.stats.rounds + 1)), settled  # every round read once, in order
    assert runs["static"] == runs["eager"]
    lengths = {len(t) for t in runs["static"][0]}
    assert len(lengths) > 1 or temperature > 0, lengths  # greedy: requests stop at different rounds (EOS)


@pytest.mark.parametrize("method", ["ar", "dspark", "dpara"])
def test_the_host_reads_a_round_after_the_next_is_queued(pair, torch_path, monkeypatch, method):
    events = []
    verify, settle = lagged.LaggedRounds.verify, lagged.LaggedRounds.settle
    monkeypatch.setattr(lagged.LaggedRounds, "verify",
                        lambda self, draft: events.append(("queue", draft.round)) or verify(self, draft))
    monkeypatch.setattr(lagged.LaggedRounds, "settle",
                        lambda self, p: events.append(("read", p.round)) or settle(self, p))
    eng = _engine(pair, 0.0, "static", method)
    eng.generate(PROMPTS, 24)
    eng.close()
    queued = [r for what, r in events if what == "queue"]
    assert queued == list(range(1, len(queued) + 1))
    for i, (what, r) in enumerate(events):
        if what == "read":
            assert ("queue", r + 1) in events[:i], events  # round r is read once round r + 1 is queued


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", ["ar", "dspark", "dpara"])
def test_the_one_wait_of_a_lagged_round_is_the_read_of_the_round_before(pair, torch_path, method, temperature):
    eng = _engine(pair, temperature, "static", method)
    eng.generate(PROMPTS[:2], 8)
    with HostWaits(sites=True) as w:
        eng.generate(PROMPTS[:2], 40, seed=3)
    eng.close()
    assert w.per_kind() == {("verify", "tolist"): 1.0}, w.table()
    assert set(w.where["verify", "tolist"]) == {next(iter(w.where["verify", "tolist"]))}  # one site


def test_only_a_device_drafting_backend_with_a_static_target_lags(pair, monkeypatch):
    target, drafter = pair
    seen = []
    run_lagged = dpara.run_lagged
    monkeypatch.setattr(dpara, "run_lagged", lambda dec, first: seen.append(1) or run_lagged(dec, first))
    for kw, lags in ((dict(verify_mode="static", drafting="device"), True),
                     (dict(verify_mode="eager", drafting="device"), False),
                     (dict(verify_mode="static", drafting="host"), False)):
        seen.clear()
        eng = Engine(target, drafter, method="dpara", d=4, drafter_worker="thread", **kw)
        eng.generate(PROMPTS[:2], 6)
        eng.close()
        assert bool(seen) == lags, kw


def test_accept_on_device_is_the_round_states_greedy_acceptance():
    g = torch.Generator().manual_seed(0)
    B, d, V = 64, 5, 11
    block = torch.randint(0, V, (B, d + 1), generator=g)
    argmax = torch.randint(0, V, (B, d + 1), generator=g)
    argmax[:, :-1] = block[:, 1:]  # row b's draft predicted up to b % (d + 1), then missed
    for b in range(B):
        if b % (d + 1) < d:
            argmax[b, b % (d + 1)] = (block[b, b % (d + 1) + 1] + 1) % V
    r, bonus = lagged.accept_on_device(block, argmax)
    state = _core.RoundState(B, d, 1000, [], 10_000)
    state.start(np.full(B, 3, np.int64), block[:, 0].numpy().copy(), np.zeros(B, np.int64))
    want_r, want_bonus, *_ = state.accept(block.numpy(), argmax.numpy(), None, None, -1, _core.Metrics(d))
    assert set(r.tolist()) == set(range(d + 1))
    assert r.tolist() == want_r.tolist() and bonus.tolist() == want_bonus.tolist()
    r1, b1 = lagged.accept_on_device(block[:, :1], argmax[:, :1])  # an AR block: r = 0, the arg-max
    assert r1.tolist() == [0] * B and b1.tolist() == argmax[:, 0].tolist()


def test_a_ring_slot_can_be_taken_without_host_r():
    ring = _core.BoundaryRing(2, 3, 2, 4)
    slot = ring.acquire()
    slot_tensor(ring, slot).fill_(1.0)
    ring.mark_ready(slot)
    ring.take(slot)
    assert ring.state(slot) == "consumed"
    with pytest.raises(RuntimeError, match=f"cannot take slot {slot}: it is consumed, expected ready"):
        ring.take(slot)
    ring.release(slot)
    assert ring.state(slot) == "free"
