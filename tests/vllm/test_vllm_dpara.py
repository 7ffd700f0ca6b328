"""DPara inside vLLM (speculative_config {"method": "dpara"}: dpara_rt.engines.vllm.DParaProposer through the
plugin of dpara_rt.engines.vllm_plugin) on vLLM's CPU build, against vLLM without speculation.

A random Llama target (nearly a bigram model) and a drafter whose Markov head holds its bigram table
(dpara_rt.engines.random_pair), so drafts are often accepted. The DPara engine runs in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the tests can read the proposer's state; the others run as vLLM
does by default (engine core and worker in their own processes: one in-process engine per test process, as
closing one tears down the process's parallel groups, so they run first). Run with the vLLM environment's python:
    ../vllm-env/bin/python -m pytest -q -m vllm tests/vllm
"""
from __future__ import annotations

import gc
import os
import types

import pytest
import torch

pytestmark = pytest.mark.vllm

MAX_NUM_SEQS = 2  # fewer than the prompts: later requests join a running batch, slots are reused
PROMPT_LENS = (5, 9, 40, 14)  # 40 > MAX_BATCHED: that prompt's prefill is chunked
MAX_TOKENS = (64, 24, 48, 64)  # requests leave at different steps
MAX_BATCHED = 32
D = 7


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from dpara_rt.engines.random_pair import write_random_pair

    return write_random_pair(tmp_path_factory.mktemp("vllm_pair"))


def make_llm(target_dir, **kw):
    from vllm import LLM

    return LLM(model=target_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=512,
               max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED, enable_prefix_caching=False,
               disable_log_stats=False, gpu_memory_utilization=0.05, kv_cache_memory_bytes=64 << 20, seed=0, **kw)


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def prompts(vocab: int):
    from vllm.inputs import TokensPrompt

    g = torch.Generator().manual_seed(3)
    return [TokensPrompt(prompt_token_ids=torch.randint(3, vocab, (n,), generator=g).tolist()) for n in PROMPT_LENS]


def greedy(llm, vocab: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False) for n in MAX_TOKENS]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts(vocab), params, use_tqdm=False)]


def spec_metrics(llm) -> dict:
    """vLLM's spec-decode counters (vllm:spec_decode_*) by name, without the prefix."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            value = getattr(m, "value", None)
            out[m.name.removeprefix("vllm:spec_decode_")] = value if value is not None else list(m.values)
    return out


def proposer_of(llm):
    """The DParaProposer inside an in-process LLM's model runner."""
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    return worker.model_runner.drafter


@pytest.fixture(scope="module")
def vocab(pair):
    import json

    with open(os.path.join(pair[0], "config.json")) as f:
        return json.load(f)["vocab_size"]


@pytest.fixture(scope="module")
def reference(pair, vocab):
    """vLLM without speculation: the outputs every speculative run must reproduce."""
    llm = make_llm(pair[0])
    out = greedy(llm, vocab)
    close(llm)
    del llm
    gc.collect()  # now: collected later, it would tear down the parallel groups of the in-process engine
    return out


@pytest.fixture(scope="module")
def dpara(pair):
    monkey = pytest.MonkeyPatch()
    monkey.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read while the engine is built
    # the method by name (dpara_rt's vLLM plugin, found through its entry point)
    llm = make_llm(pair[0], speculative_config={"method": "dpara", "model": pair[1], "num_speculative_tokens": D},
                   additional_config={"dpara_max_requests": MAX_NUM_SEQS})
    monkey.undo()
    yield llm
    close(llm)


# vLLM's own engines (other processes) run before the in-process DPara engine is built: closing them
# tears down this process's parallel groups.
def test_ngram_baseline_equals_vllm_without_speculation(pair, reference, vocab):
    llm = make_llm(pair[0], speculative_config={"method": "ngram", "num_speculative_tokens": D,
                                                "prompt_lookup_max": 3, "prompt_lookup_min": 2})
    try:
        assert greedy(llm, vocab) == reference
        print("ngram spec-decode metrics:", spec_metrics(llm))
    finally:
        close(llm)


def test_dflash_baseline_from_an_exported_drafter(pair, reference, vocab, tmp_path_factory):
    """vLLM's own dflash method on a dpara_rt drafter exported as a DFlash checkpoint (export_dflash): it loads,
    drafts every step, and stays lossless (a random drafter: its drafts are rarely accepted)."""
    from dpara_rt.engines.random_pair import write_random_dflash

    dflash = write_random_dflash(tmp_path_factory.mktemp("vllm_dflash"))
    llm = make_llm(pair[0], speculative_config={"method": "dflash", "model": dflash, "num_speculative_tokens": D})
    try:
        assert greedy(llm, vocab) == reference
        metrics = spec_metrics(llm)
        print("dflash spec-decode metrics:", metrics)
        assert metrics["num_drafts"] > 0 and metrics["num_draft_tokens"] == D * metrics["num_drafts"]
    finally:
        close(llm)


def test_dpara_greedy_equals_vllm_without_speculation(reference, dpara, vocab):
    from dpara_rt.engines.vllm import DParaProposer

    got = greedy(dpara, vocab)
    assert got == reference
    prop = proposer_of(dpara)
    assert isinstance(prop, DParaProposer) and prop.speculator.mode == "dpara"
    m = spec_metrics(dpara)
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] == D * m["num_drafts"]
    vllm_tau = 1 + m["num_accepted_tokens"] / m["num_drafts"]
    print(f"vLLM spec-decode metrics: {m}; tau (vLLM) {vllm_tau:.3f}, tau (speculator) {prop.speculator.tau:.3f}")
    assert vllm_tau > 1.5, m
    # every verify vLLM counted was committed to the speculator with the same accepted length
    assert prop.counts["commits"] == m["num_drafts"]
    assert prop.speculator.tau == pytest.approx(vllm_tau)
    c = prop.counts
    assert c["added"] == len(PROMPT_LENS) and not any(k.startswith("draftless") for k in c), dict(c)


def test_backbone_runs_on_the_lane_beside_the_target_forward(dpara, vocab):
    greedy(dpara, vocab)  # the module's runs so far and this one
    prop = proposer_of(dpara)
    spec = prop.speculator
    backbone = [j for j in spec.jobs if j.phase == "backbone"]
    assert backbone and {j.thread_id for j in backbone} == {spec.lane_thread_id}
    assert prop.caller_thread_id not in (None, spec.lane_thread_id)  # vLLM's worker thread is another
    assert {j.phase for j in spec.jobs} >= {"backbone", "markov_head", "serial_draft", "context"}
    o = prop.stats()["overlap"]
    print("overlap:", o, f"in forward {o['backbone_in_forward_ns'] / o['backbone_ns']:.1%}, "
          f"waited for in propose {o['backbone_in_propose_ns'] / o['backbone_ns']:.1%}")
    assert o["backbones"] == len(backbone)
    # the lane's backbone spans intersect vLLM's target forwards (timeline events vs the forward hooks)
    assert o["backbones_in_forward"] > 0 and o["backbone_in_forward_ns"] > 0


def test_prompt_features_match_transformers_hidden_states(dpara, pair):
    """The forward hooks' features of a prompt equal transformers' hidden_states[i + 1] of the feature layers
    (the last layer's after the final norm), and a one-token request leaves the speculator clean."""
    from transformers import LlamaForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = list(range(10, 27))
    dpara.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, detokenize=False),
                   use_tqdm=False)
    prop = proposer_of(dpara)
    got = prop.tap.rows(0, len(ids)).float()
    hf = LlamaForCausalLM.from_pretrained(pair[0], dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[i + 1][0] for i in prop.tap.layer_ids], -1)
    assert prop.tap.layer_ids[-1] == hf.config.num_hidden_layers - 1  # the normed last layer is covered
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_sampled_requests_run(dpara, vocab):
    """Temperature > 0: the drafts stay greedy proposals (no draft probabilities), which vLLM's rejection sampler
    verifies against the target's sampling law."""
    from vllm import SamplingParams

    prop = proposer_of(dpara)
    commits = prop.counts["commits"]
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True, detokenize=False)
    outs = [list(o.outputs[0].token_ids) for o in dpara.generate(prompts(vocab)[:2], [params, params],
                                                                  use_tqdm=False)]
    assert all(len(o) == 24 and all(0 <= t < vocab for t in o) for o in outs)
    assert prop.counts["commits"] > commits and not any(k.startswith("draftless") for k in prop.counts)


def test_version_and_options_are_checked():
    from dpara_rt.engines.vllm import DParaProposer, check_vllm_version

    import vllm
    assert check_vllm_version() == vllm.__version__
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.x; the installed vLLM is 0\.31\.2"):
        check_vllm_version("0.31.2")
    cfg = types.SimpleNamespace(speculative_config=types.SimpleNamespace(num_speculative_tokens=D),
                                additional_config={})
    with pytest.raises(ValueError, match="no 'dpara_drafter'"):
        DParaProposer(cfg)
    cfg.additional_config = {"dpara_drafter": "x", "dpara_moed": "dpara"}
    with pytest.raises(ValueError, match=r"unknown additional_config keys \['dpara_moed'\]"):
        DParaProposer(cfg)


def test_the_method_name_is_vllms_custom_proposer_through_the_entry_point():
    from importlib.metadata import entry_points

    from dpara_rt.engines import vllm_plugin
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "dpara"]
    assert ep.value == "dpara_rt.engines.vllm_plugin:register"
    assert getattr(EngineArgs.create_speculative_config, "dpara_method", False)  # vLLM ran the plugin
    args = types.SimpleNamespace(speculative_config=None, additional_config={"dpara_cores": [1]}, spec_method="dpara",
                                 spec_model="/drafter")
    vllm_plugin.translate(args)
    assert args.speculative_config == {"method": "custom_class", "model": vllm_plugin.PROPOSER}
    assert args.additional_config == {"dpara_cores": [1], "dpara_drafter": "/drafter"}
    assert args.spec_method is None and args.spec_model is None
    other = {"method": "ngram", "num_speculative_tokens": 3}
    args = types.SimpleNamespace(speculative_config=dict(other), additional_config={}, spec_method=None,
                                 spec_model=None)
    vllm_plugin.translate(args)
    assert args.speculative_config == other and args.additional_config == {}
    for spec, extra, words in (({"method": "dpara"}, {}, "names no drafter"),
                               ({"method": "dpara", "model": "/a"}, {"dpara_drafter": "/b"}, "named twice")):
        with pytest.raises(ValueError, match=words):
            vllm_plugin.translate(types.SimpleNamespace(speculative_config=spec, additional_config=extra,
                                                        spec_method=None, spec_model=None))
