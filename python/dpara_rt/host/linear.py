"""``HostLinear``: an ``nn.Linear`` whose float32 inference forward on the CPU runs the core's host linear layer.

The target's projections are most of a verify on the host. torch's BLAS path runs a few-row float32 matmul far
below the core's FMA peak, and a bf16 checkpoint loaded as float32 streams twice the bytes it needs.
``_core.host_linear`` runs over weights packed once, kept as bfloat16 when that holds them exactly (the
products and sums are still the float32 model's). Each output element is one FMA chain over the input
features in order, so a token's projections are bit for bit the same whether it is verified among T tokens
or decoded alone.

A module's ``host_math`` picks the arithmetic of its native path: ``"float32"`` (the default: the float32 model's
products and sums, over bf16 weights widened exactly) or ``"bf16"`` (weights and inputs rounded to bfloat16, two
products a step summed in float32: AVX512-BF16's dot product, about twice the rate on a verify's few rows, and
still one chain per element, so verifying T tokens gives each the bits of decoding it alone). ``set_host_math``
sets it for every projection of a model.

Everything else falls back to ``F.linear``: autograd, other dtypes and devices, a bias. The packed copy
follows the weight and the math: it is repacked when the weight changes (in place, or a new tensor) or the
math does. ``native_target(False)``
(or ``DPARA_RT_NATIVE_TARGET=0`` in the environment) turns the native target paths off, here and in
``host_qwen3``: for comparing against torch, or bisecting a numerical question.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpara_rt import _core

__all__ = ["HOST_MATHS", "HostLinear", "native_target", "pack_weight", "registrations", "set_host_math"]

HOST_MATHS = ("float32", "bf16")

_registrations = 0
_native_enabled = os.environ.get("DPARA_RT_NATIVE_TARGET", "1") != "0"


def native_target(enabled: bool | None = None) -> bool:
    """Whether float32 CPU inference takes the native target paths (HostLinear, host_qwen3); set it with
    ``enabled``. Returns the setting in force before the call."""
    global _native_enabled
    before = _native_enabled
    if enabled is not None:
        if not isinstance(enabled, bool):
            raise ValueError(f"native_target(enabled={enabled!r}): expected True, False or None")
        _native_enabled = enabled
    return before


def _count_registration(*_):
    global _registrations
    _registrations += 1


# Any parameter or submodule (re)assigned anywhere bumps the count: a packed copy whose count is unchanged need
# only check its own tensors' storage and version, not walk the modules again (a verify is ~1 ms here).
torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
torch.nn.modules.module.register_module_module_registration_hook(_count_registration)


def registrations() -> int:
    """How many parameters and submodules have been registered in this process so far."""
    return _registrations


def _check_math(math) -> None:
    if math not in HOST_MATHS:
        raise ValueError(f"host math {math!r}; expected one of {', '.join(map(repr, HOST_MATHS))}")


def pack_weight(weight: Tensor, math: str = "float32") -> tuple[Tensor, str]:
    """(packed, format name) of a float32 CPU weight [N, K] for ``_core.host_linear``. float32 math: bfloat16
    panels when every weight is a bfloat16 value, float32 panels otherwise; bf16 math: bf16_dot panels."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"pack_weight: weight {tuple(weight.shape)} {weight.dtype} on {weight.device}; "
                         "expected a 2-D float32 CPU tensor [out_features, in_features]")
    _check_math(math)
    w = weight.detach().contiguous()
    n, k = w.shape
    if math == "bf16":
        fmt = "bf16_dot"
    else:
        fmt = "bfloat16" if bool(torch.equal(w, w.to(torch.bfloat16).float())) else "float32"
    packed = torch.empty(_core.host_linear_packed_elems(n, k, fmt), dtype=torch.float32 if fmt == "float32" else
                         torch.int16)
    _core.host_linear_pack(w.data_ptr(), n, k, packed.data_ptr(), fmt)
    return packed, fmt


def set_host_math(model: nn.Module, math: str) -> None:
    """Give every HostLinear of `model` (its output head too, when the model only refers to it, as a drafter does
    to its target's) this arithmetic for its native path: "float32" or "bf16" (see the module docstring). The
    packed copies follow at their next use. The torch path (autograd, other dtypes or devices,
    ``native_target(False)``) computes in its own dtype whatever the setting."""
    _check_math(math)
    linears = [m for m in model.modules() if isinstance(m, HostLinear)]
    head = getattr(model, "lm_head", None)
    for m in linears + ([head] if isinstance(head, HostLinear) else []):
        m.host_math = math
    _count_registration()  # packed layers walk their modules again at their next use


class HostLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) with a native float32 inference path on the CPU."""

    host_math = "float32"  # set_host_math's: the arithmetic of the native path
    _packed: Tensor | None = None
    _packed_dtype = ""  # the packed format's name
    # (weight, its data_ptr, its version, the math) when packed; the weight is held so that its identity is not
    # reused. A tuple: a Parameter assigned to a module attribute would become a parameter of the module.
    _packed_for: tuple = ()

    def __getstate__(self):
        # The packed copy stays behind: a process it is pickled into packs its own (pickling a tensor into a
        # worker would move its storage into shared memory under a native call that reads it here).
        state = dict(super().__getstate__())
        for name in ("_packed", "_packed_dtype", "_packed_for"):
            state.pop(name, None)
        return state

    def _native(self, x: Tensor) -> bool:
        w = self.weight
        return (_native_enabled and self.bias is None and x.dtype == torch.float32 and w.dtype == torch.float32
                and x.device.type == "cpu" and w.device.type == "cpu"
                and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))

    def forward(self, x: Tensor) -> Tensor:
        if not self._native(x):
            return F.linear(x, self.weight, self.bias)
        y = torch.empty(*x.shape[:-1], self.weight.shape[0], dtype=torch.float32)
        self._native_into(x, y)
        return y

    def forward_into(self, x: Tensor, out: Tensor) -> bool:
        """y = x W^T written straight into ``out`` (contiguous, [..., out_features]) by the native path: a ring
        slot filled without a temporary. False (nothing written) where the native path does not apply."""
        if not (self._native(x) and out.dtype == torch.float32 and out.device.type == "cpu"
                and out.is_contiguous() and out.numel() == x[..., :1].numel() * self.weight.shape[0]):
            return False
        self._native_into(x, out)
        return True

    def packed(self) -> tuple[Tensor, str]:
        """(packed weight, format name) for ``_core.host_linear``, packed again if the weight or the math changed
        since."""
        w = self.weight
        src = self._packed_for
        if not src or src[0] is not w or src[1] != w.data_ptr() or src[2] != w._version or src[3] != self.host_math:
            self._packed, self._packed_dtype = pack_weight(w, self.host_math)
            self._packed_for = (w, w.data_ptr(), w._version, self.host_math)
        return self._packed, self._packed_dtype

    def _native_into(self, x: Tensor, y: Tensor) -> None:
        self.packed()
        n, k = self.weight.shape
        if x.shape[-1] != k:
            raise ValueError(f"HostLinear: input {tuple(x.shape)} has {x.shape[-1]} features; expected {k}")
        rows = x.reshape(-1, k).contiguous()
        _core.host_linear(rows.data_ptr(), rows.shape[0], k, self._packed.data_ptr(), self._packed_dtype, n,
                          y.data_ptr())


def project_columns(rows: Tensor, packed: tuple[Tensor, str], out: Tensor, col_begin: int = 0,
                    col_end: int | None = None) -> None:
    """Output columns [col_begin, col_end) of rows [..., K] through a packed weight [V, K] (``pack_weight``), into
    those columns of out [..., V] (contiguous float32): the hidden ring's branch r, split between the Markov head
    and a drafter worker. Every column gets the same FMA chain whichever range computes it."""
    weight, fmt = packed
    k, n = rows.shape[-1], out.shape[-1]
    if not (rows.is_contiguous() and out.is_contiguous() and out.dtype == torch.float32
            and rows.numel() // k == out.numel() // n):
        raise ValueError(f"project_columns: rows {tuple(rows.shape)} and out {tuple(out.shape)} ({out.dtype}); expected "
                         "contiguous tensors of the same rows, out float32")
    _core.host_linear(rows.data_ptr(), rows.numel() // k, k, weight.data_ptr(), fmt, n, out.data_ptr(), col_begin,
                      n if col_end is None else col_end)
