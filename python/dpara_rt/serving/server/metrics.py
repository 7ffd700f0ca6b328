"""Prometheus text exposition (format 0.0.4) for `/metrics`, written by hand (no client library needed).

The speculative-decoding counters carry vLLM's names under the ``dpara_rt_`` prefix
(``dpara_rt_spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total``,
``..._num_accepted_tokens_per_pos_total{position="i"}``), plus ``dpara_rt_tau``, ``dpara_rt_fallbacks_total``
and ``dpara_rt_overlap_efficiency``. Any other numeric key of ``Scheduler.metrics()`` is exported as a gauge
``dpara_rt_<key>`` (a list as one series per index), so counters the scheduler adds later appear unasked.
"""
from __future__ import annotations

import math
import re

PREFIX = "dpara_rt_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

# scheduler key -> (metric name, type, help)
KNOWN = {
    "requests": ("requests_total", "counter", "Requests accepted by the scheduler."),
    "finished": ("requests_finished_total", "counter", "Requests that ended at a stop id or their length."),
    "cancelled": ("requests_cancelled_total", "counter",
                  "Requests cancelled (client disconnect, stop string, shutdown)."),
    "errors": ("request_errors_total", "counter", "Requests that ended with an engine error."),
    "prompt_tokens": ("prompt_tokens_total", "counter", "Prompt tokens of ended requests."),
    "completion_tokens": ("generation_tokens_total", "counter", "Generated tokens of ended requests."),
    "waiting": ("num_requests_waiting", "gauge", "Requests queued, not yet in the batch."),
    "running": ("num_requests_running", "gauge", "Requests in the running batch."),
    "rounds": ("spec_decode_num_rounds_total", "counter", "Decode rounds (one target forward each)."),
    "drafts": ("spec_decode_num_drafts_total", "counter", "Drafts verified (one per request per round)."),
    "draft_tokens": ("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed."),
    "accepted_tokens": ("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted."),
    "fallbacks": ("fallbacks_total", "counter", "Rounds whose parallel draft guess missed (serial fallback)."),
    "tau": ("tau", "gauge", "Committed tokens per request-round, bonus token included."),
    "overlap_efficiency": ("overlap_efficiency", "gauge",
                           "Share of drafter backbone time hidden under verification."),
}
PER_POSITION = ("spec_decode_num_accepted_tokens_per_pos_total", "counter",
                "Accepted draft tokens at each draft position (1-based).")


def _name(key: str) -> str:
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _value(v) -> str:
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(int(v)) if v.is_integer() and abs(v) < 2 ** 53 else repr(v)


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    esc = lambda s: str(s).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}"


class Exposition:
    """Lines of one scrape; each family's HELP/TYPE written once, before its samples."""

    def __init__(self, base_labels: dict):
        self.base, self.lines, self.seen = dict(base_labels), [], set()

    def family(self, name: str, kind: str, help: str) -> None:
        if name not in self.seen:
            self.seen.add(name)
            self.lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]

    def sample(self, name: str, value, **labels) -> None:
        self.lines.append(f"{name}{_labels({**self.base, **labels})} {_value(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


class Histogram:
    """A cumulative-bucket histogram (updated and read on the event loop only)."""

    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def write(self, out: Exposition, name: str, help: str) -> None:
        out.family(name, "histogram", help)
        for b, c in zip(self.buckets, self.counts):
            out.sample(name + "_bucket", c, le=_value(b) if not float(b).is_integer() else f"{b:.1f}")
        out.sample(name + "_bucket", self.count, le="+Inf")
        out.sample(name + "_sum", self.sum)
        out.sample(name + "_count", self.count)


def render(sched: dict, server: dict, histograms: dict[str, tuple[Histogram, str]], model_name: str,
           derived: dict | None = None) -> str:
    """The scrape: scheduler counters `sched`, server counters `server` ({metric: {label tuple: value}} or
    {metric: value}), latency `histograms`, and `derived` values used when the scheduler lacks a key."""
    out = Exposition({"model_name": model_name})
    sched = dict(sched)
    for k, v in (derived or {}).items():
        sched.setdefault(k, v)
    for key, v in sched.items():
        if key == "accepted_per_position" and isinstance(v, (list, tuple)):
            name = PREFIX + PER_POSITION[0]
            out.family(name, PER_POSITION[1], PER_POSITION[2])
            for i, x in enumerate(v):
                out.sample(name, x, position=str(i + 1))
            continue
        if key in KNOWN:
            suffix, kind, help = KNOWN[key]
        else:
            suffix, kind, help = _name(key)[len(PREFIX):], "gauge", f"Scheduler metric {key!r}."
        name = PREFIX + suffix
        if isinstance(v, bool) or not isinstance(v, (int, float, list, tuple)):
            continue
        if isinstance(v, (list, tuple)):
            nums = [x for x in v if isinstance(x, (int, float)) and not isinstance(x, bool)]
            out.family(name, "gauge", help)
            for i, x in enumerate(nums):
                out.sample(name, x, index=str(i))
            continue
        out.family(name, kind, help)
        out.sample(name, v)
    for name, (kind, help, values) in server.items():
        out.family(PREFIX + name, kind, help)
        if isinstance(values, dict):
            for labels, v in sorted(values.items()):
                out.sample(PREFIX + name, v, **dict(labels))
        else:
            out.sample(PREFIX + name, values)
    for name, (hist, help) in histograms.items():
        hist.write(out, PREFIX + name, help)
    return out.text()


__all__ = ["CONTENT_TYPE", "Histogram", "render"]
