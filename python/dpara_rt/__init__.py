"""dpara_rt: a runtime for DPara parallel speculative decoding."""
from dpara_rt._core import build_info as _core_build_info

__version__ = "0.1.0"


def build_info() -> dict:
    """Compiler, whether CUDA was compiled in, and the CUDA devices seen now."""
    return dict(_core_build_info())
