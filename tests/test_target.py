"""Our Qwen3 model and loader against transformers' Qwen3ForCausalLM."""
import json

import pytest
import torch

from dpara_rt.models.loader import load_qwen3, save_qwen3
from dpara_rt.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from dpara_rt.models.target import Target

FP32_TOL = dict(atol=2e-5, rtol=1e-5)

# GQA ratio 1 and 4, tied and untied embeddings, three rope thetas, a head_dim unlike hidden/heads.
CONFIGS = {
    "mha_tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, rope_theta=10000.0),
    "gqa4_untied": dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
                        rope_theta=1_000_000.0, seed=3),
    "gqa4_tied_hd32": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
                           rope_theta=500_000.0, seed=4),
}


def hf_reference(hf, ids):
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    return out.logits, out.hidden_states


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_features_match_transformers(name, make_tiny_target_dir):
    from transformers import Qwen3ForCausalLM as HFQwen3

    path = make_tiny_target_dir(name, **CONFIGS[name])
    hf = HFQwen3.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_qwen3(path)
    assert ours.config.tie_word_embeddings == CONFIGS[name]["tie_word_embeddings"]
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == CONFIGS[name]["tie_word_embeddings"]
    ids = torch.randint(0, ours.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    ref_logits, ref_hidden = hf_reference(hf, ids)
    layer_ids = [0, 2, 3]
    with torch.no_grad():
        logits, feats = ours(ids, torch.arange(13).expand(2, 13), layer_ids=layer_ids)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref_logits, **FP32_TOL)
    torch.testing.assert_close(feats, torch.cat([ref_hidden[i + 1] for i in layer_ids], -1), **FP32_TOL)
    # The cached path (what the engine uses) gives the same numbers.
    target = Target(ours, max_batch=2, max_len=32, layer_ids=layer_ids)
    last, cached_feats, _ = target.start(ids.tolist())
    torch.testing.assert_close(last, ref_logits[:, -1], **FP32_TOL)
    torch.testing.assert_close(cached_feats, feats, **FP32_TOL)


def test_sharded_checkpoint_equals_single_file(make_tiny_target_dir, tiny_target):
    sharded = make_tiny_target_dir("tiny_sharded", max_shard_size="40KB")  # same seed and config as "tiny"
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    model = load_qwen3(sharded)
    for (name, a), (_, b) in zip(tiny_target.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("max_shard_bytes", [None, 60_000])
def test_save_roundtrip_is_read_by_transformers(tmp_path, tiny_target, tiny_hf_target, max_shard_bytes):
    from transformers import Qwen3ForCausalLM as HFQwen3

    save_qwen3(tiny_target, tmp_path, max_shard_bytes=max_shard_bytes)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (max_shard_bytes is not None)
    again = load_qwen3(tmp_path)
    assert again.config == tiny_target.config
    for (name, a), (_, b) in zip(tiny_target.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    hf = HFQwen3.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.arange(3, 40).view(1, -1)
    torch.testing.assert_close(hf_reference(hf, ids)[0], hf_reference(tiny_hf_target, ids)[0], **FP32_TOL)


def test_tied_model_saves_without_lm_head(tmp_path, make_tiny_target_dir):
    model = load_qwen3(make_tiny_target_dir("mha_tied", **CONFIGS["mha_tied"]))
    save_qwen3(model, tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    again = load_qwen3(tmp_path)
    assert again.lm_head.weight is again.embed_tokens.weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_load_tracks_transformers(tiny_target_dir, dtype):
    from transformers import Qwen3ForCausalLM as HFQwen3

    ours = load_qwen3(tiny_target_dir, dtype=dtype)
    assert all(p.dtype == dtype for p in ours.parameters())
    hf = HFQwen3.from_pretrained(tiny_target_dir, dtype=dtype).eval()
    ids = torch.arange(5, 29).view(2, 12)
    with torch.no_grad():
        logits, _ = ours(ids, torch.arange(12).expand(2, 12))
    ref = hf_reference(hf, ids)[0].float()
    assert logits.dtype == torch.float32
    # Same op order as transformers; attention kernels may round differently, so a half-precision ulp or so.
    torch.testing.assert_close(logits, ref, atol=0.05, rtol=0.02)
    # Casting a loaded fp32 model keeps RoPE in fp32 and so equals loading in half precision.
    cast = load_qwen3(tiny_target_dir).to(dtype)
    with torch.no_grad():
        assert torch.equal(cast(ids, torch.arange(12).expand(2, 12))[0], logits)
    assert cast.inv_freq.dtype == torch.float32


def test_init_weights_is_seeded_and_transformers_like(tiny_target):
    a, b = (Qwen3ForCausalLM(tiny_target.config) for _ in range(2))
    for m in (a, b):
        m.init_weights(std=0.02, generator=torch.Generator().manual_seed(5))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() == 1:
            assert torch.equal(pa, torch.ones_like(pa)), name
    assert abs(a.lm_head.weight.std().item() - 0.02) < 0.002


def test_config_parses_transformers_4_layout():
    d = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=100, hidden_size=32,
             intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             rope_theta=123.0, rope_scaling=None, eos_token_id=7, tie_word_embeddings=True)
    cfg = Qwen3Config.from_dict(d)
    assert (cfg.rope_theta, cfg.head_dim, cfg.eos_token_id) == (123.0, 8, [7])
    assert Qwen3Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_generation_config_eos_ids_are_merged(tmp_path, tiny_target):
    save_qwen3(tiny_target, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    assert load_qwen3(tmp_path).config.eos_token_id == [2, 9]
