"""The drafter lane as a worker process (dpara_rt.host.context): the same numbers as in this process, the
same outputs from the engine, errors raised to the caller, and an engine that outlives its worker."""
from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from dpara_rt import _core
from dpara_rt.core import slot_tensor, staging_tensor
from dpara_rt.drafting.device import LocalContext
from dpara_rt.host.branch_split import BranchSplit
from dpara_rt.host.backend import HostBackend
from dpara_rt.host.context import WorkerContext
from dpara_rt.host.worker import DrafterWorker
from dpara_rt.engine import WORKER_SPIN_S, Engine
from dpara_rt.round.decoder import Draft
from engine_pairs import predictable_pair

D = 4


@pytest.fixture(scope="module")
def pair():
    return predictable_pair(seed=3)


@pytest.fixture
def one_thread():
    """The worker runs one intra-op thread (as a lane does): so does the local side it is compared with, so that
    reductions split alike and the results are bit-identical."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def worker(pair):
    w = DrafterWorker(pair[1], None, 1)
    yield w
    w.close()


def _buffers(drafter, batch: int, project: bool):
    feature_bytes = batch * (D + 1) * drafter.config.feature_size * drafter.dtype.itemsize
    staging = _core.Staging(batch, D, feature_bytes, -1, shared=True)
    row = drafter.config.vocab_size if project else drafter.config.hidden_size
    ring = _core.BoundaryRing(2, batch, D, row, str(drafter.dtype).removeprefix("torch."), -1, shared=True)
    return staging, ring


def _contexts(drafter, worker, batch: int, max_len: int, project: bool, seed: int):
    """A LocalContext and a WorkerContext over the same drafter, the worker's buffers mapped; and a generator."""
    local, remote = LocalContext(drafter, batch, max_len), WorkerContext(worker, batch, max_len)
    staging, ring = _buffers(drafter, batch, project)
    remote.map_buffers(staging, ring)
    return local, remote, staging, ring, torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("project", [True, False], ids=["logits", "hidden"])
def test_worker_context_computes_what_the_local_one_does(pair, worker, project, one_thread):
    _, drafter = pair
    B, F = 2, drafter.config.feature_size
    local, remote, staging, ring, g = _contexts(drafter, worker, B, 128, project, seed=0)

    prompt = torch.randn(B, 9, F, generator=g)
    for ctx in (local, remote):
        ctx.absorb(prompt, torch.tensor([9, 6]))  # not staged: goes through the worker's "prompt" scratch
    remote.settle()
    bonus = torch.tensor([5, 7])
    assert torch.equal(local.block_logits(bonus, D, False), remote.block_logits(bonus, D, False))

    # A round's features in staging (read there by the worker), then the tree, into a shared ring slot
    feats = torch.randn(B, D + 1, F, generator=g)
    staged = staging_tensor(staging, "features", 1).reshape(-1)[:feats.nbytes].view(feats.dtype).view(feats.shape)
    staged.copy_(feats)
    spine = torch.randint(0, drafter.config.vocab_size, (B, D + 1), generator=g)
    local.absorb(feats, torch.tensor([3, 5]))
    expect = torch.empty_like(slot_tensor(ring, 1))
    local.boundary(spine, 1, expect, project)
    remote.absorb_and_fill(staged, torch.tensor([3, 5]), spine.tolist(), 1, project)  # as Draft.spine_ids gives it
    spans = remote.settle()
    assert [name for name, _, _ in spans] == ["context", "backbone"]
    assert all(t0 <= t1 for _, t0, t1 in spans)
    assert torch.equal(slot_tensor(ring, 1), expect)

    # A request joining row 0, then the batch growing: still the same cache in both
    row = torch.randn(4, F, generator=g)
    for ctx in (local, remote):
        ctx.reset_row(0, row)
        ctx.grow(3)
    assert torch.equal(local.block_logits(torch.tensor([1, 2, 3]), D, False),
                       remote.block_logits(torch.tensor([1, 2, 3]), D, False))


def test_a_drafts_spine_ids_are_its_spine_as_token_lists():
    """What the head sends a drafter worker each round: the spine's ids as lists, built without a tensor."""
    draft = Draft(3, torch.tensor([4, 9]), torch.tensor([[1, 2], [3, 5]]), None, None, _core.Event())
    assert draft.spine_ids() == draft.spine("cpu").tolist() == [[4, 1, 2], [9, 3, 5]]
    ar_round = Draft(1, torch.tensor([4, 9]), None, None, None, _core.Event())
    assert ar_round.spine_ids() == ar_round.spine("cpu").tolist() == [[4], [9]]


def test_a_prompt_larger_than_the_scratch_grows_it_and_the_replies_in_flight_are_kept(pair, worker, one_thread):
    """A prefill's features cross in a shared scratch buffer that grows (a new mapping in the worker) when a prompt
    outgrows it. Growing waits for the worker without dropping the reply of a boundary still in flight (settle
    still gets its spans), and the worker computes from the new mapping what the local context does."""
    _, drafter = pair
    B, F = 2, drafter.config.feature_size
    local, remote, staging, ring, g = _contexts(drafter, worker, B, 2048, False, seed=1)
    small = torch.randn(B, 5, F, generator=g)
    for ctx in (local, remote):
        ctx.absorb(small, torch.tensor([5, 4]))
    remote.settle()
    spine = torch.randint(0, drafter.config.vocab_size, (B, D + 1), generator=g)
    expect = torch.empty_like(slot_tensor(ring, 0))
    local.boundary(spine, 0, expect, False)
    remote.boundary(spine, 0, None, False)  # in flight while the scratch grows
    T = (1 << 20) // (B * F * 4) + 40  # past the first mapping's megabyte
    big = torch.randn(B, T, F, generator=g)
    before = worker.scratch["prompt"][1].numel()
    for ctx in (local, remote):
        ctx.absorb(big, torch.tensor([T, T - 7]))
    assert worker.scratch["prompt"][1].numel() >= big.nbytes > before
    assert [name for name, _, _ in remote.settle()] == ["backbone", "context"]
    assert torch.equal(slot_tensor(ring, 0), expect)
    bonus = torch.tensor([4, 2])
    assert torch.equal(local.block_logits(bonus, D, False), remote.block_logits(bonus, D, False))


def test_a_decode_of_the_same_shape_takes_the_last_ones_buffers_already_mapped(pair, monkeypatch):
    """The engine keeps the last decode's staging and ring, and the worker its mappings of them and of the shared
    buffers: a second decode of the same shape maps nothing new (its ring reset: the first left a slot filled by a
    backbone nobody read), one of another batch size makes and maps its own, and every output equals a fresh
    engine's."""
    target, drafter = pair
    sent = []
    post = DrafterWorker.post
    monkeypatch.setattr(DrafterWorker, "post", lambda self, op, *a, **k: sent.append(op) or post(self, op, *a, **k))
    maps = lambda: [op for op in sent if op.startswith("map_")]  # noqa: E731
    prompts = [[[3, 9, 4, 1]], [[7, 7, 2, 5, 6, 8]], [[3, 9, 4, 1], [7, 7, 2, 5, 6, 8]]]
    eng = Engine(target, drafter, method="dpara", d=D, dpara_ring="hidden", drafter_worker="process")
    try:
        first = eng.generate(prompts[0], 20)
        assert "map_buffers" in maps() and "map_shared" in maps()
        sent.clear()
        second = eng.generate(prompts[1], 20)
        assert maps() == [] and "new_cache" in sent
        sent.clear()
        batch = eng.generate(prompts[2], 20)
        assert "map_buffers" in maps() and "map_shared" in maps()
    finally:
        eng.close()
    for got, batch_prompts in zip((first, second, batch), prompts):
        fresh = Engine(target, drafter, method="dpara", d=D, dpara_ring="hidden", drafter_worker="process")
        try:
            assert got.tokens == fresh.generate(batch_prompts, 20).tokens
        finally:
            fresh.close()


def test_worker_error_is_raised_here_with_its_traceback_and_the_worker_goes_on(worker):
    with pytest.raises(AttributeError) as info:
        worker.call("no_such_call")
    assert any("drafter worker process" in n and "no_such_call" in n for n in getattr(info.value, "__notes__", []))
    assert worker.call("ping") == worker.pid != os.getpid()


def test_calls_and_replies_cross_in_shared_memory_not_the_pipe(pair, monkeypatch):
    """A call and its reply go through the mailboxes (the pipe carries only descriptors to map): with the pipe
    made unusable a call still runs, each push of this side is one call, and a spinning pair answers the same."""
    pushes = []
    push = _core.Mailbox.push
    monkeypatch.setattr(_core.Mailbox, "push", lambda box, raw, timeout: pushes.append(len(raw)) or push(box, raw, timeout))
    for spin in (0.0, 5e-3):
        w = DrafterWorker(pair[1], None, 1, spin_s=spin)
        try:
            pipe, w._conn = w._conn, None  # any use of the pipe now fails
            pushes.clear()
            assert w.call("ping") == w.pid and len(pushes) == 1
            with pytest.raises(AttributeError, match="no_such_call"):
                w.call("no_such_call")
            assert w.call("ping") == w.pid and len(pushes) == 3
            w._conn = pipe
        finally:
            w.close()
        assert not w.alive


def test_the_worker_sleeps_after_a_decode_and_after_a_new_cache_instead_of_spinning(pair, monkeypatch):
    """A worker spins for its next call only within a decode: after the call that starts one (a prefill follows, and
    its second thread wants the worker's core) and after a decode ends, it sleeps at once. Spinning a minute, it would
    still be awake here."""
    w = DrafterWorker(pair[1], None, 1, spin_s=60.0)
    calls = w._calls[0]

    def asleep_soon() -> bool:  # the reader's sleep is registered on the calls mailbox
        for _ in range(500):
            if calls.sleepers == 1:
                return True
            time.sleep(0.002)
        return False

    try:
        assert asleep_soon()  # after its first call, a ping
        context = WorkerContext(w, 1, 64)
        assert w.pending == ("new_cache",) and asleep_soon()
        w.collect()
        context.grow(1)  # a call of a decode: it spins for the next ...
        time.sleep(0.05)
        assert calls.sleepers == 0
        context.rest()  # ... until the decode says it is over
        assert asleep_soon()
        w.collect()
    finally:
        w.close()


def test_a_decode_ends_by_letting_the_worker_sleep(pair):
    target, drafter = pair
    eng = Engine(target, drafter, method="dpara", d=D, drafter_worker="process")
    try:
        eng.generate([[1, 2, 3]], 8)
        assert eng._worker.pending[-1:] == ("rest",)  # dropped by the next decode
        eng.generate([[4, 5, 6]], 8)
        assert eng._worker.pending[-1:] == ("rest",)
    finally:
        eng.close()


@pytest.mark.perf
def test_a_spinning_reader_gives_its_core_to_a_thread_that_wants_it():
    """On one core, a reader spinning for a message leaves the core to another thread that has work: the work takes
    about as long as it does alone, not twice as long (the two time-slicing the core)."""
    script = textwrap.dedent("""
        import os, threading, time, mmap, torch
        from dpara_rt import _core
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # this thread; the reader below inherits it
        mapping = mmap.mmap(-1, _core.Mailbox.bytes_for(4096))
        box = _core.Mailbox(torch.frombuffer(mapping, dtype=torch.uint8).data_ptr(), 4096, True)
        def work():
            t = time.perf_counter()
            sum(range(3_000_000))
            return time.perf_counter() - t
        alone = min(work() for _ in range(3))
        reader = threading.Thread(target=lambda: box.pop(30.0, 60.0))  # spins all along
        reader.start()
        time.sleep(0.01)
        beside = min(work() for _ in range(3))
        box.push(b"done", 1.0)
        reader.join()
        print(beside / alone)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) < 1.4, out.stdout


def test_buffers_not_in_shared_memory_are_refused(pair, worker):
    staging = _core.Staging(1, D, 64)
    ring = _core.BoundaryRing(2, 1, D, 8)
    ctx = WorkerContext(worker, 1, 16)
    with pytest.raises(ValueError, match="shared_fd = -1"):
        ctx.map_buffers(staging, ring)


def test_shared_core_buffers_are_memfds_another_mapping_sees():
    ring = _core.BoundaryRing(2, 1, D, 8, "float32", -1, shared=True)
    staging = _core.Staging(1, D, 100, shared=True)
    for what in (ring, staging):
        assert what.shared_fd >= 0
    with mmap.mmap(os.dup(ring.shared_fd), ring.nbytes) as m:
        other = torch.frombuffer(m, dtype=torch.float32).view(2, 1, D + 1, D, 8)
        other[1, 0, 2, 3, 4] = 7.5
        assert slot_tensor(ring, 1)[0, 2, 3, 4] == 7.5
        del other
    with mmap.mmap(os.dup(staging.shared_fd), staging.nbytes) as m:
        m[staging.offset("draft", 1):staging.offset("draft", 1) + 4] = (11).to_bytes(4, "little")
        assert int(staging_tensor(staging, "draft", 1)[0, 0]) == 11
    assert _core.BoundaryRing(2, 1, D, 8).shared_fd == -1
    with pytest.raises(ValueError, match="device must be -1, got 0"):
        _core.BoundaryRing(2, 1, D, 8, "float32", 0, shared=True)
    with pytest.raises(ValueError, match="device must be -1, got 0"):
        _core.Staging(1, D, 100, 0, shared=True)


@pytest.mark.parametrize("ring", ["logits", "hidden"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_engine_outputs_are_the_same_with_the_drafter_in_a_worker(pair, ring, temperature):
    target, drafter = pair
    prompts = [[3, 9, 4, 1], [7, 7, 2, 5, 6, 8]]
    outs = {}
    for mode in ("thread", "process"):
        eng = Engine(target, drafter, method="dpara", d=D, dpara_ring=ring, drafter_worker=mode)
        try:
            out = eng.generate(prompts, 24, temperature=temperature, seed=5)
        finally:
            eng.close()
        assert (eng._worker is not None) == (mode == "process")
        assert out.stats.fallback_rate == 0 and out.stats.tau > 1
        outs[mode] = out
    assert outs["process"].tokens == outs["thread"].tokens
    if temperature == 0:
        ar = Engine(target, method="ar").generate(prompts, 24).tokens
        assert outs["process"].tokens == ar
    # The worker's own spans are on the timeline: drafting hidden under verification
    assert outs["process"].stats.backbone_ms > 0 and outs["process"].stats.overlap_efficiency > 0


def test_auto_uses_a_worker_for_dpara_split_on_the_host_only(pair):
    target, drafter = pair
    for method, placement, expect in (("dpara", "split", True), ("dpara", "colocated", False),
                                      ("dspark", "split", False)):
        eng = Engine(target, drafter, method=method, d=D, placement=placement)
        eng.generate([[1, 2, 3]], 8)
        assert (eng._worker is not None) == expect, (method, placement)
        if expect:  # on cores of its own (two or more here) it spins for calls; sharing the target's it sleeps
            own = set(eng._worker_cores or ()) and not set(eng._worker_cores) & set(eng.lanes[0].cores or ())
            assert eng._worker._spin_s == (WORKER_SPIN_S if own else 0.0)
        eng.close()
    eng = Engine(target, drafter, method="dpara", d=D, placement="colocated", drafter_worker="process")
    eng.generate([[1, 2, 3]], 8)
    assert eng._worker is not None and eng._worker._spin_s == 0.0
    eng.close()
    with pytest.raises(ValueError, match="drafter_worker 'procs'; expected one of"):
        Engine(target, drafter, drafter_worker="procs")


def test_a_dead_worker_fails_its_decode_and_the_engine_starts_another(pair):
    target, drafter = pair
    eng = Engine(target, drafter, method="dpara", d=D, drafter_worker="process")
    prompts = [[3, 9, 4, 1]]
    try:
        expect = eng.generate(prompts, 32).tokens
        first = eng._worker
        stream = eng.stream(prompts, 32)
        next(stream)
        os.kill(first.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="drafter worker process .* (died|is gone)"):
            for _ in stream:
                pass
        assert not first.alive
        assert eng.generate(prompts, 32).tokens == expect
        assert eng._worker is not first and eng._worker.alive
    finally:
        eng.close()
    assert not eng._worker.alive


@pytest.mark.parametrize("ring", ["logits", "hidden"])
def test_a_sampled_drafts_q_computed_by_the_worker_changes_nothing(pair, ring, monkeypatch):
    """With a drafter worker, a sampled head whose noise was drawn ahead drafts alone and the worker computes the
    draft's q beside verification (noise_ahead.WorkerQ), from the ring slot or, with the hidden ring, from branch
    r as the head projected it: the outputs equal a thread decode's, whose head computes q itself."""
    from dpara_rt.host import noise_ahead
    target, drafter = pair
    prompts = [[3, 9, 4, 1], [7, 7, 2, 5, 6, 8]]
    halves = []
    take = noise_ahead.PendingQ.take
    monkeypatch.setattr(noise_ahead.PendingQ, "take", lambda self: halves.append(self.half) or take(self))
    out = {}
    for mode in ("thread", "process"):
        eng = Engine(target, drafter, method="dpara", d=D, dpara_ring=ring, drafter_worker=mode)
        try:
            out[mode] = [eng.generate(prompts, 24, temperature=t, seed=5, top_p=top_p)
                         for t, top_p in ((1.0, 1.0), (0.7, 0.9))]
        finally:
            eng.close()
        assert halves if mode == "process" else not halves
    rounds = sum(res.stats.rounds for res in out["process"])
    assert len(halves) >= rounds - 4 and set(halves) == {0, 1}  # every round after each decode's serial first
    for threaded, worker in zip(out["thread"], out["process"]):
        assert worker.tokens == threaded.tokens and worker.stats.tau == threaded.stats.tau


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_the_hidden_rings_head_in_one_core_call_changes_nothing(pair, mode, monkeypatch):
    """On the host the hidden ring's head projects branch r and drafts in one core call (HostMarkovHead.from_hidden,
    with the worker's branch buffer when it computes q): the outputs equal those of the projection and the head
    called from Python, greedy and sampled. (With a worker the projection is shared with it, tested below; here
    the head projects alone.)"""
    from dpara_rt.models.drafter import Drafter
    from dpara_rt.host.native import HostMarkovHead
    target, drafter = pair
    prompts = [[3, 9, 4, 1], [7, 7, 2, 5, 6, 8]]
    calls = []
    fused = HostMarkovHead.from_hidden
    monkeypatch.setattr(HostMarkovHead, "from_hidden", lambda self, *a, **k: calls.append(1) or fused(self, *a, **k))
    monkeypatch.setattr(HostBackend, "project_ahead", lambda self, out: None)
    out = {}
    for split in (False, True):
        if split:
            monkeypatch.setattr(Drafter, "packed_head", lambda self: None)
        eng = Engine(target, drafter, method="dpara", d=D, dpara_ring="hidden", drafter_worker=mode)
        try:
            out[split] = [eng.generate(prompts, 24, temperature=t, seed=5) for t in (0.0, 1.0)]
        finally:
            eng.close()
        rounds = sum(res.stats.rounds for res in out[split])
        assert (len(calls) >= rounds - 4) if not split else (len(calls) == 0), (split, len(calls), rounds)
        calls.clear()
    for one, two in zip(out[False], out[True]):
        assert one.tokens == two.tokens and one.stats.tau == two.stats.tau


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_the_worker_projects_a_share_of_branch_r_and_the_drafts_are_the_same(pair, monkeypatch, temperature):
    """With the hidden ring and a drafter worker, verification has the worker project the last columns of branch r
    (project_branch) while the head projects the first ones. The drafts are those of the head projecting alone
    (the same tokens and tau, so the same acceptances), for a batch of two, greedy and sampled, and every round
    after each decode's serial first draft shared its projection."""
    target, drafter = pair
    prompts = [[3, 9, 4, 1], [7, 7, 2, 5, 6, 8]]
    sent = []
    post = DrafterWorker.post
    monkeypatch.setattr(DrafterWorker, "post", lambda self, op, *a, **k: sent.append((op, a)) or post(self, op, *a, **k))
    ahead = HostBackend.project_ahead

    def decode():
        eng = Engine(target, drafter, method="dpara", d=D, dpara_ring="hidden", drafter_worker="process")
        try:
            return eng.generate(prompts, 24, temperature=temperature, seed=5)
        finally:
            eng.close()
    shared = decode()
    shares = [a for op, a in sent if op == "project_branch"]
    assert len(shares) >= shared.stats.rounds - 2 and {a[2] for a in shares} == {0, 1}  # both halves of the buffer
    vocab = drafter.config.vocab_size
    assert all(0 < a[3] < vocab and a[3] % _core.HOST_LINEAR_PANEL == 0 for a in shares), shares[:2]
    # Wherever the split falls, round by round (one panel for either side, or the middle), the drafts are the same
    panel, seen = _core.HOST_LINEAR_PANEL, []

    def jump(self, head, worker, received_ns, columns):
        seen.append(columns)
        self.columns = (panel, vocab - panel, vocab // 2 // panel * panel)[len(seen) % 3]
    monkeypatch.setattr(BranchSplit, "observe", jump)
    sent.clear()
    jumping = decode()
    assert {panel, vocab - panel} <= set(seen) and len(seen) == len([op for op, _ in sent if op == "project_branch"])
    monkeypatch.setattr(HostBackend, "project_ahead", lambda self, out: None)
    sent.clear()
    alone = decode()
    assert not [op for op, _ in sent if op == "project_branch"]
    for other in (shared, jumping):
        assert other.tokens == alone.tokens and other.stats.tau == alone.stats.tau
        assert other.stats.acceptance_histogram == alone.stats.acceptance_histogram
    monkeypatch.setattr(HostBackend, "project_ahead", ahead)


def test_a_right_guess_at_branch_r_skips_the_heads_projection_and_changes_no_draft(pair, monkeypatch):
    """Greedy at batch 1 with the hidden ring and a worker, the worker projects the branch of the last round's r
    after each backbone (BranchGuess); where verification accepts that r the head projects nothing (no share goes
    to the worker either) and drafts from the guess. The tokens, tau and acceptance histogram are those of
    decoding without guesses; sampled and batched decodes make none."""
    from dpara_rt.host.branch_guess import BranchGuess
    from dpara_rt.round.decoder import Decoder
    target, drafter = pair
    decoders, sent, judged = [], [], []
    init, post, accepted = Decoder.__init__, DrafterWorker.post, BranchGuess.accepted
    monkeypatch.setattr(Decoder, "__init__", lambda self, *a, **k: decoders.append(self) or init(self, *a, **k))
    monkeypatch.setattr(DrafterWorker, "post", lambda self, op, *a, **k: sent.append(op) or post(self, op, *a, **k))
    monkeypatch.setattr(BranchGuess, "accepted", lambda self, *a: judged.append(a) or accepted(self, *a))

    def decode(prompts, **kw):
        eng = Engine(target, drafter, method="dpara", d=D, dpara_ring="hidden", drafter_worker="process")
        try:
            return eng.generate(prompts, 40, **kw)
        finally:
            eng.close()
    prompt = [[3, 9, 4, 1, 3, 9, 4, 1]]
    guessed = decode(prompt)
    guess = decoders[-1].drafting.guess
    assert guess.guesses >= guessed.stats.rounds - 2 and guess.hits > 0, (guess.guesses, guess.hits)
    assert sent.count("guess_branch") == guess.guesses
    # every round that goes on is judged (not the last): a hit sends no share; round 1 (s_0 alone) always hits
    assert len(judged) >= guess.guesses - 1 and judged[0][2] == [0]
    assert sent.count("project_branch") == len(judged) - guess.hits
    monkeypatch.setattr(BranchGuess, "post", lambda self, slot, active=True, known=None: None)
    plain = decode(prompt)
    assert decoders[-1].drafting.guess.hits == 0
    assert guessed.tokens == plain.tokens and guessed.stats.tau == plain.stats.tau
    assert guessed.stats.acceptance_histogram == plain.stats.acceptance_histogram
    decode(prompt, temperature=1.0, seed=3)
    assert decoders[-1].drafting.guess is None
    decode(prompt * 2)
    assert decoders[-1].drafting.guess is None


def test_a_guess_is_taken_only_by_the_head_of_the_round_that_found_it_right():
    """BranchGuess with a stand-in context: a known r (an AR round's 0) is posted as it is and leaves the last r
    alone; before a drafted round has accepted, full acceptance is guessed, then the last r; a guess posted for a
    slot hits only that slot's round with the same r; a hit is taken once, by that round's head, and a hit whose
    head never ran (a decode paused there) is not taken by a later round on the same slot."""
    from dpara_rt.host.branch_guess import BranchGuess

    class Context:
        def __init__(self):
            self.posted, self.waited = [], 0

        def shared_buffer(self, name, shape):
            return torch.zeros(shape)

        def guess_branch(self, slot, r):
            self.posted.append((slot, r))

        def wait_guess(self):
            self.waited += 1
    ctx = Context()
    guess = BranchGuess(ctx, 3, 40)
    guess.post(0, known=[0])  # round 1 verifies s_0 alone: its one outcome
    assert ctx.posted == [(0, [0])] and guess.accepted(1, 0, [0]) and guess.take(1, 0) is not None
    guess.post(1)  # no drafted round has accepted yet: full acceptance (d = 3), not the AR round's 0
    assert ctx.posted[-1] == (1, [3])
    assert not guess.accepted(2, 1, [2]) and guess.take(2, 1) is None  # wrong r
    guess.post(0)  # branch 2, the r just accepted
    assert ctx.posted[-1] == (0, [2])
    assert guess.accepted(3, 0, [2]) and guess.take(3, 0) is not None and ctx.waited == 2
    assert guess.take(3, 0) is None  # taken once
    guess.post(1)
    assert guess.accepted(4, 1, [2])  # ... and its head never runs: the decode pauses there
    assert guess.take(6, 1) is None  # a later round's head on the same slot (no guess judged for it) reads none
    guess.post(1)  # branch 2 of slot 1 ... and the decode pauses before that round is verified
    guess.post(1, active=False)  # after the restart, a round on the same slot without a guess (a sampling row)
    assert not guess.accepted(8, 1, [2]) and ctx.posted[-1] == (1, [2])
    assert (guess.hits, guess.guesses) == (3, 5)


def test_the_branch_split_moves_to_where_the_head_and_the_workers_reply_finish_together():
    """BranchSplit from the spans it is shown: a head twice as fast per column as the worker, both starting
    together and the reply delivered at once, settles on 2/3 of the columns; a worker starting earlier leaves
    the head fewer; a reply that arrives late (the head waited past the worker's end) moves columns
    to the head. Columns stay on panel edges with a panel for each side."""
    panel, vocab = 32, 3200

    def settle(start_gap_ns: int, delivery_ns: int, rounds: int = 60) -> BranchSplit:
        split = BranchSplit(vocab, 1, panel)
        for _ in range(rounds):
            c = split.columns
            assert c % panel == 0 and panel <= c <= vocab - panel, c
            head = (10_000, 10_000 + 1 * c)  # 1 ns a column
            worker = (10_000 - start_gap_ns, 10_000 - start_gap_ns + 2 * (vocab - c))  # 2 ns a column
            split.observe(head, worker, max(head[1], worker[1] + delivery_ns), c)
        return split
    assert BranchSplit(vocab, 1, panel).columns == 1216  # 3/8 of the columns before any span, on a panel edge
    together = settle(0, 0)
    assert abs(together.columns - 2 * vocab / 3) <= panel, together.columns
    early = settle(2000, 0)  # a worker starting 2000 ns earlier: the head takes (6400 - 2000) / 3 of them
    assert abs(early.columns - (2 * vocab - 2000) / 3) <= panel, early.columns
    late = settle(0, 300)  # a reply 300 ns behind the worker's end: 100 more columns for the head
    assert late.delivery_ns > 200 and abs(late.columns - (2 * vocab + 300) / 3) <= panel, (late.columns,
                                                                                           late.delivery_ns)
    assert settle(10 ** 9, 0).columns == panel  # a worker far ahead takes all but the head's one panel
    assert settle(-10 ** 9, 0).columns == vocab - panel  # and far behind, all but its own one
    with pytest.raises(ValueError, match="vocab 32 must exceed one panel"):
        BranchSplit(32, 1, panel)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_the_next_heads_noise_drawn_beside_verification_changes_nothing(pair, mode, monkeypatch):
    """A sampled DPara decode's drafter draws the next Markov head's Gumbel noise after its backbone; the head
    reads it (every round after the first) and the outputs equal those of heads that draw their own."""
    from dpara_rt.host import noise_ahead
    target, drafter = pair
    prompts = [[3, 9, 4, 1], [7, 7, 2, 5, 6, 8]]
    taken = []
    take = noise_ahead.NoiseAhead.take
    monkeypatch.setattr(noise_ahead.NoiseAhead, "take", lambda self, *a: taken.append(take(self, *a)) or taken[-1])

    def decode():
        eng = Engine(target, drafter, method="dpara", d=D, drafter_worker=mode)
        try:
            return eng.generate(prompts, 24, temperature=1.0, seed=5)
        finally:
            eng.close()
    drawn = decode()
    used = sum(t is not None for t in taken)
    assert used >= drawn.stats.rounds - 2 and used > 0  # every head after the serial first draft
    monkeypatch.setattr(noise_ahead.NoiseAhead, "plan", lambda self, *a: None)
    taken.clear()
    own = decode()
    assert not any(t is not None for t in taken)
    assert drawn.tokens == own.tokens and drawn.stats.tau == own.stats.tau


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_worker_absorbs_a_rounds_features_while_the_head_runs(pair, monkeypatch, temperature):
    """With a drafter worker, verification sends the accepted features right away (absorb_ahead) and the head's
    link sends only the next backbone; the outputs equal a thread decode's, where the absorb stays in the head's
    link on the drafter lane."""
    target, drafter = pair
    prompts = [[3, 9, 4, 1], [7, 7, 2, 5, 6, 8]]
    sent = []
    post = DrafterWorker.post
    monkeypatch.setattr(DrafterWorker, "post", lambda self, op, *a, **k: sent.append(op) or post(self, op, *a, **k))
    out = {}
    for mode in ("thread", "process"):
        eng = Engine(target, drafter, method="dpara", d=D, drafter_worker=mode)
        try:
            out[mode] = eng.generate(prompts, 24, temperature=temperature, seed=5)
        finally:
            eng.close()
    rounds = out["process"].stats.rounds
    assert "absorb_and_fill" not in sent
    assert sent.count("absorb_staged") >= rounds - 2 and sent.count("boundary") >= rounds - 1
    assert out["process"].tokens == out["thread"].tokens
