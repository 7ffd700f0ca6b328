#pragma once
// Private helpers for the core's sources: message formatting and argument checks.
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "dpara_rt/types.h"

namespace dpara_rt::detail {

template <class... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

// std::invalid_argument becomes ValueError in Python, std::runtime_error becomes RuntimeError.
template <class... Args>
[[noreturn]] void value_error(Args&&... args) {
  throw std::invalid_argument(cat(std::forward<Args>(args)...));
}
template <class... Args>
[[noreturn]] void runtime_error(Args&&... args) {
  throw std::runtime_error(cat(std::forward<Args>(args)...));
}

// std::invalid_argument unless 1 <= d <= kMaxDraft; `what` names the object being built.
inline void check_draft_length(int d, const char* what) {
  if (d < 1 || d > kMaxDraft) value_error(what, " draft length d must be in 1..", kMaxDraft, ", got ", d);
}

// a * b for extents a caller gave; std::invalid_argument "<where><what> = a * b overflows int64" when it does not
// fit, so every offset formed from them later is defined.
inline std::int64_t checked_mul(const char* where, std::int64_t a, std::int64_t b, const char* what) {
  std::int64_t out;
  if (__builtin_mul_overflow(a, b, &out)) value_error(where, what, " = ", a, " * ", b, " overflows int64");
  return out;
}

inline std::size_t align_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

}  // namespace dpara_rt::detail
