"""A target directory whose config.json (or generation_config.json) has a wrong type or an impossible value: every
loader and the CLI end in one line naming the field and the file (dpara_rt.models.config_check), fast, never a
traceback nor a fall-through to transformers."""
import json
import time

import pytest

from dpara_rt.assets import TINY_DIR
from dpara_rt.models.config_check import ConfigError, check_config
from dpara_rt.models.hf_target import load_target
from dpara_rt.models.loader import load_qwen3
from dpara_rt.models.qwen3 import Qwen3Config
from dpara_rt.serving.text import model_eos_ids
from dpara_rt.tools import cli as cli_module

GOOD = json.loads((TINY_DIR / "target" / "config.json").read_text())

# (field as the message names it, its bad value, what the message says); a dotted field is nested
CASES = [
    ("hidden_size", "64", "'64' (str); expected a positive int"),
    ("hidden_size", 0, "0 (int); expected a positive int"),
    ("num_hidden_layers", 8.0, "8.0 (float); expected a positive int"),
    ("num_hidden_layers", True, "True (bool); expected a positive int"),
    ("vocab_size", None, "None (NoneType); expected a positive int"),
    ("vocab_size", -5, "-5 (int); expected a positive int"),
    ("intermediate_size", [768], "[768] (list); expected a positive int"),
    ("num_attention_heads", 0, "0 (int); expected a positive int"),
    ("num_attention_heads", "4", "'4' (str)"),
    ("num_key_value_heads", 0, "0 (int); expected a positive int or null"),
    ("num_key_value_heads", 3, "num_attention_heads = 4 is not a multiple of num_key_value_heads = 3"),
    ("head_dim", 64.5, "64.5 (float); expected a positive int or null"),
    ("max_position_embeddings", "4096", "'4096' (str); expected a positive int or null"),
    ("rms_norm_eps", "1e-6", "'1e-6' (str); expected a finite number > 0 or null"),
    ("rms_norm_eps", 0, "0 (int); expected a finite number > 0"),
    ("rope_theta", "10000", "'10000' (str); expected a finite number > 0 or null"),
    ("rope_theta", -1.0, "-1.0 (float); expected a finite number > 0"),
    ("rope_parameters.rope_theta", "1e4", "'1e4' (str); expected a finite number > 0"),
    ("rope_parameters.rope_type", 1, "1 (int); expected a string"),
    ("rope_parameters", "default", "'default' (str); expected an object or null"),
    ("rope_scaling", [1], "[1] (list); expected an object or null"),
    ("eos_token_id", "0", "'0' (str); expected a token id (an int >= 0) or a list of them"),
    ("eos_token_id", [0, "1"], "[0, '1'] (list); expected a token id"),
    ("eos_token_id", -1, "-1 (int); expected a token id"),
    ("tie_word_embeddings", "false", "'false' (str); expected true or false or null"),
    ("attention_bias", 0, "0 (int); expected true or false"),
    ("use_sliding_window", "no", "'no' (str); expected true or false"),
    ("model_type", 3, "3 (int); expected a string"),
    ("architectures", "Qwen3ForCausalLM", "'Qwen3ForCausalLM' (str); expected a list of strings"),
    ("hidden_act", None, None),  # null: the default (silu); not an error
    ("hidden_act", ["silu"], "['silu'] (list); expected a string"),
    ("dtype", 16, "16 (int); expected a string or null"),
    ("torch_dtype", ["bfloat16"], "(list); expected a string or null"),
    ("moe_intermediate_size", "1", "'1' (str); expected a positive int or null"),
    ("layer_norm_eps", "x", "'x' (str); expected a finite number > 0 or null"),
    ("text_config", [], "[] (list); expected an object or null"),
    ("text_config.hidden_size", "64", "'64' (str); expected a positive int"),
    ("text_config.eos_token_id", "2", "'2' (str); expected a token id"),
]
BAD = [c for c in CASES if c[2] is not None]


def _with(config: dict, field: str, value) -> dict:
    d = json.loads(json.dumps(config))
    *outer, name = field.split(".")
    node = d
    for key in outer:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[name] = value
    return d


def _target_dir(tmp_path, config: dict, generation: dict | None = None):
    root = tmp_path / "target"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    (root / "model.safetensors").symlink_to(TINY_DIR / "target" / "model.safetensors")
    (root / "tokenizer.json").symlink_to(TINY_DIR / "tokenizer.json")
    if generation is not None:
        (root / "generation_config.json").write_text(json.dumps(generation))
    return root


def _one_line(e: Exception, *fragments: str) -> None:
    text = str(e)
    assert "\n" not in text, text
    for f in fragments:
        assert f in text, (f, text)


def _run_cli(capsys, *args) -> tuple[int, str]:
    try:
        rc = cli_module.main([*map(str, args)])
    except SystemExit as e:
        rc = e.code
    _, err = capsys.readouterr()
    return rc, err


@pytest.mark.parametrize("field, value, says", BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_a_bad_field_is_one_line_naming_it_and_the_file(tmp_path, capsys, field, value, says):
    root = _target_dir(tmp_path, _with(GOOD, field, value))
    where = f"config.json in {root}"
    named = says if "not a multiple" in says else f"{field} = "
    t0 = time.perf_counter()
    for load in (load_target, load_qwen3, lambda r: Qwen3Config.from_json(r / "config.json")):
        with pytest.raises(ConfigError) as e:
            load(root)
        _one_line(e.value, where, named, says)
    assert time.perf_counter() - t0 < 10  # refused before any weights load (a float layer count took 59 s)
    if field.endswith("eos_token_id"):
        with pytest.raises(ConfigError) as e:
            model_eos_ids(root)
        _one_line(e.value, where, named, says)
    for argv in (("generate", "def f(x):", "--target", root, "--method", "ar", "--max-new-tokens", 2),
                 ("info", "--target", root)):
        rc, err = _run_cli(capsys, *argv)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc != 0 and len(lines) == 1 and "Traceback" not in err, (argv[0], err)
        assert where in err and named in err and says in err, (argv[0], err)


@pytest.mark.parametrize("field, value, says", BAD[:4], ids=[f"{f}={v!r}" for f, v, _ in BAD[:4]])
def test_a_config_given_as_a_dict_names_the_field(field, value, says):
    with pytest.raises(ConfigError) as e:
        Qwen3Config.from_dict(_with(GOOD, field, value))
    _one_line(e.value, f"config: {field} = ", says)


@pytest.mark.parametrize("value, says", [("2", "'2' (str)"), ([1, 2.0], "[1, 2.0] (list)"), ({"a": 1}, "(dict)")])
def test_a_bad_generation_config_eos_is_one_line_naming_that_file(tmp_path, capsys, value, says):
    root = _target_dir(tmp_path, GOOD, {"eos_token_id": value})
    where = f"generation_config.json in {root}"
    for load in (load_target, load_qwen3, model_eos_ids):
        with pytest.raises(ConfigError) as e:
            load(root)
        _one_line(e.value, where, "eos_token_id = ", says, "expected a token id")
    rc, err = _run_cli(capsys, "generate", "def f(x):", "--target", root, "--method", "ar", "--max-new-tokens", 2)
    assert rc != 0 and len(err.strip().splitlines()) == 1 and where in err, err


def test_nulls_where_a_default_or_text_config_stands_in_are_accepted(tmp_path):
    d = _with(_with(GOOD, "hidden_act", None), "num_key_value_heads", None)
    for name in ("head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "eos_token_id"):
        d[name] = None
    cfg = Qwen3Config.from_json(_target_dir(tmp_path, d) / "config.json")
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.eos_token_id) == (4, 64, [])
    multimodal = {"model_type": "m", "vocab_size": None, "text_config": {"vocab_size": 8192, "hidden_size": 64}}
    assert check_config(multimodal, tmp_path / "config.json") is multimodal


def test_the_cli_process_itself_prints_one_line_and_exits_2(tmp_path):
    import subprocess
    import sys
    root = _target_dir(tmp_path, _with(GOOD, "num_hidden_layers", 8.0))
    for argv in (("generate", "def f(x):", "--target", str(root), "--method", "ar"), ("info", "--target", str(root))):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "dpara_rt.tools.cli", *argv], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip() == (f"dpara-rt {argv[0]}: error: config.json in {root}: num_hidden_layers = 8.0 "
                                       "(float); expected a positive int")
        assert time.perf_counter() - t0 < 60
