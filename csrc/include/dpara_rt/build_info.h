#pragma once
#include <string>

namespace dpara_rt {

struct BuildInfo {
  std::string compiler;
  bool cuda_compiled = false;
  int cuda_runtime_version = 0;  // 0 when not compiled with CUDA
  int cuda_devices = 0;          // devices usable now; 0 when none or no driver
  std::string cuda_status;       // why cuda_devices is 0, if it is
};

BuildInfo build_info();

// Number of CUDA devices usable now. No driver / no device counts as 0, not as an error.
int cuda_device_count(std::string* why = nullptr);

}  // namespace dpara_rt
