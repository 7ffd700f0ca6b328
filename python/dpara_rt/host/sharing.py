"""Which weights a drafter worker process maps, and when they move into shared memory.

Pickling a CPU tensor into a spawned process (torch.multiprocessing) moves its storage into shared memory in
place: the old storage is freed, and any native call still reading it through a raw pointer (the Markov head's
factors and bias cache, the host backbone's layers) reads freed memory. So nothing moves while a model may be
in use:

- ``bind(target, drafter)``: an Engine's construction. A model's tensors move into shared memory at its first
  binding, before any Engine can run on them; the target's embedding and output head too, the only parts of
  it a worker maps (through the drafter, which holds them).
- ``for_worker(drafter)``: what a worker is handed. The drafter itself when everything it pickles already is in
  shared memory; otherwise a copy whose other tensors are fresh shared copies (weights replaced after binding),
  so the originals stay where they are.
"""
from __future__ import annotations

import copy
import io
import pickle
import threading
import weakref

import torch
from torch import nn

__all__ = ["bind", "for_worker", "pickled_tensors"]

_lock = threading.Lock()
_bound: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _nothing():
    return None


class _TensorFinder(pickle.Pickler):
    """Pickles an object as a worker's spawn does, recording its tensors instead of writing them."""

    def __init__(self):
        super().__init__(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        self.found: dict[int, torch.Tensor] = {}

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            self.found.setdefault(id(obj), obj)
            return _nothing, ()
        return NotImplemented


def pickled_tensors(obj) -> list[torch.Tensor]:
    """Every tensor that pickling `obj` reaches (each once)."""
    finder = _TensorFinder()
    finder.dump(obj)
    return list(finder.found.values())


def _private(tensors) -> list[torch.Tensor]:
    return [t for t in tensors if t.device.type == "cpu" and not t.is_shared()]


def _share(module: nn.Module) -> None:
    """Move `module`'s CPU tensors into shared memory at its first binding (nothing runs on them yet)."""
    if module in _bound:
        return
    for t in _private(pickled_tensors(module)):
        try:
            t.share_memory_()
        except RuntimeError:  # no room in /dev/shm: a worker, if one starts, takes copies (for_worker)
            break
    _bound.add(module)


def _embedding_and_head(target) -> list[nn.Module]:
    """The target's embedding and output head (ours name them; transformers' models give them by getters)."""
    parts = []
    for name, getter in (("embed_tokens", "get_input_embeddings"), ("lm_head", "get_output_embeddings")):
        part = getattr(target, name, None)
        if not isinstance(part, nn.Module) and callable(getattr(target, getter, None)):
            part = getattr(target, getter)()
        weight = getattr(part, "weight", None)
        if isinstance(part, nn.Module) and isinstance(weight, torch.Tensor) and weight.device.type == "cpu":
            parts.append(part)
    return parts


def bind(target: nn.Module, drafter: nn.Module | None) -> None:
    """An Engine's models: the target's embedding and output head, then the drafter (its own tensors and, when
    they are copies of its own, its embedding and head), each moved into shared memory at its first binding."""
    with _lock:
        for part in _embedding_and_head(target):
            _share(part)
        if drafter is not None and drafter.device.type == "cpu":
            for part in getattr(drafter, "_shared", ()):  # bound with the target, or copies of the drafter's own
                if isinstance(part, nn.Module):
                    _share(part)
            _share(drafter)


def _shared_copy(t: torch.Tensor) -> torch.Tensor:
    c = torch.empty_like(t).share_memory_()  # fresh storage, moved before anything holds its address
    c.copy_(t.detach())
    return nn.Parameter(c, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else c


def for_worker(drafter: nn.Module) -> nn.Module:
    """The drafter to pickle into a worker process: pickling it moves no storage anything else reads."""
    with _lock:
        tensors = pickled_tensors(drafter)
        private = {id(t) for t in _private(tensors)}
        if not private:
            return drafter
        memo = {id(t): _shared_copy(t) if id(t) in private else t for t in tensors}
        memo[id(memo)] = [tensors]  # deepcopy's keep-alive list: the originals outlive the copy
        return copy.deepcopy(drafter, memo)
