"""The native host layers of a float32 Qwen3 target (host/qwen3.py) against the torch path."""
import pytest
import torch

from dpara_rt import _core
from dpara_rt.host import qwen3 as host_qwen3
from dpara_rt.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from dpara_rt.models.target import Target
from engine_pairs import assert_verified_tokens_get_their_decode_logits


def _model(bf16_weights: bool, head_dim: int = 16) -> Qwen3ForCausalLM:
    cfg = Qwen3Config(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, rope_theta=10000.0)
    model = Qwen3ForCausalLM(cfg).eval()
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms away from 1, so a missed norm weight shows
                p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(p.numel())) + 0.5)
            if bf16_weights:
                p.copy_(p.bfloat16().float())
    return model


def _decode(model, monkeypatch, native: bool):
    """Ragged prefill of two rows, a verify of 5 tokens, a commit, a verify of 1: every output."""
    if not native:
        monkeypatch.setattr(host_qwen3, "usable", lambda *a: False)
    target = Target(model, 2, 64, [0, 2])
    prompts = [[5, 17, 3, 88, 41, 9, 60], [12, 7, 70]]
    block = torch.tensor([[4, 8, 15, 16, 23], [42, 1, 2, 3, 5]])
    with torch.no_grad():
        last, feats, _ = target.start(prompts)
        logits, vfeats = target.verify(block)
        target.commit(torch.tensor([2, 5]))
        step, sfeats = target.verify(block[:, :1])
    monkeypatch.undo()
    return [last, feats, logits, vfeats, step, sfeats]


@pytest.mark.parametrize("bf16_weights", [True, False])
@pytest.mark.parametrize("head_dim", [16, 12])  # 12: the tails of the 8-wide loops
def test_native_layers_match_the_torch_path(monkeypatch, bf16_weights, head_dim):
    model = _model(bf16_weights, head_dim)
    native = _decode(model, monkeypatch, native=True)
    assert model._host is not None and len(model._host._layers) == 3
    torch_path = _decode(model, monkeypatch, native=False)
    for a, b in zip(native, torch_path):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_verified_token_gets_the_logits_of_decoding_it_alone():
    model = _model(bf16_weights=True)
    assert_verified_tokens_get_their_decode_logits(model)


def test_a_prefill_on_two_threads_gives_each_token_its_decode_logits():
    """A prompt's prefill (32 or more tokens a row) splits its products, its attention (a KV head each) and its SiLU
    over two threads; its last token's logits are still bit for bit those of decoding the prompt one token at a
    time."""
    cfg = Qwen3Config(vocab_size=96, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=10000.0)
    model = Qwen3ForCausalLM(cfg).eval()  # wide enough that a 40-token prefill's products take the helper
    model.init_weights(std=0.05, generator=torch.Generator().manual_seed(3))
    prompt = [(7 * i + 3) % 96 for i in range(40)]
    with torch.no_grad():
        prefilled = Target(model, 1, 64)
        last, _, _ = prefilled.start([prompt])
        stepped = Target(model, 1, 64)
        stepped.start([prompt[:1]])
        for token in prompt[1:]:
            step, _ = stepped.verify(torch.tensor([[token]]))
            stepped.commit(torch.tensor([1]))
    assert torch.equal(last.reshape(-1), step.reshape(-1))


def test_repacks_when_a_weight_changes(monkeypatch):
    model = _model(bf16_weights=True)
    before = _decode(model, monkeypatch, native=True)[2]
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight.mul_(0.5)
    after = _decode(model, monkeypatch, native=True)[2]
    reference = _decode(model, monkeypatch, native=False)[2]
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, reference, rtol=1e-5, atol=1e-5)


def test_a_decodes_verifies_trust_the_layers_its_start_checked(monkeypatch):
    """Target.start checks every parameter against its packed copy; the verifies after it check only the cache
    (recheck=False), so a weight changed in the middle of a decode is seen from the next start on."""
    model = _model(bf16_weights=True)
    checks = []
    unchanged = host_qwen3._PackedLayer.unchanged
    monkeypatch.setattr(host_qwen3._PackedLayer, "unchanged", lambda self: checks.append(self) or unchanged(self))
    target, block = Target(model, 1, 64), torch.tensor([[4, 8, 15]])
    with torch.no_grad():
        target.start([[5, 17, 3]])
        target.start([[5, 17, 3]])
        assert len(checks) == 3  # the second start checked each layer
        first, _ = target.verify(block)
        target.verify(block)
        assert len(checks) == 3
        model.layers[1].mlp.down_proj.weight.mul_(0.5)
        assert torch.equal(target.verify(block)[0], first)
        target.start([[5, 17, 3]])
        fresh, _ = target.verify(block)
    monkeypatch.undo()
    monkeypatch.setattr(host_qwen3, "usable", lambda *a: False)
    with torch.no_grad():
        reference = Target(model, 1, 64)
        reference.start([[5, 17, 3]])
        expected, _ = reference.verify(block)
    assert not torch.allclose(fresh, first)
    torch.testing.assert_close(fresh, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer_ids", [[0, 2], [2, 2], []])
def test_a_verify_is_one_core_call_with_the_bits_of_its_steps(monkeypatch, layer_ids):
    """A verify runs embedding, RoPE rows, layers, final norm and output head in one core call (host_qwen3_tokens),
    with the bits the native steps give one by one (a ragged batch, features of any layers); a token id out of
    the vocabulary is refused by name before anything is written."""
    model = _model(bf16_weights=True)
    prompts, block = [[5, 17, 3, 88, 41], [12, 7]], torch.tensor([[4, 8, 15], [42, 1, 2]])
    out = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(Qwen3ForCausalLM, "_host_forward", lambda *a: None)
        calls = []
        tokens_forward = _core.HostQwen3Stack.tokens_forward
        monkeypatch.setattr(_core.HostQwen3Stack, "tokens_forward",
                            lambda *a, **k: calls.append(1) or tokens_forward(*a, **k), raising=False)
        target = Target(model, 2, 64, layer_ids)
        with torch.no_grad():
            target.start(prompts)
            out[fused] = target.verify(block)
        assert len(calls) == (1 if fused else 0)
        monkeypatch.undo()
    for a, b in zip(out[True], out[False]):
        assert torch.equal(a, b)
    target = Target(model, 1, 64, layer_ids)
    with torch.no_grad():
        target.start([[5, 17]])
        before = target.cache.k.clone()
        with pytest.raises(ValueError, match=r"tokens\[0, 1\] = 96, expected 0..95"):
            target.verify(torch.tensor([[4, 96, 1]]))
    assert torch.equal(target.cache.k, before)


@pytest.mark.parametrize("layer_ids", [[0, 2], [2, 2], []])
def test_a_decodes_verify_plan_gives_the_verifys_bits_and_its_argmax(monkeypatch, layer_ids):
    """Target.verify_argmax runs each verify of a decode as one call of the plan start() bound (host_qwen3_verify):
    the logits and features verify() gives, the features written straight into features_out, and the arg-max, at
    positions that follow the commits. A layer listed twice has no plan (the Python path copies it) and gives the
    same. A verify past the cache is refused by name with the cache untouched; a NaN logit gives no arg-max."""
    model = _model(bf16_weights=True)
    runs = []
    run = _core.HostQwen3Verify.run
    monkeypatch.setattr(_core.HostQwen3Verify, "run", lambda *a, **k: runs.append(1) or run(*a, **k))
    planned, reference = Target(model, 2, 64, layer_ids), Target(model, 2, 64, layer_ids)
    prompts = [[5, 17, 3, 88, 41], [12, 7]]
    with torch.no_grad():
        planned.start(prompts)
        reference.start(prompts)
        assert (planned._plan is None) == (layer_ids == [2, 2])
        for block, keep in ((torch.tensor([[4, 8, 15], [42, 1, 2]]), [2, 3]), (torch.tensor([[9], [33]]), [1, 1])):
            out = torch.full((2, block.shape[1], planned.feature_dim), float("nan"))
            logits, feats, argmax = planned.verify_argmax(block, out)
            expected, expected_feats = reference.verify(block)
            assert torch.equal(logits, expected) and torch.equal(feats, expected_feats)
            assert feats.data_ptr() == out.data_ptr()
            assert torch.equal(argmax, expected.argmax(-1))
            for target in (planned, reference):
                target.commit(torch.tensor(keep))
    assert len(runs) == (0 if layer_ids == [2, 2] else 2)
    if layer_ids == [2, 2]:
        return
    with torch.no_grad():
        target = Target(model, 1, 16, layer_ids)
        target.start([[5, 17, 3]])
        before = target.cache.k.clone()
        with pytest.raises(ValueError, match=r"lengths\[0\] = 3 with t = 14, expected 0..2"):
            target.verify_argmax(torch.arange(14)[None])
        assert torch.equal(target.cache.k, before)
        model.embed_tokens.weight[8, 0] = float("nan")  # read as it is (embedding rows are not packed)
        assert target.verify_argmax(torch.tensor([[4, 8]]))[2] is None


def test_a_replaced_parameter_is_repacked_and_copies_pack_their_own(monkeypatch):
    import copy
    model = _model(bf16_weights=True)
    _decode(model, monkeypatch, native=True)
    layer = model.layers[2].mlp
    layer.down_proj.weight = torch.nn.Parameter(layer.down_proj.weight.detach() * 0.5)  # a new tensor
    after = _decode(model, monkeypatch, native=True)
    torch.testing.assert_close(after[2], _decode(model, monkeypatch, native=False)[2], rtol=1e-5, atol=1e-5)
    twin = copy.deepcopy(model)  # the core objects hold raw pointers: the copy starts without them
    assert twin._host is not None and twin._host._layers == {}
    assert all(torch.equal(a, b) for a, b in zip(_decode(twin, monkeypatch, native=True), after))


def test_the_native_target_can_be_turned_off(monkeypatch):
    from dpara_rt.host.linear import native_target
    model = _model(bf16_weights=True)
    before = native_target(False)
    try:
        off = _decode(model, monkeypatch, native=True)
        assert model._host is None and model.lm_head._packed is None
    finally:
        native_target(before)
    on = _decode(model, monkeypatch, native=True)
    assert model._host is not None
    for a, b in zip(on, off):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"native_target\(enabled='no'\)"):
        native_target("no")


def test_training_takes_the_torch_path():
    model = _model(bf16_weights=True).train()
    from dpara_rt.models.kv_cache import KVCache
    cache = KVCache.for_model(model.config, 1, 16, torch.float32, "cpu")
    logits, _ = model(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], cache)
    assert logits.requires_grad and model._host is None  # the native path would leave no graph


def test_the_core_refuses_a_position_past_the_cache():
    layer = _core.HostQwen3Layer(1, 1, 1, 1, ["float32"] * 4, 1, 1, 1, 1)
    h, pos = torch.zeros(1, 8), torch.tensor([[4]])
    cos = sin = torch.zeros(1, 2)
    kv = torch.zeros(1, 1, 4, 2)
    with pytest.raises(ValueError, match=r"positions\[0, 0\] = 4, expected 0..3"):
        layer.forward(8, 1, 1, 2, 4, 1e-6, h.data_ptr(), 1, 1, pos.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                      kv.data_ptr(), kv.data_ptr(), 8, 8, 4)
    with pytest.raises(ValueError, match="head_dim 3"):
        layer.forward(8, 1, 1, 3, 4, 1e-6, h.data_ptr(), 1, 1, pos.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                      kv.data_ptr(), kv.data_ptr(), 8, 8, 4)


@pytest.mark.parametrize("layer_ids", [[2, 0], [1, 1, 2], [0], []])
def test_the_layers_run_in_one_core_call_and_capture_any_features(monkeypatch, layer_ids):
    """One HostQwen3Stack call per forward writes the captured layers' outputs into the features, in the order
    asked, a layer listed twice in both places, the last one after the final norm: as the torch path."""
    model = _model(bf16_weights=False)
    calls = []
    forward = _core.HostQwen3Layer.forward
    monkeypatch.setattr(_core.HostQwen3Layer, "forward", lambda *a: calls.append(1) or forward(*a), raising=False)
    prompt, block = torch.tensor([[5, 17, 3, 88]]), torch.tensor([[4, 8, 15]])
    out = {}
    for native in (True, False):
        if not native:
            monkeypatch.setattr(host_qwen3, "usable", lambda *a: False)
        target = Target(model, 1, 64, layer_ids)
        with torch.no_grad():
            target.start(prompt.tolist())
            out[native] = target.verify(block)
    assert calls == []  # no per-layer calls from Python
    assert model._host._stack is not None
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"capture has 1 entries; expected one per layer \(3\)"):
        _core.HostQwen3Stack([p.core for p in model._host._layers.values()], 0, 0, 1, 1, 1, 1, [0])


def test_the_final_norm_is_the_cores_and_falls_back_to_torch(monkeypatch):
    """A native forward's final norm is one core call (the torch module is not run), within rounding of the torch
    RMSNorm; a weight the core cannot read directly (not float32 or not contiguous) takes the module."""
    from dpara_rt.models.qwen3 import RMSNorm
    model = _model(bf16_weights=False)
    calls = []
    forward = RMSNorm.forward
    monkeypatch.setattr(RMSNorm, "forward", lambda self, x: calls.append(self) or forward(self, x))
    with torch.no_grad():
        target = Target(model, 1, 64)
        target.start([[5, 17, 3]])
        calls.clear()
        target.verify(torch.tensor([[4, 8]]))
    assert model.norm not in calls
    h = torch.randn(2, 3, 48)
    with torch.no_grad():
        native = host_qwen3.HostQwen3().norm(model.norm, h)
        torch.testing.assert_close(native, forward(model.norm, h), rtol=1e-6, atol=1e-6)
        strided = RMSNorm(96, model.norm.eps)
        strided.weight = torch.nn.Parameter(torch.rand(96)[::2])
        calls.clear()
        host_qwen3.HostQwen3().norm(strided, h)
    assert calls == [strided]
    with pytest.raises(ValueError, match=r"host_rms_norm: rows 1, n 0, eps 1e-06; expected rows >= 0, n >= 1"):
        _core.host_rms_norm(h.data_ptr(), h.data_ptr(), 1, 0, 1e-6, h.data_ptr())


def test_the_rope_table_gives_rope_cos_sin_bit_for_bit():
    """RopeTable gathers what rope_cos_sin computes per position: the same bits, grown on demand, rebuilt for other
    frequencies or dtypes; negative or non-integer positions are computed directly."""
    from dpara_rt.models.qwen3 import RopeTable, rope_cos_sin, rope_inv_freq
    table, inv = RopeTable(), rope_inv_freq(16, 10000.0)
    for positions in (torch.tensor([[0, 5, 3]]), torch.tensor([[300, 301], [7, 1000]]), torch.arange(12)[None]):
        for got, want in zip(table(positions, inv, torch.float32), rope_cos_sin(positions, inv, torch.float32)):
            assert got.shape == want.shape and torch.equal(got, want)
    assert len(table._cos) >= 1001
    other = rope_inv_freq(16, 500.0)
    for inv_freq, dtype in ((other, torch.float32), (other, torch.bfloat16)):
        got, want = table(torch.tensor([[2, 9]]), inv_freq, dtype), rope_cos_sin(torch.tensor([[2, 9]]), inv_freq, dtype)
        assert all(g.dtype == dtype and torch.equal(g, w) for g, w in zip(got, want))
    for positions in (torch.tensor([[-1, 4]]), torch.tensor([[1.0, 2.0]])):
        got, want = table(positions, inv, torch.float32), rope_cos_sin(positions, inv, torch.float32)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
