"""The step-level speculator driven by a plain transformers host loop (docs/speculator.md).

The host owns a transformers Qwen3ForCausalLM and one DynamicCache per request: it prefills with
output_hidden_states, hands the prompt's features to the speculator, verifies [bonus, draft] blocks itself,
accepts greedily, crops its cache on rollback and commits (r, bonus, features) back. The output must equal
transformers' own greedy ``generate``.
"""
from __future__ import annotations

import threading

import pytest
import torch
from dpara_rt import ops
from dpara_rt.models.drafter import Drafter, DrafterConfig
from dpara_rt.sampling import make_generator, probs, uniforms
from dpara_rt.serving.speculator import Proposal, Speculator

LAYER_IDS = [1, 2]
EOS = 2


def _drafter_for(hf, markov_rank: int, block_size: int = 8) -> Drafter:
    c = hf.config
    dcfg = DrafterConfig(layer_ids=list(LAYER_IDS), target_hidden_size=c.hidden_size, hidden_size=c.hidden_size,
                         num_layers=1, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                         intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps, rope_theta=10000.0,
                         vocab_size=c.vocab_size, block_size=block_size, markov_rank=markov_rank)
    return Drafter(dcfg, hf.model.embed_tokens, hf.lm_head)


@pytest.fixture(scope="module")
def hf_pair():
    """A transformers target that is nearly a bigram model and a drafter whose Markov head is that bigram
    table (the trick of tests/engine_pairs.py, on a transformers model): drafts are often accepted."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    vocab = 64
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                      tie_word_embeddings=False, max_position_embeddings=512, initializer_range=0.1,
                      eos_token_id=[EOS])
    hf = Qwen3ForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.03)
            layer.mlp.down_proj.weight.mul_(0.03)
    torch.manual_seed(1)
    drafter = _drafter_for(hf, markov_rank=vocab)
    with torch.no_grad():
        ids = torch.arange(vocab)[:, None]
        big = hf(input_ids=ids).logits[:, 0].float()
        big = (big - big.mean(-1, keepdim=True)) / big.std(-1, keepdim=True)
        drafter.w1.copy_(big * 6.0)
        drafter.w2.copy_(torch.eye(vocab))
    return hf, drafter.eval().requires_grad_(False)


def _prompts(vocab: int, lens=(5, 9, 3), seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def hf_greedy(hf, prompt: list[int], max_new: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, eos_token_id=EOS,
                      pad_token_id=EOS)
    return out[0, len(prompt):].tolist()


# ---------------------------------------------------------------------------------------------- the host
class HostRequest:
    """The host's own state for one request: its transformers cache and what it generated."""

    def __init__(self, rid, prompt, max_new):
        self.id, self.prompt, self.max_new = rid, prompt, max_new
        self.cache = None
        self.out: list[int] = []
        self.bonus = -1
        self.done = False

    def emit(self, tokens: list[int]) -> None:
        for t in tokens:
            if self.done:
                return
            self.out.append(t)
            if t == EOS or len(self.out) >= self.max_new:
                self.done = True


def _cache_kw(hf) -> str:
    """The forward's cache argument: `cache` in recent transformers, `past_key_values` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(type(hf).forward).parameters else "past_key_values"


def _features(hidden_states, rows=slice(None)) -> torch.Tensor:
    """The drafter's features: transformers' hidden_states[i + 1] of each feature layer i, concatenated."""
    return torch.cat([hidden_states[i + 1][0, rows] for i in LAYER_IDS], dim=-1)


@torch.no_grad()
def host_prefill(hf, req: HostRequest, spec: Speculator) -> None:
    from transformers import DynamicCache

    req.cache = DynamicCache(config=hf.config)
    out = hf(input_ids=torch.tensor([req.prompt]), **{_cache_kw(hf): req.cache}, use_cache=True,
             output_hidden_states=True)
    req.bonus = int(out.logits[0, -1].argmax())
    req.emit([req.bonus])
    spec.add_request(req.id, _features(out.hidden_states), req.bonus)  # [T, F], the first bonus


@torch.no_grad()
def host_verify(hf, req: HostRequest, draft: list[int], d: int, q=None, gen=None, temperature=0.0):
    """The host's own verify of [bonus, draft]: greedy (or lossless with q) acceptance, cache rollback.
    Returns (r, new bonus, features [d+1, F])."""
    block = torch.tensor([[req.bonus] + draft])
    out = hf(input_ids=block, **{_cache_kw(hf): req.cache}, use_cache=True, output_hidden_states=True)
    logits = out.logits[0].float()
    if q is None:
        best = logits.argmax(-1).tolist()
        r = 0
        while r < d and draft[r] == best[r]:
            r += 1
        bonus = best[r]
    else:  # lossless: dpara_rt's verification helpers with the speculator's q
        p = probs(logits[None], temperature)
        r_t, b_t = ops.verify_sample(p, q[None].float(), torch.tensor([draft]), uniforms(gen, 1, d), uniforms(gen, 1))
        r, bonus = int(r_t[0]), int(b_t[0])
    if r < d:
        req.cache.crop(-(d - r))  # keep the KV of s_0..s_r
    req.emit(draft[:r] + [bonus])
    req.bonus = bonus
    return r, bonus, _features(out.hidden_states)


def run_host(hf, spec: Speculator, prompts, max_new, joins=None, leave_early=None, remove_after_commit=False,
             temperature=0.0, seed=0):
    """Decode `prompts` with the host loop. joins: {prompt index: host step at which it arrives} (default 0);
    leave_early: {prompt index: max_new for it} (it leaves the batch sooner). Returns outputs per prompt."""
    joins = joins or {}
    leave_early = leave_early or {}
    reqs = [HostRequest(f"req{i}", p, leave_early.get(i, max_new)) for i, p in enumerate(prompts)]
    gen = make_generator(seed)
    d, step = spec.d, 0
    running: list[HostRequest] = []
    while True:
        for i, req in enumerate(reqs):
            if joins.get(i, 0) == step and req.cache is None:
                host_prefill(hf, req, spec)
                if req.done:
                    spec.remove_request(req.id)
                else:
                    running.append(req)
        if not running and all(r.cache is not None for r in reqs):
            break
        step += 1
        if not running:
            continue
        ids = [r.id for r in running]
        proposal = spec.propose(ids)
        assert isinstance(proposal, Proposal) and proposal.tokens.shape == (len(ids), d)
        assert (proposal.q is None) == (temperature == 0)
        rs, bonuses, feats = [], [], []
        for b, req in enumerate(running):
            q = None if proposal.q is None else proposal.q[b]
            r, bonus, f = host_verify(hf, req, proposal.tokens[b].tolist(), d, q, gen, temperature)
            rs.append(r), bonuses.append(bonus), feats.append(f)
        finished = [req for req in running if req.done]
        if not remove_after_commit:  # a finished request leaves before the commit, which then omits it
            for req in finished:
                spec.remove_request(req.id)
        keep = [b for b, req in enumerate(running) if remove_after_commit or not req.done]
        if keep:
            spec.commit([running[b].id for b in keep], torch.tensor([rs[b] for b in keep]),
                        torch.tensor([bonuses[b] for b in keep]), torch.stack([feats[b] for b in keep]))
        if remove_after_commit:
            for req in finished:
                spec.remove_request(req.id)
        running = [req for req in running if not req.done]
    return [r.out for r in reqs]


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("mode", ["dpara", "dspark"])
def test_batch1_equals_transformers_greedy(hf_pair, mode):
    hf, drafter = hf_pair
    spec = Speculator(drafter, d=4, mode=mode, max_requests=2, max_len=256, threads=1)
    prompts = _prompts(hf.config.vocab_size)
    for prompt in prompts:
        got = run_host(hf, spec, [prompt], max_new=40)[0]
        assert got == hf_greedy(hf, prompt, 40)
    assert spec.tau > 1.5, spec.tau  # the bigram drafter's drafts are accepted often
    phases = {job.phase for job in spec.jobs}
    if mode == "dpara":
        assert {"backbone", "markov_head", "serial_draft", "context"} <= phases
    else:
        assert "backbone" not in phases and "markov_head" not in phases
    assert spec.requests == []


def test_dpara_backbone_runs_on_the_speculator_lane(hf_pair):
    hf, drafter = hf_pair
    spec = Speculator(drafter, d=4, mode="dpara", max_requests=1, max_len=256, threads=1)
    run_host(hf, spec, _prompts(hf.config.vocab_size, lens=(6,)), max_new=24)
    backbone = [job for job in spec.jobs if job.phase == "backbone"]
    assert backbone, "no backbone ran"
    assert spec.lane_thread_id != threading.get_ident()
    assert {job.thread_id for job in spec.jobs} == {spec.lane_thread_id}
    assert {job.lane for job in backbone} == {"speculator"}
    # the core's timeline holds the same spans, on the lane
    assert {(e["phase"], e["lane"]) for e in spec.metrics.events() if e["phase"] == "backbone"} \
        == {("backbone", "speculator")}
    # one serial draft (round 1) per request: every later draft came from the ring through the Markov head
    assert [job.phase for job in spec.jobs].count("serial_draft") == 1


@pytest.mark.parametrize("mode", ["dpara", "dspark"])
@pytest.mark.parametrize("remove_after_commit", [False, True])
def test_requests_join_and_leave(hf_pair, mode, remove_after_commit):
    """Two requests: the second joins at host step 3, the first leaves early (fewer new tokens)."""
    hf, drafter = hf_pair
    prompts = _prompts(hf.config.vocab_size, lens=(7, 4), seed=11)
    spec = Speculator(drafter, d=4, mode=mode, max_requests=2, max_len=256, threads=1)
    outs = run_host(hf, spec, prompts, max_new=36, joins={1: 3}, leave_early={0: 14},
                    remove_after_commit=remove_after_commit)
    assert outs[0] == hf_greedy(hf, prompts[0], 14)
    assert outs[1] == hf_greedy(hf, prompts[1], 36)
    assert spec.requests == []
    drafting = [job for job in spec.jobs if job.phase in ("backbone", "serial_draft")]
    assert any(job.ids == ("req0", "req1") for job in drafting)  # the two overlapped: batched rounds
    # a third request reuses a freed slot
    assert run_host(hf, spec, [prompts[0]], max_new=20)[0] == hf_greedy(hf, prompts[0], 20)


def test_noncontiguous_slots_batch(hf_pair):
    """Three slots, the middle one freed: the batch spans slots 0 and 2 (gathered context views)."""
    hf, drafter = hf_pair
    prompts = _prompts(hf.config.vocab_size, lens=(5, 6, 8), seed=5)
    spec = Speculator(drafter, d=3, mode="dpara", max_requests=3, max_len=256, threads=1)
    outs = run_host(hf, spec, prompts, max_new=30, leave_early={1: 2})
    for prompt, out, n in zip(prompts, outs, (30, 2, 30)):
        assert out == hf_greedy(hf, prompt, n)


def test_random_drafter_on_tiny_hf_target(tiny_hf_target):
    """A random drafter on the shared tiny target (drafts rarely accepted): still exactly greedy."""
    torch.manual_seed(7)
    drafter = _drafter_for(tiny_hf_target, markov_rank=16).eval()
    prompts = _prompts(tiny_hf_target.config.vocab_size, lens=(5, 11), seed=1)
    for mode in ("dpara", "dspark"):
        spec = Speculator(drafter, d=3, mode=mode, max_requests=2, max_len=128, threads=1)
        outs = run_host(tiny_hf_target, spec, prompts, max_new=12)
        assert outs == [hf_greedy(tiny_hf_target, p, 12) for p in prompts]


def test_sampled_drafts_return_q_and_repeat(hf_pair):
    hf, drafter = hf_pair
    prompts = _prompts(hf.config.vocab_size, lens=(6, 4), seed=2)
    runs = []
    for _ in range(2):
        spec = Speculator(drafter, d=4, mode="dpara", max_requests=2, max_len=256, temperature=0.8, seed=5,
                          threads=1)
        runs.append(run_host(hf, spec, prompts, max_new=20, temperature=0.8, seed=9))
    assert runs[0] == runs[1]  # seeded end to end: the drafts (and so the verify draws) repeat
    assert all(len(o) == 20 or o[-1] == EOS for o in runs[0])
    # q is the drafter's distribution of each draft token
    spec = Speculator(drafter, d=4, mode="dspark", max_requests=1, max_len=64, temperature=1.0, seed=1,
                      threads=1)
    spec.add_request("a", torch.randn(3, drafter.config.feature_size), 5)
    tokens, q = spec.propose(["a"])
    assert q.shape == (1, 4, hf.config.vocab_size)
    torch.testing.assert_close(q.sum(-1), torch.ones(1, 4))
    assert bool((q.gather(-1, tokens[..., None]) > 0).all())


def test_bad_arguments_raise_value_error_naming_them(hf_pair):
    hf, drafter = hf_pair
    F, V = drafter.config.feature_size, hf.config.vocab_size
    spec = Speculator(drafter, d=4, mode="dpara", max_requests=1, max_len=64, threads=1)
    with pytest.raises(ValueError, match="mode 'nope'"):
        Speculator(drafter, mode="nope")
    with pytest.raises(ValueError, match="d = 99"):
        Speculator(drafter, d=99)
    with pytest.raises(ValueError, match=r"prompt_features of request 'a' has shape \(3, 7\)"):
        spec.add_request("a", torch.zeros(3, 7), 1)
    with pytest.raises(ValueError, match=r"bonus of request 'a' = 999"):
        spec.add_request("a", torch.zeros(3, F), 999)
    with pytest.raises(ValueError, match="unknown request id 'ghost'"):
        spec.propose(["ghost"])
    with pytest.raises(ValueError, match="unknown request id 'ghost'"):
        spec.remove_request("ghost")
    with pytest.raises(ValueError, match="commit without a propose"):
        spec.commit(["a"], [0], [1], torch.zeros(1, 1, F))
    spec.add_request("a", torch.randn(3, F), 1)
    with pytest.raises(ValueError, match="'a' is already added"):
        spec.add_request("a", torch.randn(3, F), 1)
    with pytest.raises(ValueError, match="all max_requests=1 slots"):
        spec.add_request("b", torch.randn(3, F), 1)
    with pytest.raises(ValueError, match="appears twice"):
        spec.propose(["a", "a"])
    with pytest.raises(ValueError, match="ids = 'a'"):
        spec.propose("a")
    spec.propose(["a"])
    with pytest.raises(ValueError, match="waits for its commit"):
        spec.propose(["a"])
    with pytest.raises(ValueError, match="r = 5 for request 'a'"):
        spec.commit(["a"], [5], [1], torch.zeros(1, 6, F))
    with pytest.raises(ValueError, match=rf"bonus of request 'a' = {V}"):
        spec.commit(["a"], [0], [V], torch.zeros(1, 1, F))
    with pytest.raises(ValueError, match=rf"features has shape \(1, 2, {F}\)"):
        spec.commit(["a"], [2], [1], torch.zeros(1, 2, F))
    with pytest.raises(ValueError, match="r has 2 entries for 1 requests"):
        spec.commit(["a"], [0, 0], [1], torch.zeros(1, 1, F))
    spec.commit(["a"], [1], [3], torch.randn(1, 5, F))  # still usable after the refusals
    assert spec.propose(["a"]).tokens.shape == (1, 4)


def test_lane_error_surfaces_on_the_next_call(hf_pair, monkeypatch):
    _, drafter = hf_pair
    F = drafter.config.feature_size
    spec = Speculator(drafter, d=4, mode="dpara", max_requests=2, max_len=64, threads=1)
    spec.add_request("a", torch.randn(3, F), 1)

    def broken(*args, **kwargs):
        raise RuntimeError("backbone exploded")
    monkeypatch.setattr(drafter, "boundary_logits", broken)
    spec.propose(["a"])  # the backbone is queued, not waited for
    spec.lane.synchronize()  # ... and has failed on the lane by now
    with pytest.raises(RuntimeError, match="backbone exploded") as info:
        spec.commit(["a"], [0], [1], torch.randn(1, 1, F))
    assert "'backbone' job" in "".join(getattr(info.value, "__notes__", []))
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="request 'a' lost its drafter state"):
        spec.propose(["a"])
    spec.remove_request("a")
    spec.add_request("a", torch.randn(3, F), 1)  # the speculator stays usable
    assert spec.propose(["a"]).tokens.shape == (1, 4)
    spec.commit(["a"], [0], [2], torch.randn(1, 1, F))
    assert spec.propose(["a"]).tokens.shape == (1, 4)


def test_lane_error_reaches_the_propose_that_needs_the_draft(hf_pair, monkeypatch):
    """Without waiting: the commit may return before the backbone failed; the next propose raises then."""
    _, drafter = hf_pair
    F = drafter.config.feature_size
    spec = Speculator(drafter, d=4, mode="dpara", max_requests=1, max_len=64, threads=1)
    spec.add_request(7, torch.randn(3, F), 1)

    def broken(*args, **kwargs):
        raise RuntimeError("backbone exploded")
    monkeypatch.setattr(drafter, "boundary_logits", broken)
    spec.propose([7])
    with pytest.raises(RuntimeError, match="backbone exploded"):
        spec.commit([7], [0], [1], torch.randn(1, 1, F))
        spec.propose([7])
    monkeypatch.undo()
    spec.remove_request(7)
    assert spec.requests == []


def test_removing_every_request_mid_step_frees_the_ring_slot(hf_pair):
    hf, drafter = hf_pair
    F = drafter.config.feature_size
    spec = Speculator(drafter, d=3, mode="dpara", max_requests=1, max_len=64, threads=1, ring_capacity=2)
    for i in range(4):  # more than the ring's capacity: a leaked slot would make acquire fail
        spec.add_request(i, torch.randn(4, F), 1)
        spec.propose([i])
        spec.commit([i], [1], [2], torch.randn(1, 2, F))
        spec.propose([i])
        spec.remove_request(i)  # between propose and commit: the step is abandoned
    spec.synchronize()
    assert [spec.ring.state(s) for s in range(2)] == ["free", "free"]
    prompt = _prompts(hf.config.vocab_size, lens=(5,))[0]
    assert run_host(hf, spec, [prompt], max_new=16)[0] == hf_greedy(hf, prompt, 16)


def test_per_request_temperature_and_seed(hf_pair):
    """A greedy request in a sampled call gets a one-hot q; a sampled request's drafts do not depend on
    its batch-mates (its own seed, its own Philox offset)."""
    _, drafter = hf_pair
    F = drafter.config.feature_size
    torch.manual_seed(4)
    feats = {"a": torch.randn(5, F), "b": torch.randn(3, F)}

    def drafts(ids, mode):
        spec = Speculator(drafter, d=4, mode=mode, max_requests=2, max_len=64, threads=1)
        spec.add_request("a", feats["a"], 7, temperature=0.9, seed=123)
        if "b" in ids:
            spec.add_request("b", feats["b"], 9, temperature=0.0)
        out = [spec.propose(ids)]
        block_feats = torch.randn(len(ids), 2, F, generator=torch.Generator().manual_seed(0))  # row 0 alike
        spec.commit(ids, [1] * len(ids), [4] * len(ids), block_feats)
        out.append(spec.propose(ids))
        return out

    for mode in ("dpara", "dspark"):
        alone, pair = drafts(["a"], mode), drafts(["a", "b"], mode)
        for (t1, q1), (t2, q2) in zip(alone, pair):
            assert torch.equal(t1[0], t2[0])
            torch.testing.assert_close(q1[0], q2[0])
            greedy_q = q2[1]
            assert torch.equal(greedy_q, torch.nn.functional.one_hot(t2[1], greedy_q.shape[-1]).float())
