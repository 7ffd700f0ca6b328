"""Tree-mask attention: the Triton kernel (interpreted on the CPU) against the torch reference, and the
reference against a direct per-row softmax over the keys docs/design.md says each row may see."""
import os

import torch

if not torch.cuda.is_available():  # must precede the first triton import (kernels import it lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dpara_rt.kernels.tree_attention import (tree_attention_reference, tree_attention_triton,  # noqa: E402
                                             tree_mask, tree_position_offsets, tree_size)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _inputs(batch, n_q_heads, n_kv_heads, head_dim, d, max_ctx, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_tree = tree_size(d)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)

    q = rand(batch, n_q_heads, n_tree, head_dim)
    k_ctx, v_ctx = rand(batch, n_kv_heads, max_ctx, head_dim), rand(batch, n_kv_heads, max_ctx, head_dim)
    k_tree, v_tree = rand(batch, n_kv_heads, n_tree, head_dim), rand(batch, n_kv_heads, n_tree, head_dim)
    lens = torch.randint(0, max_ctx + 1, (batch,), generator=g)
    lens[0] = max_ctx  # the longest row fills the cache; the others are ragged (0 allowed)
    return q, k_ctx, v_ctx, lens, k_tree, v_tree


def _visible(d: int, row: int, key: int) -> bool:
    """docs/design.md §1 in words: spine i sees spine 0..i; branch r sees spine 0..r and all of branch r."""
    def place(i):
        return ("spine", i) if i <= d else ("branch", (i - d - 1) // d)
    row_kind, row_id = place(row)
    key_kind, key_id = place(key)
    if key_kind == "spine":
        return key_id <= row_id
    return row_kind == "branch" and key_id == row_id


@pytest.mark.parametrize("d", [1, 2, 3, 7])
def test_tree_mask_and_positions_follow_the_design(d):
    n = tree_size(d)
    expected = torch.tensor([[_visible(d, i, j) for j in range(n)] for i in range(n)])
    assert torch.equal(tree_mask(d), expected)
    pos = tree_position_offsets(d)
    assert pos[: d + 1].tolist() == list(range(d + 1))  # spine s_i at n + i
    for r in range(d + 1):  # branch r's tokens at n + r + 1 .. n + r + d
        assert pos[d + 1 + r * d: d + 1 + (r + 1) * d].tolist() == list(range(r + 1, r + 1 + d))


def test_reference_matches_a_direct_softmax_per_row():
    d, scale = 2, 0.3
    q, k_ctx, v_ctx, lens, k_tree, v_tree = _inputs(3, 4, 2, 16, d, 9, torch.float64, seed=1)
    out = tree_attention_reference(q, k_ctx, v_ctx, lens, k_tree, v_tree, d, scale)
    group = q.shape[1] // k_ctx.shape[1]
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for i in range(tree_size(d)):
                keys = [k_ctx[b, h // group, t] for t in range(int(lens[b]))]
                vals = [v_ctx[b, h // group, t] for t in range(int(lens[b]))]
                keys += [k_tree[b, h // group, j] for j in range(tree_size(d)) if _visible(d, i, j)]
                vals += [v_tree[b, h // group, j] for j in range(tree_size(d)) if _visible(d, i, j)]
                weights = torch.softmax(torch.stack(keys) @ q[b, h, i] * scale, dim=0)
                torch.testing.assert_close(out[b, h, i], weights @ torch.stack(vals))


# (batch, q heads, kv heads, head_dim, d, max context, dtype, context splits or None = automatic)
CASES = [
    (1, 2, 2, 64, 1, 0, torch.float32, None),        # no context at all, plain MHA, smallest tree
    (2, 4, 2, 64, 3, 100, torch.float32, None),      # GQA 2, ragged contexts
    (3, 8, 2, 128, 7, 200, torch.bfloat16, 3),       # GQA 4, head_dim 128, split context (flash-decoding)
    (16, 2, 1, 64, 2, 40, torch.float32, 2),         # batch 16, splits shorter than some rows
    (1, 2, 1, 128, 16, 70, torch.bfloat16, None),    # d = 16: 289 query rows, several tree tiles
    (2, 4, 4, 128, 5, 513, torch.float32, 4),        # many context tiles per split, ragged tail tile
    (4, 4, 1, 64, 4, 130, torch.float16, 1),         # GQA 4 on one kv head, fp16
]


@pytest.mark.parametrize("batch,n_q,n_kv,head_dim,d,max_ctx,dtype,splits", CASES)
def test_triton_matches_reference(batch, n_q, n_kv, head_dim, d, max_ctx, dtype, splits):
    args = _inputs(batch, n_q, n_kv, head_dim, d, max_ctx, dtype)
    scale = head_dim ** -0.5
    got = tree_attention_triton(*args, d, scale, num_splits=splits)
    want = tree_attention_reference(*args, d, scale)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_long_context_online_softmax_across_splits():
    """2k context keys through 32 key tiles and 3 splits; results agree with one split and the reference."""
    args = _inputs(1, 2, 1, 64, 2, 2048, torch.float32, seed=3)
    want = tree_attention_reference(*args, 2, 0.125)
    for splits in (1, 3):
        torch.testing.assert_close(tree_attention_triton(*args, 2, 0.125, num_splits=splits), want,
                                   atol=2e-5, rtol=2e-5)


def test_strided_cache_views_are_read_in_place():
    """A cache laid out [B, L, Hkv, D] is passed transposed (last dim still contiguous)."""
    d, batch, n_kv, head_dim, max_ctx = 2, 2, 2, 64, 50
    q, _, _, lens, k_tree, v_tree = _inputs(batch, 4, n_kv, head_dim, d, max_ctx, torch.float32, seed=4)
    k_store = torch.randn(batch, max_ctx, n_kv, head_dim, device=DEVICE)
    v_store = torch.randn(batch, max_ctx, n_kv, head_dim, device=DEVICE)
    k_ctx, v_ctx = k_store.transpose(1, 2), v_store.transpose(1, 2)
    assert not k_ctx.is_contiguous()
    got = tree_attention_triton(q, k_ctx, v_ctx, lens, k_tree, v_tree, d, 0.125)
    want = tree_attention_reference(q, k_ctx.contiguous(), v_ctx.contiguous(), lens, k_tree, v_tree, d, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_hidden_keys_do_not_leak():
    """Changing what a row may not see (context past its length, other branches, later spine) changes nothing."""
    d = 3
    q, k_ctx, v_ctx, lens, k_tree, v_tree = _inputs(2, 2, 1, 64, d, 20, torch.float32, seed=5)
    lens = torch.tensor([20, 7])
    base = tree_attention_triton(q, k_ctx, v_ctx, lens, k_tree, v_tree, d, 0.125)
    v_ctx2, v_tree2 = v_ctx.clone(), v_tree.clone()
    v_ctx2[1, :, 7:] += 100.0  # past row 1's context length
    branch1 = slice(d + 1 + d, d + 1 + 2 * d)
    v_tree2[:, :, branch1] += 100.0  # branch 1's keys
    out = tree_attention_triton(q, k_ctx, v_ctx2, lens, k_tree, v_tree2, d, 0.125)
    unaffected = torch.ones(tree_size(d), dtype=torch.bool)
    unaffected[branch1] = False  # only branch 1's own rows see branch 1
    torch.testing.assert_close(out[:, :, unaffected], base[:, :, unaffected])
    assert (out[:, :, branch1] - base[:, :, branch1]).abs().max() > 1.0
