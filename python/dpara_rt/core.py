"""Python conveniences over the C++ scheduling core (``dpara_rt._core``).

The core objects are re-exported as they are; this module adds torch views of core memory (zero-copy
through DLPack), staging copies from torch tensors, a timeline ``span`` context manager, and plain-Python
reference implementations of the round bookkeeping (``RefRoundState``, ``RefRing``,
``ref_greedy_accept``) that the tests and ``bench/bench_core.py`` compare with.
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
    "ref_greedy_accept", "RefRoundState", "RefRing",
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


# --- plain-Python references of the round bookkeeping ---------------------------------------------------
def ref_greedy_accept(draft: Sequence[Sequence[int]], target_argmax: Sequence[Sequence[int]]):
    """Longest prefix with draft[b][i] == target_argmax[b][i], bonus = target_argmax[b][r]."""
    rs, bonuses = [], []
    for t, p in zip(draft, target_argmax):
        r = 0
        while r < len(t) and t[r] == p[r]:
            r += 1
        rs.append(r)
        bonuses.append(p[r])
    return rs, bonuses


class RefRoundState:
    """Plain-Python twin of ``RoundState`` (same semantics, lists instead of arrays)."""

    def __init__(self, batch: int, d: int, max_new_tokens: int, eos_ids: Sequence[int], max_len: int):
        self.batch, self.d, self.max_new_tokens, self.max_len = batch, d, max_new_tokens, max_len
        self.eos_ids = set(eos_ids)
        self.rounds = 0

    def _append(self, b: int, tok: int) -> bool:
        out = self.outputs[b]
        out.append(tok)
        if tok in self.eos_ids:
            self.reasons[b] = "eos"
        elif len(out) >= self.max_new_tokens:
            self.reasons[b] = "length"
        elif self.prompt_lens[b] + len(out) >= self.max_len:
            self.reasons[b] = "max_len"
        return not self.reasons[b]

    def _stop_if_no_room(self, b: int) -> None:
        if not self.reasons[b] and self.target_pos[b] + self.d + 1 > self.max_len:
            self.reasons[b] = "max_len"

    def start(self, prompt_lens: Sequence[int], first_tokens: Sequence[int]) -> list[int]:
        self.prompt_lens = list(prompt_lens)
        self.target_pos = list(prompt_lens)
        self.drafter_pos = list(prompt_lens)
        self.outputs = [[] for _ in range(self.batch)]
        self.reasons = [""] * self.batch
        self.slots = [[] for _ in range(self.batch)]
        self.spine = [[tok] + [0] * self.d for tok in first_tokens]
        for b, tok in enumerate(first_tokens):
            if self._append(b, tok):
                self._stop_if_no_room(b)
        self.rounds = 0
        return [1] * self.batch

    def set_draft(self, draft: Sequence[Sequence[int]]) -> None:
        for b in range(self.batch):
            self.spine[b][1:] = list(draft[b])

    def step(self, target_argmax: Sequence[Sequence[int]], slot: int = -1):
        r, bonus = ref_greedy_accept([s[1:] for s in self.spine], target_argmax)
        committed = self.commit(r, bonus, slot)
        for b in range(self.batch):
            if committed[b] == 0:
                r[b], bonus[b] = 0, self.spine[b][0]
        return r, bonus, committed

    def commit(self, r: Sequence[int], bonus: Sequence[int], slot: int = -1) -> list[int]:
        committed = [0] * self.batch
        for b in range(self.batch):
            if self.reasons[b]:
                continue
            n, running = 0, True
            for tok in self.spine[b][1:r[b] + 1] + [bonus[b]]:
                running = self._append(b, tok)
                n += 1
                if not running:
                    break
            committed[b] = n
            self.target_pos[b] += n
            self.drafter_pos[b] += n
            self.slots[b].append(slot)
            self.spine[b][0] = bonus[b]
            self._stop_if_no_room(b)
        self.rounds += 1
        return committed

    def finished(self) -> list[bool]:
        return [bool(x) for x in self.reasons]


class RefRing:
    """Plain-Python twin of ``BoundaryRing``'s slot bookkeeping (states and row offsets, no memory)."""

    def __init__(self, capacity: int, batch: int, d: int, vocab: int):
        self.capacity, self.batch, self.d, self.vocab = capacity, batch, d, vocab
        self.states = ["free"] * capacity
        self.next_slot = 0
        self.row = d * vocab
        self.slot_elems = batch * (d + 1) * self.row

    def _move(self, slot: int, want: str, to: str, what: str) -> None:
        if self.states[slot] != want:
            raise RuntimeError(f"cannot {what} slot {slot}: it is {self.states[slot]}, expected {want}")
        self.states[slot] = to

    def acquire(self) -> int:
        slot = self.next_slot
        if self.states[slot] != "free":
            raise RuntimeError(f"slot {slot} is {self.states[slot]}, not free")
        self.states[slot] = "filling"
        self.next_slot = (slot + 1) % self.capacity
        return slot

    def mark_ready(self, slot: int) -> None:
        self._move(slot, "filling", "ready", "mark ready")

    def select(self, slot: int, r: Sequence[int]) -> list[int]:
        for b, rb in enumerate(r):
            if not 0 <= rb <= self.d:
                raise ValueError(f"r[{b}] = {rb} out of range: expected 0..{self.d}")
        self._move(slot, "ready", "consumed", "select")
        base, per_request = slot * self.slot_elems, (self.d + 1) * self.row
        return [base + b * per_request + rb * self.row for b, rb in enumerate(r)]

    def release(self, slot: int) -> None:
        self._move(slot, "consumed", "free", "release")
