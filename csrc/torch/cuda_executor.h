// The executor of CUDA allocators (compiled only into CUDA builds).
#pragma once

#include <c10/core/Device.h>

#include <memory>

#include "../core/executor.h"

namespace swa {
std::shared_ptr<Executor> make_cuda_executor(const c10::Device& device);

// While one lives on a thread, that thread's waits for the GPU release the GIL. The
// bindings' concurrency guard holds one: no other thread's call on the allocator runs
// beside such a call; it waits for it (threads_waiting_for_gpu()).
class WaitsReleaseGil {
 public:
  WaitsReleaseGil();
  ~WaitsReleaseGil();
  WaitsReleaseGil(const WaitsReleaseGil&) = delete;
  WaitsReleaseGil& operator=(const WaitsReleaseGil&) = delete;

 private:
  bool outer_;
};
// How many threads wait for the GPU with the GIL released.
int threads_waiting_for_gpu();
}  // namespace swa
