// Copies of the device's error record on their way to the host, read without waiting
// (Executor::watch_errors / landed_errors, csrc/core/executor.h). Each copy goes into
// a pinned host slot of its own, enqueued behind the work so far, and an event marks
// it; a slot is read only once its event says the copy has landed, and written again
// only then, so the host never waits. Copies land in the order they were enqueued
// (the executor's work is one sequence, whichever streams it runs on). When every slot
// is in flight the device is that many calls behind, and watch() enqueues nothing.
//
// Torch-free and CUDA-free, like staging_ring.h: the device is CudaExecutor's adapter
// or a test's. Device must provide:
//   int64_t* alloc_host(int64_t words), void free_host(int64_t*)   pinned host memory
//   void copy_to_host_async(int64_t* dst, const int64_t* src, int64_t words)   enqueued
//   void mark(int slot)      records slot's event after the copy just enqueued
//   bool done(int slot)      whether slot's event has passed; never waits
//   void wait(int slot)      waits for slot's event
#pragma once

#include <array>
#include <cstdint>

namespace swa {
namespace cuda {

template <class Device, int kSlots = 4>
class ErrorWatch {
 public:
  ErrorWatch(Device& device, int64_t words) : device_(device), words_(words) {}
  ErrorWatch(const ErrorWatch&) = delete;
  ErrorWatch& operator=(const ErrorWatch&) = delete;
  // Frees the pinned slots; the owner first waits for their copies (drain()).
  ~ErrorWatch() {
    for (Slot& slot : slots_)
      if (slot.host != nullptr) device_.free_host(slot.host);
  }

  void watch(const int64_t* record) {
    if (in_flight_ == kSlots) return;
    const int k = (oldest_ + in_flight_) % kSlots;
    Slot& slot = slots_[k];
    if (slot.host == nullptr) slot.host = device_.alloc_host(words_);
    device_.copy_to_host_async(slot.host, record, words_);
    device_.mark(k);
    slot.counts = true;
    ++in_flight_;
  }

  // The newest copy that has landed since the last call, or null. Valid until the next watch().
  const int64_t* landed() {
    const int64_t* newest = nullptr;
    while (in_flight_ > 0 && device_.done(oldest_)) {
      if (slots_[oldest_].counts) newest = slots_[oldest_].host;
      oldest_ = (oldest_ + 1) % kSlots;
      --in_flight_;
    }
    return newest;
  }

  // The copies in flight no longer count (the record was cleared behind them).
  void forget() {
    for (Slot& slot : slots_) slot.counts = false;
  }

  // Waits for every copy in flight (before the slots are freed).
  void drain() {
    for (; in_flight_ > 0; --in_flight_, oldest_ = (oldest_ + 1) % kSlots) device_.wait(oldest_);
  }

  static constexpr int slots() { return kSlots; }

 private:
  struct Slot {
    int64_t* host = nullptr;
    bool counts = false;
  };
  Device& device_;
  int64_t words_;
  std::array<Slot, kSlots> slots_{};
  int oldest_ = 0, in_flight_ = 0;
};

}  // namespace cuda
}  // namespace swa
