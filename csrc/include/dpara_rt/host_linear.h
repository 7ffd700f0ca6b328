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

}  // namespace dpara_rt
