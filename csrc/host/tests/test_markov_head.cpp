// Host Markov head: Philox known answers, greedy steps by hand (every boundary dtype, ties), an exact
// integer case across vocabulary tiles against a naive walk, sampling invariants, a sampled draft alone
// (pruned) and its q from markov_q_host against the full call, the bias cache, the hidden ring's head through the output head, argument validation.
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include "check.h"
#include "dpara_rt/host/linear.h"
#include "dpara_rt/host/markov_head.h"

using namespace dpara_rt;
using I = std::vector<std::int64_t>;
using F = std::vector<float>;

static void test_philox_known_answers() {
  // Values of kernels/_rng.py's philox4x32 (the first is Random123's known answer at counter 0, key 0).
  CHECK(philox4x32_10(0, 0, 0) == 0x6627e8d5u);
  CHECK(philox4x32_10(1, 0, 0) == 0xf8e4cca4u);
  CHECK(philox4x32_10(12345, 7, 42) == 0xeee9fa9eu);
  CHECK(philox4x32_10(0xFFFFFFFFu, (std::uint64_t(1) << 32) + 5, (std::uint64_t(1) << 40) + 3) == 0x390070dfu);
  CHECK(philox4x32_10(77, ~std::uint64_t(0), ~std::uint64_t(0)) == 0x1c20a36cu);
  CHECK(philox4x32_10(3, std::uint64_t(1) << 63, 0xDEADBEEFu) == 0x01e192fau);
}

// V = 3, R = 1, d = 2, one request reading acceptance row r = 1 of 2, bonus 0. W1 = [1, 0, 2]^T,
// W2 = [0, 1, -1]. Step 1: z = [0, 0, 0.5] + 1 * W2 = [0, 1, -0.5] -> 1. Step 2: W1[1] = 0, so
// z = [1, 3, 3] -> 1 (tie: lowest index). Row r = 0 holds decoys that would win if it were read.
struct HandCase {
  F w1{1, 0, 2}, w2{0, 1, -1};
  I r{1}, bonus{0}, draft = I(2, -1);
  void run(const void* boundary, DType dtype) {
    markov_head_host(boundary, dtype, 1, 2, 2, 3, 6, r.data(), bonus.data(), w1.data(), w2.data(), 1, 0.0, 0, 0,
                     draft.data(), nullptr);
  }
};

static void test_greedy_by_hand_every_dtype() {
  HandCase c;
  const F f32{9, 0, 0, 0, 0, 9, 0, 0, 0.5f, 1, 3, 3};
  c.run(f32.data(), DType::float32);
  CHECK((c.draft == I{1, 1}));
  // the same values as bfloat16 (top half of the float32 bits) and float16
  const std::vector<std::uint16_t> bf16{0x4110, 0, 0, 0, 0, 0x4110, 0, 0, 0x3F00, 0x3F80, 0x4040, 0x4040};
  c.draft = I(2, -1);
  c.run(bf16.data(), DType::bfloat16);
  CHECK((c.draft == I{1, 1}));
  const std::vector<std::uint16_t> f16{0x4880, 0, 0, 0, 0, 0x4880, 0, 0, 0x3800, 0x3C00, 0x4200, 0x4200};
  c.draft = I(2, -1);
  c.run(f16.data(), DType::float16);
  CHECK((c.draft == I{1, 1}));
}

static void test_float16_subnormals_and_signs() {
  // with W = 0 the draft is the arg-max of the boundary row: -2, 2^-24 (the smallest subnormal), -0
  const std::vector<std::uint16_t> row{0xC000, 0x0001, 0x8000};
  const F w(3, 0.0f);
  I r{0}, bonus{2}, draft(1, -1);
  markov_head_host(row.data(), DType::float16, 1, 1, 1, 3, 3, r.data(), bonus.data(), w.data(), w.data(), 1, 0.0, 0, 0,
                   draft.data(), nullptr);
  CHECK(draft[0] == 1);
}

// Small LCG: deterministic data without <random>'s implementation-defined distributions.
static std::int64_t lcg(std::uint64_t& s, int n) {
  s = s * 6364136223846793005ull + 1442695040888963407ull;
  return std::int64_t((s >> 33) % std::uint64_t(n));
}

static void test_integer_case_matches_naive_walk() {
  // Integer data is exact in float32, so the tiled kernel must equal a naive walk bit for bit, ties included
  // (values 0..2 tie often); V spans three tiles and a ragged end, R is not a multiple of 4.
  const std::int64_t batch = 3, n_rows = 2, vocab = 2500, rank = 7;
  const int d = 4;
  std::uint64_t s = 1;
  F boundary(std::size_t(batch * n_rows * d * vocab)), w1(std::size_t(vocab * rank)), w2(std::size_t(rank * vocab));
  for (auto& x : boundary) x = float(lcg(s, 3));
  for (auto& x : w1) x = float(lcg(s, 3) - 1);
  for (auto& x : w2) x = float(lcg(s, 3) - 1);
  I r{1, 0, 1}, bonus{5, 2499, 1024}, draft(std::size_t(batch * d));
  markov_head_host(boundary.data(), DType::float32, batch, n_rows, d, vocab, d * vocab, r.data(), bonus.data(),
                   w1.data(), w2.data(), rank, 0.0, 0, 0, draft.data(), nullptr);
  for (std::int64_t b = 0; b < batch; ++b) {
    std::int64_t x = bonus[std::size_t(b)];
    for (int j = 0; j < d; ++j) {
      const float* row = boundary.data() + ((b * n_rows + r[std::size_t(b)]) * d + j) * vocab;
      std::int64_t best = 0;
      float best_z = -std::numeric_limits<float>::infinity();
      for (std::int64_t v = 0; v < vocab; ++v) {
        float z = 0;
        for (std::int64_t k = 0; k < rank; ++k) z += w1[std::size_t(x * rank + k)] * w2[std::size_t(k * vocab + v)];
        z += row[v];
        if (z > best_z) best_z = z, best = v;
      }
      x = best;
      CHECK(draft[std::size_t(b * d + j)] == x);
    }
  }
}

static void test_sampling_invariants() {
  // One dominant logit per step is always drawn (Gumbel noise of this generator lies in (-2.8, 16.7)); q is
  // a distribution concentrated on it, and repeated calls with the same seed and offset agree.
  const std::int64_t vocab = 37;
  const int d = 3;
  F boundary(std::size_t(d * vocab), 0.0f), w1(std::size_t(vocab), 0.0f), w2(std::size_t(vocab), 0.0f);
  const std::int64_t hot[] = {4, 36, 0};
  for (int j = 0; j < d; ++j) boundary[std::size_t(j * vocab + hot[j])] = 100.0f;
  I r{0}, bonus{7}, draft(3), again(3);
  F q(std::size_t(d * vocab)), q2(q.size());
  markov_head_host(boundary.data(), DType::float32, 1, 1, d, vocab, d * vocab, r.data(), bonus.data(), w1.data(),
                   w2.data(), 1, 0.5, 123, 9, draft.data(), q.data());
  CHECK((draft == I{4, 36, 0}));
  for (int j = 0; j < d; ++j) {
    double sum = 0;
    for (std::int64_t v = 0; v < vocab; ++v) sum += q[std::size_t(j * vocab + v)];
    CHECK(std::fabs(sum - 1.0) < 1e-5);
    CHECK(q[std::size_t(j * vocab + hot[j])] > 0.999f);
  }
  markov_head_host(boundary.data(), DType::float32, 1, 1, d, vocab, d * vocab, r.data(), bonus.data(), w1.data(),
                   w2.data(), 1, 0.5, 123, 9, again.data(), q2.data());
  CHECK(again == draft && q2 == q);
}

static void test_draft_alone_then_q_equals_the_full_call() {
  // A sampling call with its noise drawn ahead may draft alone, pruned by the Cauchy-Schwarz bound, and leave
  // q to markov_q_host: the same draft and the same q bits as one full call, for one row and a block of rows.
  const std::int64_t vocab = 1500, rank = 12, n_rows = 3;
  const int d = 4;
  std::uint64_t s = 99;
  auto uniform = [&] { return float(lcg(s, 1 << 20)) / float(1 << 20) - 0.5f; };
  F w1(static_cast<std::size_t>(vocab * rank)), w2(w1.size()), w2t(w1.size()), norms(static_cast<std::size_t>(vocab));
  for (auto& w : w1) w = 2.0f * uniform();
  for (auto& w : w2) w = uniform();
  for (std::int64_t v = 0; v < vocab; ++v) {
    double sq = 0;
    for (std::int64_t k = 0; k < rank; ++k) {
      w2t[std::size_t(v * rank + k)] = w2[std::size_t(k * vocab + v)];
      sq += double(w2[std::size_t(k * vocab + v)]) * w2[std::size_t(k * vocab + v)];
    }
    norms[std::size_t(v)] = std::nextafter(float(std::sqrt(sq)), std::numeric_limits<float>::infinity());
  }
  for (std::int64_t batch : {1, 3}) {
    F boundary(std::size_t(batch * n_rows * d * vocab));
    for (auto& z : boundary) z = 8.0f * uniform();
    I r(static_cast<std::size_t>(batch)), bonus(r.size());
    for (std::int64_t b = 0; b < batch; ++b) r[std::size_t(b)] = b % n_rows, bonus[std::size_t(b)] = 17 * b + 3;
    for (double t : {1.0, 0.6}) {
      F noise(std::size_t(batch * d * vocab)), q(noise.size()), q_later(noise.size(), -1.0f);
      gumbel_noise_host(noise.data(), batch, d, vocab, 5, 11);
      I full(std::size_t(batch * d)), alone(full.size(), -1);
      markov_head_host(boundary.data(), DType::float32, batch, n_rows, d, vocab, d * vocab, r.data(), bonus.data(),
                       w1.data(), w2.data(), rank, t, 5, 11, full.data(), q.data(), nullptr, DType::float32,
                       nullptr, noise.data());
      markov_head_host(boundary.data(), DType::float32, batch, n_rows, d, vocab, d * vocab, r.data(), bonus.data(),
                       w1.data(), w2.data(), rank, t, 5, 11, alone.data(), nullptr, w2t.data(), DType::float32,
                       norms.data(), noise.data());
      CHECK(alone == full);
      markov_q_host(boundary.data(), DType::float32, batch, n_rows, d, vocab, d * vocab, r.data(), bonus.data(),
                    full.data(), w1.data(), w2.data(), rank, t, q_later.data());
      CHECK(q_later == q);
    }
    I bad(std::size_t(batch * d), 0);
    bad.back() = vocab;
    F q(std::size_t(batch * d * vocab));
    CHECK_THROWS(markov_q_host(boundary.data(), DType::float32, batch, n_rows, d, vocab, d * vocab, r.data(),
                               bonus.data(), bad.data(), w1.data(), w2.data(), rank, 1.0, q.data()),
                 std::invalid_argument, "expected 0..1499");
    CHECK_THROWS(markov_q_host(boundary.data(), DType::float32, batch, n_rows, d, vocab, d * vocab, r.data(),
                               bonus.data(), bad.data(), w1.data(), w2.data(), rank, 0.0, q.data()),
                 std::invalid_argument, "temperature = 0, expected > 0");
  }
}

static void test_bias_cache() {
  // The hand case through a cache: the same draft, the second call from kept rows only.
  HandCase c;
  const F f32{9, 0, 0, 0, 0, 9, 0, 0, 0.5f, 1, 3, 3};
  MarkovBiasCache cache(c.w1.data(), c.w2.data(), 3, 1, 2);
  for (int call = 0; call < 2; ++call) {
    c.draft = I(2, -1);
    markov_head_host(f32.data(), DType::float32, 1, 2, 2, 3, 6, c.r.data(), c.bonus.data(), c.w1.data(),
                     c.w2.data(), 1, 0.0, 0, 0, c.draft.data(), nullptr, nullptr, DType::float32, nullptr, nullptr,
                     &cache);
    CHECK((c.draft == I{1, 1}));
  }
  CHECK(cache.misses() == 2 && cache.hits() == 2);  // tokens 0 and 1, each computed once
  // Least recently used first, never a row the current step holds.
  MarkovBiasCache two(c.w1.data(), c.w2.data(), 3, 1, 2);
  two.begin_step();
  const float* row0 = two.claim(0);
  two.claim(1);
  CHECK_THROWS(two.claim(2), std::invalid_argument, "all 2 rows are in use by this step");
  two.begin_step();
  CHECK(two.find(0) == row0);  // token 0 used now: token 1's row is the one replaced
  CHECK(two.claim(2) != row0 && two.find(1) == nullptr && two.find(2) != nullptr);
  // A cache belongs to one pair of factors; a bad capacity is named.
  const F other_w1 = c.w1;
  CHECK_THROWS(markov_head_host(f32.data(), DType::float32, 1, 2, 2, 3, 6, c.r.data(), c.bonus.data(),
                                other_w1.data(), c.w2.data(), 1, 0.0, 0, 0, c.draft.data(), nullptr, nullptr,
                                DType::float32, nullptr, nullptr, &cache),
               std::invalid_argument, "one cache per pair of factors");
  CHECK_THROWS(MarkovBiasCache(c.w1.data(), c.w2.data(), 3, 1, 0), std::invalid_argument, "capacity = 0 rows");
}

static void test_hidden_branch_through_the_output_head() {
  // V = H = 3 and an identity output head: branch r's hidden states are its logits, so the hidden head drafts what
  // the head drafts from those rows (the hand case's boundary: row r = 1 of 2).
  HandCase c;
  const F hidden{9, 0, 0, 0, 0, 9, 0, 0, 0.5f, 1, 3, 3};
  const F eye{1, 0, 0, 0, 1, 0, 0, 0, 1};
  std::vector<float> packed(std::size_t(host_linear_packed_elems(3, 3, PackedFormat::float32)));
  host_linear_pack(eye.data(), 3, 3, packed.data(), PackedFormat::float32);
  F logits(6, -1.0f);
  I draft(2, -1);
  markov_head_hidden_host(hidden.data(), 1, 2, 2, 3, c.r.data(), packed.data(), PackedFormat::float32, 3, logits.data(),
                          c.bonus.data(), c.w1.data(), c.w2.data(), 1, 0.0, 0, 0, draft.data(), nullptr);
  CHECK((logits == F{0, 0, 0.5f, 1, 3, 3}));
  CHECK((draft == I{1, 1}));
  I bad_r{2};
  CHECK_THROWS(markov_head_hidden_host(hidden.data(), 1, 2, 2, 3, bad_r.data(), packed.data(), PackedFormat::float32, 3,
                                       logits.data(), c.bonus.data(), c.w1.data(), c.w2.data(), 1, 0.0, 0, 0,
                                       draft.data(), nullptr),
               std::invalid_argument, "r[0] = 2, expected 0..1");
}

static void test_validation() {
  HandCase c;
  const F b(12, 0.0f);
  F q(6);
  auto call = [&](std::int64_t batch, std::int64_t n_rows, int d, std::int64_t vocab, std::int64_t stride,
                  std::int64_t rank, double t, float* q_out, DType dt = DType::float32) {
    markov_head_host(b.data(), dt, batch, n_rows, d, vocab, stride, c.r.data(), c.bonus.data(), c.w1.data(),
                     c.w2.data(), rank, t, 0, 0, c.draft.data(), q_out);
  };
  CHECK_THROWS(call(-1, 2, 2, 3, 6, 1, 0.0, nullptr), std::invalid_argument, "batch = -1, expected >= 0");
  CHECK_THROWS(call(1, 0, 2, 3, 6, 1, 0.0, nullptr), std::invalid_argument, "n_rows = 0");
  CHECK_THROWS(call(1, 2, 0, 3, 6, 1, 0.0, nullptr), std::invalid_argument, "got 0");
  CHECK_THROWS(call(1, 2, 33, 3, 99, 1, 0.0, nullptr), std::invalid_argument, "must be in 1..32, got 33");
  CHECK_THROWS(call(1, 2, 2, 0, 6, 1, 0.0, nullptr), std::invalid_argument, "vocab = 0");
  CHECK_THROWS(call(1, 2, 2, 3, 6, 0, 0.0, nullptr), std::invalid_argument, "rank = 0");
  CHECK_THROWS(call(1, 2, 2, 3, 5, 1, 0.0, nullptr), std::invalid_argument, "row_stride = 5, expected >= d * vocab = 6");
  CHECK_THROWS(call(1, 2, 2, 3, 6, 1, 0.0, nullptr, DType::int32), std::invalid_argument, "boundary dtype int32");
  CHECK_THROWS(call(1, 2, 2, 3, std::int64_t(1) << 62, 1, 0.0, nullptr), std::invalid_argument, "overflows");
  CHECK_THROWS(call(1, 2, 2, 3, 6, 1, -0.5, nullptr), std::invalid_argument, "temperature = -0.5");
  CHECK_THROWS(call(1, 2, 2, 3, 6, 1, std::nan(""), nullptr), std::invalid_argument, "temperature = nan");
  CHECK_THROWS(call(1, 2, 2, 3, 6, 1, 1e-300, q.data()), std::invalid_argument, "1/temperature");
  CHECK_THROWS(call(1, 2, 2, 3, 6, 1, 1.0, nullptr), std::invalid_argument, "q_out is null");  // and no noise
  CHECK_THROWS(call(1, 2, 2, 3, 6, 1, 0.0, q.data()), std::invalid_argument, "q_out is given with temperature 0");
  // 2^20 requests * 32 * 8192 logits: more than the 2^32 counters (nothing is read: validation fails first)
  CHECK_THROWS(call(1 << 20, 1, 32, 8192, 32 * 8192, 1, 1.0, q.data()), std::invalid_argument, "expected <= 2^32");
  c.r = {2};
  CHECK_THROWS(call(1, 2, 2, 3, 6, 1, 0.0, nullptr), std::invalid_argument, "r[0] = 2, expected 0..1");
  c.r = {1};
  c.bonus = {-1};
  CHECK_THROWS(call(1, 2, 2, 3, 6, 1, 0.0, nullptr), std::invalid_argument, "bonus[0] = -1, expected 0..2");
  c.bonus = {0};
  CHECK_THROWS(markov_head_host(nullptr, DType::float32, 1, 2, 2, 3, 6, c.r.data(), c.bonus.data(), c.w1.data(),
                                c.w2.data(), 1, 0.0, 0, 0, c.draft.data(), nullptr),
               std::invalid_argument, "boundary is null");
  // batch 0: nothing to read or write, so null buffers are fine
  markov_head_host(nullptr, DType::float32, 0, 2, 2, 3, 6, nullptr, nullptr, nullptr, nullptr, 1, 0.0, 0, 0, nullptr,
                   nullptr);
}

int main() {
  test_philox_known_answers();
  test_greedy_by_hand_every_dtype();
  test_float16_subnormals_and_signs();
  test_integer_case_matches_naive_walk();
  test_sampling_invariants();
  test_draft_alone_then_q_equals_the_full_call();
  test_bias_cache();
  test_hidden_branch_through_the_output_head();
  test_validation();
  return check::finish("test_markov_head");
}
