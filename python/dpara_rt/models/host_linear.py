"""``HostLinear``: an ``nn.Linear`` whose float32 inference forward on the CPU runs the core's host linear layer.

The target's projections are most of a verify on the host. torch's BLAS path runs a few-row float32 matmul far
below the core's FMA peak, and a bf16 checkpoint loaded as float32 streams twice the bytes it needs.
``_core.host_linear`` runs over weights packed once, kept as bfloat16 when that holds them exactly (the
products and sums are still the float32 model's). Each output element is one FMA chain over the input
features in order, so a token's projections are bit for bit the same whether it is verified among T tokens
or decoded alone.

Everything else falls back to ``F.linear``: autograd, other dtypes and devices, a bias. The packed copy
follows the weight: it is repacked when the weight changes (in place, or a new tensor). ``native_target(False)``
(or ``DPARA_RT_NATIVE_TARGET=0`` in the environment) turns the native target paths off, here and in
``host_qwen3``: for comparing against torch, or bisecting a numerical question.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpara_rt import _core

__all__ = ["HostLinear", "native_target", "pack_weight", "registrations"]

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


def pack_weight(weight: Tensor) -> tuple[Tensor, str]:
    """(packed, dtype name) of a float32 CPU weight [N, K] for ``_core.host_linear``: bfloat16 panels when every
    weight is a bfloat16 value, float32 panels otherwise."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"pack_weight: weight {tuple(weight.shape)} {weight.dtype} on {weight.device}; "
                         "expected a 2-D float32 CPU tensor [out_features, in_features]")
    w = weight.detach().contiguous()
    n, k = w.shape
    exact = bool(torch.equal(w, w.to(torch.bfloat16).float()))
    dtype = "bfloat16" if exact else "float32"
    packed = torch.empty(_core.host_linear_packed_elems(n, k), dtype=torch.int16 if exact else torch.float32)
    _core.host_linear_pack(w.data_ptr(), n, k, packed.data_ptr(), dtype)
    return packed, dtype


class HostLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) with a native float32 inference path on the CPU."""

    _packed: Tensor | None = None
    _packed_dtype = ""
    # (weight, its data_ptr, its version) when packed; the weight is held so that its identity is not reused.
    # A tuple: a Parameter assigned to a module attribute would become a parameter of the module.
    _packed_for: tuple = ()

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
        """(packed weight, dtype name) for ``_core.host_linear``, packed again if the weight changed since."""
        w = self.weight
        src = self._packed_for
        if not src or src[0] is not w or src[1] != w.data_ptr() or src[2] != w._version:
            self._packed, self._packed_dtype = pack_weight(w)
            self._packed_for = (w, w.data_ptr(), w._version)
        return self._packed, self._packed_dtype

    def _native_into(self, x: Tensor, y: Tensor) -> None:
        self.packed()
        n, k = self.weight.shape
        if x.shape[-1] != k:
            raise ValueError(f"HostLinear: input {tuple(x.shape)} has {x.shape[-1]} features; expected {k}")
        rows = x.reshape(-1, k).contiguous()
        _core.host_linear(rows.data_ptr(), rows.shape[0], k, self._packed.data_ptr(), self._packed_dtype, n,
                          y.data_ptr())
