// The drafter's block layers against the target's cached layers: a block whose rows see themselves causally after
// a context equals the same tokens decoded through host_qwen3_layer over that context (within float32 rounding:
// the two sum attention in different orders); the last layer's skipped rows change nothing of the kept ones; a
// per-block mask; refusals name the value. A context update stores the K/V the layer stores. Layer scratch is
// kept by its thread for the next call.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <set>
#include <thread>
#include <vector>

#include "../src/attention.h"  // the layers' private scratch
#include "check.h"
#include "dpara_rt/host/linear.h"
#include "dpara_rt/host/qwen3.h"

using namespace dpara_rt;
using F = std::vector<float>;

namespace {

F noise(std::int64_t count, std::uint32_t seed, float scale) {
  F out(count);
  for (auto& v : out) {
    seed = seed * 1664525u + 1013904223u;
    v = scale * (static_cast<float>(seed >> 8) / 16777216.0f - 0.5f);
  }
  return out;
}

struct Layer {
  std::vector<std::vector<float>> packed;
  F norms;  // input, post (hidden each), q, k (head_dim each)
  HostQwen3Weights w;
};

Layer make_layer(const HostQwen3Dims& dm, std::uint32_t seed) {
  const std::int64_t hd = dm.hidden, qd = dm.heads * dm.head_dim, kvd = dm.kv_heads * dm.head_dim;
  const std::int64_t shapes[4][2] = {{qd + 2 * kvd, hd}, {hd, qd}, {2 * dm.intermediate, hd}, {hd, dm.intermediate}};
  Layer l;
  for (auto& s : shapes) {
    const F w = noise(s[0] * s[1], seed++, 0.4f);
    l.packed.emplace_back(host_linear_packed_elems(s[0], s[1], PackedFormat::float32));
    host_linear_pack(w.data(), s[0], s[1], l.packed.back().data(), PackedFormat::float32);
  }
  l.norms = noise(2 * hd + 2 * dm.head_dim, seed, 0.5f);
  for (auto& v : l.norms) v += 1.0f;
  HostPackedLinear* lins[4] = {&l.w.qkv, &l.w.o, &l.w.gate_up, &l.w.down};
  for (int i = 0; i < 4; ++i) *lins[i] = {l.packed[i].data(), PackedFormat::float32};
  l.w.input_norm = l.norms.data();
  l.w.post_norm = l.norms.data() + hd;
  l.w.q_norm = l.norms.data() + 2 * hd;
  l.w.k_norm = l.norms.data() + 2 * hd + dm.head_dim;
  return l;
}

// n layers (make_layer with seeds seed * (i + 1)) and their weights, as host_qwen3_layers takes them.
struct Layers {
  std::vector<Layer> ls;
  std::vector<HostQwen3Weights> ws;
  Layers(const HostQwen3Dims& dm, int n, std::uint32_t seed) {
    for (int i = 0; i < n; ++i) ls.push_back(make_layer(dm, seed * (i + 1)));
    for (auto& l : ls) ws.push_back(l.w);
  }
};

// Zeroed KV caches of n layers, batch rows of max_len slots each; a copy holds the same values in its own memory.
struct Caches {
  std::int64_t head_stride, row_stride, layer_size, max_len;
  F k, v;
  std::vector<HostKVLayer> layers;
  Caches(const HostQwen3Dims& dm, int n, std::int64_t batch, std::int64_t max_len)
      : head_stride(max_len * dm.head_dim), row_stride(dm.kv_heads * head_stride), layer_size(batch * row_stride),
        max_len(max_len), k(n * layer_size, 0.0f), v(k.size(), 0.0f) {
    point(n);
  }
  Caches(const Caches& o)
      : head_stride(o.head_stride), row_stride(o.row_stride), layer_size(o.layer_size), max_len(o.max_len), k(o.k),
        v(o.v) {
    point(static_cast<int>(o.layers.size()));
  }
  void point(int n) {
    for (int i = 0; i < n; ++i)
      layers.push_back({k.data() + i * layer_size, v.data() + i * layer_size, row_stride, head_stride, max_len});
  }
};

void rope(const HostQwen3Dims& dm, const std::vector<std::int64_t>& positions, F& cos, F& sin) {
  const std::int64_t d = dm.head_dim, half = d / 2;
  cos.assign(positions.size() * d, 0.0f);
  sin.assign(positions.size() * d, 0.0f);
  for (std::size_t r = 0; r < positions.size(); ++r)
    for (std::int64_t i = 0; i < d; ++i) {
      const double a = positions[r] * std::pow(10000.0, -2.0 * (i % half) / d);
      cos[r * d + i] = static_cast<float>(std::cos(a));
      sin[r * d + i] = static_cast<float>(std::sin(a));
    }
}

float max_abs_diff(const float* a, const float* b, std::int64_t n) {
  float m = 0;
  for (std::int64_t i = 0; i < n; ++i) m = std::fmax(m, std::fabs(a[i] - b[i]));
  return m;
}

void test_a_causal_block_equals_decoding_after_the_context() {
  const HostQwen3Dims dm{32, 4, 2, 8, 48, 1e-6f};
  const std::int64_t layers = 2, ctx = 5, t = 6, max_len = 16, hd = dm.hidden, keep = 2;
  std::vector<Layer> ls;
  std::vector<HostQwen3Weights> ws;
  for (int i = 0; i < layers; ++i) ls.push_back(make_layer(dm, 100u * (i + 1)));
  for (auto& l : ls) ws.push_back(l.w);
  const std::int64_t head_stride = max_len * dm.head_dim, row_stride = dm.kv_heads * head_stride;
  F k(layers * row_stride), v(layers * row_stride);
  std::vector<HostKVLayer> caches;
  for (int i = 0; i < layers; ++i) caches.push_back({k.data() + i * row_stride, v.data() + i * row_stride, row_stride,
                                                      head_stride, max_len});
  // The context: ctx tokens through the cached layers (their K/V stay in the cache for both paths below).
  std::vector<std::int64_t> pos(ctx);
  for (std::int64_t j = 0; j < ctx; ++j) pos[j] = j;
  F cos, sin, h = noise(ctx * hd, 7, 2.0f);
  rope(dm, pos, cos, sin);
  host_qwen3_layers(dm, ws.data(), caches.data(), layers, h.data(), 1, ctx, pos.data(), cos.data(), sin.data(),
                    nullptr, nullptr, 0);

  // The block first (it leaves the cache as it found it), then the same rows decoded through the cache.
  pos.resize(t);
  for (std::int64_t j = 0; j < t; ++j) pos[j] = ctx + j;
  rope(dm, pos, cos, sin);
  const F rows = noise(t * hd, 9, 2.0f);
  std::vector<std::uint8_t> causal(t * t);
  for (std::int64_t j = 0; j < t; ++j)
    for (std::int64_t m = 0; m < t; ++m) causal[j * t + m] = m <= j;
  const F final_norm = noise(hd, 11, 0.5f);
  const std::int64_t lens[1] = {ctx};
  F block = rows, out((t - keep) * hd), all = rows, out_all(t * hd);
  host_block_layers(dm, ws.data(), caches.data(), layers, block.data(), 1, t, lens, causal.data(), 0, cos.data(),
                    sin.data(), keep, final_norm.data(), out.data());
  host_block_layers(dm, ws.data(), caches.data(), layers, all.data(), 1, t, lens, causal.data(), t * t, cos.data(),
                    sin.data(), 0, final_norm.data(), out_all.data());
  // skipping the first rows in the last layer changes nothing of the others (each row's arithmetic is its own)
  CHECK(max_abs_diff(out.data(), out_all.data() + keep * hd, (t - keep) * hd) == 0.0f);

  F decoded = rows, normed(t * hd);
  host_qwen3_layers(dm, ws.data(), caches.data(), layers, decoded.data(), 1, t, pos.data(), cos.data(), sin.data(),
                    nullptr, nullptr, 0);
  host_rms_norm(decoded.data(), final_norm.data(), t, hd, dm.eps, normed.data());
  CHECK(max_abs_diff(out_all.data(), normed.data(), t * hd) < 2e-5f);

  // A block that sees only itself and the first context slot differs (the mask and ctx_lens are honoured).
  std::vector<std::uint8_t> diagonal(t * t, 0);
  for (std::int64_t j = 0; j < t; ++j) diagonal[j * t + j] = 1;
  const std::int64_t one[1] = {1};
  F alone = rows, out_alone(t * hd);
  host_block_layers(dm, ws.data(), caches.data(), layers, alone.data(), 1, t, one, diagonal.data(), 0, cos.data(),
                    sin.data(), 0, final_norm.data(), out_alone.data());
  CHECK(max_abs_diff(out_alone.data(), out_all.data(), t * hd) > 1e-3f);
  // ... and equals, row by row, that row decoded alone right after the first context token
  for (std::int64_t j = 0; j < t; ++j) {
    F row(rows.begin() + j * hd, rows.begin() + (j + 1) * hd), row_out(hd);
    const std::int64_t at[1] = {1};
    F row_cos(cos.begin() + j * dm.head_dim, cos.begin() + (j + 1) * dm.head_dim);
    F row_sin(sin.begin() + j * dm.head_dim, sin.begin() + (j + 1) * dm.head_dim);
    F kk = k, vv = v;  // a scratch cache: decoding writes the row's K/V at slot 1
    std::vector<HostKVLayer> scratch;
    for (int i = 0; i < layers; ++i)
      scratch.push_back({kk.data() + i * row_stride, vv.data() + i * row_stride, row_stride, head_stride, max_len});
    host_qwen3_layers(dm, ws.data(), scratch.data(), layers, row.data(), 1, 1, at, row_cos.data(), row_sin.data(),
                      nullptr, nullptr, 0);
    host_rms_norm(row.data(), final_norm.data(), 1, hd, dm.eps, row_out.data());
    CHECK(max_abs_diff(out_alone.data() + j * hd, row_out.data(), hd) < 2e-5f);
  }

  // refusals name the value
  F scratch_h = rows;
  CHECK_THROWS(host_block_layers(dm, ws.data(), caches.data(), layers, scratch_h.data(), 1, t, lens, causal.data(), 0,
                                 cos.data(), sin.data(), t, final_norm.data(), out.data()),
               std::invalid_argument, "keep_from 6");
  const std::int64_t too_long[1] = {max_len + 1};
  CHECK_THROWS(host_block_layers(dm, ws.data(), caches.data(), layers, scratch_h.data(), 1, t, too_long,
                                 causal.data(), 0, cos.data(), sin.data(), 0, final_norm.data(), out.data()),
               std::invalid_argument, "ctx_lens[0] = 17");
}

// A context update whose fc is the identity and whose norm is the layer's input norm stores, bit for bit, the K/V
// that the layer itself stores for the same rows (the same norm, the same FMA chains over the k and v columns, the
// same k norm and RoPE); rows past a block's count are not written; refusals name the value before any write.
void test_a_verify_gives_each_token_the_bits_of_decoding_it_alone() {
  // Tokens verified together (two rows of different lengths, keys crossing a block of eight) get the bits that
  // decoding each alone after the same context gives: attention shares the KV head's blocks among the queries,
  // but each score and each value sum is one query's own. head_dim 8: the blocked path; 12: the one-query path.
  for (const std::int64_t head_dim : {8, 12}) {
    const HostQwen3Dims dm{32, 4, 2, head_dim, 48, 1e-6f};
    const std::int64_t layers = 2, batch = 2, t = 6, hd = dm.hidden;
    const std::int64_t ctx[2] = {13, 3};
    const Layers net(dm, layers, 500u);
    Caches c1(dm, layers, batch, 32);
    std::vector<std::int64_t> pos(batch * 13);  // each row's context, the shorter one padded past its end
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t j = 0; j < 13; ++j) pos[b * 13 + j] = j < ctx[b] ? j : ctx[b] + t + j;
    F cos, sin, h = noise(batch * 13 * hd, 31, 2.0f);
    rope(dm, pos, cos, sin);
    host_qwen3_layers(dm, net.ws.data(), c1.layers.data(), layers, h.data(), batch, 13, pos.data(), cos.data(),
                      sin.data(), nullptr, nullptr, 0);
    Caches c2 = c1;
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t j = 0; j < t; ++j) pos[b * t + j] = ctx[b] + j;
    pos.resize(batch * t);
    rope(dm, pos, cos, sin);
    const F rows = noise(batch * t * hd, 33, 2.0f);
    F together = rows;
    host_qwen3_layers(dm, net.ws.data(), c1.layers.data(), layers, together.data(), batch, t, pos.data(), cos.data(),
                      sin.data(), nullptr, nullptr, 0);
    for (std::int64_t j = 0; j < t; ++j) {  // one token per row per call, in order
      F step(batch * hd), step_cos(batch * dm.head_dim), step_sin(batch * dm.head_dim);
      std::vector<std::int64_t> step_pos(batch);
      for (std::int64_t b = 0; b < batch; ++b) {
        std::copy_n(rows.data() + (b * t + j) * hd, hd, step.data() + b * hd);
        std::copy_n(cos.data() + (b * t + j) * dm.head_dim, dm.head_dim, step_cos.data() + b * dm.head_dim);
        std::copy_n(sin.data() + (b * t + j) * dm.head_dim, dm.head_dim, step_sin.data() + b * dm.head_dim);
        step_pos[b] = pos[b * t + j];
      }
      host_qwen3_layers(dm, net.ws.data(), c2.layers.data(), layers, step.data(), batch, 1, step_pos.data(),
                        step_cos.data(), step_sin.data(), nullptr, nullptr, 0);
      for (std::int64_t b = 0; b < batch; ++b)
        CHECK(max_abs_diff(step.data() + b * hd, together.data() + (b * t + j) * hd, hd) == 0.0f);
    }
    CHECK(max_abs_diff(c1.k.data(), c2.k.data(), layers * c1.layer_size) == 0.0f);
  }
}

void test_the_context_update_stores_what_the_layer_stores() {
  const HostQwen3Dims dm{32, 4, 2, 8, 48, 1e-6f};
  const std::int64_t batch = 2, t = 3, max_len = 8, hd = dm.hidden;
  const Layer l = make_layer(dm, 300u);
  const std::int64_t head_stride = max_len * dm.head_dim, row_stride = dm.kv_heads * head_stride;
  const std::int64_t lengths[2] = {2, 0}, counts[2] = {3, 1};
  std::vector<std::int64_t> pos(batch * t);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t j = 0; j < t; ++j) pos[b * t + j] = lengths[b] + j;
  F cos, sin;
  rope(dm, pos, cos, sin);
  const F x = noise(batch * t * hd, 21, 2.0f);

  F k_layer(batch * row_stride, 0.0f), v_layer(batch * row_stride, 0.0f);
  F h = x;
  host_qwen3_layer(dm, l.w, h.data(), batch, t, pos.data(), cos.data(), sin.data(),
                   {k_layer.data(), v_layer.data(), row_stride, head_stride, max_len});

  F eye(hd * hd, 0.0f);
  for (std::int64_t i = 0; i < hd; ++i) eye[i * hd + i] = 1.0f;
  std::vector<float> fc(host_linear_packed_elems(hd, hd, PackedFormat::float32));
  host_linear_pack(eye.data(), hd, hd, fc.data(), PackedFormat::float32);
  const HostPackedLinear fc_packed{fc.data(), PackedFormat::float32};
  F k_ctx(batch * row_stride, -7.0f), v_ctx(batch * row_stride, -7.0f);
  const HostKVLayer ctx{k_ctx.data(), v_ctx.data(), row_stride, head_stride, max_len};
  host_context_kv(dm, &l.w, &ctx, 1, fc_packed, hd, l.w.input_norm, x.data(), batch, t, lengths,
                  counts, cos.data(), sin.data());
  std::int64_t written = 0, untouched = 0;
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t g = 0; g < dm.kv_heads; ++g)
      for (std::int64_t s = 0; s < max_len; ++s) {
        const std::int64_t at = b * row_stride + g * head_stride + s * dm.head_dim;
        if (s >= lengths[b] && s < lengths[b] + counts[b]) {
          CHECK(max_abs_diff(k_ctx.data() + at, k_layer.data() + at, dm.head_dim) == 0.0f);
          CHECK(max_abs_diff(v_ctx.data() + at, v_layer.data() + at, dm.head_dim) == 0.0f);
          ++written;
        } else {
          for (std::int64_t i = 0; i < dm.head_dim; ++i) untouched += k_ctx[at + i] == -7.0f && v_ctx[at + i] == -7.0f;
        }
      }
  CHECK(written == dm.kv_heads * (counts[0] + counts[1]));
  CHECK(untouched == (batch * max_len - counts[0] - counts[1]) * dm.kv_heads * dm.head_dim);

  const F before = k_ctx;
  const std::int64_t too_many[2] = {3, 4}, too_long[2] = {6, 0};
  CHECK_THROWS(host_context_kv(dm, &l.w, &ctx, 1, fc_packed, hd, l.w.input_norm, x.data(), batch, t,
                               lengths, too_many, cos.data(), sin.data()),
               std::invalid_argument, "counts[1] = 4");
  CHECK_THROWS(host_context_kv(dm, &l.w, &ctx, 1, fc_packed, hd, l.w.input_norm, x.data(), batch, t,
                               too_long, counts, cos.data(), sin.data()),
               std::invalid_argument, "lengths[0] = 6 + counts[0] = 3");
  CHECK(max_abs_diff(before.data(), k_ctx.data(), batch * row_stride) == 0.0f);
}

void test_a_whole_forward_is_its_steps() {
  // host_qwen3_tokens against its steps taken one by one: gathered embedding and RoPE rows, the layers (capturing
  // layer 0), the final norm (copied into the features too) and the output head; bit for bit. A bad token id is
  // refused by name before anything is written. Then host_qwen3_verify: the same from committed lengths, with the
  // arg-max; a row past the cache refused with nothing written, a NaN logit reported.
  const HostQwen3Dims dm{32, 4, 2, 8, 48, 1e-6f};
  const std::int64_t layers = 2, batch = 2, t = 3, hd = dm.hidden, vocab = 40, table = 20;
  const Layers net(dm, layers, 300u);
  const std::vector<HostQwen3Weights>& ws = net.ws;
  Caches caches1(dm, layers, batch, 16), caches2 = caches1, caches3 = caches1;  // the steps', the verify's
  const std::vector<HostKVLayer>&c1 = caches1.layers, &c2 = caches2.layers, &c3 = caches3.layers;
  const std::int64_t layer_size = caches1.layer_size;
  F &k1 = caches1.k, &k2 = caches2.k, &k3 = caches3.k;
  std::vector<std::int64_t> all_pos(table);
  for (std::int64_t p = 0; p < table; ++p) all_pos[p] = p;
  F cos_table, sin_table;
  rope(dm, all_pos, cos_table, sin_table);
  const F embed = noise(vocab * hd, 21, 2.0f), final_norm = noise(hd, 23, 0.5f), head_w = noise(vocab * hd, 25, 0.4f);
  std::vector<float> head(host_linear_packed_elems(vocab, hd, PackedFormat::float32));
  host_linear_pack(head_w.data(), vocab, hd, head.data(), PackedFormat::float32);
  const HostQwen3Ends ends{embed.data(), vocab, cos_table.data(), sin_table.data(), table, final_norm.data(), 1e-6f,
                           {head.data(), PackedFormat::float32}, vocab};
  const std::vector<std::int64_t> tokens = {3, 17, 39, 0, 8, 8}, pos = {4, 5, 6, 1, 2, 3};
  const std::vector<std::int64_t> capture = {0, -1};
  const std::int64_t rows = batch * t, fw = 2 * hd;
  F feats(rows * fw, 0.0f), logits(rows * vocab);
  host_qwen3_tokens(dm, ws.data(), c1.data(), layers, ends, tokens.data(), batch, t, pos.data(), capture.data(), hd,
                    feats.data(), fw, logits.data());

  F h(rows * hd), cos(rows * dm.head_dim), sin(rows * dm.head_dim), feats2(rows * fw, 0.0f), normed(rows * hd),
      logits2(rows * vocab);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t i = 0; i < hd; ++i) h[r * hd + i] = embed[tokens[r] * hd + i];
    for (std::int64_t i = 0; i < dm.head_dim; ++i) {
      cos[r * dm.head_dim + i] = cos_table[pos[r] * dm.head_dim + i];
      sin[r * dm.head_dim + i] = sin_table[pos[r] * dm.head_dim + i];
    }
  }
  host_qwen3_layers(dm, ws.data(), c2.data(), layers, h.data(), batch, t, pos.data(), cos.data(), sin.data(),
                    capture.data(), feats2.data(), fw);
  host_rms_norm(h.data(), final_norm.data(), rows, hd, 1e-6f, normed.data());
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t i = 0; i < hd; ++i) feats2[r * fw + hd + i] = normed[r * hd + i];
  host_linear(normed.data(), rows, hd, head.data(), PackedFormat::float32, vocab, logits2.data());
  CHECK(max_abs_diff(logits.data(), logits2.data(), rows * vocab) == 0.0f);
  CHECK(max_abs_diff(feats.data(), feats2.data(), rows * fw) == 0.0f);
  CHECK(max_abs_diff(k1.data(), k2.data(), layers * layer_size) == 0.0f);

  const F k_before = k1;
  const std::vector<std::int64_t> bad = {3, 17, 40, 0, 8, 8}, far = {4, 5, 6, 1, 2, 20};
  CHECK_THROWS(host_qwen3_tokens(dm, ws.data(), c1.data(), layers, ends, bad.data(), batch, t, pos.data(),
                                 capture.data(), hd, feats.data(), fw, logits.data()),
               std::invalid_argument, "tokens[0, 2] = 40, expected 0..39");
  CHECK_THROWS(host_qwen3_tokens(dm, ws.data(), c1.data(), layers, ends, tokens.data(), batch, t, far.data(),
                                 capture.data(), hd, feats.data(), fw, logits.data()),
               std::invalid_argument, "positions[1, 2] = 20, expected 0..19");
  CHECK(max_abs_diff(k_before.data(), k1.data(), layers * layer_size) == 0.0f);

  // host_qwen3_verify: the same forward at positions lengths[b] + j, and the arg-max of each row of its logits.
  F feats3(rows * fw, 0.0f), logits3(rows * vocab);
  const std::vector<std::int64_t> lengths = {4, 1};
  std::vector<std::int64_t> argmax(rows, -1);
  CHECK(host_qwen3_verify(dm, ws.data(), c3.data(), layers, ends, tokens.data(), batch, t, lengths.data(),
                          capture.data(), hd, feats3.data(), fw, logits3.data(), argmax.data()));
  CHECK(max_abs_diff(logits.data(), logits3.data(), rows * vocab) == 0.0f);
  CHECK(max_abs_diff(feats.data(), feats3.data(), rows * fw) == 0.0f);
  CHECK(max_abs_diff(k2.data(), k3.data(), layers * layer_size) == 0.0f);
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* row = logits.data() + r * vocab;
    CHECK(argmax[r] == std::max_element(row, row + vocab) - row);
  }
  const F k3_before = k3;
  const std::vector<std::int64_t> past_the_cache = {4, 14};
  CHECK_THROWS(host_qwen3_verify(dm, ws.data(), c3.data(), layers, ends, tokens.data(), batch, t,
                                 past_the_cache.data(), capture.data(), hd, feats3.data(), fw, logits3.data(),
                                 argmax.data()),
               std::invalid_argument, "lengths[1] = 14 with t = 3, expected 0..13");
  CHECK(max_abs_diff(k3_before.data(), k3.data(), layers * layer_size) == 0.0f);
  F poisoned = embed;
  poisoned[17 * hd] = std::nanf("");  // token 17's embedding: its row's logits turn NaN
  const HostQwen3Ends poisoned_ends{poisoned.data(), vocab, cos_table.data(), sin_table.data(), table,
                                    final_norm.data(), 1e-6f, {head.data(), PackedFormat::float32}, vocab};
  CHECK(!host_qwen3_verify(dm, ws.data(), c3.data(), layers, poisoned_ends, tokens.data(), batch, t, lengths.data(),
                           capture.data(), hd, feats3.data(), fw, logits3.data(), argmax.data()));
}

// A block of scratch goes back to its thread when released: the next call gets it again (the smallest idle block
// that is large enough), not fresh pages; another thread has blocks of its own.
void test_scratch_is_kept_by_its_thread() {
  using dpara_rt::detail::scratch;
  float *first = nullptr, *second = nullptr;
  {
    auto a = scratch(1000);
    first = a.get();
    a[999] = 1.0f;
  }
  {
    auto again = scratch(1000);
    CHECK(again.get() == first);
    auto other = scratch(1000);  // the first is taken: a block of its own
    second = other.get();
    CHECK(second != first);
  }
  {
    auto small = scratch(10);  // an idle block large enough, not a new one
    CHECK(small.get() == first || small.get() == second);
  }
  float* elsewhere = nullptr;
  std::thread([&] { elsewhere = scratch(1000).get(); }).join();
  CHECK(elsewhere != first && elsewhere != second);  // both stay with this thread
  auto mine = scratch(1000);
  CHECK(mine.get() == first || mine.get() == second);
}

void test_a_batch_prefills_layer_scratch_is_kept_whole() {
  // A batch-16 prefill of HumanEval prompts (about 2800 rows) takes some 43 MB of blocks a layer; all of them stay
  // with the thread for its next layer and its next prefill. Under a cap of 32 MiB the largest were freed and
  // faulted in anew every layer (~20K page faults a prefill).
  using dpara_rt::detail::Scratch;
  using dpara_rt::detail::scratch;
  const std::int64_t rows = 2800;
  const std::int64_t sizes[] = {rows * 1536, rows * 768, rows * 512, rows * 256, rows * 256, rows * 256, rows * 256};
  std::thread([&] {
    std::set<float*> first;
    {
      std::vector<Scratch> held;
      for (const std::int64_t n : sizes) {
        held.push_back(scratch(n));
        first.insert(held.back().get());
      }
    }
    std::vector<Scratch> again;
    for (const std::int64_t n : sizes) {
      again.push_back(scratch(n));
      CHECK(first.count(again.back().get()) == 1);
    }
  }).join();
}

}  // namespace

int main() {
  test_scratch_is_kept_by_its_thread();
  test_a_batch_prefills_layer_scratch_is_kept_whole();
  test_a_whole_forward_is_its_steps();
  test_a_causal_block_equals_decoding_after_the_context();
  test_a_verify_gives_each_token_the_bits_of_decoding_it_alone();
  test_the_context_update_stores_what_the_layer_stores();
  return check::finish("test_host_qwen3");
}
