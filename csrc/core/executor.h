// Where the device allocator's ops run and its memory lives. The CUDA executor (in the
// binding layer, kernels in csrc/cuda) launches each op as one kernel on the current
// stream; HostExecutor runs them element by element on the CPU, which lets the tests
// replay every trace through the device algorithm on a machine without a GPU.
#pragma once

#include <cstdint>
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

// Runs the ops on the CPU, one element after another, in host memory.
class HostExecutor : public Executor {
 public:
  // order_offset shifts the element order of every launch (next_order), so that a test
  // run with another offset runs each launch of each test in another order.
  explicit HostExecutor(int64_t order_offset = order_offset_from_env());
  // SWA_EXT_EMULATED_ORDER_OFFSET, a non-negative integer; 0 when unset.
  static int64_t order_offset_from_env();

  const char* kernels() const override { return "emulated"; }
  int64_t* allocate(int64_t words) override;
  const int64_t* upload(const std::vector<int64_t>& words) override;
  void copy_to_device(int64_t* dst, const int64_t* src, int64_t words) override;
  void copy_to_host(int64_t* dst, const int64_t* src, int64_t words) override;
  void start_readback(const int64_t* src, int64_t words) override;
  const int64_t* finish_readback() override;
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
  };
  ElementOrder next_order(int64_t n);

 private:
  std::vector<std::unique_ptr<int64_t[]>> blocks_;
  std::vector<int64_t> uploaded_, readback_;
  int64_t order_offset_;
  int64_t launches_;  // starts at order_offset_
};

}  // namespace swa
