"""The `dpara-rt` command line: bad input gives one line and a non-zero exit, never a traceback; the main
commands run on the embedded pair."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from dpara_rt.assets import TINY_DIR


def cli(*args, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "dpara_rt.cli", *args], capture_output=True, text=True,
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
    rc, _, err = cli("demo", "--models", str(root), "--out", str(tmp_path / "o"))
    one_line_error(rc, err, victim.name, "missing")


def test_unknown_method():
    rc, _, err = cli("generate", "x = 1", "--method", "beam")
    one_line_error(rc, err, "unknown method 'beam'")


def test_out_pointing_at_a_file(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("")
    rc, _, err = cli("demo", "--out", str(f))
    one_line_error(rc, err, "is a file")


def test_out_that_cannot_be_created_or_written(tmp_path):
    rc, _, err = cli("demo", "--out", "/dev/null/sub")
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
        rc, out, err = cli("demo", "--out", str(locked))
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
    rc, _, err = cli("demo", "--batch", batch, "--out", str(tmp_path))
    one_line_error(rc, err, "--batch")


def test_generate_streams_text_equal_to_ar():
    rc, out_ar, err = cli("generate", "def add(a, b):", "--method", "ar", "--max-new-tokens", "24")
    assert rc == 0, err
    rc, out_dp, err = cli("generate", "def add(a, b):", "--method", "dpara", "--max-new-tokens", "24")
    assert rc == 0, err
    assert out_dp == out_ar and out_dp.startswith("def add(a, b):")
    assert "tau" in err


def test_info():
    rc, out, err = cli("info")
    assert rc == 0, err
    assert "cuda_compiled" in out and "embedded pair" in out


def test_demo_small_run_writes_json_and_png(tmp_path):
    rc, out, err = cli("demo", "--prompts", "2", "--max-new-tokens", "16", "--out", str(tmp_path))
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
