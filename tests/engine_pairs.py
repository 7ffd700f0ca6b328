"""Target + drafter pairs for engine tests, built in seconds without training.

A random drafter almost never gets a token accepted, which would leave the acceptance paths untested.
Here the target is made nearly a bigram model (its layers' output projections are shrunk, so the next token
depends mostly on the current one), and the drafter's Markov head is set to that bigram table. Drafts are
then accepted often but not always, so rounds see every acceptance length.
"""
from __future__ import annotations

import copy

import torch

from dpara_rt.models.drafter import Drafter, DrafterConfig
from dpara_rt.models.qwen3 import Qwen3Config, Qwen3ForCausalLM


def predictable_pair(vocab: int = 64, hidden: int = 64, layers: int = 4, inter: int = 128,
                     drafter_layers: int = 1, shrink: float = 0.03, markov_scale: float = 6.0,
                     seed: int = 0, eos: int = 2) -> tuple[Qwen3ForCausalLM, Drafter]:
    cfg = Qwen3Config.from_dict(dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                     num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=hidden // 4, rms_norm_eps=1e-6, rope_theta=10000.0,
                                     max_position_embeddings=4096, tie_word_embeddings=False,
                                     eos_token_id=[eos]))
    g = torch.Generator().manual_seed(seed)
    target = Qwen3ForCausalLM(cfg)
    target.init_weights(std=0.1, generator=g)
    with torch.no_grad():
        for layer in target.layers:
            layer.self_attn.o_proj.weight.mul_(shrink)
            layer.mlp.down_proj.weight.mul_(shrink)
    target.eval().requires_grad_(False)

    dcfg = DrafterConfig.for_target(cfg, num_layers=drafter_layers, num_feature_layers=2, block_size=8,
                                    markov_rank=vocab)
    drafter = Drafter(dcfg, target.embed_tokens, target.lm_head)
    torch.manual_seed(seed + 1)
    drafter.reset_parameters()
    with torch.no_grad():
        # Bigram table: the target's logits after a lone token x, standardised per row.
        ids = torch.arange(vocab)[:, None]
        logits, _ = target(ids, torch.zeros_like(ids))
        big = logits[:, 0]
        big = (big - big.mean(-1, keepdim=True)) / big.std(-1, keepdim=True)
        drafter.w1.copy_(big * markov_scale)
        drafter.w2.copy_(torch.eye(vocab))
    drafter.eval().requires_grad_(False)
    return target, drafter


class FlakyDrafter(Drafter):
    """A drafter whose boundary forward raises on its `fail_at`-th call and works otherwise. Each copy counts its
    own calls, so the failure happens wherever the forwards run, a drafter worker process included."""
    fail_at = 0

    def boundary_logits(self, *args, **kwargs):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected backbone failure")
        return super().boundary_logits(*args, **kwargs)


def _recast(drafter: Drafter, cls: type, **attrs) -> Drafter:
    """`drafter`'s weights (shared, not copied) in a subclass `cls`, with these attributes."""
    out = copy.copy(drafter)
    out.__class__ = cls
    for name, value in attrs.items():
        setattr(out, name, value)
    return out


def flaky(drafter: Drafter, fail_at: int) -> FlakyDrafter:
    """`drafter`'s weights (shared, not copied) in a FlakyDrafter."""
    return _recast(drafter, FlakyDrafter, fail_at=fail_at)


class MathCheckedDrafter(Drafter):
    """A drafter whose boundary forward raises unless its projections and its output head have host math
    `math`: wherever it runs (a drafter worker process included), a lost setting fails the decode."""
    math = "float32"

    def boundary_logits(self, *args, **kwargs):
        found = {m.host_math for m in self.modules() if hasattr(m, "host_math")} | {self.lm_head.host_math}
        if found != {self.math}:
            raise RuntimeError(f"host math {sorted(found)}, expected {self.math!r}")
        return super().boundary_logits(*args, **kwargs)


def math_checked(drafter: Drafter, math: str) -> MathCheckedDrafter:
    """`drafter`'s weights (shared, not copied) in a MathCheckedDrafter expecting `math`."""
    return _recast(drafter, MathCheckedDrafter, math=math)


def assert_verified_tokens_get_their_decode_logits(model) -> None:
    """A verify of 6 tokens gives each the logits of decoding it alone, bit for bit."""
    from dpara_rt.models.target import Target
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
