"""A careless or hostile caller: whatever it does, the runtime gives a clear error or correct output, never a
crash, a hang, corrupted memory or wrong tokens. (Other probes live beside the feature they guard:
test_engine.py, test_engine_sampling.py, test_cli.py, test_target_errors.py, test_core_*.py.)"""
import json
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from dpara_rt.assets import TINY_DIR, AssetError, verify_assets
from dpara_rt.engine import Engine
from dpara_rt.models.autoregressive import generate_ar
from dpara_rt.models.drafter_io import read_drafter_config, save_drafter
from dpara_rt.models.target import Target
from engine_pairs import predictable_pair


@pytest.fixture(scope="module")
def pair():
    return predictable_pair()


PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33]]


@pytest.fixture(scope="module")
def want(pair):
    target, _ = pair
    t = Target(target, 1, 512)
    return {(i, n): generate_ar(t, [p], n, eos_ids=(2,))[0] for i, p in enumerate(PROMPTS) for n in (6, 14)}


def test_a_manifest_entry_removed_does_not_let_an_unchecked_file_load(tmp_path):
    root = tmp_path / "tiny"
    shutil.copytree(TINY_DIR, root)
    manifest = json.loads((root / "manifest.json").read_text())
    victim = sorted(manifest["files"])[0]
    del manifest["files"][victim]
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(AssetError, match=rf"\['{victim}'\] .* not listed in the manifest"):
        verify_assets(root)


def test_a_drafter_config_of_the_wrong_type_names_its_file(pair, tmp_path):
    _, drafter = pair
    save_drafter(drafter, tmp_path)
    path = tmp_path / "drafter_config.json"
    blob = json.loads(path.read_text())
    blob["config"]["num_layers"] = "1"
    path.write_text(json.dumps(blob))
    with pytest.raises(ValueError, match=r"bad drafter config .*drafter_config.json: num_layers='1': expected a "
                                         "positive integer"):
        read_drafter_config(tmp_path)


ACTIONS = st.lists(st.one_of(
    st.tuples(st.just("stream"), st.integers(0, 3), st.sampled_from([6, 14]), st.integers(0, 4)),
    st.tuples(st.just("generate"), st.integers(0, 3), st.sampled_from([6, 14])),
    st.tuples(st.just("resume"), st.integers(0, 5), st.integers(1, 20)),
    st.tuples(st.just("close"), st.integers(0, 5)),
), min_size=1, max_size=8)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=ACTIONS, method=st.sampled_from(["dspark", "dpara"]))
def test_streams_created_abandoned_and_interleaved_never_corrupt_output(pair, want, actions, method):
    """Streams opened, partly consumed, abandoned or resumed, and generate calls, in any order: every call that
    completes returns AR's tokens; a stream a newer call cancelled says so when resumed."""
    target, drafter = pair
    eng = Engine(target, drafter, method=method, d=4)
    streams = []  # [iterator, key, tokens so far, live]
    for act in actions:
        if act[0] == "stream":
            _, i, n, consume = act
            it = eng.stream([PROMPTS[i]], n)
            entry = [it, (i, n), [], True]
            streams.append(entry)
            _advance(entry, consume, want)
        elif act[0] == "generate":
            _, i, n = act
            assert eng.generate([PROMPTS[i]], n).tokens[0] == want[(i, n)]
        elif act[0] == "resume" and streams:
            _advance(streams[act[1] % len(streams)], act[2], want)
        elif act[0] == "close" and streams:
            entry = streams[act[1] % len(streams)]
            entry[0].close()
            entry[3] = False


def _advance(entry, steps: int, want) -> None:
    it, key, got, live = entry
    if not live:
        return
    for _ in range(steps):
        try:
            got += next(it)[0]
        except StopIteration:
            assert got == want[key]
            entry[3] = False
            return
        except RuntimeError as e:  # cancelled by a newer call: said so, and what came before was right
            assert "this stream was cancelled" in str(e)
            assert got == want[key][:len(got)]
            entry[3] = False
            return
    assert got == want[key][:len(got)]


def test_a_stream_left_suspended_holds_no_process_state(pair):
    target, drafter = pair
    eng = Engine(target, drafter, method="dpara", d=4)
    it = eng.stream([PROMPTS[0]], 14)
    next(it)
    x = torch.ones(3, requires_grad=True)
    (x * 2).sum().backward()  # the caller's autograd works while the stream is suspended
    assert x.grad.tolist() == [2.0, 2.0, 2.0]
    del it  # abandoned without close(): the next call still runs correctly
    assert eng.generate([PROMPTS[1]], 14).tokens[0] == generate_ar(Target(target, 1, 512), [PROMPTS[1]], 14,
                                                                   eos_ids=(2,))[0]


def _run_python(code: str, timeout: float = 120):
    """A probe in its own interpreter: a crash or a hang there fails the test instead of killing the run."""
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


CORE_PROBES = """
import torch
from dpara_rt import _core
def refused(fn, needle):
    try:
        fn()
    except ValueError as e:
        assert needle in str(e), (needle, str(e))
    else:
        raise AssertionError("accepted: " + needle)
refused(lambda: _core.Staging(1, 1, 2**63), "feature_bytes = 9223372036854775808 is out of range")
refused(lambda: _core.Staging(1, 1, 2**41), "feature_bytes = 2199023255552 is out of range")
refused(lambda: _core.Staging(1, 1, -1), "feature_bytes = -1 is out of range")
refused(lambda: _core.Staging(1.5, 1, 0), "batch = 1.5; expected an int")
refused(lambda: _core.Staging(2**31, 1, 0), "batch = 2147483648 is out of range")
refused(lambda: _core.BoundaryRing(1, 1, 2**40, 8), "d = 1099511627776 is out of range")
refused(lambda: _core.RoundState(1, 4, 8, "2", 64), "eos_ids must be a list")
refused(lambda: _core.RoundState(1, 4, 8, [2.5], 64), "eos_ids holds 2.5")
refused(lambda: _core.Metrics(2**33), "d = 8589934592 is out of range")
st, lane = _core.Staging(1, 1, 16), _core.HostLane("probe")
refused(lambda: st.copy_in(lane, "features", 0, 16, 0), "null source pointer")
refused(lambda: st.copy_out(lane, "features", 0, 16, 0), "null destination pointer")
refused(lambda: st.copy_in(lane, "features", torch.zeros(8).data_ptr(), 4096, 0), "does not fit")
src = torch.arange(4, dtype=torch.int32)
st.copy_in(lane, "features", src.data_ptr(), 16, 1)
lane.synchronize()
assert torch.from_dlpack(st.view("features", 1)).view(torch.int32).tolist() == [0, 1, 2, 3]
print("ok")
"""


def test_core_sizes_and_pointers_are_checked_before_any_memory_is_touched():
    proc = _run_python(CORE_PROBES)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_two_lanes_synchronizing_each_other_get_an_error_not_a_hang():
    code = """
import threading, time
from dpara_rt import _core
a, b = _core.HostLane("a"), _core.HostLane("b")
a_waiting = threading.Event()
def on_b():
    a_waiting.wait(); time.sleep(0.05)
    a.synchronize()        # a's task is waiting for b: refused
def on_a():
    b.submit(on_b); a_waiting.set()
    b.synchronize()        # re-raises b's refusal here
a.submit(on_a)
try:
    a.synchronize()
except RuntimeError as e:
    print("refused:", "would deadlock" in str(e))
"""
    proc = _run_python(code, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "refused: True", (proc.stdout, proc.stderr)


def test_a_task_that_never_ends_does_not_hang_interpreter_exit():
    code = """
import threading
from dpara_rt import _core
lane = _core.HostLane("stuck")
lane.submit(lambda: threading.Event().wait())   # waits for something that never happens
print("leaving")
"""
    proc = _run_python(code, timeout=90)
    assert proc.returncode == 0 and proc.stdout.strip() == "leaving", proc.stderr
    assert "host lane 'stuck' is still busy" in proc.stderr
