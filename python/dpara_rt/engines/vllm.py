"""DPara as a vLLM custom proposer (docs/engines.md).

    from vllm import LLM
    llm = LLM(model=target_dir, enforce_eager=True, enable_prefix_caching=False,
              speculative_config={"model": "dpara_rt.engines.vllm.DParaProposer", "num_speculative_tokens": 7},
              additional_config={"dpara_drafter": drafter_dir})

vLLM keeps the target, its KV cache, the scheduler and its rejection sampler; ``DParaProposer`` owns the
drafter through a ``Speculator`` (serving/speculator.py). Forward hooks on the target's decoder layers capture
the feature layers' hidden states of each target forward. After vLLM's verify of a step the proposer, for the
step's requests in vLLM's batch order:

    removes finished / unscheduled requests        Speculator.remove_request
    commits (r, bonus, verified rows' features)    Speculator.commit: the Markov head on branch r (lane)
    adds requests whose prefill just completed     Speculator.add_request (chunked prefills accumulate)
    proposes the next drafts                       Speculator.propose: waits for the head, queues the backbone

The backbone over [bonus, draft] so queued runs on the speculator's lane thread while vLLM runs its next target
forward (the verify of that draft). vLLM's custom-proposer call passes no request ids, so one method of vLLM's
runner is wrapped to hand the proposer the step's scheduler output and batch order (``install_step_hook``).

Options (``additional_config``): ``dpara_drafter`` (required: a drafter directory, ``load_drafter``),
``dpara_max_requests`` (speculator slots, default min(max_num_seqs, 8); requests beyond run without drafts),
``dpara_cores`` (CPU cores the lane's thread is pinned to, e.g. [1] beside VLLM_CPU_OMP_THREADS_BIND=0 for
the target; default: unpinned), ``dpara_mode`` ("dpara" or "dspark"), ``dpara_stats`` (a JSON file rewritten
after every step: tau, lane/forward overlap, request counts).
"""
from __future__ import annotations

import collections
import functools
import inspect
import json
import logging
import os
import threading
import types

import torch
import torch.nn.functional as F
from torch import nn

from dpara_rt import _core
from dpara_rt.host.linear import HostLinear
from dpara_rt.models.drafter_io import load_drafter
from dpara_rt.serving.speculator import MODES, Speculator

SUPPORTED_VLLM = "0.32"
OPTIONS = ("dpara_drafter", "dpara_max_requests", "dpara_cores", "dpara_mode", "dpara_stats")
logger = logging.getLogger(__name__)


def check_vllm_version(version: str | None = None) -> str:
    """The installed vLLM version if this adapter supports it, else a RuntimeError naming both."""
    if version is None:
        import vllm
        version = vllm.__version__
    if version != SUPPORTED_VLLM and not version.startswith(SUPPORTED_VLLM + "."):
        raise RuntimeError(f"dpara_rt.engines.vllm supports vLLM {SUPPORTED_VLLM}.x; the installed vLLM is "
                           f"{version} (its runner's proposer hooks differ: install vllm {SUPPORTED_VLLM}.x)")
    return version


def install_step_hook() -> None:
    """Wrap ``GPUModelRunner.propose_draft_token_ids`` (the CPU runner inherits it) so that a DParaProposer hears
    each step's scheduler output and batch order before vLLM calls its ``propose``. Idempotent."""
    check_vllm_version()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.propose_draft_token_ids
    if getattr(original, "dpara_step_hook", False):
        return
    params = list(inspect.signature(original).parameters)
    if params[:2] != ["self", "scheduler_output"]:
        raise RuntimeError(f"GPUModelRunner.propose_draft_token_ids takes {params}; expected (self, "
                           f"scheduler_output, ...) as in vLLM {SUPPORTED_VLLM}.x")

    @functools.wraps(original)
    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, DParaProposer):
            drafter.begin_step(scheduler_output, list(self.input_batch.req_ids))
        return original(self, scheduler_output, *args, **kwargs)

    propose_draft_token_ids.dpara_step_hook = True
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids


class FeatureTap:
    """Forward hooks on a vLLM decoder-only model: the feature layers' hidden states of its last forward
    (``parts``: one [N, H] tensor per layer id), that forward's positions, and every forward's (start, end) on
    the core's clock. vLLM's decoder layers return (hidden, residual): the residual stream is their sum; the
    last layer's feature is taken after the final norm (transformers' hidden_states[L])."""

    def __init__(self, model: nn.Module, layer_ids):
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise ValueError(f"{type(model).__name__} has no .model.layers; expected a vLLM decoder-only causal "
                             "LM (Llama, Qwen3, ...)")
        n = len(layers)
        bad = [i for i in layer_ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"drafter layer_ids {list(layer_ids)} include {bad}; the target has {n} decoder layers")
        self.layer_ids = list(layer_ids)
        self.parts: list = [None] * len(self.layer_ids)
        self.positions = None
        self.spans: collections.deque = collections.deque(maxlen=256)  # (start_ns, end_ns) of target forwards
        self.forwards = 0
        self._t0 = 0
        self.handles = [model.register_forward_pre_hook(self._start, with_kwargs=True),
                        model.register_forward_hook(self._end)]
        for k, i in enumerate(self.layer_ids):
            last = i == n - 1
            module = inner.norm if last else layers[i]
            self.handles.append(module.register_forward_hook(functools.partial(self._grab, k, last)))

    def _start(self, module, args, kwargs):
        self._t0 = _core.now_ns()
        self.parts = [None] * len(self.layer_ids)
        self.positions = kwargs["positions"] if "positions" in kwargs else args[1]

    def _grab(self, k, normed, module, args, out):
        if normed:  # the final norm: normed, or (normed, residual)
            self.parts[k] = out[0] if isinstance(out, tuple) else out
        else:  # a decoder layer: (hidden, residual), whose sum is the residual stream
            self.parts[k] = out[0] + out[1]

    def _end(self, module, args, out):
        self.spans.append((self._t0, _core.now_ns()))
        self.forwards += 1

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Features [stop - start, F] of the last forward's token rows start..stop-1."""
        if any(p is None for p in self.parts):
            raise RuntimeError(f"the feature hooks on layers {self.layer_ids} did not fire in the last target "
                               "forward (a compiled model: run vLLM with enforce_eager=True)")
        return torch.cat([p[start:stop] for p in self.parts], dim=-1)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _shared_target(model: nn.Module) -> types.SimpleNamespace:
    """What ``load_drafter`` reads of a target: its config and its embedding / output head, sharing vLLM's
    weights (vLLM pads the vocabulary rows of both; the drafter sees the first vocab_size)."""
    cfg = model.config
    v = cfg.vocab_size
    embed_w = model.model.embed_tokens.weight[:v]
    head_w = model.lm_head.weight[:v]
    with torch.no_grad():
        embed = nn.Embedding(v, cfg.hidden_size, _weight=embed_w, _freeze=True)
        head = HostLinear(cfg.hidden_size, v, bias=False, device="meta")
        head.weight = nn.Parameter(head_w, requires_grad=False)
    return types.SimpleNamespace(config=cfg, embed_tokens=embed, lm_head=head)


class DParaProposer:
    """vLLM's custom proposer (``speculative_config={"model": "dpara_rt.engines.vllm.DParaProposer", ...}``):
    built by vLLM's runner with the VllmConfig, ``load_model(target)`` after the target loads, then
    ``propose(sampled_token_ids, ...)`` once per step after the verify (see the module docstring)."""

    def __init__(self, vllm_config):
        self.vllm_version = check_vllm_version()
        spec, extra = vllm_config.speculative_config, dict(vllm_config.additional_config or {})
        unknown = sorted(k for k in extra if k.startswith("dpara_") and k not in OPTIONS)
        if unknown:
            raise ValueError(f"unknown additional_config keys {unknown}; DParaProposer takes {list(OPTIONS)}")
        if not extra.get("dpara_drafter"):
            raise ValueError("additional_config has no 'dpara_drafter'; expected the drafter's directory, e.g. "
                             "additional_config={'dpara_drafter': '/path/to/drafter'}")
        self.drafter_dir = os.fspath(extra["dpara_drafter"])
        self.mode = extra.get("dpara_mode", "dpara")
        if self.mode not in MODES:
            raise ValueError(f"dpara_mode {self.mode!r}; expected one of {MODES}")
        self.max_requests = extra.get("dpara_max_requests", min(vllm_config.scheduler_config.max_num_seqs, 8))
        self.cores = extra.get("dpara_cores")
        if self.cores is not None and (not isinstance(self.cores, (list, tuple)) or not self.cores
                                       or not all(isinstance(c, int) and c >= 0 for c in self.cores)):
            raise ValueError(f"dpara_cores = {self.cores!r}; expected a list of CPU core ids for the lane, e.g. [1]")
        self.stats_path = extra.get("dpara_stats")
        self.d = spec.num_speculative_tokens
        par = vllm_config.parallel_config
        if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={par.tensor_parallel_size}, pipeline_parallel_size="
                             f"{par.pipeline_parallel_size}; DParaProposer supports one worker (both 1)")
        if vllm_config.cache_config.enable_prefix_caching:
            logger.warning("DParaProposer: prefix caching is on; a request whose prompt starts in cached blocks "
                           "has no features for them and runs without drafts (enable_prefix_caching=False)")
        self.max_len = vllm_config.model_config.max_model_len + 2 * self.d + 2
        self.speculator: Speculator | None = None
        self.tap: FeatureTap | None = None
        self._step: tuple[list, dict, set] | None = None  # (batch order, scheduled tokens, finished ids)
        self._rows: dict = {}      # request id -> context rows the speculator holds (= the bonus's position)
        self._prefill: dict = {}   # request id -> feature chunks of a prefill under way
        self._draftless: set = set()  # requests that run without drafts (no slot, or features missing)
        self._events_seen = 0
        self.caller_thread_id = None
        self.counts = collections.Counter()
        self.calls: collections.deque = collections.deque(maxlen=256)  # (start_ns, end_ns) of propose calls
        self.overlap = collections.Counter()
        install_step_hook()

    # ------------------------------------------------------------------ vLLM's calls
    def load_model(self, target_model: nn.Module) -> None:
        drafter = load_drafter(self.drafter_dir, _shared_target(target_model)).eval().requires_grad_(False)
        # The lane keeps the worker's intra-op thread count: vLLM's CPU worker turns torch.set_num_threads into a
        # no-op once it has bound its OpenMP threads (and ATen's count is process-wide: setting it on the lane
        # would shrink the target's). Pinning the lane's thread to cores of its own is per thread.
        self.speculator = Speculator(drafter, d=self.d, mode=self.mode, max_requests=self.max_requests,
                                     max_len=self.max_len, temperature=0.0, lane_name="dpara")
        if self.cores is not None:
            self.speculator.lane.pin(self.cores)
            self.speculator.synchronize()
        self.tap = FeatureTap(target_model, drafter.config.layer_ids)

    def begin_step(self, scheduler_output, req_ids: list) -> None:
        """From the wrapped runner method: the step's batch order and scheduled token counts."""
        self._step = (req_ids, dict(scheduler_output.num_scheduled_tokens), set(scheduler_output.finished_req_ids))

    def propose(self, sampled_token_ids, num_tokens_no_spec=None, token_ids_cpu=None, slot_mappings=None,
                **kwargs) -> list[list[int]]:
        if self.speculator is None:
            raise RuntimeError("DParaProposer.propose before load_model: vLLM's runner loads the drafter first")
        if self._step is None:
            raise RuntimeError("DParaProposer.propose without the step's scheduler output: the wrapped "
                               "GPUModelRunner.propose_draft_token_ids did not run (install_step_hook)")
        t0 = _core.now_ns()
        self.caller_thread_id = threading.get_ident()  # vLLM's worker thread
        req_ids, scheduled, finished = self._step
        self._step = None
        if len(sampled_token_ids) != len(req_ids):
            raise RuntimeError(f"{len(sampled_token_ids)} rows of sampled tokens for a batch of {len(req_ids)} "
                               "requests; expected one row per request")
        with torch.inference_mode():
            drafts = self._advance(req_ids, scheduled, finished, sampled_token_ids)
        self.calls.append((t0, _core.now_ns()))
        self._account()
        if self.stats_path:
            self.write_stats(self.stats_path)
        return [drafts.get(rid, []) for rid in req_ids]

    # ------------------------------------------------------------------ one step
    def _advance(self, req_ids, scheduled, finished, sampled) -> dict:
        spec, tap = self.speculator, self.tap
        for rid in list(self._rows):
            if rid in finished or rid not in scheduled:  # finished, preempted or not scheduled this step
                self._drop(rid, "removed" if rid in finished else "unscheduled")
        for rid in finished:
            self._prefill.pop(rid, None)
            self._draftless.discard(rid)
        commit, added, off = [], [], 0
        positions = tap.positions
        if positions is None:
            raise RuntimeError("the target forward hooks saw no forward before this propose (a compiled model: "
                               "run vLLM with enforce_eager=True)")
        for i, rid in enumerate(req_ids):
            n = scheduled[rid]
            start = int(positions[off])
            rows = sampled[i]
            if rid in self._rows and (start != self._rows[rid] or not rows):
                self._drop(rid, "out_of_step")  # vLLM skipped a draft step or recomputed: its rows moved
            if rid in self._rows:
                commit.append((rid, len(rows) - 1, rows[-1], tap.rows(off, off + len(rows))))
            elif start == 0 or rid in self._prefill:
                if start == 0:  # a new request, or one vLLM recomputes from the start (preemption)
                    self._prefill[rid] = []
                chunks = self._prefill[rid]
                if start == sum(len(c) for c in chunks):
                    chunks.append(tap.rows(off, off + n))
                    if rows:  # the prefill is complete: vLLM sampled the first token
                        added.append((rid, torch.cat(self._prefill.pop(rid)), rows[-1]))
                else:
                    self._prefill.pop(rid)
                    self._go_draftless(rid, "prefill_gap")
            elif rid not in self._draftless:
                self._go_draftless(rid, "no_features")  # e.g. its prompt began in prefix-cached blocks
            off += n
        if commit:
            t = max(f.shape[0] for *_, f in commit)
            feats = torch.stack([F.pad(f, (0, 0, 0, t - f.shape[0])) for *_, f in commit])
            spec.commit([c[0] for c in commit], [c[1] for c in commit], [c[2] for c in commit], feats)
            for rid, r, _, _ in commit:
                self._rows[rid] += r + 1
            self.counts["commits"] += len(commit)
        for rid, feats, bonus in added:
            if len(spec.requests) >= spec.max_requests or feats.shape[0] + 1 + 2 * self.d > spec.max_len:
                self._go_draftless(rid, "no_slot")
                continue
            spec.add_request(rid, feats, bonus)
            self._rows[rid] = feats.shape[0]
            self._draftless.discard(rid)
            self.counts["added"] += 1
        live = [rid for rid in req_ids if rid in self._rows]
        if not live:
            return {}
        tokens = spec.propose(live).tokens.tolist()
        self.counts["steps"] += 1
        return dict(zip(live, tokens))

    def _drop(self, rid, why: str) -> None:
        self.speculator.remove_request(rid)
        del self._rows[rid]
        self.counts[why] += 1

    def _go_draftless(self, rid, why: str) -> None:
        self._draftless.add(rid)
        self.counts[f"draftless_{why}"] += 1

    # ------------------------------------------------------------------ measurement
    def _account(self) -> None:
        """Fold the lane's new backbone spans into the measurement: how much of each ran inside a target forward,
        and how much inside this proposer's own calls (the only place vLLM waits for the drafter)."""
        events = self.speculator.metrics.events()
        forwards, calls = list(self.tap.spans), list(self.calls)
        o = self.overlap
        for e in events[self._events_seen:]:
            if e["phase"] != "backbone":
                continue
            s, t = e["start_ns"], e["end_ns"]
            inside = _overlap(s, t, forwards)
            o["backbone_ns"] += t - s
            o["backbone_in_forward_ns"] += inside
            o["backbone_in_propose_ns"] += _overlap(s, t, calls)
            o["backbones"] += 1
            o["backbones_in_forward"] += inside > 0
        self._events_seen = len(events)
        if len(forwards) >= 1 and len(calls) >= 2:  # this step: its forward, and the propose call before it
            a, b = forwards[-1]
            o["forward_ns"] += b - a
            o["propose_ns"] += calls[-1][1] - calls[-1][0]
            o["gap_ns"] += max(0, a - calls[-2][1])  # vLLM's own work between a propose and the next forward
            o["steps_timed"] += 1

    def stats(self) -> dict:
        """tau, the request counts, and how much of the backbone's lane time fell inside target forwards."""
        spec = self.speculator
        threads = {job.thread_id for job in spec.jobs if job.phase == "backbone"}
        return {"vllm": self.vllm_version, "mode": self.mode, "d": self.d, "tau": spec.tau,
                "counts": dict(self.counts), "overlap": dict(self.overlap), "target_forwards": self.tap.forwards,
                "lane_thread_id": spec.lane_thread_id, "caller_thread_id": self.caller_thread_id,
                "backbone_threads": sorted(threads), "live_requests": len(self._rows)}

    def write_stats(self, path) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.stats(), f)
        os.replace(tmp, path)


def _overlap(s: int, t: int, spans) -> int:
    return sum(max(0, min(t, b) - max(s, a)) for a, b in spans)


__all__ = ["DParaProposer", "FeatureTap", "OPTIONS", "SUPPORTED_VLLM", "check_vllm_version", "install_step_hook"]
