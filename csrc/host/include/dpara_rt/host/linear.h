#pragma once
// The host linear layer: y = x @ W^T over weights packed once at load.
//
// Why not torch's matmul: at verify shapes (a few rows, K and N in the hundreds) the BLAS path runs far below
// the core's FMA peak, and float32 weights of a bf16 checkpoint double the bytes every forward streams.
//
// Every output element is one chain over k = 0..K-1 in order, whatever M is and wherever the row sits in x: a
// row's result does not depend on the rows beside it, so verifying T tokens computes each token's projections
// bit for bit as decoding it alone would.
#include <cstddef>
#include <cstdint>
#include <string>

namespace dpara_rt {

// A packed weight's format, which is also the arithmetic its products get.
//   float32:  float32 panels; each element a float32 FMA chain (the float32 model's products and sums).
//   bfloat16: the same chains over weights that are bfloat16 values, kept as bfloat16 (half the bytes) and
//             widened exactly in registers.
//   bf16_dot: weights and x rounded to bfloat16 (to nearest even; subnormals to zero), each chain adding two
//             products a step, x[2j+1] w[2j+1] and then x[2j] w[2j], each an FMA into a float32 sum: AVX512-BF16's
//             dot product (twice the float32 FMA rate), and the same bits emulated where the CPU lacks it (but
//             for sums that fall below float32's normal range, which it flushes to zero). A bf16 model's
//             arithmetic rather than the float32 one's.
enum class PackedFormat : std::uint8_t { float32, bfloat16, bf16_dot };

// "float32" | "bfloat16" | "bf16_dot"; anything else -> std::invalid_argument naming it and the accepted names.
PackedFormat parse_packed_format(const std::string& name);
const char* packed_format_name(PackedFormat format);
std::size_t packed_format_size(PackedFormat format);  // bytes per packed element

// Whether bf16_dot products run on the CPU's own dot-product instruction (AVX512-BF16) here, rather than
// emulated (DPARA_RT_HOST_LINEAR_TILES=narrow in the environment emulates them everywhere).
bool host_linear_bf16_dot_native();

// Output columns per packed panel: the packed weight is [ceil(N / kHostLinearPanel)][K][kHostLinearPanel]
// (bf16_dot: [..][ceil(K / 2)][kHostLinearPanel][2], the pairs along k side by side), the last panel padded with
// zeros. A bfloat16 panel row interleaves each group of 16 columns (column j beside column j + 8) so that one
// load gives two float vectors; a float32 one keeps them in order.
constexpr std::int64_t kHostLinearPanel = 32;

// Elements of the packed weight for an n x k layer (n output features, k input features) in this format.
std::int64_t host_linear_packed_elems(std::int64_t n, std::int64_t k, PackedFormat format);

// Packs w [n, k] (float32, row-major: torch's Linear.weight) into `packed` (host_linear_packed_elems(n, k, format)
// elements of packed_format_size(format) bytes). bfloat16 requires every weight to be a bfloat16 value (else
// std::invalid_argument names the first, before any write); bf16_dot rounds them. Bad extents are refused too.
void host_linear_pack(const float* w, std::int64_t n, std::int64_t k, void* packed, PackedFormat format);

// y [m, n] = x [m, k] @ W^T, x and y float32 row-major (x rows k apart, y rows n apart); `packed` from
// host_linear_pack with the same n, k and format. One thread; m = 0 writes nothing.
void host_linear(const float* x, std::int64_t m, std::int64_t k, const void* packed, PackedFormat format,
                 std::int64_t n, float* y);

// Output columns [col_begin, col_end) of the same product into y, whose rows are ldy >= n floats apart (y points
// at column 0); nothing else of y is written. Both ends on a panel edge: multiples of kHostLinearPanel, or n.
// Each element is the chain host_linear computes, so callers splitting the columns produce its bits.
void host_linear_columns(const float* x, std::int64_t m, std::int64_t k, const void* packed, PackedFormat format,
                         std::int64_t n, std::int64_t col_begin, std::int64_t col_end, float* y, std::int64_t ldy);

// host_linear over two threads, for products large enough to pay for the hand-off (a prompt's prefill): the
// caller projects the first half of the panels and a helper thread of the core the rest. The helper runs on the
// process's cores other than those of the thread that first called this (the target lane's), where any are left
// (a drafter worker sleeps through a prefill), else on any of them; it is named "dpara_rt-helper". The same
// bits as host_linear. Below the size, with the helper busy (another caller), from a thread held to the helper's
// one core, on a single-core machine or with DPARA_RT_HOST_THREADS=1 in the environment, the caller computes
// everything itself. Callers: a prompt's prefill and its absorb into a drafter's context.
void host_linear_two_threads(const float* x, std::int64_t m, std::int64_t k, const void* packed,
                             PackedFormat format, std::int64_t n, float* y);

}  // namespace dpara_rt
