// Lanes, events and the DLPack export, without Python.
#include <atomic>
#include <chrono>
#include <stdexcept>
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

static void test_cuda_lane_without_device() {
  // This machine has no CUDA device (or the build has no CUDA): the error names the device index.
  if (cuda_device_count() > 0) return;
  CHECK_THROWS(CudaLane(0), std::runtime_error, "CUDA device 0");
  CHECK_THROWS(CudaLane(3), std::runtime_error, "CUDA device 3");
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

int main() {
  test_fifo_order();
  test_record_completes_after_prior_work();
  test_cross_lane_wait();
  test_exception_capture();
  test_exception_from_record();
  test_lane_dropped_by_its_own_task();
  test_synchronize_from_own_task();
  test_events();
  test_copy_async();
  test_cuda_lane_without_device();
  test_dlpack_export();
  auto info = build_info();
  std::printf("compiler=%s cuda=%d devices=%d (%s)\n", info.compiler.c_str(), info.cuda_compiled, info.cuda_devices,
              info.cuda_status.c_str());
  return check::finish("test_lanes");
}
