"""The hidden ring's head in one core call (native.HostMarkovHead.from_hidden over _core.markov_head_hidden_host):
branch r's hidden states through the packed output head, then the Markov head, with the bits of the projection
and the head called one after the other; bad arguments raise ValueError naming the value."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dpara_rt import _core
from dpara_rt.host.linear import HostLinear
from dpara_rt.host.native import HostMarkovHead, gumbel_noise

V, H, R, D = 600, 48, 8, 5


def _parts(seed=0, bf16_head=True):
    g = torch.Generator().manual_seed(seed)
    head = HostLinear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) / H ** 0.5)
        if bf16_head:  # packed as bfloat16 panels (exact), else float32 ones
            head.weight.copy_(head.weight.bfloat16().float())
    w1, w2 = torch.randn(V, R, generator=g) * 0.3, torch.randn(R, V, generator=g)
    return head, HostMarkovHead(w1, w2, bound=True, cache_bytes=1)


@pytest.mark.parametrize("bf16_head", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("batch", [1, 3])
def test_from_hidden_is_the_projection_then_the_head(batch, temperature, bf16_head):
    head, markov = _parts(batch, bf16_head)
    assert head.packed()[1] == ("bfloat16" if bf16_head else "float32")
    g = torch.Generator().manual_seed(10 + batch)
    hidden = torch.randn(batch, D + 1, D, H, generator=g)
    r, bonus = torch.randint(0, D + 1, (batch,), generator=g), torch.randint(0, V, (batch,), generator=g)
    with torch.no_grad():
        projected = head(hidden[torch.arange(batch), r])  # [B, d, V], torch-indexed rows through HostLinear
    first = torch.zeros(batch, dtype=torch.long)
    want, q_want = markov(projected[:, None].contiguous(), first, bonus, temperature, 3, 9)
    logits = torch.full((batch, D, V), float("nan"))
    draft, q = markov.from_hidden(hidden, r, bonus, temperature, 3, 9, head=head.packed(), logits=logits)
    assert torch.equal(logits, projected) and torch.equal(draft, want)
    assert (q is None) if temperature == 0 else torch.equal(q, q_want)
    if temperature:  # the draft alone with the noise drawn ahead, its q later from the projected logits
        noise = gumbel_noise(batch, D, V, 3, 9)
        alone, none = markov.from_hidden(hidden, r, bonus, temperature, 3, 9, noise, with_q=False,
                                         head=head.packed(), logits=logits)
        assert none is None and torch.equal(alone, want)
        assert torch.equal(markov.q(logits[:, None], first, bonus, alone, temperature), q_want)


def test_from_hidden_arguments_are_checked():
    head, markov = _parts()
    hidden, logits = torch.randn(2, D + 1, D, H), torch.empty(2, D, V)
    r, bonus = torch.tensor([0, D]), torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"hidden is torch.float64 \(2, 6, 5, 48\) on cpu, expected a contiguous"):
        markov.from_hidden(hidden.double(), r, bonus, head=head.packed(), logits=logits)
    with pytest.raises(ValueError, match=r"head holds .* packed elements, expected host_linear_packed_elems\(V = 600"):
        markov.from_hidden(hidden, r, bonus, head=(head.packed()[0][:-1], "bfloat16"), logits=logits)
    with pytest.raises(ValueError, match=r"logits has shape \(2, 5, 599\), expected \[B, d, V\] = \(2, 5, 600\)"):
        markov.from_hidden(hidden, r, bonus, head=head.packed(), logits=logits[..., 1:].contiguous())
    with pytest.raises(ValueError, match=r"r\[1\] = 6, expected 0..5"):
        markov.from_hidden(hidden, torch.tensor([0, D + 1]), bonus, head=head.packed(), logits=logits)
    with pytest.raises(ValueError, match=r"bonus\[0\] = 600, expected 0..599"):
        markov.from_hidden(hidden, r, torch.tensor([V, 0]), head=head.packed(), logits=logits)
    with pytest.raises(ValueError, match=r"temperature = -1.0, expected a finite float >= 0"):
        markov.from_hidden(hidden, r, bonus, -1.0, head=head.packed(), logits=logits)
    assert markov.from_hidden(hidden, r, bonus, 0, head=head.packed(), logits=logits)[1] is None  # an int, as __call__
    with pytest.raises(ValueError, match="packed format 'int32', expected 'float32', 'bfloat16' or 'bf16_dot'"):
        _core.markov_head_hidden_host(hidden.data_ptr(), 2, D + 1, D, H, r.numpy(), head.packed()[0].data_ptr(),
                                      "int32", V, logits.data_ptr(), bonus.numpy(), markov.w1.data_ptr(),
                                      markov.w2.data_ptr(), R, 0.0, 0, 0, np.zeros((2, D), dtype=np.int64), 0)
