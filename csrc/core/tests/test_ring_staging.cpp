// Boundary ring state machine and staging buffers, without Python.
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#endif

#include "check.h"
#include "dpara_rt/dlpack.h"
#include "dpara_rt/ring.h"
#include "dpara_rt/staging.h"

using namespace dpara_rt;
using namespace std::chrono_literals;

static void test_ring_cycle_and_refusal() {
  BoundaryRing ring(2, 3, 4, 5, DType::float32);
  CHECK(ring.view().shape == (std::vector<std::int64_t>{2, 3, 5, 4, 5}));
  CHECK(ring.slot_view(1).shape == (std::vector<std::int64_t>{3, 5, 4, 5}));
  CHECK(ring.slot_elems() == 3 * 5 * 4 * 5);
  const int s0 = ring.acquire(), s1 = ring.acquire();
  CHECK(s0 == 0 && s1 == 1);
  CHECK(ring.state(0) == SlotState::filling);
  // Slot 0 is filling: the ring is full and must refuse, naming slot and state.
  CHECK_THROWS(ring.acquire(), std::runtime_error, "slot 0 is filling, not free");
  ring.mark_ready(0);
  CHECK_THROWS(ring.acquire(), std::runtime_error, "slot 0 is ready, not free: it has not been consumed");
  std::vector<std::int64_t> r{0, 4, 2}, off(3);
  ring.select(0, r.data(), 3, off.data());
  CHECK(ring.state(0) == SlotState::consumed);
  CHECK_THROWS(ring.acquire(), std::runtime_error, "slot 0 is consumed, not free");
  // Offsets are ring[0][b][r_b] in elements from the ring start.
  const std::int64_t per_request = 5 * 4 * 5, row = 4 * 5;
  CHECK(off[0] == 0 && off[1] == per_request + 4 * row && off[2] == 2 * per_request + 2 * row);
  ring.release(0);
  CHECK(ring.acquire() == 0);  // round-robin wraps
  CHECK(ring.next_slot() == 1);
}

static void test_ring_illegal_transitions() {
  BoundaryRing ring(3, 1, 2, 8, DType::bfloat16);
  std::vector<std::int64_t> r{1}, off(1);
  CHECK_THROWS(ring.mark_ready(0), std::runtime_error, "cannot mark slot 0 ready: it is free, expected filling");
  CHECK_THROWS(ring.select(0, r.data(), 1, off.data()), std::runtime_error, "it is free, expected ready");
  CHECK_THROWS(ring.release(0), std::runtime_error, "cannot release slot 0: it is free, expected consumed");
  ring.acquire();
  CHECK_THROWS(ring.select(0, r.data(), 1, off.data()), std::runtime_error, "it is filling, expected ready");
  ring.mark_ready(0);
  CHECK_THROWS(ring.mark_ready(0), std::runtime_error, "it is ready, expected filling");
  std::vector<std::int64_t> bad{3};
  CHECK_THROWS(ring.select(0, bad.data(), 1, off.data()), std::invalid_argument, "r[0] = 3 out of range");
  CHECK(ring.state(0) == SlotState::ready);  // a rejected select changes nothing
  CHECK_THROWS(ring.select(0, r.data(), 2, off.data()), std::invalid_argument, "got 2 values for batch 1");
  ring.take(0);  // a reader that picks the branches itself: ready -> consumed, no r
  CHECK(ring.state(0) == SlotState::consumed);
  CHECK_THROWS(ring.take(0), std::runtime_error, "cannot take slot 0: it is consumed, expected ready");
  ring.release(0);
  CHECK_THROWS(ring.state(3), std::invalid_argument, "slot 3 out of range");
  CHECK_THROWS(ring.mark_ready(-1), std::invalid_argument, "slot -1 out of range");
  ring.reset();
  CHECK(ring.state(0) == SlotState::free && ring.next_slot() == 0);
}

static void test_ring_bad_arguments() {
  CHECK_THROWS(BoundaryRing(0, 1, 1, 1, DType::float32), std::invalid_argument, "capacity must be >= 1, got 0");
  CHECK_THROWS(BoundaryRing(1, 0, 1, 1, DType::float32), std::invalid_argument, "batch must be >= 1, got 0");
  CHECK_THROWS(BoundaryRing(1, 1, 0, 1, DType::float32), std::invalid_argument, "got 0");
  CHECK_THROWS(BoundaryRing(1, 1, 1, 1, DType::int32), std::invalid_argument, "'int32'");
}

static void test_ring_events_guard_slots() {
  BoundaryRing ring(1, 1, 1, 4, DType::float16);
  HostLane producer, consumer;
  std::atomic<bool> written{false}, read_done{false};
  const int slot = ring.acquire(&producer);
  producer.submit([&] {
    std::this_thread::sleep_for(20ms);
    written = true;
  });
  ring.mark_ready(slot, producer.record());
  std::vector<std::int64_t> r{1}, off(1);
  ring.select(slot, r.data(), 1, off.data());  // waits on the host for the ready event
  CHECK(written.load());
  consumer.submit([&] {
    std::this_thread::sleep_for(20ms);
    read_done = true;
  });
  ring.release(slot, consumer.record());
  bool refilled_after_read = false;
  CHECK(ring.acquire(&producer) == slot);  // the producer lane waits for the consumer's release event
  producer.submit([&] { refilled_after_read = read_done.load(); });
  producer.synchronize();
  CHECK(refilled_after_read);
}

static void test_staging() {
  Staging st(4, 3, 100);
  CHECK(st.bytes(StagingRegion::rb) == 4 * 2 * 4);
  CHECK(st.bytes(StagingRegion::draft) == 4 * 3 * 4);
  CHECK(st.bytes(StagingRegion::features) == 100);
  for (auto region : {StagingRegion::rb, StagingRegion::draft, StagingRegion::features})
    for (int phase : {0, 1}) CHECK(reinterpret_cast<std::uintptr_t>(st.data(region, phase)) % 64 == 0);
  CHECK(st.data(StagingRegion::draft, 0) != st.data(StagingRegion::draft, 1));
  CHECK(st.view(StagingRegion::draft, 1).shape == (std::vector<std::int64_t>{4, 3}));
  CHECK(st.view(StagingRegion::features, 0).dtype == DType::uint8);
  CHECK(!st.pinned() && st.device() == -1);
  HostLane lane;
  std::vector<std::int32_t> rb{1, 10, 2, 20, 0, 30, 3, 40}, back(8, -1);
  st.copy_in(lane, StagingRegion::rb, rb.data(), rb.size() * 4, 0);
  lane.synchronize();
  const auto* p0 = static_cast<const std::int32_t*>(st.data(StagingRegion::rb, 0));
  CHECK(p0[3] == 20 && p0[7] == 40);
  CHECK(static_cast<const std::int32_t*>(st.data(StagingRegion::rb, 1))[3] == 0);  // phase 1 untouched
  st.copy_out(lane, StagingRegion::rb, back.data(), back.size() * 4, 0);
  lane.synchronize();
  CHECK(back == rb);
  CHECK_THROWS(st.copy_in(lane, StagingRegion::rb, rb.data(), 33, 0), std::invalid_argument, "33 bytes");
  for (int bad : {2, -1})
    CHECK_THROWS(st.data(StagingRegion::rb, bad), std::invalid_argument,
                 ("staging phase must be 0 or 1, got " + std::to_string(bad)).c_str());
  CHECK_THROWS(parse_staging_region("logits"), std::invalid_argument, "'logits'");
  CHECK_THROWS(Staging(0, 1, 0), std::invalid_argument, "batch must be >= 1, got 0");
  // Sizes near 2^64 once wrapped in the alignment and allocated a few bytes behind a huge bounds check.
  CHECK_THROWS(Staging(1, 1, std::size_t(1) << 63), std::invalid_argument, "exceeds the limit");
  CHECK_THROWS(Staging(1, 1, ~std::size_t(0)), std::invalid_argument, "exceeds the limit");
  CHECK_THROWS(st.copy_in(lane, StagingRegion::rb, nullptr, 8, 0), std::invalid_argument, "null source pointer");
  CHECK_THROWS(st.copy_out(lane, StagingRegion::rb, nullptr, 8, 0), std::invalid_argument, "null destination");
  st.copy_in(lane, StagingRegion::rb, nullptr, 0, 0);  // nothing to copy: no pointer needed
  lane.synchronize();
}

// Device memory for the ring, pinned memory for staging: a clear error naming device 0 without a GPU; with
// one, a round's hand-off on two CUDA lanes: lane a fills a ring slot on the device and marks it ready with
// its event, lane b selects the rows (waiting on that event) and copies them into pinned staging.
static void test_ring_and_staging_on_device() {
  if (check::cuda_devices() == 0) {
    CHECK_THROWS(BoundaryRing(1, 1, 1, 4, DType::float32, 0), std::runtime_error, "CUDA device 0");
    CHECK_THROWS(Staging(1, 1, 0, 0), std::runtime_error, "CUDA device 0");
    return;
  }
  const int batch = 2, d = 3, vocab = 8;
  BoundaryRing ring(2, batch, d, vocab, DType::float32, 0);
  Staging st(batch, d, std::size_t(batch) * std::size_t(ring.row_elems()) * sizeof(float), 0);
  CHECK(ring.device() == 0 && ring.view().device == 0 && dlpack_device(ring.slot_view(1)).device_type == dlpack::kDLCUDA);
  CHECK(st.pinned() && st.device() == 0 && dlpack_device(st.view(StagingRegion::features, 0)).device_type == dlpack::kDLCPU);
  CudaLane producer(0, 0, "drafter"), consumer(0, 0, "head");
  const std::size_t slot_bytes = std::size_t(ring.slot_elems()) * sizeof(float);
  Buffer src(MemoryKind::host_pinned, slot_bytes);  // pinned: copied in lane order, not when issued
  auto* values = static_cast<float*>(src.data());
  for (std::int64_t i = 0; i < ring.slot_elems(); ++i) values[i] = float(i) + 0.5f;
  const int slot = ring.acquire(&producer);
  producer.copy_async(ring.slot_view(slot).data, src.data(), slot_bytes);
  ring.mark_ready(slot, producer.record());
  std::vector<std::int64_t> r{2, 0}, off(2);
  ring.select(slot, r.data(), batch, off.data(), &consumer);  // consumer's stream waits for the ready event
  const std::size_t row_bytes = std::size_t(ring.row_elems()) * sizeof(float);
  auto* feats = static_cast<char*>(st.data(StagingRegion::features, 1));
  for (int b = 0; b < batch; ++b)
    consumer.copy_async(feats + std::size_t(b) * row_bytes, static_cast<const float*>(ring.data()) + off[std::size_t(b)],
                        row_bytes);
  ring.release(slot, consumer.record());
  consumer.synchronize();
  const auto* got = reinterpret_cast<const float*>(feats);
  bool same = true;
  for (int b = 0; b < batch; ++b)
    for (std::int64_t k = 0; k < ring.row_elems(); ++k)
      same &= got[b * ring.row_elems() + k] == values[off[std::size_t(b)] - slot * ring.slot_elems() + k];
  CHECK(same);
  CHECK(got[0] == values[2 * ring.row_elems()] && ring.state(slot) == SlotState::free);
}

// Shared ring and staging: another process maps the memfd and writes; this one reads the bytes in place.
static void test_shared_memory_across_processes() {
#ifdef __linux__
  BoundaryRing ring(2, 1, 3, 8, DType::float32, -1, /*shared=*/true);
  Staging staging(2, 3, 40, -1, /*shared=*/true);
  CHECK(ring.shared_fd() >= 0 && staging.shared_fd() >= 0);
  CHECK(BoundaryRing(2, 1, 3, 8, DType::float32).shared_fd() == -1);
  CHECK_THROWS(BoundaryRing(2, 1, 3, 8, DType::float32, 0, true), std::invalid_argument, "device must be -1, got 0");
  CHECK_THROWS(Staging(2, 3, 40, 0, true), std::invalid_argument, "device must be -1, got 0");
  const std::size_t ring_bytes = ring.nbytes(), feat_offset = staging.offset(StagingRegion::features, 1);
  const pid_t pid = fork();
  if (pid == 0) {  // the child maps by fd alone, as a drafter worker process does
    void* r = mmap(nullptr, ring_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, ring.shared_fd(), 0);
    void* s = mmap(nullptr, staging.nbytes(), PROT_READ | PROT_WRITE, MAP_SHARED, staging.shared_fd(), 0);
    if (r == MAP_FAILED || s == MAP_FAILED) _exit(2);
    static_cast<float*>(r)[ring.slot_elems() + 5] = 2.5f;       // slot 1, element 5
    static_cast<unsigned char*>(s)[feat_offset + 3] = 0xAB;     // features, phase 1, byte 3
    _exit(0);
  }
  int status = -1;
  CHECK(pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK(static_cast<const float*>(ring.data())[ring.slot_elems() + 5] == 2.5f);
  CHECK(static_cast<const unsigned char*>(staging.data(StagingRegion::features, 1))[3] == 0xAB);
#endif
}

int main() {
  test_ring_cycle_and_refusal();
  test_ring_illegal_transitions();
  test_ring_bad_arguments();
  test_ring_events_guard_slots();
  test_staging();
  test_ring_and_staging_on_device();
  test_shared_memory_across_processes();
  return check::finish("test_ring_staging");
}
