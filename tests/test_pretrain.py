"""The embedded model pair: stdlib corpus + BPE tokenizer, target pre-training, manifest checks, load_tiny."""
import json
import math
import shutil

import pytest
import torch

from dpara_rt.assets import (MANIFEST_FORMAT, MANIFEST_NAME, TINY_DIR, AssetError, describe_files, load_tiny,
                             read_manifest, verify_assets)
from dpara_rt.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from dpara_rt.train.pretrain import (PretrainConfig, evaluate_loss, heldout_windows, learning_rate, lm_loss,
                                     pretrain, progress_of)
from dpara_rt.train.tokenizer import (EOS_TOKEN, CodeTokenizer, encode_documents, is_heldout, load_stdlib_corpus,
                                      train_tokenizer)

torch.set_num_threads(1)

TRICKY_TEXT = ("def f(x):\r\n\treturn  x + 'héllo 🐍'  # ünïcode\n\n    \n" + EOS_TOKEN + "\x00 trailing  ")


# ---------------------------------------------------------------- corpus and tokenizer
def _fake_stdlib(root):
    files = {"os.py": "import sys\n", "json/decoder.py": "x = 1\n", "test/test_os.py": "t = 1\n",
             "site-packages/pkg/mod.py": "p = 1\n", "idlelib/editor.py": "e = 1\n",
             "email/tests/test_email.py": "m = 1\n", "asyncio/tasks.py": "async def f(): pass\n"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "latin.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))  # not UTF-8: skipped, counted
    names = [f"mod{i:02d}.py" for i in range(60)]  # enough files for both splits to be non-empty
    for name in names:
        (root / name).write_text(f"VALUE_{name[3:5]} = {name[3:5]}\n")
    return ["asyncio/tasks.py", "json/decoder.py", *names, "os.py"]


def test_corpus_rule_split_and_stats(tmp_path):
    kept = _fake_stdlib(tmp_path)
    corpus = load_stdlib_corpus(tmp_path)
    got = [rel for rel, _ in corpus.train] + [rel for rel, _ in corpus.heldout]
    assert sorted(got) == sorted(kept)  # tests, site-packages, idlelib and non-UTF-8 files are out
    assert corpus.skipped_non_utf8 == ["latin.py"]
    assert [rel for rel, _ in corpus.train] == sorted(rel for rel in kept if not is_heldout(rel))
    assert [rel for rel, _ in corpus.heldout] == sorted(rel for rel in kept if is_heldout(rel))
    stats = corpus.stats()
    assert stats["train"]["files"] + stats["heldout"]["files"] == len(kept)
    assert stats["heldout"]["bytes"] == sum(len(t.encode()) for _, t in corpus.heldout)
    with pytest.raises(ValueError, match="is not a directory"):
        load_stdlib_corpus(tmp_path / "nowhere")


def test_trained_tokenizer_round_trips_any_text(tmp_path):
    corpus = load_stdlib_corpus()
    texts = corpus.texts("train")[:3]
    tok = train_tokenizer(texts, vocab_size=4096)
    assert tok.encode(EOS_TOKEN) == [tok.eos_token_id]
    for text in (TRICKY_TEXT, texts[0][:2000], ""):
        assert tok.decode(tok.encode(text)) == text
    # merges compress code: fewer tokens than bytes
    assert len(tok.encode(texts[0])) < len(texts[0].encode()) / 2
    stream = encode_documents(tok, ["a = 1\n", "b = 2\n"])
    assert (stream == tok.eos_token_id).nonzero().flatten().tolist() == [len(tok.encode("a = 1\n")),
                                                                         stream.numel() - 1]
    tok.save(tmp_path / "t.json")
    assert CodeTokenizer.from_file(tmp_path / "t.json").encode(TRICKY_TEXT) == tok.encode(TRICKY_TEXT)
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_tokenizer(texts, vocab_size=100)
    with pytest.raises(ValueError, match="does not exist"):
        CodeTokenizer.from_file(tmp_path / "missing.json")


# ---------------------------------------------------------------- pre-training
def _tiny_model(seed=0):
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg)
    model.init_weights(generator=torch.Generator().manual_seed(seed))
    return model


def _patterned_stream(n, seed):
    """A learnable stream: token i+1 = (3 * token i + 1) mod 64, with 10% random resets."""
    g = torch.Generator().manual_seed(seed)
    out, x = [], 0
    for noise in torch.rand(n, generator=g).tolist():
        x = int(torch.randint(0, 64, (1,), generator=g)) if noise < 0.1 else (3 * x + 1) % 64
        out.append(x)
    return torch.tensor(out)


CFG = dict(seq_len=32, batch_size=8, lr=1e-2, warmup_steps=5, budget_minutes=None, eval_every_steps=10,
           eval_tokens=512, precision="fp32", progress=False)


def test_pretraining_steps_reduce_held_out_loss():
    train, held = _patterned_stream(4000, 0), _patterned_stream(1000, 1)
    model = _tiny_model()
    before = evaluate_loss(model, heldout_windows(held, 32, 512), 8)
    result = pretrain(model, train, held, PretrainConfig(max_steps=40, **CFG))
    assert result.step == 40 and result.tokens_seen == 40 * 8 * 32
    assert [e["step"] for e in result.evals] == [10, 20, 30, 40]
    assert result.heldout_loss < before - 1.0
    assert result.heldout_loss == pytest.approx(evaluate_loss(model, heldout_windows(held, 32, 512), 8))


def test_resume_is_bit_identical(tmp_path, monkeypatch):
    import dpara_rt.train.pretrain as pt

    train, held = _patterned_stream(3000, 0), _patterned_stream(500, 1)
    cfg = PretrainConfig(max_steps=12, checkpoint_dir=str(tmp_path), checkpoint_every_steps=6, **CFG)
    straight = _tiny_model()
    full = pretrain(straight, train, held, PretrainConfig(max_steps=12, **CFG))
    calls, sample = [], pt.sample_windows

    def crash_at_step_8(*args):
        calls.append(1)
        if len(calls) == 8:
            raise KeyboardInterrupt("simulated crash")
        return sample(*args)

    monkeypatch.setattr(pt, "sample_windows", crash_at_step_8)
    with pytest.raises(KeyboardInterrupt):
        pretrain(_tiny_model(), train, held, cfg)
    monkeypatch.setattr(pt, "sample_windows", sample)
    resumed = _tiny_model(seed=1)  # another init: the checkpoint must win
    res = pretrain(resumed, train, held, cfg)
    assert res.step == 12 and res.losses == full.losses
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    (tmp_path / "pretrain_state.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="is damaged"):
        pretrain(_tiny_model(), train, held, cfg)


def test_wall_clock_budget_and_schedule():
    cfg = PretrainConfig(**{**CFG, "budget_minutes": 1e-4, "warmup_steps": 4})
    model = _tiny_model()
    result = pretrain(model, _patterned_stream(2000, 0), _patterned_stream(500, 1), cfg)
    assert result.step >= 1 and result.elapsed_s >= 60 * cfg.budget_minutes and result.evals  # final eval always
    both = PretrainConfig(**{**CFG, "max_steps": 100, "budget_minutes": 10.0})
    assert progress_of(50, 60.0, both) == 0.5 and progress_of(10, 450.0, both) == 0.75
    assert learning_rate(0, 0.0, cfg) == pytest.approx(cfg.lr / 4)
    assert learning_rate(4, 0.0, cfg) == pytest.approx(cfg.lr)
    assert learning_rate(50, 1.0, cfg) == pytest.approx(cfg.lr * cfg.min_lr_ratio)
    assert learning_rate(50, 0.5, cfg) == pytest.approx(cfg.lr * (1 + cfg.min_lr_ratio) / 2)


def test_pretrain_refuses_bad_inputs():
    with pytest.raises(ValueError, match="budget_minutes and max_steps are both None"):
        PretrainConfig(budget_minutes=None, max_steps=None)
    with pytest.raises(ValueError, match="precision = 'fp8'"):
        PretrainConfig(precision="fp8")
    with pytest.raises(ValueError, match="seq_len = 0"):
        PretrainConfig(seq_len=0)
    model, ok = _tiny_model(), _patterned_stream(500, 0)
    with pytest.raises(ValueError, match=r"token ids in \[0, 64\]; the model's vocab is \[0, 64\)"):
        pretrain(model, torch.arange(65).repeat(10), ok, PretrainConfig(max_steps=1, **CFG))
    with pytest.raises(ValueError, match="needs at least 33"):
        pretrain(model, ok, ok[:10], PretrainConfig(max_steps=1, **CFG))


# ---------------------------------------------------------------- manifest and the embedded pair
def _fake_assets(root):
    (root / "target").mkdir(parents=True)
    (root / "tokenizer.json").write_text("{}")
    (root / "target" / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    files = describe_files(root, ["tokenizer.json", "target/model.safetensors"])
    (root / MANIFEST_NAME).write_text(json.dumps({"format": MANIFEST_FORMAT, "files": files}))


def test_manifest_catches_missing_and_damaged_files(tmp_path):
    _fake_assets(tmp_path)
    assert set(verify_assets(tmp_path)["files"]) == {"tokenizer.json", "target/model.safetensors"}
    weights = tmp_path / "target" / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[100] ^= 1  # one flipped bit
    weights.write_bytes(bytes(blob))
    with pytest.raises(AssetError, match=r"model\.safetensors is damaged: sha256 .* differs"):
        verify_assets(tmp_path)
    weights.unlink()
    with pytest.raises(AssetError, match=r"model\.safetensors is missing"):
        verify_assets(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(AssetError, match="manifest .* is not valid JSON"):
        verify_assets(tmp_path)
    (tmp_path / MANIFEST_NAME).unlink()
    with pytest.raises(AssetError, match="manifest .* is missing"):
        load_tiny(root=tmp_path)


def test_load_tiny_checks_the_committed_pair(tmp_path):
    # The embedded pair is committed: its absence is a failure, never a skip.
    manifest = read_manifest(TINY_DIR)
    damaged = tmp_path / "tiny"
    shutil.copytree(TINY_DIR, damaged)
    weights = damaged / "drafter" / "drafter.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1])
    with pytest.raises(AssetError, match=r"drafter\.safetensors is damaged"):
        load_tiny(root=damaged)
    assert manifest["weight_bytes"] <= 25_000_000
    assert sum(e["bytes"] for rel, e in manifest["files"].items() if rel.endswith(".safetensors")) \
        == manifest["weight_bytes"]
    assert manifest["target"]["parameters"] <= 25_000_000


def test_load_tiny_returns_a_working_pair():
    from dpara_rt.train.data import build_train_data
    from dpara_rt.train.evaluate import estimate_tau

    tok, target, drafter = load_tiny()
    manifest = read_manifest(TINY_DIR)
    assert tok.vocab_size == target.config.vocab_size == manifest["tokenizer"]["vocab_size"]
    assert tok.decode(tok.encode(TRICKY_TEXT)) == TRICKY_TEXT
    assert tok.eos_token_id in target.config.eos_token_id
    assert sum(p.numel() for p in target.parameters()) == manifest["target"]["parameters"]
    code = ('import os\n\n\ndef read_lines(path):\n    """Return the lines of a text file."""\n'
            '    with open(path) as f:\n        return [line.rstrip("\\n") for line in f]\n')
    ids = torch.tensor([tok.encode(code)])
    with torch.no_grad():
        loss = float(lm_loss(target, ids))
    assert loss < 0.5 * math.log(tok.vocab_size)  # it has learnt Python: far better than uniform guessing
    prompts = [tok.encode(code), tok.encode("class Point:\n    def __init__(self, x, y):\n")]
    data = build_train_data(target, prompts, 24, drafter.config.layer_ids, eos_ids=target.config.eos_token_id)
    d = drafter.config.block_size
    tau = {mode: estimate_tau(drafter, data, d, mode) for mode in ("dspark", "dpara")}
    untrained = type(drafter)(drafter.config, target.embed_tokens, target.lm_head)  # same shape, fresh init
    baseline = estimate_tau(untrained, data, d, "dspark")
    assert tau["dspark"] > baseline and tau["dpara"] > baseline, (tau, baseline)


def test_reuse_target_trains_only_the_drafter(tmp_path, monkeypatch):
    import dpara_rt.train.preset_tiny as preset_tiny

    calls = []

    def no_training(fn, drafter, data, heldout, knobs, d, seconds, ckpt, seed, resume):
        calls.append((fn.__name__, len(data), len(heldout)))
        return {"steps": 0, "final_loss": 0.0, "epoch_taus": [], "wall_s": 0.0}, 0.0

    monkeypatch.setattr(preset_tiny, "_train_stage", no_training)
    old = read_manifest(TINY_DIR)
    small = dict(train_sequences=3, heldout_sequences=2, max_new_tokens=16, generate_batch=4)
    out = tmp_path / "pair"
    manifest = preset_tiny.run_tiny_preset(out, drafter_minutes=1.0, work_dir=tmp_path / "work", threads=1,
                                           command="t", preset=preset_tiny.TinyPreset(**small),
                                           reuse_target=TINY_DIR)
    assert [c[0] for c in calls] == ["train_stage1", "train_stage2"] and calls[0][1:] == (3, 2)
    for rel in ("tokenizer.json", "target/model.safetensors", "target/config.json"):
        assert manifest["files"][rel] == old["files"][rel], rel  # byte-identical target and tokenizer
    assert manifest["target"]["reused_from"] == {"created": old["created"], "command": old["command"]}
    assert manifest["target"]["heldout_loss"] == old["target"]["heldout_loss"]
    assert manifest["budgets_minutes"] == {"target": old["budgets_minutes"]["target"], "drafter": 1.0}
    assert manifest["corpus"] == old["corpus"] and manifest["drafter"]["data"]["train_sequences"] == 3
    verify_assets(out)
    _, target, drafter = load_tiny(root=out)
    assert drafter.config.layer_ids == old["drafter"]["config"]["layer_ids"]

    other = preset_tiny.TinyPreset(**small, target={**preset_tiny.TinyPreset().target, "num_hidden_layers": 4})
    with pytest.raises(ValueError, match=r"--reuse-target .*target=.*num_hidden_layers.*same target preset"):
        preset_tiny.run_tiny_preset(tmp_path / "other", drafter_minutes=1.0, work_dir=tmp_path / "work2",
                                    threads=1, command="t", preset=other, reuse_target=TINY_DIR)
