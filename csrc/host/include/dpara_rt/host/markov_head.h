#pragma once
// The host Markov head: the d cheap sequential steps that turn boundary logits into the next draft, for
// CPU memory. Same contract as markov_head_reference in kernels/markov_head.py (and bit-identical random
// bits to the Triton kernel). For each request b: x_0 = bonus[b], and for j = 1..d
//   z_j = float(boundary[b, r[b], j-1, :]) + W1[x_{j-1}, :] @ W2      (fp32 accumulation)
//   greedy (temperature 0): x_j = argmax z_j                           (ties -> lowest index)
//   sampling (T > 0):       z_j *= float32(1/T); q[b, j-1] = softmax(z_j); x_j = argmax(z_j + g)
// where g[v] = -log(-log(u)), u = ((bits >> 9) * 2 + 1) * 2^-24 and bits = philox4x32_10(
// (b*d + j-1)*V + v, offset, seed): Gumbel-max, i.e. a draw from q[b, j-1]. One difference: a NaN logit
// is never drafted (torch.argmax would pick the first NaN).
#include <cstdint>

#include "dpara_rt/host/linear.h"
#include "dpara_rt/host/markov_bias_cache.h"
#include "dpara_rt/types.h"

namespace dpara_rt {

// First output word of Philox4x32-10 at counter (counter, offset_lo, offset_hi, 0) under the key
// (seed_lo, seed_hi): the generator behind tl.philox and kernels/_rng.py's philox4x32.
std::uint32_t philox4x32_10(std::uint32_t counter, std::uint64_t offset, std::uint64_t seed);

// boundary: rows ring[b][r] of d x vocab elements (contiguous), row (b, r) starting at element
//   (b * n_rows + r) * row_stride; dtype float32, bfloat16 or float16. row_stride >= d * vocab
//   (d * vocab for a contiguous [batch, n_rows, d, vocab] tensor).
// r, bonus: [batch]; w1: [vocab, rank] and w2: [rank, vocab] float32, row-major.
// temperature: 0 = greedy; > 0 samples with the Philox stream (seed, offset) and writes q_out
//   [batch, d, vocab] (must be null when greedy, non-null when sampling). draft_out: [batch, d].
// Every extent and index is validated before anything is written: std::invalid_argument names the value
// and what was expected. Not thread-hostile: no shared state, one scratch allocation per call.
// (temperature is a double so that float32(1/T) rounds exactly as the Python side does.)
// w2t [vocab, rank] (W2 transposed; float32, or bfloat16 when that holds W2 exactly) and w2_norms [vocab]
// (w2_norms[v] >= |W2[:, v]|, rounded up), both given or both null: greedy steps then compute the exact value
// only for the tokens that the bound |W1[x] @ W2[:, v]| <= |W1[x]| |W2[:, v]| leaves in reach of the arg-max.
// Same drafts either way. noise (sampling only, or null): [batch, d, vocab] from gumbel_noise_host with the
// same seed and offset, used instead of drawing it here. Sampling with noise and q_out null drafts alone (pruned
// by the same bound when w2t / w2_norms are given); markov_q_host then gives that draft's q.
// cache (or null): bias rows of this W1 / W2 kept across calls (markov_bias_cache.h); a step whose token it holds
// adds the stored row, and the others fill it (the bound is not used then). Same drafts and q either way. A
// cache built for other factors is an error; one with fewer rows than min(batch, 32) is not used.
void markov_head_host(const void* boundary, DType boundary_dtype, std::int64_t batch, std::int64_t n_rows, int d,
                      std::int64_t vocab, std::int64_t row_stride, const std::int64_t* r, const std::int64_t* bonus,
                      const float* w1, const float* w2, std::int64_t rank, double temperature, std::uint64_t seed,
                      std::uint64_t offset, std::int64_t* draft_out, float* q_out, const void* w2t = nullptr,
                      DType w2t_dtype = DType::float32, const float* w2_norms = nullptr,
                      const float* noise = nullptr, MarkovBiasCache* cache = nullptr);

// The hidden ring's head in one call: branch r[b]'s d hidden states (hidden: [batch, n_rows, d, hidden_dim] float32,
// contiguous) through the output head (head_packed: host_linear_pack of its [vocab, hidden_dim] weight) into
// logits [batch, d, vocab] float32, then markov_head_host over those logits (one row per request) with the
// remaining arguments as there. The same bits as the projection and the head called one after the other.
void markov_head_hidden_host(const float* hidden, std::int64_t batch, std::int64_t n_rows, int d,
                             std::int64_t hidden_dim, const std::int64_t* r, const void* head_packed,
                             PackedFormat head_format, std::int64_t vocab, float* logits, const std::int64_t* bonus,
                             const float* w1, const float* w2, std::int64_t rank, double temperature,
                             std::uint64_t seed, std::uint64_t offset, std::int64_t* draft_out, float* q_out,
                             const void* w2t = nullptr, DType w2t_dtype = DType::float32,
                             const float* w2_norms = nullptr, const float* noise = nullptr,
                             MarkovBiasCache* cache = nullptr);

// q_out [batch, d, vocab] of the sampling markov_head_host call (same boundary, r, bonus, W1, W2, temperature)
// that drafted `draft` [batch, d]: bit for bit what it would have written, computed from the given draft, so
// the d steps no longer wait on each other's draws (a DPara drafter computes it beside verification).
void markov_q_host(const void* boundary, DType boundary_dtype, std::int64_t batch, std::int64_t n_rows, int d,
                   std::int64_t vocab, std::int64_t row_stride, const std::int64_t* r, const std::int64_t* bonus,
                   const std::int64_t* draft, const float* w1, const float* w2, std::int64_t rank,
                   double temperature, float* q_out, MarkovBiasCache* cache = nullptr);

// The Gumbel noise a sampling markov_head_host call with (batch, d, vocab, seed, offset) draws, into out
// [batch, d, vocab] float32. Passed back to that call as `noise`, the draw is the same and leaves the critical
// path: the noise depends on the call's counters only, so a DPara drafter draws it beside verification.
void gumbel_noise_host(float* out, std::int64_t batch, int d, std::int64_t vocab, std::uint64_t seed,
                       std::uint64_t offset);

// Computes ahead of time the bias rows W1[x] @ W2 of tokens[0..n) that `cache` does not hold (each token in
// [0, vocab)), with a step's arithmetic, so that the steps which later start from them find the bits they would
// compute. A cache of capacity >= vocab filled with every token never computes a row during a decode (at V =
// 8192 a row computed on a step's path took about 175 us right after a verify). With fewer rows than tokens,
// the last ones are kept (least recently used replaced). Counts neither hits nor misses.
void markov_bias_fill(MarkovBiasCache& cache, const std::int64_t* tokens, std::int64_t n);

}  // namespace dpara_rt
