#pragma once
// A tiny assertion kit for the C++ unit tests: CHECK / CHECK_THROWS record failures and keep going;
// main() returns the failure count through finish().
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "dpara_rt/build_info.h"

namespace check {

// CUDA devices usable now, through the core's build-info API (an error of cudaGetDeviceCount counts as 0).
// Device-dependent checks branch on it, so the suite tells the truth with and without a GPU.
inline int cuda_devices() { return dpara_rt::cuda_device_count(); }

inline int& failures() {
  static int n = 0;
  return n;
}

inline void fail(const char* file, int line, const std::string& what) {
  ++failures();
  std::fprintf(stderr, "%s:%d: FAILED %s\n", file, line, what.c_str());
}

inline int finish(const char* name) {
  if (failures()) std::fprintf(stderr, "%s: %d check(s) failed\n", name, failures());
  else std::printf("%s: all checks passed\n", name);
  return failures() ? 1 : 0;
}

}  // namespace check

#define CHECK(cond)                                      \
  do {                                                   \
    if (!(cond)) check::fail(__FILE__, __LINE__, #cond); \
  } while (0)

// expr must throw `type` whose what() contains `needle`.
#define CHECK_THROWS(expr, type, needle)                                                                  \
  do {                                                                                                    \
    bool thrown_ = false;                                                                                 \
    try {                                                                                                 \
      (void)(expr);                                                                                       \
    } catch (const type& e_) {                                                                            \
      thrown_ = true;                                                                                     \
      if (!std::strstr(e_.what(), needle))                                                                \
        check::fail(__FILE__, __LINE__, std::string(#expr " message lacks '") + needle + "': " + e_.what()); \
    } catch (const std::exception& e_) {                                                                  \
      thrown_ = true;                                                                                     \
      check::fail(__FILE__, __LINE__, std::string(#expr " threw the wrong type: ") + e_.what());         \
    }                                                                                                     \
    if (!thrown_) check::fail(__FILE__, __LINE__, #expr " did not throw " #type);                         \
  } while (0)
