#pragma once
// One Qwen3 decoder layer of a float32 target on the host, in one call: the target's verify and decode steps
// run as 8-odd native calls instead of ~60 small torch operators per layer.
//
// Same maths as dpara_rt.models.qwen3 (transformers' Qwen3): h += o(attn(rope(q_norm(q)), rope(k_norm(k)), v))
// over the pre-norm input, then h += down(silu(gate(x)) * up(x)) over the post-attention norm. The Llama family
// is the same layer without the q / k norms (Llama, Mistral) and with a bias on q, k and v (Qwen2): the weights
// say which (HostQwen3Weights). Every step works
// on one row (token) at a time in a fixed order, and the projections are host_linear's FMA chains, so a token's
// layer output does not depend on the other tokens of the call: verifying T tokens gives each the values that
// decoding it alone would.
#include <cstdint>

#include "dpara_rt/host/linear.h"
#include "dpara_rt/types.h"

namespace dpara_rt {

struct HostQwen3Dims {
  std::int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, intermediate = 0;
  float eps = 1e-6f;
};

// A weight packed by host_linear_pack, in that format.
struct HostPackedLinear {
  const void* data = nullptr;
  PackedFormat format = PackedFormat::float32;
};

struct HostQwen3Weights {
  HostPackedLinear qkv;      // [(heads + 2 kv_heads) head_dim, hidden]: q_proj, k_proj, v_proj rows stacked
  HostPackedLinear o;        // [hidden, heads head_dim]
  HostPackedLinear gate_up;  // [2 intermediate, hidden]: gate_proj rows, then up_proj rows
  HostPackedLinear down;     // [hidden, intermediate]
  const float* input_norm = nullptr;  // [hidden]
  const float* post_norm = nullptr;   // [hidden]
  const float* q_norm = nullptr;      // [head_dim]; null with k_norm: no q / k norms (Llama, Qwen2, Mistral)
  const float* k_norm = nullptr;      // [head_dim]
  const float* qkv_bias = nullptr;    // [(heads + 2 kv_heads) head_dim] added to the qkv product, or null (none)
};

// One layer's KV cache: element (row b, kv head g, slot s, i) at k[b * row_stride + g * head_stride + s * head_dim
// + i] (likewise v), slots 0..max_len-1.
struct HostKVLayer {
  float* k = nullptr;
  float* v = nullptr;
  std::int64_t row_stride = 0, head_stride = 0, max_len = 0;
};

// h [batch * t, hidden] (row-major, updated in place) at positions [batch, t] (distinct within a row, each in
// [0, max_len)); cos / sin [batch * t, head_dim] the RoPE tables of those positions. Writes each token's K/V at
// its position of its cache row, then token (b, j) attends to slots 0..positions[b, j] of row b (the caller
// keeps the slots below a row's first position committed). std::invalid_argument names a bad extent or
// position before anything is written. One thread; scratch is allocated per call.
void host_qwen3_layer(const HostQwen3Dims& dims, const HostQwen3Weights& w, float* h, std::int64_t batch,
                      std::int64_t t, const std::int64_t* positions, const float* cos, const float* sin,
                      const HostKVLayer& cache);

// Layers 0..n_layers-1 in one call: layer i with weights[i] over caches[i], each as host_qwen3_layer (the same
// bits). capture (or null): [n_layers] columns; when capture[i] >= 0, h after layer i is copied into features
// [batch * t, features_width] (row-major) at that column (the drafter's features, without a copy per layer
// outside). Everything is checked before the first layer writes anything.
void host_qwen3_layers(const HostQwen3Dims& dims, const HostQwen3Weights* weights, const HostKVLayer* caches,
                       std::int64_t n_layers, float* h, std::int64_t batch, std::int64_t t,
                       const std::int64_t* positions, const float* cos, const float* sin,
                       const std::int64_t* capture, float* features, std::int64_t features_width);

// What a whole forward needs besides the layers (host_qwen3_tokens): the embedding table [vocab, hidden], the RoPE
// tables cos / sin [table_len, head_dim] by position, the final RMSNorm and the packed output head.
struct HostQwen3Ends {
  const float* embed = nullptr;
  std::int64_t vocab = 0;
  const float* cos_table = nullptr;
  const float* sin_table = nullptr;
  std::int64_t table_len = 0;
  const float* final_norm = nullptr;  // [hidden]
  float final_eps = 1e-6f;
  HostPackedLinear head;              // [head_vocab, hidden]
  std::int64_t head_vocab = 0;
};

// A forward from token ids to logits in one call (a verify or a decode step, where each separate call cost the
// round interpreter time right after the last round had evicted the caches): the embedding rows of tokens
// [batch, t] (each in 0..vocab-1) and the RoPE rows of positions (each below table_len), host_qwen3_layers over
// them (capture as there), the final RMSNorm of every row, copied into features at column last_capture when it is
// >= 0, and logits [batch * t, head_vocab] = that through the output head. The same bits as those steps taken one
// by one (a gathered row is a copy). Everything is checked before the first write. One thread.
void host_qwen3_tokens(const HostQwen3Dims& dims, const HostQwen3Weights* weights, const HostKVLayer* caches,
                       std::int64_t n_layers, const HostQwen3Ends& ends, const std::int64_t* tokens,
                       std::int64_t batch, std::int64_t t, const std::int64_t* positions, const std::int64_t* capture,
                       std::int64_t last_capture, float* features, std::int64_t features_width, float* logits);

// A round's verify from the rows' committed lengths, all in the core: host_qwen3_tokens over tokens [batch, t] at
// positions lengths[b] + j (each row's next t slots, within the cache's max_len), then argmax_finite_host over the
// logits into argmax_out [batch * t]. Returns whether every logit is finite (argmax_out unspecified if not). The
// caller's interpreter work per round is then one call, where positions, the arg-max and the finiteness check
// each cost it one more.
bool host_qwen3_verify(const HostQwen3Dims& dims, const HostQwen3Weights* weights, const HostKVLayer* caches,
                       std::int64_t n_layers, const HostQwen3Ends& ends, const std::int64_t* tokens,
                       std::int64_t batch, std::int64_t t, const std::int64_t* lengths, const std::int64_t* capture,
                       std::int64_t last_capture, float* features, std::int64_t features_width, float* logits,
                       std::int64_t* argmax_out);

// A drafter's backbone over blocks of rows that attend to an injected context and to each other through a
// visibility mask (a DPara boundary's spine and branches, a DSpark block): layers as host_qwen3_layer, except that
// the rows' K/V stay out of the cache. Row (b, j) attends to slots 0..ctx_lens[b]-1 of contexts[i] (layer i's
// context cache) and to the rows m of its own block with visible[b * visible_stride + j * t + m] != 0
// (visible_stride 0: one mask for every block, else t * t). The last layer's output projection and MLP run for
// rows keep_from.. of each block only (the rows before them give K/V, and nobody reads their outputs); out
// [batch * (t - keep_from), hidden] = the final RMSNorm (weight final_norm) of those rows. h [batch * t, hidden]
// holds the embedded rows and is overwritten; cos / sin [batch * t, head_dim] their RoPE tables. One thread.
void host_block_layers(const HostQwen3Dims& dims, const HostQwen3Weights* weights, const HostKVLayer* contexts,
                       std::int64_t n_layers, float* h, std::int64_t batch, std::int64_t t,
                       const std::int64_t* ctx_lens, const std::uint8_t* visible, std::int64_t visible_stride,
                       const float* cos, const float* sin, std::int64_t keep_from, const float* final_norm,
                       float* out);

// A drafter's context update (KV injection): for the first counts[b] of the t rows of each block of features
// [batch * t, feature_width], c = RMSNorm(fc(features)) (fc packed [hidden, feature_width], norm weight
// context_norm), then for every layer i its K (k-normed, rotated by cos / sin [batch * t, head_dim]) and V of c,
// the k and v rows of weights[i].qkv, stored at slots lengths[b] + j of contexts[i] (the rows' RoPE positions).
// Rows past counts[b] are read by nobody. Each value is the FMA chain and norm the layers compute, per row, so a
// row's K/V do not depend on the rows beside it. Everything is checked before the first write. A prompt's fc
// product (large enough) takes the helper thread too (host_linear_two_threads: the same bits).
void host_context_kv(const HostQwen3Dims& dims, const HostQwen3Weights* weights, const HostKVLayer* contexts,
                     std::int64_t n_layers, const HostPackedLinear& fc, std::int64_t feature_width,
                     const float* context_norm, const float* features, std::int64_t batch, std::int64_t t,
                     const std::int64_t* lengths, const std::int64_t* counts, const float* cos, const float* sin);

// out [rows, n] = the RMSNorm of x [rows, n] with weight w [n] (float32, row-major), computed as the layers
// compute their own norms: a native forward's final norm.
void host_rms_norm(const float* x, const float* w, std::int64_t rows, std::int64_t n, float eps, float* out);

}  // namespace dpara_rt
