// Mailbox: messages arrive whole and in order across the ring's wrap-around, from another thread, whatever their
// sizes; an empty mailbox times out; refusals name the value.
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "dpara_rt/mailbox.h"

using dpara_rt::Mailbox;

namespace {

struct Memory {
  void* p;
  explicit Memory(std::size_t bytes) : p(std::aligned_alloc(64, (bytes + 63) / 64 * 64)) { std::memset(p, 0, bytes); }
  ~Memory() { std::free(p); }
};

std::string message(int i) { return std::string(std::size_t(i * 37 % 301), char('a' + i % 26)) + std::to_string(i); }

void test_messages_cross_between_threads_in_order() {
  const std::size_t capacity = 1024;  // far less than the messages in all: the ring wraps many times
  Memory mem(Mailbox::bytes_for(capacity));
  Mailbox producer(mem.p, capacity, true), consumer(mem.p, capacity, false);
  const int n = 2000;
  std::thread writer([&] {
    for (int i = 0; i < n; ++i) {
      const std::string m = message(i);
      if (!producer.push(m.data(), m.size(), 10.0)) std::abort();
    }
  });
  std::string got;
  bool in_order = true;
  for (int i = 0; i < n; ++i) in_order &= consumer.pop(got, 1e-4, 10.0) && got == message(i);
  writer.join();
  CHECK(in_order);
  CHECK(!consumer.ready());
}

void test_an_empty_mailbox_times_out_and_refusals_name_the_value() {
  const std::size_t capacity = 256;
  Memory mem(Mailbox::bytes_for(capacity));
  Mailbox box(mem.p, capacity, true);
  std::string got = "untouched";
  CHECK(!box.pop(got, 0.0, 0.01));
  CHECK(got == "untouched");
  const std::string big(300, 'x');
  CHECK_THROWS(box.push(big.data(), big.size(), 0.0), std::invalid_argument, "a message of 300 bytes needs 312");
  const std::string fits(200, 'y');
  CHECK(box.push(fits.data(), fits.size(), 0.0));
  CHECK(!box.push(fits.data(), fits.size(), 0.01));  // no room until the first is read
  CHECK(box.pop(got, 0.0, 0.0) && got == fits);
  CHECK_THROWS(Mailbox(mem.p, 512, false), std::invalid_argument, "capacity 512 to a mailbox laid out with 256");
  CHECK_THROWS(Mailbox(mem.p, 100, true), std::invalid_argument, "capacity 100 bytes, expected a multiple of 8");
}

}  // namespace

int main() {
  test_messages_cross_between_threads_in_order();
  test_an_empty_mailbox_times_out_and_refusals_name_the_value();
  return check::finish("test_mailbox");
}
