#pragma once
// A one-way queue of messages (byte strings) between two processes over shared memory: one producer, one
// consumer. A drafter worker process gets its calls through one and answers through another. A pipe costs each
// message two system calls at least and wakes a sleeping reader through the scheduler; here a message is a copy
// and a counter, and a reader that waits spins first (its core is its own; it yields the core to any other thread
// that wants it), sleeping on a futex only after that.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace dpara_rt {

class Mailbox {
 public:
  // Bytes of shared memory a mailbox of `capacity` bytes of messages (each message takes 8 more) occupies.
  static std::size_t bytes_for(std::size_t capacity);

  // A mailbox in `memory` (bytes_for(capacity) bytes, 64-byte aligned, mapped by both processes). create: lay it
  // out (once, by one side, before the other attaches); otherwise attach to the one laid out there.
  Mailbox(void* memory, std::size_t capacity, bool create);

  std::size_t capacity() const { return capacity_; }

  // Appends a message; waits (spinning, then sleeping) while the queue is too full. False when there was no room
  // within timeout_s. std::invalid_argument when the message can never fit.
  bool push(const void* data, std::size_t bytes, double timeout_s);

  // The oldest message into `out`: spins up to spin_s for one, then sleeps until one comes or timeout_s (from the
  // call) passes; false then.
  bool pop(std::string& out, double spin_s, double timeout_s);

  // Whether a message is waiting.
  bool ready() const;

  // Sides asleep in a wait on this mailbox now (not spinning): 0, 1 or 2.
  std::uint32_t sleepers() const;

 private:
  struct Header;
  Header* header_;
  unsigned char* data_;
  std::size_t capacity_;
};

}  // namespace dpara_rt
