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
from dpara_rt.models.drafter import read_drafter_config, save_drafter
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
