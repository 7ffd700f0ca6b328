"""Lanes as the engine uses them: a core lane (host worker thread or CUDA stream) plus its placement.

On the CPU a lane is a worker thread pinned to its own core(s), so two lanes behave like two devices; on
CUDA it is a stream, and every job submitted to it runs with that stream current.
"""
from __future__ import annotations

import os
import warnings
from typing import Callable, Sequence

import torch

from dpara_rt import _core

PLACEMENTS = ("split", "colocated")


class Lane:
    placement = "split"  # what make_lanes placed the lane with (a split on one CUDA device runs colocated)

    def __init__(self, name: str, device: torch.device, cores: Sequence[int] | None, threads: int):
        self.name, self.device = name, device
        self.cores, self.threads = cores, threads
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device=device)
            self.core = _core.CudaLane(device.index or 0, self.stream.cuda_stream, name)
        else:
            self.stream = None
            self.core = _core.HostLane(name)
        if cores is not None or device.type == "cpu":
            self.pin(cores)

    def pin(self, cores: Sequence[int] | None) -> None:
        """Move a host lane's thread to `cores` (from its next job on)."""
        self.cores = cores
        threads = self.threads
        self.core.submit(lambda: _pin_thread(cores, threads))

    @property
    def device_index(self) -> int:
        """The core's device convention: -1 for the host, else the CUDA ordinal."""
        return -1 if self.device.type == "cpu" else self.device.index or 0

    def submit(self, fn: Callable[[], None]):
        if self.stream is None:
            self.core.submit(fn)
        else:
            stream = self.stream
            self.core.submit(lambda: _on_stream(stream, fn))

    def record(self) -> _core.Event:
        return self.core.record()

    def wait(self, event: _core.Event) -> None:
        """Order what this lane does next after `event` (from a job of this lane: before it goes on)."""
        self.core.wait(event)

    def synchronize(self):
        self.core.synchronize()


def _pin_thread(cores: Sequence[int] | None, threads: int):
    # sched_setaffinity(0) binds only the calling thread: each lane gets its own core(s), like a device.
    if cores is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(threads)


def _on_stream(stream, fn):
    with torch.cuda.stream(stream):
        fn()


def parse_device(value, what: str = "device") -> torch.device:
    """A device argument (``cpu``, ``cuda``, ``cuda:N`` or a torch.device) checked against this machine; ValueError
    naming the value and what this machine takes."""
    expected = "cpu" if not torch.cuda.is_available() else \
        f"cpu, cuda or cuda:N with N < {torch.cuda.device_count()}"
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"{what} {value!r}; expected {expected}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what} {value!r}; expected {expected}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ValueError(f"{what} {value!r}: this machine has {count} CUDA device(s); expected {expected}")
    return device


def make_lanes(target_device: torch.device, drafter_device: torch.device, placement: str, parallel: bool,
               threads: int) -> tuple[Lane, Lane]:
    """The target lane and the drafter lane. `parallel`: the method runs both lanes at once (on the CPU a
    split placement then gives each lane its own cores; serial methods share them whatever the placement).
    On CUDA a split with target and drafter on one device runs colocated (two streams of that device), with a
    warning; the lanes' ``placement`` says which ran."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r}; expected one of {PLACEMENTS}")
    target_device, drafter_device = torch.device(target_device), torch.device(drafter_device)
    if target_device.type != drafter_device.type:
        raise ValueError(f"target on {target_device} and drafter on {drafter_device}: both on CPU or both on CUDA")
    if target_device.type == "cuda":
        if target_device.index is None:
            target_device = torch.device("cuda", torch.cuda.current_device())
        if drafter_device.index is None:
            drafter_device = torch.device("cuda", torch.cuda.current_device())
        if placement == "split" and parallel and drafter_device == target_device:
            # one device holds both: the drafter's stream beside the target's is the split this machine has
            warnings.warn(f"placement 'split' with target and drafter on {target_device} "
                          f"({torch.cuda.device_count()} CUDA device(s)): running colocated, two streams of one "
                          "device (put the drafter on another device to split)", RuntimeWarning, stacklevel=3)
            placement = "colocated"
        if placement == "colocated" and drafter_device != target_device:
            raise ValueError(f"placement 'colocated' needs target and drafter on one device; got {target_device} "
                             f"and {drafter_device}")
        return _placed(placement, Lane("target", target_device, None, threads),
                       Lane("drafter", drafter_device, None, threads))
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    shared = placement == "colocated" or not parallel
    need = threads if shared else 2 * threads
    if len(cores) < need:
        raise ValueError(f"placement {placement!r} with {threads} thread(s) per lane needs {need} CPU "
                         f"cores; this process may use {len(cores)} ({cores})")
    t_cores = cores[:threads]
    d_cores = t_cores if shared else cores[threads:2 * threads]
    return _placed(placement, Lane("target", target_device, t_cores, threads),
                   Lane("drafter", drafter_device, d_cores, threads))


def _placed(placement: str, *lanes: Lane) -> tuple[Lane, ...]:
    for lane in lanes:
        lane.placement = placement
    return lanes
