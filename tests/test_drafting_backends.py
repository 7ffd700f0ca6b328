"""The drafting-backend seam: the generic round imports nothing host-only, both backends implement the whole
interface, and every method's greedy output is AR's on both (sampled decodes are each backend's own law, the same
draws on both where the host's mechanisms keep the bits)."""
from __future__ import annotations

import ast
import pathlib

import pytest

import dpara_rt
from dpara_rt.drafting import DeviceBackend, DraftingBackend
from dpara_rt.engine import Engine
from dpara_rt.host.backend import HostBackend
from dpara_rt.methods import VARIANTS, variant
from engine_pairs import predictable_pair

PACKAGE = pathlib.Path(dpara_rt.__file__).parent
GENERIC = ("round", "methods", "drafting")  # the generic round: the same code on every device


def _imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


@pytest.mark.parametrize("package", GENERIC)
def test_the_generic_round_never_imports_the_host_backend(package):
    files = sorted((PACKAGE / package).rglob("*.py"))
    assert files, f"no modules under {PACKAGE / package}"
    offenders = {f.relative_to(PACKAGE).as_posix(): sorted(i for i in _imports(f) if i.startswith("dpara_rt.host"))
                 for f in files}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_no_module_imports_a_private_name_of_another():
    bad = []
    for f in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dpara_rt"):
                bad += [f"{f.relative_to(PACKAGE)}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__") and node.module != "dpara_rt"
                        and a.name != "_core"]
    assert not bad, bad


def test_both_backends_implement_every_call_of_the_interface():
    calls = [n for n, v in vars(DraftingBackend).items() if callable(v) and not n.startswith("_")]
    assert len(calls) >= 14, calls
    for backend in (DeviceBackend, HostBackend):
        missing = [n for n in calls if getattr(backend, n) is getattr(DraftingBackend, n)]
        assert not missing, (backend.__name__, missing)


def test_from_dpara_rt_import_engine():
    from dpara_rt import Engine as E, load_pair  # noqa: F401
    assert E is Engine


@pytest.fixture(scope="module")
def pair():
    return predictable_pair()


NAMES = [n for n in VARIANTS if not n.startswith("auto")]


@pytest.mark.parametrize("drafting", ["device", "host"])
def test_every_methods_greedy_output_is_ars_on_both_backends(pair, drafting):
    target, drafter = pair
    prompts = [[3, 9, 4, 1], [7, 7, 2, 5, 6, 8]]
    ar = Engine(target, None, method="ar").generate(prompts, 24).tokens
    for name in NAMES:
        if name == "ar":
            continue
        eng = Engine(target, drafter, **variant(name), d=4, drafting=drafting)
        try:
            assert eng.drafting == drafting
            for batch in (1, 2):
                assert eng.generate(prompts[:batch], 24).tokens == ar[:batch], (name, drafting, batch)
            # a process only where the host backend runs DPara's drafting on cores of its own
            assert (eng._worker is not None) == (drafting == "host" and name in ("dpara", "dpara-logits",
                                                                                 "dpara-hidden")), name
        finally:
            eng.close()


@pytest.mark.parametrize("name", ["dspark", "dpara-single", "dpara"])
def test_a_sampled_decode_draws_the_same_on_both_backends(pair, name):
    """Noise drawn ahead, q computed by the worker and the fused projection give the device backend's bits."""
    target, drafter = pair
    prompts = [[3, 9, 4, 1], [7, 7, 2, 5, 6, 8]]
    got = {}
    for drafting in ("device", "host"):
        eng = Engine(target, drafter, **variant(name), d=4, drafting=drafting)
        try:
            out = eng.generate(prompts, 24, temperature=1.0, seed=11)
        finally:
            eng.close()
        got[drafting] = (out.tokens, out.stats.acceptance_histogram)
    assert got["device"] == got["host"]


def test_the_backend_is_checked_up_front(pair):
    target, drafter = pair
    with pytest.raises(ValueError, match="drafting 'gpu'; expected one of"):
        Engine(target, drafter, drafting="gpu")
    with pytest.raises(ValueError, match="drafter_worker 'process' runs the drafter in a host process"):
        Engine(target, drafter, drafting="device", drafter_worker="process")


@pytest.fixture(scope="module")
def tiny():
    from dpara_rt.tools.compare import load_pair
    tok, target, drafter = load_pair()
    return tok, target, drafter


# the worker call each mechanism makes (noise_ahead: a backbone message carrying the noise to draw)
_CALL = {"absorb_ahead": "absorb_staged", "split": "project_branch", "guess": "guess_branch", "worker_q": "markov_q"}


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_each_host_mechanism_switches_off_and_the_drafts_stay_the_same(tiny, monkeypatch, temperature):
    from dpara_rt.host.backend import MECHANISMS
    from dpara_rt.host.worker import DrafterWorker
    tok, target, drafter = tiny
    prompt = [tok.encode("def fib(n):\n    ")]
    sent = []
    post = DrafterWorker.post
    monkeypatch.setattr(DrafterWorker, "post", lambda self, op, *a, **k: sent.append((op, a)) or post(self, op, *a, **k))
    eng = Engine(target, drafter, method="dpara", d=7, dpara_ring="hidden", drafter_worker="process")

    def decode(off: str):
        monkeypatch.setenv("DPARA_RT_HOST_OFF", off)
        sent.clear()
        out = eng.generate(prompt, 40, temperature=temperature, seed=7)
        return out.tokens, out.stats.acceptance_histogram, [op for op, _ in sent], [a for op, a in sent]

    try:
        base = decode("")
        expected = {"absorb_ahead", "split", "guess"} if temperature == 0 else {"absorb_ahead", "split", "worker_q"}
        assert {m for m, op in _CALL.items() if op in base[2]} == expected, base[2][:12]
        if temperature:  # the backbone's message names the noise the worker draws after it
            assert any(op in ("boundary", "absorb_and_fill") and a[-1] is not None for op, a in zip(base[2], base[3]))
        for mechanism in MECHANISMS:
            got = decode(mechanism)
            assert got[:2] == base[:2], mechanism
            assert _CALL.get(mechanism, "-") not in got[2], (mechanism, got[2][:12])
            if mechanism == "noise_ahead":
                assert all(a[-1] is None for op, a in zip(got[2], got[3]) if op in ("boundary", "absorb_and_fill"))
        with pytest.raises(ValueError, match=r"DPARA_RT_HOST_OFF names \['gues'\]; expected a comma-separated"):
            decode("gues")
    finally:
        eng.close()
