"""Where branch r's projection is split between the Markov head and a drafter worker (the hidden ring on a host
with a worker process): a panel edge, learned from both sides' spans."""
from __future__ import annotations


class BranchSplit:
    """Where the Markov head's columns of branch r's projection end and the worker's begin (a panel edge), for one
    batch size of one worker. Each shared projection reports both sides' spans on the lanes' clock, and the split
    moves toward the column where the head finishes just as the worker's reply arrives: the two sides start at
    different times (the worker when verification posts its share, the head after settling the backbone) and run
    at different speeds (the head right after a verify that streamed the target's weights, the worker on its own
    cache), which a fixed share gets right on one host only (3/8 for the head on an AVX2 host, about half on an
    AVX-512 one). The reply's delivery (the worker's send, this process waking from its wait) is part of the
    worker's side. Where the split falls does not change the logits: every column gets the same FMA chain
    whichever side computes it."""
    SMOOTHING = 0.25  # of each projection's estimate: one round's spans are noisy

    def __init__(self, vocab: int, batch: int, panel: int):
        if not vocab > panel:
            raise ValueError(f"BranchSplit: vocab {vocab} must exceed one panel ({panel} columns) to be shared")
        self.vocab, self.panel = vocab, panel
        # before any span: (4B - 1) / 8B of the columns for the head (3/8 at batch 1, about half at batch 16)
        self._estimate = vocab * (4 * batch - 1) / (8 * batch)
        self.columns = self._edge(self._estimate)
        self.delivery_ns = 0.0  # from the worker's end to the head holding its reply, when the head waited

    def _edge(self, cols: float) -> int:
        """cols on a panel edge, leaving each side at least one panel."""
        return min(max(self.panel, int(round(cols / self.panel)) * self.panel), self.vocab - self.panel)

    def observe(self, head: tuple[int, int], worker: tuple[int, int], received_ns: int, columns: int) -> None:
        """The spans (start_ns, end_ns) of the head's projection of columns [0, columns) and the worker's of the
        rest, and when the head held the worker's reply. At its rate each side would be done with split c at
        h0 + c hc and w0 + (V - c) wc + delivery; equal at c = (w0 - h0 + delivery + V wc) / (hc + wc)."""
        (h0, h1), (w0, w1) = head, worker
        s = self.SMOOTHING
        if w1 > h1:  # the head was waiting when the worker finished: the reply's delivery shows
            self.delivery_ns += s * (max(received_ns - w1, 0) - self.delivery_ns)
        hc = max(h1 - h0, 1) / columns  # ns per column
        wc = max(w1 - w0, 1) / (self.vocab - columns)
        balanced = (w0 - h0 + self.delivery_ns + self.vocab * wc) / (hc + wc)
        self._estimate += s * (min(max(balanced, 0.0), float(self.vocab)) - self._estimate)
        self.columns = self._edge(self._estimate)


__all__ = ["BranchSplit"]
