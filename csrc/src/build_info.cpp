#include "dpara_rt/build_info.h"

namespace dpara_rt {

#ifndef DPARA_RT_WITH_CUDA
int cuda_device_count(std::string* why) {
  if (why) *why = "built without CUDA";
  return 0;
}
int cuda_runtime_version_() { return 0; }
#else
int cuda_runtime_version_();
#endif

BuildInfo build_info() {
  BuildInfo info;
  info.compiler = DPARA_RT_CXX_COMPILER;
#ifdef DPARA_RT_WITH_CUDA
  info.cuda_compiled = true;
#endif
  info.cuda_runtime_version = cuda_runtime_version_();
  info.cuda_devices = cuda_device_count(&info.cuda_status);
  return info;
}

}  // namespace dpara_rt
