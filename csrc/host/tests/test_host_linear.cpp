// The host linear layer: exact results on dyadic inputs (every product and sum representable), a row's result
// independent of the rows beside it, every packed format, ragged n, column ranges and the two-thread product with
// the same bits, bf16_dot's chain (run under DPARA_RT_HOST_LINEAR_TILES=narrow too: the emulation) against the
// instruction's definition, and refusals that name the value.
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "check.h"
#include "dpara_rt/host/linear.h"

using namespace dpara_rt;
using F = std::vector<float>;

namespace {

// Small multiples of 1/8: bfloat16-exact, and every FMA chain of a few hundred terms stays exact in float32.
F dyadic(std::int64_t count, std::uint32_t seed) {
  F out(count);
  for (auto& v : out) {
    seed = seed * 1664525u + 1013904223u;
    v = static_cast<float>(static_cast<int>(seed >> 27) - 16) / 8.0f;
  }
  return out;
}

constexpr PackedFormat kFormats[] = {PackedFormat::float32, PackedFormat::bfloat16, PackedFormat::bf16_dot};

std::vector<std::uint8_t> pack(const F& w, std::int64_t n, std::int64_t k, PackedFormat format) {
  std::vector<std::uint8_t> packed(host_linear_packed_elems(n, k, format) * packed_format_size(format));
  host_linear_pack(w.data(), n, k, packed.data(), format);
  return packed;
}

void test_exact_against_the_definition() {
  // Every tile height: 8-row tiles with 0..7 rows left over (wide; one or two rows left take four or two panels
  // per pass, three rows two), and 6-row blocks with 0..5 rows left over (narrow), past a 64-row block too; panel
  // counts of 1, 2, 3 and 4 (n = 1..100), so that a multi-panel pass also meets a shorter tail.
  for (PackedFormat dtype : kFormats)
    for (std::int64_t m : {1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 13, 15, 69})
      for (std::int64_t n : {1, 31, 32, 64, 77, 100}) {
        const std::int64_t k = 37;
        const F w = dyadic(n * k, 7u + n), x = dyadic(m * k, 11u);
        const auto packed = pack(w, n, k, dtype);
        F y(m * n, NAN);
        host_linear(x.data(), m, k, packed.data(), dtype, n, y.data());
        bool exact = true;
        for (std::int64_t i = 0; i < m; ++i)
          for (std::int64_t c = 0; c < n; ++c) {
            double ref = 0;
            for (std::int64_t kk = 0; kk < k; ++kk) ref += double(x[i * k + kk]) * w[c * k + kk];
            exact &= y[i * n + c] == static_cast<float>(ref);
          }
        CHECK(exact);
      }
}

void test_a_row_does_not_depend_on_its_neighbours() {
  // Inexact inputs (thirds), so a different summation order would show; quarters as weights, exact in bf16.
  const std::int64_t n = 70, k = 300;
  F w(n * k);
  for (std::int64_t i = 0; i < n * k; ++i) w[i] = static_cast<float>((i % 17) - 8) / 4.0f;
  for (PackedFormat dtype : kFormats)
    for (std::int64_t m : {2, 3, 7, 10, 21}) {
      F x(m * k);
      for (std::int64_t i = 0; i < m * k; ++i) x[i] = static_cast<float>((i * 7 % 23) - 11) / 3.0f;
      const auto packed = pack(w, n, k, dtype);
      F all(m * n), one(n);
      host_linear(x.data(), m, k, packed.data(), dtype, n, all.data());
      bool same = true;
      for (std::int64_t i = 0; i < m; ++i) {
        host_linear(x.data() + i * k, 1, k, packed.data(), dtype, n, one.data());
        same &= std::memcmp(one.data(), all.data() + i * n, sizeof(float) * n) == 0;
      }
      CHECK(same);
    }
}

void test_column_ranges_and_two_threads_give_the_same_bits() {
  // Inexact inputs as above. Column ranges on panel edges tile the product; the two-thread product (large enough
  // to use the helper: 130 x 1536 x 256, and a small one that stays on the caller) equals the one-thread one.
  for (PackedFormat dtype : kFormats)
    for (auto [m, n, k] : {std::array<std::int64_t, 3>{7, 100, 37}, {130, 1536, 256}, {130, 1000, 256}}) {
      F w(n * k), x(m * k);
      for (std::int64_t i = 0; i < n * k; ++i) w[i] = static_cast<float>((i % 17) - 8) / 4.0f;
      for (std::int64_t i = 0; i < m * k; ++i) x[i] = static_cast<float>((i * 7 % 23) - 11) / 3.0f;
      const auto packed = pack(w, n, k, dtype);
      F full(m * n), parts(m * (n + 5), NAN), two(m * n, NAN);
      host_linear(x.data(), m, k, packed.data(), dtype, n, full.data());
      const std::int64_t cut = (n / 2) / kHostLinearPanel * kHostLinearPanel;
      host_linear_columns(x.data(), m, k, packed.data(), dtype, n, cut, n, parts.data(), n + 5);  // ldy > n
      host_linear_columns(x.data(), m, k, packed.data(), dtype, n, 0, cut, parts.data(), n + 5);
      bool same = true, untouched = true;
      for (std::int64_t i = 0; i < m; ++i) {
        same &= std::memcmp(parts.data() + i * (n + 5), full.data() + i * n, sizeof(float) * n) == 0;
        for (int c = 0; c < 5; ++c) untouched &= std::isnan(parts[i * (n + 5) + n + c]);
      }
      host_linear_two_threads(x.data(), m, k, packed.data(), dtype, n, two.data());
      CHECK(same);
      CHECK(untouched);
      CHECK(std::memcmp(two.data(), full.data(), sizeof(float) * m * n) == 0);
    }
  const F w(64 * 2, 1.0f);
  const auto packed = pack(w, 64, 2, PackedFormat::float32);
  F y(64);
  CHECK_THROWS(host_linear_columns(w.data(), 1, 2, packed.data(), PackedFormat::float32, 64, 16, 64, y.data(), 64),
               std::invalid_argument, "columns [16, 64) of n = 64");
  CHECK_THROWS(host_linear_columns(w.data(), 1, 2, packed.data(), PackedFormat::float32, 64, 0, 64, y.data(), 63),
               std::invalid_argument, "ldy = 63");
}

// bfloat16 bits of f as the format rounds: to nearest even, subnormals to zero.
float bf16_round(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u = (u & 0x7f800000u) == 0 ? u & 0x80000000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

void test_bf16_dot_is_the_instructions_chain() {
  // Inexact inputs and weights (rounded to bfloat16 on the way: thirds, sevenths, a subnormal, ties), an odd k
  // (its last pair padded with 0) and ragged n: every element is the definition's chain bit for bit, on the
  // instruction or on its emulation, at every tile height.
  const std::int64_t n = 45, k = 37;
  F w(n * k);
  for (std::int64_t i = 0; i < n * k; ++i) w[i] = static_cast<float>((i * 5 % 29) - 14) / 7.0f;
  w[3] = 1e-39f;                       // a subnormal weight: zero
  w[4] = 1.0f + 1.0f / 256.0f;          // a tie, to even: 1
  w[5] = 1.0f + 3.0f / 256.0f;          // a tie, to even: 1 + 1/64
  const auto packed = pack(w, n, k, PackedFormat::bf16_dot);
  for (std::int64_t m : {1, 2, 3, 5, 8, 11}) {
    F x(m * k);
    for (std::int64_t i = 0; i < m * k; ++i) x[i] = static_cast<float>((i * 7 % 23) - 11) / 3.0f;
    F y(m * n, NAN);
    host_linear(x.data(), m, k, packed.data(), PackedFormat::bf16_dot, n, y.data());
    bool same = true;
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t c = 0; c < n; ++c) {
        float acc = 0.0f;
        for (std::int64_t j = 0; 2 * j < k; ++j) {
          const std::int64_t e = 2 * j, o = 2 * j + 1;
          if (o < k) acc = std::fma(bf16_round(x[i * k + o]), bf16_round(w[c * k + o]), acc);
          acc = std::fma(bf16_round(x[i * k + e]), bf16_round(w[c * k + e]), acc);
        }
        same &= std::memcmp(&acc, &y[i * n + c], sizeof acc) == 0;
      }
    CHECK(same);
  }
  CHECK(host_linear_packed_elems(45, 37, PackedFormat::bf16_dot) == 2 * 32 * 2 * 19);
}

void test_refusals() {
  const F w{1.0f, 1.0f / 3.0f};  // 1/3 is not a bfloat16 value
  std::vector<std::uint16_t> packed(host_linear_packed_elems(1, 2, PackedFormat::bfloat16), 7);
  CHECK_THROWS(host_linear_pack(w.data(), 1, 2, packed.data(), PackedFormat::bfloat16), std::invalid_argument,
               "weight [0, 1]");
  CHECK(packed[0] == 7);  // refused before writing
  CHECK_THROWS(host_linear_pack(w.data(), 1, 2, packed.data(), static_cast<PackedFormat>(7)), std::invalid_argument,
               "packed format 7");
  CHECK_THROWS(parse_packed_format("float16"), std::invalid_argument, "packed format 'float16', expected");
  CHECK(parse_packed_format("bf16_dot") == PackedFormat::bf16_dot);
  CHECK_THROWS(host_linear_packed_elems(0, 2, PackedFormat::float32), std::invalid_argument, "n = 0");
  float y = 0;
  CHECK_THROWS(host_linear(w.data(), -1, 2, packed.data(), PackedFormat::float32, 1, &y), std::invalid_argument,
               "m = -1");
  host_linear(w.data(), 0, 2, packed.data(), PackedFormat::float32, 1, &y);  // no rows: nothing written
  CHECK(y == 0);
}

}  // namespace

int main() {
  test_exact_against_the_definition();
  test_a_row_does_not_depend_on_its_neighbours();
  test_column_ranges_and_two_threads_give_the_same_bits();
  test_bf16_dot_is_the_instructions_chain();
  test_refusals();
  return check::finish("test_host_linear");
}
