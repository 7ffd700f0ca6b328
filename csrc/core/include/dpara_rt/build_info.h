#pragma once
#include <string>
#include <vector>

namespace dpara_rt {

struct BuildInfo {
  std::string compiler;
  bool cuda_compiled = false;
  int cuda_runtime_version = 0;  // 0 when not compiled with CUDA
  int cuda_devices = 0;          // devices usable now; 0 when none or no driver
  std::string cuda_status;       // why cuda_devices is 0, if it is
  std::vector<std::string> cuda_device_names;  // one per usable device
};

BuildInfo build_info();

// Number of CUDA devices usable now. No driver / no device counts as 0, not as an error.
int cuda_device_count(std::string* why = nullptr);
// "name (sm_XY, N GiB)" of each usable device; empty when none.
std::vector<std::string> cuda_device_names();

}  // namespace dpara_rt
