// The hidden ring's head: branch r's hidden states through the output head, then the Markov head, in one call.
#include <cstring>
#include <utility>
#include <vector>

#include "dpara_rt/host/linear.h"
#include "dpara_rt/host/markov_head.h"
#include "util.h"

namespace dpara_rt {

void markov_head_hidden_host(const float* hidden, std::int64_t batch, std::int64_t n_rows, int d,
                             std::int64_t hidden_dim, const std::int64_t* r, const void* head_packed,
                             PackedFormat head_format, std::int64_t vocab, float* logits, const std::int64_t* bonus,
                             const float* w1, const float* w2, std::int64_t rank, double temperature,
                             std::uint64_t seed, std::uint64_t offset, std::int64_t* draft_out, float* q_out,
                             const void* w2t, DType w2t_dtype, const float* w2_norms, const float* noise,
                             MarkovBiasCache* cache) {
  using detail::checked_mul;
  using detail::value_error;
  constexpr const char* what = "markov_head_hidden_host: ";
  if (batch < 0) value_error(what, "batch = ", batch, ", expected >= 0");
  if (n_rows < 1) value_error(what, "n_rows = ", n_rows, ", expected >= 1 (branches per request)");
  detail::check_draft_length(d, "markov_head_hidden_host:");
  if (hidden_dim < 1) value_error(what, "hidden_dim = ", hidden_dim, ", expected >= 1");
  if (vocab < 1) value_error(what, "vocab = ", vocab, ", expected >= 1");
  const std::int64_t branch = checked_mul(what, d, hidden_dim, "d * hidden_dim");  // floats per branch
  checked_mul(what, checked_mul(what, checked_mul(what, batch, n_rows, "batch * n_rows"), branch, "hidden floats"),
              std::int64_t(sizeof(float)), "hidden bytes");
  checked_mul(what, checked_mul(what, checked_mul(what, batch, d, "batch * d"), vocab, "logits floats"),
              std::int64_t(sizeof(float)), "logits bytes");
  if (batch == 0) return;
  const std::pair<const char*, const void*> pointers[] = {
      {"hidden", hidden}, {"r", r}, {"head_packed", head_packed}, {"logits", logits}, {"bonus", bonus}};
  for (const auto& [name, p] : pointers)
    if (!p) value_error(what, name, " is null, expected a buffer (batch = ", batch, ")");
  for (std::int64_t b = 0; b < batch; ++b) {  // before anything is read or written: the head checks the rest
    if (r[b] < 0 || r[b] >= n_rows) value_error(what, "r[", b, "] = ", r[b], ", expected 0..", n_rows - 1);
    if (bonus[b] < 0 || bonus[b] >= vocab) value_error(what, "bonus[", b, "] = ", bonus[b], ", expected 0..", vocab - 1);
  }
  // Branch r of each request, as the rows of one product: one request's branch is contiguous already.
  const float* rows = hidden + r[0] * branch;
  thread_local std::vector<float> gathered;
  if (batch > 1) {
    gathered.resize(std::size_t(batch * branch));
    for (std::int64_t b = 0; b < batch; ++b)
      std::memcpy(gathered.data() + b * branch, hidden + (b * n_rows + r[b]) * branch,
                  std::size_t(branch) * sizeof(float));
    rows = gathered.data();
  }
  host_linear(rows, batch * d, hidden_dim, head_packed, head_format, vocab, logits);
  thread_local std::vector<std::int64_t> first;  // the projected logits hold one row per request
  first.assign(std::size_t(batch), 0);
  markov_head_host(logits, DType::float32, batch, 1, d, vocab, std::int64_t(d) * vocab, first.data(), bonus, w1, w2,
                   rank, temperature, seed, offset, draft_out, q_out, w2t, w2t_dtype, w2_norms, noise, cache);
}

}  // namespace dpara_rt
