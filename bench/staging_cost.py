"""The host cost of one upload (a call's batch layout on its way to the GPU), before and
after the persistent staging ring, on a machine without a GPU. Run from the source tree:

    python bench/staging_cost.py

Compiles a small torch extension with both paths and times them in one process,
alternating, medians of many uploads of the words an ``alloc_decode`` of batch B sends
(``4 B + 1``):

* ``per-call tensors`` (the old CudaExecutor::upload): a host tensor and a device tensor
  from torch's allocators through the dispatcher, the values copied into the first and
  ``copy_(non_blocking=True)`` into the second. Without a GPU both are CPU tensors: this
  measures the dispatcher's and the allocators' work, not CUDA's pinned allocator (its
  lock, event record and event queries) nor the driver's copy;
* ``staging ring`` (csrc/cuda/staging_ring.h as CudaExecutor uses it): the values
  copied into a persistent slot, the slot's bookkeeping, and the device's copy and event
  record, here counted but not issued.

The driver calls both paths make (one cudaMemcpyAsync; the ring's event record against
the old path's pinned-block event) are not measured.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

from torch.utils.cpp_extension import load_inline

ROOT = Path(__file__).resolve().parents[1]

SOURCE = r"""
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <vector>

#include "cuda/staging_ring.h"

namespace {

// The ring's device with its CUDA calls counted, not made.
struct CountingDevice {
  std::vector<std::unique_ptr<int64_t[]>> blocks;
  int64_t copies = 0, marks = 0, waits = 0;
  int64_t* alloc_host(int64_t words) { blocks.emplace_back(new int64_t[words]); return blocks.back().get(); }
  void free_host(int64_t*) {}
  int64_t* alloc_device(int64_t words) { return alloc_host(words); }
  void copy_async(int64_t*, const int64_t*, int64_t) { ++copies; }
  void mark(int) { ++marks; }
  void wait(int) { ++waits; }
};

int64_t sink = 0;

// The old upload, CPU tensors standing in for pinned and device ones.
const int64_t* tensor_upload(const std::vector<int64_t>& words, at::Tensor& uploaded) {
  const int64_t n = static_cast<int64_t>(words.size());
  at::Tensor host = at::empty({n}, at::TensorOptions().dtype(at::kLong));
  std::memcpy(host.data_ptr<int64_t>(), words.data(), sizeof(int64_t) * n);
  uploaded = at::empty({n}, at::TensorOptions().dtype(at::kLong));
  uploaded.copy_(host, /*non_blocking=*/true);
  return uploaded.data_ptr<int64_t>();
}

}  // namespace

// Median ns per upload of n words: {per-call tensors, staging ring}, alternating rounds.
std::vector<double> measure(int64_t n, int64_t rounds, int64_t per_round) {
  std::vector<int64_t> words(n);
  for (int64_t i = 0; i < n; ++i) words[i] = i * 7;
  CountingDevice device;
  swa::cuda::StagingRing<CountingDevice> ring(device);
  at::Tensor uploaded;
  std::vector<double> old_ns, ring_ns;
  for (int64_t r = 0; r < rounds; ++r) {
    for (int k = 0; k < 2; ++k) {
      const bool use_ring = (k == 0) == (r % 2 == 0);
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < per_round; ++i)
        sink += use_ring ? ring.upload(words.data(), n)[0] : tensor_upload(words, uploaded)[0];
      const auto t1 = std::chrono::steady_clock::now();
      (use_ring ? ring_ns : old_ns).push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / per_round);
    }
  }
  auto median = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  return {median(old_ns), median(ring_ns)};
}
"""


def main() -> int:
    module = load_inline("swa_staging_cost", cpp_sources=[SOURCE], functions=["measure"],
                         extra_include_paths=[str(ROOT / "csrc")], extra_cflags=["-O3"], verbose=False)
    print("Host cost of one upload, ns (median of 200 rounds of 100 uploads, alternating)\n")
    print("| batch | words | per-call tensors ns | staging ring ns | saved ns |")
    print("|---:|---:|---:|---:|---:|")
    for batch in (1, 16, 256, 2048):
        words = 4 * batch + 1
        old, ring = module.measure(words, 200, 100)
        print(f"| {batch} | {words} | {old:.0f} | {ring:.0f} | {old - ring:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
