"""Chains of lane links (dpara_rt.round.chain): a link queued on the running link's own lane runs next on that thread,
ahead of jobs other threads queued meanwhile, each link keeping its own span; links on another lane go through
that lane's queue; an error in a link ends the chain and reaches the consumer."""
import threading

import pytest
import torch

from dpara_rt import _core
from dpara_rt.round.chain import Chain
from dpara_rt.round.lanes import Lane


@pytest.fixture
def lanes():
    return Lane("target", torch.device("cpu"), None, 1), Lane("drafter", torch.device("cpu"), None, 1)


def test_a_link_on_its_own_lane_runs_next_on_that_thread(lanes):
    target, drafter = lanes
    chain = Chain(lanes, _core.Metrics(3))
    order, threads = [], {}
    started, release = threading.Event(), threading.Event()

    def first():
        threads["first"] = threading.get_ident()
        started.set()
        release.wait(5)  # meanwhile another thread queues a job on this lane
        order.append("first")
        chain.post(target, "second", second)
        chain.post(drafter, "elsewhere", lambda: order.append("elsewhere"))

    def second():
        threads["second"] = threading.get_ident()
        order.append("second")
        chain.post(target, "third", lambda: order.append("third"))

    chain.post(target, "first", first)
    assert started.wait(5)
    target.submit(lambda: order.append("queued meanwhile"))
    release.set()
    target.synchronize()
    drafter.synchronize()
    chain.finish()
    assert list(chain.drain()) == []
    assert [o for o in order if o != "elsewhere"] == ["first", "second", "third", "queued meanwhile"]
    assert "elsewhere" in order and threads["first"] == threads["second"]
    spans = {e["name"]: e for e in _trace(chain)}
    assert set(spans) == {"first", "second", "third", "elsewhere"}
    # each link its own span: the next one starts after the one that queued it closed
    assert spans["first"]["ts"] + spans["first"]["dur"] <= spans["second"]["ts"]
    assert spans["second"]["ts"] + spans["second"]["dur"] <= spans["third"]["ts"]


def test_an_error_in_an_inline_link_ends_the_chain(lanes):
    target, _ = lanes
    chain = Chain(lanes, _core.Metrics(3))
    ran = []

    def fails():
        ran.append("fails")
        raise ValueError("link 2 failed")

    def first():
        ran.append("first")
        chain.post(target, "fails", fails)
        chain.post(target, "never", lambda: ran.append("never"))

    chain.post(target, "first", first)
    with pytest.raises(ValueError, match="link 2 failed"):
        list(chain.drain())
    assert ran == ["first", "fails"]  # the chain stopped: the link queued beside the failing one is skipped
    target.submit(lambda: ran.append("after"))
    target.synchronize()
    assert ran[-1] == "after"  # the lane keeps working


def _trace(chain):
    import json
    events = json.loads(chain.metrics.chrome_trace())
    events = events["traceEvents"] if isinstance(events, dict) else events
    return [e for e in events if e.get("ph") == "X"]
