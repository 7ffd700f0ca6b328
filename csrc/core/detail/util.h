#pragma once
// Private helpers for the sources of dpara_rt_core and dpara_rt_host (never installed): message formatting and
// argument checks.
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "dpara_rt/types.h"

namespace dpara_rt::detail {

// Appends one piece of a message. No iostreams: on a GPU machine, formatting an integer through an ostream after
// torch's CUDA init crashed the process (SIGSEGV in basic_ostream::_M_insert<long>, the num_put facet), so numbers
// go through to_string and snprintf, which need no locale facets. Floats print as an ostream would (%g).
inline void append(std::string& out, std::string_view s) { out.append(s); }
inline void append(std::string& out, const char* s) { out.append(s ? s : "(null)"); }
inline void append(std::string& out, char c) { out.push_back(c); }
template <class T>
void append(std::string& out, const T& v) {
  if constexpr (std::is_same_v<T, bool>) {
    out.push_back(v ? '1' : '0');
  } else if constexpr (std::is_integral_v<T>) {
    out.append(std::to_string(v));
  } else if constexpr (std::is_floating_point_v<T>) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", static_cast<double>(v));
    out.append(buf);
  } else if constexpr (std::is_pointer_v<T>) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%p", static_cast<const void*>(v));
    out.append(buf);
  } else {
    append(out, std::string_view(v));  // std::string and other string-like values
  }
}

template <class... Args>
std::string cat(Args&&... args) {
  std::string out;
  (append(out, args), ...);
  return out;
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
