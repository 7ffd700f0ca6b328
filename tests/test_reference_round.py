"""The reference round (dpara_rt.round.reference) as the oracle of the engine's greedy decoding, on the embedded pair.

The reference's AR, DSpark and DPara give AR's tokens (lossless); every engine variant gives the same tokens; and
the engine's DSpark and DPara accept, round for round, what the reference's serial block and spine + branches tree
accept: the same r every round, so the engine's DPara drafts from branch r of the tree, not serially underneath.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dpara_rt.engine import Engine
from dpara_rt.host.linear import set_host_math
from dpara_rt.methods import VARIANTS, variant
from dpara_rt.models.autoregressive import generate_ar
from dpara_rt.models.drafter import Drafter
from dpara_rt.models.target import Target
from dpara_rt.host.linear import native_target
from dpara_rt.round.reference import reference_decode
from dpara_rt.tools.compare import load_pair

MAX_NEW = 32
DS = (7, 3)
TEXTS = ("def add(a, b):", "for i in range(10):", "class Stack:\n    def push(self, x):")
ENGINE_VARIANTS = [name for name in VARIANTS if not name.startswith("auto")]
# the variants whose rounds follow one of the reference's schedules, and that schedule
SCHEDULES = {name: variant(name)["method"] for name in ENGINE_VARIANTS
             if variant(name)["method"] in ("dspark", "dpara")}


@pytest.fixture(scope="module")
def pair():
    # float32 host math: the engine's native paths then compute the float32 model's products, as the reference's
    # torch path does (in another order). With "bf16" math (the default where the CPU has the bf16 dot product) the
    # engine rounds the inputs to bf16, and its greedy output is that model's, not the float32 reference's.
    tokenizer, target, drafter = load_pair(host_math="float32")
    return target, drafter, [tokenizer.encode(text) for text in TEXTS], list(target.config.eos_token_id)


def reference(target, drafter, prompt, d, method, eos):
    # One intra-op thread: the reference's products of a few dozen rows gain nothing from a second one, and on a
    # busy host the threads' barriers made each forward several times slower.
    # The torch path (HostLinear on F.linear): the oracle shares no kernel with the engine's native host paths.
    threads, native = torch.get_num_threads(), native_target(False)
    torch.set_num_threads(1)
    try:
        return reference_decode(target, drafter, prompt, MAX_NEW, d, method, eos)
    finally:
        torch.set_num_threads(threads)
        native_target(native)


@pytest.fixture(scope="module")
def refs(pair):
    """{(prompt index, d, method): (tokens, accepted)}; AR's once per prompt, under d = None."""
    target, drafter, prompts, eos = pair
    out = {}
    for i, p in enumerate(prompts):
        out[i, None, "ar"] = reference(target, drafter, p, DS[0], "ar", eos)
        for d in DS:
            for method in ("dspark", "dpara"):
                out[i, d, method] = reference(target, drafter, p, d, method, eos)
    return out


def commits(tokens: list[int], accepted: list[int]) -> list[int]:
    """Tokens committed per round: r + 1, the last round's cut at EOS or max_new_tokens (the prefill's token is
    the first of `tokens` and no round's)."""
    n = [r + 1 for r in accepted]
    n[-1] -= sum(n) + 1 - len(tokens)
    assert 1 <= n[-1] <= accepted[-1] + 1
    return n


def check_engine(eng: Engine, prompt, want: tuple[list[int], list[int]], d: int, schedule: bool) -> None:
    """The engine's tokens are the reference's; with `schedule`, so is every round's committed length (streamed) and
    the statistics (the histogram counts each round's committed length - 1, tau is their mean)."""
    tokens, accepted = want
    out = eng.generate([prompt], MAX_NEW)
    assert out.tokens[0] == tokens
    if not schedule:
        return
    n = commits(tokens, accepted)
    st = out.stats
    assert st.rounds == len(accepted)
    assert st.acceptance_histogram == [sum(1 for k in n if k - 1 == r) for r in range(d + 1)]
    assert st.tau == pytest.approx(sum(n) / len(n))
    chunks = [c[0] for c in eng.stream([prompt], MAX_NEW)]
    assert sum(chunks, []) == tokens and len(chunks[0]) == 1  # the prefill's token, then one chunk a round
    assert [len(c) for c in chunks[1:]] == n


def test_reference_is_lossless(pair, refs):
    target, drafter, prompts, eos = pair
    for i, p in enumerate(prompts):
        tokens, accepted = refs[i, None, "ar"]
        assert len(tokens) == MAX_NEW and accepted == [0] * (MAX_NEW - 1)
        assert tokens == generate_ar(Target(target, 1, len(p) + MAX_NEW), [p], MAX_NEW, eos_ids=eos)[0]
        for d in DS:
            for method in ("dspark", "dpara"):
                assert refs[i, d, method][0] == tokens, (i, d, method)
            assert refs[i, d, "dpara"][1][0] == 0  # DPara's round 1 verifies s_0 alone
    # The schedules accept differently (DPara's branch r sees the feature-less spine, DSpark's block the features),
    # so matching one round for round says which one the engine ran.
    assert any(refs[i, d, "dpara"][1][1:] != refs[i, d, "dspark"][1][:-1] for i in range(len(prompts)) for d in DS)
    with pytest.raises(ValueError, match="expected one of"):
        reference_decode(target, drafter, prompts[0], 4, 7, method="psd")


@pytest.mark.parametrize("d", DS)
@pytest.mark.parametrize("name", ENGINE_VARIANTS)
def test_engine_matches_reference(pair, refs, name, d):
    """Every variant's tokens are the reference's. The engine runs its native host paths (the core's linear layers,
    backbone and Markov head), the reference torch's: their logits differ in the last bits, yet every round's r is
    the same, exactly: each arg-max the rounds take wins by far more than float32 rounding moves it."""
    target, drafter, prompts, _ = pair
    eng = Engine(target, drafter, **variant(name), d=d)
    try:
        for i, p in enumerate(prompts):
            schedule = SCHEDULES.get(name)
            check_engine(eng, p, refs[i, d, schedule or "dspark"], d, schedule is not None)
    finally:
        eng.close()


def test_eos_inside_a_block(pair, refs):
    """An EOS id that the text reaches inside a block: both schedules commit through it and stop, in the same rounds
    as the engine's."""
    target, drafter, prompts, _ = pair
    d, cut_inside = DS[0], []
    for i, p in enumerate(prompts):
        ar = refs[i, None, "ar"][0]
        eos = [ar[10]]
        for method in ("dspark", "dpara"):
            tokens, accepted = got = reference(target, drafter, p, d, method, eos)
            assert tokens == ar[:ar.index(eos[0]) + 1], method
            cut_inside.append(commits(tokens, accepted)[-1] < accepted[-1] + 1)
            eng = Engine(target, drafter, **variant(method), d=d, eos_ids=eos)
            try:
                check_engine(eng, p, got, d, True)
            finally:
                eng.close()
    assert any(cut_inside)  # some round accepted past the EOS: the cut came inside its block


def test_dflash_mask_rows(pair, refs):
    """The DFlash convention (draft_rows "mask": a block [anchor, MASK x d], the drafts from the mask rows; a branch
    of d + 1 rows) in the reference and the engine: the embedded drafter's weights read that way."""
    target, drafter, prompts, eos = pair
    d = DS[0]
    masked = Drafter(dataclasses.replace(drafter.config, draft_rows="mask"), target.embed_tokens, target.lm_head)
    masked.load_state_dict(drafter.state_dict())
    masked.eval().requires_grad_(False)
    set_host_math(masked, "float32")
    p = prompts[0]
    want = {m: reference(target, masked, p, d, m, eos) for m in ("dspark", "dpara")}
    assert want["dspark"][0] == want["dpara"][0] == refs[0, None, "ar"][0]
    for name in ("dspark", "dpara-logits", "dpara-hidden"):
        eng = Engine(target, masked, **variant(name), d=d)
        try:
            check_engine(eng, p, want[SCHEDULES[name]], d, True)
        finally:
            eng.close()
