#pragma once
// Private to the host library's sources: the host Qwen3 layer's attention (qwen3.cpp), over a KV cache and
// over a drafter's block of rows, and the pieces both files share.
#include <cstddef>
#include <cstdint>
#include <memory>

#include "dpara_rt/host/qwen3.h"
#include "markov_head_math.h"  // F8, load8, DPARA_RT_INLINE

namespace dpara_rt::detail {

// Scratch that every use writes before it reads: no zero fill (a prefill's layer would clear megabytes), and kept
// by its thread for the next call instead of freed (a batch's prefill had taken ~5000 page faults a call as the
// allocator handed fresh pages back and forth; scratch_cache bounds what a thread keeps).
struct ScratchReturn {
  std::size_t floats;
  void operator()(float* p) const;
};
using Scratch = std::unique_ptr<float[], ScratchReturn>;
Scratch scratch(std::int64_t n);

// Sum of a[i] * b[i] in a fixed order: eight lanes, a fixed tree, then the tail.
DPARA_RT_INLINE float dot(const float* a, const float* b, std::int64_t n) {
  F8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc += load8(a + i) * load8(b + i);
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// out [rows, heads d]: token (b, j), head hh of the KV groups [g0, g1) attends to slots 0..positions[b, j] of its
// KV head in `cache` (already holding this block's K/V). Two callers with disjoint group ranges write disjoint
// outputs (a prefill splits them over two threads); each query's arithmetic is the same whoever computes it.
void attention(const HostQwen3Dims& dm, const float* qkv, std::int64_t batch, std::int64_t t,
               const std::int64_t* positions, const HostKVLayer& cache, float* out, std::int64_t g0, std::int64_t g1);

// out [rows, heads d]: row (b, j), head hh attends to slots 0..ctx_lens[b]-1 of the context and to the rows m of
// its own block with visible[j * t + m] (visible advanced by visible_stride per block), whose K/V are in qkv.
void block_attention(const HostQwen3Dims& dm, const float* qkv, std::int64_t batch, std::int64_t t,
                     const std::int64_t* ctx_lens, const std::uint8_t* visible, std::int64_t visible_stride,
                     const HostKVLayer& ctx, float* out);

}  // namespace dpara_rt::detail
