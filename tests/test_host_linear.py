"""HostLinear: the core's float32 host linear layer behind nn.Linear's interface (the target's projections)."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from dpara_rt import _core
from dpara_rt.host.linear import HostLinear, pack_weight


def _layer(n: int, k: int, bf16_exact: bool, seed: int = 0) -> HostLinear:
    layer = HostLinear(k, n, bias=False)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    with torch.no_grad():
        layer.weight.copy_(w.bfloat16().float() if bf16_exact else w)
    return layer


@pytest.mark.parametrize("bf16_exact", [True, False])
@pytest.mark.parametrize("rows,k,n", [(1, 64, 96), (8, 256, 768), (13, 48, 33), (130, 96, 40)])
def test_matches_f_linear(rows, k, n, bf16_exact):
    layer = _layer(n, k, bf16_exact)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = layer(x)
    ref = F.linear(x.double(), layer.weight.double())
    assert layer._packed_dtype == ("bfloat16" if bf16_exact else "float32")
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=2e-5 * k ** 0.5)


def test_a_token_projects_the_same_verified_among_others_or_alone():
    layer = _layer(200, 160, bf16_exact=True)
    x = torch.randn(2, 8, 160, generator=torch.Generator().manual_seed(2))  # [B, T, K], as in a verify
    with torch.no_grad():
        block = layer(x)
        alone = torch.stack([torch.cat([layer(x[b, t:t + 1]) for t in range(8)]) for b in range(2)])
    assert block.shape == (2, 8, 200)
    assert torch.equal(block, alone)


@pytest.mark.parametrize("bf16_exact", [True, False])
def test_two_threads_give_one_threads_bits_even_from_two_callers(bf16_exact):
    """host_linear_two_threads (a prefill's products) splits the panels between the caller and the core's helper
    thread: the bits of host_linear, above its size threshold and below, and from two callers at once (one of
    them finds the helper busy and computes alone)."""
    import threading
    layer = _layer(1536, 256, bf16_exact)
    packed, dtype = layer.packed()
    results = []

    def project(rows: int, seed: int):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(seed))
        one, two = torch.empty(rows, 1536), torch.full((rows, 1536), float("nan"))
        _core.host_linear(x.data_ptr(), rows, 256, packed.data_ptr(), dtype, 1536, one.data_ptr())
        for _ in range(5):
            _core.host_linear_two_threads(x.data_ptr(), rows, 256, packed.data_ptr(), dtype, 1536, two.data_ptr())
            results.append(torch.equal(one, two))

    project(130, 0)  # above the threshold: the helper takes half
    project(3, 1)  # below it: the caller alone
    callers = [threading.Thread(target=project, args=(130, seed)) for seed in (2, 3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert len(results) == 20 and all(results)
    with pytest.raises(ValueError, match="m = -1 rows"):
        _core.host_linear_two_threads(0, -1, 256, packed.data_ptr(), dtype, 1536, 0)


@pytest.mark.parametrize("bf16_exact", [True, False])
def test_a_column_range_writes_those_columns_with_the_whole_products_bits(bf16_exact):
    """host_linear's col_begin / col_end (the hidden ring's head and the drafter worker share branch r's projection
    so): two ranges give the whole product's bits, nothing outside a range is written, and a range off a panel
    edge is refused with its values named."""
    n, k, rows = 200, 96, 7
    layer = _layer(n, k, bf16_exact)
    packed, dtype = layer.packed()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(4))
    whole, parts = torch.empty(rows, n), torch.full((rows, n), float("nan"))
    _core.host_linear(x.data_ptr(), rows, k, packed.data_ptr(), dtype, n, whole.data_ptr())
    split = 3 * _core.HOST_LINEAR_PANEL
    _core.host_linear(x.data_ptr(), rows, k, packed.data_ptr(), dtype, n, parts.data_ptr(), 0, split)
    assert parts[:, :split].isfinite().all() and parts[:, split:].isnan().all()
    _core.host_linear(x.data_ptr(), rows, k, packed.data_ptr(), dtype, n, parts.data_ptr(), split)
    assert torch.equal(whole, parts)
    with pytest.raises(ValueError, match=r"columns \[5, 200\) of n = 200, expected .*\(multiples of 32"):
        _core.host_linear(x.data_ptr(), rows, k, packed.data_ptr(), dtype, n, parts.data_ptr(), 5)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: the helper has no other core to take")
def test_the_helper_thread_takes_the_cores_its_first_caller_leaves():
    """The helper of host_linear_two_threads runs on the process's cores other than the (pinned) thread that first
    used it: left to the scheduler it was often woken on the caller's own core, and the two halves took turns."""
    script = textwrap.dedent("""
        import os, threading, torch
        from dpara_rt import _core
        from dpara_rt.host.linear import pack_weight
        everything = os.sched_getaffinity(0)
        mine = {min(everything)}
        packed, dtype = pack_weight(torch.randn(1536, 256).bfloat16().float())
        x, y = torch.randn(130, 256), torch.empty(130, 1536)
        def prefill():  # on a thread pinned as a lane pins its own
            os.sched_setaffinity(0, mine)
            _core.host_linear_two_threads(x.data_ptr(), 130, 256, packed.data_ptr(), dtype, 1536, y.data_ptr())
        lane = threading.Thread(target=prefill)
        lane.start()
        lane.join()
        helpers = [int(t) for t in os.listdir("/proc/self/task")
                   if open(f"/proc/self/task/{t}/comm").read().strip() == "dpara_rt-helper"]
        assert len(helpers) == 1, helpers
        print(sorted(os.sched_getaffinity(helpers[0])) == sorted(everything - mine))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_the_packed_copy_follows_the_weight():
    layer = _layer(40, 32, bf16_exact=True)
    x = torch.randn(3, 32)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2)  # in place
        torch.testing.assert_close(layer(x), before * 2)
        layer.weight = torch.nn.Parameter(torch.full((40, 32), 1 / 3))  # a new tensor, not bf16-exact
        torch.testing.assert_close(layer(x), x.sum(-1, keepdim=True).expand(3, 40) / 3)
    assert layer._packed_dtype == "float32"


def test_autograd_and_other_dtypes_take_torch():
    layer = _layer(24, 16, bf16_exact=True)
    x = torch.randn(4, 16, requires_grad=True)
    layer(x).sum().backward()  # grad enabled: F.linear, so gradients flow
    torch.testing.assert_close(x.grad, layer.weight.detach().sum(0).expand(4, 16))
    assert layer._packed is None
    with torch.no_grad():
        y16 = layer.to(torch.bfloat16)(x.detach().bfloat16())
    assert y16.dtype == torch.bfloat16 and layer._packed is None
    assert list(layer.state_dict()) == ["weight"]
    with torch.no_grad():
        layer.float()(x.detach())  # packed now: the packed copy is no parameter or buffer
    assert layer._packed is not None and list(layer.state_dict()) == ["weight"]
    assert [name for name, _ in layer.named_parameters()] == ["weight"]


def test_refusals_name_the_value():
    with pytest.raises(ValueError, match=r"weight \(3,\) torch.float32 on cpu; expected a 2-D"):
        pack_weight(torch.zeros(3))
    with pytest.raises(ValueError, match=r"weight \[0, 1\] = 0.333333 is not a bfloat16 value"):
        w, packed = torch.tensor([[1.0, 1 / 3]]), torch.empty(64, dtype=torch.int16)
        _core.host_linear_pack(w.data_ptr(), 1, 2, packed.data_ptr(), "bfloat16")
    with pytest.raises(ValueError, match="packed format 'float16', expected 'float32', 'bfloat16' or 'bf16_dot'"):
        _core.host_linear(0, 1, 2, 0, "float16", 1, 0)
    with torch.no_grad(), pytest.raises(ValueError, match=r"input \(2, 5\) has 5 features; expected 16"):
        _layer(24, 16, bf16_exact=True)(torch.zeros(2, 5))


def test_the_qwen3_target_projects_through_packed_bf16_weights():
    from dpara_rt.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).eval()
    model.init_weights(generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())  # a bf16 checkpoint loaded as float32
        ids = torch.tensor([[3, 9, 27, 5]])
        logits, _ = model(ids, torch.arange(4)[None])
    linears = [m for m in model.modules() if isinstance(m, HostLinear)]
    assert len(linears) == 2 * 7 + 1
    assert all(m._packed_dtype == "bfloat16" for m in linears)
    assert model.lm_head.weight is model.embed_tokens.weight
    torch_logits, _ = model(ids, torch.arange(4)[None])  # grad enabled: every projection through F.linear
    torch.testing.assert_close(logits, torch_logits.detach(), rtol=0, atol=1e-5)
