#include "dpara_rt/ring.h"

#include "cuda_internal.h"
#include "util.h"

namespace dpara_rt {

const char* slot_state_name(SlotState s) {
  switch (s) {
    case SlotState::free: return "free";
    case SlotState::filling: return "filling";
    case SlotState::ready: return "ready";
    case SlotState::consumed: return "consumed";
  }
  return "?";
}

namespace {

std::size_t ring_bytes(int capacity, int batch, int d, std::int64_t vocab, DType dtype) {
  std::size_t n = dtype_size(dtype);
  for (std::size_t f : {std::size_t(capacity), std::size_t(batch), std::size_t(d + 1), std::size_t(d),
                        std::size_t(vocab)}) {
    if (__builtin_mul_overflow(n, f, &n))
      detail::value_error("boundary ring of ", capacity, " x ", batch, " x ", d + 1, " x ", d, " x ", vocab,
                          " elements overflows the address space");
  }
  return n;
}

}  // namespace


BoundaryRing::BoundaryRing(int capacity, int batch, int d, std::int64_t vocab, DType dtype, int device, bool shared)
    : capacity_(capacity), batch_(batch), d_(d), vocab_(vocab), dtype_(dtype), device_(device) {
  if (capacity < 1) detail::value_error("ring capacity must be >= 1, got ", capacity);
  if (batch < 1) detail::value_error("ring batch must be >= 1, got ", batch);
  detail::check_draft_length(d, "ring");
  if (vocab < 1) detail::value_error("vocab must be >= 1, got ", vocab);
  if (dtype != DType::float32 && dtype != DType::bfloat16 && dtype != DType::float16)
    detail::value_error("ring dtype must be float32, bfloat16 or float16, got '", dtype_name(dtype), "'");
  if (device < -1) detail::value_error("ring device must be -1 (host) or a CUDA device index, got ", device);
  if (shared && device >= 0)
    detail::value_error("a shared ring lives in host memory for a drafter process: device must be -1, got ", device);
  const std::size_t bytes = ring_bytes(capacity, batch, d, vocab, dtype);
  if (shared) {
    buf_ = std::make_shared<Buffer>(MemoryKind::host_shared, bytes);
  } else if (device >= 0) {
    detail::require_cuda_device(device, "a boundary ring");
    buf_ = std::make_shared<Buffer>(MemoryKind::device, bytes, device);
  } else {
    buf_ = std::make_shared<Buffer>(MemoryKind::host, bytes);
  }
  state_.assign(std::size_t(capacity), SlotState::free);
  ready_.resize(std::size_t(capacity));
  released_.resize(std::size_t(capacity));
}

void BoundaryRing::check_slot(int slot) const {
  if (slot < 0 || slot >= capacity_)
    detail::value_error("slot ", slot, " out of range for a ring of capacity ", capacity_, " (expected 0..",
                        capacity_ - 1, ")");
}

int BoundaryRing::acquire(Lane* lane) {
  Event guard;
  const int slot = acquire_nowait(&guard);
  wait_on(guard, lane);
  return slot;
}

int BoundaryRing::acquire_nowait(Event* guard) {
  int slot;
  {
    std::lock_guard<std::mutex> lk(mu_);
    slot = next_;
    const SlotState s = state_[std::size_t(slot)];
    if (s != SlotState::free) {
      const char* why = s == SlotState::filling ? "it is still being filled"
                        : s == SlotState::ready ? "it has not been consumed"
                                                : "it has not been released";
      detail::runtime_error("slot ", slot, " is ", slot_state_name(s), ", not free: ", why,
                            " (ring capacity ", capacity_, ")");
    }
    state_[std::size_t(slot)] = SlotState::filling;
    next_ = (slot + 1) % capacity_;
    *guard = std::move(released_[std::size_t(slot)]);
    released_[std::size_t(slot)] = Event();
    ready_[std::size_t(slot)] = Event();
  }
  return slot;
}

void BoundaryRing::mark_ready(int slot, Event ready) {
  check_slot(slot);
  std::lock_guard<std::mutex> lk(mu_);
  const SlotState s = state_[std::size_t(slot)];
  if (s != SlotState::filling)
    detail::runtime_error("cannot mark slot ", slot, " ready: it is ", slot_state_name(s), ", expected filling");
  state_[std::size_t(slot)] = SlotState::ready;
  ready_[std::size_t(slot)] = std::move(ready);
}

void BoundaryRing::select(int slot, const std::int64_t* r, std::int64_t n, std::int64_t* offsets_out, Lane* lane) {
  wait_on(select_nowait(slot, r, n, offsets_out), lane);
}

Event BoundaryRing::select_nowait(int slot, const std::int64_t* r, std::int64_t n, std::int64_t* offsets_out) {
  check_slot(slot);
  if (n != batch_) detail::value_error("select needs one r per request: got ", n, " values for batch ", batch_);
  for (std::int64_t b = 0; b < n; ++b)
    if (r[b] < 0 || r[b] > d_)
      detail::value_error("r[", b, "] = ", r[b], " out of range: expected 0..", d_, " (d = ", d_, ")");
  const Event ready = consume(slot, "select");
  const std::int64_t base = std::int64_t(slot) * slot_elems(), per_request = std::int64_t(d_ + 1) * row_elems();
  for (std::int64_t b = 0; b < n; ++b) offsets_out[b] = base + b * per_request + r[b] * row_elems();
  return ready;
}

void BoundaryRing::take(int slot, Lane* lane) {
  check_slot(slot);
  wait_on(consume(slot, "take"), lane);
}

Event BoundaryRing::consume(int slot, const char* verb) {
  std::lock_guard<std::mutex> lk(mu_);
  const SlotState s = state_[std::size_t(slot)];
  if (s != SlotState::ready)
    detail::runtime_error("cannot ", verb, " slot ", slot, ": it is ", slot_state_name(s), ", expected ready");
  state_[std::size_t(slot)] = SlotState::consumed;
  return ready_[std::size_t(slot)];
}

void BoundaryRing::release(int slot, Event done) {
  check_slot(slot);
  std::lock_guard<std::mutex> lk(mu_);
  const SlotState s = state_[std::size_t(slot)];
  if (s != SlotState::consumed)
    detail::runtime_error("cannot release slot ", slot, ": it is ", slot_state_name(s),
                          ", expected consumed (select it first)");
  state_[std::size_t(slot)] = SlotState::free;
  released_[std::size_t(slot)] = std::move(done);
}

void BoundaryRing::reset() {
  std::vector<Event> pending;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (int i = 0; i < capacity_; ++i) {
      pending.push_back(std::move(ready_[std::size_t(i)]));
      pending.push_back(std::move(released_[std::size_t(i)]));
      ready_[std::size_t(i)] = released_[std::size_t(i)] = Event();
      state_[std::size_t(i)] = SlotState::free;
    }
    next_ = 0;
  }
  for (auto& e : pending) e.synchronize();
}

SlotState BoundaryRing::state(int slot) const {
  check_slot(slot);
  std::lock_guard<std::mutex> lk(mu_);
  return state_[std::size_t(slot)];
}

Event BoundaryRing::ready_event(int slot) const {
  check_slot(slot);
  std::lock_guard<std::mutex> lk(mu_);
  return ready_[std::size_t(slot)];
}

Event BoundaryRing::release_event(int slot) const {
  check_slot(slot);
  std::lock_guard<std::mutex> lk(mu_);
  return released_[std::size_t(slot)];
}

int BoundaryRing::next_slot() const {
  std::lock_guard<std::mutex> lk(mu_);
  return next_;
}

TensorView BoundaryRing::view() const {
  return TensorView{buf_, buf_->data(), dtype_, {capacity_, batch_, d_ + 1, d_, vocab_}, device_};
}

TensorView BoundaryRing::slot_view(int slot) const {
  check_slot(slot);
  auto* p = static_cast<char*>(buf_->data()) + std::size_t(slot) * std::size_t(slot_elems()) * dtype_size(dtype_);
  return TensorView{buf_, p, dtype_, {batch_, d_ + 1, d_, vocab_}, device_};
}

}  // namespace dpara_rt
