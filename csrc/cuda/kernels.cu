// The device allocator's ops as CUDA kernels: each op's operator()(i) (device_ops.h)
// runs once per element in a grid-stride loop, and the state scans use CUB.
#include <cub/device/device_select.cuh>
#include <thrust/iterator/counting_iterator.h>

#include <stdexcept>
#include <string>

#include "launch.h"

namespace swa {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // enough to fill an H200; the loop strides over the rest

template <class Op>
__global__ void for_each_element(int64_t n, Op op) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) op(i);
}

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

// The launch's own status: cudaGetLastError() after a <<<>>> launch could return an
// error an earlier, unrelated call left behind.
template <class Op>
cudaError_t launch_op(int64_t n, const Op& op, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks);
  Op arg = op;
  void* args[] = {&n, &arg};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&for_each_element<Op>), dim3(static_cast<unsigned>(blocks)),
                          dim3(kThreads), args, 0, stream);
}

struct StateIs {
  const dev::StateWord* state;
  dev::StateWord a, b;
  __host__ __device__ bool operator()(int64_t page) const {
    const dev::StateWord s = state[page];
    return s == a || s == b;
  }
};

}  // namespace

#define SWA_DEFINE_LAUNCH(Op) \
  cudaError_t launch(int64_t n, const Op& op, cudaStream_t stream) { return launch_op(n, op, stream); }
SWA_DEVICE_OPS(SWA_DEFINE_LAUNCH)
#undef SWA_DEFINE_LAUNCH

size_t select_scratch_bytes(int64_t num_pages) {
  size_t bytes = 0;
  check(cub::DeviceSelect::If(nullptr, bytes, thrust::counting_iterator<int64_t>(1), static_cast<int64_t*>(nullptr),
                              static_cast<int64_t*>(nullptr), num_pages, StateIs{nullptr, 0, 0}),
        "swa_ext select scratch");
  return bytes;
}

cudaError_t select_pages(const dev::StateWord* state, int64_t num_pages, dev::StateWord a, dev::StateWord b,
                         int64_t* out, int64_t* count, void* scratch, size_t scratch_bytes, cudaStream_t stream) {
  // CUB reads its launches' status with cudaPeekAtLastError(): clear an error an earlier
  // call left behind, so that only this launch's own error counts (a fault that stuck stays).
  cudaGetLastError();
  return cub::DeviceSelect::If(scratch, scratch_bytes, thrust::counting_iterator<int64_t>(1), out, count, num_pages,
                               StateIs{state, a, b}, stream);
}

}  // namespace cuda
}  // namespace swa
