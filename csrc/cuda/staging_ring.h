// Host values on their way to the device: a ring of pinned host slots and one device
// input buffer, kept for the allocator's life so that an upload allocates nothing. An
// upload writes the values into the next slot and enqueues one asynchronous copy from
// it into the input buffer, then marks the slot with an event. A slot is written again
// only once its event says that copy has run; the input buffer needs no such wait,
// since the copy and the ops that read it are ordered on one stream.
//
// Torch-free and CUDA-free: the device is a template parameter, CudaExecutor's (the
// CUDA runtime) or a test's, so that the ring's rules are tested without a GPU.
//
// Device must provide:
//   int64_t* alloc_host(int64_t words), void free_host(int64_t*)   pinned host memory
//   int64_t* alloc_device(int64_t words)                           lives as long as the device
//   void copy_async(int64_t* dst, const int64_t* src, int64_t words)   host to device, enqueued
//   void mark(int slot)         records slot's event after the copy just enqueued
//   void wait(int slot)         waits for slot's event; throws on a device fault
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>

namespace swa {
namespace cuda {

// kSlots: how many uploads the host may run ahead of the GPU before it waits.
template <class Device, int kSlots = 16>
class StagingRing {
 public:
  explicit StagingRing(Device& device) : device_(device) {}
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  // Frees the pinned slots; the owner first waits for their copies (drain()).
  ~StagingRing() {
    for (Slot& slot : slots_)
      if (slot.host != nullptr) device_.free_host(slot.host);
  }

  // words[0, n) in device memory, valid for the ops enqueued after it and before the
  // next upload.
  const int64_t* upload(const int64_t* words, int64_t n) {
    Slot& slot = slots_[next_];
    if (slot.in_flight) {
      device_.wait(next_);
      slot.in_flight = false;
    }
    if (slot.capacity < n) {  // its last copy has run: the old block can go
      const int64_t capacity = grown(slot.capacity, n);
      if (slot.host != nullptr) device_.free_host(slot.host);
      slot.host = nullptr, slot.capacity = 0;  // as it is if the allocation throws
      slot.host = device_.alloc_host(capacity);
      slot.capacity = capacity;
    }
    if (input_capacity_ < n) {  // ops enqueued before read the old buffer, which lives on
      input_capacity_ = grown(input_capacity_, n);
      input_ = device_.alloc_device(input_capacity_);
    }
    std::memcpy(slot.host, words, sizeof(int64_t) * static_cast<size_t>(n));
    device_.copy_async(input_, slot.host, n);
    device_.mark(next_);
    slot.in_flight = true;
    next_ = (next_ + 1) % kSlots;
    return input_;
  }

  // Waits for every copy in flight (before the slots are freed).
  void drain() {
    for (int k = 0; k < kSlots; ++k)
      if (slots_[k].in_flight) {
        slots_[k].in_flight = false;
        device_.wait(k);
      }
  }

  static constexpr int slots() { return kSlots; }

 private:
  struct Slot {
    int64_t* host = nullptr;
    int64_t capacity = 0;
    bool in_flight = false;
  };
  // Room for n words and more, so that a growing batch reallocates a few times only.
  static int64_t grown(int64_t capacity, int64_t n) { return std::max<int64_t>({n, 2 * capacity, 256}); }

  Device& device_;
  std::array<Slot, kSlots> slots_{};
  int next_ = 0;
  int64_t* input_ = nullptr;
  int64_t input_capacity_ = 0;
};

}  // namespace cuda
}  // namespace swa
