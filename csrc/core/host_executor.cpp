#include <algorithm>

#include "executor.h"

namespace swa {

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

// A GPU runs an op's elements in no fixed order, so the host alternates between
// ascending and descending order from one launch to the next: an op whose result
// depends on the order of its elements then fails the emulated tests.
#define SWA_DEFINE_RUN(Op)                                      \
  void HostExecutor::run(int64_t n, const Op& op) {             \
    descending_ = !descending_;                                 \
    if (descending_) {                                          \
      for (int64_t i = n - 1; i >= 0; --i) op(i);               \
    } else {                                                    \
      for (int64_t i = 0; i < n; ++i) op(i);                    \
    }                                                           \
  }
SWA_DEVICE_OPS(SWA_DEFINE_RUN)
#undef SWA_DEFINE_RUN

}  // namespace swa
