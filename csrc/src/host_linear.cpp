// The host linear layer (see dpara_rt/host_linear.h): an MR x 32 register tile of float32 accumulators, one
// packed weight panel streamed through it in k order.
#include "dpara_rt/host_linear.h"

#include <algorithm>
#include <cstring>

#include "util.h"

// Compiled per CPU level (GCC function multiversioning, picked at load time): AVX-512 (x86-64-v4) keeps the
// 8 x 32 tile's 16 accumulators in zmm registers; without AVX-512 a 6 x 16 tile's 12 fit in ymm (AVX2 + FMA,
// v3) or xmm pairs (the baseline). The helpers are always_inline, so each clone gets its own copy and the
// vector ABI GCC warns about never applies.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define DPARA_RT_LINEAR_HOT __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DPARA_RT_LINEAR_HOT
#endif
#define DPARA_RT_INLINE inline __attribute__((always_inline))
#pragma GCC diagnostic ignored "-Wpsabi"

namespace dpara_rt {
namespace {

constexpr std::int64_t kPanel = kHostLinearPanel;
constexpr int kHalf = 16;             // floats per vector; a panel row is two
constexpr std::int64_t kRowBlock = 64;  // rows per pass over the panels: their x stays in L2 while W streams

// N floats of a packed panel row: F is the float vector, H / U the bf16 and uint32 vectors of as many lanes.
template <int N>
struct Lanes {
  typedef float F __attribute__((vector_size(4 * N)));
  typedef std::uint16_t H __attribute__((vector_size(2 * N)));
  typedef std::uint32_t U __attribute__((vector_size(4 * N)));
};
typedef Lanes<16>::F F16;  // a zmm register (AVX-512)
typedef Lanes<8>::F F8;    // a ymm register (AVX2)

// N weights of a packed panel row as float32: a bfloat16 is the top half of its float32.
template <int N>
DPARA_RT_INLINE typename Lanes<N>::F load_weights(const std::uint16_t* p) {
  typename Lanes<N>::H h;
  std::memcpy(&h, p, sizeof h);
  const typename Lanes<N>::U wide = __builtin_convertvector(h, typename Lanes<N>::U) << 16;
  typename Lanes<N>::F f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}
template <int N>
DPARA_RT_INLINE typename Lanes<N>::F load_weights(const float* p) {
  typename Lanes<N>::F f;
  std::memcpy(&f, p, sizeof f);
  return f;
}

// y[0..MR) x [0..cols) = x[0..MR) @ panel: acc += x[m][k] * w[k] for k in order (one FMA per element and k,
// the same chain for every MR).
template <int MR, class W>
DPARA_RT_INLINE void tile(const float* x, std::int64_t k_dim, const W* panel, float* y, std::int64_t n,
                          std::int64_t cols) {
  F16 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = F16{};
  for (std::int64_t k = 0; k < k_dim; ++k) {
    const F16 w0 = load_weights<16>(panel + k * kPanel), w1 = load_weights<16>(panel + k * kPanel + kHalf);
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * k_dim + k];
      acc[m][0] += xv * w0;
      acc[m][1] += xv * w1;
    }
  }
  for (int m = 0; m < MR; ++m) {
    float* row = y + m * n;
    if (cols == kPanel) {
      std::memcpy(row, &acc[m][0], sizeof(F16));
      std::memcpy(row + kHalf, &acc[m][1], sizeof(F16));
    } else {  // the last panel's zero padding is not written
      float tmp[kPanel];
      std::memcpy(tmp, &acc[m][0], sizeof(F16));
      std::memcpy(tmp + kHalf, &acc[m][1], sizeof(F16));
      std::memcpy(row, tmp, sizeof(float) * cols);
    }
  }
}

// The same in 8-float vectors over NV * 8 columns of a panel (`cols` of them written): with 16 vector registers
// (AVX2) a 6 x 16 tile holds its 12 accumulators, two weight vectors and the broadcast input, where the 8 x 32
// tile would spill; a row or two left over take the panel's 32 columns at once (four chains each, to cover
// the FMA latency). Per element the same FMA chain as tile(), so the same bits.
template <int MR, int NV, class W>
DPARA_RT_INLINE void tile8(const float* x, std::int64_t k_dim, const W* panel, float* y, std::int64_t n,
                           std::int64_t cols) {
  F8 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = F8{};
  for (std::int64_t k = 0; k < k_dim; ++k) {
    F8 w[NV];
    for (int v = 0; v < NV; ++v) w[v] = load_weights<8>(panel + k * kPanel + 8 * v);
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * k_dim + k];
      for (int v = 0; v < NV; ++v) acc[m][v] += xv * w[v];
    }
  }
  for (int m = 0; m < MR; ++m) {
    float tmp[8 * NV];
    std::memcpy(tmp, &acc[m][0], sizeof acc[m]);
    std::memcpy(y + m * n, tmp, sizeof(float) * cols);
  }
}

// 64-byte vectors want AVX-512's 32 registers; with fewer, the 16-column tiles (decided once, at first use).
DPARA_RT_INLINE bool wide_vectors() {
#if defined(__GNUC__) && defined(__x86_64__)
  static const bool wide = __builtin_cpu_supports("avx512f");
  return wide;
#else
  return true;
#endif
}

template <class W>
DPARA_RT_INLINE void linear(const float* x, std::int64_t m, std::int64_t k, const W* packed, std::int64_t n,
                            float* y) {
  const std::int64_t panels = (n + kPanel - 1) / kPanel;
  const bool wide = wide_vectors();
  for (std::int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
    const std::int64_t r1 = std::min(m, r0 + kRowBlock);
    for (std::int64_t p = 0; p < panels; ++p) {
      const W* panel = packed + p * k * kPanel;
      const std::int64_t c0 = p * kPanel, cols = std::min(kPanel, n - c0);
      std::int64_t r = r0;
      if (wide) {
        for (; r + 8 <= r1; r += 8) tile<8>(x + r * k, k, panel, y + r * n + c0, n, cols);
        for (; r + 4 <= r1; r += 4) tile<4>(x + r * k, k, panel, y + r * n + c0, n, cols);
        for (; r < r1; ++r) tile<1>(x + r * k, k, panel, y + r * n + c0, n, cols);
        continue;
      }
      const std::int64_t r6 = r0 + (r1 - r0) / 6 * 6;
      for (std::int64_t h = 0; h < cols; h += 16)
        for (r = r0; r < r6; r += 6)
          tile8<6, 2>(x + r * k, k, panel + h, y + r * n + c0 + h, n, std::min<std::int64_t>(16, cols - h));
      r = r6;
      if (r1 - r >= 3) {  // 3..5 rows left: one tile of them per 16 columns
        for (std::int64_t h = 0; h < cols; h += 16) {
          const std::int64_t hc = std::min<std::int64_t>(16, cols - h);
          float* out = y + r * n + c0 + h;
          if (r1 - r == 5) tile8<5, 2>(x + r * k, k, panel + h, out, n, hc);
          else if (r1 - r == 4) tile8<4, 2>(x + r * k, k, panel + h, out, n, hc);
          else tile8<3, 2>(x + r * k, k, panel + h, out, n, hc);
        }
        r = r1;
      }
      if (r1 - r == 2) tile8<2, 4>(x + r * k, k, panel, y + r * n + c0, n, cols);
      else if (r < r1) tile8<1, 4>(x + r * k, k, panel, y + r * n + c0, n, cols);
    }
  }
}

DPARA_RT_LINEAR_HOT void linear_bf16(const float* x, std::int64_t m, std::int64_t k, const std::uint16_t* packed,
                                     std::int64_t n, float* y) {
  linear(x, m, k, packed, n, y);
}
DPARA_RT_LINEAR_HOT void linear_f32(const float* x, std::int64_t m, std::int64_t k, const float* packed,
                                    std::int64_t n, float* y) {
  linear(x, m, k, packed, n, y);
}

void check_extents(const char* what, std::int64_t n, std::int64_t k) {
  if (n < 1 || k < 1) detail::value_error(what, ": n = ", n, " and k = ", k, " must both be >= 1");
}

void check_packed_dtype(const char* what, DType dtype) {
  if (dtype != DType::float32 && dtype != DType::bfloat16)
    detail::value_error(what, ": packed dtype ", dtype_name(dtype), ", expected float32 or bfloat16");
}

}  // namespace

std::int64_t host_linear_packed_elems(std::int64_t n, std::int64_t k) {
  check_extents("host_linear_packed_elems", n, k);
  const std::int64_t panels = (n + kPanel - 1) / kPanel;
  return detail::checked_mul("host_linear_packed_elems: ", detail::checked_mul("", panels, kPanel, "columns"), k,
                             "elements");
}

void host_linear_pack(const float* w, std::int64_t n, std::int64_t k, void* packed, DType packed_dtype) {
  constexpr const char* kWhat = "host_linear_pack";
  check_extents(kWhat, n, k);
  check_packed_dtype(kWhat, packed_dtype);
  const std::int64_t elems = host_linear_packed_elems(n, k);
  if (packed_dtype == DType::bfloat16) {
    for (std::int64_t i = 0; i < n * k; ++i) {
      std::uint32_t bits;
      std::memcpy(&bits, w + i, sizeof bits);
      if (bits & 0xffffu)
        detail::value_error(kWhat, ": weight [", i / k, ", ", i % k, "] = ", w[i],
                            " is not a bfloat16 value; pack this layer as float32");
    }
  }
  auto fill = [&](auto* out, auto convert) {
    std::fill(out, out + elems, convert(0.0f));
    for (std::int64_t c = 0; c < n; ++c)
      for (std::int64_t kk = 0; kk < k; ++kk)
        out[((c / kPanel) * k + kk) * kPanel + c % kPanel] = convert(w[c * k + kk]);
  };
  if (packed_dtype == DType::bfloat16) {
    fill(static_cast<std::uint16_t*>(packed), [](float v) {
      std::uint32_t bits;
      std::memcpy(&bits, &v, sizeof bits);
      return static_cast<std::uint16_t>(bits >> 16);
    });
  } else {
    fill(static_cast<float*>(packed), [](float v) { return v; });
  }
}

void host_linear(const float* x, std::int64_t m, std::int64_t k, const void* packed, DType packed_dtype,
                 std::int64_t n, float* y) {
  constexpr const char* kWhat = "host_linear";
  check_extents(kWhat, n, k);
  check_packed_dtype(kWhat, packed_dtype);
  if (m < 0) detail::value_error(kWhat, ": m = ", m, " rows, expected >= 0");
  detail::checked_mul("host_linear: ", m, std::max(n, k), "elements");
  if (packed_dtype == DType::bfloat16)
    linear_bf16(x, m, k, static_cast<const std::uint16_t*>(packed), n, y);
  else
    linear_f32(x, m, k, static_cast<const float*>(packed), n, y);
}

}  // namespace dpara_rt
