#include "dpara_rt/types.h"

#include <chrono>

#include "util.h"

namespace dpara_rt {

DType parse_dtype(const std::string& name) {
  if (name == "float32") return DType::float32;
  if (name == "bfloat16") return DType::bfloat16;
  if (name == "float16") return DType::float16;
  if (name == "int32") return DType::int32;
  if (name == "int64") return DType::int64;
  if (name == "uint8") return DType::uint8;
  detail::value_error("unknown dtype '", name, "': expected float32, bfloat16, float16, int32, int64 or uint8");
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::float32: return "float32";
    case DType::bfloat16: return "bfloat16";
    case DType::float16: return "float16";
    case DType::int32: return "int32";
    case DType::int64: return "int64";
    case DType::uint8: return "uint8";
  }
  return "?";
}

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::float32: case DType::int32: return 4;
    case DType::bfloat16: case DType::float16: return 2;
    case DType::int64: return 8;
    case DType::uint8: return 1;
  }
  return 0;
}

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace dpara_rt
