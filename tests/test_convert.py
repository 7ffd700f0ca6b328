"""Published drafters: DFlash checkpoints checked against z-lab's own `dflash` package (a reference nobody
here wrote), DSpark checkpoints written with DeepSpec's tensor names and config fields, and the refusals."""
from __future__ import annotations

import json

import dflash.model as dflash_model  # the reference; .ci/run installs it (pip install --no-deps dflash==0.1.0)
import pytest
import torch
import torch.nn.functional as F

from dpara_rt.engine import Engine
from dpara_rt.models.autoregressive import generate_ar
from dpara_rt.models.convert import UnsupportedCheckpoint, convert
from dpara_rt.models.drafter_io import checkpoint_format, load_drafter, read_drafter_config
from dpara_rt.models.target import Target

BLOCK = 4          # DFlash block: anchor + 3 mask rows, i.e. d = 3 drafts
MASK_TOKEN = 511
LAYERS = [1, 2]


def _draft_qwen3_config(**extra):
    from transformers import Qwen3Config
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                      max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False)
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg


@pytest.fixture(scope="module")
def dflash_ref():
    """A random DFlashDraftModel for the tiny target (every weight perturbed, norms included)."""
    cfg = _draft_qwen3_config(block_size=BLOCK, num_target_layers=4,
                              dflash_config={"mask_token_id": MASK_TOKEN, "target_layer_ids": LAYERS})
    cfg.architectures = ["DFlashDraftModel"]
    torch.manual_seed(3)
    model = dflash_model.DFlashDraftModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(scope="module")
def dflash_dir(dflash_ref, tmp_path_factory):
    path = tmp_path_factory.mktemp("dflash")
    dflash_ref.save_pretrained(path)
    return path


def _reference_block(ref, hf_target, feats, block_ids):
    """dflash's own forward: context = feats at positions 0..N-1, the block right after it -> hidden [1, Q, H]."""
    n, q = feats.shape[1], block_ids.shape[1]
    noise = hf_target.get_input_embeddings()(block_ids)
    return ref(target_hidden=feats, noise_embedding=noise, position_ids=torch.arange(n + q)[None])


def _ours_block(drafter, feats, anchor, d):
    cache = drafter.new_context_cache(1, 64)
    drafter.extend_context(cache, feats, torch.tensor([feats.shape[1]]))
    return drafter.block_logits(cache, torch.tensor([anchor]), d)


def test_dflash_block_logits_equal_dflash_forward(dflash_ref, dflash_dir, tiny_target, tiny_hf_target):
    assert checkpoint_format(dflash_dir) == "dflash"
    drafter = load_drafter(dflash_dir, tiny_target)
    c = drafter.config
    assert (c.draft_rows, c.markov_rank, c.mask_token_id, c.block_size, c.layer_ids) == ("mask", 0, MASK_TOKEN,
                                                                                          BLOCK - 1, LAYERS)
    feats = torch.randn(1, 9, c.feature_size, generator=torch.Generator().manual_seed(0))
    anchor = 42
    with torch.no_grad():
        hidden = _reference_block(dflash_ref, tiny_hf_target, feats, torch.tensor([[anchor] + [MASK_TOKEN] * 3]))
        want = tiny_hf_target.lm_head(hidden[:, 1:])  # DFlash reads the mask rows
    got = _ours_block(drafter, feats, anchor, BLOCK - 1)
    assert (got - want).abs().max() <= 1e-4


def _record_verify_blocks(monkeypatch) -> list:
    blocks, verify = [], Target.verify

    def recording(self, tokens):
        blocks.append(torch.as_tensor(tokens).clone())
        return verify(self, tokens)
    monkeypatch.setattr(Target, "verify", recording)
    return blocks


@pytest.mark.parametrize("prompt_len", [5, 12])
def test_dflash_generate_and_ours_verify_the_same_drafts(dflash_ref, dflash_dir, tiny_target, tiny_hf_target,
                                                         monkeypatch, prompt_len):
    """dflash_generate on a transformers Qwen3 target and our `dflash` method on the same checkpoint: the same
    blocks go to the target every round (so every draft token is equal) and the outputs are equal."""
    prompt = torch.randint(3, 500, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    theirs = []
    hook = tiny_hf_target.register_forward_pre_hook(
        lambda mod, args, kwargs: theirs.append((args[0] if args else kwargs["input_ids"]).clone()), with_kwargs=True)
    try:
        out = dflash_model.dflash_generate(dflash_ref, tiny_hf_target, prompt, max_new_tokens=24,
                                           stop_token_ids=None)
    finally:
        hook.remove()
    theirs = [b for b in theirs[1:] if b.shape[1] == BLOCK]  # after the prefill; full blocks only

    drafter = load_drafter(dflash_dir, tiny_target)
    ours = _record_verify_blocks(monkeypatch)
    eng = Engine(tiny_target, drafter, method="dflash", d=BLOCK - 1, eos_ids=[])
    tokens = eng.generate([prompt[0].tolist()], max_new_tokens=24).tokens[0]

    assert len(theirs) >= 4
    for k, (a, b) in enumerate(zip(theirs, ours)):
        assert torch.equal(a.cpu(), b.cpu()), f"round {k + 1}: dflash verified {a.tolist()}, ours {b.tolist()}"
    new = out[0, prompt_len:].tolist()
    n = min(len(new), len(tokens))
    assert n >= 20 and new[:n] == tokens[:n]
    assert tokens == generate_ar(Target(tiny_target, 1, 64), [prompt[0].tolist()], 24)[0]


# ---------------------------------------------------------------- DSpark (DeepSpec's format)
RANK = 16


def _write_dspark(path, ref, target_hf, **config_overrides):
    """A checkpoint as DeepSpec's Qwen3DSparkModel saves it: its config fields and tensor names."""
    from safetensors.torch import save_file
    cfg = _draft_qwen3_config().to_dict()
    cfg.update(architectures=["Qwen3DSparkModel"], model_type="qwen3", num_target_layers=4, block_size=BLOCK,
               target_layer_ids=LAYERS, mask_token_id=MASK_TOKEN, num_anchors=512, enable_confidence_head=True,
               confidence_head_with_markov=False, markov_rank=RANK, markov_head_type="vanilla",
               layer_types=["full_attention"] * 2, tie_word_embeddings=False)
    cfg.update(config_overrides)
    g = torch.Generator().manual_seed(5)
    state = {k: v.clone() for k, v in ref.state_dict().items()}  # the same backbone names as DFlash's
    state.update({
        "embed_tokens.weight": target_hf.get_input_embeddings().weight.detach().clone(),
        "lm_head.weight": target_hf.lm_head.weight.detach().clone(),
        "markov_head.markov_w1.weight": torch.randn(512, RANK, generator=g),
        "markov_head.markov_w2.weight": torch.randn(512, RANK, generator=g) * 0.1,  # Linear(R, V).weight
    })
    if cfg["enable_confidence_head"]:
        state.update({"confidence_head.proj.weight": torch.randn(1, 64, generator=g),
                      "confidence_head.proj.bias": torch.zeros(1)})
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return state


def test_dspark_checkpoint_maps_backbone_and_markov_head(dflash_ref, tiny_target, tiny_hf_target, tmp_path):
    state = _write_dspark(tmp_path / "dspark", dflash_ref, tiny_hf_target)
    with pytest.warns(UserWarning, match="dropped its standalone confidence head"):
        drafter = load_drafter(tmp_path / "dspark", tiny_target)
    c = drafter.config
    assert (c.draft_rows, c.markov_rank, c.block_size, c.mask_token_id) == ("anchor", RANK, BLOCK, MASK_TOKEN)
    # the backbone is DFlash's computation; DSpark reads d = block_size rows starting at the anchor
    feats = torch.randn(1, 7, c.feature_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = _reference_block(dflash_ref, tiny_hf_target, feats, torch.tensor([[9] + [MASK_TOKEN] * 3]))
        want = tiny_hf_target.lm_head(hidden)
    assert (_ours_block(drafter, feats, 9, BLOCK) - want).abs().max() <= 1e-4
    # the Markov bias as DeepSpec applies it: markov_w2(markov_w1(prev))
    prev = torch.tensor([0, 17, 511])
    want_bias = F.linear(F.embedding(prev, state["markov_head.markov_w1.weight"]), state["markov_head.markov_w2.weight"])
    torch.testing.assert_close(drafter.markov_bias(prev), want_bias)


@pytest.mark.parametrize("method", ["dspark", "dpara", "dflash", "psd"])
def test_imported_drafters_are_lossless(dflash_ref, dflash_dir, tiny_target, tiny_hf_target, tiny_prompts,
                                        tmp_path, method):
    _write_dspark(tmp_path / "dspark", dflash_ref, tiny_hf_target)
    want = generate_ar(Target(tiny_target, len(tiny_prompts), 64), tiny_prompts, 16)
    for src in (tmp_path / "dspark", dflash_dir):
        with pytest.warns() if src != dflash_dir else _no_warning():
            drafter = load_drafter(src, tiny_target)
        eng = Engine(tiny_target, drafter, method=method, d=3, eos_ids=[])
        out = eng.generate(tiny_prompts, max_new_tokens=16)
        assert out.tokens == want, (src, method)
        assert out.stats.fallback_rate == 0 or method == "psd"


class _no_warning:
    def __enter__(self):
        import warnings
        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_convert_writes_an_equivalent_dpara_rt_drafter(kind, dflash_ref, dflash_dir, tiny_target, tiny_hf_target,
                                                       tmp_path):
    src = dflash_dir if kind == "dflash" else tmp_path / "src"
    if kind == "dspark":
        _write_dspark(src, dflash_ref, tiny_hf_target, enable_confidence_head=False)
    config = convert(kind, src, tmp_path / "out")
    assert checkpoint_format(tmp_path / "out") == "dpara_rt" and read_drafter_config(tmp_path / "out") == config
    a, b = load_drafter(src, tiny_target), load_drafter(tmp_path / "out", tiny_target)
    feats = torch.randn(1, 5, config.feature_size, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_ours_block(a, feats, 3, 3), _ours_block(b, feats, 3, 3), rtol=0, atol=0)
    other = "dflash" if kind == "dspark" else "dspark"
    with pytest.raises(ValueError, match=f"holds a {kind} drafter, not a {other} one"):
        convert(other, src, tmp_path / "out2")


@pytest.mark.parametrize("field, value", [
    ("markov_head_type", "gated"),
    ("markov_head_type", "rnn"),
    ("confidence_head_with_markov", True),
    ("layer_types", ["sliding_attention", "full_attention"]),
    ("target_layer_ids", [-1, 2]),
    ("final_logit_softcapping", 30.0),
    ("attention_bias", True),
])
def test_dspark_refusals_name_the_field(field, value, dflash_ref, tiny_target, tiny_hf_target, tmp_path):
    _write_dspark(tmp_path / "x", dflash_ref, tiny_hf_target, **{field: value})
    with pytest.raises(UnsupportedCheckpoint) as e:
        load_drafter(tmp_path / "x", tiny_target)
    msg = str(e.value)
    assert "\n" not in msg and (field in msg or field.replace("_", " ") in msg), msg


@pytest.mark.parametrize("field, value", [
    ("conv_kernel_size", 4), ("selector_rank", 32), ("architectures", ["DFlash2DraftModel"]),
    ("input_embedding_scale", 2.0), ("final_logit_softcapping", 20.0), ("sliding_window_layers", None),
])
def test_dflash_refusals_name_the_field(field, value, dflash_dir, tiny_target, tmp_path):
    import shutil
    shutil.copytree(dflash_dir, tmp_path / "x")
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    if field == "sliding_window_layers":
        field, value = "layer_types", ["sliding_attention", "full_attention"]
    cfg[field] = value
    (tmp_path / "x" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpoint, match=field):
        read_drafter_config(tmp_path / "x")


def test_unknown_tensors_and_directories_are_refused(dflash_ref, dflash_dir, tiny_target, tmp_path):
    from safetensors.torch import save_file
    state = {k: v.contiguous() for k, v in dflash_ref.state_dict().items()}
    state["layers.0.attention_conv.base_kernel"] = torch.zeros(2, 4, 64)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text((dflash_dir / "config.json").read_text())
    save_file(state, str(tmp_path / "x" / "model.safetensors"))
    with pytest.raises(UnsupportedCheckpoint, match="tensor='layers.0.attention_conv.base_kernel'"):
        load_drafter(tmp_path / "x", tiny_target)
    with pytest.raises(ValueError, match="expected drafter_config.json"):
        read_drafter_config(tmp_path / "missing")
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="neither a DSpark nor a DFlash"):
        read_drafter_config(tmp_path / "y")


# ---------------------------------------------------------------- export to DFlash (engines' baseline)
def test_export_dflash_round_trips_to_dflash_reference(dflash_ref, dflash_dir, tiny_target, tiny_hf_target,
                                                       tmp_path):
    """A DFlash-convention drafter written back as a DFlashDraftModel checkpoint: the same tensors under DFlash's
    names, a config DFlash's own code loads, and its forward equals our block logits."""
    from safetensors.torch import load_file
    from dpara_rt.models.convert import export_dflash

    convert("dflash", dflash_dir, tmp_path / "ours")
    cfg = export_dflash(tmp_path / "ours", tmp_path / "back", num_target_layers=4)
    assert (cfg["block_size"], cfg["dflash_config"]) == (BLOCK, {"mask_token_id": MASK_TOKEN,
                                                                 "target_layer_ids": LAYERS})
    assert checkpoint_format(tmp_path / "back") == "dflash"
    want = dflash_ref.state_dict()
    got = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(got) == sorted(k for k in want if not k.endswith("inv_freq"))
    for k, t in got.items():
        assert torch.equal(t, want[k]), k
    reloaded = dflash_model.DFlashDraftModel.from_pretrained(tmp_path / "back").eval()
    feats = torch.randn(1, 7, 2 * 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = _reference_block(reloaded, tiny_hf_target, feats, torch.tensor([[9] + [MASK_TOKEN] * 3]))
        theirs = tiny_hf_target.lm_head(hidden[:, 1:])
    ours = _ours_block(load_drafter(tmp_path / "back", tiny_target), feats, 9, BLOCK - 1)
    assert (ours - theirs).abs().max() <= 1e-4


def test_export_dflash_refuses_what_dflash_cannot_hold(dflash_dir, tiny_target, tmp_path):
    from dpara_rt.models.convert import export_dflash
    from dpara_rt.models.drafter import Drafter, DrafterConfig
    from dpara_rt.models.drafter_io import save_drafter

    anchor = Drafter(DrafterConfig.for_target(tiny_target.config, block_size=3, markov_rank=4, layer_ids=LAYERS),
                     tiny_target.embed_tokens, tiny_target.lm_head)
    save_drafter(anchor, tmp_path / "anchor")
    with pytest.raises(UnsupportedCheckpoint, match="draft_rows='anchor'"):
        export_dflash(tmp_path / "anchor", tmp_path / "x", 4)
    convert("dflash", dflash_dir, tmp_path / "ours")
    with pytest.raises(ValueError, match="num_target_layers=2: expected more than the drafter's largest feature "
                                         "layer 2"):
        export_dflash(tmp_path / "ours", tmp_path / "x", 2)
