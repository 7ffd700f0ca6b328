"""Top-k / top-p with every method, and per-request sampling parameters.

Truncation (temperature, then top-k, then top-p: dpara_rt.sampling.probs) is what AR draws from and what
lossless verification uses as the target side p, so every speculative method samples from AR's truncated law:
chi-square tests of the first three new tokens (the helpers of test_engine_sampling) against the exact joint
law enumerated from the target, and tokens outside the kept set never appear. Per-request parameters: a row's
distribution depends only on its own parameters, greedy rows of a sampled batch get the AR greedy output, and
with per-request seeds a request draws what it draws alone.
"""
import os

import torch

if not torch.cuda.is_available():  # must precede the first triton import (kernels import it lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from dpara_rt.engine import Engine  # noqa: E402
from dpara_rt.kernels.triton_support import interpreting  # noqa: E402
from dpara_rt.kernels.verify import verify_sample_reference, verify_sample_triton  # noqa: E402
from dpara_rt.methods import variant  # noqa: E402
from dpara_rt.round.decoder import DecodeOptions  # noqa: E402
from dpara_rt.sampling import (check_sampling, make_generator, probs, sample, top_k_filter,  # noqa: E402
                               top_p_filter)
from engine_pairs import predictable_pair  # noqa: E402
from test_engine_sampling import PROMPT, TEMP, V, assert_matches  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N_CALLS, BATCH = 40, 16


# ------------------------------------------------------------------------------------------ truncation

def test_top_k_keeps_the_k_most_likely_and_renormalises():
    p = torch.tensor([[0.1, 0.4, 0.3, 0.2]])
    torch.testing.assert_close(top_k_filter(p, 2), torch.tensor([[0.0, 4 / 7, 3 / 7, 0.0]]))
    assert torch.equal(top_k_filter(p, 1), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


def test_top_k_keeps_every_token_tied_with_the_kth():
    p = torch.tensor([[0.4, 0.2, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25]])
    assert torch.equal(top_k_filter(p, 2) > 0, torch.ones(2, 4, dtype=torch.bool))
    assert torch.equal(top_k_filter(torch.tensor([[0.3, 0.3, 0.2, 0.2]]), 2) > 0,
                       torch.tensor([[True, True, False, False]]))


def test_top_k_off_or_at_least_vocab_changes_nothing():
    p = torch.softmax(torch.randn(3, 7, generator=torch.Generator().manual_seed(0)), -1)
    for k in (0, 7, 8, 1000):
        assert torch.equal(top_k_filter(p, k), p)


def test_tiny_top_p_keeps_the_argmax_and_ties_keep_the_lowest_index():
    p = torch.softmax(torch.randn(4, 9, generator=torch.Generator().manual_seed(1)), -1)
    kept = top_p_filter(p, 1e-6)
    assert torch.equal(kept, torch.zeros_like(p).scatter_(-1, p.argmax(-1, keepdim=True), 1.0))
    tie = torch.tensor([[0.1, 0.3, 0.3, 0.3]])
    assert torch.equal(top_p_filter(tie, 1e-6), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    assert torch.equal(top_p_filter(tie, 0.5), torch.tensor([[0.0, 0.5, 0.5, 0.0]]))


def test_truncation_order_is_temperature_then_top_k_then_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1]]))
    # top-k first: {0.625, 0.375}; then top-p 0.6 of that keeps the first alone. The other order would keep two.
    assert torch.equal(probs(logits, 1.0, 0.6, 2) > 0, torch.tensor([[True, False, False, False]]))
    assert torch.equal(top_k_filter(top_p_filter(torch.exp(logits), 0.6), 2) > 0,
                       torch.tensor([[True, True, False, False]]))
    z = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(2))
    want = top_p_filter(top_k_filter(torch.softmax(z / 0.7, -1), 5), 0.8)
    torch.testing.assert_close(probs(z, 0.7, 0.8, 5), want, rtol=0, atol=0)


def test_per_row_parameters_equal_row_by_row_calls():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(5, 4, 13, generator=g)
    temps, top_ps, top_ks = [0.0, 1.0, 0.5, 1.3, 2.0], [1.0, 0.9, 0.5, 1.0, 0.3], [0, 3, 0, 20, 1]
    batched = probs(z, temps, top_ps, top_ks)
    for b in range(5):
        assert torch.equal(batched[b], probs(z[b:b + 1], temps[b], top_ps[b], top_ks[b])[0]), b
    # per-row generators: row b draws what it draws alone with its seed; greedy rows take the argmax
    seeds = [11, 12, 13, 14, 15]
    together = sample(z[:, 0], temps, top_ps, [make_generator(s) for s in seeds], top_ks)
    alone = [int(sample(z[b:b + 1, 0], temps[b], top_ps[b], make_generator(seeds[b]), top_ks[b])) for b in range(5)]
    assert together.tolist() == alone
    assert together[0] == z[0, 0].argmax()


@pytest.mark.parametrize("kwargs,message", [
    (dict(top_k=-1), "top_k = -1; expected an int >= 0"),
    (dict(top_k=2.5), "top_k = 2.5"),
    (dict(top_k=True), "top_k = True"),
    (dict(top_p=0.0), "top_p = 0.0"),
    (dict(top_k=(1, -2)), r"top_k\[1\] = -2"),
    (dict(temperature=(1.0, -0.5)), r"temperature\[1\] = -0.5"),
    (dict(top_p=(0.5, 1.5)), r"top_p\[1\] = 1.5"),
    (dict(seed=(1, -1)), r"seed\[1\] = -1"),
    (dict(temperature=()), r"temperature = \(\)"),
])
def test_decode_options_name_the_bad_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodeOptions(**kwargs)


def test_check_sampling_names_the_bad_value():
    with pytest.raises(ValueError, match="top_k = -3"):
        check_sampling(1.0, 1.0, -3)
    with pytest.raises(ValueError, match="top_k = -3"):
        sample(torch.zeros(1, 4), 1.0, 1.0, top_k=-3)


# ------------------------------------------------------------------------------------------ kernels

def _truncated_inputs(batch, d, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, d + 1, vocab, generator=g) * 2
    p = probs(logits, 1.0, [0.7, 1.0, 0.9, 0.5][:batch], [0, 4, 6, 0][:batch])
    q = torch.softmax(torch.randn(batch, d, vocab, generator=g) * 2, -1)  # untruncated drafter
    draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(batch, d)
    return p, q, draft, torch.rand(batch, d, generator=g), torch.rand(batch, generator=g)


def test_verification_kernels_agree_on_truncated_p():
    """Triton (interpreted on the CPU) == torch reference on a truncated p and an untruncated q: draft tokens
    outside p's support are rejected, and bonuses come from inside it. Row 1's q dominates p everywhere (the
    residual max(p - q, 0) is zero: the bonus then comes from p); row 2's q lies wholly outside p's support."""
    batch, d, vocab = 4, 3, 50
    p, q, draft, u_accept, u_bonus = _truncated_inputs(batch, d, vocab, seed=5)
    q[1] = p[1, :d] * 1.5
    draft[1, 0] = int(p[1, 0].argmax())
    u_accept[1, 0] = 0.9  # 0.9 * 1.5 p > p: rejected
    q[2] = torch.where(p[2, :d] > 0, 0.0, 1.0)
    q[2] /= q[2].sum(-1, keepdim=True)
    draft[2] = torch.multinomial(q[2], 1).squeeze(-1)
    u_accept[0] = 0.0  # row 0 accepts whatever p allows
    ref = verify_sample_reference(p, q, draft, u_accept, u_bonus)
    tri = verify_sample_triton(p.to(DEVICE), q.to(DEVICE), draft.to(DEVICE), u_accept.to(DEVICE), u_bonus.to(DEVICE))
    assert [t.tolist() for t in ref] == [t.cpu().tolist() for t in tri]
    r, bonus = ref
    assert r[1] == 0 and r[2] == 0
    for b in range(batch):
        tokens = draft[b, :r[b]].tolist() + [int(bonus[b])]
        assert all(p[b, i, t] > 0 for i, t in enumerate(tokens)), (b, tokens)


# ------------------------------------------------------------------------------------------ engine

@pytest.fixture(scope="module")
def pair():
    return predictable_pair(vocab=V, hidden=32, inter=64, layers=2, markov_scale=2.0, eos=0)


def exact_joint(target, temperature, top_p, top_k, prompt=PROMPT) -> np.ndarray:
    """The law of the first three new tokens under AR's truncated sampling (sampling.probs), [V, V, V]."""
    with torch.no_grad():
        def next_probs(seqs):
            ids = torch.tensor(seqs)
            pos = torch.arange(ids.shape[1]).expand_as(ids)
            logits, _ = target(ids, pos)
            p = probs(logits[:, -1], temperature, top_p, top_k).double()
            return p / p.sum(-1, keepdim=True)
        p1 = next_probs([prompt])[0]
        p2 = next_probs([prompt + [a] for a in range(V)])
        p3 = next_probs([prompt + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).numpy()


def counts_of(eng, n_calls=N_CALLS, **kwargs) -> tuple[np.ndarray, int]:
    """counts[b][t1, t2, t3] of the first three new tokens of row b over n_calls calls, and accepted drafts."""
    counts = np.zeros((BATCH, V, V, V))
    accepted = 0
    for call in range(n_calls):
        out = eng.generate([PROMPT] * BATCH, max_new_tokens=3, seed=1000 * call + 11, **kwargs)
        for b, toks in enumerate(out.tokens):
            counts[b][tuple(toks)] += 1
        accepted += sum(out.stats.acceptance_histogram[1:]) if eng.method != "ar" else 0
    return counts, accepted


TRUNCATIONS = {"top_k": dict(top_k=4, top_p=1.0), "top_p": dict(top_k=0, top_p=0.7),
               "both": dict(top_k=6, top_p=0.8)}
METHOD_VARIANTS = ["ar", "dspark", "psd-pearl", "psd-ssd", "dpara-logits", "dpara-hidden"]


@pytest.fixture(scope="module")
def joints(pair):
    target, _ = pair
    return {name: exact_joint(target, TEMP, **kw) for name, kw in TRUNCATIONS.items()}


@pytest.mark.parametrize("truncation", list(TRUNCATIONS))
@pytest.mark.parametrize("name", METHOD_VARIANTS)
def test_truncated_sampling_matches_ar_law(pair, joints, name, truncation):
    target, drafter = pair
    eng = Engine(target, drafter, d=3, temperature=TEMP, max_len=64, eos_ids=[], **TRUNCATIONS[truncation],
                 **variant(name))
    counts, accepted = counts_of(eng)
    counts = counts.sum(0)
    joint = joints[truncation]
    if name != "ar":
        assert accepted > 0, "no draft token was ever accepted: the test would not exercise rejection sampling"
    assert counts[joint == 0].sum() == 0, "a token outside the top-k / top-p set was sampled"
    assert (joint > 0).sum() < V ** 3 / 4  # the truncation really removed tokens
    assert_matches(counts, joint)


def test_per_request_parameters_give_each_row_its_own_law(pair):
    """One dpara batch, rows alternating two settings (different temperature and truncation): each half
    follows its own AR law (per-row temperature runs the Markov head per row)."""
    target, drafter = pair
    a, b = dict(temperature=1.0, top_p=1.0, top_k=4), dict(temperature=0.7, top_p=0.8, top_k=0)
    rows = [a if i % 2 == 0 else b for i in range(BATCH)]
    per_request = {k: [row[k] for row in rows] for k in a}
    eng = Engine(target, drafter, method="dpara", d=3, max_len=64, eos_ids=[])
    counts, accepted = counts_of(eng, n_calls=60, **per_request)
    assert accepted > 0
    for half, kw in ((counts[0::2].sum(0), a), (counts[1::2].sum(0), b)):
        joint = exact_joint(target, **kw)
        assert half[joint == 0].sum() == 0
        assert_matches(half, joint)


PROMPTS = [PROMPT, [1, 2, 3], [7, 7], [4, 5, 6, 7, 8], [3], [9, 8, 7, 6]]


@pytest.mark.parametrize("name", METHOD_VARIANTS)
def test_greedy_rows_of_a_sampled_batch_are_ar_greedy(pair, name):
    target, drafter = pair
    greedy = Engine(target, None, method="ar", max_len=64, eos_ids=[]).generate(PROMPTS, 16).tokens
    eng = Engine(target, drafter, d=3, max_len=64, eos_ids=[], **variant(name))
    temps = [0.0, 1.0, 0.0, 1.5, 0.0, 0.8]
    for seed in (5, [5, 6, 7, 8, 9, 10]):
        out = eng.generate(PROMPTS, 16, temperature=temps, top_k=[0, 3, 2, 0, 0, 5], seed=seed).tokens
        for i, t in enumerate(temps):
            if t == 0:
                assert out[i] == greedy[i], (name, seed, i)


@pytest.mark.parametrize("name", ["ar", "dspark", "dpara-logits", "dpara-hidden"])
def test_a_request_with_its_own_seed_draws_what_it_draws_alone(pair, name):
    """Per-request seeds: each request's output equals its output decoded alone with that seed (this holds
    here because the tiny models' batched forwards give each row the logits of a batch of one)."""
    target, drafter = pair
    eng = Engine(target, drafter, d=3, max_len=64, eos_ids=[], **variant(name))
    kw = dict(temperature=[1.0, 0.0, 0.7, 1.3, 1.0, 1.0], top_k=[3, 0, 5, 0, 0, 8],
              top_p=[1.0, 1.0, 0.8, 0.9, 1.0, 0.95], seed=[1, 2, 3, 4, 5, 1])
    together = eng.generate(PROMPTS, 16, **kw).tokens
    for i, prompt in enumerate(PROMPTS):
        alone = eng.generate([prompt], 16, **{k: v[i] for k, v in kw.items()}).tokens[0]
        assert together[i] == alone, (name, i)


def test_per_request_counts_must_match_the_batch(pair):
    target, drafter = pair
    eng = Engine(target, drafter, method="dspark", d=3, max_len=64)
    with pytest.raises(ValueError, match="temperature has 3 values for 2 prompts"):
        eng.generate([[1, 2], [3, 4]], 4, temperature=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="seed has 1 values for 2 prompts"):
        eng.generate([[1, 2], [3, 4]], 4, temperature=1.0, seed=[3])
    with pytest.raises(ValueError, match="top_k = -1"):
        eng.generate([[1, 2]], 4, temperature=1.0, top_k=-1)
    with pytest.raises(ValueError, match="top_k = 1.5"):
        Engine(target, drafter, method="dpara", top_k=1.5)
    # the speculative methods no longer refuse truncation
    Engine(target, drafter, method="dpara", d=3, temperature=1.0, top_p=0.5, top_k=3).generate([[1, 2]], 4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_truncated_sampling_on_every_ops_backend(pair, joints, backend, monkeypatch):
    """The host backend runs above; here the torch references, then the Triton kernels (interpreted on the
    CPU), draft and verify: the same truncated law. DSpark: the Triton interpreter's state is global, so the
    kernels must not run on two lanes at once."""
    if backend == "triton" and not interpreting():
        pytest.skip("the pair lives on the CPU, where Triton runs only in the interpreter, which a CUDA machine's "
                    "test run leaves off (the kernel tests cover Triton there)")
    monkeypatch.setenv("DPARA_RT_OPS", backend)
    target, drafter = pair
    eng = Engine(target, drafter, method="dspark", d=3, temperature=TEMP, max_len=64, eos_ids=[],
                 **TRUNCATIONS["both"])
    counts, accepted = counts_of(eng, n_calls=N_CALLS if backend == "torch" else 16)
    counts = counts.sum(0)
    assert accepted > 0
    assert counts[joints["both"] == 0].sum() == 0
    assert_matches(counts, joints["both"])
