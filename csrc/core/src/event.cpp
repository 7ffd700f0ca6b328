#include "dpara_rt/event.h"

#include <condition_variable>
#include <mutex>

#include "dpara_rt/types.h"
#include "util.h"

namespace dpara_rt {

struct HostEventImpl::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::int64_t ts = 0;
};

HostEventImpl::HostEventImpl() : s_(std::make_unique<State>()) {}
HostEventImpl::~HostEventImpl() = default;

void HostEventImpl::complete() {
  {
    std::lock_guard<std::mutex> lk(s_->mu);
    s_->ts = now_ns();
    s_->done = true;
  }
  s_->cv.notify_all();
}

bool HostEventImpl::query() {
  std::lock_guard<std::mutex> lk(s_->mu);
  return s_->done;
}

void HostEventImpl::synchronize() {
  std::unique_lock<std::mutex> lk(s_->mu);
  s_->cv.wait(lk, [&] { return s_->done; });
}

std::int64_t HostEventImpl::timestamp_ns() {
  synchronize();
  return s_->ts;
}

Event Event::completed_host() {
  auto impl = std::make_shared<HostEventImpl>();
  impl->complete();
  return Event(impl);
}

std::int64_t Event::timestamp_ns() const {
  if (!impl_) detail::runtime_error("a null event (default-constructed, already complete) has no timestamp");
  if (impl_->device() >= 0)
    detail::runtime_error("event on CUDA device ", impl_->device(),
                          " has no host timestamp: use elapsed_ms between two CUDA events");
  return impl_->timestamp_ns();
}

double Event::elapsed_ms(const Event& start, const Event& end) {
  if (start.is_null() || end.is_null())
    detail::value_error("elapsed_ms needs two recorded events, got a null event as ",
                        start.is_null() ? "start" : "end");
  const bool sh = start.is_host(), eh = end.is_host();
  if (sh != eh)
    detail::value_error("elapsed_ms between a ", sh ? "host" : "CUDA", " event and a ", eh ? "host" : "CUDA",
                        " event: both must come from the same backend");
  if (sh) return double(end.timestamp_ns() - start.timestamp_ns()) / 1e6;
  return cuda_elapsed_ms(*start.impl_, *end.impl_);
}

}  // namespace dpara_rt
