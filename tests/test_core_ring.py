"""Boundary ring and staging through the bindings: zero-copy torch views, the slot state machine (also as a
hypothesis property over random acquire / fill / consume sequences), row offsets, and bad input."""
import gc

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dpara_rt.core import (BoundaryRing, HostLane, RefRing, Staging, ring_tensor, slot_tensor, stage_in, stage_out,
                           staging_tensor)


@pytest.mark.parametrize("dtype,torch_dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                               ("float16", torch.float16)])
def test_slot_views_alias_ring_memory(dtype, torch_dtype):
    ring = BoundaryRing(3, 2, 4, 11, dtype)
    whole = ring_tensor(ring)
    assert whole.shape == (3, 2, 5, 4, 11) and whole.dtype == torch_dtype
    assert whole.data_ptr() == ring.data_ptr and whole.data_ptr() % 64 == 0
    slot = ring.acquire()
    view = slot_tensor(ring, slot)
    view[1, 2].fill_(3.0)
    assert whole[slot, 1, 2].eq(3.0).all() and whole.sum().item() == 3.0 * 4 * 11


def test_view_keeps_memory_alive_after_ring_is_gone():
    ring = BoundaryRing(1, 1, 2, 8)
    t = slot_tensor(ring, 0)
    t.fill_(7.0)
    del ring
    gc.collect()
    assert t.sum().item() == 7.0 * 3 * 2 * 8
    assert float(np.from_dlpack(BoundaryRing(1, 1, 1, 2).slot(0)).sum()) == 0.0  # numpy consumes it too
    BoundaryRing(1, 1, 1, 2).view().__dlpack__()  # an unconsumed capsule frees its export when dropped


def test_select_offsets_address_the_chosen_rows():
    batch, d, vocab = 3, 4, 6
    ring = BoundaryRing(2, batch, d, vocab)
    flat = ring_tensor(ring).view(-1)
    ring_tensor(ring).copy_(torch.arange(flat.numel(), dtype=torch.float32).view(2, batch, d + 1, d, vocab))
    for _ in range(2):  # land on slot 1 the second time
        slot = ring.acquire()
        ring.mark_ready(slot)
        r = np.array([0, d, 2])
        offsets = ring.select(slot, r)
        assert offsets.dtype == np.int64
        rows = ring_tensor(ring)[slot, torch.arange(batch), torch.from_numpy(r)]  # [batch, d, vocab]
        for b in range(batch):
            got = flat[offsets[b]:offsets[b] + ring.row_elems].view(d, vocab)
            assert torch.equal(got, rows[b])
        ring.release(slot)


def test_state_machine_errors_name_slot_and_states():
    ring = BoundaryRing(2, 1, 3, 5)
    assert ring.acquire() == 0 and ring.acquire() == 1
    with pytest.raises(RuntimeError, match="slot 0 is filling, not free"):
        ring.acquire()
    ring.mark_ready(0)
    with pytest.raises(RuntimeError, match="slot 0 is ready, not free: it has not been consumed"):
        ring.acquire()
    with pytest.raises(RuntimeError, match="cannot mark slot 0 ready: it is ready, expected filling"):
        ring.mark_ready(0)
    with pytest.raises(RuntimeError, match="cannot select slot 1: it is filling, expected ready"):
        ring.select(1, np.array([0]))
    with pytest.raises(RuntimeError, match="cannot release slot 0: it is ready, expected consumed"):
        ring.release(0)
    with pytest.raises(ValueError, match=r"r\[0\] = 4 out of range"):
        ring.select(0, np.array([4]))
    assert ring.state(0) == "ready"
    ring.select(0, np.array([3]))
    assert ring.state(0) == "consumed"
    ring.reset()
    assert [ring.state(i) for i in range(2)] == ["free", "free"] and ring.next_slot == 0


def test_ready_and_release_events_order_producer_and_consumer():
    ring = BoundaryRing(1, 1, 1, 4)
    producer, consumer = HostLane("drafter"), HostLane("markov")
    log = []
    slot = ring.acquire(producer)
    producer.submit(lambda: (slot_tensor(ring, slot).fill_(1.0), log.append("filled")))
    ring.mark_ready(slot, producer.record())
    ring.select(slot, np.array([1]), lane=consumer)  # the consumer lane waits for the ready event
    consumer.submit(lambda: log.append(("read", slot_tensor(ring, slot).sum().item())))
    ring.release(slot, consumer.record())
    assert ring.acquire(producer) == slot  # the producer lane waits for the consumer's release event
    producer.submit(lambda: log.append("refilled"))
    producer.synchronize()
    consumer.synchronize()
    assert log == ["filled", ("read", 8.0), "refilled"]


@pytest.mark.parametrize("args,match", [
    (dict(capacity=0), "capacity must be >= 1, got 0"),
    (dict(batch=0), "batch must be >= 1, got 0"),
    (dict(d=0), "got 0"),
    (dict(d=33), "got 33"),
    (dict(vocab=0), "vocab must be >= 1, got 0"),
    (dict(dtype="int8"), "'int8'"),
    (dict(dtype="int32"), "'int32'"),
])
def test_ring_bad_arguments(args, match):
    kw = {**dict(capacity=2, batch=1, d=2, vocab=4, dtype="float32"), **args}
    with pytest.raises(ValueError, match=match):
        BoundaryRing(**kw)


def test_ring_bad_slot_and_r_shape():
    ring = BoundaryRing(2, 2, 2, 4)
    for call in (lambda: ring.state(2), lambda: ring.slot(-1), lambda: ring.mark_ready(5)):
        with pytest.raises(ValueError, match=r"slot (2|-1|5) out of range for a ring of capacity 2"):
            call()
    ring.acquire()
    ring.mark_ready(0)
    with pytest.raises(ValueError, match=r"got 3 values for batch 2"):
        ring.select(0, np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"shape \(1, 2\)"):
        ring.select(0, np.array([[0, 1]]))
    with pytest.raises(RuntimeError, match="CUDA device 0"):
        BoundaryRing(1, 1, 1, 4, "float32", 0)


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 4), ops=st.lists(st.sampled_from(["acquire", "ready", "select", "release"]),
                                                min_size=20, max_size=200),
       picks=st.lists(st.integers(0, 10 ** 6), min_size=200, max_size=200))
def test_random_sequences_never_overwrite_an_unconsumed_slot(capacity, ops, picks):
    """Each filled slot carries a unique stamp; whenever a stamped slot is consumed, its stamp must still be
    the one written at fill time, and the ring must refuse exactly the moves the model forbids."""
    batch, d, vocab = 2, 2, 3
    ring = BoundaryRing(capacity, batch, d, vocab)
    model = RefRing(capacity, batch, d, vocab)
    data = ring_tensor(ring)
    stamps = {}
    for step, (op, pick) in enumerate(zip(ops, picks)):
        want_states = list(model.states)
        if op == "acquire":
            try:
                slot = model.acquire()
            except RuntimeError:
                with pytest.raises(RuntimeError, match=f"slot {model.next_slot} is {want_states[model.next_slot]}"):
                    ring.acquire()
                continue
            assert ring.acquire() == slot
            data[slot].fill_(float(step))  # the producer writes the slot
            stamps[slot] = float(step)
            continue
        in_state = {"ready": "filling", "select": "ready", "release": "consumed"}[op]
        candidates = [s for s in range(capacity) if model.states[s] == in_state]
        slot = pick % capacity
        if not candidates:
            with pytest.raises(RuntimeError, match=f"slot {slot}"):
                {"ready": lambda: ring.mark_ready(slot), "select": lambda: ring.select(slot, np.zeros(batch)),
                 "release": lambda: ring.release(slot)}[op]()
            continue
        slot = candidates[pick % len(candidates)]
        if op == "ready":
            model.mark_ready(slot)
            ring.mark_ready(slot)
        elif op == "select":
            r = [pick % (d + 1), (pick // 7) % (d + 1)]
            assert list(ring.select(slot, np.array(r))) == model.select(slot, r)
            assert data[slot].eq(stamps[slot]).all(), f"slot {slot} was overwritten before it was consumed"
        else:
            model.release(slot)
            ring.release(slot)
        assert [ring.state(s) for s in range(capacity)] == model.states


def test_staging_regions_views_and_copies():
    st_ = Staging(batch=3, d=4, feature_bytes=3 * 8 * 2)
    assert st_.bytes("rb") == 24 and st_.bytes("draft") == 48 and not st_.pinned and st_.device == -1
    rb = staging_tensor(st_, "rb")
    assert rb.shape == (3, 2) and rb.dtype == torch.int32
    feats = staging_tensor(st_, "features", dtype=torch.bfloat16, shape=(3, 8))
    assert feats.shape == (3, 8)
    for region in ("rb", "draft", "features"):
        assert st_.data_ptr(region, 0) % 64 == 0 and st_.data_ptr(region, 1) % 64 == 0
    lane = HostLane("transfer")
    src = torch.tensor([[1, 10], [2, 20], [0, 30]], dtype=torch.int32)
    stage_in(st_, lane, "rb", src)
    lane.synchronize()
    assert torch.equal(rb, src) and st_.phase == 0
    assert st_.flip() == 1 and st_.phase == 1
    assert staging_tensor(st_, "rb").eq(0).all()  # phase 1 is a separate buffer
    out = torch.zeros(3, 2, dtype=torch.int32)
    stage_out(st_, lane, "rb", out, phase=0)
    lane.synchronize()
    assert torch.equal(out, src)
    with pytest.raises(ValueError, match="28 bytes does not fit staging region 'rb' of 24 bytes"):
        st_.copy_in(lane, "rb", src.data_ptr(), 28)
    with pytest.raises(ValueError, match="'logits'"):
        st_.view("logits")
    with pytest.raises(ValueError, match="got 2"):
        st_.view("rb", 2)
    with pytest.raises(ValueError, match="strides"):
        stage_in(st_, lane, "draft", torch.zeros(4, 3, dtype=torch.int32).t())
    with pytest.raises(ValueError, match="batch must be >= 1, got 0"):
        Staging(0, 4, 0)
    with pytest.raises(RuntimeError, match="CUDA device 0"):
        Staging(1, 1, 0, 0)
