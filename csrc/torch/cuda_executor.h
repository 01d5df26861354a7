// The executor of CUDA allocators (compiled only into CUDA builds).
#pragma once

#include <c10/core/Device.h>

#include <memory>

#include "../core/executor.h"

namespace swa {
std::shared_ptr<Executor> make_cuda_executor(const c10::Device& device);
}  // namespace swa
