// Host rejection-sampling verification: five requests worked by hand (dyadic values, so every sum is exact)
// across a group of four and a group of one, and argument validation that writes nothing; AR's draw
// (inverse_cdf_host) by hand too.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "check.h"
#include "dpara_rt/host/verify.h"

using namespace dpara_rt;
using I = std::vector<std::int64_t>;
using F = std::vector<float>;

// V = 4, d = 2. Request 0: t_1 = 2 has p 0.0625 vs q 0.25 and u 0.75: 0.1875 < 0.0625 fails, r = 0; residual
// max(p_0 - q_0, 0) = [0.25, 0.25, 0, 0], total 0.5, u_bonus 0.5: target 0.25 is not < cdf[0] = 0.25 (strict),
// so bonus 1. Request 1: both accepted (u q < p), w = p_2 = [0, 0, 0.75, 0.25]; u_bonus 0: target 0 is below
// cdf[0] = 0 only from index 2, the first positive weight. Request 2: t_1 = 0 rejected (0.5 * 0.25 < 0.125
// fails) and the residual of p_0 = 0.125 < q_0 = 0.25 is all 0: degenerate, w = p_0 (uniform 0.125); u_bonus
// 0.6: target 0.3 -> cdf 0.125, 0.25, 0.375 -> bonus 2. Request 3: as request 1 with u_bonus 0.9 -> target
// 0.9 -> bonus 3. Request 4: as request 0 with u_bonus 0.25 -> target 0.125 -> bonus 0.
struct HandCase {
  static constexpr int d = 2;
  static constexpr std::int64_t vocab = 4, batch = 5;
  F p, q;
  I draft{2, 0, 0, 0, 0, 3, 0, 0, 2, 0};
  F u_accept{0.75f, 0.0f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.75f, 0.0f};
  F u_bonus{0.5f, 0.0f, 0.6f, 0.9f, 0.25f};
  I r = I(batch, -1), bonus = I(batch, -1);

  HandCase() {
    const F rejecting_p{0.5f, 0.375f, 0.0625f, 0.0625f}, rejecting_q{0.25f, 0.125f, 0.25f, 0.375f};
    const F uniform(4, 0.25f), eighths(4, 0.125f), last{0, 0, 0.75f, 0.25f};
    const std::vector<std::vector<F>> p_rows{{rejecting_p, uniform, uniform}, {uniform, uniform, last},
                                             {eighths, uniform, uniform}, {uniform, uniform, last},
                                             {rejecting_p, uniform, uniform}};
    const std::vector<std::vector<F>> q_rows{{rejecting_q, uniform}, {uniform, uniform}, {uniform, uniform},
                                             {uniform, uniform}, {rejecting_q, uniform}};
    for (const auto& rows : p_rows)
      for (const F& row : rows) p.insert(p.end(), row.begin(), row.end());
    for (const auto& rows : q_rows)
      for (const F& row : rows) q.insert(q.end(), row.begin(), row.end());
  }
  void run(std::int64_t b = batch, int dd = d, std::int64_t v = vocab) {
    verify_sample_host(p.data(), q.data(), draft.data(), u_accept.data(), u_bonus.data(), b, dd, v, r.data(),
                       bonus.data());
  }
};

static void test_by_hand() {
  HandCase c;
  c.run();
  CHECK((c.r == I{0, 2, 0, 2, 0}));
  CHECK((c.bonus == I{1, 2, 2, 3, 0}));
  // Alone (a group of one), request 0 gives the same answer.
  HandCase one;
  one.run(1);
  CHECK(one.r[0] == 0 && one.bonus[0] == 1);
}

static void test_zero_and_nan_weights() {
  // After full acceptance w = max(p_d, 0): a row of zeros (and a negative) draws 0; a NaN never wins the draw,
  // and with a NaN total no running sum beats the target, so the last positive weight is drawn.
  HandCase c;
  const F zeros{0, -0.5f, 0, 0}, with_nan{0.25f, NAN, 0.25f, 0};
  std::copy(zeros.begin(), zeros.end(), c.p.begin() + (1 * 3 + 2) * 4);
  std::copy(with_nan.begin(), with_nan.end(), c.p.begin() + (3 * 3 + 2) * 4);
  c.run();
  CHECK(c.r[1] == 2 && c.bonus[1] == 0);
  CHECK(c.r[3] == 2 && c.bonus[3] == 2);
}

static void test_validation_writes_nothing() {
  HandCase c;
  const auto rejects = [&](const char* needle) {
    CHECK_THROWS(c.run(), std::invalid_argument, needle);
    CHECK((c.r == I(5, -1) && c.bonus == I(5, -1)));  // checked before anything is written
  };
  c.draft[9] = 4;
  rejects("draft[4, 1] = 4, expected a token id in 0..3 (vocab = 4)");
  c.draft[9] = -1;
  rejects("draft[4, 1] = -1");
  c.draft[9] = 0;
  c.u_accept[3] = NAN;
  rejects("u_accept[1, 1] = nan, expected a value in [0, 1)");
  c.u_accept[3] = -0.25f;
  rejects("u_accept[1, 1] = -0.25");
  c.u_accept[3] = 0.5f;
  c.u_bonus[4] = 1.0f;
  rejects("u_bonus[4] = 1, expected a value in [0, 1)");
  c.u_bonus[4] = std::nextafter(1.0f, 2.0f);
  rejects("u_bonus[4] = 1.00000012");
  c.u_bonus[4] = 0.25f;
  CHECK_THROWS(c.run(-1), std::invalid_argument, "batch = -1, expected >= 0");
  CHECK_THROWS(c.run(5, 0), std::invalid_argument, "draft length d must be in 1..32, got 0");
  CHECK_THROWS(c.run(5, 33), std::invalid_argument, "got 33");
  CHECK_THROWS(c.run(5, 2, 0), std::invalid_argument, "vocab = 0, expected >= 1");
  CHECK_THROWS(c.run(std::int64_t(1) << 40, 2, std::int64_t(1) << 40), std::invalid_argument, "overflows int64");
  CHECK_THROWS(verify_sample_host(c.p.data(), nullptr, c.draft.data(), c.u_accept.data(), c.u_bonus.data(), 5, 2, 4,
                                  c.r.data(), c.bonus.data()),
               std::invalid_argument, "q is null, expected a buffer");
  // batch 0: nothing to read or write, so null buffers are fine
  verify_sample_host(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 2, 4, nullptr, nullptr);
}

static void test_inverse_cdf_by_hand() {
  // Five rows of [0, 0.5, 0, 0.5, 0] (a group of four, then one): the target u * 1 is first exceeded at index 1
  // for u < 0.5 and at index 3 from u = 0.5 on (strictly greater), never at a zero weight. A row of zeros (and a
  // negative) draws 0; with a NaN the total is NaN, so the last positive weight is drawn.
  const F half{0, 0.5f, 0, 0.5f, 0};
  F w;
  for (int b = 0; b < 5; ++b) w.insert(w.end(), half.begin(), half.end());
  const F u{0.0f, 0.49f, 0.5f, 0.99999994f, 0.25f};
  I out(5, -1);
  inverse_cdf_host(w.data(), u.data(), 5, 5, out.data());
  CHECK((out == I{1, 1, 3, 3, 1}));
  const F odd{0, -0.5f, 0, 0, 0, /* */ 0.25f, NAN, 0.25f, 0, 0};
  I two(2, -1);
  inverse_cdf_host(odd.data(), u.data(), 2, 5, two.data());
  CHECK((two == I{0, 2}));
  // A uniform outside [0, 1) is refused by name before anything is written.
  const F bad_u{0.5f, 1.0f};
  I untouched(2, -1);
  CHECK_THROWS(inverse_cdf_host(w.data(), bad_u.data(), 2, 5, untouched.data()), std::invalid_argument,
               "u[1] = 1, expected a value in [0, 1)");
  CHECK((untouched == I{-1, -1}));
  inverse_cdf_host(nullptr, nullptr, 0, 5, nullptr);  // no rows: nothing to read or write
}

int main() {
  test_by_hand();
  test_zero_and_nan_weights();
  test_validation_writes_nothing();
  test_inverse_cdf_by_hand();
  return check::finish("test_verify");
}
