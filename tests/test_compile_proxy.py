"""The steps a CUDA device captures as graphs trace as one graph each (torch.compile fullgraph=True, the eager
backend) and give the eager bits: no host read or data-dependent branch inside them, the precondition for capture.

What compiles, on the device path (DPARA_RT_OPS=torch, the native host paths off):
- the Markov head's torch reference;
- the target's static verify step (StaticVerify._forward: logits, features and the packed arg-max from the
  persistent tokens and dev_lengths, the KV writes included);
- the drafter's backbone over the tree with ops.tree_attention as boundary_logits attends (the context cache's
  full capacity: the mask hides the slots past each row's length);
- the drafter's context update's device part: Drafter.context_kv and the scatter into the cache. extend_context
  as a whole does not: it checks the counts and builds the scatter's indices from host numpy counts by design.

The host backend keeps its host reads (the RoPE table sized from the positions, the tree attention's longest
context), and the core's tree mask is a host array: under compile the mask is derived from indices instead.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dpara_rt import _core, ops
from dpara_rt.kernels.markov_head import markov_head_reference
from dpara_rt.kernels.tree_attention import tree_mask, tree_mask_from_indices
from dpara_rt.models.drafter import MASK_ID, Drafter, DrafterConfig, tree_layout
from dpara_rt.models.kv_cache import KVCache
from dpara_rt.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from dpara_rt.models.static_verify import StaticVerify

D = 3  # draft length of the drafter tests


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(fn):
    """fn compiled as one graph: a graph break (a host read among them) raises."""
    return torch.compile(fn, fullgraph=True, backend="eager")


@pytest.fixture(scope="module")
def pair():
    """A tiny random target (2 layers, hidden 32, vocab 128) and a 2-layer drafter on two of its layers."""
    hidden = 32
    cfg = Qwen3Config.from_dict(dict(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=hidden // 4, rms_norm_eps=1e-6, rope_theta=1e6,
                                     max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=[]))
    target = Qwen3ForCausalLM(cfg)
    target.init_weights(std=0.05, generator=torch.Generator().manual_seed(0))
    target.eval().requires_grad_(False)
    dcfg = DrafterConfig.for_target(cfg, num_layers=2, layer_ids=[0, 1], block_size=D, markov_rank=8)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        drafter = Drafter(dcfg, target.embed_tokens, target.lm_head).eval().requires_grad_(False)
    return target, drafter


def _random_cache(cache, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    cache.lengths[:] = torch.tensor(lengths)
    return cache


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


@pytest.mark.parametrize("d", range(1, _core.MAX_DRAFT + 1))
def test_tree_mask_from_indices_is_the_cores(d):
    assert torch.equal(tree_mask_from_indices(d), tree_mask(d))


def test_tree_mask_compiles_to_the_cores():
    got = compiled(lambda x: x.masked_fill(~tree_mask(D, str(x.device)), 0.0))(torch.ones(16, 16))
    assert torch.equal(got, tree_mask(D).float())


def test_static_verify_step_compiles_as_one_graph_with_the_same_bits(pair, torch_path):
    target, _ = pair
    tokens = torch.randint(0, 128, (2, 4), generator=torch.Generator().manual_seed(2))

    def step():
        cache = _random_cache(KVCache.for_model(target.config, 2, 64, torch.float32, "cpu"), [5, 9], seed=3)
        sv = StaticVerify(target, cache, [0, 1], "static")
        sv.lengths_changed()
        return sv

    eager, traced = step(), step()
    with torch.no_grad():
        want = eager._forward(tokens.clone(), 64)
        got = compiled(traced._forward)(tokens.clone(), 64)
    for name, w, g in zip(("logits", "features", "packed"), want, got):
        assert torch.equal(g, w), name
    assert torch.equal(traced.cache.k, eager.cache.k) and torch.equal(traced.cache.v, eager.cache.v)


def test_drafter_backbone_over_the_tree_compiles_as_one_graph_with_the_same_bits(pair, torch_path):
    _, drafter = pair
    B, w = 2, D
    cache = _random_cache(drafter.new_context_cache(B, 40), [7, 13], seed=4)
    offsets, _ = tree_layout(w)
    spine = torch.randint(0, 128, (B, w + 1), generator=torch.Generator().manual_seed(5))
    tokens = torch.cat([spine, torch.full((B, (w + 1) * w), MASK_ID)], dim=1)
    positions = cache.lengths[:, None] + offsets
    ctx_kv = [(cache.k[i], cache.v[i]) for i in range(cache.k.shape[0])]  # whole capacity: a static shape

    def backbone(tokens, positions, ctx_lens, ctx_kv):  # as Drafter.boundary_logits runs it
        def attend(q, k_ctx, v_ctx, k_tree, v_tree):
            return ops.tree_attention(q, k_ctx, v_ctx, ctx_lens, k_tree, v_tree, w, drafter.scale,
                                      lens_checked=True)
        return drafter.backbone(tokens, positions, ctx_kv, attend, keep_from=w + 1)

    with torch.inference_mode():
        want = backbone(tokens, positions, cache.lengths.clone(), ctx_kv)
        got = compiled(backbone)(tokens, positions, cache.lengths.clone(), ctx_kv)
        boundary = drafter.boundary_logits(cache, spine, project=False)
    assert torch.equal(got, want)
    # boundary_logits trims the context to the longest row: the same maths, summed over fewer columns
    torch.testing.assert_close(want.view(B, w + 1, w, -1), boundary, rtol=1e-5, atol=1e-5)


def test_drafter_context_kv_and_its_scatter_compile_as_one_graph_with_the_same_bits(pair, torch_path):
    _, drafter = pair
    B, T, L = 2, 4, 40
    features = torch.randn(B, T, drafter.config.feature_size, generator=torch.Generator().manual_seed(6))
    counts, lengths = np.array([3, 1]), np.array([7, 13])
    # the host's part of extend_context: positions and the scatter's indices from host counts
    pos = torch.from_numpy(np.minimum(lengths[:, None] + np.arange(T), L - 1))
    rows, cols = np.nonzero(np.arange(T)[None, :] < counts[:, None])
    dst = torch.from_numpy(lengths[rows] + cols)
    rows, cols = torch.from_numpy(rows), torch.from_numpy(cols)

    def update(cache, features, pos, rows, cols, dst):  # the device's part of extend_context
        for i, (k, v) in enumerate(drafter.context_kv(features, pos)):
            cache.k[i, rows, :, dst] = k[rows, :, cols].to(cache.k.dtype)
            cache.v[i, rows, :, dst] = v[rows, :, cols].to(cache.v.dtype)

    eager, traced, whole = (_random_cache(drafter.new_context_cache(B, L), lengths.tolist(), seed=7)
                            for _ in range(3))
    with torch.inference_mode():
        update(eager, features, pos, rows, cols, dst)
        compiled(update)(traced, features, pos, rows, cols, dst)
    drafter.extend_context(whole, features, torch.from_numpy(counts))
    assert torch.equal(traced.k, eager.k) and torch.equal(traced.v, eager.v)
    assert torch.equal(whole.k, eager.k) and torch.equal(whole.v, eager.v)
