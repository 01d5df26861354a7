// The CUDA executor's error watch (csrc/cuda/error_watch.h) and event query
// (csrc/cuda/event_query.h) on fakes: a stream that runs copies only when told, and a
// runtime that keeps a last error the way the CUDA runtime does.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <vector>

#include "../../csrc/cuda/error_watch.h"
#include "../../csrc/cuda/event_query.h"
#include "fake_stream.h"

namespace {

using V = std::vector<int64_t>;

// The watch's device: one fake stream, whose copies run when the test lets it catch up.
struct FakeWatchDevice : FakeStream {
  std::vector<std::unique_ptr<int64_t[]>> host_blocks;
  int waits = 0;

  int64_t* alloc_host(int64_t words) {
    host_blocks.emplace_back(new int64_t[static_cast<size_t>(words)]());
    return host_blocks.back().get();
  }
  void free_host(int64_t* block) { EXPECT_FALSE(pending_on(block)) << "freed under a pending copy"; }
  void copy_to_host_async(int64_t* dst, const int64_t* src, int64_t words) { enqueue(dst, src, words); }
  bool done(int slot) { return passed(slot); }
  void wait(int slot) {
    ++waits;
    run_until(marks[slot]);
  }
};

using Watch = swa::cuda::ErrorWatch<FakeWatchDevice, 4>;

}  // namespace

TEST(ErrorWatch, ACopyIsReadOnlyOnceItLandedAndTheNewestLandedWins) {
  FakeWatchDevice stream;
  V record(4, 0);
  Watch watch(stream, 4);
  watch.watch(record.data());
  EXPECT_EQ(watch.landed(), nullptr) << "read before its copy ran";
  record[0] = 7;  // the device records an error behind the first copy
  watch.watch(record.data());
  stream.run_all();
  const int64_t* landed = watch.landed();
  ASSERT_NE(landed, nullptr);
  EXPECT_EQ(landed[0], 7);
  EXPECT_EQ(watch.landed(), nullptr) << "a copy handed out twice";
  EXPECT_EQ(stream.waits, 0);
}

TEST(ErrorWatch, WhenEverySlotIsInFlightNothingIsEnqueuedAndNothingWaits) {
  FakeWatchDevice stream;
  V record(4, 0);
  Watch watch(stream, 4);
  for (int k = 0; k < 10; ++k) watch.watch(record.data());
  EXPECT_EQ(stream.queue.size(), 4u);
  EXPECT_EQ(stream.waits, 0);
  stream.run_until(2);  // the device catches up with two calls
  EXPECT_NE(watch.landed(), nullptr);
  watch.watch(record.data());
  watch.watch(record.data());
  watch.watch(record.data());
  EXPECT_EQ(stream.queue.size(), 6u) << "two slots were free again";
  watch.drain();
  EXPECT_EQ(stream.ran, stream.queue.size());
}

TEST(ErrorWatch, CopiesMadeBeforeTheRecordWasClearedDoNotCount) {
  FakeWatchDevice stream;
  V record(4, 0);
  record[0] = 3;
  Watch watch(stream, 4);
  watch.watch(record.data());
  watch.forget();  // the host cleared the record behind this copy
  record[0] = 0;
  stream.run_all();
  EXPECT_EQ(watch.landed(), nullptr);
  watch.watch(record.data());
  stream.run_all();
  ASSERT_NE(watch.landed(), nullptr);
}

namespace {

// The CUDA runtime's way with a query: "not ready" is also left as the last error.
struct FakeRuntime {
  enum Status { kSuccess, kNotReady, kLaunchFailure };
  using Event = int;
  Status answer = kSuccess;
  Status last_error = kSuccess;
  Status query(Event) {
    if (answer != kSuccess) last_error = answer;
    return answer;
  }
  void clear_last_error() { last_error = kSuccess; }
};

}  // namespace

TEST(EventQuery, NotReadyLeavesNoLastErrorForTheNextCaller) {
  FakeRuntime runtime;
  const auto raise = [](FakeRuntime::Status) { throw std::runtime_error("device error"); };
  EXPECT_TRUE(swa::cuda::event_passed(runtime, 0, raise));
  runtime.answer = FakeRuntime::kNotReady;
  EXPECT_FALSE(swa::cuda::event_passed(runtime, 0, raise));
  EXPECT_EQ(runtime.last_error, FakeRuntime::kSuccess) << "torch's next launch check would report 'not ready'";
  runtime.answer = FakeRuntime::kLaunchFailure;
  EXPECT_THROW(swa::cuda::event_passed(runtime, 0, raise), std::runtime_error);
}
