"""Any transformers causal LM as the target: small random Llama, Qwen2, Qwen3-MoE and Mistral (sliding window)
checkpoints written by transformers, loaded with load_target; every method's greedy output equals transformers'
own generate, rollback equals a fresh prefill, and a Qwen3 checkpoint takes the native fast path. Llama, Qwen2
and full-attention Mistral checkpoints take it too (tests/test_native_llama.py); here native=False keeps them on
the adapter."""
import functools

import pytest
import torch

from dpara_rt.engine import Engine
from dpara_rt.engines.random_pair import hold_bigram_table
from dpara_rt.methods import METHODS, VARIANTS, variant
from dpara_rt.models.drafter import Drafter, DrafterConfig
from dpara_rt.models.hf_target import HFCausalLM, HFTarget, load_target, make_target
from dpara_rt.models.qwen3 import Qwen3ForCausalLM
from dpara_rt.models.target import Target

VOCAB, EOS = 256, 2
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, bos_token_id=1,
              eos_token_id=EOS)
ARCHS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                          decoder_sparse_step=1, norm_topk_prob=True)),
    # a window shorter than prompt + output: rollback must crop sliding-window layers past their window
    "mistral": ("MistralConfig", dict(sliding_window=6)),
}
GEN_ARCHS = ["llama", "qwen2", "qwen3_moe", "mistral"]
PROMPTS = [[5, 9, 33, 70, 11, 140, 7], [200, 17, 64]]
NEW = 14


def build_hf(arch: str, seed: int = 0, shrink: float = 0.1, **overrides):
    """A random transformers model; the layers' output projections are shrunk so the next token leans on the
    current one, which a bigram Markov head can then guess (drafts get accepted, commits keep several tokens)."""
    import transformers

    name, extra = ARCHS[arch]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(**{**COMMON, **extra, **overrides}))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "o_proj" in pname or "down_proj" in pname:
                p.mul_(shrink)
    return model.eval()


def bigram_drafter(model, seed: int = 1) -> Drafter:
    """A random drafter whose Markov head holds the target's bigram table (logits after a lone token)."""
    dcfg = DrafterConfig.for_target(model.config, num_layers=1, num_feature_layers=2, block_size=8,
                                    markov_rank=VOCAB)
    drafter = Drafter(dcfg, model.embed_tokens, model.lm_head)
    torch.manual_seed(seed)
    drafter.reset_parameters()
    return hold_bigram_table(drafter, model.hf).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def pairs(saved_models):
    """arch -> (HFCausalLM loaded from a checkpoint dir, drafter, checkpoint dir), built on first use."""
    @functools.cache
    def get(arch):
        path, _ = saved_models(f"adapter_{arch}", lambda: build_hf(arch))
        model = load_target(path, native=False)
        return model, bigram_drafter(model), path

    return get


def hf_generate(model: HFCausalLM, prompts, max_new: int) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time (stops after EOS, which it keeps)."""
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        seq = model.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                                pad_token_id=0)
        out.append(seq[0, len(p):].tolist())
    return out


# ------------------------------------------------------------------ loading
@pytest.mark.parametrize("arch", list(ARCHS))
def test_load_target_wraps_transformers_models(pairs, arch):
    model, _, path = pairs(arch)
    assert isinstance(model, HFCausalLM) and not isinstance(model, Qwen3ForCausalLM)
    c = model.config
    assert (c.model_type, c.vocab_size, c.hidden_size, c.num_hidden_layers) == (arch, VOCAB, 64, 3)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert c.eos_token_id == [EOS] and c.max_position_embeddings == 512
    assert model.dtype == torch.float32 and model.device == torch.device("cpu")
    assert isinstance(model.embed_tokens, torch.nn.Embedding) and isinstance(model.lm_head, torch.nn.Linear)
    assert model.lm_head.weight is not model.embed_tokens.weight
    assert load_target(path, dtype="bfloat16", native=False).dtype == torch.bfloat16


def test_qwen3_checkpoint_takes_the_native_path(tiny_target_dir):
    """The native Qwen3 is chosen for a Qwen3 checkpoint; through transformers it computes the same logits and
    features (hidden_states[i + 1], the last layer's after the final norm) at prefill and after a rollback."""
    native = load_target(tiny_target_dir)
    assert isinstance(native, Qwen3ForCausalLM)
    hf = load_target(tiny_target_dir, native=False)
    assert isinstance(hf, HFCausalLM) and hf.config.eos_token_id == native.config.eos_token_id
    layers = [0, 2, 3]
    a, b = make_target(native, 2, 64, layers), make_target(hf, 2, 64, layers)
    assert type(a) is Target and type(b) is HFTarget and a.feature_dim == b.feature_dim == 3 * 64
    prompts = [[7, 300, 41, 9, 18], [77, 5]]
    for x, y in zip(a.start(prompts), b.start(prompts)):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)
    block = torch.tensor([[3, 4, 5, 6], [10, 11, 12, 13]])
    for x, y in zip(a.verify(block), b.verify(block)):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)
    a.commit(torch.tensor([1, 3])), b.commit(torch.tensor([1, 3]))
    for x, y in zip(a.verify(block[:, :2]), b.verify(block[:, :2])):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)


def test_load_target_errors_name_the_path(tmp_path):
    with pytest.raises(ValueError, match="nowhere.*not a directory"):
        load_target(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=f"{tmp_path.name}.*no config.json"):
        load_target(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="config.json.*no model_type"):
        load_target(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=f"cannot load .*{tmp_path.name}"):
        load_target(tmp_path)


def test_tied_embeddings(tmp_path):
    """A tied checkpoint shares one weight between embed_tokens and lm_head, and decodes losslessly."""
    build_hf("llama", shrink=1.0, tie_word_embeddings=True).save_pretrained(tmp_path)
    model = load_target(tmp_path, native=False)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight
    drafter = bigram_drafter(model)
    want = hf_generate(model, PROMPTS, NEW)
    for method in ("ar", "dpara"):
        eng = Engine(model, drafter if method != "ar" else None, method=method, d=4)
        assert eng.generate(PROMPTS, max_new_tokens=NEW).tokens == want


def test_make_target_refuses_a_bare_transformers_model(pairs):
    model, _, _ = pairs("llama")
    with pytest.raises(ValueError, match="HFCausalLM"):
        make_target(model.hf, 1, 32)


# ------------------------------------------------------------------ the target
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "mistral"])
def test_rollback_equals_fresh_prefill(pairs, arch):
    """After verify + partial commits (past the sliding window for mistral), the next verify's logits and
    features equal those of a target freshly prefilled with the committed tokens."""
    model, _, _ = pairs(arch)
    layers = [0, 2]
    t = HFTarget(model, 2, 64, layers)
    t.start(PROMPTS)
    kept = [list(p) for p in PROMPTS]
    g = torch.Generator().manual_seed(3)
    for n in ([2, 0], [5, 1], [0, 6], [3, 3]):
        block = torch.randint(3, VOCAB, (2, 6), generator=g)
        t.verify(block)
        t.commit(torch.tensor(n))
        for b in range(2):
            kept[b] += block[b, : n[b]].tolist()
    assert t.lengths.tolist() == [len(k) for k in kept]
    probe = torch.randint(3, VOCAB, (2, 3), generator=g)
    logits, feats = t.verify(probe)
    fresh = HFTarget(model, 2, 64, layers)
    fresh.start(kept)
    want_logits, want_feats = fresh.verify(probe)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(feats, want_feats, atol=1e-5, rtol=1e-5)
    # and both equal transformers over the whole sequence at once
    for b in range(2):
        full = model.hf(input_ids=torch.tensor([kept[b] + probe[b].tolist()])).logits[0, -3:].float()
        torch.testing.assert_close(logits[b], full, atol=1e-4, rtol=1e-4)


def test_start_features_and_a_replaced_verify(pairs):
    model, _, _ = pairs("qwen2")
    t = HFTarget(model, 2, 64, [1])
    logits, feats, lens = t.start(PROMPTS)
    assert logits.shape == (2, VOCAB) and logits.dtype == torch.float32
    assert feats.shape == (2, 7, 64) and lens.tolist() == [7, 3]
    assert feats[1, 3:].abs().sum() == 0 and feats[1, :3].abs().sum() > 0
    hs = model.hf(input_ids=torch.tensor([PROMPTS[0]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(feats[0], hs[2][0], atol=1e-5, rtol=1e-5)
    # a verify that was never committed is replaced by the next one, as the native target overwrites it
    first = t.verify(torch.tensor([[4, 5, 6], [7, 8, 9]]))
    t.verify(torch.tensor([[40, 50], [70, 80]]))
    again = t.verify(torch.tensor([[4, 5, 6], [7, 8, 9]]))
    torch.testing.assert_close(first[0], again[0], atol=1e-5, rtol=1e-5)
    assert t.lengths.tolist() == [7, 3]
    no_feats = HFTarget(model, 1, 16)
    no_feats.start([[3, 4]])
    assert no_feats.verify(torch.tensor([[5]]))[1].shape == (1, 1, 0)


def test_bad_arguments_as_the_native_target_words_them(pairs):
    model, _, _ = pairs("llama")
    with pytest.raises(ValueError, match=r"layer_ids \[3\] contain \[3\]; expected indices in \[0, 3\)"):
        HFTarget(model, 1, 32, [3])
    with pytest.raises(ValueError, match="max_len = 0"):
        HFTarget(model, 1, 0)
    t = HFTarget(model, 2, 16)
    with pytest.raises(RuntimeError, match="verify before start"):
        t.verify(torch.tensor([[1]]))
    with pytest.raises(ValueError, match="3 prompts exceed this target's max_batch 2"):
        t.check_prompts([[1], [2], [3]])
    with pytest.raises(ValueError, match=r"token ids \[256\] outside the vocabulary \[0, 256\)"):
        t.check_prompts([[1, 256]])
    t.start([[3, 4, 5], [6]])
    with pytest.raises(ValueError, match=r"verify tokens shape \(1, 2\); expected \[2, T >= 1\]"):
        t.verify(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="row 0: length 3 \\+ 14 verify tokens exceeds max_len 16"):
        t.verify(torch.ones(2, 14, dtype=torch.long))
    t.verify(torch.ones(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"rows \[1\] outside \[0, 2\]"):
        t.commit(torch.tensor([1, 3]))
    t.reserve(32)
    assert t.max_len == 32
    t.verify(torch.ones(2, 14, dtype=torch.long))  # fits after reserve


# ------------------------------------------------------------------ every method equals transformers' generate
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("arch", GEN_ARCHS)
def test_greedy_equals_transformers_generate(pairs, arch, method):
    model, drafter, _ = pairs(arch)
    want = hf_generate(model, PROMPTS, NEW)
    eng = Engine(model, drafter if METHODS[method].needs_drafter else None, method=method, d=4)
    assert isinstance(eng.target, HFTarget)
    assert eng.generate(PROMPTS[:1], max_new_tokens=NEW).tokens == want[:1]
    out = eng.generate(PROMPTS, max_new_tokens=NEW)   # a ragged batch of two
    assert out.tokens == want
    if method != "ar":
        assert out.stats.tau > 1.0   # drafts were accepted: commits kept several tokens and rolled back others


@pytest.mark.parametrize("name", [v for v in VARIANTS if v not in METHODS])
def test_every_variant_equals_generate(pairs, name):
    model, drafter, _ = pairs("qwen3_moe")
    want = hf_generate(model, PROMPTS, NEW)
    assert Engine(model, drafter, d=3, **variant(name)).generate(PROMPTS, max_new_tokens=NEW).tokens == want


def test_eos_stops_as_generate_does(pairs):
    """With an EOS id that greedy decoding hits mid-way, the engine and generate stop at the same place."""
    model, drafter, _ = pairs("qwen2")
    plain = hf_generate(model, PROMPTS[:1], NEW)[0]
    eos = plain[4]
    want = [plain[: plain.index(eos) + 1]]
    seq = model.hf.generate(torch.tensor(PROMPTS[:1]), max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                            pad_token_id=0)
    assert seq[0, len(PROMPTS[0]):].tolist() == want[0]
    for method in ("ar", "dpara"):
        eng = Engine(model, drafter if method != "ar" else None, method=method, d=4, eos_ids=[eos])
        assert eng.generate(PROMPTS[:1], max_new_tokens=NEW).tokens == want


def test_continuous_batching_on_a_transformers_target(pairs):
    """Rows of a transformers target are re-prefilled when requests join (prefill_row): joined requests
    decode exactly as alone."""
    from test_batching import Timeline, _request, _run
    model, drafter, _ = pairs("llama")
    eng = Engine(model, drafter, method="dpara", d=3, max_batch=2)
    prompts = [[5, 9, 13], [7, 3, 11, 19, 4], [21, 8]]
    alone = [eng.generate([p], 10).tokens[0] for p in prompts]
    reqs = [_request(i, p, 10, eos=model.config.eos_token_id) for i, p in enumerate(prompts)]
    timeline = Timeline(eng, [(0, reqs[0]), (2, reqs[1]), (3, reqs[2])])
    slots = _run(eng, timeline, batch=2)
    assert [[t for c in r.handle for t in c] for r in reqs] == alone
    assert slots.joins >= 1
