"""The plain autoregressive loop over a `Target`, outside any engine: the reference the decoding methods are
tested against, and how training data is generated. `ARDecoder` runs one round at a time (start, step);
`generate_ar` runs it to the end.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from dpara_rt.host.native import all_finite
from dpara_rt.models.target import Target
from dpara_rt.sampling import check_sampling, make_generator, sample


class ARDecoder:
    def __init__(self, target: Target, max_new_tokens: int, eos_ids: Sequence[int] = (),
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0):
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {max_new_tokens!r}; expected a positive integer")
        check_sampling(temperature, top_p)
        self.target = target
        self.max_new_tokens = max_new_tokens
        self.eos_ids = torch.tensor(sorted(set(int(e) for e in eos_ids)), dtype=torch.long)
        self.temperature, self.top_p = temperature, top_p
        self.generator = make_generator(seed, target.device)
        self.outputs: list[list[int]] = []
        self.finished = torch.zeros(0, dtype=torch.bool)
        self.last = torch.zeros(0, dtype=torch.long)
        self.rounds = 0

    @property
    def done(self) -> bool:
        return bool(self.finished.all())

    def start(self, prompts: list[list[int]]) -> Tensor:
        """Prefill and pick each request's first new token. Returns it, [B]."""
        lens = self.target.check_prompts(prompts)
        # The last new token is never fed back, so a request needs prompt + max_new_tokens - 1 slots.
        need = [n + self.max_new_tokens - 1 for n in lens]
        over = [i for i, n in enumerate(need) if n > self.target.max_len]
        if over:
            i = over[0]
            raise ValueError(f"prompt {i} ({lens[i]} tokens) + max_new_tokens {self.max_new_tokens} needs "
                             f"{need[i]} cache slots, more than max_len {self.target.max_len}")
        logits, _, _ = self.target.start(prompts)
        self.outputs = [[] for _ in prompts]
        self.finished = torch.zeros(len(prompts), dtype=torch.bool)
        self.last = torch.zeros(len(prompts), dtype=torch.long)
        self.rounds = 0
        return self._take(logits)

    def step(self) -> Tensor:
        """One AR round: feed every row's last token, commit it for live rows, pick the next token.
        Returns the new tokens [B] (-1 for rows that had already finished)."""
        if self.done:
            raise RuntimeError("step() after every request finished")
        logits, _ = self.target.verify(self.last[:, None])
        self.target.commit((~self.finished).long())
        self.rounds += 1
        return self._take(logits[:, 0])

    def _take(self, logits: Tensor) -> Tensor:
        if not all_finite(logits):  # an arg-max of NaNs is token 0 (often an EOS): a silent wrong answer
            raise FloatingPointError(f"round {self.rounds}: the target's logits hold non-finite values (NaN or inf); "
                                     "expected finite logits (a damaged model or an overflow in its dtype)")
        tok = sample(logits, self.temperature, self.top_p, self.generator).cpu()
        live = ~self.finished
        tok = torch.where(live, tok, torch.full_like(tok, -1))
        for b in live.nonzero().flatten().tolist():
            self.outputs[b].append(int(tok[b]))
        hit_eos = torch.isin(tok, self.eos_ids)
        too_long = torch.tensor([len(o) >= self.max_new_tokens for o in self.outputs])
        self.finished |= live & (hit_eos | too_long)
        # Finished rows keep being fed a valid token (their slot is never committed).
        self.last = torch.where(live, tok, self.last)
        return tok


def generate_ar(target: Target, prompts: list[list[int]], max_new_tokens: int, eos_ids: Sequence[int] = (),
                temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> list[list[int]]:
    """New tokens for each prompt (EOS included, then stop), greedy at temperature 0, seeded otherwise."""
    dec = ARDecoder(target, max_new_tokens, eos_ids, temperature, top_p, seed)
    dec.start(prompts)
    while not dec.done:
        dec.step()
    return dec.outputs
