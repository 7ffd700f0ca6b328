"""A random Llama target and a drafter for it that reaches tau > 1, written as directories an engine loads.

The target's attention and MLP outputs are scaled down, so its next token depends mostly on the current one
(nearly a bigram model); the drafter's Markov head holds that bigram table (logits after a lone token), so its
drafts are often accepted, whatever its random backbone does. For tests and benchmarks of engine adapters:
    target_dir, drafter_dir = write_random_pair(root)
``write_random_dflash`` adds a random DFlash drafter for the same target, exported as a DFlashDraftModel
checkpoint for engines' own ``dflash`` method (a baseline: it drafts badly, and stays lossless).
"""
from __future__ import annotations

import os

import torch

from dpara_rt.models.drafter import Drafter, DrafterConfig
from dpara_rt.models.drafter_io import save_drafter

# head_dim 64: vLLM's CPU attention kernels take 32, 64, 80, 96, 112, 128, ... (not 16)
TARGET = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, initializer_range=0.1,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def build_target(seed: int = 0, **overrides):
    """A random transformers LlamaForCausalLM (fp32, eval), nearly a bigram model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig(**{**TARGET, **overrides})).eval().requires_grad_(False)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.003)
            layer.mlp.down_proj.weight.mul_(0.003)
    return hf


def _drafter_config(hf, layer_ids, num_layers: int, block_size: int, **kw) -> DrafterConfig:
    """A drafter config shaped like one of ``hf``'s decoder layers."""
    c = hf.config
    return DrafterConfig(layer_ids=list(layer_ids), target_hidden_size=c.hidden_size, hidden_size=c.hidden_size,
                         num_layers=num_layers, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                         intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps, rope_theta=10000.0,
                         vocab_size=c.vocab_size, block_size=block_size, **kw)


def bigram_drafter(hf, layer_ids=(1, 5), num_layers: int = 1, block_size: int = 8, seed: int = 1) -> Drafter:
    """A drafter for ``hf`` whose Markov head is hf's bigram table; ``layer_ids`` name its feature layers (the
    default includes the last one, whose feature is taken after the final norm)."""
    dcfg = _drafter_config(hf, layer_ids, num_layers, block_size, markov_rank=hf.config.vocab_size)
    drafter = Drafter(dcfg, hf.model.embed_tokens, hf.lm_head)
    torch.manual_seed(seed)
    drafter.reset_parameters()
    return hold_bigram_table(drafter, hf).eval().requires_grad_(False)


@torch.no_grad()
def hold_bigram_table(drafter: Drafter, hf) -> Drafter:
    """Set the drafter's Markov head to the bigram table of ``hf`` (a transformers causal LM): W1 holds hf's logits
    after each lone token, standardised and scaled by 6, W2 the identity (markov_rank must equal the vocabulary)."""
    v, rank = drafter.config.vocab_size, drafter.config.markov_rank
    if rank != v:
        raise ValueError(f"markov_rank={rank}: a bigram table needs markov_rank = vocab_size = {v}")
    big = hf(input_ids=torch.arange(v)[:, None]).logits[:, 0].float()
    big = (big - big.mean(-1, keepdim=True)) / big.std(-1, keepdim=True)
    drafter.w1.copy_(big * 6.0)
    drafter.w2.copy_(torch.eye(v))
    return drafter


def write_random_pair(root: str | os.PathLike, seed: int = 0, drafter_layers: int = 1,
                      **target_overrides) -> tuple[str, str]:
    """Write the target (transformers' save_pretrained) to root/target and its drafter to root/drafter; returns
    both paths. Prompts are token ids: the target has no tokenizer (vLLM: skip_tokenizer_init=True)."""
    target_dir, drafter_dir = os.path.join(root, "target"), os.path.join(root, "drafter")
    hf = build_target(seed, **target_overrides)
    hf.save_pretrained(target_dir)
    save_drafter(bigram_drafter(hf, num_layers=drafter_layers), drafter_dir)
    return target_dir, drafter_dir


def write_random_dflash(root: str | os.PathLike, seed: int = 0, block_size: int = 8, **target_overrides) -> str:
    """A random DFlash-convention drafter (mask rows embedded as token 0, no Markov head) for the target
    ``write_random_pair(root, seed, **target_overrides)`` writes, saved to root/dflash_drafter and exported as a
    DFlash checkpoint to root/dflash; returns the DFlash directory."""
    from dpara_rt.models.convert import export_dflash

    hf = build_target(seed, **target_overrides)
    dcfg = _drafter_config(hf, [1, 4], 1, block_size, markov_rank=0, draft_rows="mask", mask_token_id=0)
    drafter = Drafter(dcfg, hf.model.embed_tokens, hf.lm_head)
    torch.manual_seed(seed + 2)
    drafter.reset_parameters()
    ours, dflash = os.path.join(root, "dflash_drafter"), os.path.join(root, "dflash")
    save_drafter(drafter, ours)
    export_dflash(ours, dflash, num_target_layers=hf.config.num_hidden_layers)
    return dflash
