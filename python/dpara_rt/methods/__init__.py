"""The decoding methods, one module each, and the one registry of them that the engine, the CLI, the
comparison and the benchmarks read.

Each method module has ``run(dec, first)``: it queues the method's chain of lane jobs on a ``Decoder``
after the prefill's ``Outcome``. ``VARIANTS`` are the names users pick (a method plus engine arguments).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dpara_rt.methods import ar, dpara, dspark, psd


@dataclass(frozen=True)
class Method:
    run: Callable        # run(dec, first): queue the method's chain
    needs_drafter: bool
    parallel: bool       # drafts while the target verifies: both lanes busy at once
    markov: bool = True  # drafts through the drafter's Markov head (if it has one)
    worker: bool = False  # its drafting may run in a worker process (the host backend's, on CPU hosts)


METHODS = {
    "ar": Method(ar.run, needs_drafter=False, parallel=False),
    "dspark": Method(dspark.run, needs_drafter=True, parallel=False),
    # DFlash: the same serial chain, drafting the backbone's own tokens without the Markov head
    "dflash": Method(dspark.run, needs_drafter=True, parallel=False, markov=False),
    "psd": Method(psd.run, needs_drafter=True, parallel=True),
    "dpara": Method(dpara.run, needs_drafter=True, parallel=True, worker=True),
}
AUTO = "auto"                          # adaptive: profiles these per batch size and keeps the faster
# variant names; AR among them: where verification is compute-bound (large batches on the host) it wins
AUTO_CANDIDATES = ("ar", "dspark", "dpara-logits", "dpara-hidden")

# name -> Engine keyword arguments
VARIANTS = {
    "ar": dict(method="ar"),
    "dspark": dict(method="dspark"),
    "dflash": dict(method="dflash"),
    "psd-pearl": dict(method="psd", psd_policy="pearl"),
    "psd-ssd": dict(method="psd", psd_policy="ssd"),
    "dpara": dict(method="dpara"),  # the ring's contents chosen for the drafter's hardware (options.ring_for)
    "dpara-single": dict(method="dpara", placement="colocated"),
    "dpara-logits": dict(method="dpara", dpara_ring="logits"),
    "dpara-hidden": dict(method="dpara", dpara_ring="hidden"),
    AUTO: dict(method=AUTO),
    "auto-single": dict(method=AUTO, placement="colocated"),
}
_DEFAULTS = dict(placement="split", psd_policy="pearl", dpara_ring="auto")


def variant(name: str) -> dict:
    """Engine keyword arguments of a variant name."""
    if name not in VARIANTS:
        raise ValueError(f"unknown method {name!r}; expected one of {', '.join(VARIANTS)}")
    return dict(VARIANTS[name])


def needs_drafter(method: str) -> bool:
    return method == AUTO or METHODS[method].needs_drafter


def variant_name(method: str, placement: str = "split", psd_policy: str = "pearl", dpara_ring: str = "auto") -> str:
    """The variant name of an engine configuration (the inverse of VARIANTS). Only what changes a method's
    behaviour counts: the PSD policy for psd, the ring's contents for dpara, the placement for methods that
    run both lanes at once."""
    def relevant(kw: dict) -> tuple:
        m = kw["method"]
        parallel = m == AUTO or METHODS[m].parallel
        return (m, kw.get("placement", _DEFAULTS["placement"]) if parallel else None,
                kw.get("psd_policy", _DEFAULTS["psd_policy"]) if m == "psd" else None,
                kw.get("dpara_ring", _DEFAULTS["dpara_ring"]) if m == "dpara" else None)

    want = relevant(dict(method=method, placement=placement, psd_policy=psd_policy, dpara_ring=dpara_ring))
    for name, kw in VARIANTS.items():
        if relevant(kw) == want:
            return name
    return "-".join(str(x) for x in want if x is not None)


__all__ = ["AUTO", "AUTO_CANDIDATES", "METHODS", "Method", "VARIANTS", "needs_drafter", "variant", "variant_name"]
