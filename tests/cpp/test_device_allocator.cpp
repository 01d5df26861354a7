// The device allocator's host side and ops, run by HostExecutor, against the CPU core.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "allocator.h"
#include "device_store.h"

using namespace swa;
using V = std::vector<int64_t>;

namespace {

// The same calls on the CPU core and on the device algorithm (emulated on the host).
struct Pair {
  V cpu_mapping, dev_mapping;
  HybridAllocator cpu;
  std::shared_ptr<HostExecutor> exec;
  DeviceHybridStore* dev_store;
  HybridAllocator dev;
  // threads: the emulation's (HostExecutor); shares_list: the shared mode (size_swa == size).
  Pair(int64_t size, int64_t size_swa, int64_t ps, bool need_sort, bool debug = false, int threads = 0,
       bool shares_list = false)
      : cpu_mapping(static_cast<size_t>(HybridAllocator::mapping_size(size, size_swa, ps, shares_list))),
        dev_mapping(cpu_mapping.size()),
        cpu(std::make_unique<HostHybridStore>(size, size_swa, ps, need_sort, shares_list, ParentLayout{}, cpu_mapping.data(), len())),
        exec(std::make_shared<HostExecutor>(0, threads)),
        dev_store(new DeviceHybridStore(exec, size, size_swa, ps, need_sort, shares_list, debug, dev_mapping.data(), len())),
        dev(std::unique_ptr<HybridStore>(dev_store)) {}
  int64_t len() const { return static_cast<int64_t>(cpu_mapping.size()); }
  DeviceControl& control() { return dev_store->control(); }

  V extend(const V& prefix, const V& seq, const V& last, int64_t ext) {
    VectorOut a, b;
    const BatchLengths batch{prefix, seq, false};
    const bool ok = cpu.alloc_extend(batch, last, ext, a);
    EXPECT_EQ(ok, dev.alloc_extend(batch, last, ext, b));
    EXPECT_EQ(a.values, b.values);
    return ok ? a.values : V{};
  }
  V decode(const V& seq, const V& last) {
    VectorOut a, b;
    const BatchLengths batch{Span(), seq, true};
    const bool ok = cpu.alloc_decode(batch, last, a);
    EXPECT_EQ(ok, dev.alloc_decode(batch, last, b));
    EXPECT_EQ(a.values, b.values);
    return ok ? a.values : V{};
  }
  void expect_same() {
    EXPECT_EQ(cpu.available_size(), dev.available_size());
    EXPECT_EQ(cpu.full_used_size(), dev.full_used_size());
    EXPECT_EQ(cpu.swa_used_size(), dev.swa_used_size());
    EXPECT_TRUE(cpu.backup_state() == dev.backup_state());
    dev.check_invariants();
  }
};

V slice(const V& v, size_t begin, size_t end) { return V(v.begin() + begin, v.begin() + end); }

}  // namespace

// Allocations, decode, window eviction, a free group and frees of every kind, on both
// stores; shares_list: in the shared mode (one list of 40 pages), threads: the emulation's.
void expect_lifecycle_matches(bool shares_list, int threads) {
  for (const bool need_sort : {false, true}) {
    Pair p(40 * 16, (shares_list ? 40 : 24) * 16, 16, need_sort, false, threads, shares_list);
    const V slots = p.extend({0, 0, 0}, {37, 16, 5}, {-1, -1, -1}, 58);
    ASSERT_EQ(slots.size(), 58u);
    p.expect_same();
    const V step = p.decode({38, 17, 6}, {slots[36], slots[52], slots[57]});
    p.expect_same();
    // Window eviction of the first request's first page, then its whole release.
    p.cpu.free_swa_segment(slice(slots, 0, 16), 0);
    p.dev.free_swa_segment(Span(slots.data(), 16), 0);
    p.expect_same();
    p.cpu.free_group_begin();
    p.dev.free_group_begin();
    const V rest = slice(slots, 16, 37);
    p.cpu.free_segment(rest, 16);
    p.dev.free_segment(rest, 16);
    const V second = slice(slots, 37, 53);
    p.cpu.free(second);
    p.dev.free(second);
    p.cpu.free_group_end();
    p.dev.free_group_end();
    p.expect_same();
    p.cpu.free_full(slice(slots, 0, 16));
    p.dev.free_full(Span(slots.data(), 16));
    // The last two requests (the first one's decode slot went with its segment).
    V last = slice(slots, 53, 58);
    last.push_back(step[1]);
    last.push_back(step[2]);
    p.cpu.free(last);
    p.dev.free(last);
    p.expect_same();
    EXPECT_EQ(p.dev.full_available_size(), 40 * 16);
    EXPECT_EQ(p.dev.swa_available_size(), (shares_list ? 40 : 24) * 16);
  }
}

TEST(DeviceAllocator, LifecycleMatchesTheCpuCore) { expect_lifecycle_matches(false, 0); }

TEST(DeviceAllocator, SharedModeLifecycleMatchesTheCpuCore) {
  expect_lifecycle_matches(true, 0);
  expect_lifecycle_matches(true, 4);
}

TEST(DeviceAllocator, SharedModeReportsAnSwaPageFreedAsFullAsTheCpuCoreDoes) {
  Pair p(32 * 4, 32 * 4, 4, false, /*debug=*/true, 0, /*shares_list=*/true);
  const V slots = p.extend({0}, {6}, {-1}, 6);
  V swa(slots.size());
  p.dev.translate(slots, swa.data());
  const V swa_page{swa[0]};
  std::string cpu_message, dev_message;
  try { p.cpu.free_full(swa_page); } catch (const ArgumentError& e) { cpu_message = e.what(); }
  const AllocatorState before = p.dev.backup_state();
  try { p.dev.free_full(swa_page); } catch (const ArgumentError& e) { dev_message = e.what(); }
  EXPECT_NE(cpu_message.find("holds SWA KV"), std::string::npos) << cpu_message;
  EXPECT_EQ(dev_message.substr(0, dev_message.find(" [in ")), cpu_message);
  EXPECT_TRUE(p.dev.backup_state() == before);
  p.expect_same();
}

TEST(DeviceAllocator, AFreesCountIsReadBackOnceByTheNextCallThatNeedsIt) {
  Pair p(32 * 16, 16 * 16, 16, false);
  const V slots = p.extend({0}, {40}, {-1}, 40);
  const int64_t waits = p.control().waits();
  p.dev.free(slots);  // 3 pages, known only to the device
  EXPECT_EQ(p.control().waits(), waits);
  EXPECT_EQ(p.dev.available_size(), 16 * 16);
  EXPECT_EQ(p.control().waits(), waits + 1);
  EXPECT_TRUE(p.dev.new_pages_available(32, 16));
  // The used counts came back with the free counts: no other wait.
  EXPECT_EQ(p.dev.full_used_size() + p.dev.swa_used_size(), 0);
  EXPECT_EQ(p.control().waits(), waits + 1);
}

TEST(DeviceAllocator, DebugModeRejectsADoubleFreeBeforeAnythingChanges) {
  Pair p(32 * 4, 16 * 4, 4, false, /*debug=*/true);
  const V slots = p.extend({0}, {10}, {-1}, 10);
  p.dev.free_segment(Span(slots.data(), 4), 0);
  const AllocatorState before = p.dev.backup_state();
  EXPECT_THROW(p.dev.free_segment(Span(slots.data(), 8), 0), ArgumentError);  // its first page is free already
  EXPECT_TRUE(p.dev.backup_state() == before);
  p.dev.check_invariants();
}

TEST(DeviceAllocator, WithoutDebugABadCallIsReportedLaterUntilClear) {
  Pair p(32 * 4, 16 * 4, 4, false);
  const V slots = p.extend({0}, {8}, {-1}, 8);
  p.dev.free_segment(Span(slots.data(), 8), 0);
  p.dev.free_segment(Span(slots.data(), 8), 0);  // double free: found by the ops, reported later
  EXPECT_THROW(p.control().raise_found_errors(), DeferredError);
  VectorOut out;
  EXPECT_THROW(p.dev.alloc(4, out), DeferredError);
  p.dev.clear();
  ASSERT_TRUE(p.dev.alloc(4, out));
  EXPECT_EQ(out.values, (V{4, 5, 6, 7}));
  p.dev.check_invariants();
}

TEST(DeviceAllocator, AFreeGroupFreesTheUnionOfItsFreeCalls) {
  Pair p(32 * 16, 16 * 16, 16, false, /*debug=*/true);
  const V slots = p.extend({0}, {40}, {-1}, 40);
  p.cpu.free_group_begin();
  p.dev.free_group_begin();
  // Two free() calls naming slots of the same pages (SGLang frees the union at the end).
  const V first = slice(slots, 0, 20), second = slice(slots, 10, 40);
  for (const V* part : {&first, &second}) {
    p.cpu.free(*part);
    p.dev.free(*part);
  }
  p.cpu.free_group_end();
  p.dev.free_group_end();
  p.expect_same();
  EXPECT_EQ(p.dev.available_size(), 16 * 16);
}

namespace {

// Three requests of 40, 10 and 33 tokens (page size 4) in rows 1, 2 and 0 of a table of
// 64-slot rows, then one batched eviction of all three on both cores; returns the table.
V evict_three_requests(Pair& p) {
  const int64_t row_len = 64;
  V req_to_token(static_cast<size_t>(3 * row_len));
  const V lens{40, 10, 33};
  for (int64_t r = 0; r < 3; ++r) {
    const V slots = p.extend({0}, {lens[r]}, {-1}, lens[r]);
    std::copy(slots.begin(), slots.end(), req_to_token.begin() + r * row_len);
  }
  p.expect_same();
  const V rows{2, 0, 1}, pre{33, 40, 10}, evicted{0, 8, 0};
  V cpu_next(3), dev_next(3);
  const SlotRows table{nullptr, req_to_token.data(), 3, row_len};
  p.cpu.evict_out_of_window(table, rows, pre, evicted, 8, 1, false, cpu_next.data());
  p.dev.evict_out_of_window(table, rows, pre, evicted, 8, 1, false, dev_next.data());
  EXPECT_EQ(cpu_next, dev_next);
  p.expect_same();
  return req_to_token;
}

}  // namespace

TEST(DeviceAllocator, BatchedEvictionReleasesAsOneSegmentFreePerRequest) {
  for (const bool need_sort : {false, true}) {
    Pair p(128 * 4, 128 * 4, 4, need_sort);
    evict_three_requests(p);
  }
}

TEST(DeviceAllocator, AFullPageMappedIntoTwoSwaPagesFreesBoth) {
  Pair p(32 * 4, 16 * 4, 4, false, /*debug=*/true);
  const V slots = p.extend({0}, {8}, {-1}, 8);  // full pages 1-2 -> SWA pages 1-2
  // Full slot 5 (page 1) now maps into SWA page 2: page 1's slots span two SWA pages.
  const V full{slots[1]}, swa_slot{p.cpu_mapping[static_cast<size_t>(slots[5])]};
  p.cpu.set_mapping(full, swa_slot);
  p.dev.set_mapping(full, swa_slot);
  const V first_page = slice(slots, 0, 4);
  p.cpu.free_swa(first_page);
  p.dev.free_swa(first_page);
  EXPECT_EQ(p.cpu.swa_available_size(), 16 * 4);  // both SWA pages, from full page 1 alone
  EXPECT_TRUE(p.cpu.backup_state() == p.dev.backup_state());
  const V second_page = slice(slots, 4, 8);  // still mapped into SWA page 2, now free
  p.cpu.clear_mapping(second_page);
  p.dev.clear_mapping(second_page);
  p.expect_same();
  p.cpu.check_invariants();
}

// The emulation stands in for a GPU's unordered elements only if its launches run them
// in orders that differ: ascending, descending, and a stride that is neither.
TEST(DeviceAllocator, EmulatedLaunchesRunEveryElementOnceInOrdersThatDiffer) {
  HostExecutor exec;
  for (const int64_t n : {1, 2, 3, 5, 8, 64, 100, 1000, 4096, 65537}) {
    V ascending(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) ascending[i] = i;
    const V descending(ascending.rbegin(), ascending.rend());
    std::vector<V> walks;
    for (int launch = 0; launch < 6; ++launch) {
      V walk;
      exec.next_order(n).for_each([&walk](int64_t i) { walk.push_back(i); });
      V sorted = walk;
      std::sort(sorted.begin(), sorted.end());
      ASSERT_EQ(sorted, ascending) << "n=" << n << ": not every element exactly once";
      walks.push_back(walk);
    }
    if (n < 5) continue;
    int strided = 0;
    for (const V& walk : walks) {
      const bool neighbours = std::abs(walk[1] - walk[0]) == 1 || std::abs(walk[1] - walk[0]) == n - 1;
      strided += walk != ascending && walk != descending && !neighbours;
    }
    EXPECT_TRUE(std::count(walks.begin(), walks.end(), ascending) >= 1) << "n=" << n;
    EXPECT_TRUE(std::count(walks.begin(), walks.end(), descending) >= 1) << "n=" << n;
    EXPECT_GE(strided, 2) << "n=" << n;
  }
}

// A run with another order offset (SWA_EXT_EMULATED_ORDER_OFFSET) runs the same launches
// in other orders, each still visiting every element once.
TEST(DeviceAllocator, EmulatedOrderOffsetsChangeTheOrderOfEachLaunch) {
  const V sizes{7, 64, 100, 1000, 7, 64, 100, 1000, 4096};
  std::vector<std::vector<V>> runs;
  for (const int64_t offset : {0, 1, 2, 3, 6}) {
    HostExecutor exec(offset);
    std::vector<V> walks;
    for (const int64_t n : sizes) {
      V walk;
      exec.next_order(n).for_each([&walk](int64_t i) { walk.push_back(i); });
      V sorted = walk;
      std::sort(sorted.begin(), sorted.end());
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(sorted[i], i) << "offset " << offset << ", n=" << n;
      walks.push_back(walk);
    }
    runs.push_back(walks);
  }
  for (size_t a = 0; a < runs.size(); ++a)
    for (size_t b = a + 1; b < runs.size(); ++b) {
      int differ = 0;
      for (size_t k = 0; k < sizes.size(); ++k) differ += runs[a][k] != runs[b][k];
      // Offsets 0, 1 and 2 give each launch another kind of order; 3 and 6 the same kinds
      // as 0, with strided walks that start elsewhere or take another stride.
      EXPECT_GE(differ, (a < 3 && b < 3) ? static_cast<int>(sizes.size()) : 3) << "offsets #" << a << " and #" << b;
    }
  setenv("SWA_EXT_EMULATED_ORDER_OFFSET", "5", 1);
  EXPECT_EQ(HostExecutor::order_offset_from_env(), 5);
  setenv("SWA_EXT_EMULATED_ORDER_OFFSET", "-1", 1);
  EXPECT_THROW(HostExecutor::order_offset_from_env(), std::invalid_argument);
  unsetenv("SWA_EXT_EMULATED_ORDER_OFFSET");
  EXPECT_EQ(HostExecutor::order_offset_from_env(), 0);
}

namespace {

// One pool's device arrays in host memory, for running single ops on counters a test sets.
struct RawPool {
  static constexpr int64_t kPages = 8;
  V ring = V(kPages), staged = V(kPages), group_index = V(kPages), group_pages = V(kPages), ring_pos = V(kPages + 1);
  std::vector<dev::StateWord> state = std::vector<dev::StateWord>(kPages + 1, dev::kHeld);
  V counters = V(2 * dev::kCounterWords), error = V(dev::kErrWords);
  dev::PoolView view() {
    return dev::PoolView{kPages, PageGeometry(1), ring.data(), staged.data(), group_index.data(), group_pages.data(),
                         state.data(), ring_pos.data(), counters.data(), counters.data() + dev::kCounterWords};
  }
  dev::Origin origin() { return dev::Origin{error.data(), kCallFree, kArgIndices, 1}; }
};

}  // namespace

// Counters that a caller's misuse could once push past the pool (the host counting pages
// the device refused) must not lead a release outside its list: it reports, moves nothing.
TEST(DeviceAllocator, AReleaseThatWouldOverfillItsListMovesNothing) {
  for (const Destination dest : {Destination::kPrepend, Destination::kAppend, Destination::kStaged,
                                 Destination::kGroupIndex, Destination::kGroupPages}) {
    RawPool pool;
    const dev::CounterWord word = dev::count_word(dest);
    pool.counters[word] = RawPool::kPages - 1;  // room for one page
    const V pages{1, 2, 3};
    const RawPool before = pool;
    HostExecutor exec;
    exec.run(3, dev::ReleaseOp{pool.view(), pages.data(), 3, nullptr, 3, dest, -1, pool.origin()});
    EXPECT_EQ(pool.error[dev::kErrCode], dev::kCountsOff);
    EXPECT_EQ(pool.ring, before.ring);
    EXPECT_EQ(pool.staged, before.staged);
    EXPECT_EQ(pool.group_index, before.group_index);
    EXPECT_EQ(pool.group_pages, before.group_pages);
    EXPECT_EQ(pool.state, before.state);
    EXPECT_EQ(V(pool.counters.begin() + dev::kCounterWords, pool.counters.end()), V(pool.counters.begin(), pool.counters.begin() + dev::kCounterWords))
        << "the written counter copy is the read one";
  }
}

TEST(DeviceAllocator, AReleaseAfterARefusedClaimMovesNothing) {
  RawPool pool;
  pool.error[dev::kErrCode] = dev::kClaimRefused;  // a claim of the call refused
  const V pages{1, 0, 3};                           // its refused entry
  const RawPool before = pool;
  HostExecutor exec;
  exec.run(3, dev::ReleaseOp{pool.view(), pages.data(), 3, nullptr, 3, Destination::kAppend, -1, pool.origin()});
  EXPECT_EQ(pool.ring, before.ring);
  EXPECT_EQ(pool.state, before.state);
  EXPECT_EQ(pool.counters[dev::kCounterWords + dev::kFreeCount], 0) << "the refused entry moved a count";
  EXPECT_EQ(pool.error[dev::kErrCode], dev::kClaimRefused);
}

TEST(DeviceAllocator, AnAllocationThatItsFreeListCannotHoldHandsOutOnlyThePaddingSlot) {
  Pair p(8, 8, 1, false);
  // The device's free list holds 8 pages. A plan for 9 (which the host makes only from
  // counts a refused call skewed) must take none.
  DevicePool& pool = static_cast<DevicePool&>(p.dev.full());
  const dev::PoolView full = pool.view();
  const V words{0, 9, 0, 0, 9};  // one request: tokens [0, 9), no prefix, 9 tokens
  const dev::BatchView batch{words.data(), 1};
  const dev::LastLocCheck check{full, false, false, full, nullptr, nullptr, p.control().origin(kCallAlloc, kArgLastLoc)};
  V out(9, -1);
  p.exec->run(9, dev::AllocSlotsOp{batch, check, 9, 0, -1, nullptr, out.data()});
  pool.flip();
  EXPECT_EQ(out, V(9, 0));
  EXPECT_THROW(p.control().raise_found_errors(), DeferredError);
  p.dev.clear();
  p.expect_same();
}

// ---------------------------------------------------------------- misuse surfaces at once

// Without debug checks a double free at page size 1 changes no count the host waits
// for; the next call still raises it, from a copy of the error record that call made
// without waiting.
TEST(DeviceAllocator, ADoubleFreeRaisesInTheNextCallWithoutAWait) {
  for (const int64_t ps : {1, 4}) {
    Pair p(32 * ps, 16 * ps, ps, false);
    const V slots = p.extend({0}, {2 * ps}, {-1}, 2 * ps);
    p.dev.free(slots);
    const int64_t waits = p.control().waits();
    p.dev.free(slots);  // the bad call: the device refuses it, the host cannot know yet
    VectorOut out;
    try {
      p.dev.alloc(ps, out);
      ADD_FAILURE() << "page size " << ps << ": the call after a double free raised nothing";
    } catch (const DeferredError& e) {
      EXPECT_NE(std::string(e.what()).find("[in free]"), std::string::npos) << e.what();
    }
    EXPECT_EQ(p.control().waits(), waits) << "page size " << ps;
    EXPECT_TRUE(out.values.empty());
    p.dev.clear();
    p.cpu.clear();
    p.expect_same();
  }
}

// ---------------------------------------------------------------- the threaded emulation

TEST(DeviceAllocator, ThreadedLaunchesRunEveryElementOnce) {
  for (const int threads : {3, 7, 32}) {
    HostExecutor exec(0, threads);
    for (const int64_t n : {1, 2, 3, 31, 32, 33, 1000, 65537}) {
      std::vector<int64_t> visits(static_cast<size_t>(n));
      exec.run_elements(n, [&visits](int64_t i) { __atomic_fetch_add(&visits[static_cast<size_t>(i)], 1, __ATOMIC_RELAXED); });
      EXPECT_EQ(visits, V(static_cast<size_t>(n), 1)) << threads << " threads, n=" << n;
    }
  }
  EXPECT_THROW(HostExecutor(0, 2), std::invalid_argument);
  EXPECT_THROW(HostExecutor(0, 33), std::invalid_argument);
  setenv("SWA_EXT_EMULATED_THREADS", "8", 1);
  EXPECT_EQ(HostExecutor::threads_from_env(), 8);
  setenv("SWA_EXT_EMULATED_THREADS", "1", 1);
  EXPECT_THROW(HostExecutor::threads_from_env(), std::invalid_argument);
  unsetenv("SWA_EXT_EMULATED_THREADS");
  EXPECT_EQ(HostExecutor::threads_from_env(), 0);
}

// The lifecycle and a batched eviction on threads, against the CPU core.
TEST(DeviceAllocator, ThreadedEmulationMatchesTheCpuCore) {
  for (const int threads : {3, 11, 32}) {
    Pair p(128 * 4, 64 * 4, 4, threads % 2 == 1, false, threads);
    const V req_to_token = evict_three_requests(p);
    const V first(req_to_token.begin() + 64, req_to_token.begin() + 64 + 10);
    p.cpu.free(first);
    p.dev.free(first);
    p.expect_same();
  }
}

#if defined(__SANITIZE_THREAD__)
// A race planted in an op (every element adds to one word without an atomic) is what
// the threaded emulation exists to show: ThreadSanitizer must report it.
TEST(ThreadedEmulationDeathTest, ThreadSanitizerReportsAPlantedRace) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  setenv("TSAN_OPTIONS", "halt_on_error=1:exitcode=66", 1);
  const auto plant = [] {
    HostExecutor exec(0, 8);
    int64_t total = 0;
    exec.run_elements(4096, [&total](int64_t) { total += 1; });
    std::exit(total >= 0 ? 0 : 1);
  };
  EXPECT_EXIT(plant(), ::testing::ExitedWithCode(66), "ThreadSanitizer: data race");
}
#endif

// ---------------------------------------------------------------- determinism of one launch

// Of several bad entries in one launch the record keeps the lowest (as the CPU core
// reports its first), in every element order and on threads.
TEST(DeviceAllocator, SeveralBadEntriesReportTheLowest) {
  for (const int threads : {0, 3, 16}) {
    for (int64_t offset = 0; offset < 6; ++offset) {
      RawPool pool;
      pool.state[3] = dev::kFree;
      pool.state[6] = dev::kFree;
      const V input{5, 3, 200, 6, 300};  // entry 1: page 3 free; 2: out of the pool; 3: page 6 free; 4: out
      V list(input.size());
      HostExecutor exec(offset, threads);
      exec.run(static_cast<int64_t>(input.size()),
               dev::ClaimOp{pool.view(), input.data(), dev::ClaimSource::kSlot, false, list.data(), pool.origin()});
      EXPECT_EQ(pool.error[dev::kErrCode], dev::kClaimRefused) << threads << " threads, offset " << offset;
      EXPECT_EQ(pool.error[dev::kErrEntry], 1) << threads << " threads, offset " << offset;
      EXPECT_EQ(pool.error[dev::kErrValue], 3) << threads << " threads, offset " << offset;
    }
  }
}

// free_page_ids: the CPU core checks every id's range before it claims any.
TEST(DeviceAllocator, APageIdOutOfThePoolOutranksAnEarlierRefusedClaim) {
  for (int64_t offset = 0; offset < 3; ++offset) {
    RawPool pool;
    pool.state[3] = dev::kFree;
    const V input{3, 9};
    HostExecutor exec(offset);
    exec.run(2, dev::ClaimOp{pool.view(), input.data(), dev::ClaimSource::kPageId, false, V(2).data(), pool.origin()});
    EXPECT_EQ(pool.error[dev::kErrCode], dev::kPageIdOutOfPool) << "offset " << offset;
    EXPECT_EQ(pool.error[dev::kErrEntry], 1);
  }
}

// An earlier launch's error stands: a later launch's lower entry does not replace it.
TEST(DeviceAllocator, TheFirstLaunchsErrorStands) {
  RawPool pool;
  const V first{5, 100}, second{200};
  HostExecutor exec;
  exec.run(2, dev::ClaimOp{pool.view(), first.data(), dev::ClaimSource::kSlot, false, V(2).data(), pool.origin()});
  dev::Origin later = pool.origin();
  later.launch = 2;
  exec.run(1, dev::ClaimOp{pool.view(), second.data(), dev::ClaimSource::kSlot, false, V(1).data(), later});
  EXPECT_EQ(pool.error[dev::kErrEntry], 1);
  EXPECT_EQ(pool.error[dev::kErrValue], 100);
}

// set_full_to_swa_mapping naming one full slot twice keeps the last value, on the CPU
// core and on the device in every element order.
TEST(DeviceAllocator, ASlotMappedTwiceInOneCallKeepsTheLastValue) {
  for (const int threads : {0, 5}) {
    for (int64_t launch = 0; launch < 6; ++launch) {
      Pair p(32 * 4, 16 * 4, 4, false, false, threads);
      const V slots = p.extend({0}, {12}, {-1}, 12);
      for (int64_t k = 0; k < launch; ++k) p.exec->next_order(2);  // another order for the launches below
      const V full{slots[0], slots[1], slots[0], slots[0]};
      const V swa{p.cpu_mapping[static_cast<size_t>(slots[4])], p.cpu_mapping[static_cast<size_t>(slots[5])],
                  p.cpu_mapping[static_cast<size_t>(slots[8])], p.cpu_mapping[static_cast<size_t>(slots[6])]};
      p.cpu.set_mapping(full, swa);
      p.dev.set_mapping(full, swa);
      EXPECT_EQ(p.dev_mapping[static_cast<size_t>(slots[0])], swa[3]) << threads << " threads, launch " << launch;
      EXPECT_EQ(p.cpu_mapping, p.dev_mapping);
      p.cpu.clear_mapping(full);
      p.dev.clear_mapping(full);
      EXPECT_EQ(p.cpu_mapping, p.dev_mapping);
      // The entries' owners are zero again: the next call's last value wins as well.
      const V again{slots[1], slots[1]}, values{swa[0], swa[2]};
      p.cpu.set_mapping(again, values);
      p.dev.set_mapping(again, values);
      EXPECT_EQ(p.cpu_mapping, p.dev_mapping);
    }
  }
}
