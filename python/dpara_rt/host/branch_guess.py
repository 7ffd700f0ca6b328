"""The drafter worker's guess at branch r, projected in its idle time beside verification (greedy, batch 1).

With the hidden ring the worker's backbone ends before the target's verify does (at batch 1 on the embedded
pair by about one branch's projection), while branch r's projection waits for r and runs on the critical path,
split over both cores. So right after its backbone the worker projects one branch in full, the one the last
round accepted (an acceptance length repeats itself about a third of the time; before any, full acceptance),
into a shared buffer. DPara's first round verifies s_0 alone, whose one outcome is r = 0: its branch is posted
as known, and what it accepts says nothing of the next round's r. When verification accepts that very r, the
Markov head reads those logits and projects nothing: they are the ones it would have computed (the same packed
head and kernel, every column the same FMA chain).
Otherwise the round runs as without it. No draft depends on the guess, so a wrong one costs the worker's idle
time and nothing falls back.
"""
from __future__ import annotations

import torch


class BranchGuess:
    """One decode's guesses: posted by the head lane with the backbone, checked by verification, taken by the
    next head."""

    def __init__(self, context, d: int, vocab: int):
        self.context = context
        # [1, d, V] float32, shared with the worker. Mapped now, while the decode waits for no reply: mapping is a
        # call, and a call collects every reply before its own (a backbone's, which the head would then miss).
        self._buffer = context.shared_buffer("guess", (1, d, vocab))
        # the r the last drafted round accepted; before one, full acceptance (the most frequent r)
        self._last: list[int] = [d]
        self._posted: tuple[int, list[int]] | None = None  # (slot, guessed r) the worker projects
        self._known = False  # whether the r posted was known rather than guessed (an AR round's, which says nothing
        # about the next round's)
        self._hit: tuple[int, int] | None = None  # (round, slot) whose guess verification found right
        self.hits = self.guesses = 0

    def post(self, slot: int, active: bool = True, known: list[int] | None = None) -> None:
        """Head lane, right after the slot's backbone went out: project branch `last r` of it next, or the r that
        verification will accept when it is `known` (unless not `active`: then this round has no guess, and none
        from an earlier round can match it)."""
        if not active:
            self._posted = None
            return
        r, self._known = (known, True) if known is not None else (self._last, False)
        self.context.guess_branch(slot, r)
        self._posted = (slot, r)
        self.guesses += 1

    def accepted(self, round_: int, slot: int, r: list[int]) -> bool:
        """Target lane, once round `round_`, which read `slot`, accepted r: whether the worker projected branch r."""
        posted, self._posted = self._posted, None
        if not self._known:
            self._last = r
        self._hit = (round_, slot) if posted == (slot, r) else None
        self.hits += self._hit is not None
        return self._hit is not None

    def take(self, round_: int, slot: int) -> torch.Tensor | None:
        """Head lane, after round `round_`: branch r's logits [1, d, V] when that round's guess was right (waiting for
        the worker to finish them, if it has not), else None. A hit left by a round whose head never ran (a decode
        paused there) matches no later round."""
        if self._hit != (round_, slot):
            return None
        self._hit = None
        self.context.wait_guess()
        return self._buffer
