"""Host waits of a round on the device backend, counted on CPU tensors through the torch path (what a GPU would
wait for: dpara_rt.round.sync_guard), with a ratchet: a new host wait in a steady-state round fails here."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from dpara_rt import _core

from dpara_rt.engine import Engine
from dpara_rt.round import chain
from dpara_rt.round.sync_guard import HostWaits, Launches
from engine_pairs import predictable_pair

# A steady-state round of every method, greedy and sampled, waits for the device once: the verify's one read-back
# (the verified block, the arg-max, the finiteness flag and, sampled, the verdicts (r, bonus)); with a static
# verify every method reads the round before, once this one is queued (tests/test_lagged.py). Before the waits went
# (d = 4, 2 requests, greedy/sampled): ar 14/15, dspark 41/55, dpara 48/62; then ar 12/13, dspark 25/30, dpara
# 26/31; then ar 7/8, dspark 12/16, dpara 15/19; then ar 6/7, dspark 10/14, dpara 13/17.
ONE_READ = {("verify", "tolist"): 1.0}
PROMPTS = [[1, 5, 9, 3], [4, 4, 7]]


@pytest.fixture(scope="module")
def pair():
    return predictable_pair()


def test_the_guard_counts_each_kind_of_host_wait_and_its_link():
    t = torch.arange(6)
    from_numpy, synchronize = torch.from_numpy, _core.Event.synchronize
    with HostWaits() as w:
        t.sum().item()
        t.tolist()
        t.numpy()
        bool(t.any())
        int(t[0]), float(t[1])
        t.nonzero()
        t[t > 2]
        t.cpu()
        t.to("cpu")
        t.to("cpu", non_blocking=True)  # not a wait
        t.to(torch.int32)               # not a copy between devices
        _core.Event().synchronize()     # a lane's event, waited for on the host
        host = torch.from_numpy(np.arange(4))  # host memory on every machine: reading it waits for nothing
        host.tolist(), host[1:].numpy(), int(host[0]), host.view(torch.float64).cpu()
        host.clone().tolist()           # a copy made by an op lives where ops run: a read
        with w.hook("verify", 3):
            done = threading.Event()

            def lane():  # another thread, inside a link of its own
                with w.hook("backbone", 3):
                    t.max().item()
                done.set()
            threading.Thread(target=lane).start()
            done.wait()
            t.tolist()
    kinds = {what: n for (_, link, what), n in w.counts.by.items() if link == "caller"}
    assert kinds == {"item": 1, "tolist": 2, "numpy": 1, "bool": 1, "int": 1, "float": 1, "nonzero": 1,
                     "mask index": 1, "cpu": 1, "to": 1, "event": 1}, kinds
    assert w.counts.per_link([3]) == {"backbone": 1.0, "verify": 1.0}
    assert not chain.LINK_HOOKS and torch.Tensor.item.__qualname__.startswith("TensorBase")
    assert torch.from_numpy is from_numpy and _core.Event.synchronize is synchronize  # restored


def _waits_here(t):
    return t.tolist()


def test_the_guard_names_the_line_that_waits():
    with HostWaits(sites=True) as w:
        _waits_here(torch.arange(3))
    [(site, calls)] = w.where["caller", "tolist"].items()
    assert site.startswith("test_host_waits.py:") and site.endswith(" _waits_here") and calls == 1, site


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", ["ar", "dspark", "dpara"])
def test_a_steady_round_waits_for_the_device_once(pair, torch_path, method, sampled):
    target, drafter = pair
    # the static verify: what a CUDA device runs (captured as graphs)
    eng = Engine(target, drafter if method != "ar" else None, method=method, d=4, drafting="device",
                 drafter_worker="thread", temperature=1.0 if sampled else 0.0, verify_mode="static")
    eng.generate(PROMPTS, 8)  # built and warm: the counted decode is a steady one
    with HostWaits() as w:
        eng.generate(PROMPTS, 40, seed=3)
    print(f"\n{method} {'sampled' if sampled else 'greedy'}: {w.steady_per_round():g} host waits per round")
    print(w.table())
    assert len(w.steady()) >= 3, w.rounds()
    assert w.per_kind() == ONE_READ and w.steady_per_round() == 1, w.table()


def test_launches_are_counted_per_link(pair, torch_path):
    target, drafter = pair
    eng = Engine(target, drafter, method="dpara", d=4, drafting="device", drafter_worker="thread")
    with Launches() as n:
        eng.generate(PROMPTS, 24)
    links = n.per_link()
    assert {"verify", "backbone", "markov_head", "context"} <= set(links), links
    assert n.steady_per_round() > 0 and not chain.LINK_HOOKS
