// The CUDA backend: device queries, device / pinned memory, CUDA events and the CudaLane. Compiled only
// when CMake finds a CUDA toolkit; used only when a device is present.
#include <cuda_runtime.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_internal.h"
#include "dpara_rt/build_info.h"
#include "dpara_rt/event.h"
#include "dpara_rt/lane.h"
#include "util.h"

namespace dpara_rt {

int cuda_runtime_version_() {
  int v = 0;
  cudaRuntimeGetVersion(&v);
  return v;
}

int cuda_device_count(std::string* why) {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    // No driver (35) or no device (100) means "no CUDA device", not a failure.
    if (why) *why = std::string("no CUDA device: ") + cudaGetErrorString(err) + " (" + std::to_string(int(err)) + ")";
    cudaGetLastError();
    return 0;
  }
  if (why) *why = n ? "ok" : "no CUDA device";
  return n;
}

std::vector<std::string> cuda_device_names() {
  std::vector<std::string> names;
  const int n = cuda_device_count();
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    names.push_back(std::string(p.name) + " (sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
                    std::to_string(p.totalGlobalMem >> 30) + " GiB)");
  }
  return names;
}

namespace {

void check(cudaError_t st, const char* what, int device) {
  if (st == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so later calls are not blamed for it
  detail::runtime_error(what, " failed on CUDA device ", device, ": ", cudaGetErrorString(st), " (", int(st), ")");
}

// Makes `device` current for a scope and restores the caller's device after. Destructors pass
// throwing = false: a failure there (e.g. the driver shutting down at exit) must not terminate.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device, bool throwing = true) {
    cudaGetDevice(&prev_);
    if (prev_ == device) return;
    const cudaError_t st = cudaSetDevice(device);
    if (throwing) check(st, "cudaSetDevice", device);
    else cudaGetLastError();
  }
  ~DeviceGuard() { cudaSetDevice(prev_); }

 private:
  int prev_ = 0;
};

// Released cudaEvent_t handles per device, handed out again: a round records several events, and creating one
// costs the host more than recording it. A wait queued on an event keeps the record it saw, so a handle whose
// last record is still pending is safe to record again. (They keep timing: Event::elapsed_ms reads two of them.)
class EventPool {
 public:
  static cudaEvent_t take(int device) {
    {
      std::lock_guard<std::mutex> lk(mu());
      auto& free = handles()[device];
      if (!free.empty()) {
        cudaEvent_t ev = free.back();
        free.pop_back();
        return ev;
      }
    }
    DeviceGuard g(device);
    cudaEvent_t ev{};
    check(cudaEventCreate(&ev), "cudaEventCreate", device);
    return ev;
  }
  static void give(int device, cudaEvent_t ev) {
    {
      std::lock_guard<std::mutex> lk(mu());
      auto& free = handles()[device];
      if (free.size() < kKept) {
        free.push_back(ev);
        return;
      }
    }
    DeviceGuard g(device, false);
    cudaEventDestroy(ev);
  }

 private:
  static constexpr std::size_t kKept = 64;  // per device: a few rounds' worth
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  // never destroyed: events outlive static destruction order at exit, and the driver frees them with the process
  static std::map<int, std::vector<cudaEvent_t>>& handles() {
    static auto* h = new std::map<int, std::vector<cudaEvent_t>>();
    return *h;
  }
};

// A cudaEvent_t plus a host-side "recorded" flag: a lane may record it later, from its worker, and an
// unrecorded cudaEvent_t would otherwise query as complete.
class CudaEventImpl final : public EventImpl {
 public:
  explicit CudaEventImpl(int device) : device_(device), ev_(EventPool::take(device)) {}
  ~CudaEventImpl() override { EventPool::give(device_, ev_); }
  void record(cudaStream_t s) {
    cudaError_t st;
    {
      DeviceGuard g(device_);
      st = cudaEventRecord(ev_, s);
    }
    set_recorded(st == cudaSuccess ? "" : cudaGetErrorString(st));
    check(st, "cudaEventRecord", device_);
  }
  void fail(const std::string& why) { set_recorded(why.empty() ? "record failed" : why); }
  bool recorded() {
    std::lock_guard<std::mutex> lk(mu_);
    return recorded_;
  }
  void wait_recorded() {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return recorded_; });
    if (!error_.empty()) detail::runtime_error("CUDA event on device ", device_, " was never recorded: ", error_);
  }
  bool query() override {
    if (!recorded()) return false;
    DeviceGuard g(device_);
    const cudaError_t st = cudaEventQuery(ev_);
    if (st == cudaErrorNotReady) return false;
    check(st, "cudaEventQuery", device_);
    return true;
  }
  void synchronize() override {
    wait_recorded();
    DeviceGuard g(device_);
    check(cudaEventSynchronize(ev_), "cudaEventSynchronize", device_);
  }
  int device() const override { return device_; }
  std::int64_t timestamp_ns() override {
    detail::runtime_error("CUDA events have no host timestamp (device ", device_, ")");
  }
  cudaEvent_t handle() const { return ev_; }

 private:
  void set_recorded(std::string error) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      recorded_ = true;
      error_ = std::move(error);
    }
    cv_.notify_all();
  }
  int device_;
  cudaEvent_t ev_{};
  std::mutex mu_;
  std::condition_variable cv_;
  bool recorded_ = false;
  std::string error_;
};

}  // namespace

namespace detail {

void require_cuda_device(int device, const char* what) {
  int n = 0;
  const cudaError_t st = cudaGetDeviceCount(&n);
  if (st != cudaSuccess) {
    cudaGetLastError();
    runtime_error(what, " needs CUDA device ", device, ", but no CUDA device is usable: cudaGetDeviceCount returned ",
                  int(st), " (", cudaGetErrorString(st), ")");
  }
  if (device < 0 || device >= n)
    runtime_error(what, " needs CUDA device ", device, ", but this machine has ", n, " CUDA device(s) (0..", n - 1, ")");
}

void* cuda_malloc(std::size_t bytes, int device) {
  DeviceGuard g(device);
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc", device);
  return p;
}

void cuda_free(void* p, int device) {
  DeviceGuard g(device, false);
  cudaFree(p);
}

void* cuda_host_alloc(std::size_t bytes) {
  void* p = nullptr;
  // Portable: pinned for every device's context, so one staging buffer serves transfers between devices.
  check(cudaHostAlloc(&p, bytes, cudaHostAllocPortable), "cudaHostAlloc", -1);
  return p;
}

void cuda_host_free(void* p) { cudaFreeHost(p); }

void cuda_memset_zero(void* p, std::size_t bytes, int device) {
  DeviceGuard g(device);
  check(cudaMemset(p, 0, bytes), "cudaMemset", device);
  // cudaMemset runs on the legacy default stream, which non-blocking lane streams do not wait for.
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize", device);
}

}  // namespace detail

double cuda_elapsed_ms(EventImpl& start, EventImpl& end) {
  auto* s = dynamic_cast<CudaEventImpl*>(&start);
  auto* e = dynamic_cast<CudaEventImpl*>(&end);
  if (!s || !e) detail::value_error("elapsed_ms needs two CUDA events");
  s->synchronize();
  e->synchronize();
  float ms = 0.f;
  check(cudaEventElapsedTime(&ms, s->handle(), e->handle()), "cudaEventElapsedTime", s->device());
  return double(ms);
}

struct CudaLane::Impl {
  int device = 0;
  cudaStream_t stream = nullptr;
  bool owns = false;
  std::unique_ptr<HostLane> worker;  // host side: submitted callables, and lane-ordered stream operations
};

CudaLane::CudaLane(int device, std::uintptr_t stream, std::string name)
    : Lane(std::move(name)), impl_(std::make_unique<Impl>()) {
  detail::require_cuda_device(device, "a CUDA lane");
  impl_->device = device;
  if (stream) {
    impl_->stream = reinterpret_cast<cudaStream_t>(stream);
  } else {
    DeviceGuard g(device);
    check(cudaStreamCreateWithFlags(&impl_->stream, cudaStreamNonBlocking), "cudaStreamCreate", device);
    impl_->owns = true;
  }
  impl_->worker = std::make_unique<HostLane>(this->name() + ".host");
}

CudaLane::~CudaLane() {
  impl_->worker.reset();  // runs what is still queued
  DeviceGuard g(impl_->device, false);
  cudaStreamSynchronize(impl_->stream);
  if (impl_->owns) cudaStreamDestroy(impl_->stream);
}

void CudaLane::submit(Task fn) {
  const int dev = impl_->device;
  impl_->worker->submit([dev, fn = std::move(fn)] {
    check(cudaSetDevice(dev), "cudaSetDevice", dev);  // callables launch on the lane's device
    fn();
  });
}

Event CudaLane::record() {
  // From the lane's own task run_in_order records at once; the task's captured errors stay for the caller.
  if (!impl_->worker->on_worker()) impl_->worker->rethrow_captured();
  auto ev = std::make_shared<CudaEventImpl>(impl_->device);
  cudaStream_t s = impl_->stream;
  impl_->worker->run_in_order([ev, s] {
    try {
      ev->record(s);
    } catch (const std::exception& e) {
      ev->fail(e.what());
      throw;
    }
  });
  return Event(ev);
}

void CudaLane::wait(const Event& e) {
  if (e.query()) return;
  cudaStream_t s = impl_->stream;
  const int dev = impl_->device;
  if (e.is_host()) {
    // Make the stream itself wait: a host function on the stream blocks until the host event completes.
    // (It holds CUDA's callback thread meanwhile, so host events waited on here should complete soon.)
    impl_->worker->run_in_order([s, dev, e] {
      auto* held = new Event(e);
      cudaHostFn_t fn = [](void* p) {
        auto* ev = static_cast<Event*>(p);
        ev->synchronize();
        delete ev;
      };
      DeviceGuard g(dev);
      const cudaError_t st = cudaLaunchHostFunc(s, fn, held);
      if (st != cudaSuccess) delete held;
      check(st, "cudaLaunchHostFunc", dev);
    });
    return;
  }
  auto ce = std::dynamic_pointer_cast<CudaEventImpl>(e.impl());
  Task task = [ce, s, dev] {
    ce->wait_recorded();
    DeviceGuard g(dev);
    check(cudaStreamWaitEvent(s, ce->handle(), 0), "cudaStreamWaitEvent", dev);
  };
  // Not recorded yet: only the worker may block on that, never the caller.
  if (ce->recorded()) impl_->worker->run_in_order(std::move(task));
  else impl_->worker->submit(std::move(task));
}

void CudaLane::synchronize() {
  impl_->worker->synchronize();
  DeviceGuard g(impl_->device);
  check(cudaStreamSynchronize(impl_->stream), "cudaStreamSynchronize", impl_->device);
}

void CudaLane::copy_async(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  cudaStream_t s = impl_->stream;
  const int dev = impl_->device;
  impl_->worker->run_in_order([=] {
    DeviceGuard g(dev);
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s), "cudaMemcpyAsync", dev);
  });
}

int CudaLane::device() const { return impl_->device; }
std::uintptr_t CudaLane::stream() const { return reinterpret_cast<std::uintptr_t>(impl_->stream); }
bool CudaLane::owns_stream() const { return impl_->owns; }

}  // namespace dpara_rt
