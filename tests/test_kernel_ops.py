"""dpara_rt.ops: backend dispatch (DPARA_RT_OPS), input validation before launch, and the package working
without triton installed."""
import os

import torch

if not torch.cuda.is_available():  # must precede the first triton import (kernels import it lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402

from dpara_rt import ops  # noqa: E402
from dpara_rt.kernels.tree_attention import tree_size  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tree_args(d=2, batch=2, n_q=4, n_kv=2, head_dim=64, max_ctx=30):
    g = torch.Generator().manual_seed(0)
    n = tree_size(d)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE)
    return dict(q=rand(batch, n_q, n, head_dim), k_ctx=rand(batch, n_kv, max_ctx, head_dim),
                v_ctx=rand(batch, n_kv, max_ctx, head_dim), ctx_lens=torch.tensor([max_ctx, 5])[:batch],
                k_tree=rand(batch, n_kv, n, head_dim), v_tree=rand(batch, n_kv, n, head_dim), d=d, scale=0.125)


def _markov_args(batch=2, d=3, vocab=50, rank=4):
    g = torch.Generator().manual_seed(1)
    return dict(boundary=torch.randn(batch, d + 1, d, vocab, generator=g).to(DEVICE),
                r=torch.tensor([0, d])[:batch], bonus=torch.tensor([1, vocab - 1])[:batch],
                w1=torch.randn(vocab, rank, generator=g).to(DEVICE),
                w2=torch.randn(rank, vocab, generator=g).to(DEVICE),
                temperature=0.0, seed=0, offset=0)


def _greedy_args(batch=2, d=3, vocab=50):
    logits = torch.randn(batch, d + 1, vocab, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    return dict(target_logits=logits, draft=logits.argmax(-1)[:, :d].contiguous())


def _sample_args(batch=2, d=3, vocab=50):
    g = torch.Generator().manual_seed(3)
    return dict(p=torch.softmax(torch.randn(batch, d + 1, vocab, generator=g), -1).to(DEVICE),
                q=torch.softmax(torch.randn(batch, d, vocab, generator=g), -1).to(DEVICE),
                draft=torch.randint(0, vocab, (batch, d), generator=g).to(DEVICE),
                u_accept=torch.rand(batch, d, generator=g).to(DEVICE),
                u_bonus=torch.rand(batch, generator=g).to(DEVICE))


OPS = {"tree_attention": (ops.tree_attention, _tree_args), "markov_head": (ops.markov_head, _markov_args),
       "verify_greedy": (ops.verify_greedy, _greedy_args), "verify_sample": (ops.verify_sample, _sample_args)}


def _results_equal(a, b):
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, atol=2e-5, rtol=2e-5)


def test_backend_selection(monkeypatch):
    monkeypatch.delenv("DPARA_RT_OPS", raising=False)
    assert ops.backend(torch.device("cpu")) == "host"
    monkeypatch.setenv("DPARA_RT_OPS", "torch")
    assert ops.backend(torch.device("cpu")) == "torch"
    monkeypatch.setenv("DPARA_RT_OPS", "triton")
    assert ops.backend(torch.device("cpu")) == "triton"
    monkeypatch.setenv("DPARA_RT_OPS", "cuda")
    with pytest.raises(ValueError, match="DPARA_RT_OPS='cuda'"):
        ops.backend(torch.device("cpu"))


@pytest.mark.parametrize("name", sorted(OPS))
def test_forced_backends_agree(monkeypatch, name):
    fn, make = OPS[name]
    monkeypatch.setenv("DPARA_RT_OPS", "torch")
    want = fn(**make())
    monkeypatch.setenv("DPARA_RT_OPS", "triton")
    _results_equal(fn(**make()), want)
    monkeypatch.setenv("DPARA_RT_OPS", "host")
    _results_equal(fn(**make()), want)


def test_markov_head_sampling_through_ops_returns_q(monkeypatch):
    args = _markov_args() | dict(temperature=0.9, seed=4, offset=7)
    monkeypatch.setenv("DPARA_RT_OPS", "torch")
    draft, q = ops.markov_head(**args)
    monkeypatch.setenv("DPARA_RT_OPS", "triton")
    draft_t, q_t = ops.markov_head(**args)
    assert torch.equal(draft, draft_t) and q.shape == (2, 3, 50)
    torch.testing.assert_close(q, q_t)


def _replace(args: dict, **changes) -> dict:
    return args | changes


# (op, how to break its arguments, what the message must say)
BAD = [
    ("tree_attention", lambda a: _replace(a, d=3), r"expected \(d\+1\)\*\*2 = 16"),
    ("tree_attention", lambda a: _replace(a, d=0), r"d = 0 .* expected 1\.\.32"),
    ("tree_attention", lambda a: _replace(a, d=40), r"d = 40 .* expected 1\.\.32"),
    ("tree_attention", lambda a: _replace(a, k_ctx=a["k_ctx"].half()), "k_ctx has dtype torch.float16"),
    ("tree_attention", lambda a: _replace(a, v_tree=a["v_tree"][:, :, :-1]), r"v_tree has shape .*\[B, Hkv, Q, D\]"),
    ("tree_attention", lambda a: _replace(a, k_ctx=a["k_ctx"][:, :1], v_ctx=a["v_ctx"][:, :1]),
     r"k_tree has shape \(2, 2, 9, 64\), expected \[B, Hkv, Q, D\] = \(2, 1, 9, 64\)"),
    ("tree_attention", lambda a: _replace(a, q=a["q"][:, :3]), "multiple of the 2 kv heads"),
    ("tree_attention", lambda a: _replace(a, ctx_lens=torch.tensor([31, 0])),
     r"ctx_lens holds 31, expected .*\[0, 31\)"),
    ("tree_attention", lambda a: _replace(a, ctx_lens=torch.tensor([1.0, 2.0])), "ctx_lens must hold integer"),
    ("tree_attention", lambda a: _replace(a, scale=-1.0), "scale = -1.0"),
    ("tree_attention", lambda a: _replace(a, q=a["q"].transpose(2, 3).contiguous().transpose(2, 3)),
     "q must be contiguous in its last dimension"),
    ("markov_head", lambda a: _replace(a, r=torch.tensor([0, 4])), r"r holds 4, expected values in \[0, 4\)"),
    ("markov_head", lambda a: _replace(a, r=torch.tensor([-1, 0])), r"r holds -1"),
    ("markov_head", lambda a: _replace(a, bonus=torch.tensor([50, 0])),
     r"bonus holds 50, expected values in \[0, 50\)"),
    ("markov_head", lambda a: _replace(a, w2=a["w2"][:, :49]), r"w2 has shape \(4, 49\), expected \[R, V\]"),
    ("markov_head", lambda a: _replace(a, w1=a["w1"].double()), "w1 must be float32/bfloat16/float16"),
    ("markov_head", lambda a: _replace(a, w2=a["w2"].half()), "w2 has dtype torch.float16 but w1"),
    ("markov_head", lambda a: _replace(a, w2=a["w2"].T.contiguous().T), "w2 must be contiguous"),
    ("markov_head", lambda a: _replace(a, boundary=a["boundary"].transpose(2, 3).contiguous().transpose(2, 3)),
     "boundary must be contiguous in its last dimension"),
    ("markov_head", lambda a: _replace(a, boundary=torch.zeros(2, 1, 33, 50, device=DEVICE)), r"d = 33"),
    ("markov_head", lambda a: _replace(a, bonus=torch.tensor([[1, 2]])), "bonus must have 1 dimensions"),
    ("markov_head", lambda a: _replace(a, temperature=float("nan")), "temperature = nan"),
    ("markov_head", lambda a: _replace(a, temperature=-0.5), "temperature = -0.5"),
    ("markov_head", lambda a: _replace(a, seed=-1), r"seed = -1, expected an int in \[0, 2\*\*63\)"),
    ("markov_head", lambda a: _replace(a, offset=1 << 64), "offset = "),
    ("verify_greedy", lambda a: _replace(a, draft=a["draft"][:, :2]), r"draft has shape \(2, 2\), expected \[B, d\]"),
    ("verify_greedy", lambda a: _replace(a, draft=a["draft"].float()), "draft must hold integer"),
    ("verify_greedy", lambda a: _replace(a, target_logits=a["target_logits"][:, :1]), r"d = 0"),
    ("verify_greedy", lambda a: _replace(a, draft=a["draft"] + 50), r"draft holds \d+, expected values in \[0, 50\)"),
    ("verify_sample", lambda a: _replace(a, u_bonus=torch.ones(2, device=DEVICE)), r"u_bonus holds 1.0"),
    ("verify_sample", lambda a: _replace(a, u_accept=torch.full((2, 3), float("nan"), device=DEVICE)),
     "u_accept holds nan"),
    ("verify_sample", lambda a: _replace(a, q=a["q"][:, :, :49]), r"q has shape \(2, 3, 49\), expected \[B, d, V\]"),
    ("verify_sample", lambda a: _replace(a, draft=a["draft"] - 60), r"draft holds -\d+"),
    ("verify_sample", lambda a: _replace(a, p=a["p"].to(torch.int64)), "p must be float32/bfloat16/float16"),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name,breaker,message", BAD, ids=lambda v: v if isinstance(v, str) else "")
def test_bad_inputs_raise_before_launch(monkeypatch, backend, name, breaker, message):
    monkeypatch.setenv("DPARA_RT_OPS", backend)
    fn, make = OPS[name]
    with pytest.raises(ValueError, match=message):
        fn(**breaker(make()))


def test_triton_head_dim_limit_is_reported(monkeypatch):
    monkeypatch.setenv("DPARA_RT_OPS", "triton")
    args = _tree_args(head_dim=48)
    with pytest.raises(ValueError, match="head_dim = 48 is not supported by the Triton kernel"):
        ops.tree_attention(**args)
    monkeypatch.setenv("DPARA_RT_OPS", "torch")
    assert ops.tree_attention(**args).shape == args["q"].shape  # the reference takes any head_dim


def test_package_works_without_triton():
    """With `import triton` blocked: dpara_rt.ops imports, CPU ops run, forcing triton says what is missing."""
    script = textwrap.dedent("""
        import os, sys, torch
        sys.modules["triton"] = None  # any `import triton` now raises ImportError
        from dpara_rt import ops
        logits = torch.randn(2, 4, 30)
        r, bonus = ops.verify_greedy(logits, logits.argmax(-1)[:, :3].contiguous())
        assert r.tolist() == [3, 3], r
        draft, q = ops.markov_head(torch.randn(1, 1, 2, 30), torch.zeros(1, dtype=torch.long),
                                   torch.zeros(1, dtype=torch.long), torch.randn(30, 2), torch.randn(2, 30), 1.0)
        assert draft.shape == (1, 2) and q.shape == (1, 2, 30)
        os.environ["DPARA_RT_OPS"] = "triton"
        try:
            ops.verify_greedy(logits, logits.argmax(-1)[:, :3].contiguous())
        except RuntimeError as exc:
            assert "optional `triton` package" in str(exc), exc
        else:
            raise AssertionError("forcing triton without triton did not fail")
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("DPARA_RT_OPS", "TRITON_INTERPRET")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_forcing_triton_on_cpu_without_interpreter_is_explained():
    script = textwrap.dedent("""
        import os, torch
        os.environ["DPARA_RT_OPS"] = "triton"
        from dpara_rt import ops
        logits = torch.randn(1, 2, 10)
        try:
            ops.verify_greedy(logits, logits.argmax(-1)[:, :1].contiguous())
        except RuntimeError as exc:
            assert "set TRITON_INTERPRET=1" in str(exc), exc
            print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_batch_gives_empty_results(monkeypatch, backend):
    monkeypatch.setenv("DPARA_RT_OPS", backend)
    r, bonus = ops.verify_greedy(torch.randn(0, 3, 10, device=DEVICE),
                                 torch.zeros(0, 2, dtype=torch.long, device=DEVICE))
    assert r.shape == bonus.shape == (0,)
    draft, q = ops.markov_head(torch.randn(0, 2, 2, 10, device=DEVICE), torch.zeros(0, dtype=torch.long),
                               torch.zeros(0, dtype=torch.long), torch.randn(10, 2, device=DEVICE),
                               torch.randn(2, 10, device=DEVICE), 1.0)
    assert draft.shape == (0, 2) and q.shape == (0, 2, 10)
