#include <cuda_runtime.h>
#include <string>

#include "dpara_rt/build_info.h"

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

}  // namespace dpara_rt
