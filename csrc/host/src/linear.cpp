// The host linear layer (see dpara_rt/host/linear.h): an MR x 32 register tile of float32 accumulators, one
// packed weight panel streamed through it in k order. bf16_dot panels: linear_dot.cpp.
#include "dpara_rt/host/linear.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>

#include <unistd.h>
#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif

#include "linear_dot.h"
#include "spin.h"
#include "two_parts.h"
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
constexpr std::int64_t kRowBlock = 64;  // rows per pass over the panels: their x stays in L2 while W streams

// N floats: F is the float vector, U the uint32 vector of as many lanes.
template <int N>
struct Lanes {
  typedef float F __attribute__((vector_size(4 * N)));
  typedef std::uint32_t U __attribute__((vector_size(4 * N)));
};
typedef Lanes<16>::F F16;  // a zmm register (AVX-512)
typedef Lanes<8>::F F8;    // a ymm register (AVX2)

// 2N weights of a packed panel row as two float vectors (lo, hi) of N columns each. float32 panels hold the
// columns in order. bfloat16 panels interleave each group of 16 columns, column j beside column j + 8, so one
// load of N 32-bit lanes gives both vectors with a shift and a mask (a bfloat16 is the top half of its
// float32): no widening conversion, which AVX2 spends several instructions on.
template <int N>
DPARA_RT_INLINE void load_weights(const std::uint16_t* p, typename Lanes<N>::F& lo, typename Lanes<N>::F& hi) {
  typename Lanes<N>::U u;
  std::memcpy(&u, p, sizeof u);
  const typename Lanes<N>::U l = u << 16, h = u & 0xffff0000u;
  std::memcpy(&lo, &l, sizeof lo);
  std::memcpy(&hi, &h, sizeof hi);
}
template <int N>
DPARA_RT_INLINE void load_weights(const float* p, typename Lanes<N>::F& lo, typename Lanes<N>::F& hi) {
  std::memcpy(&lo, p, sizeof lo);
  std::memcpy(&hi, p + N, sizeof hi);
}

// The panels are contiguous, so a tile's weights run on into the next panel's: the line kPrefetchBytes ahead of
// the row a tile reads is requested before it is needed. With the hardware prefetcher alone the transfer and the
// arithmetic took turns: a verify of 8 tokens with the weights out of cache took 4.21 ms, 3.58 with this (and
// 49.3 against 40.9 ms at batch 16; 1024-8192 bytes ahead measured alike, one token's decode unchanged).
constexpr std::int64_t kPrefetchBytes = 4096;
template <class W>
DPARA_RT_INLINE void prefetch_ahead(const W* row) {
  const char* p = reinterpret_cast<const char*>(row) + kPrefetchBytes;
  __builtin_prefetch(p);
  if (sizeof(W) == 4) __builtin_prefetch(p + 64);  // a float32 panel row is two lines
}

// Where a packed panel row keeps column c (0..31): in order for float32; for bfloat16 interleaved per group
// of 16 as load_weights reads it.
constexpr std::int64_t packed_position(std::int64_t c, bool bf16) {
  return bf16 ? (c / 16) * 16 + 2 * (c % 8) + (c % 16) / 8 : c;
}

// y[0..MR) x [0..cols) = x[0..MR) @ NP adjacent panels: acc += x[m][k] * w[k] for k in order (one FMA per
// element and k, the same chain whatever MR and NP). Fewer rows take more panels at once so that at least eight
// accumulator chains cover the FMA latency: one row over one panel has two, and ran at a third of the rate.
template <int MR, int NP, class W>
DPARA_RT_INLINE void tile(const float* x, std::int64_t k_dim, const W* panel, float* y, std::int64_t n,
                          std::int64_t cols) {
  const std::int64_t stride = k_dim * kPanel;  // from one panel to the next
  F16 acc[MR][2 * NP];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2 * NP; ++v) acc[m][v] = F16{};
  for (std::int64_t k = 0; k < k_dim; ++k) {
    F16 w[2 * NP];
    for (int q = 0; q < NP; ++q) {
      prefetch_ahead(panel + q * stride + k * kPanel);
      load_weights<16>(panel + q * stride + k * kPanel, w[2 * q], w[2 * q + 1]);
    }
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * k_dim + k];
      for (int v = 0; v < 2 * NP; ++v) acc[m][v] += xv * w[v];
    }
  }
  // Column c sits where packing put it: a bf16 row's packed position p is lane p / 2 of w0 (p even) or w1 (odd),
  // so w0 holds columns 0-7 and 16-23, w1 8-15 and 24-31, and two shuffles put them in order; a float32 row's
  // vectors hold columns 0-15 and 16-31. (Picked out one float at a time, this took a quarter of a verify's
  // products at K = 256.)
  typedef Lanes<16>::U Order;
  for (int m = 0; m < MR; ++m)
    for (int q = 0; q < NP && q * kPanel < cols; ++q) {
      F16 part[2] = {acc[m][2 * q], acc[m][2 * q + 1]};
      if (sizeof(W) == 2) {
        const F16 lo = part[0], hi = part[1];
        part[0] = __builtin_shuffle(lo, hi, Order{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23});
        part[1] = __builtin_shuffle(lo, hi, Order{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
      }
      // the last panel's zero padding is not written
      std::memcpy(y + m * n + q * kPanel, part, sizeof(float) * std::min<std::int64_t>(kPanel, cols - q * kPanel));
    }
}

// The same in 8-float vectors over G groups of 16 columns (`cols` of them written, contiguous in y), group g's
// weights at groups[g]: with 16 vector registers (AVX2) a 6 x 16 tile holds its 12 accumulators, a weight
// pair and the broadcast input, where the 8 x 32 tile would spill; the last row or two take 64 or 32 columns
// at once (eight chains, to cover the FMA latency). Per element the same FMA chain as tile(), so the same bits.
template <int MR, int G, class W>
DPARA_RT_INLINE void tile8(const float* x, std::int64_t k_dim, const W* const (&groups)[G], float* y,
                           std::int64_t n, std::int64_t cols) {
  F8 acc[MR][2 * G];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2 * G; ++v) acc[m][v] = F8{};
  for (std::int64_t k = 0; k < k_dim; ++k) {
    F8 w[2 * G];
    for (int g = 0; g < G; g += 2) prefetch_ahead(groups[g] + k * kPanel);  // groups g and g + 1 share a line
    for (int g = 0; g < G; ++g) load_weights<8>(groups[g] + k * kPanel, w[2 * g], w[2 * g + 1]);
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * k_dim + k];
      for (int v = 0; v < 2 * G; ++v) acc[m][v] += xv * w[v];
    }
  }
  for (int m = 0; m < MR; ++m) {
    float tmp[16 * G];
    std::memcpy(tmp, &acc[m][0], sizeof acc[m]);
    std::memcpy(y + m * n, tmp, sizeof(float) * cols);
  }
}

// 64-byte vectors want AVX-512's 32 registers; with fewer, the 16-column tiles. Decided once, at first use;
// DPARA_RT_HOST_LINEAR_TILES=wide or narrow forces either (both are exact everywhere: tests run each path on
// any CPU).
DPARA_RT_INLINE bool wide_vectors() {
  static const bool wide = [] {
    const char* force = std::getenv("DPARA_RT_HOST_LINEAR_TILES");
    if (force != nullptr && std::strcmp(force, "wide") == 0) return true;
    if (force != nullptr && std::strcmp(force, "narrow") == 0) return false;
#if defined(__GNUC__) && defined(__x86_64__)
    return static_cast<bool>(__builtin_cpu_supports("avx512f"));
#else
    return true;
#endif
  }();
  return wide;
}

// The last MR (< 8) rows of a row block over panels [p, min(p + NP, p1)), NP at once where NP remain.
template <int MR, int NP, class W>
DPARA_RT_INLINE void rest_rows(const float* x, std::int64_t k, const W* packed, std::int64_t n, std::int64_t p,
                               std::int64_t p1, float* y, std::int64_t ldy) {
  if (p + NP <= p1) {
    const std::int64_t c0 = p * kPanel;
    return tile<MR, NP>(x, k, packed + p * k * kPanel, y + c0, ldy, std::min(NP * kPanel, n - c0));
  }
  for (; p < p1; ++p) {
    const std::int64_t c0 = p * kPanel;
    tile<MR, 1>(x, k, packed + p * k * kPanel, y + c0, ldy, std::min(kPanel, n - c0));
  }
}

// Panels [p0, p1) of the packed weight into y (rows ldy floats apart; y points at column 0): every caller's
// output element goes through the same tile and the same FMA chain, whatever the panel range.
template <class W>
DPARA_RT_INLINE void linear_wide(const float* x, std::int64_t m, std::int64_t k, const W* packed, std::int64_t n,
                                 std::int64_t p0, std::int64_t p1, float* y, std::int64_t ldy) {
  for (std::int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
    const std::int64_t r1 = std::min(m, r0 + kRowBlock), r8 = r0 + (r1 - r0) / 8 * 8;
    const float* xr = x + r8 * k;
    float* yr = y + r8 * ldy;
    for (std::int64_t p = p0; p < p1; ++p) {
      const W* panel = packed + p * k * kPanel;
      const std::int64_t c0 = p * kPanel, cols = std::min(kPanel, n - c0);
      for (std::int64_t r = r0; r < r8; r += 8) tile<8, 1>(x + r * k, k, panel, y + r * ldy + c0, ldy, cols);
      // the rows left over, while the panel is in L1; one or two rows take four or two panels per pass
      const std::int64_t step = r1 - r8 == 1 ? 4 : r1 - r8 <= 3 ? 2 : 1;
      if ((p - p0) % step != 0) continue;
      switch (r1 - r8) {
        case 1: rest_rows<1, 4>(xr, k, packed, n, p, p1, yr, ldy); break;
        case 2: rest_rows<2, 2>(xr, k, packed, n, p, p1, yr, ldy); break;
        case 3: rest_rows<3, 2>(xr, k, packed, n, p, p1, yr, ldy); break;
        case 4: rest_rows<4, 1>(xr, k, packed, n, p, p1, yr, ldy); break;
        case 5: rest_rows<5, 1>(xr, k, packed, n, p, p1, yr, ldy); break;
        case 6: rest_rows<6, 1>(xr, k, packed, n, p, p1, yr, ldy); break;
        case 7: rest_rows<7, 1>(xr, k, packed, n, p, p1, yr, ldy); break;
        default: break;
      }
    }
  }
}

// MR rows (3..6) over a panel, one 16-column group at a time.
template <int MR, class W>
DPARA_RT_INLINE void rows_by_group(const float* x, std::int64_t k, const W* panel, float* y, std::int64_t n,
                                   std::int64_t c0, std::int64_t cols) {
  for (std::int64_t h = 0; h < cols; h += 16) {
    const W* const group[1] = {panel + h};
    tile8<MR, 1>(x, k, group, y + c0 + h, n, std::min<std::int64_t>(16, cols - h));
  }
}

template <class W>
DPARA_RT_INLINE void linear_narrow(const float* x, std::int64_t m, std::int64_t k, const W* packed, std::int64_t n,
                                   std::int64_t p0, std::int64_t p1, float* y, std::int64_t ldy) {
  auto panel_at = [&](std::int64_t p) { return packed + p * k * kPanel; };
  for (std::int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
    const std::int64_t r1 = std::min(m, r0 + kRowBlock), r6 = r0 + (r1 - r0) / 6 * 6, left = r1 - r6;
    for (std::int64_t p = p0; p < p1; ++p) {
      const std::int64_t c0 = p * kPanel, cols = std::min(kPanel, n - c0);
      for (std::int64_t r = r0; r < r6; r += 6)
        rows_by_group<6>(x + r * k, k, panel_at(p), y + r * ldy, ldy, c0, cols);
      const float* xr = x + r6 * k;
      float* yr = y + r6 * ldy;
      if (left == 5) rows_by_group<5>(xr, k, panel_at(p), yr, ldy, c0, cols);
      else if (left == 4) rows_by_group<4>(xr, k, panel_at(p), yr, ldy, c0, cols);
      else if (left == 3) rows_by_group<3>(xr, k, panel_at(p), yr, ldy, c0, cols);
      else if (left == 2) {
        const W* const group[2] = {panel_at(p), panel_at(p) + 16};
        tile8<2, 2>(xr, k, group, yr + c0, ldy, cols);
      } else if (left == 1 && (p - p0) % 2 == 0) {  // one row: two panels at once (the last one alone if unpaired)
        if (p + 1 < p1) {
          const W* const group[4] = {panel_at(p), panel_at(p) + 16, panel_at(p + 1), panel_at(p + 1) + 16};
          tile8<1, 4>(xr, k, group, yr + c0, ldy, std::min(2 * kPanel, n - c0));
        } else {
          const W* const group[2] = {panel_at(p), panel_at(p) + 16};
          tile8<1, 2>(xr, k, group, yr + c0, ldy, cols);
        }
      }
    }
  }
}

template <class W>
DPARA_RT_INLINE void linear(const float* x, std::int64_t m, std::int64_t k, const W* packed, std::int64_t n,
                            std::int64_t p0, std::int64_t p1, float* y, std::int64_t ldy) {
  if (wide_vectors()) linear_wide(x, m, k, packed, n, p0, p1, y, ldy);
  else linear_narrow(x, m, k, packed, n, p0, p1, y, ldy);
}

DPARA_RT_LINEAR_HOT void linear_bf16(const float* x, std::int64_t m, std::int64_t k, const std::uint16_t* packed,
                                     std::int64_t n, std::int64_t p0, std::int64_t p1, float* y, std::int64_t ldy) {
  linear(x, m, k, packed, n, p0, p1, y, ldy);
}
DPARA_RT_LINEAR_HOT void linear_f32(const float* x, std::int64_t m, std::int64_t k, const float* packed,
                                    std::int64_t n, std::int64_t p0, std::int64_t p1, float* y, std::int64_t ldy) {
  linear(x, m, k, packed, n, p0, p1, y, ldy);
}

void check_extents(const char* what, std::int64_t n, std::int64_t k) {
  if (n < 1 || k < 1) detail::value_error(what, ": n = ", n, " and k = ", k, " must both be >= 1");
}

void check_format(const char* what, PackedFormat format) {
  if (format != PackedFormat::float32 && format != PackedFormat::bfloat16 && format != PackedFormat::bf16_dot)
    detail::value_error(what, ": packed format ", int(format), ", expected float32, bfloat16 or bf16_dot");
}

}  // namespace

PackedFormat parse_packed_format(const std::string& name) {
  for (PackedFormat f : {PackedFormat::float32, PackedFormat::bfloat16, PackedFormat::bf16_dot})
    if (name == packed_format_name(f)) return f;
  detail::value_error("packed format '", name, "', expected 'float32', 'bfloat16' or 'bf16_dot'");
}

const char* packed_format_name(PackedFormat format) {
  switch (format) {
    case PackedFormat::float32: return "float32";
    case PackedFormat::bfloat16: return "bfloat16";
    case PackedFormat::bf16_dot: return "bf16_dot";
  }
  return "?";
}

std::size_t packed_format_size(PackedFormat format) { return format == PackedFormat::float32 ? 4 : 2; }

bool host_linear_bf16_dot_native() { return detail::bf16_dot_native(); }

std::int64_t host_linear_packed_elems(std::int64_t n, std::int64_t k, PackedFormat format) {
  check_extents("host_linear_packed_elems", n, k);
  check_format("host_linear_packed_elems", format);
  const std::int64_t panels = (n + kPanel - 1) / kPanel;
  const std::int64_t depth = format == PackedFormat::bf16_dot ? 2 * detail::dot_pairs(k) : k;
  return detail::checked_mul("host_linear_packed_elems: ", detail::checked_mul("", panels, kPanel, "columns"), depth,
                             "elements");
}

void host_linear_pack(const float* w, std::int64_t n, std::int64_t k, void* packed, PackedFormat format) {
  constexpr const char* kWhat = "host_linear_pack";
  check_extents(kWhat, n, k);
  check_format(kWhat, format);
  const std::int64_t elems = host_linear_packed_elems(n, k, format);
  if (format == PackedFormat::bf16_dot) return detail::pack_bf16_dot(w, n, k, static_cast<std::uint16_t*>(packed));
  if (format == PackedFormat::bfloat16) {
    for (std::int64_t i = 0; i < n * k; ++i) {
      std::uint32_t bits;
      std::memcpy(&bits, w + i, sizeof bits);
      if (bits & 0xffffu)
        detail::value_error(kWhat, ": weight [", i / k, ", ", i % k, "] = ", w[i],
                            " is not a bfloat16 value; pack this layer as float32");
    }
  }
  const bool bf16 = format == PackedFormat::bfloat16;
  auto fill = [&](auto* out, auto convert) {
    std::fill(out, out + elems, convert(0.0f));
    for (std::int64_t c = 0; c < n; ++c)
      for (std::int64_t kk = 0; kk < k; ++kk)
        out[((c / kPanel) * k + kk) * kPanel + packed_position(c % kPanel, bf16)] = convert(w[c * k + kk]);
  };
  if (bf16) {
    fill(static_cast<std::uint16_t*>(packed), [](float v) {
      std::uint32_t bits;
      std::memcpy(&bits, &v, sizeof bits);
      return static_cast<std::uint16_t>(bits >> 16);
    });
  } else {
    fill(static_cast<float*>(packed), [](float v) { return v; });
  }
}

void host_linear(const float* x, std::int64_t m, std::int64_t k, const void* packed, PackedFormat format,
                 std::int64_t n, float* y) {
  host_linear_columns(x, m, k, packed, format, n, 0, n, y, n);
}

void host_linear_columns(const float* x, std::int64_t m, std::int64_t k, const void* packed, PackedFormat format,
                         std::int64_t n, std::int64_t col_begin, std::int64_t col_end, float* y, std::int64_t ldy) {
  constexpr const char* kWhat = "host_linear";
  check_extents(kWhat, n, k);
  check_format(kWhat, format);
  if (m < 0) detail::value_error(kWhat, ": m = ", m, " rows, expected >= 0");
  if (col_begin < 0 || col_begin > col_end || col_end > n || (col_begin % kPanel != 0 && col_begin != n) ||
      (col_end % kPanel != 0 && col_end != n))
    detail::value_error(kWhat, ": columns [", col_begin, ", ", col_end, ") of n = ", n, ", expected 0 <= begin <= ",
                        "end <= n with both on a panel edge (multiples of ", kPanel, ", or n)");
  if (ldy < n) detail::value_error(kWhat, ": ldy = ", ldy, ", expected >= n = ", n, " (y's row stride in floats)");
  detail::checked_mul("host_linear: ", m, std::max(ldy, k), "elements");
  const std::int64_t p0 = col_begin / kPanel, p1 = (col_end + kPanel - 1) / kPanel;
  if (format == PackedFormat::bf16_dot)
    detail::linear_bf16_dot(x, m, k, static_cast<const std::uint16_t*>(packed), n, p0, p1, y, ldy);
  else if (format == PackedFormat::bfloat16)
    linear_bf16(x, m, k, static_cast<const std::uint16_t*>(packed), n, p0, p1, y, ldy);
  else
    linear_f32(x, m, k, static_cast<const float*>(packed), n, p0, p1, y, ldy);
}

namespace {

// Below this many multiply-adds the hand-off (two wake-ups, tens of us each on a VM) costs more than half the
// product saves: a verify's products stay on the caller, a prefill's go to two threads.
constexpr std::int64_t kTwoThreadMacs = std::int64_t(8) << 20;

// The core's one helper thread, started on first use and never stopped (a detached thread: nothing to join at
// exit). One job at a time; a caller that finds it busy computes alone. A forked child starts its own.
class Helper {
 public:
  static Helper* get() {
    static const bool enabled = [] {
      const char* env = std::getenv("DPARA_RT_HOST_THREADS");
      if (env != nullptr && std::strcmp(env, "1") == 0) return false;
#ifdef __linux__
      cpu_set_t cores;  // a process held to one core would only time-slice the two halves
      if (sched_getaffinity(getpid(), sizeof cores, &cores) == 0) return CPU_COUNT(&cores) > 1;
#endif
      return std::thread::hardware_concurrency() > 1;
    }();
    if (!enabled) return nullptr;
    static std::mutex made_mu;
    static Helper* made = nullptr;
    std::lock_guard<std::mutex> lk(made_mu);
    if (made == nullptr || made->pid_ != getpid()) made = new Helper();  // a fork's copy has no thread: leaked
    return made;
  }

  // Whether the calling thread is held to the helper's one core (a drafter lane beside the target lane's): the
  // two halves would then only take turns on it.
  bool on_callers_core() const {
#ifdef __linux__
    cpu_set_t caller;
    return CPU_COUNT(&cores_) == 1 && sched_getaffinity(0, sizeof caller, &caller) == 0 && CPU_COUNT(&caller) == 1 &&
           CPU_EQUAL(&caller, &cores_);
#else
    return false;
#endif
  }

  bool try_start(std::function<void()> job) {
    if (busy_.exchange(true)) return false;
    job_ = std::move(job);  // read by the helper only once it sees the new count
    posted_.fetch_add(1, std::memory_order_seq_cst);
    if (helper_asleep_.load(std::memory_order_seq_cst)) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_one();
    }
    return true;
  }

  void wait() {
    const std::uint64_t job = posted_.load(std::memory_order_relaxed);
    const auto done = [&] { return finished_.load(std::memory_order_acquire) == job; };
    if (!detail::spin_until(done, kWaitSpin)) {
      std::unique_lock<std::mutex> lk(mu_);
      caller_asleep_.store(true, std::memory_order_seq_cst);
      done_cv_.wait(lk, done);
      caller_asleep_.store(false, std::memory_order_relaxed);
    }
    job_ = nullptr;
    busy_.store(false);
  }

 private:
  // A prefill hands the helper about four products a layer, a few hundred microseconds apart: each side spins for
  // the other (yielding its core to any thread that wants it) before it sleeps. Woken through the condition
  // variables each time, the hand-offs had cost a prefill of 129 tokens 1.5 of its 6.9 ms.
  static constexpr double kWaitSpin = 2e-3, kIdleSpin = 1e-3;

  Helper() : pid_(getpid()) {
#ifdef __linux__
    // The process's cores but those of the (pinned) lane thread that starts it, where any are left: the caller
    // computes its half there. Left to the scheduler, the helper was often woken on the caller's own core.
    CPU_ZERO(&cores_);
    cpu_set_t caller;
    if (sched_getaffinity(pid_, sizeof cores_, &cores_) == 0 && sched_getaffinity(0, sizeof caller, &caller) == 0) {
      cpu_set_t others;
      CPU_XOR(&others, &cores_, &caller);
      CPU_AND(&others, &others, &cores_);
      if (CPU_COUNT(&others) > 0) cores_ = others;
    }
#endif
    std::thread([this] { loop(); }).detach();
  }

  void loop() {
#ifdef __linux__
    pthread_setname_np(pthread_self(), "dpara_rt-helper");  // what a profiler or a test finds it by
    if (CPU_COUNT(&cores_) > 0) sched_setaffinity(0, sizeof cores_, &cores_);
#endif
    std::uint64_t seen = 0;
    for (;;) {
      const auto posted = [&] { return posted_.load(std::memory_order_seq_cst) != seen; };
      if (!detail::spin_until(posted, kIdleSpin)) {
        std::unique_lock<std::mutex> lk(mu_);
        helper_asleep_.store(true, std::memory_order_seq_cst);
        cv_.wait(lk, posted);
        helper_asleep_.store(false, std::memory_order_relaxed);
      }
      seen = posted_.load(std::memory_order_acquire);
      job_();
      finished_.store(seen, std::memory_order_seq_cst);
      if (caller_asleep_.load(std::memory_order_seq_cst)) {
        std::lock_guard<std::mutex> lk(mu_);
        done_cv_.notify_one();
      }
    }
  }

  const pid_t pid_;
#ifdef __linux__
  cpu_set_t cores_;
#endif
  std::atomic<bool> busy_{false};
  std::atomic<std::uint64_t> posted_{0}, finished_{0};  // jobs handed over / done, in order
  std::atomic<bool> helper_asleep_{false}, caller_asleep_{false};
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::function<void()> job_;
};

}  // namespace

void host_two_parts(const std::function<void(int)>& part) {
  Helper* helper = Helper::get();
  if (helper == nullptr || !helper->try_start([&part] { part(1); })) {
    part(0);
    part(1);
    return;
  }
  try {
    part(0);
  } catch (...) {
    helper->wait();  // part(1) still reads the caller's frame
    throw;
  }
  helper->wait();
}

void host_linear_two_threads(const float* x, std::int64_t m, std::int64_t k, const void* packed,
                             PackedFormat format, std::int64_t n, float* y) {
  const std::int64_t split = (n + kPanel - 1) / kPanel / 2 * kPanel;  // columns [0, split) here, the rest there
  // Every argument checked before either thread writes (an empty range checks them all).
  host_linear_columns(x, m, k, packed, format, n, split, split, y, n);
  Helper* helper = split > 0 && m * n >= kTwoThreadMacs / k ? Helper::get() : nullptr;
  if (helper == nullptr || helper->on_callers_core() ||
      !helper->try_start([=] { host_linear_columns(x, m, k, packed, format, n, split, n, y, n); }))
    return host_linear(x, m, k, packed, format, n, y);
  host_linear_columns(x, m, k, packed, format, n, 0, split, y, n);
  helper->wait();
}

}  // namespace dpara_rt
