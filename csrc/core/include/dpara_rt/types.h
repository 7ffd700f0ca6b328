#pragma once
// Small vocabulary types shared by every part of the core: the draft limit, element types, the host clock.
#include <cstddef>
#include <cstdint>
#include <string>

namespace dpara_rt {

// Largest draft length d anywhere in the runtime: the tree layout, the boundary ring, staging, metrics and
// (through _core.MAX_DRAFT) the Python layer and its kernels all take it from here.
constexpr int kMaxDraft = 32;

enum class DType : std::uint8_t { float32, bfloat16, float16, int32, int64, uint8 };

// "float32" | "bfloat16" | "float16" | "int32" | "int64" | "uint8"; anything else -> std::invalid_argument
// naming the value and the accepted names.
DType parse_dtype(const std::string& name);
const char* dtype_name(DType t);
std::size_t dtype_size(DType t);

// Monotonic host clock in nanoseconds. Host events, lanes and the metrics timeline all use it, so their
// timestamps can be compared and subtracted directly.
std::int64_t now_ns();

}  // namespace dpara_rt
