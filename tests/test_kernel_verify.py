"""Verification: Triton (interpreted on the CPU) == torch reference == the core's greedy rule / a numpy loop, and lossless
rejection sampling reproduces the target distribution (chi-square)."""
import os

import torch

if not torch.cuda.is_available():  # must precede the first triton import (kernels import it lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from scipy import stats  # noqa: E402

from dpara_rt import _core  # noqa: E402
from dpara_rt.kernels.verify import (verify_greedy_reference, verify_greedy_triton,  # noqa: E402
                                     verify_sample_reference, verify_sample_triton)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _core_greedy(logits, draft):
    """The runtime's one greedy acceptance rule (the C++ round state's), on the target's argmax."""
    argmax = logits.float().argmax(-1).cpu().numpy().astype(np.int64)
    r, bonus = _core.greedy_accept(draft.cpu().numpy().astype(np.int64), argmax)
    return r.tolist(), bonus.tolist()


def _numpy_sample(p, q, draft, u_accept, u_bonus):
    """Speculative sampling written out: float32 acceptance test, float64 running sum for the bonus."""
    p, q = p.float().cpu().numpy(), q.float().cpu().numpy()
    draft, u_accept, u_bonus = draft.cpu().numpy(), u_accept.float().cpu().numpy(), u_bonus.cpu().numpy()
    d = draft.shape[1]
    r_out, bonus_out = [], []
    for b in range(draft.shape[0]):
        r = 0
        while r < d and u_accept[b, r] * q[b, r, draft[b, r]] < p[b, r, draft[b, r]]:
            r += 1
        weights = np.maximum(p[b, r] - q[b, r], np.float32(0)) if r < d else p[b, r]
        if weights.astype(np.float64).sum() <= 0:
            weights = p[b, r]
        target = float(u_bonus[b]) * float(np.cumsum(weights.astype(np.float64))[-1])
        running, bonus = 0.0, int(np.flatnonzero(weights > 0)[-1])
        for v, w in enumerate(weights.astype(np.float64)):
            running += w
            if w > 0 and running > target:
                bonus = v
                break
        r_out.append(r)
        bonus_out.append(bonus)
    return r_out, bonus_out


def _greedy_inputs(batch, d, vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, d + 1, vocab, generator=g).to(DEVICE, dtype)
    draft = logits.argmax(-1)[:, :d].clone()
    first_miss = torch.randint(0, d + 1, (batch,), generator=g)  # d = all accepted
    for b in range(batch):
        if first_miss[b] < d:
            draft[b, first_miss[b]] = (draft[b, first_miss[b]] + 1) % vocab
            draft[b, first_miss[b] + 1:] = torch.randint(0, vocab, (d - 1 - int(first_miss[b]),), generator=g)
    return logits, draft


# (batch, d, vocab, dtype, splits or None = automatic)
GREEDY = [(1, 1, 64, torch.float32, None), (3, 4, 1000, torch.float32, 3), (5, 7, 777, torch.bfloat16, None),
          (16, 16, 50, torch.float32, 2), (8, 3, 4096, torch.float16, 4)]


@pytest.mark.parametrize("batch,d,vocab,dtype,splits", GREEDY)
def test_greedy_matches_reference_and_numpy(batch, d, vocab, dtype, splits):
    logits, draft = _greedy_inputs(batch, d, vocab, dtype)
    want = _core_greedy(logits, draft)
    r, bonus = verify_greedy_triton(logits, draft, num_splits=splits)
    r_ref, bonus_ref = verify_greedy_reference(logits, draft)
    assert (r_ref.tolist(), bonus_ref.tolist()) == want
    assert (r.tolist(), bonus.tolist()) == want
    assert r.dtype == bonus.dtype == torch.long


@pytest.mark.parametrize("splits", [1, 3])
def test_greedy_ties_take_the_lowest_index(splits):
    logits = torch.zeros(2, 3, 10000, device=DEVICE)
    logits[:, :, [9000, 5000, 300]] = 1.0  # tied maxima in different vocabulary tiles (and splits)
    draft = torch.tensor([[300, 300], [300, 5000]], device=DEVICE)
    for r, bonus in (verify_greedy_triton(logits, draft, num_splits=splits), verify_greedy_reference(logits, draft)):
        assert r.tolist() == [2, 1] and bonus.tolist() == [300, 300]


def _sample_inputs(batch, d, vocab, dtype, seed=0, sharp=2.0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(batch, d + 1, vocab, generator=g) * sharp, -1)
    q = torch.softmax(torch.randn(batch, d, vocab, generator=g) * sharp, -1)
    draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(batch, d)
    u_accept, u_bonus = torch.rand(batch, d, generator=g), torch.rand(batch, generator=g)
    return p.to(DEVICE, dtype), q.to(DEVICE, dtype), draft.to(DEVICE), u_accept.to(DEVICE), u_bonus.to(DEVICE)


# (batch, d, vocab, dtype)
SAMPLE = [(1, 1, 32, torch.float32), (4, 3, 100, torch.float32), (8, 2, 1000, torch.bfloat16),
          (16, 7, 777, torch.float32), (3, 16, 300, torch.float16)]


@pytest.mark.parametrize("batch,d,vocab,dtype", SAMPLE)
def test_sample_matches_reference_and_numpy(batch, d, vocab, dtype):
    args = _sample_inputs(batch, d, vocab, dtype)
    want = _numpy_sample(*args)
    r_ref, bonus_ref = verify_sample_reference(*args)
    r, bonus = verify_sample_triton(*args)
    assert (r_ref.tolist(), bonus_ref.tolist()) == want
    assert (r.tolist(), bonus.tolist()) == want


def test_sample_edge_cases():
    """Row 0 accepts everything (bonus from p_d); row 1 has q == p at the rejection (residual 0 -> p_r);
    row 2 drafts a token q gives no mass (always accepted)."""
    vocab, d = 64, 3
    p, q, draft, u_accept, u_bonus = _sample_inputs(3, d, vocab, torch.float32, seed=4)
    u_accept[0] = 0.0
    draft[1, 0] = 5
    p[1, 0] = q[1, 0]
    p[1, 0, 5] = q[1, 0, 5] * 0.25  # ... except at the draft token: reject with probability 0.75
    u_accept[1, 0] = 0.9
    q[2, 0, draft[2, 0]] = 0.0
    u_accept[2, 0] = 0.999
    want = _numpy_sample(p, q, draft, u_accept, u_bonus)
    for r, bonus in (verify_sample_triton(p, q, draft, u_accept, u_bonus),
                     verify_sample_reference(p, q, draft, u_accept, u_bonus)):
        assert (r.tolist(), bonus.tolist()) == want
        assert r[0] == d and r[1] == 0 and r[2] >= 1


def _first_two_tokens(impl, n: int, seed: int):
    """Committed tokens of n identical rounds (d = 2): y1 = t1 or the bonus; y2 (when r >= 1) = t2 or the bonus."""
    vocab, d = 6, 2
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(1, d + 1, vocab, generator=g) * 1.5, -1).expand(n, -1, -1).contiguous()
    q = torch.softmax(torch.randn(1, d, vocab, generator=g) * 1.5, -1).expand(n, -1, -1).contiguous()
    draft = torch.multinomial(q[0], n, replacement=True, generator=g).T.contiguous()
    u_accept, u_bonus = torch.rand(n, d, generator=g), torch.rand(n, generator=g)
    r, bonus = impl(p.to(DEVICE), q.to(DEVICE), draft.to(DEVICE), u_accept.to(DEVICE), u_bonus.to(DEVICE))
    r, bonus = r.cpu(), bonus.cpu()
    committed = torch.cat([draft, torch.zeros(n, 1, dtype=torch.long)], 1)
    committed[torch.arange(n), r] = bonus
    return p[0].double().numpy(), committed, r


def _chi2(samples, probs) -> float:
    counts = np.bincount(samples.numpy(), minlength=len(probs))
    return stats.chisquare(counts, probs / probs.sum() * len(samples)).pvalue


@pytest.mark.parametrize("impl,n", [(verify_sample_reference, 40000), (verify_sample_triton, 4096)])
def test_rejection_sampling_is_lossless(impl, n):
    p, committed, r = _first_two_tokens(impl, n, seed=0)
    assert _chi2(committed[:, 0], p[0]) > 1e-3  # the first committed token follows p_0
    assert _chi2(committed[r >= 1, 1], p[1]) > 1e-3  # after t1 is accepted, the next follows p_1


@pytest.mark.slow
def test_qwen3_vocab():
    """V = 151,936 (Qwen3): greedy and sampling verification at d = 7."""
    logits, draft = _greedy_inputs(2, 7, 151936, torch.bfloat16, seed=9)
    r, bonus = verify_greedy_triton(logits, draft)
    r_ref, bonus_ref = verify_greedy_reference(logits, draft)
    assert torch.equal(r, r_ref) and torch.equal(bonus, bonus_ref)
    args = _sample_inputs(2, 7, 151936, torch.float32, seed=9, sharp=4.0)
    r, bonus = verify_sample_triton(*args)
    r_ref, bonus_ref = verify_sample_reference(*args)
    assert torch.equal(r, r_ref) and torch.equal(bonus, bonus_ref)
