#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <stdexcept>
#include <string>

#include "executor.h"

namespace swa {

HostExecutor::HostExecutor(int64_t order_offset) : order_offset_(order_offset), launches_(order_offset) {
  if (order_offset < 0) throw std::invalid_argument("order_offset: must be >= 0, got " + std::to_string(order_offset));
}

int64_t HostExecutor::order_offset_from_env() {
  const char* text = std::getenv("SWA_EXT_EMULATED_ORDER_OFFSET");
  if (text == nullptr || text[0] == '\0') return 0;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (*end != '\0' || value < 0)
    throw std::invalid_argument(std::string("SWA_EXT_EMULATED_ORDER_OFFSET: expected a non-negative integer, got '") +
                                text + "'");
  return value;
}

int64_t* HostExecutor::allocate(int64_t words) {
  blocks_.emplace_back(new int64_t[static_cast<size_t>(std::max<int64_t>(words, 1))]());
  return blocks_.back().get();
}

const int64_t* HostExecutor::upload(const std::vector<int64_t>& words) {
  uploaded_ = words;
  return uploaded_.data();
}

void HostExecutor::copy_to_device(int64_t* dst, const int64_t* src, int64_t words) {
  std::copy(src, src + words, dst);
}

void HostExecutor::copy_to_host(int64_t* dst, const int64_t* src, int64_t words) {
  ++waits_;
  std::copy(src, src + words, dst);
}

void HostExecutor::start_readback(const int64_t* src, int64_t words) { readback_.assign(src, src + words); }

const int64_t* HostExecutor::finish_readback() {
  ++waits_;
  return readback_.data();
}

void HostExecutor::select_pages(const dev::StateWord* state, int64_t num_pages, dev::StateWord a, dev::StateWord b,
                                int64_t* out, int64_t* count) {
  int64_t n = 0;
  for (int64_t p = 1; p <= num_pages; ++p)
    if (state[p] == a || state[p] == b) out[n++] = p;
  *count = n;
}

// A GPU runs an op's elements in no fixed order, so the host cycles through three
// orders from one launch to the next: ascending, descending, and a stride that
// interleaves elements far apart. An op whose result depends on the order of its
// elements then fails the emulated tests. Each order is a walk i -> (i + step) mod n
// with step coprime to n, which visits every element once. The offset shifts which
// launch gets which order, where a strided walk starts, and (every third offset) its stride.
HostExecutor::ElementOrder HostExecutor::next_order(int64_t n) {
  const int64_t kind = launches_++ % 3;
  if (n <= 1 || kind == 0) return ElementOrder{n, 0, 1};
  if (kind == 1) return ElementOrder{n, n - 1, n - 1};
  // Far from 1 and from n - 1: about 5n/8 to 7n/8.
  int64_t step = std::max<int64_t>(1, n / 2 + n / 8 + order_offset_ / 3 % std::max<int64_t>(1, n / 4));
  while (std::gcd(step, n) != 1) ++step;
  return ElementOrder{n, launches_ % n, step};
}

#define SWA_DEFINE_RUN(Op) \
  void HostExecutor::run(int64_t n, const Op& op) { next_order(n).for_each(op); }
SWA_DEVICE_OPS(SWA_DEFINE_RUN)
#undef SWA_DEFINE_RUN

}  // namespace swa
