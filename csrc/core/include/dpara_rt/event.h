#pragma once
// Events mark a point in a lane's order. A host event completes when its lane's worker reaches it and
// carries the host timestamp of that moment; a CUDA event wraps a cudaEvent_t recorded on a stream.
#include <cstdint>
#include <memory>
#include <string>

namespace dpara_rt {

class EventImpl {
 public:
  virtual ~EventImpl() = default;
  virtual bool query() = 0;
  virtual void synchronize() = 0;
  virtual int device() const = 0;  // -1 for host events
  // Host clock (now_ns) at completion; only host events have one.
  virtual std::int64_t timestamp_ns() = 0;
};

// Completes once, from whichever thread runs the lane's worker.
class HostEventImpl final : public EventImpl {
 public:
  HostEventImpl();
  ~HostEventImpl() override;
  void complete();
  bool query() override;
  void synchronize() override;
  int device() const override { return -1; }
  std::int64_t timestamp_ns() override;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// A shared handle. A default-constructed Event is already complete (nothing to wait for), so optional
// guards such as "ready after this event" can always hold one.
class Event {
 public:
  Event() = default;
  explicit Event(std::shared_ptr<EventImpl> impl) : impl_(std::move(impl)) {}

  static Event completed_host();  // a host event completed now (timestamped)

  bool query() const { return !impl_ || impl_->query(); }
  void synchronize() const {
    if (impl_) impl_->synchronize();
  }
  bool is_null() const { return !impl_; }
  bool is_host() const { return !impl_ || impl_->device() < 0; }
  int device() const { return impl_ ? impl_->device() : -1; }
  std::int64_t timestamp_ns() const;
  const std::shared_ptr<EventImpl>& impl() const { return impl_; }

  // Milliseconds from start to end, waiting for both. Both must come from the same backend.
  static double elapsed_ms(const Event& start, const Event& end);

 private:
  std::shared_ptr<EventImpl> impl_;
};

// CUDA side of elapsed_ms; throws when built without CUDA.
double cuda_elapsed_ms(EventImpl& start, EventImpl& end);

}  // namespace dpara_rt
