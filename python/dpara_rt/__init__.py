"""dpara_rt: a runtime for DPara parallel speculative decoding.

    from dpara_rt import Engine
    out = Engine(target, drafter, method="dpara").generate([[1, 2, 3]], max_new_tokens=64)

The C++ core's primitives are exported too. ``Engine`` and the other front-end classes import torch on first use,
so ``import dpara_rt`` (and a process that only schedules) stays light.
"""
import importlib

from dpara_rt._core import build_info as _core_build_info
from dpara_rt.core import BoundaryRing, CudaLane, Event, HostLane, Lane, Metrics, RoundState, Staging  # noqa: F401
from dpara_rt.core import greedy_accept, now_ns, tree_mask, tree_metadata  # noqa: F401

__version__ = "0.1.0"

# name -> the module that defines it, imported when the name is first read
_LAZY = {
    "Engine": "dpara_rt.engine", "Output": "dpara_rt.engine", "batch_for_memory": "dpara_rt.engine",
    "TextGenerator": "dpara_rt.serving.text", "TextTokenizer": "dpara_rt.serving.text",
    "Scheduler": "dpara_rt.serving.scheduler", "Speculator": "dpara_rt.serving.speculator",
    "load_pair": "dpara_rt.tools.compare",
}

__all__ = [
    "build_info", "BoundaryRing", "CudaLane", "Event", "HostLane", "Lane", "Metrics", "RoundState", "Staging",
    "greedy_accept", "now_ns", "tree_mask", "tree_metadata", *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dpara_rt' has no attribute {name!r}")


def build_info() -> dict:
    """Compiler, whether CUDA was compiled in, and the CUDA devices seen now (count, names, status)."""
    return dict(_core_build_info())
