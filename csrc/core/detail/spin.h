#pragma once
// Private to the sources of dpara_rt_core and dpara_rt_host: a short wait for another thread or process, spent on
// this core rather than in the scheduler, that still gives the core to any other thread that wants it.
#include <chrono>

#if defined(__linux__)
#include <sched.h>
#endif

namespace dpara_rt::detail {

// Spins until done() holds (true) or about `seconds` have passed (false; done() was false at the last look).
// Every 64 pauses it reads the clock and yields the core: a spinner that held it had made the thread it waited for,
// woken on the same core, wait for the spin to run out (milliseconds), and itself wait as long to be answered.
template <class Done>
bool spin_until(Done done, double seconds) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 1; !done(); ++i) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    if (i % 64 == 0) {
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() >= seconds) return false;
#if defined(__linux__)
      sched_yield();
#endif
    }
  }
  return true;
}

}  // namespace dpara_rt::detail
