"""Autoregressive baseline and token sampling."""
import pytest
import torch

from dpara_rt.models.autoregressive import ARDecoder, generate_ar
from dpara_rt.models.target import Target
from dpara_rt.sampling import inverse_cdf, make_generator, probs, sample, top_p_filter


def test_greedy_ar_equals_transformers_generate(tiny_target, tiny_hf_target, tiny_prompts):
    n_new = 20
    target = Target(tiny_target, 1, 64)
    for p in tiny_prompts:
        ours = generate_ar(target, [p], n_new)[0]
        with torch.no_grad():
            ref = tiny_hf_target.generate(torch.tensor([p]), max_new_tokens=n_new, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)
        assert ours == ref[0, len(p):].tolist()


def test_batched_ar_equals_each_alone_and_stops_at_eos(tiny_target, tiny_prompts):
    target = Target(tiny_target, 16, 64)
    alone = [generate_ar(target, [p], 12)[0] for p in tiny_prompts]
    prompts = tiny_prompts * 5 + tiny_prompts[:1]  # 16 requests
    assert generate_ar(target, prompts, 12) == [alone[i % 3] for i in range(16)]
    # Make the 5th token of request 0 an EOS: request 0 stops there (EOS included), the others run on.
    eos = alone[0][4]
    out = generate_ar(target, tiny_prompts, 12, eos_ids=[eos])
    assert out[0] == alone[0][: alone[0].index(eos) + 1]
    for o, a in zip(out[1:], alone[1:]):
        assert o == (a[: a.index(eos) + 1] if eos in a else a)


def test_ar_decoder_rounds(tiny_target, tiny_prompts):
    target = Target(tiny_target, 3, 64)
    dec = ARDecoder(target, max_new_tokens=5)
    first = dec.start(tiny_prompts)
    assert first.shape == (3,) and dec.rounds == 0
    while not dec.done:
        dec.step()
    assert dec.rounds == 4 and all(len(o) == 5 for o in dec.outputs)
    # Each committed token went into the cache; the last new token is never fed back.
    assert target.lengths.tolist() == [len(p) + 4 for p in tiny_prompts]
    with pytest.raises(RuntimeError, match="finished"):
        dec.step()


def test_sampling_repeats_with_a_seed(tiny_target, tiny_prompts):
    target = Target(tiny_target, 3, 64)
    kw = dict(max_new_tokens=16, temperature=0.9, top_p=0.95)
    a = generate_ar(target, tiny_prompts, seed=7, **kw)
    assert a == generate_ar(target, tiny_prompts, seed=7, **kw)
    assert a != generate_ar(target, tiny_prompts, seed=8, **kw)
    assert a != generate_ar(target, tiny_prompts, max_new_tokens=16)  # not greedy in disguise


def test_sample_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0, 1.5]]).repeat(40000, 1)
    g = make_generator(0)
    draws = sample(logits, temperature=1.3, generator=g)
    freq = torch.bincount(draws, minlength=6).float() / len(draws)
    expect = torch.softmax(logits[0] / 1.3, -1)
    assert (freq - expect).abs().max() < 0.01
    nucleus = sample(logits, temperature=1.0, top_p=0.6, generator=g)
    p = probs(logits[:1], 1.0, 0.6)[0]
    assert set(nucleus.unique().tolist()) == set(p.nonzero().flatten().tolist()) == {0, 5}
    assert torch.equal(sample(logits[:3], temperature=0.0), torch.zeros(3, dtype=torch.long))


def test_top_p_keeps_the_smallest_nucleus():
    p = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    torch.testing.assert_close(top_p_filter(p, 0.8), torch.tensor([[0.0, 0.625, 0.0, 0.375]]))
    assert (top_p_filter(p, 0.81) > 0).sum() == 3
    assert (top_p_filter(p, 0.01) > 0).sum() == 1
    assert torch.equal(probs(torch.tensor([[0.1, 3.0, -2.0]]), 0.0), torch.tensor([[0.0, 1.0, 0.0]]))


def test_inverse_cdf_never_picks_zero_mass():
    p = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(4, 1)
    u = torch.tensor([0.0, 0.49, 0.5, 1.0 - 1e-7])
    assert inverse_cdf(p, u).tolist() == [1, 1, 3, 3]
    assert inverse_cdf(p, torch.ones(4)).tolist() == [3, 3, 3, 3]  # u on the total still lands on mass


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3, [0.5, 1.0, 2.0]])
def test_untruncated_probs_have_the_general_paths_bits(temperature):
    """Every row sampled, no top-k or top-p: probs takes a plain softmax of logits / t, bit for bit what the
    general path (temperature per row with greedy rows masked, then the filters) computes; a top-k that keeps
    everything (k >= V) is the same."""
    g = torch.Generator().manual_seed(5)
    for shape in [(3, 8192), (3, 8, 64)]:
        logits = torch.randn(*shape, generator=g) * 4
        t = torch.as_tensor(temperature, dtype=torch.float32)
        t = t.view(-1, *([1] * (logits.dim() - 1))) if t.dim() else t
        general = torch.softmax(logits / torch.where(t == 0, 1.0, t), dim=-1)
        assert torch.equal(probs(logits, temperature), general)
        assert torch.equal(probs(logits, temperature, 1.0, shape[-1]), general)
        assert not torch.equal(probs(logits, temperature, 1.0, 2), general)  # a real top-k still truncates
