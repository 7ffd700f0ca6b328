"""Python conveniences over the C++ scheduling core (``dpara_rt._core``).

The core objects are re-exported as they are; this module adds torch views of core memory (zero-copy
through DLPack), staging copies from torch tensors and a timeline ``span`` context manager. The plain-Python
twins of the round bookkeeping that the tests and ``bench/bench_core.py`` compare with are in
``dpara_rt.testing``.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, Sequence

from dpara_rt._core import (
    BoundaryRing,
    CudaLane,
    Event,
    HostLane,
    Lane,
    Metrics,
    RoundState,
    Staging,
    TensorView,
    greedy_accept,
    now_ns,
    tree_mask,
    tree_metadata,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "BoundaryRing", "CudaLane", "Event", "HostLane", "Lane", "Metrics", "RoundState", "Staging", "TensorView",
    "greedy_accept", "now_ns", "tree_mask", "tree_metadata",
    "as_tensor", "ring_tensor", "slot_tensor", "branch_rows", "staging_tensor", "stage_in", "stage_out", "make_lane", "span",
]


# --- zero-copy torch views ---------------------------------------------------------------------------
# torch is imported on first use, so `import dpara_rt` (and a process that only schedules) stays light.
def _from_dlpack(view: TensorView) -> torch.Tensor:
    import torch

    return torch.from_dlpack(view)


def as_tensor(view: TensorView) -> torch.Tensor:
    """A torch tensor aliasing core memory; it keeps that memory alive for as long as it exists."""
    return _from_dlpack(view)


def ring_tensor(ring: BoundaryRing) -> torch.Tensor:
    """The whole ring as [capacity, batch, d+1, d, vocab]."""
    return _from_dlpack(ring.view())


def slot_tensor(ring: BoundaryRing, slot: int) -> torch.Tensor:
    """Ring slot `slot` as [batch, d+1, d, vocab]: the backbone writes it, the Markov head reads ring[slot][b][r_b]."""
    return _from_dlpack(ring.slot(slot))


def branch_rows(slot: "torch.Tensor", r) -> "torch.Tensor":
    """Branch r[b]'s rows of request b from a slot [batch, d+1, d, row], as one contiguous [batch, d, row] (the
    slot's own rows, no copy, for a batch of one): what the hidden ring's head projects."""
    import torch
    if len(r) == 1:
        return slot[0, int(r[0])][None]
    return slot[torch.arange(len(r)), torch.as_tensor(r, device=slot.device)].contiguous()


def staging_tensor(staging: Staging, region: str, phase: int, dtype: torch.dtype | None = None,
                   shape: Sequence[int] | None = None) -> torch.Tensor:
    """A staging region as a tensor: rb int32 [batch, 2], draft int32 [batch, d], features uint8 [bytes].

    ``dtype`` / ``shape`` reinterpret the bytes (e.g. features as bfloat16 [batch, F]) without a copy.
    """
    t = _from_dlpack(staging.view(region, phase))
    if dtype is not None:
        t = t.view(dtype)
    if shape is not None:
        t = t.view(*shape)
    return t


def _contiguous_bytes(tensor: torch.Tensor, staging: Staging, region: str) -> int:
    if not tensor.is_contiguous():
        raise ValueError(f"staging copies need a contiguous tensor, got strides {tuple(tensor.stride())}")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes > staging.bytes(region):
        raise ValueError(f"tensor of {nbytes} bytes does not fit staging region '{region}' of "
                         f"{staging.bytes(region)} bytes")
    return nbytes


def stage_in(staging: Staging, lane: Lane, region: str, tensor: torch.Tensor, phase: int) -> None:
    """Copy `tensor` into a staging region in `lane`'s order (memcpy task / cudaMemcpyAsync).

    The caller keeps `tensor` alive until the lane has passed the copy (e.g. an event recorded after it).
    """
    staging.copy_in(lane, region, tensor.data_ptr(), _contiguous_bytes(tensor, staging, region), phase)


def stage_out(staging: Staging, lane: Lane, region: str, tensor: torch.Tensor, phase: int) -> None:
    """Copy a staging region into `tensor` (same byte size or smaller) in `lane`'s order."""
    staging.copy_out(lane, region, tensor.data_ptr(), _contiguous_bytes(tensor, staging, region), phase)


def make_lane(device: torch.device | str | int | None, name: str = "lane", stream: int = 0) -> Lane:
    """A CudaLane for a CUDA device (adopting `stream` when non-zero), a HostLane for the CPU / None."""
    import torch

    if isinstance(device, int):
        device = torch.device("cuda", device)
    dev = torch.device(device if device is not None else "cpu")
    if dev.type == "cuda":
        return CudaLane(dev.index if dev.index is not None else 0, stream, name)
    if dev.type != "cpu":
        raise ValueError(f"lanes exist for cpu and cuda devices, got {dev}")
    return HostLane(name)


@contextlib.contextmanager
def span(metrics: Metrics, round: int, phase: str, lane: str = "main") -> Iterator[None]:
    """Record the enclosed block as one timeline event (host clock) of `round`."""
    start = now_ns()
    try:
        yield
    finally:
        metrics.add_event(round, phase, lane, start, now_ns())
