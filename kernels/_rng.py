"""Counter-based random numbers shared by the Triton kernels and their torch references.

Philox4x32-10 (Salmon et al., SC'11; the generator behind tl.philox / tl.rand) keyed by a 64-bit seed,
with a 128-bit counter (index, offset_lo, offset_hi, 0). Both sides turn the first output word into the
same float32 uniform, so a Triton kernel and its torch reference draw bit-identical uniforms.
"""
from __future__ import annotations

import torch

from .triton_support import kernel

tl = None  # bound to triton.language by triton_support.load()

MASK32 = 0xFFFFFFFF
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10
U64_LIMIT = 1 << 63  # seeds and offsets travel as int64 kernel arguments


def split_u64(value: int) -> tuple[int, int]:
    """(lo, hi) 32-bit words of a non-negative 64-bit integer."""
    return value & MASK32, (value >> 32) & MASK32


def as_int32_bits(word: int) -> int:
    """A 32-bit word as the int32 with the same bits (kernel scalar arguments are signed)."""
    return word - (1 << 32) if word >= (1 << 31) else word


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    # 16-bit halves keep every partial product below 2**49, so int64 never overflows
    p_lo = (a & 0xFFFF) * m
    p_hi = (a >> 16) * m
    low_sum = p_lo + ((p_hi & 0xFFFF) << 16)
    return ((p_hi >> 16) + (low_sum >> 32)) & MASK32, low_sum & MASK32


def philox4x32(counter: torch.Tensor, offset: int, seed: int) -> torch.Tensor:
    """First output word of Philox4x32-10 at counters (counter, offset_lo, offset_hi, 0), as int64."""
    c0 = counter.to(torch.int64) & MASK32
    off_lo, off_hi = split_u64(offset)
    c1 = torch.full_like(c0, off_lo)
    c2 = torch.full_like(c0, off_hi)
    c3 = torch.zeros_like(c0)
    k0, k1 = split_u64(seed)
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_W0) & MASK32, (k1 + PHILOX_W1) & MASK32
    return c0


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Odd multiples of 2**-24 in (0, 1): exact in float32 and never 0 or 1 (so log(-log(u)) is finite)."""
    return ((bits >> 9) * 2 + 1).to(torch.float32) * 2.0 ** -24


def gumbel(counter: torch.Tensor, offset: int, seed: int) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(u)) at the given counters (float32)."""
    u = uniform_from_bits(philox4x32(counter, offset, seed))
    return -torch.log(-torch.log(u))


@kernel
def gumbel_noise(seed, counter, off_lo, off_hi):
    """Triton twin of `gumbel`: `counter` a uint32 block; off_lo/off_hi int32 bit patterns of the offset words."""
    zero = tl.zeros_like(counter)
    bits, _c1, _c2, _c3 = tl.philox(seed, counter, zero + off_lo, zero + off_hi, zero)
    u = ((bits >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08  # 2**-24
    return -tl.log(-tl.log(u))
