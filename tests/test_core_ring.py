"""Boundary ring and staging through the bindings: zero-copy torch views, the slot state machine (also as a
hypothesis property over random acquire / fill / consume sequences), row offsets, and bad input."""
import gc

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dpara_rt import _core, build_info
from dpara_rt.testing import RefRing
from dpara_rt.core import (BoundaryRing, HostLane, Staging, ring_tensor, slot_tensor, stage_in, stage_out,
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
    (dict(d=_core.MAX_DRAFT + 1), f"d must be in 1..{_core.MAX_DRAFT}, got {_core.MAX_DRAFT + 1}"),
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
    rb = staging_tensor(st_, "rb", 0)
    assert rb.shape == (3, 2) and rb.dtype == torch.int32
    feats = staging_tensor(st_, "features", 1, dtype=torch.bfloat16, shape=(3, 8))
    assert feats.shape == (3, 8)
    for region in ("rb", "draft", "features"):
        assert st_.data_ptr(region, 0) % 64 == 0 and st_.data_ptr(region, 1) % 64 == 0
    lane = HostLane("transfer")
    src = torch.tensor([[1, 10], [2, 20], [0, 30]], dtype=torch.int32)
    stage_in(st_, lane, "rb", src, 0)
    lane.synchronize()
    assert torch.equal(rb, src)
    assert staging_tensor(st_, "rb", 1).eq(0).all()  # phase 1 is a separate buffer
    out = torch.zeros(3, 2, dtype=torch.int32)
    stage_out(st_, lane, "rb", out, phase=0)
    lane.synchronize()
    assert torch.equal(out, src)
    with pytest.raises(ValueError, match="28 bytes does not fit staging region 'rb' of 24 bytes"):
        st_.copy_in(lane, "rb", src.data_ptr(), 28, 0)
    with pytest.raises(ValueError, match="'logits'"):
        st_.view("logits", 0)
    for bad in (2, -1):
        with pytest.raises(ValueError, match=f"staging phase must be 0 or 1, got {bad}"):
            st_.view("rb", bad)
    with pytest.raises(TypeError):
        st_.view("rb")  # the phase is required: no "current phase" to fall back on
    with pytest.raises(ValueError, match="strides"):
        stage_in(st_, lane, "draft", torch.zeros(4, 3, dtype=torch.int32).t(), 0)
    with pytest.raises(ValueError, match="batch must be >= 1, got 0"):
        Staging(0, 4, 0)


def test_ring_and_staging_on_device_0():
    """Device ring and pinned staging: a clear error naming device 0 without a GPU; with one, both round-trip
    through DLPack to torch (write through the tensor, read back through the core's copies)."""
    if build_info()["cuda_devices"] == 0:
        with pytest.raises(RuntimeError, match="CUDA device 0"):
            BoundaryRing(1, 1, 1, 4, "float32", 0)
        with pytest.raises(RuntimeError, match="CUDA device 0"):
            Staging(1, 1, 0, 0)
        return
    if not torch.cuda.is_available():
        pytest.skip("the core sees a CUDA device but this torch build has no CUDA")
    ring = BoundaryRing(2, 2, 3, 8, "bfloat16", 0)
    slot0 = torch.from_dlpack(ring.slot(0))
    assert slot0.device == torch.device("cuda", 0) and slot0.shape == (2, 4, 3, 8) and slot0.dtype == torch.bfloat16
    assert slot0.data_ptr() == ring.data_ptr and slot0.eq(0).all()  # zero-filled on the device
    want = torch.randn(2, 4, 3, 8, device="cuda").to(torch.bfloat16)
    slot0.copy_(want)
    torch.cuda.synchronize()
    assert torch.equal(ring_tensor(ring)[0], want) and torch.equal(torch.from_dlpack(ring.slot(0)).cpu(), want.cpu())
    st_ = Staging(2, 3, 64, 0)
    assert st_.pinned and st_.device == 0
    rb = staging_tensor(st_, "rb", 1)
    assert rb.device.type == "cpu" and rb.is_pinned()
    rb.copy_(torch.tensor([[1, 7], [3, 9]], dtype=torch.int32))
    lane = _core.CudaLane(0, name="transfer")
    on_device = torch.zeros(2, 2, dtype=torch.int32, device="cuda")
    st_.copy_out(lane, "rb", on_device.data_ptr(), 16, 1)  # pinned -> device on the lane's stream
    lane.synchronize()
    assert on_device.cpu().tolist() == [[1, 7], [3, 9]]
