#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <unordered_map>

#include "dpara_rt/lane.h"

namespace dpara_rt {

void wait_on(const Event& e, Lane* lane) {
  if (e.query()) return;
  if (lane) lane->wait(e);
  else e.synchronize();
}

namespace {
// The host lane whose worker the calling thread is (null on other threads), and, for each worker blocked in
// another lane's synchronize(), the lane it waits for: a wait that would close a cycle is refused, not hung.
thread_local const void* t_worker_of = nullptr;
std::mutex g_waits_mu;
std::unordered_map<const void*, const void*> g_waits;

struct WaitEdge {
  const void* from;
  ~WaitEdge() {
    if (!from) return;
    std::lock_guard<std::mutex> lk(g_waits_mu);
    g_waits.erase(from);
  }
};
}  // namespace

struct HostLane::State {
  mutable std::mutex mu;
  std::condition_variable work_cv, idle_cv;
  std::deque<Task> queue;
  bool busy = false;  // a task is running, on the worker or inline (run_in_order on an idle lane)
  bool stop = false;
  std::exception_ptr error;  // first uncollected task exception
  std::thread worker;
};

HostLane::HostLane(std::string name) : Lane(std::move(name)), s_(std::make_shared<State>()) {
  s_->worker = std::thread([s = s_] { run(*s); });
}

HostLane::~HostLane() {
  {
    std::lock_guard<std::mutex> lk(s_->mu);
    s_->stop = true;
  }
  s_->work_cv.notify_all();
  // A task that drops the last reference to its own lane cannot join itself; the worker drains the
  // queue and exits on its own, keeping the state alive through its shared_ptr.
  if (on_worker()) s_->worker.detach();
  else s_->worker.join();
}

void HostLane::run(State& s) {
  t_worker_of = &s;
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lk(s.mu);
      // Not while an inline run_in_order is in progress: what was queued meanwhile comes after it.
      s.work_cv.wait(lk, [&] { return !s.busy && (s.stop || !s.queue.empty()); });
      if (s.queue.empty()) return;  // stop requested and everything queued has run
      task = std::move(s.queue.front());
      s.queue.pop_front();
      s.busy = true;
    }
    std::exception_ptr err;
    try {
      task();
    } catch (...) {
      err = std::current_exception();
    }
    // Destroy the callable (and a dropped exception) outside the lock: either may need other locks
    // (a Python callable takes the GIL to release its references).
    task = nullptr;
    {
      std::lock_guard<std::mutex> lk(s.mu);
      s.busy = false;
      if (err && !s.error) s.error = std::move(err);
      if (s.queue.empty()) s.idle_cv.notify_all();
    }
  }
}

void HostLane::submit(Task fn) {
  {
    std::lock_guard<std::mutex> lk(s_->mu);
    s_->queue.push_back(std::move(fn));
  }
  s_->work_cv.notify_one();
}

bool HostLane::on_worker() const { return s_->worker.get_id() == std::this_thread::get_id(); }

void HostLane::run_in_order(Task fn) {
  if (on_worker()) {  // the calling task is the lane's current position
    fn();
    return;
  }
  {
    std::unique_lock<std::mutex> lk(s_->mu);
    if (s_->busy || !s_->queue.empty()) {
      s_->queue.push_back(std::move(fn));
      lk.unlock();
      s_->work_cv.notify_one();
      return;
    }
    s_->busy = true;  // holds the worker off; the lock itself is not held while fn runs (fn may submit)
  }
  struct Idle {  // clears `busy` however fn returns
    State& s;
    ~Idle() {
      {
        std::lock_guard<std::mutex> lk(s.mu);
        s.busy = false;
        if (s.queue.empty()) s.idle_cv.notify_all();
      }
      s.work_cv.notify_one();
    }
  } idle{*s_};
  fn();
}

void HostLane::rethrow_captured() {
  std::exception_ptr err;
  {
    std::lock_guard<std::mutex> lk(s_->mu);
    err = std::move(s_->error);
    s_->error = nullptr;
  }
  if (err) std::rethrow_exception(err);
}

Event HostLane::record() {
  // Inside a task, an error captured from an earlier task stays for the caller that collects it.
  if (on_worker()) return Event::completed_host();
  rethrow_captured();
  auto ev = std::make_shared<HostEventImpl>();
  run_in_order([ev] { ev->complete(); });
  return Event(ev);
}

void HostLane::wait(const Event& e) {
  if (e.query()) return;  // already complete: nothing to order against
  if (on_worker()) e.synchronize();  // what this task does next comes after e
  else submit([e] { e.synchronize(); });
}

void HostLane::synchronize() {
  if (on_worker())
    throw std::runtime_error("synchronize() on host lane '" + name() + "' from one of its own tasks would wait for itself");
  WaitEdge edge{t_worker_of};
  if (edge.from) {  // a task of another host lane waits for this one: refuse a cycle of such waits
    std::lock_guard<std::mutex> lk(g_waits_mu);
    for (auto it = g_waits.find(s_.get()); it != g_waits.end(); it = g_waits.find(it->second))
      if (it->second == edge.from) {
        edge.from = nullptr;
        throw std::runtime_error("synchronize() on host lane '" + name() + "' from a task of a lane that '" + name() +
                                 "' is itself waiting for would deadlock (the lanes would wait for each other)");
      }
    g_waits[edge.from] = s_.get();
  }
  {
    std::unique_lock<std::mutex> lk(s_->mu);
    s_->idle_cv.wait(lk, [&] { return !s_->busy && s_->queue.empty(); });
  }
  rethrow_captured();
}

bool HostLane::synchronize_for(double seconds) {
  if (on_worker()) return false;
  std::unique_lock<std::mutex> lk(s_->mu);
  return s_->idle_cv.wait_for(lk, std::chrono::duration<double>(seconds),
                              [&] { return !s_->busy && s_->queue.empty(); });
}

void HostLane::copy_async(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  if (on_worker()) std::memcpy(dst, src, bytes);
  else submit([dst, src, bytes] { std::memcpy(dst, src, bytes); });
}

std::size_t HostLane::pending() const {
  std::lock_guard<std::mutex> lk(s_->mu);
  return s_->queue.size() + (s_->busy ? 1 : 0);
}

}  // namespace dpara_rt
