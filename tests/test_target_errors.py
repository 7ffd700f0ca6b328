"""Bad checkpoints and bad inputs give errors that name the file, tensor or value."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dpara_rt.models.autoregressive import generate_ar
from dpara_rt.models.loader import CheckpointError, load_qwen3, resolve_device, resolve_dtype
from dpara_rt.models.qwen3 import Qwen3Config
from dpara_rt.models.target import Target
from dpara_rt.sampling import sample

Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture
def ckpt(tmp_path, tiny_target_dir):
    """A private copy of the tiny checkpoint to break."""
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_target_dir, dst)
    return dst


def rewrite_weights(path, edit):
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f))


def test_missing_directory_and_files(tmp_path, ckpt):
    with pytest.raises(CheckpointError, match="nowhere"):
        load_qwen3(tmp_path / "nowhere")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors file in .*ckpt"):
        load_qwen3(ckpt)
    (ckpt / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json.*does not exist"):
        load_qwen3(ckpt)


def test_corrupt_safetensors_names_the_file(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_qwen3(ckpt)
    (ckpt / "model.safetensors").write_bytes(b"\x07garbage")
    with pytest.raises(CheckpointError, match="cannot read safetensors file .*model.safetensors"):
        load_qwen3(ckpt)


def test_index_naming_a_missing_shard(make_tiny_target_dir, tmp_path):
    dst = tmp_path / "sharded"
    shutil.copytree(make_tiny_target_dir("tiny_sharded", max_shard_size="40KB"), dst)
    victim = sorted(dst.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_qwen3(dst)


@pytest.mark.parametrize("edit, message", [
    (dict(model_type="gpt2"), "model_type = 'gpt2'"),
    # a Llama config is native too, but this checkpoint's architecture is Qwen3's
    (dict(model_type="llama"), r"architectures = \['Qwen3ForCausalLM'\]; expected \['LlamaForCausalLM'\]"),
    (dict(architectures=["Qwen2ForCausalLM"]), "Qwen2ForCausalLM"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}), "rope_type = 'yarn'"),
    (dict(num_key_value_heads=3), "num_key_value_heads = 3"),
    (dict(hidden_size=-64), r"hidden_size = -64"),
])
def test_config_of_another_architecture_or_bad_value(ckpt, edit, message):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(ValueError, match=message):
        load_qwen3(ckpt)


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json.*not valid JSON"):
        load_qwen3(ckpt)


def test_wrong_shape_names_tensor_and_shapes(ckpt):
    rewrite_weights(ckpt, lambda t: t.__setitem__(Q_PROJ, torch.zeros(64, 60)))
    with pytest.raises(CheckpointError, match=rf"{Q_PROJ}.*\(64, 60\).*\(64, 64\)"):
        load_qwen3(ckpt)


def test_missing_and_unexpected_weights(ckpt):
    rewrite_weights(ckpt, lambda t: t.pop(Q_PROJ))
    with pytest.raises(CheckpointError, match=rf"lacks weights \['{Q_PROJ}'\]"):
        load_qwen3(ckpt)
    rewrite_weights(ckpt, lambda t: t.update({Q_PROJ: torch.zeros(64, 64),
                                              "model.layers.7.mlp.up_proj.weight": torch.zeros(128, 64)}))
    with pytest.raises(CheckpointError, match="layers.7.mlp.up_proj"):
        load_qwen3(ckpt)


def test_dtype_mismatch(ckpt):
    with pytest.raises(ValueError, match="torch.float64"):
        load_qwen3(ckpt, dtype=torch.float64)
    with pytest.raises(ValueError, match="'int8'"):
        resolve_dtype("int8")
    assert resolve_dtype("bf16") == torch.bfloat16
    rewrite_weights(ckpt, lambda t: t.__setitem__(Q_PROJ, torch.zeros(64, 64, dtype=torch.int8)))
    with pytest.raises(CheckpointError, match=rf"{Q_PROJ}.*stored as I8"):
        load_qwen3(ckpt)
    with pytest.raises(ValueError, match="'mps'"):
        resolve_device("mps")


def test_bad_prompts(tiny_target):
    target = Target(tiny_target, max_batch=2, max_len=16)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        target.check_prompts([[5, 6], []])
    with pytest.raises(ValueError, match="prompt 0 has 17 tokens, more than max_len 16"):
        target.check_prompts([list(range(3, 20))])
    with pytest.raises(ValueError, match="3 prompts exceed this target's max_batch 2"):
        target.check_prompts([[5]] * 3)
    with pytest.raises(ValueError, match=r"prompt 0 has token ids \[512\]"):
        target.check_prompts([[5, 512]])
    with pytest.raises(ValueError, match="non-empty list"):
        target.check_prompts([])
    with pytest.raises(ValueError, match="prompt 0 .* max_new_tokens 8 needs 22 cache slots"):
        generate_ar(target, [list(range(3, 18))], max_new_tokens=8)


def test_bad_verify_and_commit(tiny_target):
    target = Target(tiny_target, max_batch=2, max_len=16, layer_ids=[0])
    with pytest.raises(RuntimeError, match="before start"):
        target.verify(torch.zeros(2, 3, dtype=torch.long))
    target.start([list(range(3, 13)), [4]])
    with pytest.raises(ValueError, match=r"row 0: length 10 \+ 7 verify tokens exceeds max_len 16"):
        target.verify(torch.zeros(2, 7, dtype=torch.long))
    for verify in (target.verify, target.verify_argmax):  # the verify plan's path refuses the same
        with pytest.raises(ValueError, match=r"shape \(3, 2\); expected \[2, T >= 1\]"):
            verify(torch.zeros(3, 2, dtype=torch.long))
    target.verify(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"commit counts \[4, 1\]: rows \[0\] outside \[0, 3\]"):
        target.commit(torch.tensor([4, 1]))
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        target.commit(torch.tensor([1, -1]))
    with pytest.raises(ValueError, match=r"commit counts shape \(1,\); expected \(2,\)"):
        target.commit(np.array([1]))
    target.commit(np.array([3, 3]))
    with pytest.raises(ValueError, match=r"outside \[0, 0\]"):  # nothing left to commit until the next verify
        target.commit(torch.tensor([1, 0]))
    with pytest.raises(ValueError, match=r"layer_ids \[4\] contain \[4\]"):
        Target(tiny_target, 1, 8, layer_ids=[4])


def test_bad_sampling_and_config_values():
    with pytest.raises(ValueError, match="temperature = -0.5"):
        sample(torch.zeros(1, 4), temperature=-0.5)
    with pytest.raises(ValueError, match="top_p = 0"):
        sample(torch.zeros(1, 4), temperature=1.0, top_p=0)
    with pytest.raises(ValueError, match="eos_token_id contains \\[99\\]"):
        Qwen3Config(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=4, eos_token_id=[99])


def test_non_finite_weights_are_refused(ckpt):
    def poison(t):
        w = t[Q_PROJ].clone()
        w[3, 5] = float("nan")
        t[Q_PROJ] = w
    rewrite_weights(ckpt, poison)
    with pytest.raises(CheckpointError, match=rf"{Q_PROJ}.*non-finite values"):
        load_qwen3(ckpt)
