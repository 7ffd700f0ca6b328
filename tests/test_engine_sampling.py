"""Sampling is lossless: every method's output distribution equals plain autoregressive sampling.

On a 16-token vocabulary the exact joint law of the first three new tokens is enumerated from the target
(16 x 16 continuations); each method's empirical marginals of tokens 2 and 3 (the first ones that come out of
speculative rounds) and of the pair (token 2, token 3) pass a chi-square test against it.
"""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dpara_rt.engine import Engine
from engine_pairs import predictable_pair

V, N_CALLS, BATCH, TEMP = 16, 100, 16, 1.0
PROMPT = [5, 9, 3, 12]


@pytest.fixture(scope="module")
def pair():
    return predictable_pair(vocab=V, hidden=32, inter=64, layers=2, markov_scale=2.0, eos=0)


@pytest.fixture(scope="module")
def exact_joint(pair):
    target, _ = pair
    with torch.no_grad():
        def next_probs(seqs):
            ids = torch.tensor(seqs)
            pos = torch.arange(ids.shape[1]).expand_as(ids)
            logits, _ = target(ids, pos)
            return torch.softmax(logits[:, -1].double() / TEMP, -1)
        p1 = next_probs([PROMPT])[0]
        p2 = next_probs([PROMPT + [a] for a in range(V)])                                    # [V, V]
        p3 = next_probs([PROMPT + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).numpy()


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    counts, probs = counts.ravel().astype(float), probs.ravel()
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def sample_counts(eng) -> tuple[np.ndarray, int]:
    counts = np.zeros((V, V, V))
    accepted = 0
    for call in range(N_CALLS):
        out = eng.generate([PROMPT] * BATCH, max_new_tokens=3, seed=1000 * call + 7)
        for toks in out.tokens:
            counts[tuple(toks)] += 1
        accepted += sum(out.stats.acceptance_histogram[1:]) if eng.method != "ar" else 0
    return counts, accepted


def assert_matches(counts: np.ndarray, exact_joint: np.ndarray) -> None:
    p_second, p_third = chi2_pvalue(counts.sum((0, 2)), exact_joint.sum((0, 2))), \
        chi2_pvalue(counts.sum((0, 1)), exact_joint.sum((0, 1)))
    p_pair = chi2_pvalue(counts.sum(0), exact_joint.sum(0))
    assert min(p_second, p_third, p_pair) > 1e-3, (p_second, p_third, p_pair)


@pytest.mark.parametrize("method,policy", [("ar", "pearl"), ("dspark", "pearl"), ("psd", "pearl"),
                                           ("psd", "ssd"), ("dpara", "pearl")])
def test_sampling_matches_exact_distribution(pair, exact_joint, method, policy):
    target, drafter = pair
    eng = Engine(target, drafter, method=method, d=3, temperature=TEMP, psd_policy=policy, max_len=64,
                 eos_ids=[])
    counts, accepted = sample_counts(eng)
    if method != "ar":
        assert accepted > 0, "no draft token was ever accepted: the test would not exercise rejection sampling"
    assert_matches(counts, exact_joint)


@pytest.mark.parametrize("method", ["dspark", "psd", "dpara"])
def test_a_drafter_gone_non_finite_keeps_sampling_exact(pair, exact_joint, method):
    """A damaged drafter (NaN Markov factors: every q is NaN) must not bias the output: its drafts are treated
    as rejected and the target's own distribution draws each token."""
    import copy
    target, drafter = pair
    broken = copy.deepcopy(drafter)
    with torch.no_grad():
        broken.w2.fill_(float("nan"))
    eng = Engine(target, broken, method=method, d=3, temperature=TEMP, max_len=64, eos_ids=[])
    with pytest.warns(RuntimeWarning, match="non-finite probabilities"):
        counts, accepted = sample_counts(eng)
    assert accepted == 0
    assert_matches(counts, exact_joint)


@pytest.mark.parametrize("method", ["ar", "dspark", "dpara"])
def test_sampling_on_the_device_path_matches_exact_distribution(pair, exact_joint, torch_path, method):
    """The round a GPU runs (torch references, the static verify, the drafter in this process): each sampled round's
    verdicts are drawn where the logits are and come back in the verify's one read."""
    target, drafter = pair
    eng = Engine(target, drafter if method != "ar" else None, method=method, d=3, temperature=TEMP, max_len=64,
                 eos_ids=[], drafting="device", drafter_worker="thread", verify_mode="static")
    counts, accepted = sample_counts(eng)
    assert method == "ar" or accepted > 0
    assert_matches(counts, exact_joint)


def test_a_drafter_gone_non_finite_keeps_the_device_path_exact(pair, exact_joint, torch_path):
    """On the device path a damaged q is handled by selects, never read on the host; the warning comes with the
    verify's read."""
    import copy
    target, drafter = pair
    broken = copy.deepcopy(drafter)
    with torch.no_grad():
        broken.w2.fill_(float("nan"))
    eng = Engine(target, broken, method="dpara", d=3, temperature=TEMP, max_len=64, eos_ids=[], drafting="device",
                 drafter_worker="thread", verify_mode="static")
    with pytest.warns(RuntimeWarning, match="non-finite probabilities"):
        counts, accepted = sample_counts(eng)
    assert accepted == 0
    assert_matches(counts, exact_joint)


def test_sampling_repeats_with_a_seed(pair):
    target, drafter = pair
    runs = [Engine(target, drafter, method="dpara", d=3, temperature=TEMP, seed=3).generate([PROMPT] * 4, 12).tokens
            for _ in range(2)]
    assert runs[0] == runs[1]
