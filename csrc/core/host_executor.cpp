#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>

#include "executor.h"

namespace swa {

struct ElementThreads::State {
  std::mutex mutex;
  std::condition_variable start, done;
  const std::function<void(int)>* body = nullptr;
  int width = 0;
  int64_t launch = 0;
  bool stopping = false;
  std::atomic<int> arrived{0}, running{0};
  std::vector<std::thread> threads;

  void serve(int t) {
    int64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* work;
      int launch_width;
      {
        std::unique_lock<std::mutex> hold(mutex);
        start.wait(hold, [this, seen] { return stopping || launch != seen; });
        if (stopping) return;
        seen = launch;
        if (t >= width) continue;  // not needed for this launch
        work = body;
        launch_width = width;
      }
      // No element runs before every thread of the launch has left the lock: a thread
      // that finished and took it again would order its writes before the others'
      // elements, running them one after another and hiding their races from
      // ThreadSanitizer.
      arrived.fetch_add(1, std::memory_order_acq_rel);
      while (arrived.load(std::memory_order_acquire) < launch_width) std::this_thread::yield();
      (*work)(t);
      if (running.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> hold(mutex);
        done.notify_one();
      }
    }
  }
};

ElementThreads::ElementThreads(int count) : state_(std::make_unique<State>()) {
  for (int t = 0; t < count; ++t) state_->threads.emplace_back([this, t] { state_->serve(t); });
}

ElementThreads::~ElementThreads() {
  {
    std::lock_guard<std::mutex> hold(state_->mutex);
    state_->stopping = true;
  }
  state_->start.notify_all();
  for (std::thread& thread : state_->threads) thread.join();
}

void ElementThreads::run(int width, const std::function<void(int)>& body) {
  State& s = *state_;
  std::unique_lock<std::mutex> hold(s.mutex);
  s.body = &body;
  s.width = width;
  s.arrived.store(0, std::memory_order_relaxed);
  s.running.store(width, std::memory_order_relaxed);
  ++s.launch;
  s.start.notify_all();
  s.done.wait(hold, [&s] { return s.running.load(std::memory_order_acquire) == 0; });
  s.body = nullptr;
}

HostExecutor::HostExecutor(int64_t order_offset, int threads)
    : order_offset_(order_offset), launches_(order_offset), threads_(threads) {
  if (order_offset < 0) throw std::invalid_argument("order_offset: must be >= 0, got " + std::to_string(order_offset));
  if (threads != 0 && (threads < kMinThreads || threads > kMaxThreads))
    throw std::invalid_argument("threads: expected 0 or " + std::to_string(kMinThreads) + " to " +
                                std::to_string(kMaxThreads) + ", got " + std::to_string(threads));
  if (threads > 0) element_threads_ = std::make_unique<ElementThreads>(threads);
}

HostExecutor::~HostExecutor() = default;

namespace {

// A non-negative integer from the environment variable `name`; 0 when it is unset or empty.
int64_t count_from_env(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || text[0] == '\0') return 0;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (*end != '\0' || value < 0)
    throw std::invalid_argument(std::string(name) + ": expected a non-negative integer, got '" + text + "'");
  return value;
}

}  // namespace

int64_t HostExecutor::order_offset_from_env() { return count_from_env("SWA_EXT_EMULATED_ORDER_OFFSET"); }

int HostExecutor::threads_from_env() {
  const int64_t threads = count_from_env("SWA_EXT_EMULATED_THREADS");
  if (threads != 0 && (threads < kMinThreads || threads > kMaxThreads))
    throw std::invalid_argument("SWA_EXT_EMULATED_THREADS: expected 0 or " + std::to_string(kMinThreads) + " to " +
                                std::to_string(kMaxThreads) + ", got " + std::to_string(threads));
  return static_cast<int>(threads);
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

// Every launch has run by the time the host goes on: a copy lands at once.
void HostExecutor::watch_errors(const int64_t* record) {
  watched_.assign(record, record + dev::kErrWords);
  watched_landed_ = true;
}

const int64_t* HostExecutor::landed_errors() {
  if (!watched_landed_) return nullptr;
  watched_landed_ = false;
  return watched_.data();
}

void HostExecutor::forget_errors() { watched_landed_ = false; }

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
  void HostExecutor::run(int64_t n, const Op& op) { run_elements(n, op); }
SWA_DEVICE_OPS(SWA_DEFINE_RUN)
#undef SWA_DEFINE_RUN

}  // namespace swa
