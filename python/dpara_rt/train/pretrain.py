"""Pre-training of the small embedded target: next-token cross-entropy on a token stream.

AdamW with linear warm-up then a cosine decay over the run's *progress*, where progress is the larger of
step / max_steps and elapsed / budget: a wall-clock budget therefore gets a complete cosine schedule
whatever the machine's speed. Held-out loss is measured periodically on fixed windows of the held-out
stream. A checkpoint (model, optimizer, step, elapsed time, history) is written atomically so an
interrupted run resumes where it stopped; with a step budget the resumed run is bit-identical.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from dpara_rt.models.qwen3 import Qwen3ForCausalLM
from dpara_rt.train.loop import optimizer_step

STATE_NAME = "pretrain_state.pt"
PRECISIONS = ("auto", "bf16", "fp32")


@dataclass
class PretrainConfig:
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 2e-3
    min_lr_ratio: float = 0.1          # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    budget_minutes: float | None = 30.0
    max_steps: int | None = None
    eval_every_steps: int = 100
    eval_tokens: int = 32768           # held-out tokens scored per evaluation (fixed windows)
    precision: str = "auto"            # "auto" times one fp32 and one bf16-autocast step and keeps the faster
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every_steps: int = 100
    resume: bool = True
    progress: bool = True

    def __post_init__(self):
        self.betas = tuple(self.betas)
        for name in ("seq_len", "batch_size", "eval_every_steps", "eval_tokens", "checkpoint_every_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PretrainConfig.{name} = {value!r}; expected a positive integer")
        if self.budget_minutes is None and self.max_steps is None:
            raise ValueError("PretrainConfig: budget_minutes and max_steps are both None; set at least one")
        if self.budget_minutes is not None and not self.budget_minutes > 0:
            raise ValueError(f"PretrainConfig.budget_minutes = {self.budget_minutes!r}; expected > 0")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"PretrainConfig.max_steps = {self.max_steps!r}; expected >= 1")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0:
            raise ValueError(f"PretrainConfig: lr = {self.lr}, min_lr_ratio = {self.min_lr_ratio}, warmup_steps = "
                             f"{self.warmup_steps}; expected lr > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0")
        if self.precision not in PRECISIONS:
            raise ValueError(f"PretrainConfig.precision = {self.precision!r}; expected one of {PRECISIONS}")


@dataclass
class PretrainResult:
    step: int = 0
    elapsed_s: float = 0.0
    tokens_seen: int = 0
    precision: str = "fp32"
    precision_timing_s: dict = field(default_factory=dict)   # seconds per step measured by precision="auto"
    losses: list[float] = field(default_factory=list)         # training loss per step
    evals: list[dict] = field(default_factory=list)           # {"step", "elapsed_s", "heldout_loss"}

    @property
    def heldout_loss(self) -> float | None:
        return self.evals[-1]["heldout_loss"] if self.evals else None


def progress_of(step: int, elapsed_s: float, cfg: PretrainConfig) -> float:
    """Fraction of the run done: the budget (steps or wall clock) that is closer to running out."""
    frac = 0.0
    if cfg.max_steps is not None:
        frac = max(frac, step / cfg.max_steps)
    if cfg.budget_minutes is not None:
        frac = max(frac, elapsed_s / (60.0 * cfg.budget_minutes))
    return min(frac, 1.0)


def learning_rate(step: int, progress: float, cfg: PretrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    low = cfg.lr * cfg.min_lr_ratio
    return low + (cfg.lr - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _autocast(precision: str):
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lm_loss(model: Qwen3ForCausalLM, windows: Tensor, precision: str = "fp32") -> Tensor:
    """Mean next-token cross-entropy over windows [B, T+1] (tokens 0..T-1 predict 1..T)."""
    inputs, labels = windows[:, :-1], windows[:, 1:]
    positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    with _autocast(precision):
        logits, _ = model(inputs, positions)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def sample_windows(stream: Tensor, batch: int, seq_len: int, generator: torch.Generator) -> Tensor:
    """``batch`` random windows of seq_len + 1 tokens from ``stream``."""
    starts = torch.randint(0, stream.numel() - seq_len, (batch,), generator=generator)
    return torch.stack([stream[s: s + seq_len + 1] for s in starts.tolist()])


def heldout_windows(stream: Tensor, seq_len: int, max_tokens: int) -> Tensor:
    """Disjoint windows of seq_len + 1 tokens (stride seq_len) from the start of ``stream``, up to
    about ``max_tokens`` predicted tokens; always at least one window."""
    n = max(1, min((stream.numel() - 1) // seq_len, max_tokens // seq_len))
    return torch.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])


@torch.no_grad()
def evaluate_loss(model: Qwen3ForCausalLM, windows: Tensor, batch_size: int, precision: str = "fp32") -> float:
    """Token-weighted mean cross-entropy of ``model`` over the held-out windows [N, T+1]."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, windows.shape[0], batch_size):
        chunk = windows[i: i + batch_size]
        total += lm_loss(model, chunk, precision).item() * chunk.shape[0]
    model.train(was_training)
    return total / windows.shape[0]


def _time_step(model, opt_params, windows: Tensor, precision: str) -> float:
    """Seconds for one forward+backward; gradients are discarded so the weights do not change."""
    start = time.perf_counter()
    lm_loss(model, windows, precision).backward()
    for p in opt_params:
        p.grad = None
    return time.perf_counter() - start


def choose_precision(model, params, windows: Tensor) -> tuple[str, dict]:
    """Time fp32 against bf16 autocast on this CPU (one warm-up and one timed step each)."""
    timing = {}
    for precision in ("fp32", "bf16"):
        _time_step(model, params, windows, precision)
        timing[precision] = round(_time_step(model, params, windows, precision), 4)
    return min(timing, key=timing.get), timing


def _check_streams(train: Tensor, heldout: Tensor, cfg: PretrainConfig, vocab: int) -> None:
    for name, s in (("train", train), ("held-out", heldout)):
        if s.dim() != 1 or s.dtype != torch.long:
            raise ValueError(f"{name} stream: shape {tuple(s.shape)} dtype {s.dtype}; expected a 1-D torch.long tensor")
        if s.numel() < cfg.seq_len + 1:
            raise ValueError(f"{name} stream has {s.numel()} tokens; seq_len={cfg.seq_len} needs at least {cfg.seq_len + 1}")
        lo, hi = int(s.min()), int(s.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"{name} stream holds token ids in [{lo}, {hi}]; the model's vocab is [0, {vocab})")


def _save(model, opt, result: PretrainResult, cfg: PretrainConfig) -> None:
    os.makedirs(cfg.checkpoint_dir, exist_ok=True)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "model_config": model.config.to_dict(),
             "result": asdict(result), "config": asdict(cfg)}
    path = os.path.join(cfg.checkpoint_dir, STATE_NAME)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # a crash mid-write never leaves half a checkpoint


def _resume(model, opt, cfg: PretrainConfig) -> PretrainResult | None:
    path = os.path.join(cfg.checkpoint_dir, STATE_NAME)
    if not (cfg.resume and os.path.exists(path)):
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a damaged file
        raise ValueError(f"pretraining checkpoint {path} is damaged: {e}") from None
    if state.get("model_config") != model.config.to_dict():
        raise ValueError(f"pretraining checkpoint {path} is for model config {state.get('model_config')}; "
                         f"this run's model is {model.config.to_dict()} (use another checkpoint_dir)")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return PretrainResult(**state["result"])


def pretrain(model: Qwen3ForCausalLM, train_stream: Tensor, heldout_stream: Tensor,
             config: PretrainConfig | None = None) -> PretrainResult:
    """Train ``model`` in place (fp32 master weights) until its step or wall-clock budget runs out; the
    result's last eval is the final held-out loss."""
    cfg = config or PretrainConfig()
    _check_streams(train_stream, heldout_stream, cfg, model.config.vocab_size)
    params = list(model.parameters())  # tied embeddings appear once
    decay = [p for p in params if p.dim() > 1]
    no_decay = [p for p in params if p.dim() <= 1]  # norms: weight decay would pull them to zero
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas)
    result = _resume(model, opt, cfg) if cfg.checkpoint_dir else None
    eval_windows = heldout_windows(heldout_stream, cfg.seq_len, cfg.eval_tokens)
    model.train()
    if result is None:
        result = PretrainResult()
        if cfg.precision == "auto":
            probe = sample_windows(train_stream, cfg.batch_size, cfg.seq_len, torch.Generator().manual_seed(cfg.seed))
            result.precision, result.precision_timing_s = choose_precision(model, params, probe)
        else:
            result.precision = cfg.precision
    bar = tqdm(total=100.0, initial=round(100 * progress_of(result.step, result.elapsed_s, cfg), 1),
               desc="target pretrain", unit="%", disable=not cfg.progress,
               bar_format="{l_bar}{bar}| {n:.1f}/{total:.0f}% [{elapsed}<{remaining}{postfix}]")
    started = time.perf_counter() - result.elapsed_s
    while progress_of(result.step, result.elapsed_s, cfg) < 1.0:
        lr = learning_rate(result.step, progress_of(result.step, result.elapsed_s, cfg), cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        # the batch is a function of (seed, step) only, so a resumed run draws the same windows
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + result.step)
        loss = lm_loss(model, sample_windows(train_stream, cfg.batch_size, cfg.seq_len, g), result.precision)
        optimizer_step(opt, loss, params, cfg.grad_clip)
        result.step += 1
        result.tokens_seen += cfg.batch_size * cfg.seq_len
        result.losses.append(loss.item())
        result.elapsed_s = time.perf_counter() - started
        done = progress_of(result.step, result.elapsed_s, cfg) >= 1.0
        if done or result.step % cfg.eval_every_steps == 0:
            held = evaluate_loss(model, eval_windows, cfg.batch_size, result.precision)
            result.evals.append({"step": result.step, "elapsed_s": round(result.elapsed_s, 1), "heldout_loss": held})
            bar.write(f"target pretrain step {result.step}: train loss {loss.item():.4f}, held-out loss {held:.4f}, "
                      f"{result.elapsed_s / 60:.1f} min")
        if cfg.checkpoint_dir and (done or result.step % cfg.checkpoint_every_steps == 0):
            _save(model, opt, result, cfg)
        bar.n = round(100 * progress_of(result.step, result.elapsed_s, cfg), 1)
        bar.set_postfix(step=result.step, loss=f"{loss.item():.3f}", lr=f"{lr:.2e}", refresh=True)
    bar.close()
    model.eval()
    return result
