"""The "tiny" preset: tokenizer -> target pre-training -> drafter stage 1 (DSpark) -> stage 2 (M-DFlash),
written as the embedded model pair with a manifest (``python/dpara_rt/assets/tiny``).

    dpara-rt train --preset tiny                      (the CLI calls run_tiny_preset)
    python -m dpara_rt.train.preset_tiny [--out DIR] [--target-minutes M] [--drafter-minutes M]
                                         [--reuse-target PAIR_DIR]

Intermediate checkpoints live in a work directory outside the package (never committed); with
``--resume`` an interrupted run continues from them. The drafter budget covers its data generation
(greedy continuations of corpus snippets by the saved target) and both training stages. With
``--reuse-target`` the tokenizer and target of an existing pair are kept (checked against their manifest)
and only the drafter is trained again.
"""
from __future__ import annotations

import copy
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dpara_rt.assets import MANIFEST_FORMAT, MANIFEST_NAME, TINY_DIR, describe_files, load_tiny, verify_assets
from dpara_rt.models.drafter import Drafter, DrafterConfig
from dpara_rt.models.drafter_io import load_drafter_weights, save_drafter
from dpara_rt.models.loader import load_qwen3, save_qwen3
from dpara_rt.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from dpara_rt.train.data import TrainData, build_train_data
from dpara_rt.train.evaluate import estimate_tau
from dpara_rt.train.loop import TrainConfig, train_stage1, train_stage2
from dpara_rt.train.pretrain import PretrainConfig, evaluate_loss, heldout_windows, pretrain
from dpara_rt.train.tokenizer import TOKENIZER_FILE, CodeTokenizer, build_tokenizer, corpus_streams
from dpara_rt.train.preset_cli import manifest_head, preset_parser, run_preset

CANONICAL_COMMAND = "dpara-rt train --preset tiny"
MAX_WEIGHT_BYTES = 25 * 1000 * 1000
MAX_TARGET_PARAMS = 25_000_000
SAVE_DTYPE = torch.bfloat16


@dataclass
class TinyPreset:
    """Every knob of the preset; the manifest records it whole."""
    vocab_size: int = 8192
    target: dict = field(default_factory=lambda: dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=True))
    pretrain: dict = field(default_factory=lambda: dict(seq_len=256, batch_size=16, lr=2e-3, warmup_steps=50,
                                                        eval_every_steps=150, eval_tokens=16384,
                                                        checkpoint_every_steps=50))
    drafter: dict = field(default_factory=lambda: dict(num_layers=1, num_feature_layers=3, block_size=7,
                                                       markov_rank=128))
    prompt_len: int = 64              # drafter data: corpus snippets continued greedily by the target
    max_new_tokens: int = 96
    train_sequences: int = 2048       # 384 overfit: held-out tau 3.1 against 4+ on the training set
    heldout_sequences: int = 32
    generate_batch: int = 16
    stage1: dict = field(default_factory=lambda: dict(batch_size=8, anchors_per_sequence=8, lr=1e-3))
    stage2: dict = field(default_factory=lambda: dict(batch_size=8, anchors_per_sequence=4, lr=5e-4))
    stage1_share: float = 0.55        # of the drafter's training time left after data generation
    seed: int = 0


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # parameters() yields a tied tensor once


def _snippets(stream: torch.Tensor, count: int, length: int, generator: torch.Generator) -> list[list[int]]:
    starts = torch.randint(0, stream.numel() - length, (count,), generator=generator)
    return [stream[s: s + length].tolist() for s in starts.tolist()]


def _log(msg: str) -> None:
    print(f"[tiny {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _build_target(preset: TinyPreset, vocab_size: int, eos_id: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(vocab_size=vocab_size, eos_token_id=[eos_id], **preset.target)
    model = Qwen3ForCausalLM(config)
    model.init_weights(generator=torch.Generator().manual_seed(preset.seed))
    if _count(model) > MAX_TARGET_PARAMS:
        raise ValueError(f"tiny target has {_count(model)} parameters; the preset allows at most {MAX_TARGET_PARAMS}")
    return model


def _drafter_data(target, streams, preset: TinyPreset, layer_ids, work: Path, resume: bool) -> tuple[TrainData, TrainData]:
    """Greedy continuations of training-split snippets (train) and held-out-split snippets (evaluation)."""
    out = {}
    for k, (split, count) in enumerate((("train", preset.train_sequences), ("heldout", preset.heldout_sequences))):
        path = work / f"drafter_data_{split}.safetensors"
        if resume and path.is_file():
            out[split] = TrainData.load(path)
            continue
        g = torch.Generator().manual_seed(preset.seed + 1 + k)
        prompts = _snippets(streams[split], count, preset.prompt_len, g)
        out[split] = build_train_data(target, prompts, preset.max_new_tokens, layer_ids,
                                      eos_ids=target.config.eos_token_id, batch_size=preset.generate_batch,
                                      store_dtype=torch.bfloat16, seed=preset.seed)
        out[split].save(path)
    return out["train"], out["heldout"]


def _taus(drafter: Drafter, heldout: TrainData, d: int) -> dict:
    return {mode: round(estimate_tau(drafter, heldout, d, mode), 4) for mode in ("dspark", "dpara")}


def _train_stage(fn, drafter, data, heldout, knobs: dict, d: int, seconds: float, ckpt: Path, seed: int,
                 resume: bool) -> tuple[dict, float]:
    """Run one stage for ``seconds``; a stage that finished in an earlier run is reloaded, not re-run."""
    done = ckpt / "stage_result.json"
    if resume and done.is_file():
        load_drafter_weights(drafter, ckpt)
        summary = json.loads(done.read_text())
        return summary, summary["wall_s"]
    cfg = TrainConfig(d=d, epochs=10_000, time_limit_s=seconds, checkpoint_dir=str(ckpt), seed=seed,
                      eval_max_sequences=8, resume=resume, **knobs)
    start = time.perf_counter()
    result = fn(drafter, data, cfg, eval_data=heldout)
    wall = round(time.perf_counter() - start, 1)
    summary = {"steps": result.step, "final_loss": round(result.losses[-1], 4),
               "epoch_taus": [round(t, 4) for t in result.taus], "wall_s": wall}
    done.write_text(json.dumps(summary))
    return summary, wall


def _fresh_target(preset: TinyPreset, stage: Path, work: Path, target_minutes: float, resume: bool, walls: dict):
    """Tokenizer and target pre-training from scratch, saved into ``stage``."""
    _log("tokenizer: byte-level BPE on the stdlib training split")
    t0 = time.perf_counter()
    tokenizer, streams, corpus = build_tokenizer(stage, preset.vocab_size)
    walls["tokenizer_s"] = round(time.perf_counter() - t0, 1)
    _log(f"corpus: {json.dumps(corpus)}")

    target = _build_target(preset, tokenizer.vocab_size, tokenizer.eos_token_id)
    pcfg = PretrainConfig(budget_minutes=target_minutes, checkpoint_dir=str(work / "pretrain"), seed=preset.seed,
                          resume=resume, **preset.pretrain)
    _log(f"target: {_count(target)} parameters, pre-training for {target_minutes} min")
    t0 = time.perf_counter()
    pre = pretrain(target, streams["train"], streams["heldout"], pcfg)
    walls["target_pretrain_s"] = round(time.perf_counter() - t0, 1)
    save_qwen3(target.to(SAVE_DTYPE), stage / "target")
    # From here on everything uses the committed (bf16-rounded) weights, computed in fp32.
    target = load_qwen3(stage / "target", dtype=torch.float32)
    windows = heldout_windows(streams["heldout"], pcfg.seq_len, pcfg.eval_tokens)
    saved_loss = evaluate_loss(target, windows, pcfg.batch_size)
    _log(f"target: {pre.step} steps, held-out loss {saved_loss:.4f} (saved bf16 weights)")
    entry = {"parameters": _count(target), "config": target.config.to_dict(), "steps": pre.step,
             "tokens_seen": pre.tokens_seen, "precision": pre.precision,
             "precision_timing_s": pre.precision_timing_s, "heldout_loss": round(saved_loss, 4),
             "heldout_tokens": int(windows[:, 1:].numel()), "heldout_curve": pre.evals}
    return tokenizer, streams, corpus, target, entry


def _reused_target(preset: TinyPreset, stage: Path, pair: Path):
    """The tokenizer and target of an existing pair (sha-checked), copied into ``stage``; the corpus must
    encode to the same streams the pair was trained on."""
    old = verify_assets(pair)
    for key in ("vocab_size", "target", "pretrain"):
        if old["preset"][key] != getattr(preset, key):
            raise ValueError(f"--reuse-target {pair}: its preset has {key}={old['preset'][key]}, this preset "
                             f"{getattr(preset, key)}; a reused target must come from the same target preset")
    shutil.copy2(pair / TOKENIZER_FILE, stage / TOKENIZER_FILE)
    shutil.copytree(pair / "target", stage / "target")
    tokenizer = CodeTokenizer.from_file(stage / TOKENIZER_FILE)
    streams, corpus = corpus_streams(tokenizer)
    for split in ("train", "heldout"):
        if corpus[split]["tokens"] != old["corpus"][split]["tokens"]:
            raise ValueError(f"--reuse-target {pair}: the {split} corpus encodes to {corpus[split]['tokens']} "
                             f"tokens here, {old['corpus'][split]['tokens']} when the pair was built "
                             f"(Python {old['corpus']['python_version']}); expected the same stdlib")
    target = load_qwen3(stage / "target", dtype=torch.float32)
    entry = {**old["target"], "reused_from": {"created": old["created"], "command": old["command"]}}
    _log(f"target: reused from {pair} (built {old['created']}, held-out loss {old['target']['heldout_loss']})")
    return tokenizer, streams, corpus, target, entry, old["budgets_minutes"]["target"]


def run_tiny_preset(out_dir=TINY_DIR, target_minutes: float = 28.0, drafter_minutes: float = 45.0,
                    work_dir=None, threads: int = 2, resume: bool = False, command: str | None = None,
                    preset: TinyPreset | None = None, reuse_target=None) -> dict:
    """Build the embedded pair into ``out_dir`` (None: the package's assets/tiny; replaced only once everything
    succeeded); return the manifest. ``command`` is recorded in the manifest (default: this process's argv).
    ``reuse_target``: a pair directory whose tokenizer and target are kept; only the drafter is trained."""
    if not target_minutes > 0 or not drafter_minutes > 0:
        raise ValueError(f"target_minutes={target_minutes}, drafter_minutes={drafter_minutes}: both must be > 0")
    if threads < 1:
        raise ValueError(f"threads={threads}: expected a positive thread count")
    preset = preset or TinyPreset()
    out_dir = TINY_DIR if out_dir is None else Path(out_dir)
    work = Path(work_dir) if work_dir else Path(tempfile.gettempdir()) / "dpara_rt_tiny_work"
    if work.resolve() == out_dir.resolve() or out_dir.resolve() in work.resolve().parents:
        raise ValueError(f"work_dir {work} is inside out_dir {out_dir}; checkpoints must stay out of the assets")
    if not resume and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    stage = out_dir.parent / f".{out_dir.name}.partial"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    torch.set_num_threads(threads)
    torch.manual_seed(preset.seed)
    walls: dict[str, float] = {}
    t_all = time.perf_counter()

    if reuse_target is None:
        tokenizer, streams, corpus, target, target_entry = _fresh_target(preset, stage, work, target_minutes,
                                                                           resume, walls)
    else:
        tokenizer, streams, corpus, target, target_entry, target_minutes = _reused_target(preset, stage,
                                                                                          Path(reuse_target))

    t_drafter = time.perf_counter()
    dcfg = DrafterConfig.for_target(target.config, **preset.drafter)
    d = dcfg.block_size
    train_data, heldout_data = _drafter_data(target, streams, preset, dcfg.layer_ids, work, resume)
    walls["drafter_data_s"] = round(time.perf_counter() - t_drafter, 1)
    _log(f"drafter data: {len(train_data)} train / {len(heldout_data)} held-out continuations "
         f"({walls['drafter_data_s']} s)")
    torch.manual_seed(preset.seed)
    drafter = Drafter(dcfg, target.embed_tokens, target.lm_head)
    left = max(60.0 * drafter_minutes - (time.perf_counter() - t_drafter), 60.0)
    s1, walls["stage1_s"] = _train_stage(train_stage1, drafter, train_data, heldout_data, preset.stage1, d,
                                         left * preset.stage1_share, work / "stage1", preset.seed, resume)
    tau1 = _taus(drafter, heldout_data, d)
    _log(f"stage 1: {s1['steps']} steps, held-out tau {tau1}")
    left = max(60.0 * drafter_minutes - (time.perf_counter() - t_drafter), 60.0)
    s2, walls["stage2_s"] = _train_stage(train_stage2, drafter, train_data, heldout_data, preset.stage2, d,
                                         left, work / "stage2", preset.seed, resume)
    walls["drafter_total_s"] = round(time.perf_counter() - t_drafter, 1)
    save_drafter(copy.deepcopy(drafter).to(SAVE_DTYPE), stage / "drafter")

    files = [TOKENIZER_FILE, *(f"target/{p.name}" for p in sorted((stage / "target").iterdir())),
             *(f"drafter/{p.name}" for p in sorted((stage / "drafter").iterdir()))]
    described = describe_files(stage, files)
    weight_bytes = sum(e["bytes"] for rel, e in described.items() if rel.endswith(".safetensors"))
    if weight_bytes > MAX_WEIGHT_BYTES:
        raise RuntimeError(f"embedded weights take {weight_bytes} bytes; the preset allows {MAX_WEIGHT_BYTES}")
    manifest = {
        **manifest_head(MANIFEST_FORMAT, command, CANONICAL_COMMAND, threads,
                        tokenizers=__import__("tokenizers").__version__),
        "layout": {"tokenizer": TOKENIZER_FILE, "target": "target", "drafter": "drafter"},
        "preset": asdict(preset),
        "budgets_minutes": {"target": target_minutes, "drafter": drafter_minutes},
        "corpus": corpus,
        "tokenizer": {"vocab_size": tokenizer.vocab_size, "eos_token_id": tokenizer.eos_token_id},
        "target": target_entry,
        "drafter": {"parameters": _count(drafter), "config": dcfg.to_dict(), "d": d,
                    "data": {"train_sequences": len(train_data), "heldout_sequences": len(heldout_data),
                             "prompt_len": preset.prompt_len, "max_new_tokens": preset.max_new_tokens,
                             "generation": "greedy continuations by the saved target"},
                    "stage1": {**s1, "heldout_tau": tau1, "epoch_taus_mode": "dspark"},
                    "stage2": {**s2, "epoch_taus_mode": "dpara"}},
        "weight_bytes": weight_bytes,
        "wall_s": walls,
        "files": described,
    }
    (stage / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    # Held-out tau after stage 2 is measured on the pair exactly as committed (bf16 drafter, sha-checked).
    _, _, saved_drafter = load_tiny(root=stage)
    manifest["drafter"]["stage2"]["heldout_tau"] = _taus(saved_drafter, heldout_data, d)
    manifest["wall_s"]["total_s"] = round(time.perf_counter() - t_all, 1)
    (stage / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    _log(f"stage 2: {s2['steps']} steps, held-out tau {manifest['drafter']['stage2']['heldout_tau']}")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    stage.rename(out_dir)
    _log(f"wrote {out_dir} ({weight_bytes} bytes of weights, {manifest['wall_s']['total_s']} s in all)")
    return manifest


def main(argv=None) -> int:
    p = preset_parser("dpara_rt.train.preset_tiny", __doc__.split("\n")[0], str(TINY_DIR), threads=2)
    p.add_argument("--target-minutes", type=float, default=28.0)
    p.add_argument("--drafter-minutes", type=float, default=45.0)
    p.add_argument("--reuse-target", default=None, metavar="PAIR_DIR",
                   help="keep this pair's tokenizer and target; train only the drafter")
    return run_preset(p, argv, lambda args, command: run_tiny_preset(
        args.out, args.target_minutes, args.drafter_minutes, args.work_dir, args.threads, args.resume, command,
        reuse_target=args.reuse_target))


if __name__ == "__main__":
    sys.exit(main())
