"""Shared fixtures: tiny random Qwen3 checkpoints written by transformers and loaded with our loader.

Session-scoped and read-only: do not train or modify `tiny_target` / `tiny_hf_target` in place; build a
fresh model with `make_tiny_target_dir` + `load_qwen3` when a test needs to change weights.
transformers is imported lazily so that tests not using these fixtures do not pay for it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

# The repository root holds the `kernels/` folder (installed as dpara_rt.kernels). `python -m pytest` puts the root
# on sys.path, where that folder would shadow the `kernels` distribution that transformers (>= 5.25) imports.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# tests/vllm runs with vLLM's own environment (docs/engines.md: python -m pytest -q -m vllm tests/vllm); elsewhere
# it is not collected. With tests/ on sys.path that folder is itself a namespace package named "vllm": only a
# regular package (one with an origin) is vLLM.
_vllm = importlib.util.find_spec("vllm")
if _vllm is None or _vllm.origin is None:
    collect_ignore = ["vllm"]

# Before any test module is collected: some import triton (transformers models, the dflash reference), and the
# Triton kernels can only run in the interpreter if it was asked for before triton's first import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Small but complete: GQA (4 query heads on 2 KV heads), untied embeddings, 4 layers. A wide init
# (initializer_range 0.1) spreads the logits so greedy decoding has clear winners.
TINY_QWEN3 = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                  tie_word_embeddings=False, max_position_embeddings=512, initializer_range=0.1,
                  eos_token_id=[2], seed=0)


def build_hf_qwen3(**overrides):
    """A random transformers Qwen3ForCausalLM (fp32, eval) from TINY_QWEN3 with `overrides`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kwargs = {**TINY_QWEN3, **overrides}
    seed = kwargs.pop("seed")
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**kwargs)).eval()


@pytest.fixture
def torch_path(monkeypatch):
    """The torch references on CPU tensors, the native target off: the code a device runs."""
    from dpara_rt.host.linear import native_target

    monkeypatch.setenv("DPARA_RT_OPS", "torch")
    before = native_target(False)
    yield
    native_target(before)


@pytest.fixture(scope="session")
def saved_models(tmp_path_factory):
    """Factory: saved_models(key, build) -> (Path, model): `build()` runs once per key and its transformers model
    is written with save_pretrained."""
    built = {}

    def get(key: str, build):
        if key not in built:
            path = tmp_path_factory.mktemp(key)
            model = build()
            model.save_pretrained(path)
            built[key] = path, model
        return built[key]

    return get


@pytest.fixture(scope="session")
def make_tiny_target_dir(tmp_path_factory):
    """Factory: make_tiny_target_dir(name="tiny", max_shard_size=None, **overrides) -> Path of a saved HF dir.
    Same name, same directory (built once per session)."""
    built = {}

    def make(name: str = "tiny", max_shard_size: str | None = None, **overrides):
        if name not in built:
            path = tmp_path_factory.mktemp(f"qwen3_{name}")
            hf = build_hf_qwen3(**overrides)
            kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
            hf.save_pretrained(path, **kw)
            built[name] = path
        return built[name]

    return make


@pytest.fixture(scope="session")
def tiny_target_dir(make_tiny_target_dir):
    return make_tiny_target_dir()


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    """Our Qwen3ForCausalLM (fp32, cpu) loaded from `tiny_target_dir`."""
    from dpara_rt.models.loader import load_qwen3

    return load_qwen3(tiny_target_dir)


@pytest.fixture(scope="session")
def tiny_hf_target(tiny_target_dir):
    """The transformers reference model for `tiny_target_dir`."""
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_layer_ids():
    """Captured layers for drafter features on the tiny target (F = 2 * hidden)."""
    return [1, 2]


@pytest.fixture
def tiny_prompts():
    """Three ragged prompts of token ids for the tiny vocabulary (none contains the EOS id 2)."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(3, 512, (n,), generator=g)).tolist() for n in (5, 11, 2)]
