"""dpara_rt: a runtime for DPara parallel speculative decoding."""
from dpara_rt._core import build_info as _core_build_info
from dpara_rt.core import BoundaryRing, CudaLane, Event, HostLane, Lane, Metrics, RoundState, Staging  # noqa: F401
from dpara_rt.core import greedy_accept, now_ns, tree_mask, tree_metadata  # noqa: F401

__version__ = "0.1.0"

__all__ = [
    "build_info", "BoundaryRing", "CudaLane", "Event", "HostLane", "Lane", "Metrics", "RoundState", "Staging",
    "greedy_accept", "now_ns", "tree_mask", "tree_metadata",
]


def build_info() -> dict:
    """Compiler, whether CUDA was compiled in, and the CUDA devices seen now (count, names, status)."""
    return dict(_core_build_info())
