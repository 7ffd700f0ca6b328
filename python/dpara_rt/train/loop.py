"""Drafter training: stage 1 (DSpark: backbone + Markov head; a DFlash drafter, draft_rows "mask": backbone
only) and stage 2 (M-DFlash: backbone only on spine + branch layouts, Markov head frozen). Both resume from a
checkpoint directory, show a tqdm bar and estimate held-out tau after each epoch."""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from dpara_rt.models.drafter import Drafter
from dpara_rt.models.drafter_io import load_drafter_weights, save_drafter
from dpara_rt.train.data import TrainData
from dpara_rt.train.evaluate import estimate_tau
from dpara_rt.train.objectives import (Layout, anchor_range, dflash_layout, dspark_layout, layout_loss, mdflash_layout,
                                       sample_anchors)

STATE_NAME = "train_state.pt"


@dataclass
class TrainConfig:
    d: int | None = None              # draft length trained for; default: the drafter's block_size
    epochs: int = 1
    batch_size: int = 4               # sequences per step
    anchors_per_sequence: int = 8     # layouts packed into each sequence's forward
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    temperature: float = 1.0          # of the target distribution the drafter is matched to
    seed: int = 0
    max_steps: int | None = None
    time_limit_s: float | None = None  # stop (evaluate, checkpoint) after the first step past this budget
    spent_s: float = 0.0              # of the same time budget, spent by earlier runs (a resumed stage)
    decay_share: float = 0.0          # lr falls linearly to 0 over this last share of the budget (time or steps)
    checkpoint_dir: str | None = None
    save_every: int = 0               # steps between checkpoints (0: at the end of each epoch only)
    resume: bool = True
    progress: bool = True
    eval_max_sequences: int | None = 16

    def __post_init__(self):
        for name in ("epochs", "batch_size", "anchors_per_sequence"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)}: expected a positive integer")
        if not self.lr > 0 or self.save_every < 0:
            raise ValueError(f"TrainConfig: lr={self.lr} must be > 0 and save_every={self.save_every} >= 0")
        if not 0.0 <= self.decay_share < 1.0 or self.spent_s < 0:
            raise ValueError(f"TrainConfig: decay_share={self.decay_share} must be in [0, 1) and "
                             f"spent_s={self.spent_s} >= 0")

    def lr_at(self, progress: float) -> float:
        """Stable, then decay: ``lr`` until 1 - decay_share of the budget is spent, then linearly towards 0.
        A time budget is read by wall time, so a stage resumed with a larger budget decays at its new end."""
        if not self.decay_share:
            return self.lr
        return self.lr * min(1.0, max(0.0, 1.0 - progress) / self.decay_share)


@dataclass
class TrainResult:
    stage: str
    step: int
    losses: list[float] = field(default_factory=list)   # one per step (this run and, on resume, before)
    taus: list[float] = field(default_factory=list)     # held-out tau after each epoch


def optimizer_step(opt: torch.optim.Optimizer, loss: torch.Tensor, params, grad_clip: float | None) -> None:
    """Backward, optional gradient clipping, one optimizer step (shared by every training loop here)."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()


def train_stage1(drafter: Drafter, data: TrainData, config: TrainConfig | None = None,
                 eval_data: TrainData | None = None) -> TrainResult:
    """DSpark: train the backbone and the Markov head on random-anchor serial blocks (DFlash's block
    [anchor, MASK x d] for a drafter whose mask rows draft)."""
    drafter.requires_grad_(True)
    layout = dflash_layout if drafter.config.draft_rows == "mask" else dspark_layout
    return _train(drafter, data, config or TrainConfig(), eval_data, "stage1", layout, "dspark")


def train_stage2(drafter: Drafter, data: TrainData, config: TrainConfig | None = None,
                 eval_data: TrainData | None = None) -> TrainResult:
    """M-DFlash: fine-tune the backbone only (no new parameters) on spine + branch layouts whose spine is
    the true continuation; the Markov head's W1/W2 are frozen and left bit-identical."""
    if drafter.config.draft_rows != "anchor":
        raise ValueError(f"stage 2 trains the spine + branch layout of draft_rows 'anchor' drafters; this one has "
                         f"draft_rows={drafter.config.draft_rows!r}")
    drafter.requires_grad_(True)
    for p in drafter.markov_parameters:
        p.requires_grad_(False)
    return _train(drafter, data, config or TrainConfig(), eval_data, "stage2", mdflash_layout, "dpara")


def _check_inputs(drafter: Drafter, data: TrainData, d: int, eval_data: TrainData | None) -> None:
    if not 1 <= d <= drafter.config.block_size:
        raise ValueError(f"training d={d}: expected 1 <= d <= the drafter's block_size={drafter.config.block_size} "
                         "(raise block_size in the drafter config to train longer blocks)")
    for name, ds in (("train", data), ("held-out", eval_data)):
        if ds is not None and ds.layer_ids != drafter.config.layer_ids:
            raise ValueError(f"{name} data captured target layers {ds.layer_ids}; the drafter expects "
                             f"{drafter.config.layer_ids}")
        if ds is not None:
            ds.check_target(drafter.config.vocab_size, drafter.lm_head.weight.shape[1], name)


def _usable(data: TrainData, layout: Layout) -> torch.Tensor:
    lo, hi = anchor_range(data, layout)
    usable = (hi >= lo).nonzero().flatten()
    if usable.numel() == 0:
        raise ValueError(f"no training sequence is long enough for a {layout.name} layout with d={layout.d}: "
                         f"need length >= prompt_len + {layout.reach + 2}, longest is {int(data.lengths.max())}")
    return usable


def _save(drafter, opt, result: TrainResult, cfg: TrainConfig, d: int) -> None:
    save_drafter(drafter, cfg.checkpoint_dir)
    state = {"stage": result.stage, "d": d, "step": result.step, "optimizer": opt.state_dict(),
             "losses": result.losses, "taus": result.taus, "config": asdict(cfg)}
    tmp = os.path.join(cfg.checkpoint_dir, STATE_NAME + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, os.path.join(cfg.checkpoint_dir, STATE_NAME))  # a crash never leaves half a state


def _resume(drafter, opt, result: TrainResult, cfg: TrainConfig, d: int) -> None:
    file = os.path.join(cfg.checkpoint_dir, STATE_NAME)
    if not (cfg.resume and os.path.exists(file)):
        return
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a damaged pickle
        raise ValueError(f"corrupt training state {file}: {e}") from None
    if state.get("stage") != result.stage or state.get("d") != d:
        raise ValueError(f"{file} is a {state.get('stage')} checkpoint with d={state.get('d')}; "
                         f"this run is {result.stage} with d={d} (use another checkpoint_dir)")
    load_drafter_weights(drafter, cfg.checkpoint_dir)
    opt.load_state_dict(state["optimizer"])
    result.step, result.losses, result.taus = state["step"], list(state["losses"]), list(state["taus"])


def _train(drafter: Drafter, data: TrainData, cfg: TrainConfig, eval_data: TrainData | None, stage: str,
           make_layout, eval_mode: str) -> TrainResult:
    d = cfg.d or drafter.config.block_size
    _check_inputs(drafter, data, d, eval_data)
    layout = make_layout(d)
    usable = _usable(data, layout)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    result = TrainResult(stage, 0)
    if cfg.checkpoint_dir:
        _resume(drafter, opt, result, cfg, d)
    per_epoch = math.ceil(len(usable) / cfg.batch_size)
    total = cfg.epochs * per_epoch if cfg.max_steps is None else min(cfg.max_steps, cfg.epochs * per_epoch)
    bar = tqdm(total=total, initial=result.step, desc=f"drafter {stage}", disable=not cfg.progress)
    drafter.train()
    started = time.monotonic()

    def progress() -> float:  # the share of the budget spent before this step
        if cfg.time_limit_s is None:
            return result.step / total
        budget = cfg.spent_s + cfg.time_limit_s
        return (cfg.spent_s + time.monotonic() - started) / budget if budget > 0 else 1.0

    while result.step < total:
        epoch, i = divmod(result.step, per_epoch)
        # order and anchors are functions of (seed, epoch, step): a resumed run sees the same batches
        order = usable[torch.randperm(len(usable), generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))]
        index = order[i * cfg.batch_size:(i + 1) * cfg.batch_size]
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + result.step)
        anchors = sample_anchors(data, index, layout, cfg.anchors_per_sequence, g)
        loss = layout_loss(drafter, data, index, anchors, layout, cfg.ce_weight, cfg.tv_weight, cfg.temperature)
        for group in opt.param_groups:  # also overrides the lr a resumed optimizer state brings
            group["lr"] = cfg.lr_at(progress())
        optimizer_step(opt, loss, params, cfg.grad_clip)
        result.step += 1
        result.losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{result.losses[-1]:.4f}", epoch=epoch)
        out_of_time = cfg.time_limit_s is not None and time.monotonic() - started > cfg.time_limit_s
        epoch_end = result.step % per_epoch == 0 or result.step == total or out_of_time
        if epoch_end and eval_data is not None:
            drafter.eval()
            tau = estimate_tau(drafter, eval_data, d, eval_mode, cfg.eval_max_sequences)
            drafter.train()
            result.taus.append(tau)
            bar.write(f"drafter {stage} epoch {epoch + 1}: step {result.step}, "
                      f"held-out tau ({eval_mode}, d={d}) = {tau:.3f}")
        if cfg.checkpoint_dir and (epoch_end or (cfg.save_every and result.step % cfg.save_every == 0)):
            _save(drafter, opt, result, cfg, d)
        if out_of_time:
            bar.write(f"drafter {stage}: time limit {cfg.time_limit_s} s reached at step {result.step}")
            break
    bar.close()
    drafter.eval()
    return result
