"""The target's static-shape verify (models/static_verify.py: what a CUDA graph captures), run eagerly on CPU tensors
through the torch path: the same tokens as the eager verify for every method, positions from device lengths, one
step per (batch, T, window), one host read per verify."""
from __future__ import annotations

import copy

import pytest
import torch

from dpara_rt.engine import Engine
from dpara_rt.models.static_verify import WINDOW, StaticVerify
from dpara_rt.models.target import Target
from dpara_rt.round.sync_guard import HostWaits
from engine_pairs import predictable_pair

PROMPTS = [[1, 5, 9, 3], [4, 4, 7, 8, 8, 1]]


@pytest.fixture(scope="module")
def pair():
    return predictable_pair()


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", ["ar", "dspark", "dpara"])
def test_static_verify_gives_the_eager_tokens(pair, torch_path, method, sampled):
    target, drafter = pair
    out = {}
    for mode in ("eager", "static"):
        eng = Engine(target, drafter if method != "ar" else None, method=method, d=4, drafting="device",
                     drafter_worker="thread", temperature=1.0 if sampled else 0.0, verify_mode=mode)
        assert eng.target.verify_mode == mode
        out[mode] = eng.generate(PROMPTS, 40, seed=5)
    assert out["static"].tokens == out["eager"].tokens
    assert out["static"].stats.tau == out["eager"].stats.tau
    if method != "ar":
        assert out["static"].stats.tau > 1.0, out["static"].stats.tau


def test_a_verify_past_a_window_granule_builds_the_next_step(pair, torch_path):
    """Prompts near a granule's end: the decode crosses into the next window; each (batch, T, window) is one step,
    built once and reused (dspark reads a round late: its window also holds the 2 (d + 1) slots a round in flight
    may add)."""
    target, drafter = pair
    near = [[(7 * i + 3) % 60 + 3 for i in range(WINDOW - 16)], [5, 9, 11]]
    eng = Engine(target, drafter, method="dspark", d=4, drafting="device", drafter_worker="thread",
                 max_len=3 * WINDOW, verify_mode="static")
    ref = Engine(target, drafter, method="dspark", d=4, drafting="device", drafter_worker="thread",
                 max_len=3 * WINDOW, verify_mode="eager")
    got = eng.generate(near, 24)
    assert got.tokens == ref.generate(near, 24).tokens
    windows = {w for (_, T, w) in eng.target._static.shapes if T == 5}
    assert windows == {WINDOW, 2 * WINDOW}, eng.target._static.shapes


def test_positions_come_from_device_lengths_after_each_commit(pair, torch_path):
    target, _ = pair
    t = Target(target, max_batch=2, max_len=64, verify_mode="static")
    t.start([[1, 2, 3], [4, 5]])
    assert t._static.dev_lengths[:2].tolist() == [3, 2]
    logits, _ = t.verify(torch.tensor([[6, 7], [8, 9]]))
    t.commit(torch.tensor([2, 1]))
    assert t._static.dev_lengths[:2].tolist() == [5, 3]
    # the static verify of the next tokens equals the eager model's own forward at those positions
    t.verify(torch.tensor([[10], [11]]))
    eager = Target(target, max_batch=2, max_len=64, verify_mode="eager")
    eager.start([[1, 2, 3], [4, 5]])
    eager.verify(torch.tensor([[6, 7], [8, 9]]))
    eager.commit(torch.tensor([2, 1]))
    a, _ = t.verify(torch.tensor([[10], [11]]))
    b, _ = eager.verify(torch.tensor([[10], [11]]))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_a_static_verify_reads_the_host_once(pair, torch_path):
    target, _ = pair
    t = Target(target, max_batch=2, max_len=64, verify_mode="static")
    t.start([[1, 2, 3], [4, 5]])
    t.verify_argmax(torch.tensor([[6, 7], [8, 9]]))  # the step built
    t.commit(torch.tensor([1, 1]))
    with HostWaits(sites=True) as w:
        _, _, argmax = t.verify_argmax(torch.tensor([[6, 7], [8, 9]]))
    assert argmax.shape == (2, 2)
    sites = {what: set(where) for (_, what), where in w.where.items()}
    # the one read: the packed arg-max (RoPE's table lookup reads positions on the host backend alone)
    assert {what: {s.split(":")[0] for s in where} for what, where in sites.items()} == \
        {"tolist": {"static_verify.py"}}, sites
    assert w.counts.by[None, "caller", "tolist"] == 1


def test_a_non_finite_logit_is_reported(pair, torch_path):
    target, _ = pair
    t = Target(target, max_batch=1, max_len=64, verify_mode="static")
    t.start([[1, 2, 3]])
    with torch.no_grad():
        saved = target.norm.weight.clone()
        target.norm.weight.fill_(float("nan"))
        try:
            _, _, argmax = t.verify_argmax(torch.tensor([[4, 5]]))
        finally:
            target.norm.weight.copy_(saved)
    assert argmax is None


def test_unknown_modes_are_refused(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="verify_mode 'fast'"):
        Target(target, max_batch=1, max_len=64, verify_mode="fast")
    t = Target(target, max_batch=1, max_len=64)
    assert t.verify_mode == "eager" and t._static is None  # auto on the CPU
    with pytest.raises(ValueError, match="static verify mode"):
        StaticVerify(target, t.cache, [], "eager")


def test_graphs_mode_captures_where_cuda_is_and_gives_the_eager_tokens(pair):
    """On a CUDA device (bench/gpu_check.sh runs this file there) "graphs" captures one graph per verify shape and
    replays it; on the CPU it runs the same static step eagerly (here through the native host layers)."""
    target, drafter = pair
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = copy.deepcopy(target).to(device)
    model.reset_rope()
    out, engines = {}, {}
    for mode in ("eager", "graphs"):
        engines[mode] = Engine(model, None, method="ar", verify_mode=mode)
        out[mode] = engines[mode].generate(PROMPTS, 24).tokens
    assert out["graphs"] == out["eager"]
    steps = list(engines["graphs"].target._static._steps.values())
    assert steps and all((s.graph is not None) == (device.type == "cuda") for s in steps)
    if device.type == "cuda":  # DPara on one GPU: the drafter's stream beside the captured verifies
        eng = Engine(model, copy.deepcopy(drafter).move_to(device), method="dpara", d=4, placement="colocated",
                     verify_mode="graphs")
        assert eng.generate(PROMPTS, 24).tokens == out["eager"]
