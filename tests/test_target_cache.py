"""The speculation KV cache: multi-token verify, commit/rollback, ragged batches."""
import torch

from dpara_rt.models.target import Target

TOL = dict(atol=2e-5, rtol=1e-5)


def block(seed, B, T, vocab=512):
    return torch.randint(3, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def test_verify_block_equals_one_token_at_a_time(tiny_target, tiny_prompts, tiny_layer_ids):
    d = 7
    tokens = block(0, len(tiny_prompts), d + 1)
    spec = Target(tiny_target, 4, 64, tiny_layer_ids)
    spec.start(tiny_prompts)
    logits, feats = spec.verify(tokens)
    assert logits.shape == (3, d + 1, 512) and feats.shape == (3, d + 1, 2 * 64)
    assert torch.equal(spec.lengths, torch.tensor([len(p) for p in tiny_prompts]))  # verify commits nothing

    serial = Target(tiny_target, 4, 64, tiny_layer_ids)
    serial.start(tiny_prompts)
    for j in range(d + 1):
        step_logits, step_feats = serial.verify(tokens[:, j:j + 1])
        serial.commit(torch.ones(3, dtype=torch.long))
        torch.testing.assert_close(logits[:, j], step_logits[:, 0], **TOL)
        torch.testing.assert_close(feats[:, j], step_feats[:, 0], **TOL)


def test_verify_matches_full_forward(tiny_target, tiny_hf_target, tiny_prompts, tiny_layer_ids):
    tokens = block(1, 3, 6)
    target = Target(tiny_target, 3, 32, tiny_layer_ids)
    target.start(tiny_prompts)
    logits, feats = target.verify(tokens)
    for b, p in enumerate(tiny_prompts):
        ids = torch.tensor([p + tokens[b].tolist()])
        with torch.no_grad():
            ref = tiny_hf_target(ids, output_hidden_states=True)
        torch.testing.assert_close(logits[b], ref.logits[0, len(p):], **TOL)
        ref_feats = torch.cat([ref.hidden_states[i + 1][0, len(p):] for i in tiny_layer_ids], -1)
        torch.testing.assert_close(feats[b], ref_feats, **TOL)


def test_rollback_then_redecode_equals_never_seeing_rejected(tiny_target, tiny_prompts, tiny_layer_ids):
    draft, rejected_again, follow = block(2, 3, 8), block(3, 3, 8), block(4, 3, 5)
    kept = torch.tensor([3, 0, 8])
    spec = Target(tiny_target, 3, 64, tiny_layer_ids)
    spec.start(tiny_prompts)
    spec.verify(draft)
    spec.commit(kept)
    # A second block that is rejected entirely leaves stale K/V past every row's length.
    spec.verify(rejected_again)
    spec.commit(torch.zeros(3, dtype=torch.long))
    assert torch.equal(spec.lengths, torch.tensor([len(p) for p in tiny_prompts]) + kept)
    logits, feats = spec.verify(follow)

    clean = Target(tiny_target, 3, 64, tiny_layer_ids)
    clean.start([p + draft[b, : kept[b]].tolist() for b, p in enumerate(tiny_prompts)])
    ref_logits, ref_feats = clean.verify(follow)
    torch.testing.assert_close(logits, ref_logits, **TOL)
    torch.testing.assert_close(feats, ref_feats, **TOL)


def test_ragged_batch_equals_each_request_alone(tiny_target, tiny_prompts, tiny_layer_ids):
    batch = Target(tiny_target, 4, 64, tiny_layer_ids)
    last, feats, lens = batch.start(tiny_prompts)
    assert lens.tolist() == [len(p) for p in tiny_prompts]
    assert feats.shape == (3, max(lens), 128)
    tokens = block(5, 3, 4)
    v_logits, v_feats = batch.verify(tokens)
    batch.commit(torch.tensor([4, 1, 2]))
    n_logits, _ = batch.verify(tokens[:, :2])
    for b, p in enumerate(tiny_prompts):
        alone = Target(tiny_target, 1, 64, tiny_layer_ids)
        a_last, a_feats, _ = alone.start([p])
        torch.testing.assert_close(last[b], a_last[0], **TOL)
        torch.testing.assert_close(feats[b, : len(p)], a_feats[0], **TOL)
        assert not feats[b, len(p):].any()  # padding rows of the features are zeros
        a_logits, a_vfeats = alone.verify(tokens[b:b + 1])
        torch.testing.assert_close(v_logits[b], a_logits[0], **TOL)
        torch.testing.assert_close(v_feats[b], a_vfeats[0], **TOL)
        alone.commit(torch.tensor([[4, 1, 2][b]]))
        torch.testing.assert_close(n_logits[b], alone.verify(tokens[b:b + 1, :2])[0][0], **TOL)


def test_restart_reuses_cache_without_leaking(tiny_target, tiny_prompts):
    target = Target(tiny_target, 3, 64)
    target.start([list(range(3, 40))] * 3)
    target.verify(block(6, 3, 8))
    last, feats, _ = target.start(tiny_prompts)
    fresh_last, _, _ = Target(tiny_target, 3, 64).start(tiny_prompts)
    torch.testing.assert_close(last, fresh_last, **TOL)
    assert feats.shape[-1] == 0  # no layers captured


def test_a_reserved_cache_takes_the_commits(tiny_target, tiny_prompts, tiny_layer_ids):
    """reserve() replaces the cache: the commits after it (through the lengths' numpy view) go to the new one."""
    target = Target(tiny_target, 3, 16, tiny_layer_ids)
    target.reserve(48)
    target.start(tiny_prompts)
    target.verify_argmax(block(2, 3, 4))
    target.commit(torch.tensor([4, 1, 0]))
    assert torch.equal(target.lengths, torch.tensor([len(p) for p in tiny_prompts]) + torch.tensor([4, 1, 0]))
    assert target.cache.max_len == 48
