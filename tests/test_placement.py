"""Placement: a split on one CUDA device runs colocated (with a warning) instead of failing, and the drafter may be
put on a device of its own (--drafter-device, TextGenerator's drafter_device). CUDA is faked where needed: the lanes
are host lanes, the placement decisions are the CUDA ones."""
from __future__ import annotations

import warnings

import pytest
import torch

from dpara_rt import engine as engine_module
from dpara_rt.engine import Engine
from dpara_rt.round import lanes as lanes_module
from dpara_rt.round.lanes import make_lanes, parse_device
from dpara_rt.tools import cli as cli_module
from engine_pairs import predictable_pair
from test_cli import run_main


class _FakeLane:
    def __init__(self, name, device, cores, threads):
        self.name, self.device, self.cores, self.threads = name, device, cores, threads


@pytest.fixture
def cuda_devices(monkeypatch):
    """A machine with `n` CUDA devices, as make_lanes sees it: host lanes stand in for streams."""
    def fake(n: int):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(lanes_module, "Lane", _FakeLane)
    return fake


def test_split_on_one_cuda_device_runs_colocated_with_a_warning(cuda_devices):
    cuda_devices(1)
    with pytest.warns(RuntimeWarning, match="running colocated"):
        t, d = make_lanes(torch.device("cuda:0"), torch.device("cuda"), "split", True, 1)
    assert t.placement == d.placement == "colocated"
    assert t.device == d.device == torch.device("cuda:0")


def test_split_on_two_cuda_devices_stays_split(cuda_devices):
    cuda_devices(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t, d = make_lanes(torch.device("cuda:0"), torch.device("cuda:1"), "split", True, 1)
    assert (t.placement, t.device, d.device) == ("split", torch.device("cuda:0"), torch.device("cuda:1"))


def test_serial_method_on_one_device_keeps_its_placement_silently(cuda_devices):
    cuda_devices(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t, _ = make_lanes(torch.device("cuda:0"), torch.device("cuda:0"), "split", False, 1)
    assert t.placement == "split"


def test_colocated_across_two_devices_is_refused(cuda_devices):
    cuda_devices(2)
    with pytest.raises(ValueError, match="cuda:0 and cuda:1"):
        make_lanes(torch.device("cuda:0"), torch.device("cuda:1"), "colocated", True, 1)


def test_engine_on_one_cuda_device_runs_dpara_colocated(monkeypatch):
    """The Engine's default dpara (split) as one CUDA device places it: colocated, and its output is AR's."""
    target, drafter = predictable_pair()
    prompts = [[1, 5, 9, 3], [4, 4, 7]]
    want = Engine(target, method="ar").generate(prompts, 16).tokens
    real = make_lanes

    def one_gpu(target_device, drafter_device, placement, parallel, threads):
        # the CUDA branch's decision, then host lanes with that placement
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(lanes_module, "Lane", _FakeLane)
        fake = real(torch.device("cuda:0"), torch.device("cuda:0"), placement, parallel, threads)
        monkeypatch.undo()
        return real(target_device, drafter_device, fake[0].placement, parallel, threads)

    monkeypatch.setattr(engine_module, "make_lanes", one_gpu)
    with pytest.warns(RuntimeWarning, match="running colocated"):
        eng = Engine(target, drafter, method="dpara", d=4, drafting="device", drafter_worker="thread")
    monkeypatch.undo()
    assert eng.placement == "colocated" and "colocated" in eng.name
    assert eng.generate(prompts, 16).tokens == want


@pytest.mark.parametrize("value", ["cpu", torch.device("cpu")])
def test_parse_device_takes_the_cpu(value):
    assert parse_device(value) == torch.device("cpu")


@pytest.mark.parametrize("value", ["tpu", "cuda:7", "nonsense:x", 3.5])
def test_parse_device_names_the_bad_value_and_what_is_expected(value, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="expected cpu") as info:
        parse_device(value, "--drafter-device")
    assert repr(value) in str(info.value) and "--drafter-device" in str(info.value)


def test_drafter_move_to_its_own_device_is_a_no_op():
    target, drafter = predictable_pair()
    assert drafter.move_to("cpu") is drafter and drafter.embed_tokens is target.embed_tokens


def test_text_generator_takes_a_drafter_device(tmp_path, monkeypatch):
    from dpara_rt.serving.text import TextGenerator, TextTokenizer
    from test_text import EOS, VOCAB, write_tokenizer

    target, drafter = predictable_pair(vocab=VOCAB, eos=EOS)
    tokenizer = TextTokenizer.from_dir(write_tokenizer(tmp_path))
    gen = TextGenerator.build(target, drafter, tokenizer, method="dpara", d=4, drafter_device="cpu")
    assert gen.engine.drafter.device == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="drafter_device 'cuda:1'.*expected cpu"):
        TextGenerator.build(target, drafter, tokenizer, method="dpara", drafter_device="cuda:1")


_main = run_main  # cli.main in this process (test_cli's)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_bad_drafter_device_is_one_line_naming_it(command, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = ["hi", "--method", "dpara"] if command == "generate" else ["--method", "dpara"]
    rc, out, err = _main(capsys, command, *args, "--drafter-device", "tpu")
    assert rc == 2 and out == ""
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "--drafter-device 'tpu'" in err and "expected cpu" in err, err


def test_cli_generate_with_drafter_device_cpu_equals_ar(capsys):
    rc, ar, err = _main(capsys, "generate", "def f(x):", "--method", "ar", "--max-new-tokens", 12)
    assert rc == 0, err
    rc, dp, err = _main(capsys, "generate", "def f(x):", "--drafter-device", "cpu", "--max-new-tokens", 12)
    assert rc == 0, err
    assert dp == ar
