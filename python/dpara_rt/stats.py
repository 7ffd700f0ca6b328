"""Per-generate statistics (docs/design.md §5), derived from the round timeline the lanes recorded."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np



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


def _hidden_ns(drafting: list[tuple[int, int]], verifies: list[tuple[int, int]]) -> int:
    """Drafting time that overlaps a verify span; both lists sorted by start, verify spans disjoint."""
    hidden, i = 0, 0
    for span in drafting:
        while i < len(verifies) and verifies[i][1] <= span[0]:
            i += 1
        j = i
        while j < len(verifies) and verifies[j][0] < span[1]:
            hidden += _overlap(span, verifies[j])
            j += 1
    return hidden


def summarize(dec, method: str, batch: int, wall_s: float, new_tokens: int, trace: bool) -> Stats:
    """Statistics of one decode from the core's metrics: its acceptance histogram and its timeline."""
    m = dec.metrics
    d = dec.d if dec.drafter is not None else 0
    rounds = max(m.rounds, 1)
    st = Stats(method=method, batch=batch, d=d, temperature=dec.opts.temperature, rounds=m.rounds,
               new_tokens=new_tokens, wall_s=wall_s, fallback_rate=m.fallbacks / rounds)
    hist = m.histogram()
    if hist.sum():
        st.tau = m.tau
        if d:
            st.acceptance_histogram = hist.tolist()
            st.accept_per_position = [float(hist[i:].sum() / hist.sum()) for i in range(1, d + 1)]
    events = [e for e in m.events() if e["phase"] != "prefill"]
    totals = m.phase_totals_ns()
    ms = lambda phases: sum(totals.get(p, 0) for p in phases) / 1e6 / rounds
    st.verify_ms, st.markov_head_ms, st.backbone_ms = ms(("verify",)), ms(("markov_head",)), ms(_DRAFT_PHASES)
    span = lambda e: (e["start_ns"], e["end_ns"])
    verifies = sorted(span(e) for e in events if e["phase"] == "verify")
    gaps = [b[0] - a[1] for a, b in zip(verifies, verifies[1:])]
    st.exposed_draft_ms = float(np.mean(gaps)) / 1e6 if gaps else 0.0
    drafting = sorted(span(e) for e in events if e["phase"] in _DRAFT_PHASES)
    total = sum(e - s for s, e in drafting)
    st.overlap_efficiency = _hidden_ns(drafting, verifies) / total if total else 0.0
    if trace:
        st.trace = m.chrome_trace()
    return st


def dump(stats: list[Stats]) -> str:
    return json.dumps([s.to_dict() for s in stats], indent=1)
