"""The Markov head's torch reference traces as one graph (torch.compile fullgraph=True): no host read or
data-dependent branch inside it, the precondition for capturing it in a CUDA graph. (The drafter's backbone does not
yet: the host rope table's position read, the tree attention's context length read and the core's tree mask break
it.)"""
from __future__ import annotations

import pytest
import torch

from dpara_rt.kernels.markov_head import markov_head_reference


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_markov_head_reference_compiles_as_one_graph_with_the_same_drafts(temperature):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    B, R1, n, V, R = 2, 5, 4, 64, 8
    boundary = torch.randn(B, R1, n, V, generator=g)
    w1, w2 = torch.randn(V, R, generator=g), torch.randn(R, V, generator=g)
    r, bonus = torch.tensor([1, 3]), torch.tensor([5, 7])
    compiled = torch.compile(markov_head_reference, fullgraph=True, backend="eager")
    draft, q = compiled(boundary, r, bonus, w1, w2, temperature, 3, 1)
    want, want_q = markov_head_reference(boundary, r, bonus, w1, w2, temperature, 3, 1)
    assert torch.equal(draft, want)
    assert (q is None) == (want_q is None) and (q is None or torch.equal(q, want_q))
    torch._dynamo.reset()
