"""Per-generate statistics (DESIGN.md §3), derived from the round timeline the lanes recorded."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np

from dpara_rt import _core


@dataclass
class Stats:
    method: str
    batch: int
    d: int
    temperature: float
    rounds: int = 0
    new_tokens: int = 0
    wall_s: float = 0.0
    tau: float = 0.0                       # committed tokens per request-round, bonus included
    accept_per_position: list = field(default_factory=list)  # P(t_i accepted), i = 1..d
    acceptance_histogram: list = field(default_factory=list)  # request-rounds with r = 0..d
    verify_ms: float = 0.0                 # per round: target forward + acceptance inputs
    backbone_ms: float = 0.0               # per round: drafter backbone work (any layout)
    markov_head_ms: float = 0.0            # per round
    exposed_draft_ms: float = 0.0          # per round: end of a verify to the start of the next
    overlap_efficiency: float = 0.0        # backbone time hidden under verification / backbone time
    fallback_rate: float = 0.0             # rounds whose guess missed / rounds (psd)
    trace: str | None = None               # Chrome / Perfetto trace JSON, when asked for

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    def fraction_of_ideal(self, speedup: float, ar_step_ms: float) -> float:
        return fraction_of_ideal(speedup, self.tau, ar_step_ms, self.verify_ms)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("trace")
        out["tokens_per_s"] = self.tokens_per_s
        return out


def fraction_of_ideal(speedup: float, tau: float, ar_step_ms: float, verify_ms: float) -> float:
    """Measured speedup / (tau * t_AR_step / t_verify): 1.0 means the drafter costs nothing."""
    ideal = tau * ar_step_ms / verify_ms if verify_ms else 0.0
    return speedup / ideal if ideal else 0.0


_DRAFT_PHASES = ("backbone", "serial_draft", "guess_draft")


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def summarize(dec, method: str, batch: int, wall_s: float, new_tokens: int, trace: bool) -> Stats:
    d = dec.d
    st = Stats(method=method, batch=batch, d=d if method != "ar" else 0, temperature=dec.opts.temperature,
               rounds=dec.round, new_tokens=new_tokens, wall_s=wall_s, fallback_rate=dec.fallbacks / max(dec.round, 1))
    acc = np.array(dec.accepted) if dec.accepted else np.zeros((0, batch))
    live = acc[acc >= 0]
    if live.size:
        st.tau = float(live.mean() + 1)
        if method != "ar":
            st.accept_per_position = [float((live >= i).mean()) for i in range(1, d + 1)]
            st.acceptance_histogram = np.bincount(live.astype(int), minlength=d + 1).tolist()
    spans = [s for s in dec.spans if s.phase != "prefill"]
    rounds = max(dec.round, 1)
    ms = lambda phases: sum(s.end_ns - s.start_ns for s in spans if s.phase in phases) / 1e6 / rounds
    st.verify_ms, st.markov_head_ms = ms(("verify",)), ms(("markov_head",))
    st.backbone_ms = ms(_DRAFT_PHASES)
    verifies = sorted((s.start_ns, s.end_ns) for s in spans if s.phase == "verify")
    gaps = [b[0] - a[1] for a, b in zip(verifies, verifies[1:])]
    st.exposed_draft_ms = float(np.mean(gaps)) / 1e6 if gaps else 0.0
    drafting = [(s.start_ns, s.end_ns) for s in spans if s.phase in _DRAFT_PHASES]
    total = sum(e - s for s, e in drafting)
    hidden = sum(_overlap(x, v) for x in drafting for v in verifies)
    st.overlap_efficiency = hidden / total if total else 0.0
    if trace:
        st.trace = chrome_trace(dec, method)
    return st


def chrome_trace(dec, method: str) -> str:
    """The rounds as a Chrome / Perfetto trace (open in ui.perfetto.dev), built by the core's metrics."""
    m = _core.Metrics(dec.d)
    for s in dec.spans:
        m.add_event(s.round, s.phase, s.lane, s.start_ns, s.end_ns)
    return m.chrome_trace()


def dump(stats: list[Stats]) -> str:
    return json.dumps([s.to_dict() for s in stats], indent=1)
