"""Optional, lazily compiled Triton.

Triton is an optional extra: the package must import (and the torch references must run) without it.
Kernel modules therefore do not import triton; they mark their Triton functions with `@kernel` and
launchers call `load()` first, which imports triton and swaps every marked function for its
`triton.jit` version in the modules' globals. Deferring `triton.jit` to the first launch also means
`TRITON_INTERPRET=1` (the CPU interpreter) is honoured when set any time before that launch.
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable

import torch

_MARKED: list[Callable] = []
_JITTED: dict[int, Any] = {}  # id(marked function) -> its triton.jit (marked functions stay alive in _MARKED)
_STATE: dict[str, Any] = {"triton": None}


def kernel(fn: Callable) -> Callable:
    """Mark `fn` (a kernel or a device helper) for `triton.jit` at the first `load()`."""
    _MARKED.append(fn)
    return fn


def available() -> bool:
    """Whether triton can be imported (without importing it when it is absent)."""
    if "triton" in sys.modules:
        return sys.modules["triton"] is not None  # None: imports of triton are blocked
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def load():
    """Import triton, jit every marked function not jitted yet, bind `tl` in their modules; return triton."""
    triton = _STATE["triton"]
    if triton is not None and len(_JITTED) == len(_MARKED):
        return triton
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "the Triton kernels need the optional `triton` package (pip install 'dpara_rt[triton]'); "
            "CPU tensors use the torch references (DPARA_RT_OPS=torch)") from exc
    if interpreting():
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.zeros, InterpretedFunction):
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after triton had been imported; triton's own library is then "
                "compiled for the GPU and cannot run in the interpreter. Set TRITON_INTERPRET=1 before "
                "anything imports triton")
    for fn in _MARKED:
        if id(fn) not in _JITTED:
            _JITTED[id(fn)] = triton.jit(fn)
    # kernels call helpers by global name, possibly imported from another module: rebind them all
    for module_globals in {id(fn.__globals__): fn.__globals__ for fn in _MARKED}.values():
        module_globals["tl"] = tl
        for name, value in list(module_globals.items()):
            if id(value) in _JITTED:
                module_globals[name] = _JITTED[id(value)]
    _STATE["triton"] = triton
    return triton


def check_device(*tensors: torch.Tensor) -> None:
    """Triton runs on CUDA tensors, or on CPU tensors only under the interpreter."""
    for t in tensors:
        if t.device.type != "cuda" and not interpreting():
            raise RuntimeError(
                f"the Triton kernels need CUDA tensors (got a tensor on {t.device}); set TRITON_INTERPRET=1 "
                "to run them on the CPU interpreter, or use DPARA_RT_OPS=torch")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a small number under the interpreter: programs run serially)."""
    if device.type == "cuda":
        return _cuda_sms(torch.cuda.current_device() if device.index is None else device.index)
    return 2


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def on_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """t as `dtype` on `device`, copied between devices only where it is elsewhere: a host tensor's synchronous
    copy waits for the device, so callers upload small host inputs ahead (dpara_rt.ops.upload)."""
    return t.to(dtype) if t.device == device else t.to(device=device, dtype=dtype)


def dot_options(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast, input_precision) for tl.dot on `dtype` operands.

    fp32 uses exact IEEE products so the kernels agree with the fp32 torch references. The interpreter
    multiplies bf16/fp16 operands as their raw integer bits (triton 3.x), so there the operands are
    upcast to fp32 first: the products of 16-bit floats are exact in fp32, so the result is the same
    as the GPU's 16-bit dot with fp32 accumulation, up to summation order.
    """
    if dtype == torch.float32:
        return False, "ieee"
    return interpreting(), "tf32"
