"""The engine and its four methods: greedy outputs equal AR exactly, EOS / max_new_tokens mid-block, ragged
batches, stats, overlap on two host lanes, bad input."""
import json
import re

import pytest
import torch

from dpara_rt.engine import AUTO_TURNS, Engine
from dpara_rt.methods import AUTO_CANDIDATES, VARIANTS, variant, variant_name
from dpara_rt.round.options import ring_for
from dpara_rt.models.autoregressive import generate_ar
from dpara_rt.models.target import Target
from dpara_rt.round.stats import Stats
from engine_pairs import flaky, predictable_pair

SPEC = ["dspark", "psd-pearl", "psd-ssd", "dpara", "dpara-single", "dpara-logits", "dpara-hidden"]


@pytest.fixture(scope="module")
def pair():
    return predictable_pair()


def prompts_for(batch, seed=0, vocab=64, lo=1, hi=12):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (batch,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def ar_reference(target, prompts, max_new, eos=(2,)):
    t = Target(target, len(prompts), 512)
    return generate_ar(t, prompts, max_new, eos_ids=eos)


@pytest.mark.parametrize("name", SPEC)
@pytest.mark.parametrize("batch,d", [(1, 1), (1, 7), (3, 4), (8, 8), (16, 3)])
def test_greedy_equals_ar(pair, name, batch, d):
    target, drafter = pair
    prompts = prompts_for(batch, seed=batch * 31 + d)
    want = ar_reference(target, prompts, 24)
    eng = Engine(target, drafter, d=d, max_len=512, **variant(name))
    out = eng.generate(prompts, max_new_tokens=24)
    assert out.tokens == want
    st = out.stats
    assert 1.0 <= st.tau <= d + 1
    if eng.method == "dpara":
        assert st.fallback_rate == 0.0
    assert sum(st.acceptance_histogram) > 0


@pytest.mark.parametrize("name", ["ar", "dspark", "dpara"])
def test_a_round_verifies_in_one_core_call_straight_into_the_staging(pair, name, monkeypatch):
    """On the host each verify of a decode is one call of the target's verify plan (host_qwen3_verify), and its
    features are written where the drafter reads them: nothing copies them into the staging."""
    from dpara_rt import _core
    runs, copies = [], []
    run, copy_in = _core.HostQwen3Verify.run, _core.Staging.copy_in
    monkeypatch.setattr(_core.HostQwen3Verify, "run", lambda *a, **k: runs.append(1) or run(*a, **k))
    monkeypatch.setattr(_core.Staging, "copy_in",
                        lambda staging, lane, region, *a: copies.append(region) or copy_in(staging, lane, region, *a))
    target, drafter = pair
    prompts = prompts_for(2, seed=3)
    eng = Engine(target, drafter if name != "ar" else None, method=name, max_len=512)
    out = eng.generate(prompts, max_new_tokens=24)
    eng.close()
    assert out.tokens == ar_reference(target, prompts, 24)
    assert len(runs) == out.stats.rounds > 0
    assert "features" not in copies
    # the draft does go through copy_in; (r, bonus) reach the head as the round state's own host arrays
    assert name != "dspark" or set(copies) == {"draft"}


def test_generate_takes_the_rounds_at_the_end_and_a_stream_each_round(pair, monkeypatch):
    """generate() wants the tokens only at the end: the lanes hand them over once, never waking the caller's
    thread mid-decode; stream() gets them round by round. The tokens are the same."""
    from dpara_rt.round.chain import Chain
    handed = []
    flush = Chain.flush
    monkeypatch.setattr(Chain, "flush", lambda self: handed.append(len(self._held)) or flush(self))
    target, drafter = pair
    prompts = prompts_for(2, seed=5)
    eng = Engine(target, drafter, method="dspark", max_len=512)
    out = eng.generate(prompts, max_new_tokens=24)
    assert [n for n in handed if n] == [out.stats.rounds]  # every round's tokens, in one hand-over
    handed.clear()
    streamed = [[] for _ in prompts]
    for new in eng.stream(prompts, max_new_tokens=24):
        for row, t in zip(streamed, new):
            row.extend(t)
    assert streamed == out.tokens
    assert len([n for n in handed if n]) > 1


def test_acceptance_is_ragged_and_nontrivial(pair):
    """The pair exercises every path: some rounds accept nothing, some accept many."""
    target, drafter = pair
    out = Engine(target, drafter, method="dpara", d=6).generate(prompts_for(8, seed=5), max_new_tokens=40)
    hist = out.stats.acceptance_histogram
    assert hist[0] > 0 and sum(hist[3:]) > 0, hist
    assert 1.5 < out.stats.tau < 7


@pytest.mark.parametrize("method", ["ar", "dspark", "psd", "dpara"])
def test_eos_and_max_new_tokens_inside_a_block(pair, method):
    target, drafter = pair
    prompts = prompts_for(6, seed=11)
    # An EOS id that the greedy continuations hit mid-way: take a token AR produces at step 3 of request 0.
    plain = ar_reference(target, prompts, 30, eos=())
    eos = plain[0][3]
    want = ar_reference(target, prompts, 13, eos=(eos,))
    assert want[0] == plain[0][:4]                           # request 0 stops on the EOS, EOS included
    assert any(len(w) == 13 for w in want)                   # another stops exactly at max_new_tokens
    eng = Engine(target, drafter if method != "ar" else None, method=method, d=7, eos_ids=[eos])
    out = eng.generate(prompts, max_new_tokens=13)
    assert out.tokens == want


def test_streaming_yields_rounds_that_add_up(pair):
    target, drafter = pair
    prompts = prompts_for(3, seed=2)
    eng = Engine(target, drafter, method="dpara", d=5)
    chunks = list(eng.stream(prompts, max_new_tokens=20))
    assert len(chunks) == eng.last_stats.rounds + 1                 # prefill's token, then one per round
    joined = [sum((c[b] for c in chunks), []) for b in range(3)]
    assert joined == ar_reference(target, prompts, 20)
    assert any(len(c[0]) > 1 for c in chunks[1:])                  # rounds commit several tokens at once


def test_stats_and_trace(pair):
    target, drafter = pair
    out = Engine(target, drafter, method="dpara", d=4).generate(prompts_for(2, seed=3), max_new_tokens=16,
                                                                 trace=True)
    st = out.stats
    assert st.rounds > 0 and st.new_tokens == sum(map(len, out.tokens))
    assert st.verify_ms > 0 and st.backbone_ms > 0 and st.markov_head_ms > 0
    assert len(st.accept_per_position) == 4
    assert all(a >= b for a, b in zip(st.accept_per_position, st.accept_per_position[1:]))
    events = json.loads(st.trace)
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e.get("name") for e in events}
    assert {"verify", "backbone", "markov_head"} <= names


def test_links_are_named_for_a_profiler_on_their_lane_only(pair, monkeypatch):
    """A link enters torch.profiler.record_function(phase) only where the profiler records its thread (as
    bench/profile_round.py enables it on a lane): the operators then sit under the link's name, and with no
    profiler on no link pays for a record_function."""
    target, drafter = pair
    eng = Engine(target, drafter, method="dspark", d=4)
    entered = []
    real = torch.profiler.record_function
    monkeypatch.setattr(torch.profiler, "record_function", lambda name: entered.append(name) or real(name))
    eng.generate(prompts_for(1, seed=4), max_new_tokens=12)
    assert entered == []
    lane = eng.lanes[0]  # the target lane
    prof = torch.autograd.profiler.profile()
    lane.submit(prof.__enter__)
    lane.synchronize()
    try:
        eng.generate(prompts_for(1, seed=4), max_new_tokens=12)
    finally:
        lane.submit(lambda: prof.__exit__(None, None, None))
        lane.synchronize()
    assert "verify" in entered and "serial_draft" not in entered  # the drafter lane's links were not recorded
    assert "verify" in {e.name for e in prof.function_events}


def test_psd_counts_fallbacks_and_dpara_never_falls_back(pair):
    target, drafter = pair
    prompts = prompts_for(8, seed=9)
    pearl = Engine(target, drafter, method="psd", psd_policy="pearl", d=6).generate(prompts, 32).stats
    dp = Engine(target, drafter, method="dpara", d=6).generate(prompts, 32).stats
    assert 0 < pearl.fallback_rate <= 1
    assert dp.fallback_rate == 0


@pytest.mark.parametrize("name", ["dpara-logits", "dpara-hidden"])
def test_greedy_dpara_verifies_s0_alone_beside_branch_0_and_drafts_nothing_serially(pair, name, monkeypatch):
    """Greedy, DPara's round 1 verifies s_0 alone (one token a row) while the drafter absorbs the prompt and fills
    branch 0 of a slot (a spine of one token); every later round verifies a draft of the ring and no round is drafted
    serially. Sampled, round 1 is a serial draft (a seeded request's draws must not depend on when it starts)."""
    from dpara_rt.round.decoder import Decoder
    from dpara_rt.models.drafter import Drafter
    target, drafter = pair
    blocks, spines = [], []
    accept, boundary = Decoder.accept, Drafter.boundary_logits
    monkeypatch.setattr(Decoder, "accept", lambda self, v: blocks.append(tuple(v.block.shape)) or accept(self, v))
    monkeypatch.setattr(Drafter, "boundary_logits", lambda self, cache, spine, *a, **k: spines.append(spine.shape[1])
                        or boundary(self, cache, spine, *a, **k))
    eng = Engine(target, drafter, d=4, drafter_worker="thread", **variant(name))
    prompts = prompts_for(3, seed=5)

    def phases(out):
        events = json.loads(out.stats.trace)
        return {e.get("name") for e in (events["traceEvents"] if isinstance(events, dict) else events)}
    out = eng.generate(prompts, 24, trace=True)
    assert out.tokens == ar_reference(target, prompts, 24)
    assert blocks[0] == (3, 1) and len(blocks) > 2 and set(blocks[1:]) == {(3, 5)}
    assert spines[0] == 1 and set(spines[1:]) == {5}
    assert "first_round" in phases(out) and "serial_draft" not in phases(out)
    blocks.clear()
    sampled = eng.generate(prompts, 12, temperature=1.0, seed=3, trace=True)
    assert "serial_draft" in phases(sampled) and blocks[0] == (3, 5)


@pytest.mark.perf
def test_overlap_is_real_on_two_host_lanes():
    """A target much wider than its drafter: the backbone must hide under verification on two cores."""
    target, drafter = predictable_pair(hidden=256, layers=8, inter=1024, vocab=256)
    prompts = prompts_for(4, seed=4, vocab=256, lo=20, hi=40)
    eng = Engine(target, drafter, method="dpara", d=7)
    eng.generate(prompts, 8)                       # warm-up
    st = eng.generate(prompts, 48).stats
    assert st.overlap_efficiency > 0.5, st
    assert st.exposed_draft_ms < st.backbone_ms, st


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="beam"), "method 'beam'"),
    (dict(d=0), "d = 0"),
    (dict(d=33), "d = 33"),
    (dict(d=2.5), "d = 2.5"),
    (dict(seed=-1), "seed = -1"),
    (dict(temperature=float("inf")), "temperature = inf"),
    (dict(temperature=-0.5), "temperature = -0.5"),
    (dict(placement="everywhere"), "placement 'everywhere'"),
    (dict(max_batch=0), "max_batch = 0"),
    (dict(max_batch=2.5), "max_batch = 2.5; expected an int"),
    (dict(threads_per_lane=0), "threads_per_lane = 0"),
    (dict(psd_policy="oracle", method="psd"), "psd_policy 'oracle'"),
    (dict(dpara_ring="tokens"), "dpara_ring 'tokens'"),
    (dict(method="psd", psd_policy="ssd", ssd_fanout=65), "ssd_fanout = 65; expected an int in 1..64"),
    (dict(eos_ids=2), "eos_ids = 2; expected a list"),
    (dict(eos_ids=["2"]), "eos_ids holds '2'"),
    (dict(max_len=10 ** 9), "max_len = 1000000000; expected at most the model's max_position_embeddings 4096"),
])
def test_bad_engine_arguments(pair, kwargs, match):
    target, drafter = pair
    with pytest.raises(ValueError, match=match):
        Engine(target, drafter, **kwargs)


def test_bad_requests_fail_before_work(pair):
    target, drafter = pair
    eng = Engine(target, drafter, method="dpara", d=4, max_batch=4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        eng.generate([[5, 6], []], 8)
    with pytest.raises(ValueError, match="exceeds max_batch 4"):
        eng.generate(prompts_for(5), 8)
    with pytest.raises(ValueError, match="max_new_tokens = 0"):
        eng.generate([[5]], 0)
    for bad, shown in ((5.7, "5.7 (float)"), (True, "True (bool)"), (b"x", "b'x' (bytes)")):
        with pytest.raises(ValueError, match=rf"prompt 0 holds {re.escape(shown)}; expected int token ids"):
            eng.generate([[5, bad]], 4)
    assert eng.generate([iter([5, 6, 7])], 6).tokens == ar_reference(target, [[5, 6, 7]], 6)  # read once
    # The engine still works after refusing.
    assert eng.generate([[5, 6, 7]], 6).tokens == ar_reference(target, [[5, 6, 7]], 6)


def test_drafter_must_match_target(pair):
    target, _ = pair
    _, other = predictable_pair(vocab=96)
    with pytest.raises(ValueError, match="vocab size mismatch"):
        Engine(target, other, method="dpara")
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(target, None, method="dspark")


def test_auto_picks_a_method_per_batch_size_and_stays_exact(pair):
    target, drafter = pair
    eng = Engine(target, drafter, method="auto", d=5)
    for batch in (1, 4):
        prompts = prompts_for(batch, seed=20 + batch)
        out = eng.generate(prompts, 20)
        assert out.tokens == ar_reference(target, prompts, 20)
        assert eng.auto_choices[batch] in AUTO_CANDIDATES
        assert out.stats.method == f"auto({eng.auto_choices[batch]})"


def test_auto_times_its_candidates_over_its_own_budget_whatever_the_first_call_asks(pair):
    """A first call of 3 tokens (a warm-up) does not shrink the probe: each candidate runs 8 (d + 1) tokens, so a
    speculative one is timed past its serially drafted first round; the call itself still gets its 3 tokens."""
    target, drafter = pair
    eng = Engine(target, drafter, method="auto", d=5)
    budgets = []
    decode = eng._decode

    def recording(ticket, method, opts, prompts, trace, admission=None, stream=True):
        budgets.append(opts.max_new_tokens)
        return decode(ticket, method, opts, prompts, trace, admission, stream)
    eng._decode = recording
    prompts = prompts_for(1, seed=8)
    out = eng.generate(prompts, 3)
    assert budgets[:-1] == [8 * (5 + 1)] * (AUTO_TURNS * len(AUTO_CANDIDATES)) and budgets[-1] == 3
    assert out.tokens == ar_reference(target, prompts, 3)


@pytest.mark.parametrize("fastest", ["ar", "dspark", "dpara-logits", "dpara-hidden"])
def test_auto_keeps_the_candidate_with_the_least_time_per_committed_token(pair, fastest):
    """The rule itself, on recorded measurements: (verify + exposed draft) / tau, each candidate's best of its
    turns. AR is a candidate: where verification is compute-bound, speculation loses to it."""
    target, drafter = pair
    eng = Engine(target, drafter, method="auto", d=5)
    turns = dict.fromkeys(AUTO_CANDIDATES, 0)

    def measured(ticket, method, opts, prompts, trace, admission=None, stream=True):
        name = eng._variant(method, opts)
        turns[name] += 1
        # Speculative candidates: 5 ms a round at tau 2.5 (2 ms a token); AR: 1.9 ms a token, slower
        # on its first turn. The fastest one is made cheaper on its last turn only (the best turn counts).
        per_round, tau = (1.9, 1.0) if name == "ar" else (5.0, 2.5)
        if name == "ar" and turns[name] == 1:
            per_round = 9.0
        if name == fastest and turns[name] == AUTO_TURNS:
            per_round *= 0.5
        eng.last_stats = Stats(method=name, batch=len(prompts), d=opts.d, temperature=0.0, tau=tau,
                               verify_ms=per_round - 1.0, exposed_draft_ms=1.0)
        yield from ()

    eng._decode = measured
    choice = eng.auto_choice(prompts_for(2, seed=3), eng.options(20), ticket=None)
    assert choice == fastest and eng.auto_choices == {2: fastest}
    assert turns == {name: AUTO_TURNS for name in ("ar", "dspark", "dpara-logits", "dpara-hidden")}


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_a_failing_round_surfaces_and_leaves_the_engine_usable(pair, worker):
    target, drafter = pair
    eng = Engine(target, flaky(drafter, fail_at=3), method="dpara", d=4, drafter_worker=worker)
    prompts = prompts_for(3, seed=13)
    with pytest.raises(RuntimeError, match="injected backbone failure"):
        eng.generate(prompts, 30)
    assert eng.generate(prompts, 30).tokens == ar_reference(target, prompts, 30)
    eng.close()


def test_abandoning_a_stream_stops_the_rounds(pair):
    target, drafter = pair
    eng = Engine(target, drafter, method="dpara", d=4)
    prompts = prompts_for(2, seed=14)
    stream = eng.stream(prompts, 40)
    next(stream), next(stream)
    stream.close()
    assert eng.generate(prompts, 12).tokens == ar_reference(target, prompts, 12)


def test_per_call_options_leave_the_engine_defaults_alone(pair):
    target, drafter = pair
    eng = Engine(target, drafter, method="dpara", d=3, temperature=0.0, seed=5)
    prompts = prompts_for(2, seed=15)
    sampled = eng.generate(prompts, 16, temperature=1.0, seed=11).tokens
    assert sampled == eng.generate(prompts, 16, temperature=1.0, seed=11).tokens
    assert eng.defaults.temperature == 0.0 and eng.defaults.seed == 5
    assert eng.generate(prompts, 16).tokens == ar_reference(target, prompts, 16)  # greedy again
    assert eng.generate(prompts, 4, temperature=1.0, top_p=0.5, top_k=3).tokens  # truncation is per call too
    assert eng.defaults.top_p == 1.0 and eng.defaults.top_k == 0


def test_the_engine_sizes_its_cache_per_call(pair):
    target, drafter = pair
    eng = Engine(target, drafter, method="dpara", d=4)
    short = eng.generate([[5, 6]], 4)
    assert eng.target.max_len < 600
    prompt = prompts_for(1, seed=16, lo=500, hi=501)[0]
    out = eng.generate([prompt], 120)
    assert eng.target.max_len >= 500 + 120 + 2 * 5
    assert out.tokens == generate_ar(Target(target, 1, 700), [prompt], 120, eos_ids=(2,))
    assert eng.generate([[5, 6]], 4).tokens == short.tokens
    fixed = Engine(target, drafter, method="dpara", d=4, max_len=64)
    with pytest.raises(ValueError, match="needs 70 cache slots, more than max_len 64"):
        fixed.generate([[5] * 40], 20)


def test_every_variant_name_maps_back_to_itself():
    for name, kw in VARIANTS.items():
        assert variant_name(**kw) == name
    assert variant("psd-ssd") == dict(method="psd", psd_policy="ssd")
    with pytest.raises(ValueError, match="unknown method 'beam'"):
        variant("beam")


def test_dpara_picks_its_ring_for_the_drafters_hardware(pair):
    """A host drafter keeps hidden states whatever its dtype (projecting 56 rows on the host outlasts the
    verify); a drafter on a GPU, whose matrix units make the projection cheap, keeps boundary logits; an
    explicit ring stays."""
    import copy
    target, drafter = pair
    eng = Engine(target, drafter, method="dpara", d=4)
    assert (eng.defaults.dpara_ring, eng.name) == ("hidden", "dpara-hidden")
    bf16 = copy.deepcopy(drafter).to(torch.bfloat16)
    assert ring_for(bf16) == "hidden" and ring_for(drafter) == "hidden"
    on_gpu = type("OnGpu", (), {"device": torch.device("cuda", 0), "dtype": torch.bfloat16})()
    assert ring_for(on_gpu) == "logits"
    assert Engine(target, drafter, method="dpara", d=4, dpara_ring="logits").name == "dpara-logits"


@pytest.mark.parametrize("name", ["ar", "dspark", "psd-pearl", "dpara-logits", "dpara-hidden"])
def test_a_new_call_cancels_a_suspended_stream(pair, name):
    target, drafter = pair
    eng = Engine(target, drafter, d=4, **variant(name))
    prompts = prompts_for(3, seed=17)
    old = eng.stream(prompts, 32)
    next(old), next(old)
    assert eng.generate(prompts, 20).tokens == ar_reference(target, prompts, 20)
    with pytest.raises(RuntimeError, match="this stream was cancelled"):
        next(old)
    assert eng.generate(prompts, 20).tokens == ar_reference(target, prompts, 20)


def test_a_suspended_stream_leaves_process_settings_alone(pair):
    import sys
    target, drafter = pair
    eng = Engine(target, drafter, method="dspark", d=3)
    switch, threads = sys.getswitchinterval(), torch.get_num_threads()
    it = eng.stream(prompts_for(1, seed=18), 16)
    next(it)
    assert sys.getswitchinterval() == switch and torch.get_num_threads() == threads
    assert not torch.is_inference_mode_enabled()
    w = torch.ones(2, requires_grad=True)
    (w * 3).sum().backward()  # the caller's autograd works inside its loop body
    assert w.grad.tolist() == [3.0, 3.0]
    list(it)


def test_one_engine_serves_one_thread_at_a_time(pair):
    import threading
    target, drafter = pair
    eng = Engine(target, drafter, method="dpara", d=4)
    prompts = prompts_for(2, seed=19)
    started, errors, results = threading.Event(), [], []

    def long_call():
        it = eng._stream(prompts, 200, dict(temperature=None, top_p=None, seed=None), False, hold=True)
        results.append(next(it))
        started.set()
        results.extend(it)

    t = threading.Thread(target=long_call)
    t.start()
    started.wait()
    try:
        eng.generate(prompts, 4)
    except RuntimeError as e:
        errors.append(str(e))
    t.join()
    assert errors and "decoding in another thread" in errors[0]
    joined = [sum((r[b] for r in results), []) for b in range(2)]
    assert joined == ar_reference(target, prompts, 200)


def test_a_caller_in_inference_mode_gets_the_same_tokens(pair):
    target, drafter = pair
    prompts = prompts_for(2, seed=20)
    eng = Engine(target, drafter, method="dpara", d=4)
    with torch.inference_mode():
        out = eng.generate([prompts[0] * 40], 8)  # grows the cache inside the caller's inference mode
        assert eng.generate(prompts, 16).tokens == ar_reference(target, prompts, 16)
    assert out.tokens == ar_reference(target, [prompts[0] * 40], 8)


def test_tau_counts_only_what_rounds_committed(pair):
    target, drafter = pair
    prompts = prompts_for(1, seed=21)
    out = Engine(target, drafter, method="dspark", d=8).generate(prompts, 3)
    st = out.stats
    assert sum(map(len, out.tokens)) == 3
    # the prefill's token plus rounds that kept at most 2 more: tau cannot exceed the tokens they committed
    assert st.tau * sum(st.acceptance_histogram) == pytest.approx(3 - 1)
