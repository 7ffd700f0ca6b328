#include "dpara_rt/host/verify.h"

#include <algorithm>
#include <cstddef>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "util.h"

namespace dpara_rt {
namespace {

constexpr const char* kWhat = "verify_sample_host: ";
// Requests whose running sums advance together: the float64 sum is a chain of dependent adds (its order is
// the reference's, so it cannot be split), and four independent chains keep the adder busy.
constexpr int kGroup = 4;

// ------------------------------------------------------------------------------------- validation

// %.9g tells a float from its neighbours (the stream's default 6 digits prints 1.0000001 as "1").
std::string float_str(float v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", double(v));
  return buf;
}

// The bonus target u * total must stay below the total; NaN fails.
inline bool is_uniform(float u) { return u >= 0.0f && u < 1.0f; }

void check_args(const float* p, const float* q, const std::int64_t* draft, const float* u_accept,
                const float* u_bonus, std::int64_t batch, int d, std::int64_t vocab, const std::int64_t* r_out,
                const std::int64_t* bonus_out) {
  using detail::checked_mul;
  using detail::value_error;
  if (batch < 0) value_error(kWhat, "batch = ", batch, ", expected >= 0");
  detail::check_draft_length(d, "verify_sample_host:");
  if (vocab < 1) value_error(kWhat, "vocab = ", vocab, ", expected >= 1");
  // Every byte offset the loops form must fit in int64 (and so in size_t).
  checked_mul(kWhat, checked_mul(kWhat, checked_mul(kWhat, batch, d + 1, "batch * (d + 1)"), vocab,
                                 "batch * (d + 1) * vocab"),
              std::int64_t(sizeof(float)), "p bytes");
  if (batch == 0) return;
  const std::pair<const char*, const void*> pointers[] = {{"p", p},
                                                          {"q", q},
                                                          {"draft", draft},
                                                          {"u_accept", u_accept},
                                                          {"u_bonus", u_bonus},
                                                          {"r_out", r_out},
                                                          {"bonus_out", bonus_out}};
  for (const auto& [name, ptr] : pointers)
    if (!ptr) value_error(kWhat, name, " is null, expected a buffer (batch = ", batch, ")");
  for (std::int64_t b = 0; b < batch; ++b) {
    for (int i = 0; i < d; ++i) {
      const std::int64_t t = draft[b * d + i];
      if (t < 0 || t >= vocab)
        value_error(kWhat, "draft[", b, ", ", i, "] = ", t, ", expected a token id in 0..", vocab - 1,
                    " (vocab = ", vocab, ")");
      if (!is_uniform(u_accept[b * d + i]))
        value_error(kWhat, "u_accept[", b, ", ", i, "] = ", float_str(u_accept[b * d + i]),
                    ", expected a value in [0, 1)");
    }
    if (!is_uniform(u_bonus[b]))
      value_error(kWhat, "u_bonus[", b, "] = ", float_str(u_bonus[b]), ", expected a value in [0, 1)");
  }
}

// ------------------------------------------------------------------------------------------- steps

// Leading accepts of one request: u * q(t) < p(t) in float32, a product and a compare (no FMA to fuse).
int accepted(const float* p, const float* q, const std::int64_t* draft, const float* u, int d, std::int64_t vocab) {
  int r = 0;
  while (r < d && u[r] * q[r * vocab + draft[r]] < p[r * vocab + draft[r]]) ++r;
  return r;
}

// The bonus's weight row into w: max(p - q, 0), or max(p, 0) without q (all d accepted), or p itself when
// no element is > 0 or NaN, i.e. when the reference's float64 sum of the residual is <= 0 (a sum of
// non-negative floats is 0 only if each is; a NaN makes it NaN). std::max keeps a NaN, as torch.clamp does.
// Branch-free (vectorised: verify.cpp is built with -fno-trapping-math), as the signs of p - q are random.
void weight_row(const float* p, const float* q, std::int64_t vocab, float* w) {
  int live = 0;
  if (q) {
    for (std::int64_t v = 0; v < vocab; ++v) {
      w[v] = std::max(p[v] - q[v], 0.0f);
      live |= !(w[v] <= 0.0f);
    }
  } else {
    for (std::int64_t v = 0; v < vocab; ++v) {
      w[v] = std::max(p[v], 0.0f);
      live |= !(w[v] <= 0.0f);
    }
  }
  if (!live) std::copy(p, p + vocab, w);
}

// N rows' float64 running sums in index order (torch's CPU cumsum is the same sequential scan). Nothing but
// the adds in this loop: a select here compiles to a branch on w > 0, mispredicted at random weights.
template <int N>
void running_sums(const float* const* rows, double* const* sums, std::int64_t vocab, double* total) {
  const float* w[N];
  double* cdf[N];
  double run[N];
  for (int g = 0; g < N; ++g) w[g] = rows[g], cdf[g] = sums[g], run[g] = 0.0;
  for (std::int64_t v = 0; v < vocab; ++v) {
#pragma GCC unroll 4
    for (int g = 0; g < N; ++g) cdf[g][v] = run[g] += double(w[g][v]);
  }
  for (int g = 0; g < N; ++g) total[g] = run[g];
}

// inverse_cdf's pick: the first v with w[v] > 0 and cdf[v] > target (never where either is NaN), else the
// last positive weight, else 0.
std::int64_t draw(const float* w, const double* cdf, std::int64_t vocab, double target) {
  std::int64_t v = 0;
  for (; v + 8 <= vocab; v += 8) {  // one branch per 8 tokens
    bool hit = false;
    for (int l = 0; l < 8; ++l) hit |= (cdf[v + l] > target) & (w[v + l] > 0.0f);
    if (hit) break;
  }
  for (; v < vocab; ++v)
    if (cdf[v] > target && w[v] > 0.0f) return v;
  for (v = vocab - 1; v > 0 && !(w[v] > 0.0f); --v) {
  }
  return v;
}

// n <= kGroup rows' draws: their running sums side by side, then each row's pick at u[g] of its total.
void draw_group(const float* const* w, double* const* cdf, int n, std::int64_t vocab, const float* u,
                std::int64_t* out) {
  double total[kGroup];
  static_assert(kGroup == 4, "the dispatch below covers groups of 1..4");
  switch (n) {
    case 1: running_sums<1>(w, cdf, vocab, total); break;
    case 2: running_sums<2>(w, cdf, vocab, total); break;
    case 3: running_sums<3>(w, cdf, vocab, total); break;
    default: running_sums<4>(w, cdf, vocab, total); break;
  }
  for (int g = 0; g < n; ++g) out[g] = draw(w[g], cdf[g], vocab, double(u[g]) * total[g]);
}

// Per-thread scratch (weights and running sums of one group), grown to the largest vocabulary seen, so a
// decode's calls allocate nothing.
struct Scratch {
  std::vector<float> w;
  std::vector<double> cdf;
};

Scratch& scratch(std::size_t n) {
  thread_local Scratch s;
  if (s.w.size() < n) {
    s.w.resize(n);
    s.cdf.resize(n);
  }
  return s;
}

}  // namespace

void verify_sample_host(const float* p, const float* q, const std::int64_t* draft, const float* u_accept,
                        const float* u_bonus, std::int64_t batch, int d, std::int64_t vocab, std::int64_t* r_out,
                        std::int64_t* bonus_out) {
  check_args(p, q, draft, u_accept, u_bonus, batch, d, vocab, r_out, bonus_out);
  if (batch == 0) return;
  const std::int64_t group = std::min<std::int64_t>(kGroup, batch);
  Scratch& s = scratch(std::size_t(group * vocab));
  const float* w[kGroup];
  double* cdf[kGroup];
  for (std::int64_t b0 = 0; b0 < batch; b0 += group) {
    const int n = int(std::min(group, batch - b0));
    for (int g = 0; g < n; ++g) {
      const std::int64_t b = b0 + g;
      const float* pb = p + b * (d + 1) * vocab;
      const float* qb = q + b * d * vocab;
      const int r = accepted(pb, qb, draft + b * d, u_accept + b * d, d, vocab);
      float* row = s.w.data() + g * vocab;
      weight_row(pb + r * vocab, r < d ? qb + r * vocab : nullptr, vocab, row);
      w[g] = row;
      cdf[g] = s.cdf.data() + g * vocab;
      r_out[b] = r;
    }
    draw_group(w, cdf, n, vocab, u_bonus + b0, bonus_out + b0);
  }
}

void inverse_cdf_host(const float* w, const float* u, std::int64_t rows, std::int64_t vocab, std::int64_t* out) {
  using detail::value_error;
  constexpr const char* what = "inverse_cdf_host: ";
  if (rows < 0) value_error(what, "rows = ", rows, ", expected >= 0");
  if (vocab < 1) value_error(what, "vocab = ", vocab, ", expected >= 1");
  detail::checked_mul(what, detail::checked_mul(what, rows, vocab, "rows * vocab"), std::int64_t(sizeof(double)),
                      "running-sum bytes");
  if (rows == 0) return;
  if (!w || !u || !out)
    value_error(what, !w ? "w" : !u ? "u" : "out", " is null, expected a buffer (rows = ", rows, ")");
  for (std::int64_t b = 0; b < rows; ++b)
    if (!is_uniform(u[b])) value_error(what, "u[", b, "] = ", float_str(u[b]), ", expected a value in [0, 1)");
  const std::int64_t group = std::min<std::int64_t>(kGroup, rows);
  Scratch& s = scratch(std::size_t(group * vocab));
  const float* wg[kGroup];
  double* cdf[kGroup];
  for (std::int64_t b0 = 0; b0 < rows; b0 += group) {
    const int n = int(std::min(group, rows - b0));
    for (int g = 0; g < n; ++g) wg[g] = w + (b0 + g) * vocab, cdf[g] = s.cdf.data() + g * vocab;
    draw_group(wg, cdf, n, vocab, u + b0, out + b0);
  }
}

namespace {

typedef float F8 __attribute__((vector_size(32)));
typedef std::int32_t I8 __attribute__((vector_size(32)));

// One row: its largest value and whether every value is finite, eight lanes at a time (exponent bits all ones
// marks inf and NaN), then the first index holding that value.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
bool argmax_row(const float* x, std::int64_t vocab, std::int64_t* out) {
  const float inf = std::numeric_limits<float>::infinity();
  F8 top = F8{} - inf;
  I8 special{};
  const I8 exponent = I8{} + 0x7f800000;
  std::int64_t v = 0;
  for (; v + 8 <= vocab; v += 8) {
    F8 f;
    std::memcpy(&f, x + v, sizeof f);
    top = f > top ? f : top;
    I8 bits;
    std::memcpy(&bits, &f, sizeof bits);
    special |= (bits & exponent) == exponent;
  }
  float m = -inf;
  bool finite = true;
  for (int l = 0; l < 8; ++l) m = std::max(m, top[l]), finite &= special[l] == 0;
  for (; v < vocab; ++v) {
    m = std::max(m, x[v]);
    finite &= std::isfinite(x[v]);
  }
  if (!finite) return false;
  std::int64_t at = 0;
  while (x[at] != m) ++at;
  *out = at;
  return true;
}

}  // namespace

bool argmax_finite_host(const float* x, std::int64_t rows, std::int64_t vocab, std::int64_t* argmax_out) {
  if (rows < 0) detail::value_error("argmax_finite_host: rows = ", rows, ", expected >= 0");
  if (vocab < 1) detail::value_error("argmax_finite_host: vocab = ", vocab, ", expected >= 1");
  if (rows > 0 && (!x || !argmax_out))
    detail::value_error("argmax_finite_host: ", x ? "argmax_out" : "x", " is null, expected a buffer (rows = ", rows,
                        ")");
  detail::checked_mul("argmax_finite_host: ", rows, vocab, "rows * vocab");
  for (std::int64_t i = 0; i < rows; ++i)
    if (!argmax_row(x + i * vocab, vocab, argmax_out + i)) return false;
  return true;
}

}  // namespace dpara_rt
