#pragma once
// The host linear layer of a float32 target: y = x @ W^T over weights packed once at load.
//
// Why not torch's matmul: at verify shapes (a few rows, K and N in the hundreds) the BLAS path runs far below
// the core's FMA peak, and float32 weights of a bf16 checkpoint double the bytes every forward streams. Packed
// weights keep the checkpoint's bf16 values when they hold W exactly (widened to float32 in registers: the
// products and sums are the float32 model's), else float32.
//
// Every output element is one float32 FMA chain over k = 0..K-1 in order, whatever M is and wherever the row
// sits in x: a row's result does not depend on the rows beside it, so verifying T tokens computes each token's
// projections bit for bit as decoding it alone would.
#include <cstdint>

#include "dpara_rt/types.h"

namespace dpara_rt {

// Output columns per packed panel: the packed weight is [ceil(N / kHostLinearPanel)][K][kHostLinearPanel],
// the last panel padded with zeros. A bfloat16 panel row interleaves each group of 16 columns (column j beside
// column j + 8) so that one load gives two float vectors; a float32 one keeps them in order.
constexpr std::int64_t kHostLinearPanel = 32;

// Elements of the packed weight for an n x k layer (n output features, k input features).
std::int64_t host_linear_packed_elems(std::int64_t n, std::int64_t k);

// Packs w [n, k] (float32, row-major: torch's Linear.weight) into `packed` (host_linear_packed_elems(n, k)
// elements of packed_dtype: float32, or bfloat16 when every weight is exactly a bfloat16 value).
// std::invalid_argument names a bad extent or dtype, or the first weight bfloat16 would round, before any write.
void host_linear_pack(const float* w, std::int64_t n, std::int64_t k, void* packed, DType packed_dtype);

// y [m, n] = x [m, k] @ W^T, x and y float32 row-major (x rows k apart, y rows n apart); `packed` from
// host_linear_pack with the same n, k and dtype. One thread; no allocation; m = 0 writes nothing.
void host_linear(const float* x, std::int64_t m, std::int64_t k, const void* packed, DType packed_dtype,
                 std::int64_t n, float* y);

// Output columns [col_begin, col_end) of the same product into y, whose rows are ldy >= n floats apart (y points
// at column 0); nothing else of y is written. Both ends on a panel edge: multiples of kHostLinearPanel, or n.
// Each element is the FMA chain host_linear computes, so callers splitting the columns produce its bits.
void host_linear_columns(const float* x, std::int64_t m, std::int64_t k, const void* packed, DType packed_dtype,
                         std::int64_t n, std::int64_t col_begin, std::int64_t col_end, float* y, std::int64_t ldy);

// host_linear over two threads, for products large enough to pay for the hand-off (a prompt's prefill): the
// caller projects the first half of the panels and a helper thread of the core the rest. The helper runs on the
// process's cores other than those of the thread that first called this (the target lane's), where any are left
// (a drafter worker sleeps through a prefill), else on any of them; it is named "dpara_rt-helper". The same
// bits as host_linear. Below the size, with the helper busy (another caller), from a thread held to the helper's
// one core, on a single-core machine or with DPARA_RT_HOST_THREADS=1 in the environment, the caller computes
// everything itself. Callers: a prompt's prefill and its absorb into a drafter's context.
void host_linear_two_threads(const float* x, std::int64_t m, std::int64_t k, const void* packed,
                             DType packed_dtype, std::int64_t n, float* y);

}  // namespace dpara_rt
