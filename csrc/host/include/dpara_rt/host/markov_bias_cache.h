#pragma once
// The Markov head's bias rows W1[x] @ W2, kept for the tokens x it drafted from lately. A step that starts from
// a kept token adds one stored row to its boundary row instead of streaming all of W2 (V x R floats) through a
// product; drafted text repeats its tokens (indentation, punctuation, keywords), so most steps do. A row is
// written once by the same arithmetic a step without the cache uses, so drafts and q are the same bits.
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace dpara_rt {

class MarkovBiasCache {
 public:
  // Rows for one pair of factors: w1 [vocab, rank] and w2 [rank, vocab] float32, which must outlive the cache
  // and not change while it holds rows (a head built for new factors gets a new cache). capacity: rows kept,
  // at least 1; the least recently used one is replaced. Memory: capacity * vocab floats, touched as filled.
  MarkovBiasCache(const float* w1, const float* w2, std::int64_t vocab, std::int64_t rank, std::int64_t capacity);

  const float* w1() const { return w1_; }
  const float* w2() const { return w2_; }
  std::int64_t vocab() const { return vocab_; }
  std::int64_t rank() const { return rank_; }
  std::int64_t capacity() const { return capacity_; }
  std::int64_t hits() const { return hits_; }
  std::int64_t misses() const { return misses_; }

  // A head call holds this for its whole run: two threads drafting with one head take turns.
  std::mutex& mutex() { return mutex_; }

  // Begins a step: rows found or claimed until the next begin_step() are not replaced before then.
  void begin_step() { ++clock_; }
  // Token x's row, or null when it is not kept. Counts a hit or a miss.
  const float* find(std::int64_t x);
  // Whether token x's row is kept (counts nothing, marks nothing).
  bool holds(std::int64_t x) const { return slot_of_[std::size_t(x)] >= 0; }
  // A row for token x (not kept), replacing the least recently used row that the current step has not used;
  // the caller fills it before the step reads it. Errors when every row is in use by the current step.
  float* claim(std::int64_t x);

 private:
  const float* w1_;
  const float* w2_;
  std::int64_t vocab_, rank_, capacity_;
  std::unique_ptr<float[]> rows_;          // capacity x vocab, uninitialised until claimed
  std::vector<std::int32_t> slot_of_;      // [vocab]: the row holding token x, or -1
  std::vector<std::int64_t> token_of_;     // [capacity]: the token a row holds, or -1
  std::vector<std::int64_t> used_;         // [capacity]: the step that last used the row
  std::int64_t clock_ = 0, hits_ = 0, misses_ = 0;
  std::mutex mutex_;
};

}  // namespace dpara_rt
