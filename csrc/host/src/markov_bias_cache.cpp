#include "dpara_rt/host/markov_bias_cache.h"

#include <limits>

#include "util.h"

namespace dpara_rt {

MarkovBiasCache::MarkovBiasCache(const float* w1, const float* w2, std::int64_t vocab, std::int64_t rank,
                                 std::int64_t capacity)
    : w1_(w1), w2_(w2), vocab_(vocab), rank_(rank), capacity_(capacity) {
  constexpr const char* what = "MarkovBiasCache: ";
  if (!w1 || !w2) detail::value_error(what, "w1 and w2 must be buffers, got ", w1 ? "w1" : "null w1", " and ",
                                      w2 ? "w2" : "null w2");
  if (vocab < 1 || vocab > std::numeric_limits<std::int32_t>::max())
    detail::value_error(what, "vocab = ", vocab, ", expected 1..", std::numeric_limits<std::int32_t>::max());
  if (rank < 1) detail::value_error(what, "rank = ", rank, ", expected >= 1");
  if (capacity < 1 || capacity > std::numeric_limits<std::int32_t>::max())
    detail::value_error(what, "capacity = ", capacity, " rows, expected 1..", std::numeric_limits<std::int32_t>::max());
  const std::int64_t floats = detail::checked_mul(what, capacity, vocab, "capacity * vocab");
  detail::checked_mul(what, floats, std::int64_t(sizeof(float)), "capacity * vocab * 4 bytes");
  rows_.reset(new float[std::size_t(floats)]);  // not value-initialised: pages are touched as rows are claimed
  slot_of_.assign(std::size_t(vocab), -1);
  token_of_.assign(std::size_t(capacity), -1);
  used_.assign(std::size_t(capacity), 0);
}

const float* MarkovBiasCache::find(std::int64_t x) {
  const std::int32_t slot = slot_of_[std::size_t(x)];
  if (slot < 0) {
    ++misses_;
    return nullptr;
  }
  ++hits_;
  used_[std::size_t(slot)] = clock_;
  return rows_.get() + std::int64_t(slot) * vocab_;
}

float* MarkovBiasCache::claim(std::int64_t x) {
  std::int64_t victim = -1;
  for (std::int64_t s = 0; s < capacity_; ++s) {  // an unused row, else the least recently used one
    if (token_of_[std::size_t(s)] < 0) {
      victim = s;
      break;
    }
    if (used_[std::size_t(s)] < clock_ && (victim < 0 || used_[std::size_t(s)] < used_[std::size_t(victim)]))
      victim = s;
  }
  if (victim < 0)
    detail::value_error("MarkovBiasCache: all ", capacity_, " rows are in use by this step, expected a cache with ",
                        "more rows than the rows stepped together");
  const std::int64_t old = token_of_[std::size_t(victim)];
  if (old >= 0) slot_of_[std::size_t(old)] = -1;
  token_of_[std::size_t(victim)] = x;
  slot_of_[std::size_t(x)] = std::int32_t(victim);
  used_[std::size_t(victim)] = clock_;
  return rows_.get() + victim * vocab_;
}

}  // namespace dpara_rt
