"""bf16 host math (set_host_math): projections over bfloat16-rounded weights and inputs with float32 sums, still one
chain per element (a token verified among others gets its bits alone), repacked when the math changes, carried to a
drafter worker, and lossless speculation under it: greedy outputs of every method equal AR's of the same math."""
import pytest
import torch
import torch.nn.functional as F

from dpara_rt import _core
from dpara_rt.engine import Engine
from dpara_rt.methods import variant
from dpara_rt.models.autoregressive import generate_ar
from dpara_rt.host.linear import HOST_MATHS, HostLinear, pack_weight, set_host_math
from dpara_rt.models.target import Target
from engine_pairs import math_checked, predictable_pair


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


def _layer(n: int, k: int, seed: int = 0) -> HostLinear:
    layer = HostLinear(k, n, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1)
    layer.host_math = "bf16"
    return layer


@pytest.mark.parametrize("rows,k,n", [(1, 64, 96), (8, 256, 768), (13, 47, 33), (70, 96, 40)])
def test_bf16_math_is_the_product_of_the_rounded_operands(rows, k, n):
    """Products of bfloat16-rounded x and W summed in float32: within float32 rounding of the exact sum of those
    products, and not the float32 product (the inputs are not bfloat16 values)."""
    layer = _layer(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = layer(x)
    assert layer._packed_dtype == "bf16_dot" and y.dtype == torch.float32 and y.shape == (rows, n)
    exact = F.linear(_bf16(x).double(), _bf16(layer.weight.detach()).double())
    torch.testing.assert_close(y.double(), exact, rtol=0, atol=2e-6 * k ** 0.5)
    assert not torch.equal(y, F.linear(x, layer.weight.detach()))


def test_a_token_projects_the_same_verified_among_others_or_alone():
    layer = _layer(200, 160)
    x = torch.randn(2, 8, 160, generator=torch.Generator().manual_seed(2))  # [B, T, K], as in a verify
    with torch.no_grad():
        block = layer(x)
        alone = torch.stack([torch.cat([layer(x[b, t:t + 1]) for t in range(8)]) for b in range(2)])
    assert torch.equal(block, alone)


def test_the_emulation_has_the_instructions_bits():
    """Where the CPU has AVX512-BF16, a process that emulates the dot product (DPARA_RT_HOST_LINEAR_TILES=narrow)
    computes the same bits; where it has not, both are the emulation."""
    import subprocess
    import sys
    code = ("import torch; from dpara_rt import _core; from dpara_rt.host.linear import pack_weight\n"
            "g = torch.Generator().manual_seed(4); w = torch.randn(300, 77, generator=g); x = torch.randn(9, 77, "
            "generator=g)\np, f = pack_weight(w, 'bf16'); y = torch.empty(9, 300)\n"
            "_core.host_linear(x.data_ptr(), 9, 77, p.data_ptr(), f, 300, y.data_ptr())\n"
            "import sys; sys.stdout.buffer.write(y.numpy().tobytes())")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, check=True,
                           env={**__import__("os").environ, "DPARA_RT_HOST_LINEAR_TILES": tiles}).stdout
            for tiles in ("wide", "narrow")]
    assert len(runs[0]) == 9 * 300 * 4 and runs[0] == runs[1]


def test_set_host_math_repacks_a_target_and_its_drafters_head():
    target, drafter = predictable_pair(seed=5)
    ids = torch.tensor([[3, 9, 27, 5]])
    with torch.no_grad():
        before, _ = target(ids, torch.arange(4)[None])
        set_host_math(target, "bf16")
        set_host_math(drafter, "bf16")
        after, _ = target(ids, torch.arange(4)[None])
        drafter.fc(torch.zeros(1, drafter.fc.in_features))  # the drafter's own projections pack on use
    linears = [m for m in target.modules() if isinstance(m, HostLinear)]
    assert all(m.host_math == "bf16" for m in linears) and drafter.lm_head is target.lm_head
    assert target.lm_head._packed_dtype == "bf16_dot" and drafter.fc._packed_dtype == "bf16_dot"
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, before, rtol=0, atol=0.05)  # the same model, rounded differently
    with torch.no_grad():
        set_host_math(target, "float32")
        again, _ = target(ids, torch.arange(4)[None])
    assert torch.equal(again, before) and target.lm_head._packed_dtype != "bf16_dot"
    with pytest.raises(ValueError, match=r"host math 'bf8'; expected one of 'float32', 'bf16'"):
        set_host_math(target, "bf8")
    with pytest.raises(ValueError, match="host math 'fp16'"):
        pack_weight(torch.zeros(4, 4), "fp16")
    assert HOST_MATHS == ("float32", "bf16")
    assert _core.host_linear_packed_elems(45, 37, "bf16_dot") == 2 * 32 * 38


@pytest.mark.parametrize("name,worker", [("dspark", "thread"), ("dpara", "thread"), ("dpara", "process"),
                                         ("dpara-logits", "thread"), ("psd-pearl", "thread")])
def test_speculation_stays_lossless_under_bf16_math(name, worker):
    """Every method's greedy output equals AR's under the same math: verify blocks and single-token steps
    round alike. A drafter worker process gets the drafter with its math."""
    target, drafter = predictable_pair(seed=7)
    set_host_math(target, "bf16")
    set_host_math(drafter, "bf16")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (5, 11, 8)]
    want = generate_ar(Target(target, 3, 512), prompts, 24, eos_ids=(2,))
    eng = Engine(target, drafter, d=6, max_len=512, drafter_worker=worker, **variant(name))
    try:
        out = eng.generate(prompts, max_new_tokens=24)
    finally:
        eng.close()
    assert out.tokens == want
    assert out.stats.tau > 1.0


def test_a_drafter_worker_drafts_with_its_drafters_math():
    """The worker process gets the drafter with its math (its projections' and its output head's), and drafts the
    thread's drafts."""
    target, drafter = predictable_pair(seed=7)
    set_host_math(target, "bf16")
    set_host_math(drafter, "bf16")
    prompts = [[5, 9, 14, 3], [7, 7, 21]]
    rounds = {}
    for worker in ("thread", "process"):
        eng = Engine(target, math_checked(drafter, "bf16"), d=6, max_len=512, drafter_worker=worker, method="dpara")
        try:
            st = eng.generate(prompts, max_new_tokens=32).stats
        finally:
            eng.close()
        rounds[worker] = (st.rounds, list(st.acceptance_histogram))
    assert rounds["thread"] == rounds["process"]
    eng = Engine(target, math_checked(drafter, "float32"), d=6, max_len=512, drafter_worker="process", method="dpara")
    try:  # the check itself bites: a drafter of another math fails in the worker, and the error surfaces here
        with pytest.raises(RuntimeError, match=r"host math \['bf16'\], expected 'float32'"):
            eng.generate(prompts, max_new_tokens=32)
    finally:
        eng.close()
