// The CUDA executor's staging ring (csrc/cuda/staging_ring.h) on a fake device whose
// copies run only when an event is waited for, as a stream behind the host would.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "../../csrc/cuda/staging_ring.h"
#include "fake_stream.h"

namespace {

using V = std::vector<int64_t>;

// The ring's device: one fake stream, whose copies run when an event is waited for.
struct FakeDevice : FakeStream {
  std::vector<std::unique_ptr<int64_t[]>> device_blocks;
  std::vector<int64_t*> host_live;
  int host_allocs = 0, device_allocs = 0, waits = 0;
  bool fail_waits = false;

  int64_t* alloc_host(int64_t words) {
    ++host_allocs;
    host_live.push_back(new int64_t[static_cast<size_t>(words)]);
    return host_live.back();
  }
  void free_host(int64_t* block) {
    // A block goes back only once every copy from it has run (after a fault none will).
    if (!fail_waits) {
      EXPECT_FALSE(pending_on(block)) << "freed under a pending copy";
    }
    host_live.erase(std::find(host_live.begin(), host_live.end(), block));
    delete[] block;
  }
  int64_t* alloc_device(int64_t words) {
    ++device_allocs;
    device_blocks.emplace_back(new int64_t[static_cast<size_t>(words)]());
    return device_blocks.back().get();
  }
  void copy_async(int64_t* dst, const int64_t* src, int64_t words) { enqueue(dst, src, words); }
  void wait(int slot) {
    ++waits;
    if (fail_waits) throw std::runtime_error("device fault");
    run_until(marks[slot]);
  }
  ~FakeDevice() {
    for (int64_t* block : host_live) delete[] block;
  }
};

using Ring = swa::cuda::StagingRing<FakeDevice, 4>;

V values(int64_t n, int64_t seed) {
  V v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), seed);
  return v;
}

}  // namespace

TEST(StagingRing, EachCopyReadsItsOwnValuesWhileTheDeviceLagsBehind) {
  FakeDevice device;
  {
    Ring ring(device);
    for (int64_t k = 0; k < 10; ++k) {  // more uploads than slots, the device never ahead
      const V v = values(5 + k, 100 * k);
      const int64_t* input = ring.upload(v.data(), static_cast<int64_t>(v.size()));
      EXPECT_NE(input, nullptr);
    }
    device.run_all();
    ASSERT_EQ(device.delivered.size(), 10u);
    for (int64_t k = 0; k < 10; ++k) EXPECT_EQ(device.delivered[static_cast<size_t>(k)], values(5 + k, 100 * k)) << k;
    ring.drain();
  }
}

TEST(StagingRing, ASlotIsRewrittenOnlyAfterItsCopyRan) {
  FakeDevice device;
  Ring ring(device);
  const V v = values(8, 1);
  for (int k = 0; k < Ring::slots(); ++k) ring.upload(v.data(), 8);
  EXPECT_EQ(device.waits, 0) << "a free slot was waited for";
  EXPECT_EQ(device.ran, 0u);
  ring.upload(v.data(), 8);  // slot 0 again: its copy must have run first
  EXPECT_EQ(device.waits, 1);
  EXPECT_GE(device.ran, 1u);
  device.run_all();
  ring.drain();
}

TEST(StagingRing, UploadsAllocateNothingOnceWarm) {
  FakeDevice device;
  Ring ring(device);
  const V big = values(4 * 2048 + 1, 0);
  for (int k = 0; k < Ring::slots(); ++k) ring.upload(big.data(), static_cast<int64_t>(big.size()));
  const int host = device.host_allocs, dev = device.device_allocs;
  EXPECT_EQ(host, Ring::slots());
  EXPECT_EQ(dev, 1);
  for (int64_t k = 0; k < 1000; ++k) {
    ring.upload(big.data(), 1 + (k * 37) % static_cast<int64_t>(big.size()));
    if (k % 7 == 0) device.run_all();
  }
  EXPECT_EQ(device.host_allocs, host);
  EXPECT_EQ(device.device_allocs, dev);
  device.run_all();
  ring.drain();
}

TEST(StagingRing, AGrownUploadKeepsTheValuesOfCopiesStillPending) {
  FakeDevice device;
  Ring ring(device);
  const V small = values(3, 7), big = values(5000, 11);
  for (int k = 0; k < Ring::slots(); ++k) ring.upload(small.data(), 3);
  const int64_t* first = ring.upload(big.data(), 5000);  // slot 0 grows after its copy ran; a new input buffer
  const int64_t* second = ring.upload(big.data(), 4000);  // slot 1 grows too
  EXPECT_EQ(first, second);
  device.run_all();
  ASSERT_EQ(device.delivered.size(), static_cast<size_t>(Ring::slots() + 2));
  for (int k = 0; k < Ring::slots(); ++k) EXPECT_EQ(device.delivered[static_cast<size_t>(k)], small);
  EXPECT_EQ(device.delivered.back(), V(big.begin(), big.begin() + 4000));
  EXPECT_TRUE(std::equal(big.begin(), big.begin() + 4000, second));
  ring.drain();
}

TEST(StagingRing, DrainWaitsForEveryCopyInFlight) {
  FakeDevice device;
  Ring ring(device);
  const V v = values(4, 3);
  ring.upload(v.data(), 4);
  ring.upload(v.data(), 4);
  ring.drain();
  EXPECT_EQ(device.ran, 2u);
  EXPECT_EQ(device.waits, 2);
  ring.drain();  // nothing left in flight
  EXPECT_EQ(device.waits, 2);
}

TEST(StagingRing, AFailedWaitLeavesTheSlotUnwritten) {
  FakeDevice device;
  Ring ring(device);
  const V v = values(4, 3), w = values(4, 50);
  for (int k = 0; k < Ring::slots(); ++k) ring.upload(v.data(), 4);
  device.fail_waits = true;
  EXPECT_THROW(ring.upload(w.data(), 4), std::runtime_error);
  EXPECT_EQ(device.queue.size(), static_cast<size_t>(Ring::slots())) << "a copy was enqueued after the fault";
  EXPECT_THROW(ring.drain(), std::runtime_error);
}
