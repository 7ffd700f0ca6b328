"""What must never happen quietly: a native call reading freed memory when Engines share a drafter across threads
(a drafter worker's start moves no storage another thread reads: dpara_rt.host.sharing), and a damaged target's
NaN logits turned into tokens (every logit that becomes a token is checked, the prefill's included). Also: prompts
given as integer tensors or arrays (transformers' input_ids) decode as lists do; other dtypes are one line; and a
draft length past the drafter's block size warns with every method."""
import copy
import threading
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from dpara_rt.engine import Engine
from dpara_rt.host.sharing import for_worker, pickled_tensors
from dpara_rt.host.worker import DrafterWorker
from dpara_rt.methods import variant
from dpara_rt.models.autoregressive import ARDecoder
from dpara_rt.models.drafter import DrafterWarning
from dpara_rt.models.hf_target import HFCausalLM, HFTarget
from dpara_rt.models.target import Target
from dpara_rt.tools.compare import load_pair
from engine_pairs import predictable_pair

PROMPTS = [[1, 5, 9, 13, 17], [2, 4, 6]]
NEW = 12


@pytest.fixture(scope="module")
def pair():
    _, target, drafter = load_pair()
    return target, drafter


@pytest.fixture(scope="module")
def ar_tokens(pair):
    target, _ = pair
    return Engine(target, None, method="ar").generate(PROMPTS, NEW).tokens


def _addresses(drafter) -> dict[int, int]:
    return {id(t): t.data_ptr() for t in pickled_tensors(drafter)}


def test_two_engines_over_one_drafter_in_threads_match_ar(pair, ar_tokens):
    # One thread drafts with the native Markov head (PSD) while the other starts its DPara worker process.
    target, drafter = pair
    engines = [Engine(target, drafter, **variant(name)) for name in ("psd-pearl", "dpara-logits")]
    barrier = threading.Barrier(len(engines))
    outs: dict[int, list] = {i: [] for i in range(len(engines))}
    errors: list[BaseException] = []

    def run(i: int, eng: Engine) -> None:
        try:
            barrier.wait()
            for _ in range(4):
                outs[i].append(eng.generate(PROMPTS, NEW).tokens)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, eng)) for i, eng in enumerate(engines)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        for eng in engines:
            eng.close()
    assert not errors, errors
    assert all(not t.is_alive() for t in threads)
    assert outs == {0: [ar_tokens] * 4, 1: [ar_tokens] * 4}


def test_engine_construction_puts_the_worker_weights_in_shared_memory(pair):
    target, drafter = pair
    Engine(target, drafter, method="dspark")  # any method: another Engine over this drafter may start a worker
    assert all(t.is_shared() for t in pickled_tensors(drafter))
    assert target.embed_tokens.weight.is_shared() and target.lm_head.weight.is_shared()


def test_a_worker_start_moves_no_storage(pair):
    target, drafter = pair
    Engine(target, drafter, method="dpara")
    before = _addresses(drafter)
    worker = DrafterWorker(drafter, None, 1)
    try:
        assert worker.call("ping") == worker.pid
    finally:
        worker.close()
    assert _addresses(drafter) == before


def test_weights_replaced_after_binding_are_copied_for_the_worker_not_moved(pair, ar_tokens):
    target, drafter = pair
    eng = Engine(target, drafter, method="dpara", dpara_ring="logits", drafter_worker="process")
    old = drafter.w1
    drafter.w1 = nn.Parameter(old.detach().clone())  # private memory, in no shared segment
    try:
        address = drafter.w1.data_ptr()
        snapshot = for_worker(drafter)
        assert snapshot is not drafter and snapshot.w1.is_shared() and not drafter.w1.is_shared()
        assert torch.equal(snapshot.w1, drafter.w1) and drafter.w1.data_ptr() == address
        assert eng.generate(PROMPTS, NEW).tokens == ar_tokens
        assert drafter.w1.data_ptr() == address and not drafter.w1.is_shared()
    finally:
        eng.close()
        drafter.w1 = old
    assert for_worker(drafter) is drafter  # all shared again: the drafter itself goes


# ------------------------------------------------------------------ non-finite logits
def _nan_copy(target):
    """A copy of `target` whose layer 3 MLP output weights are NaN, and a function that repairs it in place."""
    bad = copy.deepcopy(target)
    weight = bad.layers[3].mlp.down_proj.weight
    good = weight.detach().clone()
    with torch.no_grad():
        weight.fill_(float("nan"))

    def repair():
        with torch.no_grad():
            weight.copy_(good)
    return bad, repair


def _one_line_non_finite(e: pytest.ExceptionInfo) -> None:
    text = str(e.value)
    assert "\n" not in text and "non-finite" in text and "expected finite logits" in text


@pytest.mark.parametrize("name", ["ar", "dspark", "dpara", "dpara-single", "psd-pearl", "dflash"])
def test_a_nan_target_raises_at_prefill_and_the_engine_recovers(pair, ar_tokens, name):
    target, drafter = pair
    bad, repair = _nan_copy(target)
    eng = Engine(bad, drafter, **variant(name))
    try:
        for sampling in ({}, {"temperature": 1.0, "seed": 3}):
            with pytest.raises(FloatingPointError, match=r"^prefill: .*prompt\(s\) \[0, 1\]") as e:
                eng.generate(PROMPTS, NEW, **sampling)
            _one_line_non_finite(e)
        repair()  # the same engine decodes again, and right
        assert eng.generate(PROMPTS, NEW).tokens == ar_tokens
    finally:
        eng.close()
    good = Engine(target, drafter, **variant(name))  # and a fresh one over the same drafter
    try:
        assert good.generate(PROMPTS, NEW).tokens == ar_tokens
    finally:
        good.close()


def test_every_prefill_of_the_native_target_is_checked(pair):
    target, _ = pair
    bad, _ = _nan_copy(target)
    t = Target(bad, 2, 64)
    with pytest.raises(FloatingPointError, match=r"prompt\(s\) \[0, 1\]") as e:
        t.start(PROMPTS)
    _one_line_non_finite(e)
    t.grow(2)
    with pytest.raises(FloatingPointError, match=r"prompt\(s\) \[1\]") as e:
        t.prefill_row(1, [3, 4, 5])
    _one_line_non_finite(e)


def test_every_prefill_of_a_transformers_target_is_checked():
    from conftest import build_hf_qwen3
    hf = build_hf_qwen3()
    with torch.no_grad():
        hf.model.layers[1].mlp.down_proj.weight.fill_(float("nan"))
    model = HFCausalLM(hf)
    t = HFTarget(model, 2, 64)
    with pytest.raises(FloatingPointError, match=r"prompt\(s\) \[0, 1\]") as e:
        t.start(PROMPTS)
    _one_line_non_finite(e)
    t.grow(2)
    with pytest.raises(FloatingPointError, match=r"prompt\(s\) \[0\]"):
        t.prefill_row(0, [3, 4, 5])
    eng = Engine(model, None, method="ar")
    for sampling in ({}, {"temperature": 0.7, "seed": 1}):
        with pytest.raises(FloatingPointError, match="^prefill: "):
            eng.generate(PROMPTS, 4, **sampling)


def test_the_reference_ar_loop_checks_every_step(pair, monkeypatch):
    target, _ = pair
    dec = ARDecoder(Target(target, 1, 64), 8)
    dec.start([[1, 2, 3]])
    real = dec.target.verify

    def nan_verify(tokens):
        logits, feats = real(tokens)
        return torch.full_like(logits, float("nan")), feats
    monkeypatch.setattr(dec.target, "verify", nan_verify)
    with pytest.raises(FloatingPointError, match="^round 1: .*non-finite") as e:
        dec.step()
    _one_line_non_finite(e)


# ------------------------------------------------------------------ prompts as tensors and arrays
@pytest.fixture(scope="module")
def ar_engine(pair):
    return Engine(pair[0], None, method="ar")


@pytest.mark.parametrize("make", [
    lambda rows: torch.tensor(rows), lambda rows: torch.tensor(rows, dtype=torch.int32), lambda rows: np.array(rows),
    lambda rows: np.array(rows, dtype=np.uint16), lambda rows: [torch.tensor(r) for r in rows],
    lambda rows: [np.array(r) for r in rows]], ids=["tensor", "int32", "numpy", "uint16", "tensors", "arrays"])
def test_prompts_as_integer_tensors_or_arrays_decode_as_lists(ar_engine, make):
    rows = [[1, 5, 9], [2, 4, 6]]
    want = ar_engine.generate(rows, 6).tokens
    assert ar_engine.generate(make(rows), 6).tokens == want
    assert ar_engine.generate(make(rows)[0], 6).tokens == want[:1]  # 1-D: one prompt
    streamed = [[] for _ in rows]
    for new in ar_engine.stream(make(rows), 6):
        for out, t in zip(streamed, new):
            out.extend(t)
    assert streamed == want


def test_a_drafting_method_takes_transformers_input_ids(pair, ar_tokens):
    target, drafter = pair
    eng = Engine(target, drafter, method="dspark")
    assert eng.generate(torch.tensor(PROMPTS[0])[None], NEW).tokens == ar_tokens[:1]


@pytest.mark.parametrize("prompts, says", [
    (torch.tensor([[1.0, 2.0]]), "prompts is a tensor of dtype torch.float32; expected integer token ids"),
    (torch.tensor([True, False]), "prompts is a tensor of dtype torch.bool; expected integer token ids"),
    (np.array([[1.5, 2.0]]), "prompts is an array of dtype float64; expected integer token ids"),
    (np.array([True]), "prompts is an array of dtype bool"),
    (torch.zeros(2, 2, 2, dtype=torch.long), "prompts is a tensor of shape [2, 2, 2]; expected [T] (one prompt) or "
                                             "[B, T] (a batch) with T >= 1"),
    (torch.zeros(1, 0, dtype=torch.long), "shape [1, 0]"),
    (torch.tensor(7), "shape []"),
    ([torch.tensor([1.0])], "prompt 0 is a tensor of dtype torch.float32"),
    ([torch.tensor([[1, 2]])], "prompt 0 is a tensor of shape [1, 2]; expected [T] with T >= 1"),
    ([1, 2, 3], "prompt 0 = 1 (int); expected a list of token ids"),
    (["abc"], "prompt 0 = 'abc' (str)"),
    (torch.tensor([[1, 8192]]), "outside the vocabulary [0, 8192)"),
])
def test_other_prompt_dtypes_and_shapes_are_one_line(ar_engine, prompts, says):
    with pytest.raises(ValueError) as e:
        ar_engine.generate(prompts, 4)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert ar_engine.generate([[1, 2]], 2).tokens  # still usable


# ------------------------------------------------------------------ a draft length past the trained block size
DRAFTING = ["dspark", "dflash", "psd-pearl", "psd-ssd", "dpara", "dpara-single", "dpara-logits", "dpara-hidden",
            "auto"]


@pytest.fixture(scope="module")
def small_pair():
    return predictable_pair()  # block_size 8


@pytest.mark.parametrize("name", DRAFTING)
def test_every_drafting_method_warns_once_for_d_past_the_block_size(small_pair, name):
    target, drafter = small_pair
    bs = drafter.config.block_size
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        eng = Engine(target, drafter, d=bs + 2, **variant(name))
        try:
            eng.generate([[5, 6, 7]], 2 * bs)
        finally:
            eng.close()
    ours = [w for w in seen if issubclass(w.category, DrafterWarning)]
    assert [str(w.message) for w in ours] == [f"draft length d={bs + 2} exceeds block_size={bs} the drafter was "
                                              f"trained for: positions past {bs} are untrained (expect lower tau); "
                                              "running anyway"]
    assert ours[0].filename == __file__  # it points at the Engine(...) line


@pytest.mark.parametrize("name", DRAFTING)
def test_no_method_warns_for_d_within_the_block_size(small_pair, name):
    target, drafter = small_pair
    with warnings.catch_warnings():
        warnings.simplefilter("error", DrafterWarning)
        for d in (1, drafter.config.block_size):
            eng = Engine(target, drafter, d=d, **variant(name))
            try:
                assert eng.generate([[5, 6, 7]], 12).tokens[0]
            finally:
                eng.close()
