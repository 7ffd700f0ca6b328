#pragma once
// Lossless rejection-sampling verification on host memory: the contract of verify_sample_reference in
// kernels/verify.py, with the same decisions bit for bit. For each request b:
//   r = number of leading positions i < d with u_accept[b, i] * q[b, i, t_i] < p[b, i, t_i]   (float32)
//   w = max(p[b, r] - q[b, r], 0) if r < d, else max(p[b, d], 0)                               (float32)
//       and p[b, r] itself when every element of that residual is <= 0 (p and q equal up to rounding)
//   bonus = the first v with w[v] > 0 whose float64 running sum of w (in index order) exceeds
//       double(u_bonus[b]) * (the whole row's running sum); if none, the last v with w[v] > 0 (0 if none).
#include <cstdint>

namespace dpara_rt {

// p: [batch, d+1, vocab], q: [batch, d, vocab] float32; draft: [batch, d] int64; u_accept: [batch, d] and
// u_bonus: [batch] float32; all contiguous, row-major. Writes r_out and bonus_out [batch].
// Every extent, token id and uniform is validated before anything is written (draft ids in 0..vocab-1,
// uniforms in [0, 1), NaN failing): std::invalid_argument names the value and what was expected.
// No shared state (per-thread scratch, grown to the largest vocabulary seen), so threads may call it at once.
void verify_sample_host(const float* p, const float* q, const std::int64_t* draft, const float* u_accept,
                        const float* u_bonus, std::int64_t batch, int d, std::int64_t vocab, std::int64_t* r_out,
                        std::int64_t* bonus_out);

// inverse_cdf of kernels/verify.py (AR's draw, the bonus draw above) on host memory, bit for bit: per row b of
// w [rows, vocab] float32 (contiguous), the first v with w[v] > 0 whose float64 running sum (in index order)
// exceeds double(u[b]) * (the row's running sum); if none, the last v with w[v] > 0 (0 if none); into out
// [rows]. Every u[b] is checked to lie in [0, 1) before anything is written (std::invalid_argument names it).
void inverse_cdf_host(const float* w, const float* u, std::int64_t rows, std::int64_t vocab, std::int64_t* out);

// Greedy verification's read of the target's logits x [rows, vocab] float32 (contiguous): per row the index of
// its largest value, the first on ties (torch.argmax's choice), into argmax_out [rows]. Returns false, leaving
// argmax_out unspecified, when any value is NaN or infinite: one pass where a finiteness check and an
// arg-max took two.
bool argmax_finite_host(const float* x, std::int64_t rows, std::int64_t vocab, std::int64_t* argmax_out);

}  // namespace dpara_rt
