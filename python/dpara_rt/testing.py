"""Plain-Python twins of the core's round bookkeeping (``RefRoundState``, ``RefRing``, ``ref_greedy_accept``): the
same semantics in lists and dicts, for the tests and ``bench/bench_core.py`` to compare the C++ core with. Nothing
in the runtime uses them."""
from __future__ import annotations

from typing import Sequence

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
