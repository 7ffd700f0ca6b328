"""The engine: puts the target and the drafter on lanes and runs one decoding method over a batch.

    eng = Engine(target_model, drafter, method="dpara", d=7)
    out = eng.generate([[1, 2, 3], [4, 5]], max_new_tokens=64)
    out.tokens, out.stats.tau, out.stats.exposed_draft_ms

Placement: ``split`` gives the target and the drafter a device each (two CUDA devices, or on the CPU two
host lanes pinned to a core each); ``colocated`` (DPara-single) puts both lanes on one device (two streams
of one GPU, or two host lanes sharing one core).
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from dpara_rt.methods import ar, dpara, dspark, psd
from dpara_rt.methods.common import DecodeOptions, Decoder, Lane
from dpara_rt.models.drafter import check_target_compatible
from dpara_rt.models.target import Target
from dpara_rt.stats import Stats, summarize

METHODS = ("ar", "dspark", "psd", "dpara", "auto")
AUTO_CANDIDATES = ("dspark", "dpara")
PLACEMENTS = ("split", "colocated")
MAX_D = 32
GIL_SWITCH_S = 2e-4


@dataclass
class Output:
    tokens: list[list[int]]
    stats: Stats


class Engine:
    def __init__(self, target, drafter=None, method: str = "dpara", d: int = 7, placement: str = "split",
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, max_batch: int = 16,
                 max_len: int = 2048, eos_ids: Sequence[int] | None = None, psd_policy: str = "pearl",
                 ssd_fanout: int = 4, threads_per_lane: int = 1):
        if method not in METHODS:
            raise ValueError(f"method {method!r}; expected one of {METHODS}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement {placement!r}; expected one of {PLACEMENTS}")
        if method != "ar" and not 1 <= d <= MAX_D:
            raise ValueError(f"d = {d}; expected 1 <= d <= {MAX_D}")
        if not temperature >= 0:
            raise ValueError(f"temperature = {temperature}; expected >= 0")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p = {top_p}; expected 0 < top_p <= 1")
        if method != "ar" and top_p < 1 and temperature > 0:
            raise ValueError(f"top_p = {top_p} with speculative method {method!r}: lossless verification here "
                             "uses the full distribution; use top_p = 1 or method 'ar'")
        if psd_policy not in psd.POLICIES:
            raise ValueError(f"psd_policy {psd_policy!r}; expected one of {psd.POLICIES}")
        if ssd_fanout < 1:
            raise ValueError(f"ssd_fanout = {ssd_fanout}; expected >= 1")
        if not 1 <= max_batch <= 16:
            raise ValueError(f"max_batch = {max_batch}; expected 1..16")
        if threads_per_lane < 1:
            raise ValueError(f"threads_per_lane = {threads_per_lane}; expected >= 1")
        self.model = target
        self.drafter = drafter if method != "ar" else None
        self.method, self.placement = method, placement
        if method != "ar":
            if drafter is None:
                raise ValueError(f"method {method!r} needs a drafter; got None")
            check_target_compatible(drafter.config, target)
        self.opts = DecodeOptions(d=d if method != "ar" else 1, temperature=float(temperature), top_p=top_p,
                                  seed=seed, eos_ids=tuple(target.config.eos_token_id if eos_ids is None else eos_ids),
                                  psd_policy=psd_policy, ssd_fanout=ssd_fanout)
        layer_ids = drafter.config.layer_ids if method != "ar" else ()
        self.target = Target(target, max_batch, max_len, layer_ids)
        self.target_lane, self.drafter_lane = self._lanes(threads_per_lane)
        self.auto_choices: dict[int, str] = {}   # batch size -> method, for method="auto"

    @property
    def name(self) -> str:
        if self.method == "auto":
            return "auto" if self.placement == "split" else "auto-single"
        if self.method == "psd":
            return f"psd-{self.opts.psd_policy}"
        return "dpara-single" if self.method == "dpara" and self.placement == "colocated" else self.method

    # ------------------------------------------------------------------ placement
    def _lanes(self, threads: int) -> tuple[Lane, Lane]:
        t_dev = self.model.device
        d_dev = self.drafter.fc.weight.device if self.drafter is not None else t_dev
        if t_dev.type != d_dev.type:
            raise ValueError(f"target on {t_dev} and drafter on {d_dev}: both on CPU or both on CUDA")
        if t_dev.type == "cuda":
            if self.placement == "split" and self.drafter is not None and d_dev == t_dev:
                raise ValueError(f"placement 'split' needs the drafter on another CUDA device than the target "
                                 f"({t_dev}); found {torch.cuda.device_count()} device(s). Use placement "
                                 "'colocated' or move the drafter")
            if self.placement == "colocated" and d_dev != t_dev:
                raise ValueError(f"placement 'colocated' needs target and drafter on one device; got {t_dev} "
                                 f"and {d_dev}")
            return Lane("target", t_dev, None, threads), Lane("drafter", d_dev, None, threads)
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        # Serial methods never run both lanes at once: their lanes share cores whatever the placement.
        shared = self.placement == "colocated" or self.method in ("ar", "dspark")
        need = threads if shared else 2 * threads
        if len(cores) < need:
            raise ValueError(f"placement {self.placement!r} with {threads} thread(s) per lane needs {need} CPU "
                             f"cores; this process may use {len(cores)} ({cores})")
        t_cores = cores[:threads]
        d_cores = t_cores if shared else cores[threads:2 * threads]
        return Lane("target", t_dev, t_cores, threads), Lane("drafter", d_dev, d_cores, threads)

    # ------------------------------------------------------------------ decoding
    def _check_prompts(self, prompts):
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"prompts = {prompts!r}; expected a non-empty list of token-id lists")
        if len(prompts) > self.target.max_batch:
            raise ValueError(f"batch of {len(prompts)} prompts exceeds max_batch {self.target.max_batch}")
        self.target.check_prompts([list(p) for p in prompts])

    def stream(self, prompts: list[list[int]], max_new_tokens: int = 64, trace: bool = False
               ) -> Iterator[list[list[int]]]:
        """Yield, every round, the new tokens committed per request (the first yield is the prefill's token).
        After the iterator ends, ``self.last_stats`` holds the statistics."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {max_new_tokens!r}; expected a positive integer")
        self._check_prompts(prompts)
        prompts = [list(map(int, p)) for p in prompts]
        method = self.auto_choice(prompts, max_new_tokens) if self.method == "auto" else self.method
        yield from self._decode(method, prompts, max_new_tokens, trace)
        if self.method == "auto":
            self.last_stats.method = f"{self.name}({method})"

    def auto_choice(self, prompts: list[list[int]], max_new_tokens: int) -> str:
        """Adaptive mode: the first time a batch size is seen, time a short run of dspark and of dpara on these
        prompts with the engine's placement, and keep the faster per committed token for that batch size."""
        B = len(prompts)
        if B not in self.auto_choices:
            n = min(4 * (self.opts.d + 1), max_new_tokens)  # short, and within what the cache was sized for
            cost = {}
            for method in AUTO_CANDIDATES:
                for _ in self._decode(method, prompts, n, False):
                    pass
                cost[method] = self.last_stats.wall_s / max(self.last_stats.new_tokens, 1)
            self.auto_choices[B] = min(cost, key=cost.get)
        return self.auto_choices[B]

    def _decode(self, method: str, prompts: list[list[int]], max_new_tokens: int, trace: bool):
        self.opts.max_new_tokens = max_new_tokens
        dec = Decoder(self.target, self.drafter, self.target_lane, self.drafter_lane, self.opts,
                      needs_drafter=method != "ar")
        rounds = {"ar": ar.run, "dspark": dspark.run, "dpara": dpara.run,
                  "psd": lambda dec: psd.run(dec, self.opts.psd_policy, self.opts.ssd_fanout)}[method]
        new_tokens = 0
        t0 = time.perf_counter()
        with torch.inference_mode(), _main_thread_threads(1):
            first = dec.start(prompts)
            new_tokens += sum(map(len, first))
            yield first
            for new in rounds(dec):
                new_tokens += sum(map(len, new))
                yield new
        self.last_stats = summarize(dec, self.name if method == self.method else method, len(prompts),
                                    time.perf_counter() - t0, new_tokens, trace)

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 64, trace: bool = False) -> Output:
        tokens = [[] for _ in prompts]
        for new in self.stream(prompts, max_new_tokens, trace):
            for out, t in zip(tokens, new):
                out.extend(t)
        return Output(tokens, self.last_stats)


@contextlib.contextmanager
def _main_thread_threads(n: int):
    # The caller's thread only drains results; the lanes set their own intra-op threads. The lanes hand the GIL
    # to each other at every link, so a short switch interval keeps a waiting link from idling up to 5 ms.
    old, old_switch = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(n)
    sys.setswitchinterval(GIL_SWITCH_S)
    try:
        yield
    finally:
        torch.set_num_threads(old)
        sys.setswitchinterval(old_switch)
