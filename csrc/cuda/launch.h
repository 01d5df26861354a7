// Launchers of the device allocator's ops as CUDA kernels, one kernel per op, on the
// caller's stream; each returns its launch's status. Raw pointers only: no torch header
// reaches the .cu file.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "../core/device_ops.h"

namespace swa {
namespace cuda {

#define SWA_DECLARE_LAUNCH(Op) cudaError_t launch(int64_t n, const Op& op, cudaStream_t stream);
SWA_DEVICE_OPS(SWA_DECLARE_LAUNCH)
#undef SWA_DECLARE_LAUNCH

// Scratch that select_pages needs for a pool of num_pages pages.
size_t select_scratch_bytes(int64_t num_pages);
// The ids p in [1, num_pages] whose state is a or b, ascending, and their number.
cudaError_t select_pages(const dev::StateWord* state, int64_t num_pages, dev::StateWord a, dev::StateWord b,
                         int64_t* out, int64_t* count, void* scratch, size_t scratch_bytes, cudaStream_t stream);

}  // namespace cuda
}  // namespace swa
