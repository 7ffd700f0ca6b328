// The host Qwen3 layer's attention (see attention.h): scores, softmax and value sums as vectorised loops,
// the queries that share a KV head taken together so that its keys and values are read once for all of them.
#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

namespace dpara_rt::detail {
namespace {

// A thread's idle scratch blocks (floats, pointer), reused best-fit; at most kKeptBlocks blocks of kKeptFloats
// floats in all, the rest freed. A batch-16 prefill of HumanEval prompts holds ~43 MB of blocks a layer: under a
// cap of 32 MiB its largest were freed every layer and, depending on the allocator's state, faulted in anew (~20K
// page faults a prefill, an AR decode at batch 16 about a sixth slower).
constexpr std::size_t kKeptBlocks = 16, kKeptFloats = std::size_t(128) << 20 >> 2;  // 128 MiB
struct ScratchCache {
  std::vector<std::pair<std::size_t, float*>> idle;
  std::size_t floats = 0;
  ~ScratchCache() {
    for (auto& block : idle) delete[] block.second;
  }
};
ScratchCache& scratch_cache() {
  thread_local ScratchCache cache;
  return cache;
}

}  // namespace

Scratch scratch(std::int64_t n) {
  const std::size_t want = static_cast<std::size_t>(std::max<std::int64_t>(n, 1));
  ScratchCache& cache = scratch_cache();
  std::size_t best = cache.idle.size();
  for (std::size_t i = 0; i < cache.idle.size(); ++i)
    if (cache.idle[i].first >= want && (best == cache.idle.size() || cache.idle[i].first < cache.idle[best].first))
      best = i;
  if (best == cache.idle.size()) return Scratch(new float[want], ScratchReturn{want});
  const auto block = cache.idle[best];
  cache.idle.erase(cache.idle.begin() + static_cast<std::ptrdiff_t>(best));
  cache.floats -= block.first;
  return Scratch(block.second, ScratchReturn{block.first});
}

void ScratchReturn::operator()(float* p) const {
  ScratchCache& cache = scratch_cache();
  if (cache.idle.size() < kKeptBlocks && cache.floats + floats <= kKeptFloats) {
    cache.idle.emplace_back(floats, p);
    cache.floats += floats;
  } else {
    delete[] p;
  }
}

namespace {

DPARA_RT_INLINE float lane_sum(F8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// (x0 + x4, x1 + x5, x2 + x6, x3 + x7, y0 + y4, y1 + y5, y2 + y6, y3 + y7)
DPARA_RT_INLINE F8 half_sums(F8 x, F8 y) {
  return __builtin_shuffle(x, y, I8{0, 1, 2, 3, 8, 9, 10, 11}) +
         __builtin_shuffle(x, y, I8{4, 5, 6, 7, 12, 13, 14, 15});
}
// (x0 + x1, x2 + x3, x4 + x5, x6 + x7, y0 + y1, y2 + y3, y4 + y5, y6 + y7)
DPARA_RT_INLINE F8 pair_sums(F8 x, F8 y) {
  return __builtin_shuffle(x, y, I8{0, 2, 4, 6, 8, 10, 12, 14}) +
         __builtin_shuffle(x, y, I8{1, 3, 5, 7, 9, 11, 13, 15});
}

// The scores q . k_j of eight keys k[j * d ..] (d % 8 == 0) in one vector: each key's sum as dot()'s (its lanes over
// the chunks in order, then lane_sum's tree ((0 + 4) + (1 + 5)) + ((2 + 6) + (3 + 7))), the eight trees walked
// together by lane shuffles instead of one horizontal sum per key. Same bits as dot(), per key.
DPARA_RT_INLINE F8 scores8(const float* q, const float* k, std::int64_t d) {
  F8 a[8];
  for (int j = 0; j < 8; ++j) a[j] = F8{0, 0, 0, 0, 0, 0, 0, 0};
  for (std::int64_t i = 0; i < d; i += 8) {
    const F8 qv = load8(q + i);
    for (int j = 0; j < 8; ++j) a[j] += qv * load8(k + j * d + i);
  }
  const F8 first = pair_sums(half_sums(a[0], a[1]), half_sums(a[2], a[3]));  // per key: (0+4)+(1+5), (2+6)+(3+7)
  const F8 second = pair_sums(half_sums(a[4], a[5]), half_sums(a[6], a[7]));
  return pair_sums(first, second);
}

// scores[s] = q . k_s * scale for s < keys, each key's sum the same as dot()'s, so a score does not depend on its
// neighbours.
DPARA_RT_INLINE void attention_scores(const float* q, const float* k, std::int64_t keys, std::int64_t d,
                                      float scale, float* scores) {
  std::int64_t s = 0;
  if (d % 8 == 0)
    for (; s + 8 <= keys; s += 8) store8(scores + s, scores8(q, k + s * d, d) * scale);
  for (; s < keys; ++s) scores[s] = dot(q, k + s * d, d) * scale;
}

// softmax(scores[0..keys)) in place; returns nothing: the weights are left unnormalised and their sum returned.
DPARA_RT_INLINE float softmax_unnormalised(float* scores, std::int64_t keys) {
  F8 top8 = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
  std::int64_t s = 0;
  for (; s + 8 <= keys; s += 8) {
    const F8 v = load8(scores + s);
    top8 = v > top8 ? v : top8;
  }
  float top = std::max(std::max(std::max(top8[0], top8[1]), std::max(top8[2], top8[3])),
                       std::max(std::max(top8[4], top8[5]), std::max(top8[6], top8[7])));
  for (; s < keys; ++s) top = std::max(top, scores[s]);
  for (s = 0; s + 8 <= keys; s += 8) store8(scores + s, exp_nonpositive8(load8(scores + s) - top));
  for (; s < keys; ++s) scores[s] = exp_nonpositive(scores[s] - top);
  F8 sum8 = {0, 0, 0, 0, 0, 0, 0, 0};
  for (s = 0; s + 8 <= keys; s += 8) sum8 += load8(scores + s);
  float total = lane_sum(sum8);
  for (; s < keys; ++s) total += scores[s];
  return total;
}

// acc[0..8C) += sum_{s0 <= s < s1} p[s] v_s[0..8C) in key order. C is a constant, so the sums stay in registers
// across the keys.
template <int C>
DPARA_RT_INLINE void values_chunks(const float* p, const float* v, std::int64_t s0, std::int64_t s1, std::int64_t d,
                                   float* acc) {
  F8 a[C];
  for (int c = 0; c < C; ++c) a[c] = load8(acc + 8 * c);
  for (std::int64_t s = s0; s < s1; ++s) {
    const float* vs = v + s * d;
    for (int c = 0; c < C; ++c) a[c] += p[s] * load8(vs + 8 * c);
  }
  for (int c = 0; c < C; ++c) store8(acc + 8 * c, a[c]);
}

// acc[0..d) += sum_{s0 <= s < s1} p[s] v_s (d % 8 == 0), each output's sum in key order.
DPARA_RT_INLINE void values_add(const float* p, const float* v, std::int64_t s0, std::int64_t s1, std::int64_t d,
                                float* acc) {
  for (std::int64_t i0 = 0; i0 < d; i0 += 64) {  // direct calls: inlined into the caller's clone
    const float* vi = v + i0;
    float* ai = acc + i0;
    switch (std::min<std::int64_t>(64, d - i0) / 8) {
      case 8: values_chunks<8>(p, vi, s0, s1, d, ai); break;
      case 7: values_chunks<7>(p, vi, s0, s1, d, ai); break;
      case 6: values_chunks<6>(p, vi, s0, s1, d, ai); break;
      case 5: values_chunks<5>(p, vi, s0, s1, d, ai); break;
      case 4: values_chunks<4>(p, vi, s0, s1, d, ai); break;
      case 3: values_chunks<3>(p, vi, s0, s1, d, ai); break;
      case 2: values_chunks<2>(p, vi, s0, s1, d, ai); break;
      default: values_chunks<1>(p, vi, s0, s1, d, ai); break;
    }
  }
}

// Sixteen floats: one zmm register in attention's AVX-512 clone, two ymm in the others.
typedef float F16 __attribute__((vector_size(64)));
DPARA_RT_INLINE F16 load16(const float* p) {
  F16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
DPARA_RT_INLINE void store16(float* p, F16 v) { std::memcpy(p, &v, sizeof v); }

// values_chunks for two queries over the same keys (the heads of a group reading one token's keys): each value
// row is loaded once for both, and the 2C sums (C of 16 floats each) are independent chains that keep the FMA
// units busy, where one query's 64 dims were one chain per 8 floats. Per element the sum of values_chunks.
template <int C>
DPARA_RT_INLINE void values_chunks2(const float* pa, const float* pb, const float* v, std::int64_t s0, std::int64_t s1,
                                    std::int64_t d, float* acc_a, float* acc_b) {
  F16 a[C], b[C];
  for (int c = 0; c < C; ++c) a[c] = load16(acc_a + 16 * c), b[c] = load16(acc_b + 16 * c);
  for (std::int64_t s = s0; s < s1; ++s) {
    const float* vs = v + s * d;
    for (int c = 0; c < C; ++c) {
      const F16 w = load16(vs + 16 * c);
      a[c] += pa[s] * w;
      b[c] += pb[s] * w;
    }
  }
  for (int c = 0; c < C; ++c) store16(acc_a + 16 * c, a[c]), store16(acc_b + 16 * c, b[c]);
}

// values_add for two queries over the same keys (d % 16 == 0).
DPARA_RT_INLINE void values_add2(const float* pa, const float* pb, const float* v, std::int64_t s0, std::int64_t s1,
                                 std::int64_t d, float* acc_a, float* acc_b) {
  for (std::int64_t i0 = 0; i0 < d; i0 += 64) {
    const float* vi = v + i0;
    float *ai = acc_a + i0, *bi = acc_b + i0;
    switch (std::min<std::int64_t>(64, d - i0) / 16) {
      case 4: values_chunks2<4>(pa, pb, vi, s0, s1, d, ai, bi); break;
      case 3: values_chunks2<3>(pa, pb, vi, s0, s1, d, ai, bi); break;
      case 2: values_chunks2<2>(pa, pb, vi, s0, s1, d, ai, bi); break;
      default: values_chunks2<1>(pa, pb, vi, s0, s1, d, ai, bi); break;
    }
  }
}

// o[0..d) = sum_s p[s] v_s / total.
DPARA_RT_INLINE void attention_values(const float* p, const float* v, std::int64_t keys, std::int64_t d,
                                      float total, float* o) {
  const float inv = 1.0f / total;
  if (d % 8 == 0) {
    std::fill_n(o, d, 0.0f);
    values_add(p, v, 0, keys, d, o);
    for (std::int64_t i = 0; i < d; i += 8) store8(o + i, load8(o + i) * inv);
    return;
  }
  for (std::int64_t i = 0; i < d; ++i) {
    float acc = 0;
    for (std::int64_t s = 0; s < keys; ++s) acc += p[s] * v[s * d + i];
    o[i] = acc * inv;
  }
}

// The scores of the queries that read one KV head (query(i), i < nq) against its first keys(i) cached keys k:
// scores[i * stride + s] = q_i . k_s * scale. Eight keys at a time for all the queries, so each block is read from
// memory once and from L1 by the others; every score has dot()'s bits.
template <class Query, class Keys>
DPARA_RT_INLINE void group_scores(Query query, Keys keys, std::int64_t nq, std::int64_t most, const float* k,
                                  std::int64_t d, float scale, float* scores, std::int64_t stride) {
  for (std::int64_t s0 = 0; s0 < most; s0 += 8)
    for (std::int64_t i = 0; i < nq; ++i) {
      float* sc = scores + i * stride;
      const std::int64_t n = keys(i);
      if (d % 8 == 0 && s0 + 8 <= n) store8(sc + s0, scores8(query(i), k + s0 * d, d) * scale);
      else
        for (std::int64_t s = s0; s < n && s < s0 + 8; ++s) sc[s] = dot(query(i), k + s * d, d) * scale;
    }
}

// acc[i d ..] += sum over s < keys(i) of p_i[s] v_s for the same queries (p_i = scores + i * stride, d % 8 == 0): a
// block of keys at a time for all of them, whose values stay in L1, the two heads of a token (the same keys)
// summed together; per output the sum values_add gives its query alone.
template <class Keys>
DPARA_RT_INLINE void group_values(const float* scores, std::int64_t stride, Keys keys, std::int64_t nq,
                                  std::int64_t most, const float* v, std::int64_t d, float* acc) {
  constexpr std::int64_t kValueBlock = 32;  // keys whose values (8 KiB at d = 64) stay in L1 across the queries
  for (std::int64_t s0 = 0; s0 < most; s0 += kValueBlock)
    for (std::int64_t i = 0; i < nq;) {
      const std::int64_t s1 = std::min(keys(i), s0 + kValueBlock);
      const float* p = scores + i * stride;
      if (i + 1 < nq && keys(i + 1) == keys(i) && d % 16 == 0) {  // two heads of one token
        if (s0 < s1) values_add2(p, p + stride, v, s0, s1, d, acc + i * d, acc + (i + 1) * d);
        i += 2;
      } else {
        if (s0 < s1) values_add(p, v, s0, s1, d, acc + i * d);
        i += 1;
      }
    }
}

}  // namespace

// out [rows, heads d]: token (b, j), head hh attends to slots 0..positions[b, j] of its KV head. The queries that
// share a KV head (a row's tokens times the heads of its group) go through its keys and values together, a block at
// a time, so each block is read from memory once and from L1 by the others; every query's values are still the
// sums of one query alone (per key the same score, per output the same order).
// Attention alone also gets an AVX-512 clone: its paired value sums take 16 floats a register (the arithmetic
// per element is the same in every clone).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define DPARA_RT_ATTENTION_HOT __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DPARA_RT_ATTENTION_HOT
#endif

// The KV groups [g0, g1) only (a prefill splits them over two threads; each query's arithmetic is the same).
DPARA_RT_ATTENTION_HOT void attention(const HostQwen3Dims& dm, const float* qkv, std::int64_t batch, std::int64_t t,
                                      const std::int64_t* positions, const HostKVLayer& cache, float* out,
                                      std::int64_t g0, std::int64_t g1) {
  const std::int64_t d = dm.head_dim, width = (dm.heads + 2 * dm.kv_heads) * d, group = dm.heads / dm.kv_heads;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  std::int64_t stride = 1;  // a query's scores: as many as the most keys a query sees
  for (std::int64_t row = 0; row < batch * t; ++row) stride = std::max(stride, positions[row] + 1);
  if (d % 8 != 0) {  // one query at a time
    const Scratch scores = scratch(stride);
    for (std::int64_t row = 0; row < batch * t; ++row)
      for (std::int64_t hh = g0 * group; hh < g1 * group; ++hh) {
        const std::int64_t base = (row / t) * cache.row_stride + (hh / group) * cache.head_stride;
        const std::int64_t keys = positions[row] + 1;
        attention_scores(qkv + row * width + hh * d, cache.k + base, keys, d, scale, scores.get());
        const float total = softmax_unnormalised(scores.get(), keys);
        attention_values(scores.get(), cache.v + base, keys, d, total, out + row * dm.heads * d + hh * d);
      }
    return;
  }
  const std::int64_t nq = t * group;
  std::vector<float> acc(static_cast<std::size_t>(nq * d));
  const Scratch scores = scratch(nq * stride), totals = scratch(nq);
  std::vector<std::int64_t> keys(static_cast<std::size_t>(nq));
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t g = g0; g < g1; ++g) {
      const std::int64_t base = b * cache.row_stride + g * cache.head_stride;
      const float *k = cache.k + base, *v = cache.v + base;
      const auto query = [&](std::int64_t i) {
        return qkv + (b * t + i / group) * width + (g * group + i % group) * d;
      };
      std::int64_t most = 0;
      for (std::int64_t i = 0; i < nq; ++i) most = std::max(most, keys[i] = positions[b * t + i / group] + 1);
      const auto keys_of = [&](std::int64_t i) { return keys[i]; };
      group_scores(query, keys_of, nq, most, k, d, scale, scores.get(), stride);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (std::int64_t i = 0; i < nq; ++i)
        totals[i] = softmax_unnormalised(scores.get() + i * stride, keys[i]);
      group_values(scores.get(), stride, keys_of, nq, most, v, d, acc.data());
      for (std::int64_t i = 0; i < nq; ++i) {
        const float inv = 1.0f / totals[i];
        float* o = out + (b * t + i / group) * dm.heads * d + (g * group + i % group) * d;
        for (std::int64_t c = 0; c < d; c += 8) store8(o + c, load8(acc.data() + i * d + c) * inv);
      }
    }
}

// out [rows, heads d]: row (b, j), head hh attends to slots 0..ctx_lens[b]-1 of the context and to the rows m of
// its own block with visible[j * t + m] (visible advanced by visible_stride per block), whose K/V are in qkv. As in
// attention(), the queries of a KV head (the block's rows times the heads of its group) go through its context
// keys and values together, a block of keys at a time; per query the arithmetic is that of one query alone: each
// score dot()'s, the softmax over the context then the visible rows, the context's values summed in key order and
// scaled, then each visible row's added.
DPARA_RT_ATTENTION_HOT void block_attention(const HostQwen3Dims& dm, const float* qkv, std::int64_t batch,
                                            std::int64_t t, const std::int64_t* ctx_lens, const std::uint8_t* visible,
                                            std::int64_t visible_stride, const HostKVLayer& ctx, float* out) {
  const std::int64_t d = dm.head_dim, width = (dm.heads + 2 * dm.kv_heads) * d, group = dm.heads / dm.kv_heads;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  const std::int64_t nq = t * group;
  std::int64_t most = 0;
  for (std::int64_t b = 0; b < batch; ++b) most = std::max(most, ctx_lens[b]);
  const std::int64_t stride = most + t;  // a query's scores: its context keys, then its block's visible rows
  std::vector<float> acc(static_cast<std::size_t>(nq * d));
  const Scratch scores = scratch(nq * stride), totals = scratch(nq);
  std::vector<std::int64_t> seen(static_cast<std::size_t>(t * t)), n_seen(static_cast<std::size_t>(t));
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::uint8_t* vis = visible + b * visible_stride;
    const std::int64_t keys = ctx_lens[b];
    for (std::int64_t j = 0; j < t; ++j) {
      n_seen[j] = 0;
      for (std::int64_t m = 0; m < t; ++m)
        if (vis[j * t + m]) seen[j * t + n_seen[j]++] = b * t + m;
    }
    for (std::int64_t g = 0; g < dm.kv_heads; ++g) {
      const std::int64_t base = b * ctx.row_stride + g * ctx.head_stride;
      const float *k = ctx.k + base, *v = ctx.v + base;
      const auto query = [&](std::int64_t i) {
        return qkv + (b * t + i / group) * width + (g * group + i % group) * d;
      };
      const auto all_keys = [&](std::int64_t) { return keys; };
      group_scores(query, all_keys, nq, keys, k, d, scale, scores.get(), stride);
      for (std::int64_t i = 0; i < nq; ++i) {
        float* sc = scores.get() + i * stride;
        const float* q = query(i);
        const std::int64_t j = i / group;
        for (std::int64_t n = 0; n < n_seen[j]; ++n)
          sc[keys + n] = dot(q, qkv + seen[j * t + n] * width + (dm.heads + g) * d, d) * scale;
        totals[i] = softmax_unnormalised(sc, keys + n_seen[j]);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      if (d % 8 == 0) group_values(scores.get(), stride, all_keys, nq, keys, v, d, acc.data());
      for (std::int64_t i = 0; i < nq; ++i) {
        const float* p = scores.get() + i * stride;
        const float inv = 1.0f / totals[i];
        float* o = out + (b * t + i / group) * dm.heads * d + (g * group + i % group) * d;
        if (d % 8 == 0) {
          for (std::int64_t c = 0; c < d; c += 8) store8(o + c, load8(acc.data() + i * d + c) * inv);
        } else {
          attention_values(p, v, keys, d, totals[i], o);
        }
        const std::int64_t j = i / group;
        for (std::int64_t n = 0; n < n_seen[j]; ++n) {
          const float w = p[keys + n] * inv;
          const float* vr = qkv + seen[j * t + n] * width + (dm.heads + dm.kv_heads + g) * d;
          for (std::int64_t c = 0; c < d; ++c) o[c] += w * vr[c];
        }
      }
    }
  }
}

}  // namespace dpara_rt::detail
