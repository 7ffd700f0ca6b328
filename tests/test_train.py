"""Drafter training: data from the target, stage 1 / stage 2 steps, resume, held-out tau."""
import pytest
import torch

from dpara_rt.models.autoregressive import generate_ar
from dpara_rt.models.drafter import Drafter, DrafterConfig
from dpara_rt.models.target import Target
from dpara_rt.train import (TrainConfig, TrainData, build_train_data, estimate_tau, prompts_from_stream, train_stage1,
                            train_stage2)
from dpara_rt.models.drafter_io import copy_backbone, save_drafter
from dpara_rt.train.objectives import (dflash_layout, distill_loss, dspark_layout, layout_loss, mdflash_layout,
                                       sample_anchors)

torch.set_num_threads(1)
D = 3


@pytest.fixture(scope="module")
def data(tiny_target, tiny_layer_ids):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in torch.randint(2, 8, (12,), generator=g)]
    return build_train_data(tiny_target, prompts, 20, tiny_layer_ids, batch_size=6)


def _drafter(target, layer_ids, seed=0):
    cfg = DrafterConfig.for_target(target.config, num_layers=1, block_size=D, markov_rank=16, layer_ids=layer_ids)
    torch.manual_seed(seed)
    return Drafter(cfg, target.embed_tokens, target.lm_head)


def _fixed_loss(drafter, data, layout):
    """The training loss on a fixed set of sequences and anchors (no grad)."""
    index = torch.arange(len(data))
    anchors = sample_anchors(data, index, layout, 6, torch.Generator().manual_seed(123))
    with torch.no_grad():
        return float(layout_loss(drafter, data, index, anchors, layout, 0.1, 0.9))


def test_train_data_is_the_targets_greedy_continuation(data, tiny_target, tiny_layer_ids, tmp_path):
    s = 4
    n, p = int(data.lengths[s]), int(data.prompt_lens[s])
    prompt = data.tokens[s, :p].tolist()
    ar = generate_ar(Target(tiny_target, 1, 64), [prompt], 20)[0]
    assert data.tokens[s, p:n].tolist() == ar
    pos = torch.arange(n)[None]
    logits, feats = tiny_target(data.tokens[s:s + 1, :n], pos, layer_ids=tiny_layer_ids)
    torch.testing.assert_close(data.features[s, :n], feats[0])
    torch.testing.assert_close(data.logits[s, :n], logits[0])
    assert (data.features[s, n:] == 0).all()
    # greedy: the token after p is the argmax of the target's distribution at p
    assert torch.equal(data.logits[s, p - 1:n - 1].argmax(-1), data.tokens[s, p:n])
    data.save(tmp_path / "d.safetensors")
    back = TrainData.load(tmp_path / "d.safetensors")
    assert torch.equal(back.features, data.features) and back.layer_ids == data.layer_ids
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 9)
    with pytest.raises(ValueError, match="cannot read train data"):
        TrainData.load(tmp_path / "bad.safetensors")


def test_prompts_from_a_token_stream():
    stream = list(range(100, 130))
    assert prompts_from_stream(stream, 4, 3) == [[100, 101, 102, 103], [104, 105, 106, 107], [108, 109, 110, 111]]
    assert prompts_from_stream(stream, 3, 2, stride=10) == [[100, 101, 102], [110, 111, 112]]
    with pytest.raises(ValueError, match="has 30 tokens; 4 prompts of 10 with stride 10 need 40"):
        prompts_from_stream(stream, 10, 4)


def test_stage1_steps_reduce_the_loss(data, tiny_target, tiny_layer_ids):
    dr = _drafter(tiny_target, tiny_layer_ids)
    layout = dspark_layout(D)
    before = _fixed_loss(dr, data, layout)
    w2 = dr.w2.detach().clone()
    res = train_stage1(dr, data, TrainConfig(epochs=4, batch_size=6, lr=3e-3, progress=False))
    assert res.step == 8 and len(res.losses) == 8
    assert _fixed_loss(dr, data, layout) < before - 0.02
    assert not torch.equal(dr.w2, w2)  # stage 1 trains the Markov head


def test_stage2_trains_the_backbone_only(data, tiny_target, tiny_layer_ids):
    dr = _drafter(tiny_target, tiny_layer_ids)
    with torch.no_grad():
        dr.w2.normal_(std=0.02)  # a non-trivial (as if stage-1 trained) Markov head
    w1, w2, fc = dr.w1.detach().clone(), dr.w2.detach().clone(), dr.fc.weight.detach().clone()
    layout = mdflash_layout(D)
    before = _fixed_loss(dr, data, layout)
    train_stage2(dr, data, TrainConfig(epochs=4, batch_size=6, anchors_per_sequence=3, lr=3e-3, progress=False))
    assert _fixed_loss(dr, data, layout) < before - 0.02
    assert torch.equal(dr.w1, w1) and torch.equal(dr.w2, w2)  # bit-identical
    assert not dr.w1.requires_grad and not dr.w2.requires_grad
    assert not torch.equal(dr.fc.weight, fc)


def test_resume_continues_exactly(data, tiny_target, tiny_layer_ids, tmp_path):
    cfg = dict(epochs=3, batch_size=4, lr=1e-3, progress=False)
    straight = _drafter(tiny_target, tiny_layer_ids)
    full = train_stage1(straight, data, TrainConfig(max_steps=4, **cfg))
    first = _drafter(tiny_target, tiny_layer_ids)
    train_stage1(first, data, TrainConfig(max_steps=2, checkpoint_dir=str(tmp_path), **cfg))
    resumed = _drafter(tiny_target, tiny_layer_ids, seed=1)  # other init: the checkpoint must win
    res = train_stage1(resumed, data, TrainConfig(max_steps=4, checkpoint_dir=str(tmp_path), **cfg))
    assert res.step == 4 and res.losses == full.losses
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="stage1 checkpoint with d=3; this run is stage2"):
        train_stage2(resumed, data, TrainConfig(max_steps=5, checkpoint_dir=str(tmp_path), **cfg))


def test_time_limit_stops_and_checkpoints(data, tiny_target, tiny_layer_ids, tmp_path):
    dr = _drafter(tiny_target, tiny_layer_ids)
    res = train_stage2(dr, data, TrainConfig(epochs=5, batch_size=4, time_limit_s=0.0, progress=False,
                                             checkpoint_dir=str(tmp_path)))
    assert res.step == 1
    assert (tmp_path / "train_state.pt").exists() and (tmp_path / "drafter.safetensors").exists()


def test_lr_stays_then_decays_over_the_last_share_of_the_budget():
    cfg = TrainConfig(lr=1e-3, decay_share=0.25)
    assert [cfg.lr_at(x) for x in (0.0, 0.5, 0.75)] == [1e-3] * 3
    assert cfg.lr_at(0.875) == pytest.approx(5e-4) and cfg.lr_at(1.0) == 0.0 and cfg.lr_at(1.2) == 0.0
    assert TrainConfig(lr=1e-3).lr_at(0.99) == 1e-3  # decay_share 0: constant
    for bad in (dict(decay_share=1.0), dict(decay_share=-0.1), dict(spent_s=-1.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TrainConfig(**bad)


def test_training_follows_the_lr_schedule_on_resume_too(data, tiny_target, tiny_layer_ids, tmp_path, monkeypatch):
    import dpara_rt.train.loop as loop

    seen = []
    real_step = loop.optimizer_step

    def record(opt, loss, params, grad_clip):
        seen.append(opt.param_groups[0]["lr"])
        real_step(opt, loss, params, grad_clip)

    monkeypatch.setattr(loop, "optimizer_step", record)
    cfg = dict(epochs=10, batch_size=4, lr=1e-3, decay_share=0.5, progress=False, checkpoint_dir=str(tmp_path))
    train_stage1(_drafter(tiny_target, tiny_layer_ids), data, TrainConfig(max_steps=2, **cfg))
    # resumed with a larger step budget: the checkpoint's optimizer brings lr 1e-3; the schedule overrides it
    train_stage1(_drafter(tiny_target, tiny_layer_ids), data, TrainConfig(max_steps=4, **cfg))
    assert seen == pytest.approx([1e-3, 1e-3, 1e-3, 5e-4])  # step s of 4 at progress s / 4
    seen.clear()
    timed = TrainConfig(max_steps=2, lr=1e-3, decay_share=0.5, progress=False, time_limit_s=30.0, spent_s=60.0)
    train_stage1(_drafter(tiny_target, tiny_layer_ids), data, timed)
    assert all(0 < lr < 1e-3 * (1 - 60 / 90) / 0.5 + 1e-9 for lr in seen)  # 2/3 of a 90 s budget already spent


def test_epochs_log_held_out_tau(data, tiny_target, tiny_layer_ids, capsys):
    train, held_out = data.split(3)
    dr = _drafter(tiny_target, tiny_layer_ids)
    res = train_stage1(dr, train, TrainConfig(epochs=2, batch_size=9, progress=True), eval_data=held_out)
    assert len(res.taus) == 2 and all(1.0 <= t <= D + 1 for t in res.taus)
    printed = capsys.readouterr()
    assert "held-out tau (dspark, d=3)" in printed.out
    assert "drafter stage1" in printed.err  # the progress bar


def _synthetic(tokens: torch.Tensor, feature_size: int, prompt_len: int = 4) -> TrainData:
    """Held-out data with a chosen ground truth (greedy by construction) and random features."""
    n_seq, length = tokens.shape
    g = torch.Generator().manual_seed(0)
    return TrainData(tokens, torch.full((n_seq,), length), torch.full((n_seq,), prompt_len),
                     torch.randn(n_seq, length, feature_size, generator=g), torch.zeros(n_seq, length, 512),
                     [1, 2], 0.0)


def _repeating_drafter(target, scale):
    """A random drafter whose Markov head adds ``scale`` to the previous token (rank = vocab)."""
    cfg = DrafterConfig.for_target(target.config, num_layers=1, block_size=D, markov_rank=512, layer_ids=[1, 2])
    torch.manual_seed(0)
    dr = Drafter(cfg, target.embed_tokens, target.lm_head)
    with torch.no_grad():
        for p in dr.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        dr.w1.copy_(torch.eye(512) * scale)
        dr.w2.copy_(torch.eye(512))
    return dr


@pytest.mark.parametrize("mode", ["dspark", "dpara"])
def test_tau_counts_accepted_plus_bonus(tiny_target, mode):
    dr = _repeating_drafter(tiny_target, scale=50.0)  # drafts repeat the bonus, whatever the backbone says
    same = _synthetic(torch.full((2, 24), 7), dr.config.feature_size)
    assert estimate_tau(dr, same, D, mode) == D + 1  # every draft token right: d accepted + the bonus
    rising = _synthetic(torch.arange(24).repeat(2, 1) + 10, dr.config.feature_size)
    assert estimate_tau(dr, rising, D, mode) == 1.0  # nothing accepted: the bonus alone


def _planted_sequence(dr, mode, planted, prompt, features):
    """A ground truth built so that round k accepts exactly planted[k] draft tokens, drafting the way
    ``mode`` should: dspark from layout (a) on the grown context; dpara from layout (a) with the previous
    spine s_0..s_r as a feature-less prefix and a MASK anchor on the context before that round."""
    x, c = list(prompt), len(prompt)
    cache = dr.new_context_cache(1, features.shape[1])
    dr.extend_context(cache, features[:, :c - 1], torch.tensor([c - 1]))
    logits = dr.block_logits(cache, torch.tensor([x[-1]]), D)
    for r in planted:
        draft, prev = [], x[c - 1]
        for j in range(D):  # greedy Markov walk from the bonus
            prev = int((logits[0, j] + dr.w1[prev] @ dr.w2).argmax())
            draft.append(prev)
        bonus = (draft[r] + 1) % 512 if r < D else 5  # anything but the draft token: rejects it
        spine = torch.tensor([[x[c - 1]] + draft])
        x += draft[:r] + [bonus]
        if mode == "dpara":
            logits = dr.block_logits(cache, spine[:, 0], D, prefix=spine[:, :r + 1], mask_anchor=True)
        dr.extend_context(cache, features[:, c - 1:c + r], torch.tensor([r + 1]))
        c += r + 1
        if mode == "dspark":
            logits = dr.block_logits(cache, torch.tensor([bonus]), D)
    return x + [9] * D  # the estimator stops once a full round no longer fits


@pytest.mark.parametrize("mode", ["dspark", "dpara"])
def test_tau_follows_the_rounds_drafting_semantics(tiny_target, tiny_layer_ids, mode):
    dr = _drafter(tiny_target, tiny_layer_ids)
    with torch.no_grad():
        for p in dr.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    planted = [3, 1, 2, 0, 3, 2, 1, 3, 0, 2]
    length = 4 + sum(r + 1 for r in planted) + D
    feats = torch.randn(1, length, dr.config.feature_size, generator=torch.Generator().manual_seed(1))
    tokens = _planted_sequence(dr, mode, planted, [11, 12, 13, 14], feats)
    held = TrainData(torch.tensor([tokens]), torch.tensor([length]), torch.tensor([4]), feats,
                     torch.zeros(1, length, 512), list(tiny_layer_ids), 0.0)
    assert estimate_tau(dr, held, D, mode) == pytest.approx(sum(r + 1 for r in planted) / len(planted))


def test_training_refuses_bad_inputs(data, tiny_target, tiny_layer_ids):
    dr = _drafter(tiny_target, tiny_layer_ids)
    with pytest.raises(ValueError, match="d=4: expected 1 <= d <= the drafter's block_size=3"):
        train_stage1(dr, data, TrainConfig(d=4, progress=False))
    other = TrainData(**{**data.__dict__, "layer_ids": [0, 3]})
    with pytest.raises(ValueError, match=r"layers \[0, 3\]; the drafter expects \[1, 2\]"):
        train_stage1(dr, other, TrainConfig(progress=False))
    short = TrainData(**{**data.__dict__, "lengths": data.prompt_lens + 2})
    with pytest.raises(ValueError, match="long enough"):
        train_stage2(dr, short, TrainConfig(progress=False))
    with pytest.raises(ValueError, match="batch_size=0"):
        TrainConfig(batch_size=0)


def _dflash_drafter(target, layer_ids, seed=0):
    cfg = DrafterConfig.for_target(target.config, num_layers=1, block_size=D, markov_rank=0, layer_ids=layer_ids,
                                   draft_rows="mask", mask_token_id=511)
    torch.manual_seed(seed)
    return Drafter(cfg, target.embed_tokens, target.lm_head)


def test_dflash_layout_loss_scores_what_the_mask_rows_draft(data, tiny_target, tiny_layer_ids):
    """A DFlash drafter's training loss on one anchor equals the loss of its inference-time block logits
    ([anchor, MASK x d], the mask rows drafting tokens anchor+1..anchor+d) against the target's distributions."""
    dr = _dflash_drafter(tiny_target, tiny_layer_ids)
    with torch.no_grad():
        for p in dr.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    layout = dflash_layout(D)
    assert (layout.rows, layout.lead, layout.reach) == (D + 1, 1, D - 1)
    a = int(data.prompt_lens[0]) + 2
    with torch.no_grad():
        got = layout_loss(dr, data, torch.tensor([0]), torch.tensor([[a]]), layout, 0.1, 0.9)
        cache = dr.new_context_cache(1, 64)
        dr.extend_context(cache, data.features[0:1, :a].float(), torch.tensor([a]))
        z = dr.block_logits(cache, data.tokens[0, a:a + 1], D)
        want = distill_loss(z, data.target_logits(0, torch.arange(a, a + D)), 0.1, 0.9)
        shifted = distill_loss(z, data.target_logits(0, torch.arange(a + 1, a + D + 1)), 0.1, 0.9)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert abs(float(shifted) - float(want)) > 1e-3  # the check sees a one-position shift


def test_dflash_stage1_trains_the_backbone_and_refuses_stage2(data, tiny_target, tiny_layer_ids):
    dr = _dflash_drafter(tiny_target, tiny_layer_ids)
    layout = dflash_layout(D)
    before = _fixed_loss(dr, data, layout)
    train_stage1(dr, data, TrainConfig(epochs=4, batch_size=6, lr=3e-3, progress=False))
    assert _fixed_loss(dr, data, layout) < before - 0.02
    assert estimate_tau(dr, data, D, "dspark") >= 1.0
    with pytest.raises(ValueError, match="draft_rows='mask'"):
        train_stage2(dr, data, TrainConfig(progress=False))


def test_copy_backbone_starts_another_convention(tiny_target, tiny_layer_ids, tmp_path):
    src = _drafter(tiny_target, tiny_layer_ids, seed=1)
    save_drafter(src, tmp_path / "src")
    dst = _dflash_drafter(tiny_target, tiny_layer_ids, seed=2)
    names = copy_backbone(dst, tmp_path / "src")
    assert "fc.weight" in names and "w1" not in names and "w2" not in names
    for n in names:
        assert torch.equal(dst.state_dict()[n], src.state_dict()[n]), n
    other = Drafter(DrafterConfig.for_target(tiny_target.config, num_layers=2, block_size=D, markov_rank=0,
                                             layer_ids=tiny_layer_ids), tiny_target.embed_tokens, tiny_target.lm_head)
    with pytest.raises(ValueError, match=r"does not fit this drafter's backbone: layers\.1\..* missing"):
        copy_backbone(other, tmp_path / "src")
