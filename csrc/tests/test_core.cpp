#include <cstdio>
#include "dpara_rt/build_info.h"
int main() {
  auto info = dpara_rt::build_info();
  std::printf("compiler=%s cuda=%d devices=%d\n", info.compiler.c_str(), info.cuda_compiled, info.cuda_devices);
  return info.compiler.empty() ? 1 : 0;
}
