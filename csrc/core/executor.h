// Where the device allocator's ops run and its memory lives. The CUDA executor (in the
// binding layer, kernels in csrc/cuda) launches each op as one kernel on the current
// stream; HostExecutor runs them element by element on the CPU, which lets the tests
// replay every trace through the device algorithm on a machine without a GPU.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "device_ops.h"

namespace swa {

class Executor {
 public:
  virtual ~Executor() = default;
  // What runs the ops, as the allocator's `kernels` property names it.
  virtual const char* kernels() const = 0;
  // Zeroed device memory that lives as long as the executor.
  virtual int64_t* allocate(int64_t words) = 0;
  // Host values in device memory, valid for the ops enqueued before the next upload.
  virtual const int64_t* upload(const std::vector<int64_t>& words) = 0;
  // Blocking copies, for state snapshots and restores (not on the hot path).
  virtual void copy_to_device(int64_t* dst, const int64_t* src, int64_t words) = 0;
  virtual void copy_to_host(int64_t* dst, const int64_t* src, int64_t words) = 0;
  // An asynchronous copy of device words to host memory, read by finish_readback()
  // after waiting for it. A new readback replaces one not yet finished.
  virtual void start_readback(const int64_t* src, int64_t words) = 0;
  virtual const int64_t* finish_readback() = 0;
  // The error record (dev::kErrWords words) watched without waiting: watch_errors()
  // enqueues a copy of it behind the work enqueued so far (or none while the device is
  // too far behind for another); landed_errors() returns the newest copy that has landed
  // since it last returned one, or null; forget_errors() drops the copies made so far
  // (the record was cleared behind them).
  virtual void watch_errors(const int64_t* record) = 0;
  virtual const int64_t* landed_errors() = 0;
  virtual void forget_errors() = 0;
  // The ids p in [1, num_pages] whose state is `a` or `b`, ascending, into out; their
  // number into *count (device memory).
  virtual void select_pages(const dev::StateWord* state, int64_t num_pages, dev::StateWord a, dev::StateWord b,
                            int64_t* out, int64_t* count) = 0;
#define SWA_DECLARE_RUN(Op) virtual void run(int64_t n, const Op& op) = 0;
  SWA_DEVICE_OPS(SWA_DECLARE_RUN)
#undef SWA_DECLARE_RUN
  // How many times the host waited for the device (readbacks and blocking copies).
  int64_t waits() const { return waits_; }

 protected:
  int64_t waits_ = 0;
};

// Threads kept for an executor's life and started together for each launch:
// run(width, body) runs body(0) .. body(width - 1) on that many threads at once and
// returns when all have returned; each launch's memory is ordered after the one
// before it, as a stream orders kernels.
class ElementThreads {
 public:
  explicit ElementThreads(int count);
  ~ElementThreads();
  ElementThreads(const ElementThreads&) = delete;
  ElementThreads& operator=(const ElementThreads&) = delete;
  void run(int width, const std::function<void(int)>& body);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Runs the ops on the CPU in host memory: a launch's elements one after another, or
// spread over several threads at once, as a GPU runs them (so that what a GPU does in
// parallel is done in parallel here, under ThreadSanitizer too).
class HostExecutor : public Executor {
 public:
  // order_offset shifts the element order of every launch (next_order), so that a test
  // run with another offset runs each launch of each test in another order. threads:
  // 0, one element after another; else at most that many (3 to 32) threads run each
  // launch, the number changing from launch to launch (3, 4, ..., threads, 3, ...), and
  // thread t takes the elements t, t + width, ... of the launch's order.
  explicit HostExecutor(int64_t order_offset = order_offset_from_env(), int threads = threads_from_env());
  ~HostExecutor() override;
  // SWA_EXT_EMULATED_ORDER_OFFSET, a non-negative integer; 0 when unset.
  static int64_t order_offset_from_env();
  // SWA_EXT_EMULATED_THREADS: 0 or unset, or 3 to 32.
  static int threads_from_env();
  static constexpr int kMinThreads = 3, kMaxThreads = 32;
  int threads() const { return threads_; }

  const char* kernels() const override { return "emulated"; }
  int64_t* allocate(int64_t words) override;
  const int64_t* upload(const std::vector<int64_t>& words) override;
  void copy_to_device(int64_t* dst, const int64_t* src, int64_t words) override;
  void copy_to_host(int64_t* dst, const int64_t* src, int64_t words) override;
  void start_readback(const int64_t* src, int64_t words) override;
  const int64_t* finish_readback() override;
  void watch_errors(const int64_t* record) override;
  const int64_t* landed_errors() override;
  void forget_errors() override;
  void select_pages(const dev::StateWord* state, int64_t num_pages, dev::StateWord a, dev::StateWord b, int64_t* out,
                    int64_t* count) override;
#define SWA_DECLARE_RUN(Op) void run(int64_t n, const Op& op) override;
  SWA_DEVICE_OPS(SWA_DECLARE_RUN)
#undef SWA_DECLARE_RUN

  // The order in which a launch runs its n elements: first, then (i + step) mod n after
  // i (see next_order()). Each next_order() is the order of one more launch.
  struct ElementOrder {
    int64_t n, first, step;
    template <class Visit>
    void for_each(const Visit& visit) const {
      for (int64_t k = 0, i = first; k < n; ++k, i = i + step >= n ? i + step - n : i + step) visit(i);
    }
    // The elements at positions from, from + stride, ... of the order.
    template <class Visit>
    void for_each_strided(int64_t from, int64_t stride, const Visit& visit) const {
      // step, stride and from are below n, a page count: their products fit in 64 bits.
      const int64_t advance = step * stride % n;
      int64_t i = (first + step * from) % n;
      for (int64_t k = from; k < n; k += stride, i = i + advance >= n ? i + advance - n : i + advance) visit(i);
    }
  };
  ElementOrder next_order(int64_t n);

  // Runs any op as run() runs the allocator's (tests plant ops of their own).
  template <class Op>
  void run_elements(int64_t n, const Op& op) {
    const ElementOrder order = next_order(n);
    if (element_threads_ == nullptr || n < 2) return order.for_each(op);
    const int64_t widths = threads_ - kMinThreads + 1;
    const int width = static_cast<int>(std::min<int64_t>(n, kMinThreads + (launches_ - order_offset_) % widths));
    element_threads_->run(width, [&order, &op, width](int t) { order.for_each_strided(t, width, op); });
  }

 private:
  std::vector<std::unique_ptr<int64_t[]>> blocks_;
  std::vector<int64_t> uploaded_, readback_, watched_;
  bool watched_landed_ = false;
  int64_t order_offset_;
  int64_t launches_;  // starts at order_offset_
  int threads_;
  std::unique_ptr<ElementThreads> element_threads_;
};

}  // namespace swa
