// bf16_dot products (see dpara_rt/host/linear.h): x rounded to bfloat16 pairs once a call, then MR x 32 tiles of
// float32 sums, a step per pair of input features. AVX512-BF16's vdpbf16ps where the CPU has it, else two FMAs in
// its order (the odd feature's product first), which gives its bits: measured on the instruction, 3.2M sums
// without a difference.
#include "linear_dot.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#include <immintrin.h>
#define DPARA_RT_BF16_DOT_X86 1
#define DPARA_RT_DOT_EMULATED __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DPARA_RT_DOT_EMULATED
#endif
#define DPARA_RT_INLINE inline __attribute__((always_inline))
#pragma GCC diagnostic ignored "-Wpsabi"

namespace dpara_rt::detail {
namespace {

constexpr std::int64_t kPanel = 32;     // linear.h's kHostLinearPanel: columns per panel
constexpr std::int64_t kRowBlock = 64;  // rows per pass over the panels: their pairs stay in L2 while W streams
constexpr std::int64_t kPrefetchBytes = 4096;  // as host_linear.cpp's tiles: the next panel rows, ahead of need

// float -> bfloat16 bits: to nearest even; zero and subnormals to a signed zero (the instruction reads bfloat16
// subnormals as zero, so the emulation must never see one); NaN stays a NaN. Selects, not branches: a row's
// conversion vectorises.
DPARA_RT_INLINE std::uint16_t to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, nan = (u >> 16) | 0x40u,
                      zero = (u >> 16) & 0x8000u;
  const std::uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
  return std::uint16_t((u & 0x7f800000u) == 0 ? zero : r);
}

DPARA_RT_DOT_EMULATED void to_bf16_rows(const float* x, std::int64_t m, std::int64_t k, std::uint16_t* out) {
  const std::int64_t width = 2 * dot_pairs(k);
  for (std::int64_t r = 0; r < m; ++r) {
    for (std::int64_t i = 0; i < k; ++i) out[r * width + i] = to_bf16(x[r * k + i]);
    if (width > k) out[r * width + k] = 0;
  }
}

// x [m, k] as bfloat16 pairs [m, dot_pairs(k)]: feature 2j in the low half, 2j + 1 (0 past k) in the high half,
// as the instruction pairs them (a row of bfloat16 values read as dwords). Per-thread scratch, kept.
const std::uint32_t* pairs_of(const float* x, std::int64_t m, std::int64_t k) {
  thread_local std::vector<std::uint32_t> pairs;
  const std::int64_t k2 = dot_pairs(k);
  if (pairs.size() < std::size_t(m * k2)) pairs.resize(std::size_t(m * k2));
  to_bf16_rows(x, m, k, reinterpret_cast<std::uint16_t*>(pairs.data()));
  return pairs.data();
}

// Rows [0, MR) x panels [0, NP) (y at the first panel's column 0, `cols` columns written): the emulation. A panel
// row's 32 dwords are its columns' pairs; the low halves widened (<< 16) are feature 2j's weights, the high
// halves (masked) feature 2j + 1's.
struct Emulated {
  typedef float F __attribute__((vector_size(64)));
  typedef std::uint32_t U __attribute__((vector_size(64)));

  template <int MR, int NP>
  static DPARA_RT_INLINE void tile(const std::uint32_t* xp, std::int64_t k2, const std::uint16_t* panel,
                                   std::int64_t stride, float* y, std::int64_t ldy, std::int64_t cols) {
    F acc[MR][2 * NP];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < 2 * NP; ++v) acc[m][v] = F{};
    for (std::int64_t j = 0; j < k2; ++j) {
      F even[2 * NP], odd[2 * NP];
      for (int v = 0; v < 2 * NP; ++v) {
        const std::uint16_t* row = panel + (v / 2) * stride + j * 2 * kPanel + (v % 2) * kPanel;
        if (v % 2 == 0) __builtin_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes);
        U u;
        std::memcpy(&u, row, sizeof u);
        const U lo = u << 16, hi = u & 0xffff0000u;
        std::memcpy(&even[v], &lo, sizeof lo);
        std::memcpy(&odd[v], &hi, sizeof hi);
      }
      for (int m = 0; m < MR; ++m) {
        const std::uint32_t p = xp[m * k2 + j], lo_bits = p << 16, hi_bits = p & 0xffff0000u;
        float x_even, x_odd;
        std::memcpy(&x_even, &lo_bits, sizeof x_even);
        std::memcpy(&x_odd, &hi_bits, sizeof x_odd);
        for (int v = 0; v < 2 * NP; ++v) {
          acc[m][v] += x_odd * odd[v];  // one FMA each (-ffp-contract=fast), in the instruction's order
          acc[m][v] += x_even * even[v];
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      float out[2 * NP * 16];
      std::memcpy(out, acc[m], sizeof out);
      std::memcpy(y + m * ldy, out, sizeof(float) * std::size_t(cols));
    }
  }
};

#ifdef DPARA_RT_BF16_DOT_X86
// The same tile on the instruction. Not inlined (the drivers below are built for any CPU); a call costs a few ns
// against the hundreds of a tile.
struct Native {
  template <int MR, int NP>
  __attribute__((target("avx512f,avx512bf16"), noinline)) static void tile(
      const std::uint32_t* xp, std::int64_t k2, const std::uint16_t* panel, std::int64_t stride, float* y,
      std::int64_t ldy, std::int64_t cols) {
    __m512 acc[MR][2 * NP];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < 2 * NP; ++v) acc[m][v] = _mm512_setzero_ps();
    for (std::int64_t j = 0; j < k2; ++j) {
      __m512bh w[2 * NP];
      for (int v = 0; v < 2 * NP; ++v) {
        const std::uint16_t* row = panel + (v / 2) * stride + j * 2 * kPanel + (v % 2) * kPanel;
        if (v % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
        w[v] = (__m512bh)_mm512_loadu_si512(row);
      }
      for (int m = 0; m < MR; ++m) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(xp[m * k2 + j]));
        for (int v = 0; v < 2 * NP; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xv, w[v]);
      }
    }
    for (int m = 0; m < MR; ++m) {
      float out[2 * NP * 16];
      for (int v = 0; v < 2 * NP; ++v) _mm512_storeu_ps(out + 16 * v, acc[m][v]);
      std::memcpy(y + m * ldy, out, sizeof(float) * std::size_t(cols));
    }
  }
};
#endif

// The last MR (< 8) rows of a row block from panel p: NP panels at once where NP remain (eight or more sums in
// flight cover the instruction's latency: one row over one panel has two), else one at a time.
template <class Tile, int MR, int NP>
DPARA_RT_INLINE void rest_rows(const std::uint32_t* xp, std::int64_t k2, const std::uint16_t* packed,
                               std::int64_t stride, std::int64_t n, std::int64_t p, std::int64_t p1, float* y,
                               std::int64_t ldy) {
  if (p + NP <= p1) {
    const std::int64_t c0 = p * kPanel;
    return Tile::template tile<MR, NP>(xp, k2, packed + p * stride, stride, y + c0, ldy,
                                       std::min(NP * kPanel, n - c0));
  }
  for (; p < p1; ++p)
    Tile::template tile<MR, 1>(xp, k2, packed + p * stride, stride, y + p * kPanel, ldy,
                               std::min(kPanel, n - p * kPanel));
}

// Panels [p0, p1) for all m rows: 8-row tiles, then the rows left over while the panel is in L1. Every output
// element gets the same chain whatever tile computes it.
template <class Tile>
DPARA_RT_INLINE void drive(const std::uint32_t* xp, std::int64_t m, std::int64_t k2, const std::uint16_t* packed,
                           std::int64_t n, std::int64_t p0, std::int64_t p1, float* y, std::int64_t ldy) {
  const std::int64_t stride = k2 * 2 * kPanel;  // bfloat16 values from one panel to the next
  for (std::int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
    const std::int64_t r1 = std::min(m, r0 + kRowBlock), r8 = r0 + (r1 - r0) / 8 * 8, left = r1 - r8;
    const std::uint32_t* xr = xp + r8 * k2;
    float* yr = y + r8 * ldy;
    for (std::int64_t p = p0; p < p1; ++p) {
      const std::int64_t c0 = p * kPanel, cols = std::min(kPanel, n - c0);
      for (std::int64_t r = r0; r < r8; r += 8)
        Tile::template tile<8, 1>(xp + r * k2, k2, packed + p * stride, stride, y + r * ldy + c0, ldy, cols);
      const std::int64_t step = left == 1 ? 4 : left <= 3 ? 2 : 1;
      if ((p - p0) % step != 0) continue;
      switch (left) {
        case 1: rest_rows<Tile, 1, 4>(xr, k2, packed, stride, n, p, p1, yr, ldy); break;
        case 2: rest_rows<Tile, 2, 2>(xr, k2, packed, stride, n, p, p1, yr, ldy); break;
        case 3: rest_rows<Tile, 3, 2>(xr, k2, packed, stride, n, p, p1, yr, ldy); break;
        case 4: rest_rows<Tile, 4, 1>(xr, k2, packed, stride, n, p, p1, yr, ldy); break;
        case 5: rest_rows<Tile, 5, 1>(xr, k2, packed, stride, n, p, p1, yr, ldy); break;
        case 6: rest_rows<Tile, 6, 1>(xr, k2, packed, stride, n, p, p1, yr, ldy); break;
        case 7: rest_rows<Tile, 7, 1>(xr, k2, packed, stride, n, p, p1, yr, ldy); break;
        default: break;
      }
    }
  }
}

DPARA_RT_DOT_EMULATED void linear_emulated(const std::uint32_t* xp, std::int64_t m, std::int64_t k2,
                                           const std::uint16_t* packed, std::int64_t n, std::int64_t p0,
                                           std::int64_t p1, float* y, std::int64_t ldy) {
  drive<Emulated>(xp, m, k2, packed, n, p0, p1, y, ldy);
}

}  // namespace

bool bf16_dot_native() {
  static const bool native = [] {
    const char* force = std::getenv("DPARA_RT_HOST_LINEAR_TILES");
    if (force != nullptr && std::strcmp(force, "narrow") == 0) return false;
#ifdef DPARA_RT_BF16_DOT_X86
    return static_cast<bool>(__builtin_cpu_supports("avx512bf16"));
#else
    return false;
#endif
  }();
  return native;
}

void pack_bf16_dot(const float* w, std::int64_t n, std::int64_t k, std::uint16_t* packed) {
  const std::int64_t k2 = dot_pairs(k), panels = (n + kPanel - 1) / kPanel;
  std::fill(packed, packed + panels * k2 * 2 * kPanel, std::uint16_t(0));
  for (std::int64_t c = 0; c < n; ++c)
    for (std::int64_t kk = 0; kk < k; ++kk)
      packed[(((c / kPanel) * k2 + kk / 2) * kPanel + c % kPanel) * 2 + kk % 2] = to_bf16(w[c * k + kk]);
}

void linear_bf16_dot(const float* x, std::int64_t m, std::int64_t k, const std::uint16_t* packed, std::int64_t n,
                     std::int64_t p0, std::int64_t p1, float* y, std::int64_t ldy) {
  if (m == 0 || p0 >= p1) return;
  const std::uint32_t* xp = pairs_of(x, m, k);
#ifdef DPARA_RT_BF16_DOT_X86
  if (bf16_dot_native()) return drive<Native>(xp, m, dot_pairs(k), packed, n, p0, p1, y, ldy);
#endif
  linear_emulated(xp, m, dot_pairs(k), packed, n, p0, p1, y, ldy);
}

}  // namespace dpara_rt::detail
