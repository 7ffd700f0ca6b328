"""Fused Markov head: Triton (interpreted on the CPU) == torch reference == a naive numpy walk; the shared
Philox stream; Gumbel-max sampling against the exact distribution (chi-square)."""
from __future__ import annotations  # `tl.constexpr` annotations stay strings until triton is loaded

import os

import torch

if not torch.cuda.is_available():  # must precede the first triton import (kernels import it lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from scipy import stats  # noqa: E402

from dpara_rt import ops  # noqa: E402
from dpara_rt.host.native import HostMarkovHead  # noqa: E402
from dpara_rt.kernels import _rng, triton_support  # noqa: E402
from dpara_rt.kernels.markov_head import (factor_bytes_per_step, markov_head_reference,  # noqa: E402
                                          markov_head_triton)
from dpara_rt.models.drafter import Drafter, DrafterConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(batch, n_slots, d, vocab, rank, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    boundary = (torch.randn(batch, n_slots, d, vocab, generator=g) * 3 * scale).to(DEVICE, dtype)
    r = torch.randint(0, n_slots, (batch,), generator=g)
    bonus = torch.randint(0, vocab, (batch,), generator=g)
    w1 = (torch.randn(vocab, rank, generator=g) * scale).to(DEVICE, dtype)
    w2 = (torch.randn(rank, vocab, generator=g) / rank ** 0.5).to(DEVICE, dtype)
    return boundary, r, bonus, w1, w2


tl = None  # bound to triton.language by triton_support.load()


@triton_support.kernel
def _gumbel_probe(OUT, seed, off_lo, off_hi, base, N: tl.constexpr):
    idx = tl.arange(0, N)
    tl.store(OUT + idx, _rng.gumbel_noise(seed, (idx.to(tl.int64) + base).to(tl.uint32), off_lo, off_hi))


def test_philox_known_answer():
    # Random123's known-answer vector for Philox4x32-10 at counter 0, key 0 starts with 0x6627e8d5
    assert _rng.philox4x32(torch.zeros(1, dtype=torch.long), 0, 0).item() == 0x6627E8D5
    u = _rng.uniform_from_bits(_rng.philox4x32(torch.arange(1 << 16), 5, 7))
    assert 0.0 < u.min() and u.max() < 1.0 and abs(u.mean().item() - 0.5) < 0.01


@pytest.mark.parametrize("seed,offset,base", [(0, 0, 0), (12345, (1 << 31) + 7, (1 << 32) - 300),
                                              ((1 << 62) + 3, (1 << 63) - 1, 5)])
def test_triton_gumbel_noise_is_the_torch_stream(seed, offset, base):
    triton_support.load()
    n = 512
    out = torch.empty(n, device=DEVICE)
    off_lo, off_hi = (_rng.as_int32_bits(w) for w in _rng.split_u64(offset))
    _gumbel_probe[(1,)](out, seed, off_lo, off_hi, base, N=n)
    # counters wrap at 2**32 on both sides; log/exp may differ in the last bit between libraries
    want = _rng.gumbel(torch.arange(n) + base, offset, seed)
    torch.testing.assert_close(out.cpu(), want, atol=1e-6, rtol=1e-6)


# (batch, acceptance rows R1, d, vocab, rank, dtype, vocabulary splits or None = automatic)
GREEDY = [
    (1, 1, 1, 64, 16, torch.float32, None),        # serial (DSpark) layout, a single step
    (3, 4, 3, 777, 8, torch.float32, 3),           # non-power-of-two vocab split 3 ways, tiny rank
    (4, 8, 7, 1000, 256, torch.bfloat16, 2),       # DSpark rank 256, batch <= 4 (GEMV path)
    (16, 17, 16, 513, 32, torch.bfloat16, 4),      # batch 16 and d = 16 (tensor-core path)
    (5, 2, 2, 300, 16, torch.float32, None),       # batch 5: first batch past the GEMV path
    (9, 3, 5, 4096, 64, torch.float16, 5),
]


@pytest.mark.parametrize("batch,n_slots,d,vocab,rank,dtype,splits", GREEDY)
def test_greedy_triton_matches_reference(batch, n_slots, d, vocab, rank, dtype, splits):
    args = _inputs(batch, n_slots, d, vocab, rank, dtype)
    draft, q = markov_head_triton(*args, num_splits=splits)
    want, q_ref = markov_head_reference(*args)
    assert q is None and q_ref is None
    assert draft.dtype == torch.long and torch.equal(draft, want)


def _numpy_walk(boundary, r, bonus, w1, w2):
    """The definition, one request and one step at a time (np.argmax picks the first maximum)."""
    boundary, w1, w2 = (t.double().cpu().numpy() for t in (boundary, w1, w2))
    out = []
    for b in range(boundary.shape[0]):
        x, row = int(bonus[b]), []
        for j in range(boundary.shape[2]):
            x = int(np.argmax(boundary[b, int(r[b]), j] + w1[x] @ w2))
            row.append(x)
        out.append(row)
    return torch.tensor(out)


def test_greedy_equals_naive_walk_with_ties():
    """Small integer logits and weights are exact in every precision and tie often: lowest index wins."""
    g = torch.Generator().manual_seed(2)
    batch, n_slots, d, vocab, rank = 6, 4, 5, 70, 3
    boundary = torch.randint(0, 3, (batch, n_slots, d, vocab), generator=g).float().to(DEVICE)
    r = torch.randint(0, n_slots, (batch,), generator=g)
    bonus = torch.randint(0, vocab, (batch,), generator=g)
    w1 = torch.randint(-1, 2, (vocab, rank), generator=g).float().to(DEVICE)
    w2 = torch.randint(-1, 2, (rank, vocab), generator=g).float().to(DEVICE)
    want = _numpy_walk(boundary, r, bonus, w1, w2)
    assert torch.equal(markov_head_reference(boundary, r, bonus, w1, w2)[0].cpu(), want)
    assert torch.equal(markov_head_triton(boundary, r, bonus, w1, w2, num_splits=3)[0].cpu(), want)


@pytest.mark.parametrize("splits", [1, 4])
def test_ties_across_tiles_and_splits_pick_the_lowest_index(splits):
    vocab = 1000  # 4 vocabulary tiles: one split walks them all, four splits take one each
    boundary = torch.zeros(2, 1, 2, vocab, device=DEVICE)
    boundary[:, :, :, [777, 512, 900]] = 5.0  # equal maxima in different tiles
    boundary[1, :, 1, 3] = 5.0
    w = torch.zeros(vocab, 4, device=DEVICE)
    args = (boundary, torch.zeros(2, dtype=torch.long), torch.tensor([1, 2]), w, w.T.contiguous())
    assert markov_head_triton(*args, num_splits=splits)[0].tolist() == [[512, 512], [512, 3]]
    assert markov_head_reference(*args)[0].tolist() == [[512, 512], [512, 3]]


def test_boundary_is_read_through_its_strides():
    """A ring slot stored [R1, B, d, V] is passed permuted to [B, R1, d, V]: no copy needed."""
    boundary, r, bonus, w1, w2 = _inputs(3, 4, 3, 300, 16, torch.float32, seed=6)
    strided = boundary.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)
    assert not strided.is_contiguous()
    assert torch.equal(markov_head_triton(strided, r, bonus, w1, w2, 0.8, 3, 4)[0],
                       markov_head_reference(boundary, r, bonus, w1, w2, 0.8, 3, 4)[0])


# (batch, R1, d, vocab, rank, dtype, temperature, splits)
SAMPLING = [
    (2, 3, 3, 300, 8, torch.float32, 0.7, 3),
    (6, 4, 5, 1000, 16, torch.bfloat16, 1.0, 3),
    (1, 8, 7, 513, 256, torch.float32, 1.5, None),
    (16, 2, 9, 96, 16, torch.float32, 0.3, 2),
]


@pytest.mark.parametrize("batch,n_slots,d,vocab,rank,dtype,temperature,splits", SAMPLING)
def test_sampling_triton_matches_reference(batch, n_slots, d, vocab, rank, dtype, temperature, splits):
    args = _inputs(batch, n_slots, d, vocab, rank, dtype, scale=0.3)
    draft, q = markov_head_triton(*args, temperature, seed=11, offset=(1 << 32) + 5, num_splits=splits)
    want, q_ref = markov_head_reference(*args, temperature, seed=11, offset=(1 << 32) + 5)
    assert torch.equal(draft, want)
    assert q.shape == (batch, d, vocab) and q.dtype == torch.float32
    torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(q.sum(-1), torch.ones(batch, d, device=q.device))


def test_sampling_repeats_for_a_seed_and_offset_and_moves_with_them():
    args = _inputs(4, 2, 6, 500, 8, torch.float32, scale=0.1)
    first = markov_head_reference(*args, 1.0, seed=3, offset=9)[0]
    assert torch.equal(first, markov_head_reference(*args, 1.0, seed=3, offset=9)[0])
    assert torch.equal(first, markov_head_triton(*args, 1.0, seed=3, offset=9)[0])
    assert not torch.equal(first, markov_head_reference(*args, 1.0, seed=3, offset=10)[0])
    assert not torch.equal(first, markov_head_reference(*args, 1.0, seed=4, offset=9)[0])


def _joint_pairs_chi2(impl, n: int, seed: int) -> float:
    """Draft two tokens for n identical requests; chi-square p-value of the pairs against the exact law."""
    vocab, temperature = 5, 0.8
    g = torch.Generator().manual_seed(seed)
    boundary = torch.randn(1, 1, 2, vocab, generator=g).expand(n, 1, 2, vocab).contiguous().to(DEVICE)
    w1, w2 = torch.randn(vocab, 3, generator=g).to(DEVICE), torch.randn(3, vocab, generator=g).to(DEVICE)
    bonus = torch.full((n,), 2)
    draft, q = impl(boundary, torch.zeros(n, dtype=torch.long), bonus, w1, w2, temperature, seed, 1)
    p1 = torch.softmax((boundary[0, 0, 0] + w1[2] @ w2) / temperature, -1)
    p2 = torch.softmax((boundary[0, 0, 1][None] + w1 @ w2) / temperature, -1)  # row a: law of x2 given x1 = a
    torch.testing.assert_close(q[:, 0], p1.expand(n, vocab), atol=1e-5, rtol=1e-5)
    exact = (p1[:, None] * p2).flatten().double().cpu().numpy()
    exact /= exact.sum()
    counts = np.bincount((draft[:, 0] * vocab + draft[:, 1]).cpu().numpy(), minlength=vocab * vocab)
    return stats.chisquare(counts, exact * n).pvalue


def test_gumbel_sampling_follows_softmax_reference():
    assert _joint_pairs_chi2(markov_head_reference, 20000, seed=0) > 1e-3


def test_gumbel_sampling_follows_softmax_triton():
    assert _joint_pairs_chi2(markov_head_triton, 1024, seed=1) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_qwen3_vocab(temperature):
    """V = 151,936 (Qwen3) for one request: a few steps, greedy and sampling."""
    args = _inputs(1, 3, 2, 151936, 16, torch.bfloat16, seed=7, scale=0.3)
    draft, q = markov_head_triton(*args, temperature, seed=5, offset=2)
    want, q_ref = markov_head_reference(*args, temperature, seed=5, offset=2)
    assert torch.equal(draft, want)
    if temperature:
        torch.testing.assert_close(q, q_ref, atol=1e-7, rtol=1e-4)


def _drafter(dtype, vocab=300, hidden=32, rank=16):
    cfg = DrafterConfig(layer_ids=[0], target_hidden_size=hidden, hidden_size=hidden, num_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
                        rms_norm_eps=1e-6, rope_theta=1e4, vocab_size=vocab, block_size=4, markov_rank=rank)
    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab, bias=False)
    drafter = Drafter(cfg, embed.to(dtype), head.to(dtype)).eval().requires_grad_(False)
    with torch.no_grad():
        drafter.w1.normal_(std=1.0)
        drafter.w2.normal_(std=rank ** -0.5)  # zero at initialisation: no bias to compare
    return drafter


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_device_head_reads_the_drafters_own_factors(monkeypatch, dtype):
    """Triton and the torch path draft with the drafter's factors as they are (bf16: half the bytes of a float32
    copy a step) and accumulate in float32: the drafts of the float32 widening, q within 1e-6 + 1e-5 relative."""
    monkeypatch.setenv("DPARA_RT_OPS", "torch")
    drafter = _drafter(dtype).to(DEVICE)
    head = drafter.markov_head()
    assert isinstance(head, ops.BoundMarkovHead) and head.w2.dtype == dtype
    assert head.w1.data_ptr() == drafter.w1.data_ptr() and head.w2.data_ptr() == drafter.w2.data_ptr()  # no copy
    wide = drafter.markov_factors()  # the float32 widening the head read before
    assert factor_bytes_per_step(*wide, 2) == factor_bytes_per_step(head.w1, head.w2, 2) * (4 // dtype.itemsize)
    g = torch.Generator().manual_seed(4)
    boundary = (torch.randn(2, 5, 4, 300, generator=g) * 3).to(DEVICE, dtype)
    r, bonus = torch.tensor([3, 0]), torch.tensor([17, 250])
    for temperature in (0.0, 0.8):
        draft, q = head(boundary, r, bonus, temperature, seed=9, offset=2)
        want, q_ref = markov_head_reference(boundary, r, bonus, *wide, temperature, 9, 2)
        triton_draft, triton_q = markov_head_triton(boundary, r, bonus, head.w1, head.w2, temperature, 9, 2)
        assert torch.equal(draft, want) and torch.equal(triton_draft, want)
        if temperature:
            if dtype == torch.float32 or DEVICE == "cpu":  # the same float32 arithmetic
                assert torch.equal(q, q_ref)
            torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(triton_q, q_ref, atol=1e-6, rtol=1e-5)


def test_a_bf16_drafter_on_the_host_drafts_with_the_native_float32_head(monkeypatch):
    monkeypatch.delenv("DPARA_RT_OPS", raising=False)
    head = _drafter(torch.bfloat16).markov_head()  # a CPU drafter: the host backend
    assert isinstance(head, HostMarkovHead)
