"""Host waits and op launches of a decode, counted per link and per round, on any machine.

``HostWaits`` counts every call that makes the host wait for a CUDA device when its tensor lives there: a tensor
read on the host (``item``, ``tolist``, ``numpy``, ``bool()`` / ``int()`` / ``float()`` / ``index()`` of a tensor,
which covers ``if t.any():``), a copy to the host (``cpu()``, ``to("cpu")``), a synchronous copy to a device
(``to(device)`` or ``cuda()`` without ``non_blocking=True``), the ops whose output size is data-dependent
(``nonzero``, a boolean mask as an index, ``masked_select``), and a host-side wait for a lane's event
(``Event.synchronize``: on a GPU the lane is a stream). On CPU tensors none of these waits, so a CI machine
without a GPU counts what a GPU would wait for: the count is of calls, whichever device runs them. A read of host
memory on every machine is no wait: tensors made by ``torch.from_numpy`` (the round state's arrays, a read-back)
and their views are left out. torch.Tensor's methods are patched for the block (a TorchFunctionMode is per thread
and the lanes are threads of their own), so the lanes' calls count too; each is attributed to the chain link
running in its thread (``chain.LINK_HOOKS``).

``Launches`` counts the torch ops dispatched (a TorchDispatchMode entered in every link: views, allocations and
host reads left out), the kernels a CUDA device would launch, per link and per round.

Both are for tests and benchmarks: patching torch.Tensor slows every call down.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dpara_rt import _core
from dpara_rt.round import chain

# (name, what it is) of the patched torch.Tensor methods: reading one of these waits for the device's queue
READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "cpu", "nonzero",
         "masked_select")
# reads that cost nothing on host memory (the rest, copies to a device and event waits, wait whatever the source)
_HOST_READS = {"item", "tolist", "numpy", "bool", "int", "float", "index", "cpu", "nonzero", "masked_select",
               "mask index"}
OUTSIDE = "caller"  # calls made outside any link (the caller's thread: a decode's start and end)


class _Counts:
    def __init__(self):
        self.lock = threading.Lock()
        self.by = collections.Counter()      # (round, link, what) -> calls
        self.where = collections.defaultdict(collections.Counter)  # (link, what) -> {source line: calls}

    def add(self, rnd, link, what, site: str | None = None):
        with self.lock:
            self.by[rnd, link, what] += 1
            if site is not None:
                self.where[link, what][site] += 1

    def per_round(self, rounds) -> dict[int, int]:
        out = collections.Counter()
        for (rnd, _, _), n in self.by.items():
            if rnd in rounds:
                out[rnd] += n
        return {r: out[r] for r in rounds}

    def per_link(self, rounds) -> dict[str, float]:
        """Mean calls per round of each link (and the caller) over `rounds`."""
        out = collections.Counter()
        for (rnd, link, _), n in self.by.items():
            if rnd in rounds:
                out[link] += n
        return {k: v / max(1, len(rounds)) for k, v in sorted(out.items())}

    def per_kind(self, rounds) -> dict[tuple[str, str], float]:
        out = collections.Counter()
        for (rnd, link, what), n in self.by.items():
            if rnd in rounds:
                out[link, what] += n
        return {k: v / max(1, len(rounds)) for k, v in sorted(out.items())}

    def rounds(self) -> list[int]:
        return sorted({r for r, _, _ in self.by if r is not None})


class _Link(threading.local):
    phase = OUTSIDE
    round = None


class _Tracked:
    """Where each thread is: the link it runs (set by a chain.LINK_HOOKS hook) and whether a count is under way."""

    def __init__(self):
        self.link = _Link()
        self.inside = threading.local()

    @contextlib.contextmanager
    def hook(self, phase: str, rnd: int):
        link = self.link
        old = link.phase, link.round
        link.phase, link.round = phase, rnd
        try:
            yield
        finally:
            link.phase, link.round = old


def _steady(rounds: list[int], skip: int) -> list[int]:
    """The rounds past the first `skip` and before the last (which a decode cuts short)."""
    return rounds[skip:-1] if len(rounds) > skip + 1 else rounds[skip:]


class HostWaits(_Tracked):
    """``with HostWaits() as w: engine.generate(...)``; then ``w.steady_per_round()``, ``w.table()``.
    ``sites=True`` also keeps the source line of each call (``w.where``)."""

    def __init__(self, sites: bool = False):
        super().__init__()
        self.counts = _Counts()
        self.sites = sites
        self._saved: dict = {}
        self._host_tensors: list = []   # made by torch.from_numpy: host memory on every machine
        self._host_storages: set = set()  # their storages' addresses

    # ------------------------------------------------------------------ counting
    def _count(self, what: str) -> None:
        link = self.link
        site = None
        if self.sites:
            frames = traceback.extract_stack(limit=9)[:-2]  # less this frame and the patched method's
            inner = [f for f in frames if "/torch/" not in f.filename]
            f = (inner or frames)[-1]
            site = f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
        self.counts.add(link.round, link.phase, what, site)

    def _on_host(self, t) -> bool:
        """Whether `t` is a view of host memory on every machine (made by torch.from_numpy under this guard)."""
        if not isinstance(t, torch.Tensor) or not self._host_storages or t.device.type != "cpu":
            return False
        return t.untyped_storage().data_ptr() in self._host_storages

    def _from_numpy(self, fn):
        def host_tensor(array):
            t = fn(array)
            with self.counts.lock:  # held until the guard exits: its address is not reused by a device tensor
                self._host_tensors.append(t)
                self._host_storages.add(t.untyped_storage().data_ptr())
            return t
        return host_tensor

    def _wrap(self, name: str, fn, when=None):
        inside = self.inside
        reads_host = name in _HOST_READS

        def counted(*args, **kwargs):
            if getattr(inside, "on", False):
                return fn(*args, **kwargs)
            inside.on = True
            try:
                if reads_host and args and self._on_host(args[0]):
                    pass  # host memory: nothing to wait for
                elif when is None or when(*args, **kwargs):
                    self._count(name)
                return fn(*args, **kwargs)
            finally:
                inside.on = False
        counted.__name__ = getattr(fn, "__name__", name)
        return counted

    def __enter__(self):
        T = torch.Tensor
        patches = {name: (T, name, None) for name in READS}
        patches["to"] = (T, "to", _sync_to)
        patches["cuda"] = (T, "cuda", lambda self, *a, **k: not k.get("non_blocking", False))
        patches["__getitem__"] = (T, "__getitem__", _mask_index)
        patches["__setitem__"] = (T, "__setitem__", _mask_index)
        patches["torch.nonzero"] = (torch, "nonzero", None)
        patches["torch.masked_select"] = (torch, "masked_select", None)
        patches["event"] = (_core.Event, "synchronize", None)
        for key, (owner, name, when) in patches.items():
            original = getattr(owner, name)
            self._saved[key] = (owner, name, original)
            label = {"__getitem__": "mask index", "__setitem__": "mask index"}.get(name, name.strip("_"))
            setattr(owner, name, self._wrap("event" if key == "event" else label, original, when))
        self._saved["from_numpy"] = (torch, "from_numpy", torch.from_numpy)
        torch.from_numpy = self._from_numpy(torch.from_numpy)
        chain.LINK_HOOKS.append(self.hook)
        return self

    def __exit__(self, *exc):
        chain.LINK_HOOKS.remove(self.hook)
        for owner, name, original in self._saved.values():
            setattr(owner, name, original)
        self._saved.clear()
        self._host_tensors.clear()
        self._host_storages.clear()
        return False

    # ------------------------------------------------------------------ reading
    def rounds(self) -> list[int]:
        return self.counts.rounds()

    def steady(self, skip: int = 2) -> list[int]:
        """Steady-state rounds: past the first `skip` (a decode's start) and before the last."""
        return _steady(self.rounds(), skip)

    def steady_per_round(self, skip: int = 2) -> float:
        """Mean host waits per steady-state round (links of that round, the caller's calls left out)."""
        rounds = self.steady(skip)
        per = self.counts.per_round(rounds)
        return sum(per.values()) / max(1, len(rounds))

    def per_link(self, skip: int = 2) -> dict[str, float]:
        return self.counts.per_link(self.steady(skip))

    def per_kind(self, skip: int = 2) -> dict[tuple[str, str], float]:
        return self.counts.per_kind(self.steady(skip))

    @property
    def where(self):
        return self.counts.where

    def table(self, skip: int = 2) -> str:
        """Waits per steady-state round, per link and per kind of call."""
        lines = [f"{'link':<14}{'waits/round':>12}  by call"]
        kinds = self.per_kind(skip)
        for link, n in self.per_link(skip).items():
            parts = ", ".join(f"{what} {v:g}" for (lk, what), v in kinds.items() if lk == link)
            lines.append(f"{link:<14}{n:>12.2f}  {parts}")
        lines.append(f"{'round':<14}{self.steady_per_round(skip):>12.2f}")
        return "\n".join(lines)


def _sync_to(self, *args, **kwargs) -> bool:
    """Whether Tensor.to(...) names a device (a copy between host and device when they differ) without
    non_blocking=True."""
    if kwargs.get("non_blocking", False) or (len(args) > 1 and args[1] is True and not isinstance(args[0], str)):
        return False
    target = kwargs.get("device")
    if target is None and args:
        first = args[0]
        if isinstance(first, (str, torch.device)):
            target = first
        elif isinstance(first, torch.Tensor):
            target = first.device
        if isinstance(first, (str, torch.device)) and len(args) > 2 and args[2] is True:
            return False  # to(device, dtype, non_blocking)
    return target is not None


def _mask_index(self, index, *rest) -> bool:
    """Whether an index holds a boolean tensor: its size is the mask's count, read on the host."""
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


_VIEWS_AND_READS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense",
                    "lift_fresh", "detach", "alias", "set_", "resize_", "_reshape_alias", "_unsafe_view",
                    "expand", "view", "clone_if_needed"}


class _CountOps(TorchDispatchMode):
    def __init__(self, counter: "Launches"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in _VIEWS_AND_READS:
            link = self.counter.link
            self.counter.counts.add(link.round, link.phase, name)
        return func(*args, **(kwargs or {}))


class Launches(_Tracked):
    """``with Launches() as n: engine.generate(...)``: torch ops dispatched per link and per round (views,
    allocations and host reads left out). Only ops inside links count (a mode is per thread: one is entered in
    each link)."""

    def __init__(self):
        super().__init__()
        self.counts = _Counts()

    @contextlib.contextmanager
    def hook(self, phase: str, rnd: int):
        with super().hook(phase, rnd), _CountOps(self):
            yield

    def __enter__(self):
        chain.LINK_HOOKS.append(self.hook)
        return self

    def __exit__(self, *exc):
        chain.LINK_HOOKS.remove(self.hook)
        return False

    def steady(self, skip: int = 2) -> list[int]:
        return _steady(self.counts.rounds(), skip)

    def steady_per_round(self, skip: int = 2) -> float:
        rounds = self.steady(skip)
        return sum(self.counts.per_round(rounds).values()) / max(1, len(rounds))

    def per_link(self, skip: int = 2) -> dict[str, float]:
        return self.counts.per_link(self.steady(skip))


__all__ = ["HostWaits", "Launches", "OUTSIDE", "READS"]
