"""Native host Markov head (dpara_rt.host.native over _core.markov_head_host) == the torch reference (drafts exactly,
q to float rounding) == the Triton kernel's sampled drafts (interpreted on the CPU); its Philox == kernels/_rng's
bit for bit; bad arguments raise ValueError naming the value."""
from __future__ import annotations  # `tl.constexpr` annotations stay strings until triton is loaded

import os

import torch

if not torch.cuda.is_available():  # must precede the first triton import (kernels import it lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from dpara_rt import _core  # noqa: E402
from dpara_rt.kernels import _rng  # noqa: E402
from dpara_rt.kernels.markov_head import markov_head_reference, markov_head_triton  # noqa: E402
from dpara_rt.host.native import HostMarkovHead, MarkovBound, gumbel_noise, markov_bound, markov_head_native  # noqa: E402

SEED, OFFSET = 11, (1 << 32) + 5  # an offset with both 32-bit words set


def _inputs(batch, n_rows, d, vocab, rank, dtype=torch.float32, seed=0):
    """Random logits and weights: continuous values, so near-ties (which fp32 rounding order could flip) are
    vanishingly rare."""
    g = torch.Generator().manual_seed(seed)
    boundary = (torch.randn(batch, n_rows, d, vocab, generator=g) * 3).to(dtype)
    r = torch.randint(0, n_rows, (batch,), generator=g)
    bonus = torch.randint(0, vocab, (batch,), generator=g)
    w1 = torch.randn(vocab, rank, generator=g)
    w2 = torch.randn(rank, vocab, generator=g) / rank ** 0.5
    return boundary, r, bonus, w1, w2


def _check_matches_reference(args, temperature):
    draft, q = markov_head_native(*args, temperature, SEED, OFFSET)
    want, q_ref = markov_head_reference(*args, temperature, SEED, OFFSET)
    assert draft.dtype == torch.long and draft.shape == want.shape
    assert torch.equal(draft, want)
    if temperature == 0:
        assert q is None and q_ref is None
    else:
        assert q.dtype == torch.float32 and q.shape == q_ref.shape
        torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [1, 16])
@pytest.mark.parametrize("vocab", [5, 300])
@pytest.mark.parametrize("d", [1, 4, 7])
@pytest.mark.parametrize("batch", [1, 3])
def test_matches_reference(batch, d, vocab, rank, dtype, temperature):
    _check_matches_reference(_inputs(batch, 3, d, vocab, rank, dtype, seed=batch * 7 + d + vocab), temperature)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_matches_reference_full_vocab(temperature):
    """The demo's shape: V = 8192 spans several vocabulary tiles, rank 128 several 4-row passes."""
    _check_matches_reference(_inputs(2, 8, 7, 8192, 128, seed=3), temperature)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("batch", [5, 33, 38])
def test_batched_rows_match_reference(batch, temperature):
    """Rows are stepped together in blocks of up to 32, in groups of 4 sharing each W2 load: a batch of 5 (a
    group and a single row), 33 (a block, then a block of one) and 38 (a block, then a block of 6), with
    a vocabulary tile narrower than V and a rank that leaves a tail of single W2 rows."""
    _check_matches_reference(_inputs(batch, 2, 3, 1003, 7, seed=batch), temperature)


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_float16_boundary_matches_reference(temperature):
    _check_matches_reference(_inputs(2, 2, 3, 1000, 7, torch.float16, seed=4), temperature)


def test_ties_pick_the_lowest_index_like_the_reference():
    """Small integers are exact in fp32 whatever the summation order, and tie often, across tiles too."""
    g = torch.Generator().manual_seed(2)
    batch, n_rows, d, vocab, rank = 4, 3, 5, 2500, 3
    boundary = torch.randint(0, 3, (batch, n_rows, d, vocab), generator=g).float()
    r = torch.randint(0, n_rows, (batch,), generator=g)
    bonus = torch.randint(0, vocab, (batch,), generator=g)
    w1 = torch.randint(-1, 2, (vocab, rank), generator=g).float()
    w2 = torch.randint(-1, 2, (rank, vocab), generator=g).float()
    assert torch.equal(markov_head_native(boundary, r, bonus, w1, w2)[0],
                       markov_head_reference(boundary, r, bonus, w1, w2)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [1, 5, 128])
@pytest.mark.parametrize("batch", [1, 3])
def test_bound_pruned_greedy_drafts_are_the_full_heads(batch, rank, dtype):
    """With a MarkovBound the greedy head computes exact values only for tokens the Cauchy-Schwarz bound leaves
    in reach: the drafts are the full head's. A trained head (small bias against the logit spread) prunes most
    tokens; a large random bias prunes few; both must agree."""
    for scale, seed in ((0.2, 1), (3.0, 2)):
        boundary, r, bonus, w1, w2 = _inputs(batch, 3, 7, 4099, rank, dtype, seed=seed)
        w2 = (w2 * scale).contiguous()
        full = markov_head_native(boundary, r, bonus, w1, w2)[0]
        assert torch.equal(markov_head_native(boundary, r, bonus, w1, w2, bound=markov_bound(w2))[0], full)
        assert torch.equal(full, markov_head_reference(boundary, r, bonus, w1, w2)[0])


def test_bound_pruned_ties_nan_and_infinite_rows_match_the_full_head():
    g = torch.Generator().manual_seed(3)
    batch, n_rows, d, vocab, rank = 4, 2, 5, 2500, 3
    boundary = torch.randint(0, 3, (batch, n_rows, d, vocab), generator=g).float()
    boundary[0, :, 1] = float("-inf")             # a row with no finite logit
    boundary[1, :, 2, ::7] = float("nan")         # NaN is never drafted
    r = torch.randint(0, n_rows, (batch,), generator=g)
    bonus = torch.randint(0, vocab, (batch,), generator=g)
    w1 = torch.randint(-1, 2, (vocab, rank), generator=g).float()
    w2 = torch.randint(-1, 2, (rank, vocab), generator=g).float()
    want = markov_head_native(boundary, r, bonus, w1, w2)[0]
    assert torch.equal(markov_head_native(boundary, r, bonus, w1, w2, bound=markov_bound(w2))[0], want)
    zero = torch.zeros(rank, vocab)  # a head without bias (markov_rank 0): the arg-max of the logits
    assert torch.equal(markov_head_native(boundary, r, bonus, w1, zero, bound=markov_bound(zero))[0],
                       markov_head_native(boundary, r, bonus, w1, zero)[0])


def test_bound_is_used_when_greedy_and_ignored_when_sampling():
    boundary, r, bonus, w1, w2 = _inputs(2, 3, 4, 300, 8, seed=9)
    good = markov_bound(w2)
    # A bound whose transpose lies: the greedy drafts change, so the pruned path really runs ...
    lying = MarkovBound(w2, torch.zeros_like(good.w2t), good.norms)
    assert not torch.equal(markov_head_native(boundary, r, bonus, w1, w2, bound=lying)[0],
                           markov_head_native(boundary, r, bonus, w1, w2)[0])
    # ... and sampling, which needs every token's value, never reads it
    draft, q = markov_head_native(boundary, r, bonus, w1, w2, 0.8, SEED, OFFSET, bound=lying)
    want, q_want = markov_head_native(boundary, r, bonus, w1, w2, 0.8, SEED, OFFSET)
    assert torch.equal(draft, want) and torch.equal(q, q_want)
    with pytest.raises(ValueError, match="bound was built for another W2"):
        markov_head_native(boundary, r, bonus, w1, w2.clone(), bound=good)


def test_sampled_draft_equals_triton():
    """Same Philox stream and Gumbel transform as the Triton kernel (interpreted when there is no GPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = _inputs(2, 3, 3, 64, 8, seed=5)
    for temperature, seed, offset in [(1.0, 0, 0), (0.6, 12345, (1 << 33) + 17), (2.0, (1 << 40) + 9, 3)]:
        draft, q = markov_head_native(*args, temperature, seed, offset)
        want, q_triton = markov_head_triton(*(t.to(device) for t in args), temperature, seed, offset)
        assert torch.equal(draft, want.cpu())
        torch.testing.assert_close(q, q_triton.cpu(), atol=1e-6, rtol=1e-5)


def test_philox_is_the_rng_module_bit_for_bit():
    rng = np.random.default_rng(0)
    counters = [0, 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, *rng.integers(0, 1 << 32, 200).tolist()]
    words = [0, 1, 5, (1 << 32) - 1, 1 << 32, (1 << 32) + 5, (1 << 63) - 1, 1 << 63, (1 << 64) - 1,
             *rng.integers(0, 1 << 63, 4, dtype=np.int64).tolist()]
    for seed, offset in zip(words, reversed(words)):
        want = _rng.philox4x32(torch.tensor(counters), offset, seed).tolist()
        assert [_core.philox4x32(c, offset, seed) for c in counters] == want, (seed, offset)


def test_empty_batch():
    boundary, r, bonus, w1, w2 = _inputs(0, 2, 3, 50, 4)
    draft, q = markov_head_native(boundary, r, bonus, w1, w2, 1.0)
    assert draft.shape == (0, 3) and q.shape == (0, 3, 50)


def test_sampling_repeats_for_a_seed_and_offset_and_moves_with_them():
    args = _inputs(2, 2, 6, 500, 8)
    first = markov_head_native(*args, 1.0, 3, 9)[0]
    assert torch.equal(first, markov_head_native(*args, 1.0, 3, 9)[0])
    assert not torch.equal(first, markov_head_native(*args, 1.0, 3, 10)[0])
    assert not torch.equal(first, markov_head_native(*args, 1.0, 4, 9)[0])


def _with(args, **changes):
    names = ("boundary", "r", "bonus", "w1", "w2")
    out = dict(zip(names, args))
    out.update(changes)
    return [out[n] for n in names]


@pytest.mark.parametrize("change,kwargs,match", [
    (dict(boundary=torch.zeros(2, 3, 4, 50, dtype=torch.float64)), {}, "boundary must be float32/bfloat16/float16"),
    (dict(boundary=torch.zeros(3, 2, 4, 50).transpose(0, 1)), {}, "not contiguous"),
    (dict(boundary=torch.zeros(2, 3, 50)), {}, "boundary must have 4 dimensions"),
    (dict(w1=torch.zeros(50, 6, dtype=torch.bfloat16)), {}, "w1 must be a contiguous float32 tensor"),
    (dict(w2=torch.zeros(50, 6).T), {}, "w2 must be a contiguous float32 tensor"),
    (dict(w2=torch.zeros(6, 49)), {}, r"w1 has shape \(50, 6\) and w2 \(6, 49\), expected \[V, R\] and \[R, V\]"),
    (dict(w1=torch.zeros(49, 6), w2=torch.zeros(6, 49)), {}, r"boundary's last dimension is 50; expected V = 49"),
    (dict(r=torch.tensor([0, 3])), {}, r"r\[1\] = 3, expected 0..2"),
    (dict(bonus=torch.tensor([50, 0])), {}, r"bonus\[0\] = 50, expected 0..49"),
    (dict(bonus=torch.tensor([1.0, 2.0])), {}, "bonus must hold integer indices"),
    (dict(r=torch.zeros(3, dtype=torch.long)), {}, r"r has shape \(3,\), expected \[B\] = \(2,\)"),
    (dict(r=[0, 1]), {}, "r must be a torch.Tensor, got list"),
    ({}, dict(temperature=-1.0), "temperature = -1.0"),
    ({}, dict(temperature=float("nan")), "temperature = nan"),
    ({}, dict(seed=-1), "seed = -1"),
    ({}, dict(offset=1 << 64), f"offset = {1 << 64}"),
    ({}, dict(temperature=1e-300), "1/temperature"),
])
def test_bad_arguments_name_the_value(change, kwargs, match):
    args = _with(_inputs(2, 3, 4, 50, 6), **change)
    with pytest.raises(ValueError, match=match):
        markov_head_native(*args, **kwargs)


def test_draft_length_is_checked_by_the_core():
    args = _inputs(1, 1, _core.MAX_DRAFT + 1, 4, 2)
    with pytest.raises(ValueError, match=f"got {_core.MAX_DRAFT + 1}"):
        markov_head_native(*args)


def test_core_binding_checks_its_arrays():
    boundary, r, bonus, w1, w2 = _inputs(2, 3, 4, 50, 6)
    call = dict(boundary_ptr=boundary.data_ptr(), boundary_dtype="float32", batch=2, n_rows=3, d=4, vocab=50,
                r=r.numpy(), bonus=bonus.numpy(), w1_ptr=w1.data_ptr(), w2_ptr=w2.data_ptr(), rank=6,
                temperature=0.0, seed=0, offset=0, draft_out=np.zeros((2, 4), dtype=np.int64), q_ptr=0)
    for key, value, match in [("draft_out", np.zeros((2, 3), dtype=np.int64), r"draft_out must be a writable .*\(2, 4\)"),
                              ("draft_out", np.zeros((2, 4), dtype=np.int32), "draft_out must be a writable"),
                              ("bonus", np.zeros(3, dtype=np.int64), r"bonus must have shape \(2,\)"),
                              ("boundary_dtype", "float64", "unknown dtype 'float64'"),
                              ("temperature", 1.0, "q_out is null")]:
        with pytest.raises(ValueError, match=match):
            _core.markov_head_host(**{**call, key: value})
    _core.markov_head_host(**call)  # the unchanged call is valid


# ------------------------------------------------------------------ noise drawn ahead (dpara_rt.host.noise_ahead)
@pytest.mark.parametrize("batch,d,vocab,dtype", [(1, 7, 300, torch.bfloat16), (3, 4, 64, torch.float32),
                                                 (5, 1, 1000, torch.float16)])
def test_noise_drawn_ahead_gives_the_same_draft_and_q(batch, d, vocab, dtype):
    boundary, r, bonus, w1, w2 = _inputs(batch, d + 1, d, vocab, 16, dtype, seed=batch)
    head = HostMarkovHead(w1, w2, True)
    noise = gumbel_noise(batch, d, vocab, SEED, OFFSET)
    own = head(boundary, r, bonus, 0.7, SEED, OFFSET)
    drawn = head(boundary, r, bonus, 0.7, SEED, OFFSET, noise)
    assert torch.equal(own[0], drawn[0]) and torch.equal(own[1], drawn[1])
    # the noise really is read: another call's noise changes the draws
    other = head(boundary, r, bonus, 0.7, SEED, OFFSET, gumbel_noise(batch, d, vocab, SEED, OFFSET + 1))
    assert not torch.equal(own[0], other[0])
    # the same bits as the Philox stream the head draws from: g = -log(-log(u))
    b, j, v = batch - 1, d - 1, 3
    bits = _core.philox4x32((b * d + j) * vocab + v, OFFSET, SEED)
    u = ((bits >> 9) * 2 + 1) * 2.0 ** -24
    assert float(noise[b, j, v]) == pytest.approx(-np.log(-np.log(u)), rel=1e-6)


def test_noise_drawn_ahead_is_checked():
    boundary, r, bonus, w1, w2 = _inputs(2, 3, 2, 50, 8)
    head = HostMarkovHead(w1, w2)
    with pytest.raises(ValueError, match="noise is given with temperature 0"):
        head(boundary, r, bonus, 0.0, SEED, OFFSET, gumbel_noise(2, 2, 50, SEED, OFFSET))
    with pytest.raises(ValueError, match=r"noise has shape \(2, 2, 49\), expected \[B, d, V\] = \(2, 2, 50\)"):
        head(boundary, r, bonus, 1.0, SEED, OFFSET, torch.zeros(2, 2, 49))
    with pytest.raises(ValueError, match="seed = -1, expected an int"):
        gumbel_noise(2, 2, 50, -1, 0)
    with pytest.raises(ValueError, match="draft length d must be in 1..32, got 0"):
        _core.gumbel_noise_host(0, 1, 0, 50, 0, 0)
    with pytest.raises(ValueError, match=r"batch \* d \* vocab = 8589934592, expected <= 2\^32"):
        _core.gumbel_noise_host(0, 1 << 16, 2, 1 << 16, 0, 0)


# ------------------------------------------------------------------ a draft alone, its q later (noise_ahead.WorkerQ)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("batch,d,vocab,dtype,bf16_w2", [(1, 7, 2000, torch.bfloat16, True),
                                                         (3, 4, 300, torch.float32, False),
                                                         (34, 2, 150, torch.float16, True)])
def test_draft_alone_then_q_is_the_full_call(batch, d, vocab, dtype, bf16_w2, temperature):
    boundary, r, bonus, w1, w2 = _inputs(batch, d + 1, d, vocab, 16, dtype, seed=vocab)
    if bf16_w2:  # a bf16 drafter's factors: the bound's W2 transpose is bf16 (half the bytes)
        w1, w2 = w1.bfloat16().float(), (w2 * 4).bfloat16().float()
    head = HostMarkovHead(w1, w2, True)
    assert (head.bound.w2t.dtype == torch.bfloat16) == bf16_w2
    noise = gumbel_noise(batch, d, vocab, SEED, OFFSET)
    draft, q = head(boundary, r, bonus, temperature, SEED, OFFSET, noise)
    alone, none = head(boundary, r, bonus, temperature, SEED, OFFSET, noise, with_q=False)
    assert none is None and torch.equal(alone, draft)
    out = torch.full_like(q, -1.0)
    assert head.q(boundary, r, bonus, alone, temperature, out=out) is out
    assert torch.equal(out, q)  # bit for bit
    assert torch.equal(head.q(boundary, r, bonus, alone, temperature), q)
    # q is computed from the draft it is given: another draft gives another q
    other = (alone + 1) % vocab
    assert not torch.equal(head.q(boundary, r, bonus, other, temperature)[:, 1:], q[:, 1:])


def test_draft_alone_and_q_are_checked():
    boundary, r, bonus, w1, w2 = _inputs(2, 3, 2, 50, 8)
    head = HostMarkovHead(w1, w2, True)
    noise = gumbel_noise(2, 2, 50, SEED, OFFSET)
    with pytest.raises(ValueError, match="with_q=False with temperature 1.0 and noise None: expected a sampling"):
        head(boundary, r, bonus, 1.0, SEED, OFFSET, with_q=False)
    with pytest.raises(ValueError, match="noise is given with temperature 0"):
        head(boundary, r, bonus, 0.0, SEED, OFFSET, noise, with_q=False)
    draft = torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="with temperature 0: greedy drafting has no q"):
        head.q(boundary, r, bonus, draft, 0.0)
    with pytest.raises(ValueError, match=r"draft is torch.int64 \(2, 3\), expected int64 \[B, d\] = \(2, 2\)"):
        head.q(boundary, r, bonus, torch.zeros(2, 3, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match=r"draft\[3\] = 50, expected 0..49"):
        head.q(boundary, r, bonus, torch.tensor([[0, 1], [2, 50]]), 1.0)
    with pytest.raises(ValueError, match=r"out has shape \(2, 2, 49\)"):
        head.q(boundary, r, bonus, draft, 1.0, out=torch.zeros(2, 2, 49))
