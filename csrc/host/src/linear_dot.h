#pragma once
// The bf16_dot format of the host linear layer (dpara_rt/host/linear.h): its packing and its product, private to
// linear.cpp, which checks the arguments and dispatches here.
#include <cstdint>

namespace dpara_rt::detail {

// Pairs along k: a panel row of the bf16_dot format holds input features 2j and 2j + 1 of its 32 columns.
constexpr std::int64_t dot_pairs(std::int64_t k) { return (k + 1) / 2; }

// w [n, k] float32 -> packed [ceil(n / 32)][dot_pairs(k)][32][2] bfloat16 (rounded to nearest even, subnormals
// to zero, an odd k's last pair and the last panel's columns past n zero).
void pack_bf16_dot(const float* w, std::int64_t n, std::int64_t k, std::uint16_t* packed);

// Panels [p0, p1) of y = x @ W^T (y rows ldy apart, pointing at column 0) over a bf16_dot packed W.
void linear_bf16_dot(const float* x, std::int64_t m, std::int64_t k, const std::uint16_t* packed, std::int64_t n,
                     std::int64_t p0, std::int64_t p1, float* y, std::int64_t ldy);

// Whether the CPU's AVX512-BF16 dot product computes them (else an emulation with the same bits).
bool bf16_dot_native();

}  // namespace dpara_rt::detail
