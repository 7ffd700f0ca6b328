#pragma once
// The boundary ring: `capacity` slots of boundary logits [batch, d+1, d, vocab] (ring[slot][b][r] is the
// d x vocab block branch r produced for request b). Each slot moves free -> filling -> ready -> consumed
// -> free; every other move throws, so a slot is never overwritten before the Markov head consumed it.
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "dpara_rt/event.h"
#include "dpara_rt/lane.h"
#include "dpara_rt/memory.h"

namespace dpara_rt {

enum class SlotState : std::uint8_t { free, filling, ready, consumed };
const char* slot_state_name(SlotState s);

class BoundaryRing {
 public:
  // device -1: aligned host memory (CPU backend); device >= 0: cudaMalloc on that device. shared (host only):
  // the slots live in a memfd (shared_fd()) that a drafter worker process maps and fills.
  // Throws std::invalid_argument naming the value for capacity < 1, batch < 1, d outside 1..kMaxDraft, vocab < 1,
  // a dtype other than float32 / bfloat16 / float16, or shared with a CUDA device.
  BoundaryRing(int capacity, int batch, int d, std::int64_t vocab, DType dtype, int device = -1, bool shared = false);

  // free -> filling on the next slot in round-robin order; throws std::runtime_error (naming the slot and
  // its state) when that slot is not free. The slot's release event is waited for on `lane` (the producer
  // lane) when given, else on the calling thread.
  int acquire(Lane* lane = nullptr);
  // acquire() without the wait: `guard` receives the release event to honour before writing the slot.
  int acquire_nowait(Event* guard);
  // filling -> ready; `ready` is the producer's event after writing the slot.
  void mark_ready(int slot, Event ready = {});
  // ready -> consumed. r[b] (0 <= r[b] <= d, n == batch) picks branch r[b] of request b; offsets_out[b]
  // receives the element offset of ring[slot][b][r[b]] from the start of the ring, so a Markov head reads
  // the rows in place. The ready event is waited for on `lane` when given, else on the calling thread.
  void select(int slot, const std::int64_t* r, std::int64_t n, std::int64_t* offsets_out, Lane* lane = nullptr);
  // select() without the wait: returns the ready event to honour before reading the rows.
  Event select_nowait(int slot, const std::int64_t* r, std::int64_t n, std::int64_t* offsets_out);
  // ready -> consumed for a reader that picks the branches itself from r in device memory (never on the host):
  // no offsets; the ready event is waited for on `lane` when given, else on the calling thread.
  void take(int slot, Lane* lane = nullptr);
  // consumed -> free; `done` (the consumer's event) must complete before the slot is filled again.
  void release(int slot, Event done = {});
  // Wait for every event, then mark all slots free and restart at slot 0 (e.g. between generations).
  void reset();

  SlotState state(int slot) const;
  Event ready_event(int slot) const;
  Event release_event(int slot) const;
  int next_slot() const;

  int capacity() const { return capacity_; }
  int batch() const { return batch_; }
  int d() const { return d_; }
  std::int64_t vocab() const { return vocab_; }
  DType dtype() const { return dtype_; }
  int device() const { return device_; }
  std::int64_t slot_elems() const { return std::int64_t(batch_) * (d_ + 1) * d_ * vocab_; }
  std::int64_t row_elems() const { return std::int64_t(d_) * vocab_; }  // one ring[slot][b][r]
  void* data() const { return buf_->data(); }
  int shared_fd() const { return buf_->fd(); }  // -1 unless shared
  std::size_t nbytes() const { return buf_->bytes(); }

  TensorView view() const;              // [capacity, batch, d+1, d, vocab]
  TensorView slot_view(int slot) const;  // [batch, d+1, d, vocab]

 private:
  void check_slot(int slot) const;
  // ready -> consumed under the lock; returns the slot's ready event. `verb` names the call in the error.
  Event consume(int slot, const char* verb);
  int capacity_, batch_, d_;
  std::int64_t vocab_;
  DType dtype_;
  int device_;
  std::shared_ptr<Buffer> buf_;
  mutable std::mutex mu_;
  std::vector<SlotState> state_;
  std::vector<Event> ready_, released_;
  int next_ = 0;
};

}  // namespace dpara_rt
