// The CUDA entry points of a build without the CUDA backend: every one is a clear error, except the
// device count, which is simply 0.
#include <memory>

#include "cuda_internal.h"
#include "dpara_rt/build_info.h"
#include "dpara_rt/event.h"
#include "dpara_rt/lane.h"
#include "util.h"

namespace dpara_rt {

namespace {
[[noreturn]] void no_backend(const char* what, int device) {
  detail::runtime_error(what, " needs CUDA device ", device,
                        ", but this build of dpara_rt has no CUDA backend (DPARA_RT_CUDA=OFF or no CUDA toolkit found)");
}
}  // namespace

int cuda_runtime_version_() { return 0; }

int cuda_device_count(std::string* why) {
  if (why) *why = "built without CUDA";
  return 0;
}

std::vector<std::string> cuda_device_names() { return {}; }

namespace detail {
void require_cuda_device(int device, const char* what) { no_backend(what, device); }
void* cuda_malloc(std::size_t, int device) { no_backend("cudaMalloc", device); }
void cuda_free(void*, int) {}
void* cuda_host_alloc(std::size_t) { no_backend("cudaHostAlloc", -1); }
void cuda_host_free(void*) {}
void cuda_memset_zero(void*, std::size_t, int device) { no_backend("cudaMemset", device); }
}  // namespace detail

double cuda_elapsed_ms(EventImpl& start, EventImpl&) { no_backend("elapsed_ms of CUDA events", start.device()); }

// A CudaLane cannot be constructed without the backend, so its other members are never reached.
struct CudaLane::Impl {};
CudaLane::CudaLane(int device, std::uintptr_t, std::string name) : Lane(std::move(name)) {
  no_backend("a CUDA lane", device);
}
CudaLane::~CudaLane() = default;
void CudaLane::submit(Task) { no_backend("CudaLane.submit", -1); }
Event CudaLane::record() { no_backend("CudaLane.record", -1); }
void CudaLane::wait(const Event&) { no_backend("CudaLane.wait", -1); }
void CudaLane::synchronize() { no_backend("CudaLane.synchronize", -1); }
void CudaLane::copy_async(void*, const void*, std::size_t) { no_backend("CudaLane.copy_async", -1); }
int CudaLane::device() const { return -1; }
std::uintptr_t CudaLane::stream() const { return 0; }
bool CudaLane::owns_stream() const { return false; }

}  // namespace dpara_rt
