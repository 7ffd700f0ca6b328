"""The host Markov head's bias cache (native.HostMarkovHead(cache_bytes=...)): rows W1[x] @ W2 kept across calls
give the drafts and q of the head without one, bit for bit, whatever the batch, the hits and the evictions."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dpara_rt import _core
from dpara_rt.host.native import HostMarkovHead

SEED = 5


def _factors(vocab, rank, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, rank, generator=g) * 0.5, torch.randn(rank, vocab, generator=g) / rank ** 0.5


def _calls(batch, vocab, tokens, n_calls, dtype, seed=1):
    """Head calls whose previous tokens come from a few `tokens`: later calls find rows earlier ones kept."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n_calls):
        boundary = (torch.randn(batch, 3, 5, vocab, generator=g) * 3).to(dtype)
        r = torch.randint(0, 3, (batch,), generator=g)
        bonus = torch.tensor(tokens)[torch.randint(0, len(tokens), (batch,), generator=g)]
        yield boundary, r, bonus


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3, 40])
def test_cached_head_is_the_uncached_head(batch, dtype, temperature):
    vocab, rank = 700, 12
    w1, w2 = _factors(vocab, rank)
    plain, bounded = HostMarkovHead(w1, w2), HostMarkovHead(w1, w2, bound=True)
    cached = HostMarkovHead(w1, w2, bound=True, cache_bytes=64 * 4 * vocab)
    assert cached.cache.capacity == 64
    for i, (boundary, r, bonus) in enumerate(_calls(batch, vocab, [3, 9, 400], 4, dtype)):
        draft, q = cached(boundary, r, bonus, temperature, SEED, i)
        want, q_want = plain(boundary, r, bonus, temperature, SEED, i)
        assert torch.equal(draft, want)
        assert torch.equal(bounded(boundary, r, bonus, temperature, SEED, i)[0], want)
        if temperature:
            assert torch.equal(q, q_want)
            assert torch.equal(cached.q(boundary, r, bonus, draft, temperature), q_want)
    assert cached.cache.hits > 0 and cached.cache.misses > 0


def test_rows_are_replaced_least_recently_used_first_and_stay_exact():
    """32 rows (the least a head keeps) against 200 tokens: rows are replaced all the time, drafts never change."""
    vocab, rank = 500, 8
    w1, w2 = _factors(vocab, rank, seed=2)
    plain, cached = HostMarkovHead(w1, w2), HostMarkovHead(w1, w2, cache_bytes=1)
    assert cached.cache.capacity == 32
    for i, (boundary, r, bonus) in enumerate(_calls(2, vocab, list(range(200)), 30, torch.float32, seed=3)):
        assert torch.equal(cached(boundary, r, bonus)[0], plain(boundary, r, bonus)[0])
    assert cached.cache.misses > 32
    # a kept row is found again: the same call twice in a row adds only hits
    boundary, r, bonus = next(_calls(1, vocab, [7], 1, torch.float32, seed=4))
    cached(boundary, r, bonus)
    misses = cached.cache.misses
    cached(boundary, r, bonus)
    assert cached.cache.misses == misses


def test_kept_rows_are_read_instead_of_recomputed():
    """A head whose W2 changes in place breaks the cache's contract: its kept rows still hold the old bias. That
    the drafts follow the old W2 for kept tokens shows the rows are read, not recomputed."""
    vocab, rank = 300, 6
    w1, w2 = _factors(vocab, rank, seed=5)
    w2 *= 4  # a large bias, so that the drafts depend on it
    cached = HostMarkovHead(w1, w2, cache_bytes=1)
    boundary, r, bonus = next(_calls(1, vocab, [11], 1, torch.float32, seed=6))
    before = cached(boundary, r, bonus)[0]
    w2.neg_()
    after_plain = HostMarkovHead(w1, w2)(boundary, r, bonus)[0]
    assert not torch.equal(after_plain[:, 0], before[:, 0])  # the first step's bias is W1[11] @ W2
    assert torch.equal(cached(boundary, r, bonus)[0][:, 0], before[:, 0])


def test_cache_arguments_are_checked():
    w1, w2 = _factors(50, 4)
    with pytest.raises(ValueError, match=r"cache_bytes = -1, expected an int >= 0"):
        HostMarkovHead(w1, w2, cache_bytes=-1)
    with pytest.raises(ValueError, match="capacity = 0 rows, expected 1.."):
        _core.MarkovBiasCache(w1.data_ptr(), w2.data_ptr(), 50, 4, 0)
    with pytest.raises(ValueError, match="rank = 0, expected >= 1"):
        _core.MarkovBiasCache(w1.data_ptr(), w2.data_ptr(), 50, 0, 8)
    other = _core.MarkovBiasCache(w1.data_ptr(), w2.data_ptr(), 50, 4, 8)
    w1b = w1.clone()
    boundary = torch.randn(1, 1, 2, 50)
    draft = np.zeros((1, 2), dtype=np.int64)
    with pytest.raises(ValueError, match=r"the bias cache was built for w1 at .*\(one cache per pair of factors\)"):
        _core.markov_head_host(boundary.data_ptr(), "float32", 1, 1, 2, 50, np.zeros(1, dtype=np.int64),
                               np.zeros(1, dtype=np.int64), w1b.data_ptr(), w2.data_ptr(), 4, 0.0, 0, 0, draft, 0,
                               cache=other)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_room_for_every_row_makes_a_table_computed_when_the_head_is_built(temperature):
    """A head whose cache holds all V rows computes them as it is built (markov_bias_fill): its calls then only find
    rows, never compute one, and draft (and q) as the head without a cache does, bit for bit."""
    vocab, rank = 300, 10
    w1, w2 = _factors(vocab, rank, seed=7)
    plain, table = HostMarkovHead(w1, w2), HostMarkovHead(w1, w2, cache_bytes=4 * vocab * vocab)
    assert table.cache.capacity == vocab and (table.cache.hits, table.cache.misses) == (0, 0)
    for i, (boundary, r, bonus) in enumerate(_calls(3, vocab, list(range(0, vocab, 7)), 5, torch.float32, seed=8)):
        draft, q = table(boundary, r, bonus, temperature, SEED, i)
        want, q_want = plain(boundary, r, bonus, temperature, SEED, i)
        assert torch.equal(draft, want)
        if temperature:
            assert torch.equal(q, q_want)
    assert table.cache.misses == 0 and table.cache.hits == 5 * 3 * 5


def test_fill_computes_the_rows_a_step_would_and_keeps_the_last_ones_it_has_room_for():
    vocab, rank = 200, 6
    w1, w2 = _factors(vocab, rank, seed=9)
    cache = _core.MarkovBiasCache(w1.data_ptr(), w2.data_ptr(), vocab, rank, 40)
    tokens = np.array([5, 5, *range(100, 150)], dtype=np.int64)  # a repeat, and more tokens than rows
    cache.fill(tokens)
    head = HostMarkovHead(w1, w2)
    head.cache = cache  # the filled rows, used by a head's calls
    # the last 40 tokens are kept: a one-step call from each finds its row, and one from an earlier one does not
    one_step, r = torch.randn(1, 1, 1, vocab), torch.zeros(1, dtype=torch.long)
    for t in range(110, 150):
        head(one_step, r, torch.tensor([t]))
    assert (cache.hits, cache.misses) == (40, 0)
    head(one_step, r, torch.tensor([100]))
    assert (cache.hits, cache.misses) == (40, 1)
    for boundary, r, bonus in _calls(1, vocab, list(range(110, 150)), 6, torch.float32, seed=10):
        assert torch.equal(head(boundary, r, bonus)[0], HostMarkovHead(w1, w2)(boundary, r, bonus)[0])
    with pytest.raises(ValueError, match=r"markov_bias_fill: tokens\[1\] = 200, expected 0..199"):
        cache.fill(np.array([3, 200], dtype=np.int64))
    with pytest.raises(ValueError, match=r"tokens must have shape \(n,\)"):
        cache.fill(np.zeros((2, 2), dtype=np.int64))


def test_a_decodes_head_keeps_a_table_where_it_fits_and_a_cache_elsewhere():
    from dpara_rt import ops
    assert ops.markov_bias_bytes(8192) == 4 * 8192 * 8192 <= ops.MARKOV_BIAS_TABLE_BYTES
    assert ops.markov_bias_bytes(151936) == ops.MARKOV_BIAS_CACHE_BYTES
    w1, w2 = _factors(64, 4, seed=11)
    head = ops.markov_head_for(w1, w2)
    assert head.cache.capacity == 64 and head.cache.misses == 0
