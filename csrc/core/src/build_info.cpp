#include "dpara_rt/build_info.h"

namespace dpara_rt {

int cuda_runtime_version_();  // cuda_backend.cu, or no_cuda.cpp in a build without CUDA

BuildInfo build_info() {
  BuildInfo info;
  info.compiler = DPARA_RT_CXX_COMPILER;
#ifdef DPARA_RT_WITH_CUDA
  info.cuda_compiled = true;
#endif
  info.cuda_runtime_version = cuda_runtime_version_();
  info.cuda_devices = cuda_device_count(&info.cuda_status);
  info.cuda_device_names = cuda_device_names();
  return info;
}

}  // namespace dpara_rt
