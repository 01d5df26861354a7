// Runs the device allocator's ops on a GPU: device memory from torch's caching
// allocator, kernels (csrc/cuda) on torch's current stream, host inputs through a
// persistent pinned staging ring (csrc/cuda/staging_ring.h) so that an upload neither
// allocates nor waits, count read-backs through a pinned buffer and an event, and the
// error record watched through pinned copies read when they have landed
// (csrc/cuda/error_watch.h), so that a caller's misuse surfaces without a wait.
//
// Errors: every CUDA status is read where its call returns (a launch's own return
// value, never a stale cudaGetLastError()), and an error names the last op this
// allocator launched, since an asynchronous fault surfaces only at a later wait.
// Waits release the GIL. The destructor never throws: a fault found there is logged.
#include "cuda_executor.h"

#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "../cuda/error_watch.h"
#include "../cuda/event_query.h"
#include "../cuda/launch.h"
#include "../cuda/staging_ring.h"

namespace swa {
namespace {

std::atomic<int> waiting_threads{0};
thread_local bool waits_release_gil = false;

// Drops the GIL for a wait on the GPU, where WaitsReleaseGil allows it and the thread
// holds it, so that other Python threads run meanwhile. The count of waiting threads
// changes while this thread holds the GIL.
class GilReleased {
 public:
  GilReleased() {
    if (!waits_release_gil || !Py_IsInitialized() || !PyGILState_Check()) return;
    waiting_threads.fetch_add(1, std::memory_order_release);
    saved_ = PyEval_SaveThread();
  }
  ~GilReleased() {
    if (saved_ == nullptr) return;
    PyEval_RestoreThread(saved_);
    waiting_threads.fetch_sub(1, std::memory_order_release);
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* saved_ = nullptr;
};

// A CUDA event without timing; destroyed without a check (a destructor must not throw).
class Event {
 public:
  Event() {
    const cudaError_t status = cudaEventCreateWithFlags(&event_, cudaEventDisableTiming);
    if (status != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error(std::string("swa_ext: cannot create a CUDA event: ") + cudaGetErrorString(status));
    }
  }
  ~Event() { cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// The CUDA runtime as event_query.h asks it.
struct CudaRuntime {
  using Status = cudaError_t;
  static constexpr Status kSuccess = cudaSuccess, kNotReady = cudaErrorNotReady;
  Status query(cudaEvent_t event) const { return cudaEventQuery(event); }
  void clear_last_error() const { cudaGetLastError(); }
};

class CudaExecutor : public Executor {
 public:
  // Constructed with device current (make_cuda_executor), so that the events belong to it.
  explicit CudaExecutor(const c10::Device& device)
      : device_(device), home_(at::cuda::getCurrentCUDAStream(device.index())), last_stream_(home_.stream()),
        ring_(*this), watch_device_{*this}, watch_(watch_device_, dev::kErrWords) {
    readback_ = static_cast<int64_t*>(alloc_host_bytes(sizeof(int64_t) * kReadbackWords));
  }

  ~CudaExecutor() override {
    // Pinned memory goes back to the driver below, and device memory to torch's caching
    // allocator, which hands it out again in the order of the stream it was taken on
    // (home_): let the copies from pinned memory land, and order home_ after our last work.
    try {
      c10::cuda::CUDAGuard guard(device_);
      ring_.drain();
      watch_.drain();
      if (readback_pending_) wait_for(readback_done_.get(), "read-back");
      join(home_.stream());
    } catch (const std::exception& e) {
      static std::atomic<bool> warned{false};
      if (!warned.exchange(true))
        std::fprintf(stderr, "swa_ext: a CUDA allocator was freed after a device fault: %s\n", e.what());
    }
    cudaFreeHost(readback_);
  }

  const char* kernels() const override { return "cuda"; }

  int64_t* allocate(int64_t words) override {
    c10::cuda::CUDAGuard guard(device_);
    at::Tensor block = device_tensor(words);
    check(cudaMemsetAsync(block.data_ptr(), 0, block.nbytes(), stream()), "zeroing device memory");
    return block.data_ptr<int64_t>();
  }

  const int64_t* upload(const std::vector<int64_t>& words) override {
    c10::cuda::CUDAGuard guard(device_);
    current_ = stream();
    return ring_.upload(words.data(), static_cast<int64_t>(words.size()));
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
    const cudaStream_t s = stream();
    check(cudaMemcpyAsync(readback_, src, sizeof(int64_t) * words, cudaMemcpyDeviceToHost, s), "read-back");
    check(cudaEventRecord(readback_done_.get(), s), "read-back");
    readback_pending_ = true;
  }

  const int64_t* finish_readback() override {
    c10::cuda::CUDAGuard guard(device_);
    readback_pending_ = false;
    wait_for(readback_done_.get(), "read-back");
    ++waits_;
    return readback_;
  }

  void watch_errors(const int64_t* record) override {
    c10::cuda::CUDAGuard guard(device_);
    watch_.watch(record);
  }

  const int64_t* landed_errors() override { return watch_.landed(); }

  void forget_errors() override { watch_.forget(); }

  void select_pages(const dev::StateWord* state, int64_t num_pages, dev::StateWord a, dev::StateWord b, int64_t* out,
                    int64_t* count) override {
    c10::cuda::CUDAGuard guard(device_);
    const cudaStream_t s = stream();
    const size_t bytes = cuda::select_scratch_bytes(num_pages);
    if (scratch_bytes_ < bytes) {
      scratch_ = device_tensor(static_cast<int64_t>((bytes + sizeof(int64_t) - 1) / sizeof(int64_t))).data_ptr();
      scratch_bytes_ = bytes;
    }
    check(cuda::select_pages(state, num_pages, a, b, out, count, scratch_, bytes, s), "launch of select_pages");
    last_op_ = "select_pages";
  }

#define SWA_DEFINE_RUN(Op)                                \
  void run(int64_t n, const Op& op) override {            \
    c10::cuda::CUDAGuard guard(device_);                  \
    const cudaStream_t s = stream();                      \
    check(cuda::launch(n, op, s), "launch of " #Op);      \
    last_op_ = #Op;                                       \
  }
  SWA_DEVICE_OPS(SWA_DEFINE_RUN)
#undef SWA_DEFINE_RUN

 private:
  friend class cuda::StagingRing<CudaExecutor>;
  static constexpr int64_t kReadbackWords = 64;

  // The staging ring's device (staging_ring.h): copies on the stream of the upload.
  int64_t* alloc_host(int64_t words) { return static_cast<int64_t*>(alloc_host_bytes(sizeof(int64_t) * words)); }
  void free_host(int64_t* block) { cudaFreeHost(block); }  // only blocks whose copies ran
  int64_t* alloc_device(int64_t words) { return device_tensor(words).data_ptr<int64_t>(); }
  void copy_async(int64_t* dst, const int64_t* src, int64_t words) {
    check(cudaMemcpyAsync(dst, src, sizeof(int64_t) * words, cudaMemcpyHostToDevice, current_), "upload");
  }
  void mark(int slot) { check(cudaEventRecord(slot_done_[slot].get(), current_), "upload"); }
  void wait(int slot) {  // a slot is due again: the GPU is that many uploads behind the host
    if (passed(slot_done_[slot].get(), "upload")) return;
    ++waits_;
    wait_for(slot_done_[slot].get(), "upload");
  }

  // The error watch's device (error_watch.h): copies on the current stream.
  struct WatchDevice {
    CudaExecutor& exec;
    int64_t* alloc_host(int64_t words) { return exec.alloc_host(words); }
    void free_host(int64_t* block) { cudaFreeHost(block); }
    void copy_to_host_async(int64_t* dst, const int64_t* src, int64_t words) {
      exec.watch_stream_ = exec.stream();
      exec.check(cudaMemcpyAsync(dst, src, sizeof(int64_t) * words, cudaMemcpyDeviceToHost, exec.watch_stream_),
                 "error record copy");
    }
    void mark(int slot) {
      exec.check(cudaEventRecord(exec.watch_done_[slot].get(), exec.watch_stream_), "error record copy");
    }
    bool done(int slot) { return exec.passed(exec.watch_done_[slot].get(), "error record copy"); }
    void wait(int slot) { exec.wait_for(exec.watch_done_[slot].get(), "error record copy"); }
  };

  // Whether event has passed, without waiting (and without leaving "not ready" behind).
  bool passed(cudaEvent_t event, const char* what) const {
    return cuda::event_passed(runtime_, event, [this, what](cudaError_t status) { check(status, what); });
  }

  void* alloc_host_bytes(size_t bytes) {
    void* block = nullptr;
    check(cudaHostAlloc(&block, bytes, cudaHostAllocDefault), "pinned allocation");
    return block;
  }

  // Device memory for the executor's life, taken on home_ (torch's caching allocator
  // hands a block out again in home_'s order): a current stream other than home_ first
  // waits for home_, whose work may still use the block's last owner.
  at::Tensor device_tensor(int64_t words) {
    c10::cuda::CUDAGuard guard(device_);
    at::Tensor block;
    {
      c10::cuda::CUDAStreamGuard on_home(home_);
      block = at::empty({std::max<int64_t>(words, 1)}, at::TensorOptions().dtype(at::kLong).device(device_));
    }
    blocks_.push_back(block);
    const cudaStream_t s = stream();
    if (s != home_.stream()) {
      check(cudaEventRecord(stream_switch_.get(), home_.stream()), "stream switch");
      check(cudaStreamWaitEvent(s, stream_switch_.get(), 0), "stream switch");
    }
    return block;
  }

  // The current stream, after the work this allocator enqueued on another stream: the
  // allocator's state is one sequence of ops, whichever streams its calls run on.
  cudaStream_t stream() {
    const cudaStream_t s = at::cuda::getCurrentCUDAStream(device_.index()).stream();
    if (s != last_stream_) join(s);
    return s;
  }

  // Makes s wait for the work enqueued on last_stream_.
  void join(cudaStream_t s) {
    if (s == last_stream_) return;
    check(cudaEventRecord(stream_switch_.get(), last_stream_), "stream switch");
    check(cudaStreamWaitEvent(s, stream_switch_.get(), 0), "stream switch");
    last_stream_ = s;
  }

  void blocking_copy(int64_t* dst, const int64_t* src, int64_t words, cudaMemcpyKind kind) {
    c10::cuda::CUDAGuard guard(device_);
    const cudaStream_t s = stream();
    check(cudaMemcpyAsync(dst, src, sizeof(int64_t) * words, kind, s), "copy");
    cudaError_t status;
    {
      GilReleased unlocked;
      status = cudaStreamSynchronize(s);
    }
    check(status, "copy");
    ++waits_;
  }

  void wait_for(cudaEvent_t event, const char* what) {
    cudaError_t status;
    {
      GilReleased unlocked;
      status = cudaEventSynchronize(event);
    }
    check(status, what);
  }

  // Raises a failed CUDA call, naming what this allocator launched last: a fault in a
  // kernel shows only at a later call. A non-sticky error is cleared so that it does not
  // surface again in someone else's call.
  void check(cudaError_t status, const char* what) const {
    if (status == cudaSuccess) return;
    cudaGetLastError();
    throw std::runtime_error(std::string("swa_ext CUDA ") + what + ": " + cudaGetErrorName(status) + ": " +
                             cudaGetErrorString(status) + " (the last op this allocator launched: " + last_op_ + ")");
  }

  c10::Device device_;
  c10::cuda::CUDAStream home_;  // the stream current at construction; device memory is taken on it
  cudaStream_t last_stream_;  // where this allocator's last work went
  cudaStream_t current_ = nullptr;  // the stream of the upload in progress
  const char* last_op_ = "none";
  std::vector<at::Tensor> blocks_;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  int64_t* readback_ = nullptr;
  bool readback_pending_ = false;
  Event readback_done_, stream_switch_;
  Event slot_done_[cuda::StagingRing<CudaExecutor>::slots()];
  Event watch_done_[cuda::ErrorWatch<WatchDevice>::slots()];
  cudaStream_t watch_stream_ = nullptr;  // of the error record copy in progress
  CudaRuntime runtime_;
  cuda::StagingRing<CudaExecutor> ring_;  // freed before the events, after the destructor drained it
  WatchDevice watch_device_;
  cuda::ErrorWatch<WatchDevice> watch_;
};

}  // namespace

WaitsReleaseGil::WaitsReleaseGil() : outer_(waits_release_gil) { waits_release_gil = true; }
WaitsReleaseGil::~WaitsReleaseGil() { waits_release_gil = outer_; }
int threads_waiting_for_gpu() { return waiting_threads.load(std::memory_order_acquire); }

std::shared_ptr<Executor> make_cuda_executor(const c10::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  return std::make_shared<CudaExecutor>(device);
}

}  // namespace swa
