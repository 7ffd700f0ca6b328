#include "dpara_rt/mailbox.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <new>

#include "spin.h"
#include "util.h"

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace dpara_rt {

// Each counter on its own cache line: the producer writes `written`, the consumer `consumed`.
struct Mailbox::Header {
  alignas(64) std::atomic<std::uint64_t> written;  // bytes ever written (a message: 8-byte length, then its bytes)
  alignas(64) std::atomic<std::uint64_t> consumed;  // bytes ever read
  alignas(64) std::atomic<std::uint32_t> events;    // bumped after every write and read: what a sleeper waits on
  std::atomic<std::uint32_t> sleepers;              // sides asleep on `events`
  std::uint64_t capacity;
};

namespace {

using Clock = std::chrono::steady_clock;

// Sleep on word while it holds `seen`, at most `seconds` (a spurious or early wake-up is fine: callers re-check).
void sleep_on(std::atomic<std::uint32_t>& word, std::uint32_t seen, double seconds) {
#if defined(__linux__)
  if (seconds <= 0) return;
  timespec ts;
  ts.tv_sec = static_cast<time_t>(seconds);
  ts.tv_nsec = static_cast<long>((seconds - double(ts.tv_sec)) * 1e9);
  // not FUTEX_PRIVATE: the word is in memory another process maps
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT, seen, &ts, nullptr, 0);
#else
  (void)word, (void)seen, (void)seconds;
#endif
}

void wake_all(std::atomic<std::uint32_t>& word) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
#else
  (void)word;
#endif
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Wait until done() holds: spin for spin_s, then sleep on h.events in slices until timeout_s (both from the call).
template <class Done>
bool wait_until(std::atomic<std::uint32_t>& events, std::atomic<std::uint32_t>& sleepers, Done done, double spin_s,
                double timeout_s) {
  const auto t0 = Clock::now();
  if (detail::spin_until(done, std::min(spin_s, timeout_s))) return true;
  while (!done()) {
    const double elapsed = seconds_since(t0);
    if (elapsed >= timeout_s) return false;
    const std::uint32_t seen = events.load(std::memory_order_acquire);
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (!done()) sleep_on(events, seen, std::min(timeout_s - elapsed, 0.05));
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
  return true;
}

void notify(std::atomic<std::uint32_t>& events, std::atomic<std::uint32_t>& sleepers) {
  events.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers.load(std::memory_order_seq_cst)) wake_all(events);
}

}  // namespace

std::size_t Mailbox::bytes_for(std::size_t capacity) { return sizeof(Header) + capacity; }

Mailbox::Mailbox(void* memory, std::size_t capacity, bool create)
    : header_(static_cast<Header*>(memory)), data_(static_cast<unsigned char*>(memory) + sizeof(Header)),
      capacity_(capacity) {
  if (!memory || reinterpret_cast<std::uintptr_t>(memory) % 64)
    detail::value_error("Mailbox: memory at ", memory, ", expected a 64-byte aligned mapping");
  if (capacity < 64 || capacity % 8)
    detail::value_error("Mailbox: capacity ", capacity, " bytes, expected a multiple of 8 of at least 64");
  if (create) {
    new (header_) Header();
    header_->written.store(0);
    header_->consumed.store(0);
    header_->events.store(0);
    header_->sleepers.store(0);
    header_->capacity = capacity;
  } else if (header_->capacity != capacity) {
    detail::value_error("Mailbox: attaching with capacity ", capacity, " to a mailbox laid out with ",
                        header_->capacity, "; expected the creator's capacity");
  }
}

bool Mailbox::ready() const {
  return header_->written.load(std::memory_order_acquire) != header_->consumed.load(std::memory_order_relaxed);
}

std::uint32_t Mailbox::sleepers() const { return header_->sleepers.load(std::memory_order_acquire); }

bool Mailbox::push(const void* data, std::size_t bytes, double timeout_s) {
  const std::uint64_t need = 8 + (bytes + 7) / 8 * 8;  // messages start 8-byte aligned
  if (need > capacity_)
    detail::value_error("Mailbox.push: a message of ", bytes, " bytes needs ", need, " bytes of a mailbox of ",
                        capacity_, "; expected a mailbox larger than its largest message");
  Header& h = *header_;
  const std::uint64_t at = h.written.load(std::memory_order_relaxed);
  const auto room = [&] { return capacity_ - (at - h.consumed.load(std::memory_order_acquire)) >= need; };
  // a full queue waits for a reader that is behind: spin a moment, then sleep until it reads
  if (!wait_until(h.events, h.sleepers, room, std::min(timeout_s, 1e-3), timeout_s)) return false;
  const std::uint64_t length = bytes;
  const auto put = [&](std::uint64_t pos, const void* src, std::size_t n) {
    const std::size_t off = std::size_t(pos % capacity_), first = std::min(n, capacity_ - off);
    std::memcpy(data_ + off, src, first);
    std::memcpy(data_, static_cast<const unsigned char*>(src) + first, n - first);
  };
  put(at, &length, 8);
  put(at + 8, data, bytes);
  h.written.store(at + need, std::memory_order_release);
  notify(h.events, h.sleepers);
  return true;
}

bool Mailbox::pop(std::string& out, double spin_s, double timeout_s) {
  Header& h = *header_;
  if (!wait_until(h.events, h.sleepers, [&] { return ready(); }, spin_s, timeout_s)) return false;
  const std::uint64_t at = h.consumed.load(std::memory_order_relaxed);
  const auto get = [&](std::uint64_t pos, void* dst, std::size_t n) {
    const std::size_t off = std::size_t(pos % capacity_), first = std::min(n, capacity_ - off);
    std::memcpy(dst, data_ + off, first);
    std::memcpy(static_cast<unsigned char*>(dst) + first, data_, n - first);
  };
  std::uint64_t length = 0;
  get(at, &length, 8);
  out.resize(std::size_t(length));
  get(at + 8, out.data(), std::size_t(length));
  h.consumed.store(at + 8 + (length + 7) / 8 * 8, std::memory_order_release);
  notify(h.events, h.sleepers);
  return true;
}

}  // namespace dpara_rt
