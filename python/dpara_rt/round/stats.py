"""Per-generate statistics (docs/design.md §5), derived from the round timeline the lanes recorded."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


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
    totals = m.phase_totals_ns()
    ms = lambda phases: sum(totals.get(p, 0) for p in phases) / 1e6 / rounds
    st.verify_ms, st.markov_head_ms, st.backbone_ms = ms(("verify",)), ms(("markov_head",)), ms(_DRAFT_PHASES)
    # in the core: copying a timeline of a few hundred events out as dicts cost the call about half a millisecond
    o = m.overlap("verify", list(_DRAFT_PHASES))
    st.exposed_draft_ms = o["mean_gap_ns"] / 1e6
    st.overlap_efficiency = o["hidden_ns"] / o["drafting_ns"] if o["drafting_ns"] else 0.0
    if trace:
        st.trace = m.chrome_trace()
    return st


def dump(stats: list[Stats]) -> str:
    return json.dumps([s.to_dict() for s in stats], indent=1)
