"""Native host verification (dpara_rt.host.native.verify_sample_native over _core.verify_sample_host) makes the torch
reference's decisions exactly: acceptances, degenerate residuals, zero weights, uniforms at the edges, one-hot
(greedy) rows and non-finite weights; ops.verify_sample takes it on the CPU; bad arguments raise ValueError
naming the value. AR's draw (native.inverse_cdf_native over _core.inverse_cdf_host) is inverse_cdf's, bit for
bit, and sampling.sample takes it on the host."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from dpara_rt import _core, ops
from dpara_rt import sampling
from dpara_rt.kernels.verify import inverse_cdf, verify_sample_reference
from dpara_rt.host.native import argmax_finite, inverse_cdf_native, verify_sample_native

BELOW_ONE = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()  # the largest float32 < 1


def _case(batch: int, d: int, vocab: int, kind: str, seed: int):
    """(p, q, draft, u_accept, u_bonus) for one scenario; drafts come from q, as a drafter's do."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(batch, d + 1, vocab, generator=g) * 3, -1)
    q = torch.softmax(torch.randn(batch, d, vocab, generator=g) * 3, -1)
    draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(batch, d)
    u_accept = torch.rand(batch, d, generator=g)
    u_bonus = torch.rand(batch, generator=g)
    rows = torch.arange(batch)
    if kind == "all_accepted":  # 0 * q < p wherever p > 0: r = d, the bonus comes from p_d
        u_accept.zero_()
    elif kind == "none_accepted":  # the first draft token has no mass under p
        p[rows, 0, draft[:, 0]] = 0.0
    elif kind == "degenerate":  # rejected at 0 where q is p rounded up: the residual is 0 everywhere -> p_0
        p[rows, 0, draft[:, 0]] = 0.0
        q[:, 0] = torch.nextafter(p[:, 0], torch.tensor(float("inf")))
        q[rows, 0, draft[:, 0]] = 0.0
    elif kind == "zeros":  # truncated (top-k / top-p) p and a q with holes: many exact zero weights
        p = torch.where(torch.rand(p.shape, generator=g) < 0.6, 0.0, p)
        q = torch.where(torch.rand(q.shape, generator=g) < 0.3, 0.0, q)
    elif kind == "u_edges":  # uniforms at 0 and just below 1
        u_accept = torch.where(torch.rand(batch, d, generator=g) < 0.5, 0.0, BELOW_ONE)
        u_bonus = torch.tensor([0.0, BELOW_ONE, 1e-30] * batch)[:batch]
    elif kind == "one_hot":  # greedy requests (one-hot p and q) inside a sampled batch
        hot = torch.nn.functional.one_hot(p.argmax(-1), vocab).float()
        q_hot = torch.nn.functional.one_hot(draft, vocab).float()
        p[::2], q[::2] = hot[::2], q_hot[::2]
    elif kind == "non_finite":  # NaN / inf weights: whatever the reference decides, the core decides too
        p[0, :, vocab // 2] = float("nan")  # in every row request 0 may draw from
        q[-1, 0, 0] = float("inf")
        p[-1, 0, vocab - 1] = float("inf")
    return p, q, draft, u_accept, u_bonus


def _assert_same(args, native=verify_sample_native):
    r, bonus = native(*args)
    r_ref, bonus_ref = verify_sample_reference(*args)
    assert r.dtype == bonus.dtype == torch.long and r.shape == bonus.shape == r_ref.shape
    assert torch.equal(r, r_ref), (r, r_ref)
    assert torch.equal(bonus, bonus_ref), (bonus, bonus_ref)
    return r, bonus


KINDS = ["random", "all_accepted", "none_accepted", "degenerate", "zeros", "u_edges", "one_hot", "non_finite"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vocab", [5, 64, 8192])
@pytest.mark.parametrize("d", [1, 3, 7])
@pytest.mark.parametrize("batch", [1, 3])
def test_matches_reference(batch, d, vocab, kind):
    for seed in range(4 if vocab < 8192 else 2):
        r, _ = _assert_same(_case(batch, d, vocab, kind, seed=seed * 1000 + batch * 100 + d * 10 + len(kind)))
        if kind == "all_accepted":
            assert r.tolist() == [d] * batch
        elif kind in ("none_accepted", "degenerate"):
            assert r.tolist() == [0] * batch


def test_groups_of_rows_match_reference():
    """Batches that fill groups of four and leave a remainder (the core steps four requests together)."""
    for batch in (4, 5, 9):
        _assert_same(_case(batch, 3, 300, "random", seed=batch))
        _assert_same(_case(batch, 3, 300, "zeros", seed=batch))


def test_degenerate_residual_draws_from_p():
    """A rejection whose residual is all 0, and a full acceptance whose p_d is all <= 0: the draw is p's own."""
    p, q, draft, u_accept, u_bonus = _case(2, 2, 6, "degenerate", seed=3)
    u_accept[1] = 0.0  # request 1 accepts both tokens (0 * q < p) ...
    p[1, 0, draft[1, 0]] = 0.5
    p[1, 2] = torch.tensor([0.0, 0.0, -1.0, 0.0, -0.0, 0.0])  # ... and p_d has no positive weight
    u_bonus = torch.tensor([0.0, 0.5])
    r, bonus = _assert_same((p, q, draft, u_accept, u_bonus))
    assert r.tolist() == [0, 2]
    first_positive = torch.nonzero(p[0, 0] > 0).flatten()[0].item()
    assert bonus.tolist() == [first_positive, 0]  # u 0: the first positive weight; none positive: index 0


def test_threads_share_nothing():
    """The core keeps per-thread scratch and runs without the GIL: concurrent calls of different sizes agree."""
    cases = [_case(b, d, v, "random", seed=s) for s, (b, d, v) in enumerate([(1, 7, 8192), (5, 3, 64), (2, 1, 5)] * 4)]
    want = [verify_sample_reference(*c) for c in cases]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda c: verify_sample_native(*c), cases))
    for (r, bonus), (r_ref, bonus_ref) in zip(got, want):
        assert torch.equal(r, r_ref) and torch.equal(bonus, bonus_ref)


def test_empty_batch():
    r, bonus = verify_sample_native(torch.zeros(0, 3, 5), torch.zeros(0, 2, 5), torch.zeros(0, 2, dtype=torch.long),
                                    torch.zeros(0, 2), torch.zeros(0))
    assert r.shape == bonus.shape == (0,)


# ------------------------------------------------------------------------------------------ ops routing

def test_ops_takes_the_native_path_on_cpu(monkeypatch):
    """No torch reference and no torch-op value check on the host: the core answers alone."""
    monkeypatch.delenv("DPARA_RT_OPS", raising=False)

    def forbidden(*args, **kwargs):
        raise AssertionError("the host path must not run the torch reference or its value checks")

    monkeypatch.setattr(ops, "verify_sample_reference", forbidden)
    monkeypatch.setattr(ops, "_in_range", forbidden)
    for kind in ("random", "degenerate", "u_edges"):
        _assert_same(_case(3, 4, 64, kind, seed=7), native=ops.verify_sample)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ops_widens_other_dtypes_as_the_reference_does(monkeypatch, dtype):
    monkeypatch.delenv("DPARA_RT_OPS", raising=False)
    p, q, draft, u_accept, u_bonus = _case(3, 3, 64, "random", seed=5)
    args = (p.to(dtype), q.to(dtype), draft.to(torch.int32), u_accept.to(dtype), u_bonus.to(dtype))
    _assert_same(args, native=ops.verify_sample)
    # non-contiguous p, q (a strided view) are copied for the core, not refused
    wide_p, wide_q = torch.zeros(3, 4, 128), torch.zeros(3, 3, 128)
    wide_p[..., :64], wide_q[..., :64] = p, q
    _assert_same((wide_p[..., :64], wide_q[..., :64], draft, u_accept, u_bonus), native=ops.verify_sample)


def test_ops_host_errors_name_the_value(monkeypatch):
    monkeypatch.delenv("DPARA_RT_OPS", raising=False)
    p, q, draft, u_accept, u_bonus = _case(2, 3, 50, "random", seed=1)
    draft[1, 2] = 50
    with pytest.raises(ValueError, match=r"draft\[1, 2\] = 50, expected a token id in 0\.\.49"):
        ops.verify_sample(p, q, draft, u_accept, u_bonus)


# ------------------------------------------------------------------------------------------------ errors

def _good():
    return dict(zip(("p", "q", "draft", "u_accept", "u_bonus"), _case(2, 3, 64, "random", seed=2)))


def _with(name, fn):
    def make():
        args = _good()
        args[name] = fn(args[name])
        return args
    return make


def _set(name, index, value):
    def change(t):
        t = t.clone()
        t[index] = value
        return t
    return _with(name, change)


BAD = [
    ("draft_high", _set("draft", (0, 1), 64), r"draft\[0, 1\] = 64, expected a token id in 0\.\.63 \(vocab = 64\)"),
    ("draft_negative", _set("draft", (1, 2), -1), r"draft\[1, 2\] = -1, expected a token id in 0\.\.63"),
    ("u_accept_one", _set("u_accept", (0, 0), 1.0), r"u_accept\[0, 0\] = 1, expected a value in \[0, 1\)"),
    ("u_accept_nan", _set("u_accept", (1, 2), float("nan")),
     r"u_accept\[1, 2\] = nan, expected a value in \[0, 1\)"),
    ("u_accept_negative", _set("u_accept", (1, 0), -1e-3), r"u_accept\[1, 0\] = -0\.001"),
    ("u_bonus_nan", _set("u_bonus", 1, float("nan")), r"u_bonus\[1\] = nan, expected a value in \[0, 1\)"),
    ("u_bonus_high", _set("u_bonus", 0, 1.5), r"u_bonus\[0\] = 1\.5"),
    ("q_shape", _with("q", lambda t: t[:, :2]), r"q has shape \(2, 2, 64\), expected \[B, d, V\] = \(2, 3, 64\)"),
    ("u_bonus_shape", _with("u_bonus", lambda t: t[:1]), r"u_bonus has shape \(1,\), expected \[B\] = \(2,\)"),
    ("draft_ndim", _with("draft", lambda t: t[None]), r"draft must have 2 dimensions, got shape \(1, 2, 3\)"),
    ("d_zero", _with("p", lambda t: t[:, :1].contiguous()),
     r"p has 1 rows per request, expected d\+1 with draft length d"),
    ("p_dtype", _with("p", lambda t: t.double()), r"p must be float32, got torch\.float64"),
    ("u_accept_dtype", _with("u_accept", lambda t: t.half()), r"u_accept must be float32, got torch\.float16"),
    ("draft_dtype", _with("draft", lambda t: t.int()), r"draft must be int64, got torch\.int32"),
    ("q_device", _with("q", lambda t: t.to("meta")), r"q is on meta, expected a CPU tensor"),
    ("q_strided", _with("q", lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)),
     r"q with strides \(64, 128, 1\) is not contiguous"),
    ("u_bonus_list", _with("u_bonus", lambda t: t.tolist()), r"u_bonus must be a torch\.Tensor, got list"),
]


@pytest.mark.parametrize("make,message", [bad[1:] for bad in BAD], ids=[bad[0] for bad in BAD])
def test_bad_arguments_name_the_value(make, message):
    with pytest.raises(ValueError, match=message):
        verify_sample_native(**make())


def test_core_refuses_a_bad_draft_length():
    """Called directly (native.py checks d first), the core itself names a bad d."""
    ptr = torch.zeros(1).data_ptr()
    with pytest.raises(ValueError, match=f"draft length d must be in 1..{_core.MAX_DRAFT}, got 0"):
        _core.verify_sample_host(ptr, ptr, ptr, ptr, ptr, 1, 0, 1, ptr, ptr)


@pytest.mark.parametrize("shape", [(1, 8, 8192), (3, 5, 7), (2, 1, 9), (4, 13), (1, 1)])
def test_argmax_finite_is_torch_argmax_or_none(shape):
    """Greedy verification's one pass over the target's logits: torch.argmax (first index on ties, -0 == 0) when
    every value is finite, None when any is not."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g)
    x[..., -1] = x.amax(-1)  # the maximum again at the end of each row: the first one is picked
    x.view(-1, shape[-1])[0, 0] = -0.0
    assert torch.equal(argmax_finite(x), x.argmax(-1))
    assert torch.equal(argmax_finite(torch.zeros(shape) * -1), torch.zeros(shape[:-1], dtype=torch.long))
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y.view(-1)[-1] = bad  # the last value of the last row: every row is read
        assert argmax_finite(y) is None


def test_argmax_finite_arguments_are_checked():
    with pytest.raises(ValueError, match="expected a contiguous float32 CPU tensor"):
        argmax_finite(torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="expected a contiguous float32 CPU tensor"):
        argmax_finite(torch.zeros(4, 2).t())
    with pytest.raises(ValueError, match="vocab = 0, expected >= 1"):
        _core.argmax_finite_host(0, 1, 0, np.zeros(1, dtype=np.int64))
    with pytest.raises(ValueError, match="argmax_out must be a writable contiguous int64 array of shape"):
        _core.argmax_finite_host(torch.zeros(2, 3).data_ptr(), 2, 3, np.zeros(3, dtype=np.int64))


# ------------------------------------------------------------------------------------------ AR's draw

@pytest.mark.parametrize("kind", ["random", "zeros", "peaked", "u_edges", "non_finite"])
@pytest.mark.parametrize("vocab", [1, 5, 8192, 151936])
@pytest.mark.parametrize("batch", [1, 4, 9])
def test_inverse_cdf_native_is_the_reference_bit_for_bit(batch, vocab, kind):
    """Groups of four rows and a remainder, truncated rows (exact zeros, all-zero rows), a near one-hot row,
    uniforms at 0 and just below 1, NaN and inf weights: the core draws what inverse_cdf draws."""
    g = torch.Generator().manual_seed(batch * 7 + vocab + len(kind))
    w = torch.softmax(torch.randn(batch, vocab, generator=g) * (30 if kind == "peaked" else 3), -1)
    u = torch.rand(batch, generator=g)
    if kind == "zeros":
        w = torch.where(torch.rand(batch, vocab, generator=g) < 0.9, 0.0, w)
        w[0] = 0.0
    elif kind == "u_edges":
        u = torch.tensor([0.0, BELOW_ONE, 1e-30] * batch)[:batch]
    elif kind == "non_finite":
        w[0, vocab // 2] = float("nan")
        w[-1, 0] = float("inf")
    got = inverse_cdf_native(w, u)
    assert got.dtype == torch.long and torch.equal(got, inverse_cdf(w, u)), (got, inverse_cdf(w, u))


def test_inverse_cdf_native_checks_its_arguments():
    w = torch.softmax(torch.randn(2, 6), -1)
    with pytest.raises(ValueError, match=r"u\[1\] = 1, expected a value in \[0, 1\)"):
        inverse_cdf_native(w, torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match=r"u has shape \(3,\), expected \[B\] = \(2,\)"):
        inverse_cdf_native(w, torch.rand(3))
    with pytest.raises(ValueError, match="weights must be float32, got torch.float64"):
        inverse_cdf_native(w.double(), torch.rand(2))
    with pytest.raises(ValueError, match=r"weights must have 2 dimensions, got shape \(6,\)"):
        inverse_cdf_native(w[0], torch.rand(1))
    assert inverse_cdf_native(torch.zeros(0, 6), torch.zeros(0)).shape == (0,)


def test_sample_takes_the_native_draw_on_the_host(monkeypatch):
    """sampling.sample on host float32 logits draws through the core, with the reference's tokens."""
    calls = []
    monkeypatch.setattr(sampling, "inverse_cdf", lambda *a: calls.append(a) or inverse_cdf(*a))
    logits = torch.randn(5, 8192, generator=torch.Generator().manual_seed(1)) * 4
    got = sampling.sample(logits, 0.8, generator=sampling.make_generator(3))
    u = torch.rand(5, generator=sampling.make_generator(3))
    assert not calls and torch.equal(got, inverse_cdf(sampling.probs(logits, 0.8), u))
