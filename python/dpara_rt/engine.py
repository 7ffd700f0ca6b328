"""The engine: puts the target and the drafter on lanes and runs one decoding method over a batch.

    eng = Engine(target_model, drafter, method="dpara", d=7)
    out = eng.generate([[1, 2, 3], [4, 5]], max_new_tokens=64)
    out.tokens, out.stats.tau, out.stats.exposed_draft_ms

Placement: ``split`` gives the target and the drafter a device each (two CUDA devices, or on the CPU two
host lanes pinned to a core each); ``colocated`` (DPara-single) puts both lanes on one device (two streams
of one GPU, or two host lanes sharing one core). With ``split`` on the host, DPara's drafter forwards run in a
worker process (``drafter_worker``: "auto", "process" or "thread"; see dpara_rt.host.context) that the engine
starts at its first DPara decode and ``close()`` stops. ``drafting`` picks the drafting backend
(dpara_rt.drafting): "device" (torch and Triton on any device), "host" (a CPU drafter: the worker process and the
host's other mechanisms, python/dpara_rt/host/README.md) or "auto" (host for a CPU drafter, else device).
``verify_mode`` picks how the native target verifies (models/target.py): "auto" captures a CUDA graph per verify
shape on a CUDA device and runs eagerly elsewhere; "eager" never captures (debugging); "static" runs the graphs'
static-shape step eagerly. The
constructor's sampling arguments are defaults; each call may override them. Sampling draws from temperature, then
top-k (0 = off), then top-p (1 = off) with every method: speculative verification uses the same truncated target
distribution as AR, so it stays lossless.
A call may give temperature, top_p, top_k and seed per request (a sequence with one value per prompt); see
``generate`` for what a per-request seed guarantees.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import numbers
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from dpara_rt.drafting import DeviceBackend
from dpara_rt.host.backend import HostBackend
from dpara_rt.host.context import WORKER_MODES
from dpara_rt.host import sharing
from dpara_rt.host.worker import DrafterWorker
from dpara_rt.round.lanes import make_lanes
from dpara_rt.methods import AUTO, AUTO_CANDIDATES, METHODS, needs_drafter, variant, variant_name
from dpara_rt.round.options import ring_for
from dpara_rt.round.decoder import DecodeOptions, Decoder, is_int
from dpara_rt.models.drafter_io import check_target_compatible
from dpara_rt.models.hf_target import make_target
from dpara_rt.round.stats import Stats, summarize
from dpara_rt.token_ids import id_rows, is_id_array

DRAFTING_BACKENDS = ("auto", "device", "host")
MAX_BATCH = 16  # the default batch limit; serving derives one from memory (batch_for_memory)
GIL_SWITCH_S = 2e-4
# A drafter worker on cores of its own and the lane it answers spin this long for each other's messages before
# sleeping: a round's calls and replies come within a millisecond or two of each other.
WORKER_SPIN_S = 5e-3
AUTO_TURNS = 2  # timed runs per auto candidate (each keeps its best)
_CACHE_GRANULE = 256  # the KV cache grows in steps of this many tokens


@dataclass
class Output:
    tokens: list[list[int]]
    stats: Stats


class Engine:
    def __init__(self, target, drafter=None, method: str = "dpara", d: int = 7, placement: str = "split",
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                 max_batch: int = MAX_BATCH, max_len: int | None = None, eos_ids: Sequence[int] | None = None,
                 psd_policy: str = "pearl", ssd_fanout: int = 4, dpara_ring: str = "auto", threads_per_lane: int = 1,
                 drafter_worker: str = "auto", drafting: str = "auto", verify_mode: str = "auto"):
        if method != AUTO and method not in METHODS:
            raise ValueError(f"method {method!r}; expected one of {(*METHODS, AUTO)}")
        if not is_int(max_batch) or max_batch < 1:
            raise ValueError(f"max_batch = {max_batch!r}; expected an int >= 1 (see batch_for_memory)")
        if max_len is not None and (not is_int(max_len) or max_len < 2):
            raise ValueError(f"max_len = {max_len!r}; expected an int >= 2, or None (sized per call)")
        if not is_int(threads_per_lane) or threads_per_lane < 1:
            raise ValueError(f"threads_per_lane = {threads_per_lane!r}; expected an int >= 1")
        if drafter_worker not in WORKER_MODES:
            raise ValueError(f"drafter_worker {drafter_worker!r}; expected one of {WORKER_MODES}")
        if drafting not in DRAFTING_BACKENDS:
            raise ValueError(f"drafting {drafting!r}; expected one of {DRAFTING_BACKENDS}")
        on_host = drafter is not None and drafter.device.type == "cpu"
        if drafting == "host" and drafter is not None and not on_host:
            raise ValueError(f"drafting 'host' runs the drafter on the CPU host; the drafter is on {drafter.device} "
                             "(use 'device' or 'auto')")
        if drafter_worker == "process" and drafter is not None and (not on_host or drafting == "device"):
            raise ValueError(f"drafter_worker 'process' runs the drafter in a host process (the host backend); the "
                             f"drafter is on {drafter.device} with drafting {drafting!r} (use 'thread' or 'auto')")
        self.method, self.placement, self.drafter_worker = method, placement, drafter_worker
        self.drafting = ("host" if on_host else "device") if drafting == "auto" else drafting
        self._worker: DrafterWorker | None = None
        self._kept_buffers: dict = {}  # the last decode's staging and ring (Decoder._batch_buffers)
        eos_ids = target.config.eos_token_id if eos_ids is None else eos_ids
        if not isinstance(eos_ids, (list, tuple, set, frozenset)):
            raise ValueError(f"eos_ids = {eos_ids!r}; expected a list of token ids")
        cap = getattr(target.config, "max_position_embeddings", None)
        if max_len is not None and cap is not None and max_len > cap:
            raise ValueError(f"max_len = {max_len}; expected at most the model's max_position_embeddings {cap}")
        if dpara_ring == "auto":  # the ring's contents for this drafter's hardware
            dpara_ring = ring_for(drafter) if drafter is not None else "logits"
        self.defaults = DecodeOptions(d=d if method != "ar" else 1, temperature=_as_float(temperature),
                                      top_p=top_p, top_k=top_k, seed=seed, eos_ids=tuple(eos_ids),
                                      psd_policy=psd_policy, ssd_fanout=ssd_fanout, dpara_ring=dpara_ring)
        self.model = target
        self.drafter = drafter if needs_drafter(method) else None
        if needs_drafter(method):
            if drafter is None:
                raise ValueError(f"method {method!r} needs a drafter; got None")
            check_target_compatible(drafter.config, target)
        # the weights a drafter worker maps move into shared memory now, before any Engine decodes on them: a worker
        # started later (by any Engine over these models) moves nothing a native call in another thread reads
        sharing.bind(target, self.drafter)
        if self.drafter is not None:  # every drafting method passes here, before any draft (a worker's go unseen)
            self.drafter.warn_untrained(self.defaults.d, stacklevel=2)
        layer_ids = drafter.config.layer_ids if self.drafter is not None else ()
        self.fixed_max_len = max_len
        self.target = make_target(target, max_batch, max_len or _CACHE_GRANULE, layer_ids, verify_mode)
        parallel = method == AUTO or METHODS[method].parallel
        self.lanes = make_lanes(target.device, self.drafter.device if self.drafter is not None else target.device,
                                placement, parallel, threads_per_lane)
        self.placement = self.lanes[0].placement  # a split on one CUDA device runs colocated (make_lanes warns)
        self.auto_choices: dict[int, str] = {}   # batch size -> method, for method="auto"
        self._lock = threading.Lock()
        self._open: _Ticket | None = None        # the call holding the engine (its stream may be suspended)

    @property
    def name(self) -> str:
        return self._variant(self.method, self.defaults)

    def _variant(self, method: str, opts: DecodeOptions) -> str:
        return variant_name(method, self.placement, opts.psd_policy, opts.dpara_ring)

    # ------------------------------------------------------------------ decoding
    def options(self, max_new_tokens: int, **overrides) -> DecodeOptions:
        """This call's options: the engine's defaults with the call's arguments (None keeps a default)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        if "temperature" in given:
            given["temperature"] = _as_float(given["temperature"])
        return dataclasses.replace(self.defaults, max_new_tokens=max_new_tokens, **given)

    def _prompts(self, prompts) -> list[list[int]]:
        if is_id_array(prompts):  # transformers' input_ids: [T] is one prompt, [B, T] a batch
            prompts = id_rows(prompts)
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"prompts = {prompts!r:.80}; expected a non-empty list of token-id lists, or an integer "
                             "tensor or array [T] or [B, T]")
        if len(prompts) > self.target.max_batch:
            raise ValueError(f"batch of {len(prompts)} prompts exceeds max_batch {self.target.max_batch}")
        out = []
        for i, p in enumerate(prompts):
            if is_id_array(p):
                p = id_rows(p, f"prompt {i}", batch=False)[0]
            elif isinstance(p, (str, bytes)) or not hasattr(p, "__iter__"):
                raise ValueError(f"prompt {i} = {p!r:.40} ({type(p).__name__}); expected a list of token ids (one "
                                 "prompt's flat list of ints goes in a list: [[1, 2, 3]])")
            p = list(p)  # read once: a prompt may be an iterator
            if all(type(t) is int for t in p):  # the usual case, checked at a fraction of is_int's cost a token
                out.append(p)
                continue
            bad = [t for t in p if not is_int(t)]
            if bad:
                raise ValueError(f"prompt {i} holds {bad[0]!r} ({type(bad[0]).__name__}); expected int token ids")
            out.append([int(t) for t in p])
        return out

    def check_fits(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[int, int | None]:
        """(cache slots these prompts need, the cap); ValueError when the longest does not fit."""
        longest = max(map(len, prompts))
        need = longest + max_new_tokens + 2 * (self.defaults.d + 1)
        cap = self.fixed_max_len or getattr(self.model.config, "max_position_embeddings", None)
        if cap is not None and need > cap:
            what = "max_len" if self.fixed_max_len else "the model's max_position_embeddings"
            raise ValueError(f"longest prompt ({longest} tokens) + max_new_tokens {max_new_tokens} + "
                             f"2*(d+1) needs {need} cache slots, more than {what} {cap}")
        return need, cap

    def _reserve(self, prompts: list[list[int]], opts: DecodeOptions) -> None:
        """Size the KV cache for this call: prompt + max_new_tokens + one verify block of slack per round side."""
        need, cap = self.check_fits(prompts, opts.max_new_tokens)
        if self.fixed_max_len is None:
            granules = -(-need // _CACHE_GRANULE)
            self.target.reserve(min(granules * _CACHE_GRANULE, cap or need))

    def stream(self, prompts: list[list[int]], max_new_tokens: int = 64, *,
               temperature: float | Sequence[float] | None = None, top_p: float | Sequence[float] | None = None,
               top_k: int | Sequence[int] | None = None, seed: int | Sequence[int] | None = None,
               trace: bool = False) -> Iterator[list[list[int]]]:
        """Yield, every round, the new tokens committed per request (the first yield is the prefill's token).
        After the iterator ends, ``self.last_stats`` holds the statistics. The sampling arguments are as for
        ``generate``.

        An engine runs one decode at a time. A new call cancels a stream that is suspended (its chain stops
        before the new call touches the caches; resuming it raises), and raises while another thread's call is
        running on this engine. Process-wide settings (switch interval, intra-op threads) hold only while the
        decode runs, never while the stream is suspended in the caller's code."""
        overrides = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        return self._stream(prompts, max_new_tokens, overrides, trace, hold=False)

    def _stream(self, prompts, max_new_tokens: int, overrides: dict, trace: bool, hold: bool):
        opts = self.options(max_new_tokens, **overrides)
        prompts = self._prompts(prompts)
        ticket = self._claim()
        try:
            # a held call (generate) takes the rounds' tokens at the end: the lanes need not wake it every round
            yield from ticket.run(self._decode_prompts(ticket, prompts, opts, trace, stream=not hold), hold)
        finally:
            with self._lock:
                if self._open is ticket:
                    self._open = None

    def _decode_prompts(self, ticket: "_Ticket", prompts: list[list[int]], opts: DecodeOptions, trace: bool,
                        stream: bool = True):
        self._reserve(prompts, opts)
        self.target.check_prompts(prompts)
        if self.method == AUTO:
            choice = self.auto_choice(prompts, opts, ticket)
            method, opts = _with_variant(choice, opts)
        else:
            method = self.method
        yield from self._decode(ticket, method, opts, prompts, trace, stream=stream)
        if self.method == AUTO:
            self.last_stats.method = f"{self.name}({choice})"

    def _claim(self) -> "_Ticket":
        with self._lock:
            old = self._open
            if old is not None:
                if old.executing:
                    raise RuntimeError("this Engine is decoding in another thread; an Engine runs one decode at a "
                                       "time: use one Engine per thread")
                old.cancel()
            self._open = _Ticket(self._lock)
            return self._open

    def auto_choice(self, prompts: list[list[int]], opts: DecodeOptions, ticket: "_Ticket") -> str:
        """Adaptive mode: the first time a batch size is seen, time short runs of each candidate variant
        (ar, dspark, dpara with either ring) on these prompts with the engine's placement, and keep the one with
        the least time per committed token in steady state: (verify + exposed draft) per round over tau, which
        leaves out the prefill and the first round (drafted serially by every speculative method), both the same
        for all and most of a short run's noise. The candidates take turns twice and each keeps its better run, so
        the first turn's warm-up (a drafter worker's first calls, cold caches), measured slower for every
        candidate, does not decide. A run is 8 (d + 1) new tokens: with 4 (d + 1), a speculative run's handful of
        rounds still carried its first ones (a cold drafter, the lower acceptance at a prompt's start) and AR,
        timed over as many tokens in four times the rounds, looked faster than it is. That budget is the probe's
        own, not the call's: a first call of a few tokens (a warm-up) would otherwise time speculation on its
        serially drafted first round alone and settle the batch size on AR for good."""
        B = len(prompts)
        if B not in self.auto_choices:
            budget = 8 * (opts.d + 1)
            try:
                self.check_fits(prompts, budget)
            except ValueError:  # a cache of fixed length, or a model's position limit: what the call itself fits
                budget = min(budget, opts.max_new_tokens)
            short = dataclasses.replace(opts, max_new_tokens=budget)
            self._reserve(prompts, short)
            cost = dict.fromkeys(AUTO_CANDIDATES, float("inf"))
            for _ in range(AUTO_TURNS):
                for name in AUTO_CANDIDATES:
                    for _ in self._decode(ticket, *_with_variant(name, short), prompts, False, stream=False):
                        pass
                    st = self.last_stats
                    per_token = (st.verify_ms + st.exposed_draft_ms) / st.tau if st.tau else float("inf")
                    cost[name] = min(cost[name], per_token)
            self.auto_choices[B] = min(cost, key=cost.get)
        return self.auto_choices[B]

    def _decode(self, ticket: "_Ticket", method: str, opts: DecodeOptions, prompts: list[list[int]], trace: bool,
                admission=None, stream: bool = True):
        """Run one decode, yielding each round's commits (all at its end when not `stream`)."""
        spec = METHODS[method]
        backend = None
        if spec.needs_drafter:
            worker = self._worker_for(spec)  # started once per engine: not this decode's wall
            backend = (DeviceBackend if self.drafting == "device"
                       else functools.partial(HostBackend, worker=worker))
        t0 = time.perf_counter()  # the decoder's setup (buffers, the worker's cache) is part of the decode's wall
        dec = ticket.decoder = Decoder(self.target, self.drafter, self.lanes, opts, prompts, backend,
                                       markov=spec.markov, admission=admission, kept=self._kept_buffers)
        dec.chain.stream = stream
        new_tokens = 0
        for new in dec.run(spec.run):
            new_tokens += sum(map(len, new))
            yield new
        name = self._variant(method, opts)
        self.last_stats = summarize(dec, name, len(prompts), time.perf_counter() - t0, new_tokens, trace)

    def _worker_for(self, spec) -> DrafterWorker | None:
        """The drafter worker process a method's drafter lane runs in, or None for a thread. ``auto`` takes a
        process where it pays: a method that drafts beside verification (dpara), on the host, with each lane on
        its own cores (two threads of one interpreter slow each other's torch ops; two processes do not)."""
        mode = self.drafter_worker
        if not spec.worker or self.drafter is None or mode == "thread" or self.drafting != "host":
            return None
        if mode == "auto" and (self.drafter.device.type != "cpu" or self.placement != "split"):
            return None
        if self._worker is None or not self._worker.alive:  # started once; again only if it died
            target_lane, drafter_lane = self.lanes
            if self._worker is None:
                self._worker_cores = drafter_lane.cores
                # The lane's thread now only sends the worker its calls and runs the Markov head, both between
                # verifications: beside the target it leaves the worker its cores (sharing them, the worker's
                # wake-up would preempt the head's link).
                drafter_lane.pin(target_lane.cores)
            own = self._worker_cores and target_lane.cores and not set(self._worker_cores) & set(target_lane.cores)
            self._worker = DrafterWorker(self.drafter, self._worker_cores, drafter_lane.threads,
                                         spin_s=WORKER_SPIN_S if own else 0.0)
            weakref.finalize(self, self._worker.close)
        return self._worker

    def close(self) -> None:
        """Stop the drafter worker process, if one runs (it also stops when the engine is collected or the
        interpreter exits)."""
        if self._worker is not None:
            self._worker.close()

    def serve(self, slots, max_len: int) -> Iterator[list[list[int]]]:
        """Continuous batching (dpara_rt.serving.batching.Slots): one decode over ``slots.batch`` rows that requests
        join and leave between rounds, with a KV cache of at least ``max_len`` tokens a row; yields each
        round's commits per row. dpara_rt.serving.scheduler.Scheduler drives it."""
        B = slots.batch
        if not is_int(B) or not 1 <= B <= self.target.max_batch:
            raise ValueError(f"slots.batch = {B!r}; expected an int in 1..{self.target.max_batch} (max_batch)")
        rows = dict(temperature=(0.0,) * B, top_p=(1.0,) * B, top_k=(0,) * B, seed=(0,) * B)
        opts = self.options(1, **rows)
        method = self.method
        if method == AUTO:  # the choice profiled for this batch size, else dpara
            method, opts = _with_variant(self.auto_choices.get(B, "dpara"), opts)
        if self.fixed_max_len is None:
            cap = getattr(self.model.config, "max_position_embeddings", None) or max_len
            self.target.reserve(min(-(-max_len // _CACHE_GRANULE) * _CACHE_GRANULE, max(cap, max_len)))
        ticket = self._claim()
        try:
            yield from ticket.run(self._decode(ticket, method, opts, [[0]] * B, False, admission=slots), hold=True)
        finally:
            with self._lock:
                if self._open is ticket:
                    self._open = None

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 64, *,
                 temperature: float | Sequence[float] | None = None, top_p: float | Sequence[float] | None = None,
                 top_k: int | Sequence[int] | None = None, seed: int | Sequence[int] | None = None,
                 trace: bool = False) -> Output:
        """Decode a batch. None keeps the engine's default; temperature, top_p, top_k and seed may each be one
        value for the batch or a sequence with one value per prompt.

        Rows with temperature 0 are greedy: in a batch with sampled rows they still get exactly the AR greedy
        output. One seed for the batch gives one random stream shared by the rows (a row's draws depend on its
        batch). Per-request seeds give each request its own stream (a torch.Generator for verification's and
        AR's uniforms, and the Markov head run per row under that seed): a request then makes the same random
        draws as when it runs alone with that seed, so with AR, DSpark and DPara its output equals its
        output alone whenever the batched forwards give its row the same logits as a batch of one. PSD's
        drafts depend on the batch (a guess miss in any row makes every row draft serially), so there a
        request's output follows the same law as alone but not the same draws."""
        tokens = []
        overrides = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        for new in self._stream(prompts, max_new_tokens, overrides, trace, hold=True):
            tokens = tokens or [[] for _ in new]  # one list per request (a 1-D tensor is one prompt)
            for out, t in zip(tokens, new):
                out.extend(t)
        return Output(tokens, self.last_stats)


def batch_for_memory(target, drafter, max_len: int, d: int = 7, fraction: float = 0.5,
                     available: int | None = None) -> int:
    """The most requests whose per-row state fits `fraction` of the free memory of the target's device: the
    target's KV cache and the drafter's context cache at `max_len` tokens, and two ring slots of boundary
    logits ((d+1) x d rows of the vocabulary). `available` (bytes) overrides what the device reports."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction = {fraction!r}; expected a number in (0, 1]")
    c = target.config
    row = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * target.dtype.itemsize * max_len
    if drafter is not None:
        dc = drafter.config
        row += 2 * dc.num_layers * dc.num_key_value_heads * dc.head_dim * drafter.dtype.itemsize * max_len
        row += 2 * (d + 1) * d * dc.vocab_size * drafter.dtype.itemsize
    if available is None:
        available = _free_memory(target.device)
    return max(1, int(available * fraction) // row)


def _free_memory(device) -> int:
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _as_float(temperature):
    """A temperature as float, or a per-request sequence as a tuple of floats (validated by DecodeOptions)."""
    if isinstance(temperature, (str, bytes)):
        return temperature
    if isinstance(temperature, torch.Tensor) and temperature.dim() > 0:
        temperature = temperature.tolist()
    if hasattr(temperature, "__len__") or hasattr(temperature, "__iter__"):
        return tuple(float(t) if isinstance(t, numbers.Real) and not isinstance(t, bool) else t
                     for t in temperature)
    return float(temperature) if isinstance(temperature, numbers.Real) and not isinstance(temperature, bool) \
        else temperature


def _with_variant(name: str, opts: DecodeOptions) -> tuple[str, DecodeOptions]:
    """The method of a variant name and `opts` with the variant's options (a PSD policy, a ring's contents)."""
    kw = variant(name)
    method = kw.pop("method")
    kw.pop("placement", None)  # the engine's lanes are placed already
    return method, dataclasses.replace(opts, **kw)


class _Ticket:
    """One call's hold on an engine: the decoder it runs, whether it is running now, whether a newer call
    cancelled it."""

    def __init__(self, lock: threading.Lock):
        self._lock = lock
        self.decoder: Decoder | None = None
        self.executing = False
        self.cancelled = False

    def cancel(self) -> None:
        """Called under the engine's lock while the stream is suspended: stop its chain and wait for the lanes."""
        self.cancelled = True
        if self.decoder is not None:
            self.decoder.chain.cancel(RuntimeError("this stream was cancelled: a newer call started a decode on its "
                                                   "Engine (an Engine runs one decode at a time)"))

    def run(self, gen: Iterator, hold: bool) -> Iterator:
        """Step `gen` with the decode's settings applied, only while this ticket still owns the engine; `hold`
        keeps them (and the claim) for the whole run, as generate() does."""
        if hold:
            with self._running():
                yield from gen
            return
        while True:
            with self._running():
                try:
                    item = next(gen)
                except StopIteration:
                    return
            yield item

    @contextlib.contextmanager
    def _running(self):
        with self._lock:
            if self.cancelled:
                raise RuntimeError("this stream was cancelled: a newer call started a decode on its Engine (an "
                                   "Engine runs one decode at a time)")
            self.executing = True
        try:
            with _main_thread_settings():
                yield
        finally:
            self.executing = False


@contextlib.contextmanager
def _main_thread_settings():
    # The caller's thread only drains results; the lanes set their own intra-op threads. The lanes hand the GIL
    # to each other at every link, so a short switch interval keeps a waiting link from idling up to 5 ms.
    old, old_switch = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(1)
    sys.setswitchinterval(GIL_SWITCH_S)
    try:
        yield
    finally:
        torch.set_num_threads(old)
        sys.setswitchinterval(old_switch)
