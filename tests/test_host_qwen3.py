"""The native host layers of a float32 Qwen3 target (models/host_qwen3.py) against the torch path."""
import pytest
import torch

from dpara_rt import _core
from dpara_rt.models import host_qwen3
from dpara_rt.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from dpara_rt.models.target import Target


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
    block = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.no_grad():
        together = Target(model, 1, 64)
        together.start([[5, 17, 3]])
        all_logits, _ = together.verify(block)
        alone = Target(model, 1, 64)
        alone.start([[5, 17, 3]])
        for j in range(block.shape[1]):
            step, _ = alone.verify(block[:, j:j + 1])
            alone.commit(torch.tensor([1]))
            assert torch.equal(step[0, 0], all_logits[0, j]), j


def test_repacks_when_a_weight_changes(monkeypatch):
    model = _model(bf16_weights=True)
    before = _decode(model, monkeypatch, native=True)[2]
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight.mul_(0.5)
    after = _decode(model, monkeypatch, native=True)[2]
    reference = _decode(model, monkeypatch, native=False)[2]
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, reference, rtol=1e-5, atol=1e-5)


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
    from dpara_rt.models.host_linear import native_target
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
