#pragma once
// The host Markov head's scalar building blocks: branch-free log / exp, Philox4x32-10 and the Gumbel transform,
// boundary rows to float32. A private header of markov_head.cpp and qwen3.cpp (softmax and SiLU use its exp),
// hence the unnamed namespace.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dpara_rt/types.h"

// The hot functions are compiled twice (GCC function multiversioning) and picked at load time from the
// CPU: AVX2 + FMA (x86-64-v3) where available, the baseline elsewhere, so the build stays portable (no
// -march=native). Helpers they call are always_inline, so each clone gets its own vectorised copy.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define DPARA_RT_HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define DPARA_RT_HOT
#endif
#define DPARA_RT_INLINE inline __attribute__((always_inline))

namespace dpara_rt {
namespace {

// ----------------------------------------------------------------------------- vectorisable math

DPARA_RT_INLINE float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
DPARA_RT_INLINE std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// 8-float GCC vectors: ymm registers in the AVX2 clone, pairs of xmm in the baseline one. Every function
// taking or returning them is inlined, so the vector ABI difference GCC warns about never applies.
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float F8 __attribute__((vector_size(32)));
typedef std::int32_t I8 __attribute__((vector_size(32)));

DPARA_RT_INLINE F8 load8(const float* p) {
  F8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
DPARA_RT_INLINE void store8(float* p, F8 v) { std::memcpy(p, &v, sizeof v); }

// log and exp as branch-free float code (Cephes' logf / expf polynomials, about 1 ulp), so their loops
// vectorise: std::log / std::exp stay scalar calls without -ffast-math, and were most of the time of a
// sampled draft. They differ from torch's (SLEEF) results in the last bit at most, like Triton's do.

// log(x) for positive normal x: the Gumbel transform's inputs u in (0, 1) and -log(u) in (0, 17).
DPARA_RT_INLINE float log_positive(float x) {
  const std::uint32_t bits = float_bits(x);
  std::int32_t e = std::int32_t(bits >> 23) - 126;
  float m = bits_float((bits & 0x007fffffu) | 0x3f000000u);  // x = m * 2^e, m in [0.5, 1)
  const bool low = m < 0.707106781186547524f;
  e -= low;
  m = (low ? m + m : m) - 1.0f;  // log(x) = log1p(m) + e log(2), m in [-0.29, 0.41)
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  const float fe = float(e);
  y = y * m * z - 2.12194440e-4f * fe - 0.5f * z;  // log(2) split in two parts (Cody-Waite)
  return (m + y) + 0.693359375f * fe;
}

DPARA_RT_INLINE std::int32_t to_int(float x) { return std::int32_t(x); }
DPARA_RT_INLINE I8 to_int(F8 x) { return __builtin_convertvector(x, I8); }
DPARA_RT_INLINE float from_bits(std::int32_t b) { return bits_float(std::uint32_t(b)); }
DPARA_RT_INLINE F8 from_bits(I8 b) {
  F8 v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

// exp(x) for x <= 0 (softmax's z - max): 0 below -87 (exp < 2^-125), NaN stays NaN. One body for a float and for
// eight lanes (F8), so each lane gets the scalar's bits: GCC does not vectorise loops over the scalar (its int
// conversion and the select around it keep them scalar), so hot loops call the F8 form.
template <class T>
DPARA_RT_INLINE T exp_nonpositive_lanes(T x) {
  const T lo = T{} - 87.0f;
  const auto in_range = x >= lo;  // false for -inf and NaN too
  const T xc = in_range ? x : lo;  // keeps the int conversion below defined
  const T fn = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / log 2): 1.5 * 2^23 trick
  const T r = (xc - fn * 0.693359375f) + fn * 2.12194440e-4f;             // x - n log(2), |r| <= log(2) / 2
  T y = T{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const T two_n = from_bits((to_int(fn) + 127) << 23);  // n >= -126: a normal float
  return in_range ? y * two_n : (x < lo ? T{} : x);
}
DPARA_RT_INLINE float exp_nonpositive(float x) { return exp_nonpositive_lanes(x); }
DPARA_RT_INLINE F8 exp_nonpositive8(F8 x) { return exp_nonpositive_lanes(x); }

// ------------------------------------------------------------------------------------------ Philox

struct PhiloxKey {
  std::uint32_t off_lo, off_hi, k0, k1;
  PhiloxKey(std::uint64_t offset, std::uint64_t seed)
      : off_lo(std::uint32_t(offset)), off_hi(std::uint32_t(offset >> 32)), k0(std::uint32_t(seed)),
        k1(std::uint32_t(seed >> 32)) {}
};

// Philox4x32-10 (Salmon et al., SC'11) at counter (c0, offset_lo, offset_hi, 0); first output word only.
// Straight-line 32x32->64 products, so a loop over counters vectorises.
DPARA_RT_INLINE std::uint32_t philox_word(std::uint32_t c0, const PhiloxKey& key) {
  std::uint32_t c1 = key.off_lo, c2 = key.off_hi, c3 = 0, k0 = key.k0, k1 = key.k1;
#pragma GCC unroll 10  // straight-line code, or the counter loop around it does not vectorise
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = std::uint64_t(c0) * 0xD2511F53u, p1 = std::uint64_t(c2) * 0xCD9E8D57u;
    const std::uint32_t n0 = std::uint32_t(p1 >> 32) ^ c1 ^ k0, n2 = std::uint32_t(p0 >> 32) ^ c3 ^ k1;
    c1 = std::uint32_t(p1);
    c3 = std::uint32_t(p0);
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

// Standard Gumbel noise for counters base .. base+n-1 (wrapping mod 2^32, as the kernels do). maybe_unused: not
// every source that includes this header draws noise (nor loads rows, below).
[[maybe_unused]] DPARA_RT_HOT void gumbel_row(float* g, std::uint32_t base, std::int64_t n, PhiloxKey key) {
  for (std::int64_t v = 0; v < n; ++v) {
    const std::uint32_t bits = philox_word(base + std::uint32_t(v), key);
    // odd multiples of 2^-24 in (0, 1): exact in float32, never 0 or 1, so both logs are finite
    const float u = float(std::int32_t((bits >> 9) * 2 + 1)) * 0x1p-24f;
    g[v] = -log_positive(-log_positive(u));
  }
}

// ------------------------------------------------------------------------------ boundary row loading

// IEEE half -> float, exact for every value (subnormals through an exact int conversion, so a DAZ mode
// set by someone else cannot flush them).
DPARA_RT_INLINE float half_float(std::uint16_t h) {
  const std::uint32_t em = h & 0x7fffu;
  const std::uint32_t bits = em < 0x0400u ? float_bits(float(std::int32_t(em)) * 0x1p-24f)  // zero, subnormals
                             : em < 0x7c00u ? (em << 13) + (112u << 23)  // normals: rebias exponent 15 -> 127
                                            : (em << 13) | 0x7f800000u;  // inf, nan
  return bits_float(bits | std::uint32_t(h & 0x8000u) << 16);
}

[[maybe_unused]] DPARA_RT_HOT void load_row(float* out, const void* src, DType dtype, std::int64_t n) {
  if (dtype == DType::float32) {
    std::memcpy(out, src, std::size_t(n) * sizeof(float));
    return;
  }
  const auto* s = static_cast<const std::uint16_t*>(src);
  if (dtype == DType::bfloat16) {
    for (std::int64_t v = 0; v < n; ++v) out[v] = bits_float(std::uint32_t(s[v]) << 16);
  } else {
    for (std::int64_t v = 0; v < n; ++v) out[v] = half_float(s[v]);
  }
}

}  // namespace
}  // namespace dpara_rt
