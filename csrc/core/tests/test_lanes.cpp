// Lanes, events and the DLPack export, without Python.
#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "dpara_rt/build_info.h"
#include "dpara_rt/dlpack.h"
#include "dpara_rt/lane.h"
#include "dpara_rt/types.h"

using namespace dpara_rt;
using namespace std::chrono_literals;

static void test_fifo_order() {
  HostLane lane("fifo");
  std::vector<int> seen;
  for (int i = 0; i < 1000; ++i) lane.submit([&seen, i] { seen.push_back(i); });
  lane.synchronize();
  CHECK(seen.size() == 1000);
  bool ordered = true;
  for (int i = 0; i < 1000 && i < int(seen.size()); ++i) ordered &= seen[std::size_t(i)] == i;
  CHECK(ordered);
  CHECK(lane.pending() == 0);
}

static void test_record_completes_after_prior_work() {
  HostLane lane;
  std::atomic<bool> release{false}, ran{false};
  lane.submit([&] {
    while (!release) std::this_thread::sleep_for(1ms);
    ran = true;
  });
  Event e = lane.record();
  CHECK(!e.query());  // the blocking task is still ahead of it
  release = true;
  e.synchronize();
  CHECK(ran.load());
  CHECK(e.query());
  // An idle lane completes its event at once.
  lane.synchronize();
  const std::int64_t before = now_ns();
  Event idle = lane.record();
  CHECK(idle.query());
  CHECK(idle.timestamp_ns() >= before);
  CHECK(idle.timestamp_ns() <= now_ns());
}

static void test_cross_lane_wait() {
  HostLane producer("producer"), consumer("consumer");
  std::atomic<int> value{0};
  int observed = -1;
  producer.submit([&] {
    std::this_thread::sleep_for(30ms);
    value = 42;
  });
  Event ready = producer.record();
  consumer.wait(ready);
  consumer.submit([&] { observed = value.load(); });
  consumer.synchronize();
  CHECK(observed == 42);
  CHECK(ready.query());
}

static void test_exception_capture() {
  HostLane lane;
  bool after = false;
  lane.submit([] { throw std::runtime_error("boom in task"); });
  lane.submit([&] { after = true; });
  CHECK_THROWS(lane.synchronize(), std::runtime_error, "boom in task");
  CHECK(after);         // the lane kept running
  lane.synchronize();   // the error was delivered once
}

static void test_exception_from_record() {
  HostLane lane;
  lane.submit([] { throw std::invalid_argument("bad value 7"); });
  std::this_thread::sleep_for(20ms);
  CHECK_THROWS(lane.record(), std::invalid_argument, "bad value 7");
  Event e = lane.record();  // delivered once: the lane is usable again
  e.synchronize();
  CHECK(e.query());
}

static void test_lane_dropped_by_its_own_task() {
  // The last reference goes away inside the lane's own worker: no self-join, no use after free (ASan).
  auto lane = std::make_shared<HostLane>("self");
  std::weak_ptr<HostLane> weak = lane;
  std::atomic<bool> dropped{false};
  std::atomic<int> after{0};
  lane->submit([keep = lane, &dropped] {
    while (!dropped) std::this_thread::sleep_for(1ms);
  });
  lane->submit([&after] { ++after; });  // still runs: the worker drains the queue on its own
  lane.reset();
  dropped = true;
  for (int i = 0; i < 2000 && !weak.expired(); ++i) std::this_thread::sleep_for(1ms);
  CHECK(weak.expired());
  for (int i = 0; i < 2000 && after == 0; ++i) std::this_thread::sleep_for(1ms);
  CHECK(after == 1);
  std::this_thread::sleep_for(20ms);  // let the detached worker finish before the process exits
}

static void test_synchronize_from_own_task() {
  HostLane lane("inner");
  lane.submit([&lane] { lane.synchronize(); });
  CHECK_THROWS(lane.synchronize(), std::runtime_error, "from one of its own tasks");
}

static void test_events() {
  Event null_event;
  CHECK(null_event.query());
  null_event.synchronize();
  CHECK(null_event.is_host());
  HostLane lane;
  Event a = lane.record();
  lane.submit([] { std::this_thread::sleep_for(20ms); });
  Event b = lane.record();
  const double ms = Event::elapsed_ms(a, b);
  CHECK(ms >= 19.0);
  CHECK(ms < 5000.0);
  CHECK_THROWS(Event::elapsed_ms(null_event, b), std::invalid_argument, "null event");
  CHECK(Event::completed_host().query());
}

static void test_copy_async() {
  HostLane lane;
  std::vector<int> src{1, 2, 3, 4}, dst(4, 0);
  lane.copy_async(dst.data(), src.data(), sizeof(int) * 4);
  lane.synchronize();
  CHECK(dst == src);
}

// A task is its lane's position: record() inside it is complete at once, even with work queued behind.
static void test_record_inside_task() {
  HostLane lane("inner-record");
  std::atomic<bool> queued{false}, release{false}, complete_inside{false}, rethrown{false};
  std::atomic<std::int64_t> stamp{0}, before{0};
  lane.submit([&] {
    while (!queued) std::this_thread::sleep_for(1ms);
    before = now_ns();
    Event e = lane.record();
    complete_inside = e.query();
    stamp = e.timestamp_ns();
  });
  lane.submit([&] {
    while (!release) std::this_thread::sleep_for(1ms);
  });
  queued = true;  // the second task is queued behind the first before it records
  for (int i = 0; i < 5000 && stamp == 0; ++i) std::this_thread::sleep_for(1ms);
  CHECK(complete_inside.load());
  CHECK(stamp >= before && stamp <= now_ns());
  CHECK(lane.pending() == 1);  // the queued task has not run: the event did not wait for it
  Event outside = lane.record();  // from another thread: still queued behind the blocked task
  CHECK(!outside.query());
  release = true;
  outside.synchronize();
  // An error of an earlier task stays for the caller that collects it, not for a task that records.
  lane.submit([] { throw std::runtime_error("task error 5"); });
  lane.submit([&] {
    try {
      lane.record();
    } catch (...) {
      rethrown = true;
    }
  });
  CHECK_THROWS(lane.synchronize(), std::runtime_error, "task error 5");
  CHECK(!rethrown.load());
}

// wait() inside a task blocks that task until the event completes (cudaStreamWaitEvent for host work).
static void test_wait_inside_task() {
  HostLane a("a"), b("b");
  std::atomic<int> value{0};
  int observed = -1;
  b.submit([&] {
    std::this_thread::sleep_for(30ms);
    value = 42;
  });
  const Event written = b.record();
  a.submit([&, written] {
    a.wait(written);
    observed = value.load();  // the same task, right after the wait
  });
  a.synchronize();
  CHECK(observed == 42);
}

// copy_async inside a task copies inline: the task can read the destination right away.
static void test_copy_async_inside_task() {
  HostLane lane("inner-copy");
  std::vector<int> src{5, 6, 7}, dst(3, 0);
  bool seen_inside = false;
  lane.submit([&] {
    lane.copy_async(dst.data(), src.data(), sizeof(int) * 3);
    seen_inside = dst == src;
  });
  lane.synchronize();
  CHECK(seen_inside);
}

static void test_cuda_lane() {
  const int n = check::cuda_devices();
  // One past the last device never exists: the error names the index, with or without a GPU.
  CHECK_THROWS(CudaLane(n), std::runtime_error, ("CUDA device " + std::to_string(n)).c_str());
  if (n == 0) {
    CHECK_THROWS(CudaLane(0), std::runtime_error, "CUDA device 0");
    return;
  }
  // Lane a writes device memory; lane b waits on a's event and copies it back. A host lane's event (its
  // task fills the source late) orders lane a first, so b can only see the data through the event chain.
  CudaLane a(0, 0, "a"), b(0, 0, "b");
  CHECK(a.device() == 0 && a.owns_stream() && a.stream() != 0 && a.stream() != b.stream());
  // Pinned host memory: a copy from pageable memory would read its source when issued, not in lane order.
  constexpr std::size_t kInts = 1 << 20, kBytes = kInts * sizeof(int);
  Buffer dev(MemoryKind::device, kBytes, 0), src(MemoryKind::host_pinned, kBytes), back(MemoryKind::host_pinned, kBytes);
  auto* s = static_cast<int*>(src.data());
  auto* r = static_cast<int*>(back.data());
  HostLane filler("filler");
  filler.submit([&] {
    std::this_thread::sleep_for(20ms);
    for (std::size_t i = 0; i < kInts; ++i) s[i] = int(i * 7 + 1);
  });
  a.wait(filler.record());
  a.copy_async(dev.data(), src.data(), kBytes);
  const Event written = a.record();
  CHECK(written.device() == 0 && !written.is_host());
  b.wait(written);
  b.copy_async(back.data(), dev.data(), kBytes);
  b.synchronize();
  CHECK(std::memcmp(r, s, kBytes) == 0 && r[kInts - 1] == int((kInts - 1) * 7 + 1));
  CHECK(written.query());
  CHECK(Event::elapsed_ms(written, b.record()) >= 0.0);
}

static void test_dlpack_export() {
  auto buf = std::make_shared<Buffer>(MemoryKind::host, 2 * 3 * 4 * sizeof(float));
  CHECK(reinterpret_cast<std::uintptr_t>(buf->data()) % Buffer::kAlignment == 0);
  TensorView v{buf, buf->data(), DType::float32, {2, 3, 4}, -1};
  CHECK(v.numel() == 24);
  dlpack::DLManagedTensor* m = to_dlpack(v);
  CHECK(buf.use_count() == 3);  // buf, v, and the managed tensor, which keeps the memory alive
  CHECK(m->dl_tensor.ndim == 3);
  CHECK(m->dl_tensor.shape[2] == 4);
  CHECK(m->dl_tensor.strides[0] == 12 && m->dl_tensor.strides[1] == 4 && m->dl_tensor.strides[2] == 1);
  CHECK(m->dl_tensor.dtype.code == dlpack::kDLFloat && m->dl_tensor.dtype.bits == 32);
  CHECK(m->dl_tensor.device.device_type == dlpack::kDLCPU);
  m->deleter(m);
  CHECK(buf.use_count() == 2);
  CHECK_THROWS(parse_dtype("int8"), std::invalid_argument, "'int8'");
  CHECK(parse_dtype("bfloat16") == DType::bfloat16 && dtype_size(DType::bfloat16) == 2);
}

// Two lanes whose tasks synchronize each other: the second wait is refused instead of hanging both.
static void test_synchronize_cycle_is_refused() {
  HostLane a("a"), b("b");
  std::atomic<bool> a_waiting{false};
  std::atomic<int> refused{0};
  a.submit([&] {
    b.submit([&] {
      while (!a_waiting) std::this_thread::sleep_for(1ms);
      std::this_thread::sleep_for(20ms);  // a's task is now blocked in b.synchronize()
      try {
        a.synchronize();
      } catch (const std::runtime_error& e) {
        if (std::strstr(e.what(), "would deadlock")) ++refused;
      }
    });
    a_waiting = true;
    b.synchronize();
  });
  a.synchronize();
  b.synchronize();
  CHECK(refused == 1);
  // Waits in one direction stay allowed.
  std::atomic<int> done{0};
  a.submit([&] {
    b.submit([&] { ++done; });
    b.synchronize();
    ++done;
  });
  a.synchronize();
  CHECK(done == 2);
  CHECK(b.synchronize_for(1.0));
}

int main() {
  test_fifo_order();
  test_synchronize_cycle_is_refused();
  test_record_completes_after_prior_work();
  test_cross_lane_wait();
  test_exception_capture();
  test_exception_from_record();
  test_lane_dropped_by_its_own_task();
  test_synchronize_from_own_task();
  test_events();
  test_copy_async();
  test_record_inside_task();
  test_wait_inside_task();
  test_copy_async_inside_task();
  test_cuda_lane();
  test_dlpack_export();
  auto info = build_info();
  std::printf("compiler=%s cuda=%d devices=%d (%s)\n", info.compiler.c_str(), info.cuda_compiled, info.cuda_devices,
              info.cuda_status.c_str());
  return check::finish("test_lanes");
}
