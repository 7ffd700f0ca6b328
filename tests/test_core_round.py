"""Round state, greedy acceptance, tree-mask metadata and metrics through the bindings, checked against
naive Python / numpy built from the rules of docs/design.md (hypothesis) and the plain-Python reference."""
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dpara_rt._core import MAX_DRAFT
from dpara_rt.testing import RefRoundState
from dpara_rt.core import (BoundaryRing, Metrics, RoundState, Staging, greedy_accept, span,
                            tree_mask, tree_metadata)


def ref_tree_metadata(d: int) -> dict:
    """The layout written out independently: spine rows 0..d, then branch r's rows at offsets r+1..r+d."""
    spine, branches = range(d + 1), [(r, j) for r in range(d + 1) for j in range(d)]
    return {
        "d": d,
        "rows": (d + 1) * (d + 1),
        "query_branch": [-1] * (d + 1) + [r for r, _ in branches],
        "query_pos_offset": list(spine) + [r + 1 + j for r, j in branches],
        "query_spine_limit": list(spine) + [r for r, _ in branches],
        "key_spine": list(spine) + [-1] * len(branches),
        "key_branch": [-1] * (d + 1) + [r for r, _ in branches],
    }


def naive_accept(draft, argmax):
    rs, bonus = [], []
    for b in range(len(draft)):
        r = 0
        for i in range(len(draft[b])):
            if draft[b][i] != argmax[b][i]:
                break
            r += 1
        rs.append(r)
        bonus.append(argmax[b][r])
    return rs, bonus


@st.composite
def acceptance_case(draw):
    batch, d = draw(st.integers(1, 16)), draw(st.integers(1, 16))
    draft = np.array(draw(st.lists(st.integers(0, 3), min_size=batch * d, max_size=batch * d))).reshape(batch, d)
    argmax = np.array(draw(st.lists(st.integers(0, 3), min_size=batch * (d + 1),
                                    max_size=batch * (d + 1)))).reshape(batch, d + 1)
    for b in range(batch):  # long accepted prefixes are the interesting case: copy part of the draft
        k = draw(st.integers(0, d))
        argmax[b, :k] = draft[b, :k]
    return draft, argmax


@settings(max_examples=150, deadline=None)
@given(acceptance_case())
def test_greedy_accept_equals_naive_loop(case):
    draft, argmax = case
    r, bonus = greedy_accept(draft, argmax)
    want_r, want_bonus = naive_accept(draft.tolist(), argmax.tolist())
    assert r.tolist() == want_r and bonus.tolist() == want_bonus


def naive_tree(d):
    """The spine+branch tree of docs/design.md §1 as explicit tokens, and its dense mask."""
    tokens = [("spine", i, i) for i in range(d + 1)]                             # s_0..s_d at n..n+d
    tokens += [("branch", r, r + 1 + j) for r in range(d + 1) for j in range(d)]  # branch r at n+r+1..n+r+d
    n = len(tokens)
    mask = np.zeros((n, n), dtype=bool)
    for q, (qkind, qi, _) in enumerate(tokens):
        for k, (kkind, ki, _) in enumerate(tokens):
            if qkind == "spine":
                mask[q, k] = kkind == "spine" and ki <= qi  # causal among the spine
            else:
                mask[q, k] = (kkind == "spine" and ki <= qi) or (kkind == "branch" and ki == qi)
    return tokens, mask


@pytest.mark.parametrize("d", range(1, 17))
def test_tree_metadata_expands_to_the_naive_dense_mask(d):
    meta = tree_metadata(d)
    tokens, naive = naive_tree(d)
    assert meta["rows"] == len(tokens) == (d + 1) ** 2
    qb, lim = meta["query_branch"], meta["query_spine_limit"]
    ks, kb = meta["key_spine"], meta["key_branch"]
    expanded = ((ks[None, :] >= 0) & (ks[None, :] <= lim[:, None])) | ((kb[None, :] >= 0) & (kb[None, :] == qb[:, None]))
    assert np.array_equal(expanded, naive)
    assert np.array_equal(tree_mask(d), naive)
    assert meta["query_pos_offset"].tolist() == [pos for _, _, pos in tokens]
    assert qb.tolist() == [-1 if kind == "spine" else i for kind, i, _ in tokens]
    ref = ref_tree_metadata(d)
    for key in ("query_branch", "query_pos_offset", "query_spine_limit", "key_spine", "key_branch"):
        assert meta[key].dtype == np.int32 and meta[key].tolist() == ref[key]


def test_draft_limit_is_the_cores_max_draft():
    """Every object sized by d accepts d = MAX_DRAFT and refuses one more, naming the value and the limit."""
    top = MAX_DRAFT
    assert tree_metadata(top)["rows"] == (top + 1) ** 2 and len(Metrics(top).histogram()) == top + 1
    assert RoundState(1, top, 8, [], 256).d() == top and BoundaryRing(1, 1, top, 1).d == top
    assert Staging(1, top, 0).d == top
    for make in (tree_metadata, Metrics, lambda d: RoundState(1, d, 8, [], 256), lambda d: BoundaryRing(1, 1, d, 1),
                 lambda d: Staging(1, d, 0)):
        for d in (0, top + 1):
            with pytest.raises(ValueError, match=f"d must be in 1..{top}, got {d}"):
                make(d)


def test_eos_and_max_new_tokens_inside_a_block():
    state = RoundState(batch=3, d=4, max_new_tokens=4, eos_ids=[2, 9], max_len=100)
    committed = state.start(np.array([5, 6, 7]), np.array([10, 11, 12]))
    assert committed.tolist() == [1, 1, 1] and state.num_running() == 3
    state.set_draft(np.array([[20, 2, 21, 22], [30, 31, 32, 33], [40, 41, 42, 43]]))
    argmax = np.array([[20, 2, 21, 22, 23],     # accepts all, but the EOS 2 is its 2nd token
                       [30, 31, 32, 33, 34],    # accepts all, cut at max_new_tokens (1 + 3 tokens)
                       [99, 0, 0, 0, 0]])       # rejects at once: bonus 99 only
    r, bonus, committed = state.step(argmax, slot=1)
    assert r.tolist() == [4, 4, 0] and bonus.tolist() == [23, 34, 99]
    assert committed.tolist() == [2, 3, 1]
    assert state.outputs() == [[10, 20, 2], [11, 30, 31, 32], [12, 99]]
    assert [state.reason(b) for b in range(3)] == ["eos", "length", ""]
    assert state.finished().tolist() == [True, True, False] and state.num_running() == 1
    assert state.target_pos().tolist() == [7, 9, 8] and state.drafter_pos().tolist() == [7, 9, 8]
    assert state.committed_lens().tolist() == [8, 10, 9]
    state.set_draft(np.zeros((3, 4), dtype=np.int64))
    r, bonus, committed = state.step(np.full((3, 5), 3), slot=0)
    assert committed.tolist() == [0, 0, 1] and r.tolist() == [0, 0, 0]  # finished requests commit nothing
    assert state.slots(0).tolist() == [1] and state.slots(2).tolist() == [1, 0]
    assert state.spine()[2, 0] == 3 and state.rounds() == 2


def test_admit_and_retire_between_rounds():
    """Continuous batching: a finished row takes a new request with its own max_new_tokens and stop ids;
    retire() ends a running request, which then commits nothing."""
    state = RoundState(batch=2, d=2, max_new_tokens=3, eos_ids=[2], max_len=50)
    state.start(np.array([4, 5]), np.array([10, 11]))
    state.retire(1)
    assert state.finished().tolist() == [False, True] and state.reason(1) == "cancelled"
    with pytest.raises(ValueError, match="row 0: its request is still running"):
        state.admit(0, 3, 7, 5)
    assert state.admit(1, 6, 12, 8, stop_ids=[40]) == 1
    assert state.output(1) == [12] and state.target_pos()[1] == 6 and not state.finished(1)
    state.set_draft(np.array([[20, 21], [30, 40]]))
    r, bonus, committed = state.step(np.array([[20, 21, 22], [30, 40, 41]]))
    assert committed.tolist() == [2, 3 - 1] and state.reason(0) == "length"  # row 0 keeps the shared limit 3
    assert state.output(1) == [12, 30, 40] and state.reason(1) == "eos"      # its own stop id 40, mid-block
    state.grow(3)  # a third row, free until admitted
    assert state.batch() == 3 and state.finished(2) and state.output(1) == [12, 30, 40]
    with pytest.raises(ValueError, match="grow to 2 rows: expected at least the current 3"):
        state.grow(2)
    assert state.admit(2, 4, 13, 2) == 1 and not state.finished(2)
    for bad, match in (((1, 0, 5, 4), "prompt length 0"), ((1, 50, 5, 4), "prompt length 50"),
                       ((1, 3, -1, 4), "first token -1"), ((1, 3, 5, 0), "max_new_tokens 0"),
                       ((7, 3, 5, 4), "7")):
        with pytest.raises((ValueError, IndexError), match=match):
            state.admit(*bad)


def test_caller_owned_outputs():
    state = RoundState(2, 2, 50, [], 100)
    out = np.zeros(2, dtype=np.int64)
    state.start(np.array([3, 8]), np.array([1, 1]), out)
    state.set_draft(np.array([[4, 5], [6, 7]]))
    r, bonus, committed = np.zeros(2, np.int64), np.zeros(2, np.int64), np.zeros(2, np.int64)
    result = state.step(np.array([[4, 5, 6], [0, 0, 0]]), 0, r, bonus, committed)
    assert result[0] is r and r.tolist() == [2, 0] and committed.tolist() == [3, 1]
    assert state.target_pos().tolist() == [6, 9] and state.committed_lens().tolist() == [7, 10]
    with pytest.raises(ValueError, match=r"committed must be a writable contiguous int64 array of shape \(2,\)"):
        state.start(np.array([3, 8]), np.array([1, 1]), np.zeros(2, dtype=np.int32))


def _separately(state, metrics, block, argmax, r, bonus, slot):
    """RoundState.accept spelled out as the separate calls and numpy it fuses."""
    B, T = block.shape
    running = ~state.finished()
    state.set_draft(np.ascontiguousarray(block[:, 1:]) if T > 1 else np.zeros((B, state.d()), np.int64))
    if argmax is not None:
        r, bonus, committed = state.step(argmax, slot)
    else:
        committed = state.commit(r, bonus, slot)
    metrics.record_round(np.minimum(r, committed - 1)[running])
    r, bonus = np.where(running, r, 0), np.where(running, bonus, block[:, 0])
    out = [state.output(b)[len(state.output(b)) - committed[b]:] for b in range(B)]
    return r, bonus, committed, (r + 1) * running, out


def test_accept_is_set_draft_then_step_or_commit_and_the_rounds_record():
    """The fused per-round call gives what the separate calls give: r, bonus (s_0 for a request finished before
    the round), committed, the KV rows to keep, each request's committed tokens, and the same histogram, over
    greedy rounds cut by EOS and max_new_tokens, rounds of a sampling rule, and AR rounds."""
    def pair(d):
        return [(RoundState(3, d, 5, [2], 100), Metrics(d)) for _ in range(2)]
    for d, rounds in ((3, [("greedy", [[20, 2, 21, 22], [30, 31, 32, 33], [40, 41, 42, 43]],
                                [[20, 2, 21, 22], [30, 31, 32, 33], [99, 0, 0, 0]]),
                               ("rule", [[50, 51, 52, 53], [60, 61, 62, 63], [70, 71, 72, 73]], ([0, 2, 3], [7, 8, 9])),
                               ("greedy", [[1, 4, 4, 4], [1, 5, 5, 5], [1, 6, 6, 6]],
                                [[4, 4, 4, 4], [5, 5, 1, 1], [6, 6, 6, 6]])]),
                      (1, [("ar", [[10], [11], [12]], ([0, 0, 0], [13, 2, 15])),
                           ("ar", [[13], [2], [15]], ([0, 0, 0], [16, 17, 18]))])):
        (fused, fm), (plain, pm) = pair(d)
        for st_ in (fused, plain):
            st_.start(np.array([4, 5, 6]), np.array([10, 11, 12]))
        for k, (kind, block, given) in enumerate(rounds):
            block = np.array(block, dtype=np.int64)
            argmax = np.array(given, dtype=np.int64) if kind == "greedy" else None
            r, bonus = (None, None) if argmax is not None else (np.array(given[0]), np.array(given[1]))
            got = fused.accept(block, argmax, r, bonus, k, fm)
            want = _separately(plain, pm, block, argmax, r, bonus, k)
            for g, w in zip(got[:4], want[:4]):
                assert g.tolist() == np.asarray(w).tolist(), (kind, k, got, want)
            assert got[4] == want[4]
            assert fused.outputs() == plain.outputs() and fm.histogram().tolist() == pm.histogram().tolist()
        assert fused.finished().tolist() == plain.finished().tolist() and any(fused.finished())
    state, metrics = RoundState(2, 3, 8, [], 64), Metrics(3)
    state.start(np.array([4, 5]), np.array([1, 2]))
    block, argmax = np.zeros((2, 4), np.int64), np.zeros((2, 4), np.int64)
    for args, match in (((block, None, None, None), "expected target_argmax .a greedy round. or r and bonus .any rule., got no target_argmax$"),
                        ((block, argmax, np.zeros(2), np.zeros(2)), "got target_argmax, r, bonus"),
                        ((block, None, np.zeros(2), None), "got no target_argmax, r$"),
                        ((np.zeros((2, 3), np.int64), None, np.zeros(2), np.zeros(2)), "blocks of T = 3 tokens, expected d \\+ 1 = 4"),
                        ((np.zeros((2, 1), np.int64), np.zeros((2, 1)), None, None), "target_argmax for an AR round"),
                        ((np.zeros((2, 1), np.int64), None, np.array([0, 1]), np.zeros(2)), r"r\[1\] = 1 in an AR round"),
                        ((np.zeros((3, 4), np.int64), argmax, None, None), r"block must have shape \(2, T\), got \(3, 4\)"),
                        ((block, np.zeros((2, 3)), None, None), r"target_argmax must have shape \(2, 4\)")):
        with pytest.raises(ValueError, match=match):
            state.accept(*args, 0, metrics)
    assert state.rounds() == 0 and metrics.rounds == 0  # a refused round changes nothing


def test_round_state_bad_input_names_the_value():
    with pytest.raises(ValueError, match="batch must be >= 1, got 0"):
        RoundState(0, 4, 8, [], 64)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        RoundState(1, 4, 0, [], 64)
    state = RoundState(2, 3, 8, [], 64)
    with pytest.raises(RuntimeError, match="before start"):
        state.set_draft(np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"prompt_lens must have shape \(2,\), got \(3,\)"):
        state.start(np.array([1, 2, 3]), np.array([1, 2]))
    with pytest.raises(ValueError, match="prompt length 64 of request 1"):
        state.start(np.array([4, 64]), np.array([1, 2]))
    state.start(np.array([4, 5]), np.array([1, 2]))
    with pytest.raises(RuntimeError, match="step before set_draft"):
        state.step(np.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"target_argmax must have shape \(2, 4\), got \(2, 3\)"):
        state.set_draft(np.zeros((2, 3)))
        state.step(np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"r\[1\] = 9 out of range"):
        state.commit(np.array([0, 9]), np.array([1, 1]))
    with pytest.raises(ValueError, match="request index 2 out of range for batch 2"):
        state.output(2)


@st.composite
def generation(draw):
    batch, d = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    max_new, max_len = draw(st.integers(1, 30)), draw(st.integers(12, 60))
    eos = draw(st.lists(st.integers(0, 5), max_size=2))
    prompts = draw(st.lists(st.integers(1, 10), min_size=batch, max_size=batch))
    rounds = []
    for _ in range(draw(st.integers(1, 12))):
        draft = draw(st.lists(st.integers(0, 5), min_size=batch * d, max_size=batch * d))
        argmax = draw(st.lists(st.integers(0, 5), min_size=batch * (d + 1), max_size=batch * (d + 1)))
        keep = draw(st.lists(st.integers(0, d), min_size=batch, max_size=batch))
        draft, argmax = np.array(draft).reshape(batch, d), np.array(argmax).reshape(batch, d + 1)
        for b in range(batch):
            argmax[b, :keep[b]] = draft[b, :keep[b]]
        rounds.append((draft, argmax))
    return batch, d, max_new, eos, max_len, prompts, rounds


@settings(max_examples=120, deadline=None)
@given(generation())
def test_round_state_matches_python_reference(case):
    batch, d, max_new, eos, max_len, prompts, rounds = case
    cpp, ref = RoundState(batch, d, max_new, eos, max_len), RefRoundState(batch, d, max_new, eos, max_len)
    first = [p % 6 for p in prompts]
    assert cpp.start(np.array(prompts), np.array(first)).tolist() == ref.start(prompts, first)
    for k, (draft, argmax) in enumerate(rounds):
        cpp.set_draft(draft)
        ref.set_draft(draft.tolist())
        got = [a.tolist() for a in cpp.step(argmax, k % 3)]
        assert got == list(ref.step(argmax.tolist(), k % 3))
        assert cpp.outputs() == ref.outputs
        assert cpp.target_pos().tolist() == ref.target_pos and cpp.drafter_pos().tolist() == ref.drafter_pos
        assert cpp.finished().tolist() == ref.finished()
        assert [cpp.reason(b) for b in range(batch)] == ref.reasons
    for b in range(batch):
        out = cpp.output(b)
        assert len(out) <= max_new and prompts[b] + len(out) <= max_len
        assert all(t not in eos for t in out[:-1])  # an EOS can only be the last token
        assert cpp.slots(b).tolist() == ref.slots[b]


def test_metrics_overlap_is_what_the_timeline_spans_give():
    """Metrics.overlap (the core's summary of a timeline) against the spans computed here: the mean gap between
    consecutive verifies, the drafting phases' total and the part of it beside a verify, on a random timeline
    of disjoint verifies and drafting spans that straddle them."""
    rng = np.random.default_rng(3)
    m, verifies, drafts = Metrics(3), [], []
    t = 0
    for _ in range(40):
        start = t + int(rng.integers(1, 50))
        t = start + int(rng.integers(20, 200))
        verifies.append((start, t))
    for k in range(60):
        s = int(rng.integers(0, t))
        drafts.append((s, s + int(rng.integers(1, 300)), ("backbone", "serial_draft", "guess_draft")[k % 3]))
    for k, (s, e) in enumerate(reversed(verifies)):
        m.add_event(k, "verify", "target", s, e)
    for k, (s, e, phase) in enumerate(drafts):
        m.add_event(k, phase, "drafter", s, e)
        m.add_event(k, "markov_head", "target", s, e)  # not drafting: left out
    o = m.overlap("verify", ["backbone", "serial_draft", "guess_draft"])
    gaps = [b[0] - a[1] for a, b in zip(verifies, verifies[1:])]
    hidden = sum(max(0, min(e, ve) - max(s, vs)) for s, e, _ in drafts for vs, ve in verifies)
    assert o["gaps"] == len(gaps) and o["mean_gap_ns"] == pytest.approx(sum(gaps) / len(gaps))
    assert o["drafting_ns"] == sum(e - s for s, e, _ in drafts) and o["hidden_ns"] == hidden


def test_metrics_histogram_trace_and_span():
    m = Metrics(3)
    m.record_round(np.array([0, 3, 3]))
    m.record_round(np.array([1]), fallback=True)
    assert m.histogram().tolist() == [1, 1, 0, 2] and m.rounds == 2 and m.fallbacks == 1
    assert m.tau == pytest.approx((1 + 2 + 4 + 4) / 4)
    with span(m, 0, "verify", "target"):
        pass
    m.add_event(0, "backbone", "drafter", 100, 300)
    trace = json.loads(m.chrome_trace())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {e["name"] for e in complete} == {"verify", "backbone"} and names == {"target", "drafter"}
    backbone = next(e for e in complete if e["name"] == "backbone")
    assert backbone["ts"] == 0.0 and backbone["dur"] == pytest.approx(0.2) and backbone["args"]["round"] == 0
    assert set(m.phase_totals_ns()) == {"verify", "backbone"} and m.events()[1]["lane"] == "drafter"
    with pytest.raises(ValueError, match=r"r\[0\] = 4 out of range"):
        m.record_round(np.array([4]))
    with pytest.raises(ValueError, match="before it starts"):
        m.add_event(1, "verify", "target", 10, 5)
    with pytest.raises(ValueError, match="got 0"):
        Metrics(0)
