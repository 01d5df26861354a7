// Runs the device allocator's ops on a GPU: device memory from torch's caching
// allocator, kernels (csrc/cuda) on torch's current stream, host inputs through pinned
// memory so no copy waits, and count read-backs through a pinned buffer and an event.
#include "cuda_executor.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "../cuda/launch.h"

namespace swa {
namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

class CudaExecutor : public Executor {
 public:
  explicit CudaExecutor(const c10::Device& device) : device_(device) {
    c10::cuda::CUDAGuard guard(device_);
    readback_ = at::empty({kReadbackWords}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  }

  // The pinned read-back buffer goes back to torch's host allocator, which does not
  // know of our copy into it: let a copy in flight land first.
  ~CudaExecutor() override { readback_done_.synchronize(); }
  const char* kernels() const override { return "cuda"; }

  int64_t* allocate(int64_t words) override {
    c10::cuda::CUDAGuard guard(device_);
    blocks_.push_back(at::zeros({std::max<int64_t>(words, 1)}, at::TensorOptions().dtype(at::kLong).device(device_)));
    return blocks_.back().data_ptr<int64_t>();
  }

  const int64_t* upload(const std::vector<int64_t>& words) override {
    c10::cuda::CUDAGuard guard(device_);
    const int64_t n = static_cast<int64_t>(words.size());
    // Pinned staging from torch's host allocator, which keeps the block until the copy is done.
    at::Tensor host = at::empty({n}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    std::memcpy(host.data_ptr<int64_t>(), words.data(), sizeof(int64_t) * n);
    uploaded_ = at::empty({n}, at::TensorOptions().dtype(at::kLong).device(device_));
    uploaded_.copy_(host, /*non_blocking=*/true);
    return uploaded_.data_ptr<int64_t>();
  }

  void copy_to_device(int64_t* dst, const int64_t* src, int64_t words) override {
    blocking_copy(dst, src, words, cudaMemcpyHostToDevice);
  }

  void copy_to_host(int64_t* dst, const int64_t* src, int64_t words) override {
    blocking_copy(dst, src, words, cudaMemcpyDeviceToHost);
  }

  void start_readback(const int64_t* src, int64_t words) override {
    if (words > kReadbackWords) throw std::logic_error("swa_ext: read-back larger than its buffer");
    c10::cuda::CUDAGuard guard(device_);
    const at::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream(device_.index());
    check(cudaMemcpyAsync(readback_.data_ptr<int64_t>(), src, sizeof(int64_t) * words, cudaMemcpyDeviceToHost, stream),
          "swa_ext read-back");
    readback_done_.record(stream);
  }

  const int64_t* finish_readback() override {
    readback_done_.synchronize();
    ++waits_;
    return readback_.data_ptr<int64_t>();
  }

  void select_pages(const dev::StateWord* state, int64_t num_pages, dev::StateWord a, dev::StateWord b, int64_t* out,
                    int64_t* count) override {
    c10::cuda::CUDAGuard guard(device_);
    const size_t bytes = cuda::select_scratch_bytes(num_pages);
    if (!scratch_.defined() || static_cast<size_t>(scratch_.numel()) < bytes)
      scratch_ = at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(device_));
    cuda::select_pages(state, num_pages, a, b, out, count, scratch_.data_ptr(), bytes, stream());
  }

#define SWA_DEFINE_RUN(Op)                          \
  void run(int64_t n, const Op& op) override {      \
    c10::cuda::CUDAGuard guard(device_);            \
    cuda::launch(n, op, stream());                  \
  }
  SWA_DEVICE_OPS(SWA_DEFINE_RUN)
#undef SWA_DEFINE_RUN

 private:
  static constexpr int64_t kReadbackWords = 64;
  void blocking_copy(int64_t* dst, const int64_t* src, int64_t words, cudaMemcpyKind kind) {
    c10::cuda::CUDAGuard guard(device_);
    const cudaStream_t s = stream();
    check(cudaMemcpyAsync(dst, src, sizeof(int64_t) * words, kind, s), "swa_ext copy");
    check(cudaStreamSynchronize(s), "swa_ext copy");
    ++waits_;
  }
  cudaStream_t stream() const { return at::cuda::getCurrentCUDAStream(device_.index()).stream(); }

  c10::Device device_;
  std::vector<at::Tensor> blocks_;
  at::Tensor uploaded_, readback_, scratch_;
  at::cuda::CUDAEvent readback_done_;
};

}  // namespace

std::shared_ptr<Executor> make_cuda_executor(const c10::Device& device) {
  return std::make_shared<CudaExecutor>(device);
}

}  // namespace swa
