#include "dpara_rt/host/markov_head.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

#include "dpara_rt/host/markov_bias_cache.h"
#include "markov_head_math.h"
#include "util.h"

namespace dpara_rt {
namespace {

constexpr const char* kWhat = "markov_head_host: ";
// Vocabulary tiles: the accumulators of all rows stepped together (rows x tile floats) stay in L1.
constexpr std::int64_t kTile = 1024;         // the widest tile (4 KiB per row)
constexpr std::int64_t kAccFloats = 4096;    // accumulator floats per step (16 KiB): 1024 wide up to 4 rows
constexpr std::int64_t kBlockRows = 32;      // rows stepped together (narrowest tile: 128)
constexpr std::int64_t kCounters = std::int64_t(1) << 32;  // Philox counters are 32-bit

// -------------------------------------------------------------------------------------- one step

constexpr I8 kZeroI8 = {0, 0, 0, 0, 0, 0, 0, 0};

// Arg-max over a stream of values in increasing index order: each of 8 lanes keeps its first maximum
// (strict >), and the merge breaks ties by the lowest index, as torch.argmax does. NaN is never picked.
struct ArgMax {
  F8 lane_val = F8{} - std::numeric_limits<float>::infinity();
  I8 lane_idx = I8{0, 1, 2, 3, 4, 5, 6, 7};  // an all -inf row yields index 0
  float tail_val = -std::numeric_limits<float>::infinity();
  std::int64_t tail_idx = std::numeric_limits<std::int64_t>::max();

  DPARA_RT_INLINE void push8(F8 key, std::int64_t v) {
    const I8 gt = key > lane_val;
    lane_val = gt ? key : lane_val;
    lane_idx = gt ? I8{0, 1, 2, 3, 4, 5, 6, 7} + std::int32_t(v) : lane_idx;
  }
  DPARA_RT_INLINE void push1(float key, std::int64_t v) {
    if (key > tail_val) tail_val = key, tail_idx = v;
  }
  DPARA_RT_INLINE std::int64_t index() const {
    float best = tail_val;
    std::int64_t idx = tail_idx;
    for (int l = 0; l < 8; ++l)
      if (lane_val[l] > best || (lane_val[l] == best && lane_idx[l] < idx)) best = lane_val[l], idx = lane_idx[l];
    return idx;
  }
};

// (z[v] + acc[v]) * scale for one tile, fed to the arg-max (with Gumbel noise when sampling) and kept in out[v]
// when out is given (z itself for a row made in place; null when no q needs the logits).
template <bool kNoise>
DPARA_RT_INLINE void finish_tile(const float* z, float* out, const float* noise, const float* acc, std::int64_t v0,
                                 std::int64_t n, float scale, ArgMax& best) {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const F8 s = (load8(z + v0 + i) + load8(acc + i)) * scale;
    if (out) store8(out + v0 + i, s);
    best.push8(kNoise ? s + load8(noise + v0 + i) : s, v0 + i);
  }
  for (; i < n; ++i) {
    const float s = (z[v0 + i] + acc[i]) * scale;
    if (out) out[v0 + i] = s;
    best.push1(kNoise ? s + noise[v0 + i] : s, v0 + i);
  }
}

// One request's state during a step: its row z (the boundary row as float32), where its logits go (z itself when
// a q needs them, else null: a float32 boundary row is then read where it lies), its Gumbel noise (null when
// greedy), its coefficients a = W1[x_prev, :] and its running arg-max.
struct RowState {
  const float* z;
  float* out;
  const float* noise;
  const float* a;
  ArgMax best;
};

// acc_g[i] += a_g[k] w2[k, i] + a_g[k+1] w2[k+1, i] + a_g[k+2] w2[k+2, i] + a_g[k+3] w2[k+3, i] for the G
// rows of a group (acc_g = acc + g * stride; p0..p3 are W2 rows k..k+3 at the tile's start). The four W2
// values are loaded once and used for every row. Each element's expression is the one-row loop's, so
// every clone rounds (and contracts into FMAs) exactly as before.
template <int G>
DPARA_RT_INLINE void accumulate4(float* acc, std::int64_t stride, const RowState* rows, std::int64_t k,
                                 const float* p0, const float* p1, const float* p2, const float* p3, std::int64_t n) {
  float c[G][4];
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < 4; ++t) c[g][t] = rows[g].a[k + t];
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const F8 w0 = load8(p0 + i), w1 = load8(p1 + i), w2 = load8(p2 + i), w3 = load8(p3 + i);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      float* ac = acc + g * stride + i;
      store8(ac, load8(ac) + (c[g][0] * w0 + c[g][1] * w1 + c[g][2] * w2 + c[g][3] * w3));
    }
  }
  for (; i < n; ++i)
    for (int g = 0; g < G; ++g) {
      float& ac = acc[g * stride + i];
      ac += c[g][0] * p0[i] + c[g][1] * p1[i] + c[g][2] * p2[i] + c[g][3] * p3[i];
    }
}

// The same for one W2 row k (the rank % 4 tail).
template <int G>
DPARA_RT_INLINE void accumulate1(float* acc, std::int64_t stride, const RowState* rows, std::int64_t k,
                                 const float* p0, std::int64_t n) {
  float c[G];
  for (int g = 0; g < G; ++g) c[g] = rows[g].a[k];
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const F8 w0 = load8(p0 + i);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      float* ac = acc + g * stride + i;
      store8(ac, load8(ac) + c[g] * w0);
    }
  }
  for (; i < n; ++i)
    for (int g = 0; g < G; ++g) acc[g * stride + i] += c[g] * p0[i];
}

constexpr int kGroup = 4;  // rows that share each load of W2 values in the innermost loop

// accumulate4 / accumulate1 over rows [0, count) of a tile, kGroup at a time (the last group smaller).
DPARA_RT_INLINE void accumulate4_rows(float* acc, std::int64_t tile, const RowState* rows, int count, std::int64_t k,
                                      const float* p0, const float* p1, const float* p2, const float* p3,
                                      std::int64_t n) {
  int g = 0;
  for (; g + kGroup <= count; g += kGroup) accumulate4<kGroup>(acc + g * tile, tile, rows + g, k, p0, p1, p2, p3, n);
  switch (count - g) {
    case 3: accumulate4<3>(acc + g * tile, tile, rows + g, k, p0, p1, p2, p3, n); break;
    case 2: accumulate4<2>(acc + g * tile, tile, rows + g, k, p0, p1, p2, p3, n); break;
    case 1: accumulate4<1>(acc + g * tile, tile, rows + g, k, p0, p1, p2, p3, n); break;
    default: break;
  }
}
DPARA_RT_INLINE void accumulate1_rows(float* acc, std::int64_t tile, const RowState* rows, int count, std::int64_t k,
                                      const float* p0, std::int64_t n) {
  int g = 0;
  for (; g + kGroup <= count; g += kGroup) accumulate1<kGroup>(acc + g * tile, tile, rows + g, k, p0, n);
  switch (count - g) {
    case 3: accumulate1<3>(acc + g * tile, tile, rows + g, k, p0, n); break;
    case 2: accumulate1<2>(acc + g * tile, tile, rows + g, k, p0, n); break;
    case 1: accumulate1<1>(acc + g * tile, tile, rows + g, k, p0, n); break;
    default: break;
  }
}

// acc (count x tile) = a_b @ W2[:, v0 : v0 + n) for the rows of a tile, summed over k in order from 0.
DPARA_RT_INLINE void accumulate_rows(float* acc, std::int64_t tile, const RowState* rows, int count, const float* w2,
                                     std::int64_t rank, std::int64_t vocab, std::int64_t v0, std::int64_t n) {
  std::fill_n(acc, std::size_t(count) * std::size_t(tile), 0.0f);
  std::int64_t k = 0;
  for (; k + 4 <= rank; k += 4) {
    const float* p0 = w2 + k * vocab + v0;
    const float *p1 = p0 + vocab, *p2 = p1 + vocab, *p3 = p2 + vocab;
    accumulate4_rows(acc, tile, rows, count, k, p0, p1, p2, p3, n);
  }
  for (; k < rank; ++k) accumulate1_rows(acc, tile, rows, count, k, w2 + k * vocab + v0, n);
}

// One step of `count` requests together: each row's (z + a @ W2) * scale goes to its out (when given), and each row's
// arg-max of z (+ noise) is left in its RowState. Tiled over the vocabulary so that all rows' bias
// accumulators (count x tile floats, acc) stay in L1 while W2 streams through once per step for all of
// them; four W2 rows per pass cut the accumulators' loads and stores fourfold. Per element the bias is
// summed over k in order from 0, then added to z: the reference's rounding order, whatever the batch.
DPARA_RT_HOT void step_rows(RowState* rows, int count, std::int64_t tile, const float* w2, std::int64_t rank,
                            std::int64_t vocab, float scale) {
  alignas(64) float acc[kAccFloats];  // a local array: the compiler knows that no other pointer reaches it
  for (int b = 0; b < count; ++b) rows[b].best = ArgMax();
  for (std::int64_t v0 = 0; v0 < vocab; v0 += tile) {
    const std::int64_t n = std::min(tile, vocab - v0);
    accumulate_rows(acc, tile, rows, count, w2, rank, vocab, v0, n);
    for (int b = 0; b < count; ++b) {
      RowState& row = rows[b];
      if (row.noise) finish_tile<true>(row.z, row.out, row.noise, acc + b * tile, v0, n, scale, row.best);
      else finish_tile<false>(row.z, row.out, row.noise, acc + b * tile, v0, n, scale, row.best);
    }
  }
}

// acc[0, n) = a @ W2[:, v0 : v0 + n) for a single request, in plain loops that GCC vectorises and unroll-and-jams
// (eight W2 rows per accumulator load and store), which is faster at one row than the grouped form. Same
// rounding per element as accumulate4 / accumulate1.
DPARA_RT_INLINE void accumulate_one(float* acc, const float* a, const float* w2, std::int64_t rank, std::int64_t vocab,
                                    std::int64_t v0, std::int64_t n) {
  std::fill_n(acc, n, 0.0f);  // the bias alone first, then z + bias: the reference's rounding order
  std::int64_t k = 0;
  for (; k + 4 <= rank; k += 4) {
    const float* p0 = w2 + k * vocab + v0;
    const float *p1 = p0 + vocab, *p2 = p1 + vocab, *p3 = p2 + vocab;
    const float a0 = a[k], a1 = a[k + 1], a2 = a[k + 2], a3 = a[k + 3];
    for (std::int64_t i = 0; i < n; ++i) acc[i] += a0 * p0[i] + a1 * p1[i] + a2 * p2[i] + a3 * p3[i];
  }
  for (; k < rank; ++k) {
    const float* p0 = w2 + k * vocab + v0;
    const float a0 = a[k];
    for (std::int64_t i = 0; i < n; ++i) acc[i] += a0 * p0[i];
  }
}

// step_rows for a single request: (z + a @ W2) * scale of z (the boundary row, as float32) into out (when given);
// returns arg-max of z (+ noise).
DPARA_RT_HOT std::int64_t step(const float* z, float* out, const float* noise, const float* a, const float* w2,
                               std::int64_t rank, std::int64_t vocab, float scale) {
  alignas(64) float acc[kTile];
  ArgMax best;
  for (std::int64_t v0 = 0; v0 < vocab; v0 += kTile) {
    const std::int64_t n = std::min(kTile, vocab - v0);
    accumulate_one(acc, a, w2, rank, vocab, v0, n);
    if (noise) finish_tile<true>(z, out, noise, acc, v0, n, scale, best);
    else finish_tile<false>(z, out, noise, acc, v0, n, scale, best);
  }
  return best.index();
}

// The bias rows a_i @ W2 of `count` requests into out[i] (whole rows of vocab floats), with the arithmetic of
// step / step_rows: a step that adds a stored row to z gets the bits it would have computed.
DPARA_RT_HOT void bias_rows(const RowState* rows, float* const* out, int count, std::int64_t tile, const float* w2,
                            std::int64_t rank, std::int64_t vocab) {
  alignas(64) float acc[kAccFloats];
  for (std::int64_t v0 = 0; v0 < vocab; v0 += tile) {
    const std::int64_t n = std::min(tile, vocab - v0);
    if (count == 1) accumulate_one(acc, rows[0].a, w2, rank, vocab, v0, n);
    else accumulate_rows(acc, tile, rows, count, w2, rank, vocab, v0, n);
    for (int b = 0; b < count; ++b) std::copy_n(acc + b * tile, n, out[b] + v0);
  }
}

// One step of a request whose bias row is known: (z + bias) * scale into out (when given); returns its arg-max
// (+ noise).
DPARA_RT_HOT std::int64_t step_with_bias(const float* z, float* out, const float* noise, const float* bias,
                                         std::int64_t vocab, float scale) {
  ArgMax best;
  if (noise) finish_tile<true>(z, out, noise, bias, 0, vocab, scale, best);
  else finish_tile<false>(z, out, noise, bias, 0, vocab, scale, best);
  return best.index();
}

// W2's transpose as float32, or as bfloat16 when that holds W2 exactly (a bf16 drafter's factors): half the
// bytes to fetch for the same values.
template <class W> DPARA_RT_INLINE float w_at(const W* w, std::int64_t k);
template <> DPARA_RT_INLINE float w_at<float>(const float* w, std::int64_t k) { return w[k]; }
template <> DPARA_RT_INLINE float w_at<std::uint16_t>(const std::uint16_t* w, std::int64_t k) {
  return bits_float(std::uint32_t(w[k]) << 16);
}

// One token's exact value z[v] + a @ W2[:, v] for step(), from W2's transpose (w2t row v = W2[:, v]), with
// the same expression per element as step(), so a clone rounds (and contracts into FMAs) the same way.
template <class W>
DPARA_RT_INLINE float exact_value(float z, const float* a, const W* w, std::int64_t rank, float scale) {
  float acc = 0.0f;
  std::int64_t k = 0;
  for (; k + 4 <= rank; k += 4)
    acc += a[k] * w_at(w, k) + a[k + 1] * w_at(w, k + 1) + a[k + 2] * w_at(w, k + 2) + a[k + 3] * w_at(w, k + 3);
  for (; k < rank; ++k) acc += a[k] * w_at(w, k);
  return (z + acc) * scale;
}

// step() without the full product, for its arg-max only: since |a @ W2[:, v]| <= |a| |W2[:, v]|
// (Cauchy-Schwarz), only a token whose (z + that bound) * scale (+ its Gumbel noise when sampling) reaches
// the best exact value found so far can win (a few percent of the vocabulary for a trained head). norms[v] >=
// |W2[:, v]| (rounded up) and the bound is widened by the float32 rounding of the exact value, so the result is
// step()'s arg-max. The vocabulary goes in chunks: a chunk's candidates are listed and their W2 columns
// prefetched, so their loads overlap, then valued.
template <class W>
DPARA_RT_HOT std::int64_t step_pruned(const float* z, const float* noise, float scale, const float* a, const W* w2t,
                                      const float* norms, std::int64_t rank, std::int64_t vocab) {
  constexpr std::int64_t kChunk = 512;
  double sq = 0.0;
  for (std::int64_t k = 0; k < rank; ++k) sq += double(a[k]) * double(a[k]);
  const float a_norm = float(std::sqrt(sq) * (1.0 + 1e-4));  // covers the sum's rounding (rank * 2^-24 << 1e-4)
  const F8 zero8{};
  ArgMax first;  // the token with the largest value before the bias gives the first bar
  std::int64_t v = 0;
  for (; v + 8 <= vocab; v += 8) first.push8(load8(z + v) * scale + (noise ? load8(noise + v) : zero8), v);
  for (; v < vocab; ++v) first.push1(z[v] * scale + (noise ? noise[v] : 0.0f), v);
  std::int64_t best_idx = first.index();
  const auto exact = [&](std::int64_t u) {
    const float e = exact_value(z[u], a, w2t + u * rank, rank, scale);
    return noise ? e + noise[u] : e;
  };
  float best = exact(best_idx);
  const float rel = 1e-5f;  // the exact value's roundings, relative to its terms' magnitudes
  const auto reaches = [&](std::int64_t u) {
    const float bound = norms[u] * a_norm, g = noise ? noise[u] : 0.0f;
    const float mag = (std::fabs(z[u]) + bound) * scale + std::fabs(g);
    return (z[u] + bound) * scale + g + mag * rel >= best;
  };
  std::int32_t cand[kChunk];
  for (std::int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    const std::int64_t c1 = std::min(vocab, c0 + kChunk);
    int n = 0;
    for (v = c0; v + 8 <= c1; v += 8) {
      const F8 zv = load8(z + v), bound = load8(norms + v) * a_norm, g = noise ? load8(noise + v) : zero8;
      const F8 mag = ((zv > 0 ? zv : -zv) + bound) * scale + (g > 0 ? g : -g);
      const I8 reach = ((zv + bound) * scale + g + mag * rel) >= best;
      if (std::memcmp(&reach, &kZeroI8, sizeof reach) == 0) continue;
      for (int l = 0; l < 8; ++l)
        if (reach[l]) cand[n++] = std::int32_t(v + l);
    }
    for (; v < c1; ++v)
      if (reaches(v)) cand[n++] = std::int32_t(v);
    for (int i = 0; i < n; ++i) {
      const char* row = reinterpret_cast<const char*>(w2t + std::int64_t(cand[i]) * rank);
      for (std::size_t b = 0; b < std::size_t(rank) * sizeof(W); b += 64) __builtin_prefetch(row + b);
    }
    for (int i = 0; i < n; ++i) {
      const std::int64_t u = cand[i];
      if (u == best_idx || !reaches(u)) continue;  // a better best found meanwhile puts it out of reach
      const float e = exact(u);
      if (e > best || (e == best && u < best_idx)) best = e, best_idx = u;
    }
  }
  return best_idx;
}

// In-place softmax of one row, as torch computes it: max, exp(z - max) and their sum, times 1/sum.
DPARA_RT_HOT void softmax_row(float* q, std::int64_t n) {
  F8 m8 = F8{} - std::numeric_limits<float>::infinity();
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const F8 x = load8(q + i);
    m8 = x > m8 ? x : m8;
  }
  float m = -std::numeric_limits<float>::infinity();
  for (int l = 0; l < 8; ++l) m = std::max(m, m8[l]);
  for (; i < n; ++i) m = std::max(m, q[i]);
  std::int64_t v = 0;
  for (; v + 8 <= n; v += 8) store8(q + v, exp_nonpositive8(load8(q + v) - m));
  for (; v < n; ++v) q[v] = exp_nonpositive(q[v] - m);
  F8 sum8{};
  for (i = 0; i + 8 <= n; i += 8) sum8 += load8(q + i);
  float sum = 0.0f;
  for (int l = 0; l < 8; ++l) sum += sum8[l];
  for (; i < n; ++i) sum += q[i];
  const float inv = 1.0f / sum;
  for (std::int64_t v = 0; v < n; ++v) q[v] *= inv;
}

// ------------------------------------------------------------------------------------- validation

// A token id or row index: lo <= value < hi.
void check_index(const char* name, std::int64_t b, std::int64_t value, std::int64_t hi, const char* bound) {
  if (value < 0 || value >= hi)
    detail::value_error(kWhat, name, "[", b, "] = ", value, ", expected 0..", hi - 1, " (", bound, " = ", hi, ")");
}

void check_args(const void* boundary, DType dtype, std::int64_t batch, std::int64_t n_rows, int d, std::int64_t vocab,
                std::int64_t row_stride, const std::int64_t* r, const std::int64_t* bonus, const float* w1,
                const float* w2, std::int64_t rank, double temperature, const std::int64_t* draft_out,
                const float* q_out, const float* noise) {
  using detail::checked_mul;
  using detail::value_error;
  if (batch < 0) value_error(kWhat, "batch = ", batch, ", expected >= 0");
  if (n_rows < 1) value_error(kWhat, "n_rows = ", n_rows, ", expected >= 1 (acceptance rows per request)");
  detail::check_draft_length(d, "markov_head_host:");
  if (vocab < 1 || vocab > std::numeric_limits<std::int32_t>::max())
    value_error(kWhat, "vocab = ", vocab, ", expected 1..", std::numeric_limits<std::int32_t>::max());
  if (rank < 1) value_error(kWhat, "rank = ", rank, ", expected >= 1");
  if (dtype != DType::float32 && dtype != DType::bfloat16 && dtype != DType::float16)
    value_error(kWhat, "boundary dtype ", dtype_name(dtype), ", expected float32, bfloat16 or float16");
  const std::int64_t row = std::int64_t(d) * vocab;  // no overflow: d <= kMaxDraft, vocab < 2^31
  if (row_stride < row)
    value_error(kWhat, "row_stride = ", row_stride, ", expected >= d * vocab = ", row, " (rows must not overlap)");
  // Every byte offset the loops form must fit in int64 (and so in size_t).
  const std::int64_t rows = checked_mul(kWhat, batch, n_rows, "batch * n_rows");
  if (rows > 0)
    checked_mul(kWhat, checked_mul(kWhat, rows - 1, row_stride, "(batch * n_rows - 1) * row_stride") + row,
                std::int64_t(dtype_size(dtype)), "boundary bytes");
  checked_mul(kWhat, checked_mul(kWhat, vocab, rank, "vocab * rank"), std::int64_t(sizeof(float)), "w1 bytes");
  const std::int64_t outputs =
      checked_mul(kWhat, checked_mul(kWhat, batch, d, "batch * d"), vocab, "batch * d * vocab");
  checked_mul(kWhat, outputs, std::int64_t(sizeof(float)), "q bytes");

  if (!std::isfinite(temperature) || temperature < 0)
    value_error(kWhat, "temperature = ", temperature, ", expected a finite value >= 0 (0 = greedy)");
  const bool sample = temperature > 0;
  if (sample) {
    if (!std::isfinite(float(1.0 / temperature)))
      value_error(kWhat, "temperature = ", temperature, ", expected 1/temperature to be finite in float32");
    if (outputs > kCounters)
      value_error(kWhat, "batch * d * vocab = ", outputs, ", expected <= 2^32 when sampling (one 32-bit random ",
                  "counter per drafted logit); split the batch");
  } else if (q_out) {
    value_error(kWhat, "q_out is given with temperature 0, expected null (greedy drafting produces no q)");
  }
  if (batch == 0) return;
  const std::pair<const char*, const void*> pointers[] = {
      {"boundary", boundary}, {"r", r}, {"bonus", bonus}, {"w1", w1}, {"w2", w2}, {"draft_out", draft_out}};
  for (const auto& [name, p] : pointers)
    if (!p) value_error(kWhat, name, " is null, expected a buffer (batch = ", batch, ")");
  if (sample && !q_out && !noise)
    value_error(kWhat, "q_out is null, expected a [batch, d, vocab] float32 buffer when sampling (null only with ",
                "noise drawn ahead: the draft alone, its q left to markov_q_host)");
  for (std::int64_t b = 0; b < batch; ++b) {
    check_index("r", b, r[b], n_rows, "n_rows");
    check_index("bonus", b, bonus[b], vocab, "vocab");
  }
}

}  // namespace

std::uint32_t philox4x32_10(std::uint32_t counter, std::uint64_t offset, std::uint64_t seed) {
  return philox_word(counter, PhiloxKey(offset, seed));
}

void gumbel_noise_host(float* out, std::int64_t batch, int d, std::int64_t vocab, std::uint64_t seed,
                       std::uint64_t offset) {
  using detail::value_error;
  constexpr const char* what = "gumbel_noise_host: ";
  if (batch < 0) value_error(what, "batch = ", batch, ", expected >= 0");
  detail::check_draft_length(d, "gumbel_noise_host:");
  if (vocab < 1) value_error(what, "vocab = ", vocab, ", expected >= 1");
  const std::int64_t outputs =
      detail::checked_mul(what, detail::checked_mul(what, batch, d, "batch * d"), vocab, "batch * d * vocab");
  if (outputs > kCounters)
    value_error(what, "batch * d * vocab = ", outputs, ", expected <= 2^32 (one 32-bit counter ",
                "per drafted logit)");
  if (outputs == 0) return;
  if (!out) value_error(what, "out is null, expected a [batch, d, vocab] float32 buffer");
  const PhiloxKey key(offset, seed);
  for (std::int64_t row = 0; row < batch * d; ++row)
    gumbel_row(out + row * vocab, std::uint32_t(row * vocab), vocab, key);
}

namespace {

// One step of `count` requests with a bias cache: each row's bias comes from the cache, and the rows it does not
// hold yet are computed together (W2 streamed once for them) into rows claimed for them.
void cached_step(MarkovBiasCache& cache, RowState* rows, std::int64_t* x, int count, std::int64_t tile,
                 const float* w2, std::int64_t rank, std::int64_t vocab, float scale) {
  const float* bias[kBlockRows];
  RowState missing[kBlockRows];
  float* fill[kBlockRows];
  int n_missing = 0;
  cache.begin_step();
  for (int i = 0; i < count; ++i) {
    bias[i] = cache.find(x[i]);
    if (!bias[i]) {
      float* row = cache.claim(x[i]);  // a token twice in the batch finds this row for its second request
      missing[n_missing] = rows[i];
      fill[n_missing++] = row;
      bias[i] = row;
    }
  }
  if (n_missing) bias_rows(missing, fill, n_missing, tile, w2, rank, vocab);
  for (int i = 0; i < count; ++i) x[i] = step_with_bias(rows[i].z, rows[i].out, rows[i].noise, bias[i], vocab, scale);
}

// The head's loop, shared by markov_head_host and markov_q_host. forced (q only): the draft is given, and each
// step computes z and q exactly as the drafting call did, taking x_j from forced instead of the arg-max.
// Pruned steps (w2t and w2_norms given, by a caller that wants no q) value only the arg-max's contenders. With a
// bias cache every step takes its rows from it (cached_step) and the bound is not used.
void run_head(const void* boundary, DType boundary_dtype, std::int64_t batch, std::int64_t n_rows, int d,
              std::int64_t vocab, std::int64_t row_stride, const std::int64_t* r, const std::int64_t* bonus,
              const float* w1, const float* w2, std::int64_t rank, double temperature, std::uint64_t seed,
              std::uint64_t offset, std::int64_t* draft_out, float* q_out, const void* w2t, DType w2t_dtype,
              const float* w2_norms, const float* noise, const std::int64_t* forced, MarkovBiasCache* cache) {
  const bool sample = temperature > 0;
  const bool pruned = w2t && w2_norms;
  // float32(1/T) exactly as kernels/markov_head.py's inverse_temperature rounds it
  const float scale = sample ? float(1.0 / temperature) : 1.0f;
  const PhiloxKey key(offset, seed);
  const std::size_t esize = dtype_size(boundary_dtype);
  // Requests go in blocks of up to kBlockRows, stepped together so that each step reads W2 once per block.
  const std::int64_t block = std::min(batch, kBlockRows);
  const std::int64_t tile = std::min(kTile, kAccFloats / block / 8 * 8);
  std::unique_lock<std::mutex> lock;
  if (cache) lock = std::unique_lock<std::mutex>(cache->mutex());
  // A float32 boundary row is read where it lies unless a q needs its logits (q_out): a step then reads 64 KB at
  // V = 8192 where a copy made it 160, right after a verify has pushed everything out of the core's caches.
  const bool in_place = !q_out && boundary_dtype == DType::float32;
  // Per row of a block: its logits unless they go to q_out, or its Gumbel noise when drawn here (sampling without
  // noise drawn ahead needs q_out, so never in place).
  std::vector<float> scratch(in_place ? 0 : static_cast<std::size_t>(block * vocab));
  RowState rows[kBlockRows];
  std::int64_t x[kBlockRows];
  const char* src[kBlockRows];
  for (std::int64_t b0 = 0; b0 < batch; b0 += block) {
    const int count = int(std::min(block, batch - b0));
    for (int i = 0; i < count; ++i) {
      const std::int64_t b = b0 + i;
      src[i] = static_cast<const char*>(boundary) + std::size_t((b * n_rows + r[b]) * row_stride) * esize;
      x[i] = bonus[b];
    }
    for (int j = 0; j < d; ++j) {
      for (int i = 0; i < count; ++i) {
        const std::int64_t out = (b0 + i) * d + j;
        float* own = scratch.empty() ? nullptr : scratch.data() + i * vocab;
        const char* row = src[i] + std::size_t(j * vocab) * esize;
        float* z = in_place ? nullptr : q_out ? q_out + out * vocab : own;
        if (z) load_row(z, row, boundary_dtype, vocab);
        const float* g = nullptr;
        if (sample && noise) {
          g = noise + out * vocab;  // drawn ahead of time by gumbel_noise_host: the same bits
        } else if (sample && !forced) {
          gumbel_row(own, std::uint32_t(out * vocab), vocab, key);
          g = own;
        }
        rows[i].z = z ? z : reinterpret_cast<const float*>(row);
        rows[i].out = z;
        rows[i].noise = forced ? nullptr : g;
        rows[i].a = w1 + x[i] * rank;
      }
      if (cache) {
        cached_step(*cache, rows, x, count, tile, w2, rank, vocab, scale);
      } else if (pruned) {
        for (int i = 0; i < count; ++i)
          x[i] = w2t_dtype == DType::float32
                     ? step_pruned(rows[i].z, rows[i].noise, scale, rows[i].a, static_cast<const float*>(w2t),
                                   w2_norms, rank, vocab)
                     : step_pruned(rows[i].z, rows[i].noise, scale, rows[i].a,
                                   static_cast<const std::uint16_t*>(w2t), w2_norms, rank, vocab);
      } else if (count == 1) {
        x[0] = step(rows[0].z, rows[0].out, rows[0].noise, rows[0].a, w2, rank, vocab, scale);
      } else {
        step_rows(rows, count, tile, w2, rank, vocab, scale);
        for (int i = 0; i < count; ++i) x[i] = rows[i].best.index();
      }
      for (int i = 0; i < count; ++i) {
        const std::int64_t out = (b0 + i) * d + j;
        if (forced) x[i] = forced[out];
        check_index(forced ? "draft" : "drafted token x", out, x[i], vocab, "vocab");  // guards the next W1 read
        if (q_out) softmax_row(rows[i].out, vocab);
        if (draft_out) draft_out[out] = x[i];
      }
    }
  }
}

// The cache a call uses: `cache` when it holds this head's rows and can give every request of a block its own row,
// null when none is given. A cache of other factors is an error; one smaller than a block is left alone.
MarkovBiasCache* usable_cache(MarkovBiasCache* cache, const float* w1, const float* w2, std::int64_t vocab,
                              std::int64_t rank, std::int64_t batch) {
  if (!cache) return nullptr;
  if (cache->w1() != w1 || cache->w2() != w2 || cache->vocab() != vocab || cache->rank() != rank)
    detail::value_error(kWhat, "the bias cache was built for w1 at ", cache->w1(), ", w2 at ", cache->w2(),
                        ", vocab ", cache->vocab(), ", rank ", cache->rank(), "; this call has w1 at ", w1,
                        ", w2 at ", w2, ", vocab ", vocab, ", rank ", rank, " (one cache per pair of factors)");
  return cache->capacity() >= std::min(batch, kBlockRows) ? cache : nullptr;
}

}  // namespace

void markov_head_host(const void* boundary, DType boundary_dtype, std::int64_t batch, std::int64_t n_rows, int d,
                      std::int64_t vocab, std::int64_t row_stride, const std::int64_t* r, const std::int64_t* bonus,
                      const float* w1, const float* w2, std::int64_t rank, double temperature, std::uint64_t seed,
                      std::uint64_t offset, std::int64_t* draft_out, float* q_out, const void* w2t,
                      DType w2t_dtype, const float* w2_norms, const float* noise, MarkovBiasCache* cache) {
  check_args(boundary, boundary_dtype, batch, n_rows, d, vocab, row_stride, r, bonus, w1, w2, rank, temperature,
             draft_out, q_out, noise);
  if (batch == 0) return;
  if (noise && !(temperature > 0))
    detail::value_error(kWhat, "noise is given with temperature 0, expected null (greedy drafting draws nothing)");
  if (w2t && w2_norms && w2t_dtype != DType::float32 && w2t_dtype != DType::bfloat16)
    detail::value_error(kWhat, "w2t dtype ", dtype_name(w2t_dtype), ", expected float32 or bfloat16");
  const bool prune = w2t && w2_norms && !q_out;  // a sampling call that writes q needs every logit anyway
  run_head(boundary, boundary_dtype, batch, n_rows, d, vocab, row_stride, r, bonus, w1, w2, rank, temperature, seed,
           offset, draft_out, q_out, prune ? w2t : nullptr, w2t_dtype, prune ? w2_norms : nullptr, noise, nullptr,
           usable_cache(cache, w1, w2, vocab, rank, batch));
}

void markov_q_host(const void* boundary, DType boundary_dtype, std::int64_t batch, std::int64_t n_rows, int d,
                   std::int64_t vocab, std::int64_t row_stride, const std::int64_t* r, const std::int64_t* bonus,
                   const std::int64_t* draft, const float* w1, const float* w2, std::int64_t rank,
                   double temperature, float* q_out, MarkovBiasCache* cache) {
  if (!(temperature > 0))
    detail::value_error(kWhat, "markov_q_host: temperature = ", temperature, ", expected > 0 (greedy has no q)");
  check_args(boundary, boundary_dtype, batch, n_rows, d, vocab, row_stride, r, bonus, w1, w2, rank, temperature,
             draft, q_out, nullptr);
  for (std::int64_t i = 0; i < batch * d; ++i) check_index("draft", i, draft[i], vocab, "vocab");
  run_head(boundary, boundary_dtype, batch, n_rows, d, vocab, row_stride, r, bonus, w1, w2, rank, temperature, 0, 0,
           nullptr, q_out, nullptr, DType::float32, nullptr, nullptr, draft, usable_cache(cache, w1, w2, vocab, rank, batch));
}

void markov_bias_fill(MarkovBiasCache& cache, const std::int64_t* tokens, std::int64_t n) {
  constexpr const char* what = "markov_bias_fill: ";
  if (n < 0) detail::value_error(what, "n = ", n, ", expected >= 0");
  if (n > 0 && !tokens) detail::value_error(what, "tokens is null with n = ", n, ", expected n token ids");
  const std::int64_t vocab = cache.vocab(), rank = cache.rank();
  for (std::int64_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= vocab)
      detail::value_error(what, "tokens[", i, "] = ", tokens[i], ", expected 0..", vocab - 1, " (the cache's vocab)");
  std::lock_guard<std::mutex> lock(cache.mutex());
  // Blocks of up to kBlockRows (and no more than the cache holds) computed together, W2 streamed once per block:
  // the rows of the tiles and rounding of cached_step's fill, so a step finds the bits it would compute.
  const std::int64_t block = std::min<std::int64_t>(kBlockRows, cache.capacity());
  RowState rows[kBlockRows];
  float* fill[kBlockRows];
  for (std::int64_t i = 0; i < n;) {
    cache.begin_step();
    int count = 0;
    for (; i < n && count < block; ++i) {
      if (cache.holds(tokens[i])) continue;
      fill[count] = cache.claim(tokens[i]);
      rows[count++].a = cache.w1() + tokens[i] * rank;
    }
    if (count == 0) continue;
    const std::int64_t tile = std::min(kTile, kAccFloats / count / 8 * 8);
    bias_rows(rows, fill, count, tile, cache.w2(), rank, vocab);
  }
}

}  // namespace dpara_rt
