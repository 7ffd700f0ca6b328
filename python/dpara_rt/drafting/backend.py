"""The drafting-backend seam: everything a round asks of the drafter, as one interface.

A method's chain talks to the drafter only through the ``DraftingBackend`` its ``Decoder`` holds
(``dec.drafting``); the Decoder itself verifies, accepts and hands the round's values between lanes. Two backends
implement it: ``dpara_rt.drafting.device.DeviceBackend`` (torch and Triton on any device, the drafter's forwards
as links of the drafter lane; the same code on CPU tensors) and ``dpara_rt.host.backend.HostBackend`` (CPU hosts:
the drafter in a worker process, the head's noise drawn ahead, branch guesses, branch r's projection shared with
the worker). The engine picks one and hands the Decoder its constructor; the generic round never imports the
host's.

Shapes: B requests, d draft tokens, V the vocabulary, F the target's feature width. Lanes: "head lane" is where
the Markov head runs (``Decoder.head_lane``: the drafter lane, or the target lane when ``head_on_target``).
"""
from __future__ import annotations

from torch import Tensor

from dpara_rt.round.values import Draft, Outcome


class DraftingBackend:
    """The drafter's side of a decode. One instance per Decoder, built by ``backend(dec, drafter, markov)``."""

    head_on_target: bool = False  # the Markov head runs on the target lane, right after verification
    shared_buffers: bool = False  # staging and ring must be in shared memory (another process maps them)
    # has draft_from_device, draft_serial_from_device and start_boundary_on_device: a lagged round's drafting
    drafts_from_device: bool = False

    # -------------------------------------------------------------- the decode's shape
    def map_buffers(self, staging, ring) -> None:
        """The decode's staging and ring, made (or remade after a grow) by the Decoder."""
        raise NotImplementedError

    def options_changed(self) -> None:
        """The Decoder's options changed (a grow, a request's sampling options): re-read what the head uses."""
        raise NotImplementedError

    def grow(self, batch: int) -> None:
        """Continuous batching, lanes idle: `batch` rows from now on, the new ones empty."""
        raise NotImplementedError

    def reset_row(self, b: int, features: Tensor) -> None:
        """Row b's context: emptied, then a joining request's prompt features [T, F]."""
        raise NotImplementedError

    def row_joined(self, b: int) -> None:
        """A request took row b: its per-request seed counts head calls from now on."""
        raise NotImplementedError

    # -------------------------------------------------------------- a round's calls
    def absorb(self, out: Outcome) -> None:
        """Head lane: the features of what `out` accepted into the drafter's context cache."""
        raise NotImplementedError

    def on_accept(self, out: Outcome) -> bool:
        """Target lane, right after verification accepted `out` (a DPara round): anything the backend starts before
        the Markov head's link. True when it has absorbed `out`'s features already (the head then does not)."""
        raise NotImplementedError

    def draft_serial(self, prev: Outcome, n: int | None = None, with_logits: bool = False):
        """n (default d) tokens after `prev` drafted on the critical path (DSpark): the backbone with the bonus as
        anchor, then the Markov head. (draft [B, n], q [B, n, V] or None), plus the backbone's logits if asked."""
        raise NotImplementedError

    def block_logits(self, bonus: Tensor, n: int, prefix: Tensor | None = None,
                     prefix_seen: Tensor | None = None) -> Tensor:
        """Drafter lane: a serial block's logits [B, n, V] after the context, anchored at bonus [B]; PSD's guesses
        put a feature-less spine prefix [B, k] before it, of which row b sees prefix_seen[b] entries."""
        raise NotImplementedError

    def start_boundary(self, prev: Outcome | None, draft: Draft) -> None:
        """Head lane, in the link that sends `draft`: absorb what `prev` accepted (None: nothing new), then fill ring
        slot ``draft.slot`` with the boundary logits of every outcome of `draft`, beside its verification."""
        raise NotImplementedError

    def draft_from_boundary(self, out: Outcome) -> tuple[Tensor, object]:
        """Head lane: the Markov head on branch ``out.r`` of ring slot ``out.slot``, from ``out.bonus``: the next
        (draft [B, d], q) with q as ``resolve_q`` takes it."""
        raise NotImplementedError

    def markov(self, logits: Tensor, r: Tensor, bonus: Tensor) -> tuple[Tensor, Tensor | None]:
        """The Markov head over logits [B, R1, n, V] at rows r [B], from bonus [B]: (draft [B, n], q or None)."""
        raise NotImplementedError

    def resolve_q(self, q):
        """Target lane, after the target's forward: a draft's q [B, d, V] as a tensor (a backend may hand the
        round a handle to a q still being computed)."""
        raise NotImplementedError

    def settle(self) -> None:
        """Head lane: wait for drafting sent elsewhere (a worker) and put its spans on the timeline."""
        raise NotImplementedError

    def rest(self) -> None:
        """The decode is over."""
        raise NotImplementedError


__all__ = ["DraftingBackend"]
