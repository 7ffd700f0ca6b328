"""Drafter model: layout (b) == layout (a) per branch, context cache, save/load, bad input."""
import json
import warnings

import pytest
import torch

from dpara_rt.ops import MAX_DRAFT
from dpara_rt.models.drafter import (MASK_ID, Drafter, DrafterConfig, DrafterWarning, default_layer_ids, host_tree_layout,
                                     tree_layout)
from dpara_rt.models.drafter_io import load_drafter, save_drafter

torch.set_num_threads(1)


@pytest.fixture
def drafter(tiny_target, tiny_layer_ids):
    """A 2-layer drafter on the tiny target with every weight random (the Markov head included)."""
    cfg = DrafterConfig.for_target(tiny_target.config, num_layers=2, block_size=5, markov_rank=16,
                                   layer_ids=tiny_layer_ids)
    torch.manual_seed(0)
    dr = Drafter(cfg, tiny_target.embed_tokens, tiny_target.lm_head)
    with torch.no_grad():
        for p in dr.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return dr.eval()


def _filled_cache(dr, lengths, max_len=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    feats = torch.randn(len(lengths), int(lengths.max()), dr.config.feature_size, generator=g)
    cache = dr.new_context_cache(len(lengths), max_len)
    dr.extend_context(cache, feats, lengths)
    return cache, feats


@pytest.fixture
def mask_rows_drafter(tiny_target, tiny_layer_ids):
    """The DFlash convention: drafts read from the mask rows after the anchor, mask rows embedded as a target
    token, no Markov head."""
    cfg = DrafterConfig.for_target(tiny_target.config, num_layers=2, block_size=5, markov_rank=0,
                                   layer_ids=tiny_layer_ids)
    cfg = DrafterConfig.from_dict({**cfg.to_dict(), "mask_token_id": 7, "draft_rows": "mask"})
    torch.manual_seed(1)
    dr = Drafter(cfg, tiny_target.embed_tokens, tiny_target.lm_head)
    with torch.no_grad():
        for p in dr.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    assert dr.mask_embedding is None and "mask_embedding" not in dr.state_dict()
    return dr.eval()


@pytest.mark.parametrize("d", [1, 3, 5])
@pytest.mark.parametrize("convention", ["anchor", "mask"])
def test_branch_r_equals_serial_block_seeing_the_same(drafter, mask_rows_drafter, d, convention):
    drafter = drafter if convention == "anchor" else mask_rows_drafter
    cache, _ = _filled_cache(drafter, [7, 1, 13])  # ragged lengths
    spine = torch.randint(0, drafter.config.vocab_size, (3, d + 1), generator=torch.Generator().manual_seed(d))
    boundary = drafter.boundary_logits(cache, spine)
    assert boundary.shape == (3, d + 1, d, drafter.config.vocab_size)
    for r in range(d + 1):
        serial = drafter.block_logits(cache, spine[:, 0], d, prefix=spine[:, :r + 1], mask_anchor=True)
        torch.testing.assert_close(boundary[:, r], serial, atol=2e-5, rtol=1e-4)
    # branches differ from each other (each sees a different spine prefix and sits at other positions)
    assert not torch.allclose(boundary[:, 0], boundary[:, d], atol=1e-3)


def test_boundary_hidden_states_project_to_the_boundary_logits(drafter):
    d = 4
    cache, _ = _filled_cache(drafter, [5, 11])
    spine = torch.randint(0, drafter.config.vocab_size, (2, d + 1), generator=torch.Generator().manual_seed(4))
    hidden = drafter.boundary_logits(cache, spine, project=False)
    assert hidden.shape == (2, d + 1, d, drafter.config.hidden_size)
    logits = drafter.boundary_logits(cache, spine)
    for r in (0, 2, d):  # projecting one branch alone gives that branch's boundary logits
        torch.testing.assert_close(drafter.logits(hidden[:, r]), logits[:, r], atol=2e-5, rtol=1e-4)
    ring = torch.zeros(2, d + 1, d, drafter.config.hidden_size)
    assert drafter.boundary_logits(cache, spine, out=ring, project=False) is ring
    torch.testing.assert_close(ring, hidden)
    with pytest.raises(ValueError, match="boundary hidden states for d=4 need"):
        drafter.boundary_logits(cache, spine, out=torch.zeros(2, d + 1, d, 7), project=False)


@pytest.mark.parametrize("convention", ["anchor", "mask"])
def test_the_cores_backbone_equals_the_torch_path(drafter, mask_rows_drafter, convention, monkeypatch):
    """On the host the backbone runs as one core call (Drafter.host_backbone): its boundary hidden states,
    boundary logits and serial block logits (a ragged PSD prefix included) equal the torch path's within float32
    rounding, for ragged contexts (one empty), both conventions and d up to the block size."""
    dr = drafter if convention == "anchor" else mask_rows_drafter
    cache, _ = _filled_cache(dr, [7, 0, 13])
    prefix = torch.randint(0, dr.config.vocab_size, (3, 3), generator=torch.Generator().manual_seed(11))
    calls = []
    host = Drafter.host_backbone
    monkeypatch.setattr(Drafter, "host_backbone", lambda self, *a: calls.append(1) or host(self, *a))

    def outputs():
        out = []
        for d in (1, 3, 5):
            spine = torch.randint(0, dr.config.vocab_size, (3, d + 1), generator=torch.Generator().manual_seed(d))
            out += [dr.boundary_logits(cache, spine, project=False), dr.boundary_logits(cache, spine),
                    dr.block_logits(cache, spine[:, 0], d),
                    dr.block_logits(cache, spine[:, 0], d, prefix=prefix, prefix_seen=torch.tensor([3, 0, 2]))]
        return out
    native = outputs()
    assert len(calls) == 12
    monkeypatch.setattr(Drafter, "host_backbone", lambda self, *a: None)
    for got, want in zip(native, outputs(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)



def test_the_host_tree_layout_skips_rows_without_changing_a_bit(mask_rows_drafter):
    """Under the DFlash convention the host backbone leaves out branch w and the spine entry only it sees, and
    runs the last layer's MLP on the draft rows alone: its boundary hidden states are the bits of the full tree
    layout's rows that the boundary keeps."""
    dr = mask_rows_drafter
    cache, _ = _filled_cache(dr, [7, 0, 13])
    for d in (1, 4, dr.config.block_size - 1):
        offsets, visible, keep_from = host_tree_layout(d, 1)
        w = d + 1
        assert len(offsets) == (d + 1) * (w + 1) and keep_from == 2 * (d + 1)  # vs (w + 1) ** 2 rows, w + 1 kept
        spine = torch.randint(0, dr.config.vocab_size, (3, d + 1), generator=torch.Generator().manual_seed(d))
        full_offsets, full_visible = tree_layout(w)
        tokens = torch.cat([spine, spine[:, -1:], torch.full((3, (w + 1) * w), MASK_ID)], dim=1)
        with torch.inference_mode():  # as boundary_logits runs it (training keeps the torch path)
            full = dr.host_backbone(tokens, cache.lengths[:, None] + full_offsets, cache, full_visible, w + 1)
        want = full.view(3, w + 1, w, -1)[:, :d + 1, 1:].reshape(3, d + 1, d, -1)
        got = dr.boundary_logits(cache, spine, project=False)
        assert torch.equal(got, want)


@pytest.mark.parametrize("convention", ["anchor", "mask"])
def test_a_short_spine_gives_its_branches_alone(drafter, mask_rows_drafter, convention, monkeypatch):
    """A spine s_0..s_{k-1} with d given yields branches 0..k-1, the bits those branches have under any longer
    spine that starts the same (a branch sees the spine up to its own s_r); a whole ring slot as `out` keeps its
    other branches. The torch path (padding the spine) gives the same branches within rounding."""
    dr = drafter if convention == "anchor" else mask_rows_drafter
    cache, _ = _filled_cache(dr, [7, 0, 13])
    d, V = 4, dr.config.vocab_size
    spine = torch.randint(0, V, (3, d + 1), generator=torch.Generator().manual_seed(3))
    full = dr.boundary_logits(cache, spine, project=False)
    for k in (1, 3):
        assert torch.equal(dr.boundary_logits(cache, spine[:, :k], project=False, d=d), full[:, :k])
    slot = torch.full((3, d + 1, d, V), 7.0)
    assert dr.boundary_logits(cache, spine[:, :1], out=slot, d=d) is not None
    torch.testing.assert_close(slot[:, 0], dr.boundary_logits(cache, spine)[:, 0])
    assert bool((slot[:, 1:] == 7.0).all())
    with pytest.raises(ValueError, match="spine of 6 tokens for d=4"):
        dr.boundary_logits(cache, torch.zeros(3, 6, dtype=torch.long), d=d)
    monkeypatch.setattr(Drafter, "host_backbone", lambda self, *a: None)
    torch.testing.assert_close(dr.boundary_logits(cache, spine[:, :2], project=False, d=d), full[:, :2],
                               rtol=1e-4, atol=2e-5)

def test_the_cores_context_update_equals_the_torch_path(drafter, monkeypatch):
    """On the host extend_context's K/V are one core call (Drafter._host_context): from ragged counts (one row
    keeping nothing, one keeping all) onto ragged lengths (one empty), twice over, the cache equals the torch
    path's within float32 rounding, the slots past each row's length stay untouched, and the lengths agree."""
    from dpara_rt.host import linear as host_linear
    g = torch.Generator().manual_seed(4)
    feats = [torch.randn(3, 6, drafter.config.feature_size, generator=g) for _ in range(2)]
    counts = [torch.tensor([6, 2, 0]), torch.tensor([1, 6, 3])]
    calls = []
    host = Drafter._host_context
    monkeypatch.setattr(Drafter, "_host_context", lambda self, *a: calls.append(1) or host(self, *a))

    def filled():
        cache, _ = _filled_cache(drafter, [5, 0, 9], max_len=32)
        cache.k[:, :, :, 20:] = cache.v[:, :, :, 20:] = float("nan")  # past every row's final length
        for f, n in zip(feats, counts):
            drafter.extend_context(cache, f, n)
        return cache
    native = filled()
    assert len(calls) == 3 and native.lengths.tolist() == [12, 8, 12]
    old = host_linear.native_target(False)
    try:
        reference = filled()
    finally:
        host_linear.native_target(old)
    assert native.lengths.tolist() == reference.lengths.tolist()
    for b, n in enumerate(native.lengths.tolist()):
        torch.testing.assert_close(native.k[:, b, :, :n], reference.k[:, b, :, :n], rtol=1e-4, atol=2e-5)
        torch.testing.assert_close(native.v[:, b, :, :n], reference.v[:, b, :, :n], rtol=1e-4, atol=2e-5)
        assert native.k[:, b, :, 20:].isnan().all() and native.v[:, b, :, 20:].isnan().all()


def test_a_prompts_context_update_on_two_threads_has_the_bits_of_one(drafter):
    """A prompt's context update is large enough for its fc product to take the core's helper thread too: the
    cache equals the one built a few rows at a time (each call below that size, on this thread alone), bit for
    bit."""
    c = drafter.config
    rows = (8 << 20) // (c.feature_size * c.hidden_size) + 1  # just above host_linear_two_threads's size
    feats = torch.randn(2, rows, c.feature_size, generator=torch.Generator().manual_seed(6))
    keep = torch.tensor([rows, rows - 5])
    at_once = drafter.new_context_cache(2, rows)
    drafter.extend_context(at_once, feats, keep)
    by_parts = drafter.new_context_cache(2, rows)
    for j in range(0, rows, 16):
        drafter.extend_context(by_parts, feats[:, j:j + 16].contiguous(), (keep - j).clamp(0, 16))
    assert at_once.lengths.tolist() == by_parts.lengths.tolist() == keep.tolist()
    for b, n in enumerate(keep.tolist()):
        assert torch.equal(at_once.k[:, b, :, :n], by_parts.k[:, b, :, :n])
        assert torch.equal(at_once.v[:, b, :, :n], by_parts.v[:, b, :, :n])


def test_the_cores_context_update_names_a_bad_argument(drafter):
    """host_context_kv refuses a count out of range or a context that would overflow, naming the value, before it
    writes anything."""
    cache, _ = _filled_cache(drafter, [4, 2], max_len=8)
    c = drafter.config
    stack = drafter._host._stack_for(drafter.layers, cache, [-1] * c.num_layers)
    feats = torch.randn(2 * 3, c.feature_size, generator=torch.Generator().manual_seed(2))
    cos, sin = torch.ones(2 * 3, c.head_dim), torch.zeros(2 * 3, c.head_dim)  # no rotation
    packed, dtype = drafter.fc.packed()
    norm = drafter.context_norm.weight.detach()
    before = cache.k.clone()

    def run(lengths=(4, 2), counts=(3, 1)):
        lens, n = torch.tensor(lengths), torch.tensor(counts)
        stack.context_forward(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                              c.intermediate_size, c.rms_norm_eps, packed.data_ptr(), dtype, c.feature_size,
                              norm.data_ptr(), feats.data_ptr(), 2, 3, lens.data_ptr(), n.data_ptr(), cos.data_ptr(),
                              sin.data_ptr())
    with pytest.raises(ValueError, match=r"counts\[1\] = 4, expected 0..3"):
        run(counts=(3, 4))
    with pytest.raises(ValueError, match=r"lengths\[0\] = 6 \+ counts\[0\] = 3 exceed layer 0's context of max_len 8"):
        run(lengths=(6, 2))
    assert torch.equal(cache.k, before)
    run()
    assert not torch.equal(cache.k, before)


def test_the_cores_backbone_names_a_bad_argument(drafter):
    """host_block_layers refuses a bad keep_from, mask stride or context length with the value named."""
    from dpara_rt import _core
    cache, _ = _filled_cache(drafter, [4, 2])
    c = drafter.config
    stack = drafter._host._stack_for(drafter.layers, cache, [-1] * c.num_layers)
    h, out = torch.zeros(2 * 4, c.hidden_size), torch.zeros(2 * 4, c.hidden_size)
    cos = sin = torch.zeros(2 * 4, c.head_dim)
    visible = torch.ones(4, 4, dtype=torch.uint8)
    norm = drafter.norm.weight.detach()

    def run(lengths=(4, 2), keep_from=1, stride=0):
        lens = torch.tensor(lengths)
        stack.block_forward(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                            c.intermediate_size, c.rms_norm_eps, h.data_ptr(), 2, 4, lens.data_ptr(),
                            visible.data_ptr(), stride, cos.data_ptr(), sin.data_ptr(), keep_from, norm.data_ptr(),
                            out.data_ptr())
    run()
    with pytest.raises(ValueError, match="keep_from 4"):
        run(keep_from=4)
    with pytest.raises(ValueError, match="visible_stride 5"):
        run(stride=5)
    with pytest.raises(ValueError, match=r"ctx_lens\[1\] = 49"):
        run(lengths=(4, 49))


def test_the_last_layer_projects_only_the_rows_that_are_read(drafter, monkeypatch):
    """Spine rows give every layer their K/V, but past the last layer's attention nothing reads them: its MLP
    (and output projection) see the branch rows alone, every other layer's all rows, and the hidden states are
    those of the full forward sliced afterwards, bit for bit (the host projections are row-independent)."""
    d = 3
    cache, _ = _filled_cache(drafter, [5, 11])
    spine = torch.randint(0, drafter.config.vocab_size, (2, d + 1), generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(Drafter, "host_backbone", lambda self, *a: None)  # the torch path (the core's: below)
    rows = []
    for layer in drafter.layers:
        monkeypatch.setattr(layer, "mlp", lambda x, mlp=layer.mlp: rows.append(x.shape[1]) or mlp(x))
    hidden = drafter.boundary_logits(cache, spine, project=False)
    assert rows == [(d + 1) ** 2] * (len(drafter.layers) - 1) + [(d + 1) * d]
    backbone = Drafter.backbone  # keep_from=0: every row through every layer
    monkeypatch.setattr(Drafter, "backbone", lambda self, *a, keep_from: backbone(self, *a)[:, keep_from:])
    assert torch.equal(drafter.boundary_logits(cache, spine, project=False), hidden)


def test_boundary_logits_write_into_a_ring_slot(drafter):
    d, b = 3, 2
    cache, _ = _filled_cache(drafter, [4, 9])
    spine = torch.randint(0, drafter.config.vocab_size, (b, d + 1), generator=torch.Generator().manual_seed(3))
    ring = torch.full((3, b, d + 1, d, drafter.config.vocab_size), float("nan"))
    got = drafter.boundary_logits(cache, spine, out=ring[1])
    assert got.data_ptr() == ring[1].data_ptr()
    torch.testing.assert_close(ring[1], drafter.boundary_logits(cache, spine))
    assert ring[0].isnan().all() and ring[2].isnan().all()  # neighbouring slots untouched
    half = torch.empty(b, d + 1, d, drafter.config.vocab_size, dtype=torch.float64)  # other dtype: copied in
    drafter.boundary_logits(cache, spine, out=half)
    torch.testing.assert_close(half.float(), ring[1])
    strided = torch.empty(b, d, d + 1, drafter.config.vocab_size).transpose(1, 2)  # not contiguous: copied in
    drafter.boundary_logits(cache, spine, out=strided)
    torch.testing.assert_close(strided, ring[1])


def test_block_sees_only_its_rows_context(drafter):
    """Layout (a): context rows at or past a row's length are invisible; the anchor matters."""
    feats = torch.randn(1, 6, drafter.config.feature_size, generator=torch.Generator().manual_seed(2))
    cache = drafter.new_context_cache(2, 16)
    drafter.extend_context(cache, feats.expand(2, -1, -1), torch.tensor([6, 6]))  # two identical rows
    anchor = torch.tensor([5, 5])
    base = drafter.block_logits(cache, anchor, 4)
    torch.testing.assert_close(base[0], base[1])
    cache.k[:, 1, :, 6:] = 99.0  # stale slots past the length
    torch.testing.assert_close(drafter.block_logits(cache, anchor, 4), base)
    cache.k[:, 1, :, 2] += 1.0  # a visible context row
    assert not torch.allclose(drafter.block_logits(cache, anchor, 4)[1], base[1])
    assert not torch.allclose(drafter.block_logits(cache, torch.tensor([5, 6]), 4)[1], base[1])


def test_extend_and_crop_equal_building_from_scratch(drafter):
    g = torch.Generator().manual_seed(7)
    f = drafter.config.feature_size
    first, second, tail = (torch.randn(2, t, f, generator=g) for t in (5, 4, 3))
    cache = drafter.new_context_cache(2, 32)
    drafter.extend_context(cache, first, torch.tensor([5, 3]))
    drafter.extend_context(cache, second, torch.tensor([2, 4]))  # ragged rounds
    drafter.crop(cache, torch.tensor([4, 6]))                      # rollback
    drafter.extend_context(cache, tail, torch.tensor([3, 1]))
    assert cache.lengths.tolist() == [7, 7]
    # the rows each batch row kept, committed in one go
    kept = torch.stack([torch.cat([first[0, :4], tail[0, :3]]),
                        torch.cat([first[1, :3], second[1, :3], tail[1, :1]])])
    scratch = drafter.new_context_cache(2, 32)
    drafter.extend_context(scratch, kept, torch.tensor([7, 7]))
    torch.testing.assert_close(cache.k[:, :, :, :7], scratch.k[:, :, :, :7])
    torch.testing.assert_close(cache.v[:, :, :, :7], scratch.v[:, :, :, :7])
    spine = torch.tensor([[3, 4, 5], [6, 7, 8]])
    torch.testing.assert_close(drafter.boundary_logits(cache, spine), drafter.boundary_logits(scratch, spine))


@pytest.mark.parametrize("convention", ["anchor", "mask"])
def test_a_context_grown_on_the_device_drafts_what_the_hosts_does(drafter, mask_rows_drafter, convention,
                                                                   torch_path, monkeypatch):
    """A round the host has not read: the keep rows absorbed at the device's lengths (every row written, the rest
    past them), the host's lengths a round behind, the block read from a window of the host's longest + ahead."""
    from dpara_rt.models import kv_cache

    drafter = drafter if convention == "anchor" else mask_rows_drafter
    monkeypatch.setattr(kv_cache, "WINDOW", 1)  # the window is exactly the host's longest + ahead
    g = torch.Generator().manual_seed(3)
    f, d = drafter.config.feature_size, 3
    prompt, rounds = torch.randn(3, 6, f, generator=g), [torch.randn(3, d + 1, f, generator=g) for _ in range(3)]
    keeps = [torch.tensor([4, 1, 2]), torch.tensor([2, 4, 1]), torch.tensor([1, 3, 4])]
    anchor = torch.tensor([5, 9, 2])
    host, dev = drafter.new_context_cache(3, 40), drafter.new_context_cache(3, 40)
    for cache in (host, dev):
        drafter.extend_context(cache, prompt, torch.tensor([6, 3, 5]))
    dev.track_on_device()
    for i, (feats, keep) in enumerate(zip(rounds, keeps)):
        drafter.extend_context(host, feats, keep)
        drafter.extend_context(dev, feats, keep.clone(), on_device=True)
        if i:  # the host's lengths follow a round late
            dev.lengths += keeps[i - 1]
        assert dev.dev_lengths.tolist() == host.lengths.tolist()
        want = drafter.block_logits(host, anchor, d)
        torch.testing.assert_close(drafter.block_logits(dev, anchor, d, ahead=d + 1), want)
        if i:  # the window matters: without the round the host has not read, the block sees less context
            assert not torch.allclose(drafter.block_logits(dev, anchor, d, ahead=0), want)
        spine = torch.randint(0, drafter.config.vocab_size, (3, d + 1), generator=g)  # the tree, the same way
        torch.testing.assert_close(drafter.boundary_logits(dev, spine, ahead=d + 1),
                                   drafter.boundary_logits(host, spine))
    with pytest.raises(ValueError, match="a prefix of 2 tokens at the device's lengths"):
        drafter.block_logits(dev, anchor, d, prefix=torch.tensor([[1, 2]] * 3), ahead=d + 1)


def test_save_load_gives_identical_logits(drafter, tiny_target, tmp_path):
    save_drafter(drafter, tmp_path)
    names = set(json.load(open(tmp_path / "drafter_config.json"))["config"])
    assert "layer_ids" in names
    from safetensors import safe_open
    with safe_open(str(tmp_path / "drafter.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert not any("embed_tokens" in k or "lm_head" in k for k in keys)  # shared with the target, not saved
    loaded = load_drafter(tmp_path, tiny_target)
    assert loaded.embed_tokens is tiny_target.embed_tokens and loaded.lm_head is tiny_target.lm_head
    cache, feats = _filled_cache(drafter, [5, 8])
    cache2 = loaded.new_context_cache(2, 48)
    loaded.extend_context(cache2, feats, torch.tensor([5, 8]))
    spine = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert torch.equal(drafter.boundary_logits(cache, spine), loaded.boundary_logits(cache2, spine))
    assert torch.equal(drafter.block_logits(cache, spine[:, 0], 3), loaded.block_logits(cache2, spine[:, 0], 3))
    assert torch.equal(drafter.w1, loaded.w1) and torch.equal(drafter.w2, loaded.w2)


def _rewrite_config(path, **changes):
    blob = json.load(open(path / "drafter_config.json"))
    blob["config"].update(changes)
    json.dump(blob, open(path / "drafter_config.json", "w"))


@pytest.mark.parametrize("change,words", [
    (dict(vocab_size=600), ["vocab", "600", "512"]),
    (dict(target_hidden_size=32), ["hidden", "32", "64"]),
    (dict(layer_ids=[1, 4]), ["layer_ids", "[4]", "num_hidden_layers=4"]),
])
def test_load_refuses_a_target_that_does_not_fit(drafter, tiny_target, tmp_path, change, words):
    save_drafter(drafter, tmp_path)
    _rewrite_config(tmp_path, **change)
    with pytest.raises(ValueError) as e:
        load_drafter(tmp_path, tiny_target)
    for w in words:
        assert w in str(e.value)


def test_corrupt_checkpoints_give_clear_errors(drafter, tiny_target, tmp_path):
    save_drafter(drafter, tmp_path)
    weights = tmp_path / "drafter.safetensors"
    blob = weights.read_bytes()
    weights.write_bytes(blob[: len(blob) // 2])  # truncated
    with pytest.raises(ValueError, match="corrupt drafter weights"):
        load_drafter(tmp_path, tiny_target)
    weights.unlink()
    with pytest.raises(ValueError, match="no drafter.safetensors"):
        load_drafter(tmp_path, tiny_target)
    (tmp_path / "drafter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt drafter config"):
        load_drafter(tmp_path, tiny_target)
    with pytest.raises(ValueError, match="no drafter checkpoint"):
        load_drafter(tmp_path / "missing", tiny_target)
    save_drafter(drafter, tmp_path)
    _rewrite_config(tmp_path, markov_rank=8)  # weights no longer match the config
    with pytest.raises(ValueError, match="w1 has shape"):
        load_drafter(tmp_path, tiny_target)


def test_bad_inputs_raise_or_warn(drafter):
    cache, _ = _filled_cache(drafter, [3, 4])
    v, bs = drafter.config.vocab_size, drafter.config.block_size
    with pytest.warns(DrafterWarning, match=f"d={bs + 1} exceeds block_size={bs}"):
        drafter.block_logits(cache, torch.tensor([1, 2]), bs + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drafter.block_logits(cache, torch.tensor([1, 2]), bs)  # within the trained size: silent
    with pytest.raises(ValueError, match="d=0"):
        drafter.block_logits(cache, torch.tensor([1, 2]), 0)
    with pytest.raises(ValueError, match=f"d={MAX_DRAFT + 1}: expected 1 <= d <= {MAX_DRAFT}"):
        drafter.boundary_logits(cache, torch.zeros(2, MAX_DRAFT + 2, dtype=torch.long))
    with pytest.raises(ValueError, match=f"token id {v}"):
        drafter.boundary_logits(cache, torch.tensor([[1, v], [2, 3]]))
    with pytest.raises(ValueError, match=r"B=2, n\] token ids, got shape \(3, 3\)"):
        drafter.boundary_logits(cache, torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="need"):
        drafter.boundary_logits(cache, torch.zeros(2, 3, dtype=torch.long), out=torch.empty(2, 3, 3, v))
    with pytest.raises(ValueError, match="overflow"):
        drafter.extend_context(cache, torch.zeros(2, 48, drafter.config.feature_size), torch.tensor([48, 0]))
    with pytest.raises(ValueError, match="width"):
        drafter.extend_context(cache, torch.zeros(2, 1, 7), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="crop"):
        drafter.crop(cache, torch.tensor([4, 4]))  # row 0 holds only 3
    with pytest.raises(ValueError, match="layer_ids"):
        DrafterConfig.from_dict({**drafter.config.to_dict(), "layer_ids": [1, 1]})
    with pytest.raises(ValueError, match="unknown keys"):
        DrafterConfig.from_dict({**drafter.config.to_dict(), "extra": 1})


def test_layouts_and_layer_choice():
    offsets, visible = tree_layout(2)
    assert offsets.tolist() == [0, 1, 2, 1, 2, 2, 3, 3, 4]  # spine, then branches 0..2 restarting after s_r
    assert visible[4].tolist() == [True, False, False, True, True, False, False, False, False]
    assert visible[7].tolist() == [True, True, True, False, False, False, False, True, True]
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(4, 2) == [0, 3]


def test_mask_token_rows_embed_the_targets_token(mask_rows_drafter):
    rows = mask_rows_drafter.embed_rows(torch.tensor([[MASK_ID, 7, 3]]))
    torch.testing.assert_close(rows[0, 0], rows[0, 1])
    assert not torch.allclose(rows[0, 0], rows[0, 2])
    # the DFlash convention's block holds the anchor row too: d + 1 rows must fit the kernels
    cache, _ = _filled_cache(mask_rows_drafter, [3])
    with pytest.raises(ValueError, match=f"d={MAX_DRAFT}: expected 1 <= d <= {MAX_DRAFT - 1}"):
        mask_rows_drafter.block_logits(cache, torch.tensor([1]), MAX_DRAFT)


def test_mask_rows_take_the_mask_embedding(drafter):
    rows = drafter.embed_rows(torch.tensor([[MASK_ID, 5, MASK_ID]]))
    torch.testing.assert_close(rows[0, 0], drafter.mask_embedding.to(rows.dtype).reshape(-1))
    torch.testing.assert_close(rows[0, 2], rows[0, 0])
    torch.testing.assert_close(rows[0, 1], drafter.embed_tokens.weight[5].to(rows.dtype))


def test_shared_modules_are_frozen_and_not_parameters(drafter, tiny_target):
    own = {id(p) for p in drafter.parameters()}
    assert id(tiny_target.embed_tokens.weight) not in own and id(tiny_target.lm_head.weight) not in own
    assert not any("embed_tokens" in k or "lm_head" in k for k in drafter.state_dict())
