#pragma once
// Lanes: ordered queues of work. A HostLane is a worker thread with a FIFO queue; a CudaLane is a CUDA
// stream on one device plus a host worker for callables that launch work on it. Work on one lane runs in
// submission order; wait(event) orders a lane after a point of another lane.
//
// Called from one of the lane's own tasks, a lane acts like a CUDA stream seen from the code that feeds it:
// the running task *is* the lane's current position, and the host work it did so far is complete. So from
// the lane's worker thread, record() marks the point right after that work (a HostLane returns an event
// already completed, timestamped now, even with other tasks queued behind), wait(e) orders what the task
// does next after e (a HostLane blocks the task until e completes; a CudaLane makes its stream wait), and
// copy_async is issued at once (a HostLane copies inline). A task must not wait for an event that only a
// later task of its own lane completes. From any other thread each call keeps its queued meaning.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "dpara_rt/event.h"

namespace dpara_rt {

using Task = std::function<void()>;

class Lane {
 public:
  explicit Lane(std::string name) : name_(std::move(name)) {}
  virtual ~Lane() = default;
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;

  // Queue a callable. An exception it throws is captured and rethrown by the next record()/synchronize()
  // on the caller's thread; the lane keeps running later tasks.
  virtual void submit(Task fn) = 0;
  // An event that completes once everything submitted before it has run.
  virtual Event record() = 0;
  // Work queued after this call starts only once `e` has completed (e may come from any lane).
  virtual void wait(const Event& e) = 0;
  // Block until everything queued so far has run, then rethrow a captured exception, if any. Called from
  // one of the lane's own tasks it would wait for itself: std::runtime_error instead.
  virtual void synchronize() = 0;
  // Asynchronous copy of `bytes` bytes in lane order (a memcpy task on the host, cudaMemcpyAsync on CUDA).
  virtual void copy_async(void* dst, const void* src, std::size_t bytes) = 0;
  virtual int device() const = 0;  // -1 for the host
  virtual std::uintptr_t stream() const { return 0; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
};

// Order later work after `e`: on `lane` when given (non-blocking), else by blocking the calling thread.
void wait_on(const Event& e, Lane* lane);

class HostLane final : public Lane {
 public:
  explicit HostLane(std::string name = "host");
  // Runs what is still queued, then joins the worker (or lets it finish alone when the last reference to
  // the lane is dropped by one of its own tasks).
  ~HostLane() override;

  void submit(Task fn) override;
  Event record() override;
  void wait(const Event& e) override;
  // Refused (std::runtime_error) from a task of a host lane that this lane is waiting for, directly or
  // through other lanes: the two would wait for each other forever.
  void synchronize() override;
  // Wait at most `seconds` for the lane to go idle; false on time-out (captured errors stay captured).
  bool synchronize_for(double seconds);
  void copy_async(void* dst, const void* src, std::size_t bytes) override;
  int device() const override { return -1; }

  // Rethrow (and clear) an exception captured from a task.
  void rethrow_captured();
  std::size_t pending() const;  // queued + running tasks

 private:
  friend class CudaLane;  // its host worker is a HostLane that orders stream operations with run_in_order
  struct State;
  bool on_worker() const;  // called from one of this lane's own tasks
  // Run `fn` in lane order: at once on the caller's thread when called from the lane's own task or when the
  // lane is idle (cheap, no thread hop; the worker starts nothing until it returns), otherwise as a queued
  // task. Errors of an inline run reach the caller.
  void run_in_order(Task fn);
  static void run(State& s);  // the worker loop; touches only the shared state, never the lane object
  std::shared_ptr<State> s_;  // shared with the worker thread, which may outlive the lane object
};

class CudaLane final : public Lane {
 public:
  // Adopt `stream` (a cudaStream_t as an integer, e.g. torch.cuda.Stream().cuda_stream) or, when it is 0,
  // create a non-blocking stream owned by the lane. Throws std::runtime_error naming the device and the
  // CUDA status when the device does not exist or the build has no CUDA.
  explicit CudaLane(int device, std::uintptr_t stream = 0, std::string name = "cuda");
  ~CudaLane() override;

  void submit(Task fn) override;  // runs on the lane's host worker
  Event record() override;        // cudaEventRecord, in lane order
  void wait(const Event& e) override;
  void synchronize() override;    // drains the host worker, then cudaStreamSynchronize
  void copy_async(void* dst, const void* src, std::size_t bytes) override;
  int device() const override;
  std::uintptr_t stream() const override;
  bool owns_stream() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dpara_rt
