// One Qwen3 decoder layer on the host (see dpara_rt/host/qwen3.h): projections through host_linear, and the
// per-token work between them (norms, RoPE, the KV write, attention, SiLU) as vectorised loops over one row.
#include "dpara_rt/host/qwen3.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "dpara_rt/host/linear.h"
#include "dpara_rt/host/verify.h"
#include "attention.h"
#include "markov_head_math.h"  // F8, exp_nonpositive(8), DPARA_RT_HOT / DPARA_RT_INLINE
#include "two_parts.h"
#include "util.h"

namespace dpara_rt {
namespace {

using detail::attention;
using detail::block_attention;
using detail::dot;
using detail::Scratch;
using detail::scratch;

// out = w * (x * rsqrt(mean(x^2) + eps)), the float32 RMSNorm of models/qwen3.py.
DPARA_RT_INLINE void rms_norm(const float* x, const float* w, std::int64_t n, float eps, float* out) {
  const float inv = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  for (std::int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

DPARA_RT_HOT void norm_rows(const float* x, const float* w, std::int64_t rows, std::int64_t n, float eps,
                            float* out) {
  for (std::int64_t r = 0; r < rows; ++r) rms_norm(x + r * n, w, n, eps, out + r * n);
}

// In place on one head: RMSNorm (where w is not null), then RoPE (x * cos + rotate_half(x) * sin).
DPARA_RT_INLINE void norm_rope(float* x, const float* w, std::int64_t d, float eps, const float* cos,
                               const float* sin, float* tmp) {
  if (w)
    rms_norm(x, w, d, eps, tmp);
  else
    std::memcpy(tmp, x, sizeof(float) * d);
  const std::int64_t half = d / 2;
  for (std::int64_t i = 0; i < half; ++i) x[i] = tmp[i] * cos[i] + (-tmp[i + half]) * sin[i];
  for (std::int64_t i = half; i < d; ++i) x[i] = tmp[i] * cos[i] + tmp[i - half] * sin[i];
}

// qkv rows [rows, (heads + 2 kv) d]: q and k heads normed and rotated in place, then K/V stored in the cache
// (when it has one).
DPARA_RT_HOT void qk_rope_store(const HostQwen3Dims& dm, const HostQwen3Weights& w, float* qkv, std::int64_t batch,
                                std::int64_t t, const std::int64_t* positions, const float* cos, const float* sin,
                                const HostKVLayer& cache) {
  const std::int64_t d = dm.head_dim, width = (dm.heads + 2 * dm.kv_heads) * d;
  std::vector<float> tmp(d);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t j = 0; j < t; ++j) {
      const std::int64_t row = b * t + j;
      float* q = qkv + row * width;
      float* k = q + dm.heads * d;
      const float* v = k + dm.kv_heads * d;
      for (std::int64_t hh = 0; hh < dm.heads; ++hh)
        norm_rope(q + hh * d, w.q_norm, d, dm.eps, cos + row * d, sin + row * d, tmp.data());
      for (std::int64_t g = 0; g < dm.kv_heads; ++g) {
        norm_rope(k + g * d, w.k_norm, d, dm.eps, cos + row * d, sin + row * d, tmp.data());
        if (!cache.k) continue;  // a drafter block's rows: their K/V stay where they are, in qkv
        const std::int64_t slot = b * cache.row_stride + g * cache.head_stride + positions[row] * d;
        std::memcpy(cache.k + slot, k + g * d, sizeof(float) * d);
        std::memcpy(cache.v + slot, v + g * d, sizeof(float) * d);
      }
    }
}

// gu rows [rows, 2 n] (gate, up) -> act [rows, n] = silu(gate) * up, silu(x) = x * sigmoid(x).
DPARA_RT_HOT void silu_mul(const float* gu, std::int64_t rows, std::int64_t n, float* act) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * n;
    const float* u = g + n;
    float* a = act + r * n;
    std::int64_t i = 0;
    for (; i + 8 <= n; i += 8) {  // the tail's arithmetic on eight lanes
      const F8 x = load8(g + i), e = exp_nonpositive8(x >= 0 ? -x : x);
      const F8 sigmoid = x >= 0 ? 1.0f / (1.0f + e) : e / (1.0f + e);
      store8(a + i, x * sigmoid * load8(u + i));
    }
    for (; i < n; ++i) {
      const float x = g[i], e = exp_nonpositive(-std::fabs(x));  // exp(-|x|): no overflow either way
      const float sigmoid = x >= 0 ? 1.0f / (1.0f + e) : e / (1.0f + e);
      a[i] = x * sigmoid * u[i];
    }
  }
}

DPARA_RT_HOT void add_rows(float* h, const float* x, std::int64_t elems) {
  for (std::int64_t i = 0; i < elems; ++i) h[i] += x[i];
}

// Columns begin..width of each row of y [rows, width] += bias[begin..width): a product's bias, added after its FMA
// chain as torch's addmm does, per row, so a row's values do not depend on the rows beside it.
DPARA_RT_HOT void add_bias(float* y, const float* bias, std::int64_t rows, std::int64_t width, std::int64_t begin) {
  for (std::int64_t r = 0; r < rows; ++r) add_rows(y + r * width + begin, bias + begin, width - begin);
}

void check_layer(const char* kWhat, const HostQwen3Dims& dm, const HostQwen3Weights& w) {
  if (dm.hidden < 1 || dm.heads < 1 || dm.kv_heads < 1 || dm.head_dim < 2 || dm.head_dim % 2 ||
      dm.intermediate < 1 || dm.heads % dm.kv_heads || !(dm.eps > 0))
    detail::value_error(kWhat, ": dims hidden ", dm.hidden, ", heads ", dm.heads, ", kv_heads ", dm.kv_heads,
                        ", head_dim ", dm.head_dim, ", intermediate ", dm.intermediate, ", eps ", dm.eps,
                        "; expected positive extents, an even head_dim, heads a multiple of kv_heads, eps > 0");
  if (!w.qkv.data || !w.o.data || !w.gate_up.data || !w.down.data || !w.input_norm || !w.post_norm)
    detail::value_error(kWhat, ": a weight pointer is null");
  if (!w.q_norm != !w.k_norm)
    detail::value_error(kWhat, ": q_norm is ", w.q_norm ? "given" : "null", " and k_norm ", w.k_norm ? "given" : "null",
                        "; expected both (Qwen3) or neither (Llama, Qwen2, Mistral)");
}

void check_cache(const char* kWhat, const HostQwen3Dims& dm, const HostKVLayer& cache) {
  if (cache.max_len < 1 || cache.head_stride < cache.max_len * dm.head_dim ||
      cache.row_stride < dm.kv_heads * cache.head_stride)
    detail::value_error(kWhat, ": cache max_len ", cache.max_len, ", head_stride ", cache.head_stride,
                        ", row_stride ", cache.row_stride, " do not hold ", dm.kv_heads, " heads of max_len x ",
                        dm.head_dim);
}

void check(const HostQwen3Dims& dm, const HostQwen3Weights& w, const float* h, std::int64_t batch, std::int64_t t,
           const std::int64_t* positions, const float* cos, const float* sin, const HostKVLayer& cache) {
  constexpr const char* kWhat = "host_qwen3_layer";
  check_layer(kWhat, dm, w);
  if (batch < 0 || t < 0) detail::value_error(kWhat, ": batch ", batch, " and t ", t, " must be >= 0");
  if (batch * t != 0 && (!h || !positions || !cos || !sin || !cache.k || !cache.v))
    detail::value_error(kWhat, ": h, positions, cos, sin and the cache must be non-null");
  check_cache(kWhat, dm, cache);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t j = 0; j < t; ++j) {
      const std::int64_t p = positions[b * t + j];
      if (p < 0 || p >= cache.max_len)
        detail::value_error(kWhat, ": positions[", b, ", ", j, "] = ", p, ", expected 0..", cache.max_len - 1);
    }
}

}  // namespace

void host_rms_norm(const float* x, const float* w, std::int64_t rows, std::int64_t n, float eps, float* out) {
  constexpr const char* kWhat = "host_rms_norm";
  if (rows < 0 || n < 1 || !(eps > 0))
    detail::value_error(kWhat, ": rows ", rows, ", n ", n, ", eps ", eps, "; expected rows >= 0, n >= 1, eps > 0");
  if (rows != 0 && (!x || !w || !out))
    detail::value_error(kWhat, ": x, w and out must be non-null (rows = ", rows, ")");
  norm_rows(x, w, rows, n, eps, out);
}

namespace {

// A context update's K/V: qkv rows [rows, (heads + 2 kv) d] (their k and v columns filled) of block rows src[r]
// (b t + j): k normed and rotated in place, then both stored at slot lengths[b] + j. Compiled as qk_rope_store is
// (the same clones), so a context row's K has the bits the layer would store for it.
DPARA_RT_HOT void store_context_kv(const HostQwen3Dims& dm, const HostQwen3Weights& w, float* qkv, std::int64_t rows,
                                   const std::int64_t* src, std::int64_t t, const std::int64_t* lengths,
                                   const float* cos, const float* sin, const HostKVLayer& cache) {
  const std::int64_t d = dm.head_dim, width = (dm.heads + 2 * dm.kv_heads) * d;
  std::vector<float> tmp(d);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t b = src[r] / t, slot = lengths[b] + src[r] % t;
    float* k = qkv + r * width + dm.heads * d;
    const float* v = k + dm.kv_heads * d;
    for (std::int64_t g = 0; g < dm.kv_heads; ++g) {
      norm_rope(k + g * d, w.k_norm, d, dm.eps, cos + src[r] * d, sin + src[r] * d, tmp.data());
      const std::int64_t at = b * cache.row_stride + g * cache.head_stride + slot * d;
      std::memcpy(cache.k + at, k + g * d, sizeof(float) * d);
      std::memcpy(cache.v + at, v + g * d, sizeof(float) * d);
    }
  }
}

constexpr std::int64_t kPrefillTokens = 32;  // tokens per row from which a forward is a prefill, not a verify

using Linear = void (*)(const float*, std::int64_t, std::int64_t, const void*, PackedFormat, std::int64_t, float*);

// The layer's second half over rows of h [rows, hidden]: h += o(attn), then h += down(silu(gate(x)) * up(x)) over
// the post-attention norm of h.
void finish_layer(const HostQwen3Dims& dm, const HostQwen3Weights& w, float* h, std::int64_t rows,
                  const float* attn, Linear linear) {
  const std::int64_t hd = dm.hidden, qd = dm.heads * dm.head_dim, n = dm.intermediate;
  const Scratch xn = scratch(rows * hd), proj = scratch(rows * hd), gu = scratch(rows * 2 * n), act = scratch(rows * n);
  linear(attn, rows, qd, w.o.data, w.o.format, hd, proj.get());
  add_rows(h, proj.get(), rows * hd);
  norm_rows(h, w.post_norm, rows, hd, dm.eps, xn.get());
  linear(xn.get(), rows, hd, w.gate_up.data, w.gate_up.format, 2 * n, gu.get());
  if (linear == host_linear_two_threads) {  // a prefill: the helper takes half the rows here too
    const std::int64_t half = rows / 2;
    host_two_parts([&](int part) {
      const std::int64_t r0 = part ? half : 0, r1 = part ? rows : half;
      silu_mul(gu.get() + r0 * 2 * n, r1 - r0, n, act.get() + r0 * n);
    });
  } else {
    silu_mul(gu.get(), rows, n, act.get());
  }
  linear(act.get(), rows, n, w.down.data, w.down.format, hd, proj.get());
  add_rows(h, proj.get(), rows * hd);
}

// qkv [rows, width] of h's rows: the input norm, the projection, q / k norms and RoPE (K/V into `cache` if it has
// memory).
Scratch project_qkv(const HostQwen3Dims& dm, const HostQwen3Weights& w, const float* h, std::int64_t batch,
                    std::int64_t t, const std::int64_t* positions, const float* cos, const float* sin,
                    const HostKVLayer& cache, Linear linear) {
  const std::int64_t rows = batch * t, hd = dm.hidden;
  const std::int64_t width = (dm.heads + 2 * dm.kv_heads) * dm.head_dim;
  Scratch xn = scratch(rows * hd), qkv = scratch(rows * width);
  norm_rows(h, w.input_norm, rows, hd, dm.eps, xn.get());
  linear(xn.get(), rows, hd, w.qkv.data, w.qkv.format, width, qkv.get());
  if (w.qkv_bias) add_bias(qkv.get(), w.qkv_bias, rows, width, 0);
  qk_rope_store(dm, w, qkv.get(), batch, t, positions, cos, sin, cache);
  return qkv;
}

void layer_unchecked(const HostQwen3Dims& dm, const HostQwen3Weights& w, float* h, std::int64_t batch,
                     std::int64_t t, const std::int64_t* positions, const float* cos, const float* sin,
                     const HostKVLayer& cache) {
  const std::int64_t rows = batch * t;
  if (!rows) return;
  // A prefill's products (a prompt per row) take a second thread: the drafter lane's core has nothing to do
  // before the prompt's features exist. A verify's (d + 1 tokens a row) stay on this one, beside the drafter.
  const bool prefill = t >= kPrefillTokens;
  const Linear linear = prefill ? host_linear_two_threads : host_linear;
  const Scratch qkv = project_qkv(dm, w, h, batch, t, positions, cos, sin, cache, linear);
  const Scratch attn = scratch(rows * dm.heads * dm.head_dim);
  if (prefill && dm.kv_heads > 1) {  // and its attention, a half of the KV heads each
    const std::int64_t half = dm.kv_heads / 2;
    host_two_parts([&](int part) {
      attention(dm, qkv.get(), batch, t, positions, cache, attn.get(), part ? half : 0, part ? dm.kv_heads : half);
    });
  } else {
    attention(dm, qkv.get(), batch, t, positions, cache, attn.get(), 0, dm.kv_heads);
  }
  finish_layer(dm, w, h, rows, attn.get(), linear);
}

}  // namespace

void host_qwen3_layer(const HostQwen3Dims& dm, const HostQwen3Weights& w, float* h, std::int64_t batch,
                      std::int64_t t, const std::int64_t* positions, const float* cos, const float* sin,
                      const HostKVLayer& cache) {
  check(dm, w, h, batch, t, positions, cos, sin, cache);
  layer_unchecked(dm, w, h, batch, t, positions, cos, sin, cache);
}

void host_qwen3_layers(const HostQwen3Dims& dm, const HostQwen3Weights* weights, const HostKVLayer* caches,
                       std::int64_t n_layers, float* h, std::int64_t batch, std::int64_t t,
                       const std::int64_t* positions, const float* cos, const float* sin,
                       const std::int64_t* capture, float* features, std::int64_t features_width) {
  constexpr const char* kWhat = "host_qwen3_layers";
  if (n_layers < 0) detail::value_error(kWhat, ": n_layers = ", n_layers, ", expected >= 0");
  if (n_layers && (!weights || !caches)) detail::value_error(kWhat, ": weights and caches must be non-null");
  for (std::int64_t i = 0; i < n_layers; ++i) check(dm, weights[i], h, batch, t, positions, cos, sin, caches[i]);
  if (capture) {
    for (std::int64_t i = 0; i < n_layers; ++i) {
      if (capture[i] < 0) continue;
      if (!features && batch * t != 0)
        detail::value_error(kWhat, ": capture[", i, "] = ", capture[i], " but features is null");
      if (capture[i] > features_width - dm.hidden)
        detail::value_error(kWhat, ": capture[", i, "] = ", capture[i], ", expected a column in 0..",
                            features_width - dm.hidden, " (features_width ", features_width, ", hidden ", dm.hidden, ")");
    }
  }
  const std::int64_t rows = batch * t;
  for (std::int64_t i = 0; i < n_layers; ++i) {
    layer_unchecked(dm, weights[i], h, batch, t, positions, cos, sin, caches[i]);
    if (capture && capture[i] >= 0)
      for (std::int64_t r = 0; r < rows; ++r)
        std::memcpy(features + r * features_width + capture[i], h + r * dm.hidden, sizeof(float) * dm.hidden);
  }
}

void host_qwen3_tokens(const HostQwen3Dims& dm, const HostQwen3Weights* weights, const HostKVLayer* caches,
                       std::int64_t n_layers, const HostQwen3Ends& ends, const std::int64_t* tokens,
                       std::int64_t batch, std::int64_t t, const std::int64_t* positions, const std::int64_t* capture,
                       std::int64_t last_capture, float* features, std::int64_t features_width, float* logits) {
  constexpr const char* kWhat = "host_qwen3_tokens";
  if (!ends.embed || !ends.cos_table || !ends.sin_table || !ends.final_norm || !ends.head.data)
    detail::value_error(kWhat, ": the embedding, RoPE tables, final norm and output head must all be given");
  if (ends.vocab < 1 || ends.table_len < 1 || ends.head_vocab < 1 || !(ends.final_eps > 0))
    detail::value_error(kWhat, ": vocab ", ends.vocab, ", table_len ", ends.table_len, ", head_vocab ",
                        ends.head_vocab, ", final_eps ", ends.final_eps, "; expected each >= 1 and eps > 0");
  if (ends.head.format != PackedFormat::float32 && ends.head.format != PackedFormat::bfloat16 &&
      ends.head.format != PackedFormat::bf16_dot)
    detail::value_error(kWhat, ": output head format ", int(ends.head.format), ", expected float32, bfloat16 or "
                        "bf16_dot (host_linear_pack's)");
  if (batch < 0 || t < 1) detail::value_error(kWhat, ": batch ", batch, ", t ", t, "; expected batch >= 0, t >= 1");
  const std::int64_t rows = batch * t, hd = dm.head_dim, hidden = dm.hidden;
  if (rows && (!tokens || !positions || !logits))
    detail::value_error(kWhat, ": tokens, positions and logits must be non-null (rows = ", rows, ")");
  for (std::int64_t r = 0; r < rows; ++r) {
    if (tokens[r] < 0 || tokens[r] >= ends.vocab)
      detail::value_error(kWhat, ": tokens[", r / t, ", ", r % t, "] = ", tokens[r], ", expected 0..", ends.vocab - 1);
    if (positions[r] < 0 || positions[r] >= ends.table_len)
      detail::value_error(kWhat, ": positions[", r / t, ", ", r % t, "] = ", positions[r], ", expected 0..",
                          ends.table_len - 1, " (the RoPE tables' rows)");
  }
  if (last_capture >= 0 && ((!features && rows) || last_capture > features_width - hidden))
    detail::value_error(kWhat, ": last_capture ", last_capture, " with features_width ", features_width,
                        ", expected a column in 0..", features_width - hidden, " of a features buffer");
  std::vector<float> h(std::size_t(rows * hidden)), cos(std::size_t(rows * hd)), sin(std::size_t(rows * hd));
  for (std::int64_t r = 0; r < rows; ++r) {
    std::memcpy(h.data() + r * hidden, ends.embed + tokens[r] * hidden, sizeof(float) * hidden);
    std::memcpy(cos.data() + r * hd, ends.cos_table + positions[r] * hd, sizeof(float) * hd);
    std::memcpy(sin.data() + r * hd, ends.sin_table + positions[r] * hd, sizeof(float) * hd);
  }
  host_qwen3_layers(dm, weights, caches, n_layers, h.data(), batch, t, positions, cos.data(), sin.data(), capture,
                    features, features_width);
  std::vector<float> normed(h.size());
  norm_rows(h.data(), ends.final_norm, rows, hidden, ends.final_eps, normed.data());
  if (last_capture >= 0)
    for (std::int64_t r = 0; r < rows; ++r)
      std::memcpy(features + r * features_width + last_capture, normed.data() + r * hidden, sizeof(float) * hidden);
  host_linear(normed.data(), rows, hidden, ends.head.data, ends.head.format, ends.head_vocab, logits);
}

bool host_qwen3_verify(const HostQwen3Dims& dm, const HostQwen3Weights* weights, const HostKVLayer* caches,
                       std::int64_t n_layers, const HostQwen3Ends& ends, const std::int64_t* tokens,
                       std::int64_t batch, std::int64_t t, const std::int64_t* lengths, const std::int64_t* capture,
                       std::int64_t last_capture, float* features, std::int64_t features_width, float* logits,
                       std::int64_t* argmax_out) {
  constexpr const char* kWhat = "host_qwen3_verify";
  if (n_layers < 1 || !caches)
    detail::value_error(kWhat, ": n_layers = ", n_layers, " with caches; expected >= 1 layer");
  if (batch < 0 || t < 1) detail::value_error(kWhat, ": batch ", batch, ", t ", t, "; expected batch >= 0, t >= 1");
  if (batch && (!lengths || !argmax_out))
    detail::value_error(kWhat, ": lengths and argmax_out must be non-null (batch = ", batch, ")");
  const std::int64_t max_len = caches[0].max_len;
  std::vector<std::int64_t> positions(std::size_t(batch * t));
  for (std::int64_t b = 0; b < batch; ++b) {
    if (lengths[b] < 0 || lengths[b] > max_len - t)
      detail::value_error(kWhat, ": lengths[", b, "] = ", lengths[b], " with t = ", t, ", expected 0..", max_len - t,
                          " (the KV cache holds ", max_len, " slots a row)");
    for (std::int64_t j = 0; j < t; ++j) positions[std::size_t(b * t + j)] = lengths[b] + j;
  }
  host_qwen3_tokens(dm, weights, caches, n_layers, ends, tokens, batch, t, positions.data(), capture, last_capture,
                    features, features_width, logits);
  return argmax_finite_host(logits, batch * t, ends.head_vocab, argmax_out);
}

void host_block_layers(const HostQwen3Dims& dm, const HostQwen3Weights* weights, const HostKVLayer* contexts,
                       std::int64_t n_layers, float* h, std::int64_t batch, std::int64_t t,
                       const std::int64_t* ctx_lens, const std::uint8_t* visible, std::int64_t visible_stride,
                       const float* cos, const float* sin, std::int64_t keep_from, const float* final_norm,
                       float* out) {
  constexpr const char* kWhat = "host_block_layers";
  if (n_layers < 1 || !weights || !contexts)
    detail::value_error(kWhat, ": n_layers = ", n_layers, " with weights and contexts; expected >= 1 layer");
  if (batch < 0 || t < 1 || keep_from < 0 || keep_from >= t)
    detail::value_error(kWhat, ": batch ", batch, ", t ", t, ", keep_from ", keep_from,
                        "; expected batch >= 0, t >= 1 and 0 <= keep_from < t");
  if (visible_stride != 0 && visible_stride != t * t)
    detail::value_error(kWhat, ": visible_stride ", visible_stride, ", expected 0 (one mask) or t * t = ", t * t);
  for (std::int64_t i = 0; i < n_layers; ++i) {
    check_layer(kWhat, dm, weights[i]);
    check_cache(kWhat, dm, contexts[i]);
    if (!contexts[i].k || !contexts[i].v) detail::value_error(kWhat, ": layer ", i, "'s context cache is null");
  }
  if (batch == 0) return;
  if (!h || !ctx_lens || !visible || !cos || !sin || !final_norm || !out)
    detail::value_error(kWhat, ": h, ctx_lens, visible, cos, sin, final_norm and out must be non-null");
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t i = 0; i < n_layers; ++i)
      if (ctx_lens[b] < 0 || ctx_lens[b] > contexts[i].max_len)
        detail::value_error(kWhat, ": ctx_lens[", b, "] = ", ctx_lens[b], ", expected 0..", contexts[i].max_len);

  // The drafter runs beside the target's verify: one thread, whatever the rows.
  const HostKVLayer no_cache{};
  const std::int64_t hd = dm.hidden, qd = dm.heads * dm.head_dim, kept = t - keep_from;
  std::int64_t rows = batch * t;
  const Scratch attn = scratch(rows * qd);
  for (std::int64_t i = 0; i < n_layers; ++i) {
    const Scratch qkv = project_qkv(dm, weights[i], h, batch, t, nullptr, cos, sin, no_cache, host_linear);
    block_attention(dm, qkv.get(), batch, t, ctx_lens, visible, visible_stride, contexts[i], attn.get());
    if (i == n_layers - 1 && keep_from > 0) {  // nobody reads the first rows' outputs past their K/V
      for (std::int64_t b = 0; b < batch; ++b) {
        std::memmove(h + b * kept * hd, h + (b * t + keep_from) * hd, sizeof(float) * kept * hd);
        std::memmove(attn.get() + b * kept * qd, attn.get() + (b * t + keep_from) * qd, sizeof(float) * kept * qd);
      }
      rows = batch * kept;
    }
    finish_layer(dm, weights[i], h, rows, attn.get(), host_linear);
  }
  norm_rows(h, final_norm, rows, hd, dm.eps, out);
}

void host_context_kv(const HostQwen3Dims& dm, const HostQwen3Weights* weights, const HostKVLayer* contexts,
                     std::int64_t n_layers, const HostPackedLinear& fc, std::int64_t feature_width,
                     const float* context_norm, const float* features, std::int64_t batch, std::int64_t t,
                     const std::int64_t* lengths, const std::int64_t* counts, const float* cos, const float* sin) {
  constexpr const char* kWhat = "host_context_kv";
  if (n_layers < 1 || !weights || !contexts)
    detail::value_error(kWhat, ": n_layers = ", n_layers, " with weights and contexts; expected >= 1 layer");
  if (batch < 0 || t < 0 || feature_width < 1)
    detail::value_error(kWhat, ": batch ", batch, ", t ", t, ", feature_width ", feature_width,
                        "; expected batch >= 0, t >= 0, feature_width >= 1");
  for (std::int64_t i = 0; i < n_layers; ++i) {
    check_layer(kWhat, dm, weights[i]);
    check_cache(kWhat, dm, contexts[i]);
    if (!contexts[i].k || !contexts[i].v) detail::value_error(kWhat, ": layer ", i, "'s context cache is null");
  }
  if (batch * t == 0) return;
  if (!fc.data || !context_norm || !features || !lengths || !counts || !cos || !sin)
    detail::value_error(kWhat, ": fc, context_norm, features, lengths, counts, cos and sin must be non-null");
  std::int64_t rows = 0;
  for (std::int64_t b = 0; b < batch; ++b) {
    if (counts[b] < 0 || counts[b] > t)
      detail::value_error(kWhat, ": counts[", b, "] = ", counts[b], ", expected 0..", t);
    for (std::int64_t i = 0; i < n_layers; ++i)
      if (lengths[b] < 0 || lengths[b] + counts[b] > contexts[i].max_len)
        detail::value_error(kWhat, ": lengths[", b, "] = ", lengths[b], " + counts[", b, "] = ", counts[b],
                            " exceed layer ", i, "'s context of max_len ", contexts[i].max_len);
    rows += counts[b];
  }
  if (!rows) return;

  const std::int64_t hd = dm.hidden, d = dm.head_dim;
  std::vector<std::int64_t> src(rows);  // the kept rows, in order: block row b * t + j for j < counts[b]
  for (std::int64_t b = 0, r = 0; b < batch; ++b)
    for (std::int64_t j = 0; j < counts[b]; ++j) src[r++] = b * t + j;
  // The layers' kept scratch: a prompt's rows are megabytes that fresh allocations would fault in page by page.
  const Scratch x = scratch(rows * feature_width), c = scratch(rows * hd), cn = scratch(rows * hd);
  for (std::int64_t r = 0; r < rows; ++r)
    std::memcpy(x.get() + r * feature_width, features + src[r] * feature_width, sizeof(float) * feature_width);
  // A prompt's rows take the second thread, as the target's prefill does (a round's few rows stay here).
  host_linear_two_threads(x.get(), rows, feature_width, fc.data, fc.format, hd, c.get());
  norm_rows(c.get(), context_norm, rows, hd, dm.eps, cn.get());
  // K and V are the qkv weight's columns after the query's; the product starts on the panel edge at or below them.
  const std::int64_t q_cols = dm.heads * d, width = q_cols + 2 * dm.kv_heads * d;
  const std::int64_t begin = q_cols / kHostLinearPanel * kHostLinearPanel;
  const Scratch qkv = scratch(rows * width);  // its k and v columns written, then read (the q columns are not)
  for (std::int64_t i = 0; i < n_layers; ++i) {
    const HostQwen3Weights& w = weights[i];
    const HostKVLayer& cache = contexts[i];
    host_linear_columns(cn.get(), rows, hd, w.qkv.data, w.qkv.format, width, begin, width, qkv.get(), width);
    if (w.qkv_bias) add_bias(qkv.get(), w.qkv_bias, rows, width, q_cols);
    store_context_kv(dm, w, qkv.get(), rows, src.data(), t, lengths, cos, sin, cache);
  }
}

}  // namespace dpara_rt
