#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "allocator.h"

using namespace swa;
using V = std::vector<int64_t>;

namespace {

// A hybrid allocator on the host store.
struct Fixture {
  V mapping;
  HybridAllocator alloc;
  // shares_list: the shared mode (SPEC.md section 8), one list for both kinds, of parent
  // pages (section 8.1) as `parents` lays them out.
  Fixture(int64_t size, int64_t size_swa, int64_t ps, bool need_sort = false, bool shares_list = false,
          const ParentLayout& parents = ParentLayout{})
      : mapping(static_cast<size_t>(HybridAllocator::mapping_size(size, size_swa, ps, shares_list, parents))),
        alloc(std::make_unique<HostHybridStore>(size, size_swa, ps, need_sort, shares_list, parents, mapping.data(),
                                                static_cast<int64_t>(mapping.size()))) {}

  V extend(const V& prefix, const V& seq, const V& last, int64_t ext) {
    VectorOut out;
    if (!alloc.alloc_extend(BatchLengths{prefix, seq, false}, last, ext, out)) return {};
    return out.values;
  }
  V decode(const V& seq, const V& last) {
    VectorOut out;
    if (!alloc.alloc_decode(BatchLengths{Span(), seq, true}, last, out)) return {};
    return out.values;
  }
};

}  // namespace

TEST(Hybrid, ExtendMapsEveryFullSlotToAnSwaSlot) {
  Fixture f(256, 128, 16);
  const V slots = f.extend({0, 0}, {20, 5}, {-1, -1}, 25);
  ASSERT_EQ(slots.size(), 25u);
  for (int64_t slot : slots) EXPECT_GT(f.mapping[slot], 0);
  EXPECT_EQ(f.mapping.back(), -1);
  EXPECT_EQ(f.alloc.full_available_size(), 256 - 48);
  f.alloc.check_invariants();
}

TEST(Hybrid, DecodeRefusalIsAtomicWhenOnlyTheSwaPoolIsShort) {
  Fixture f(256, 32, 16);
  const V slots = f.extend({0, 0}, {16, 16}, {-1, -1}, 32);  // SWA pool now empty
  const auto before = f.alloc.backup_state();
  EXPECT_TRUE(f.decode({17}, {slots[15]}).empty());
  EXPECT_TRUE(f.alloc.backup_state() == before);
}

TEST(Hybrid, SwaTailLeavesTheHeadUnmapped) {
  Fixture f(256, 128, 16);
  VectorOut out;
  const V prefix{0}, seq{68}, last{-1};
  ASSERT_TRUE(f.alloc.alloc_extend_swa_tail(BatchLengths{prefix, seq, false}, last, 68, 52, out));
  for (int64_t i = 0; i < 68; ++i) EXPECT_EQ(f.mapping[out.values[i]] > 0, i >= 16) << i;
  EXPECT_EQ(f.alloc.swa_available_size(), 128 - 64);
  EXPECT_THROW(f.alloc.free_swa_segment(V(out.values.begin(), out.values.begin() + 16), 0), ArgumentError);
  f.alloc.check_invariants();
}

TEST(Hybrid, FreeIsAllOrNothing) {
  Fixture f(256, 128, 16);
  const V a = f.extend({0}, {16}, {-1}, 16);
  f.alloc.free_full(a);  // full side gone, SWA still mapped
  const auto before = f.alloc.backup_state();
  EXPECT_THROW(f.alloc.free(a), ArgumentError);  // full double free: SWA must stay untouched
  EXPECT_TRUE(f.alloc.backup_state() == before);
}

TEST(Hybrid, BatchedEvictionMatchesOneSegmentFreeAtATime) {
  const int64_t ps = 4, window = 8, row_len = 64;
  Fixture batched(512, 512, ps), single(512, 512, ps);
  V req_to_token(static_cast<size_t>(3 * row_len));
  const V lens{40, 10, 33};
  for (int64_t r = 0; r < 3; ++r) {
    const V a = batched.extend({0}, {lens[r]}, {-1}, lens[r]);
    const V b = single.extend({0}, {lens[r]}, {-1}, lens[r]);
    ASSERT_EQ(a, b);
    std::copy(a.begin(), a.end(), req_to_token.begin() + r * row_len);
  }
  const V rows{2, 0, 1}, pre{33, 40, 10}, evicted{0, 8, 0};
  V next(3);
  batched.alloc.evict_out_of_window(SlotRows{nullptr, req_to_token.data(), 3, row_len}, rows, pre, evicted, window, 1,
                                    false, next.data());
  EXPECT_EQ(next, (V{24, 32, 0}));
  for (size_t j = 0; j < rows.size(); ++j) {
    if (next[j] == evicted[j]) continue;
    const int64_t* row = req_to_token.data() + rows[j] * row_len;
    single.alloc.free_swa_segment(V(row + evicted[j], row + next[j]), evicted[j]);
  }
  EXPECT_TRUE(batched.alloc.backup_state() == single.alloc.backup_state());
  batched.alloc.check_invariants();
}

TEST(Shared, OneListServesBothKindsFullPagesFirst) {
  Fixture f(128, 128, 16, false, true);  // 8 pages in one list
  const V slots = f.extend({0, 0}, {20, 5}, {-1, -1}, 25);  // 3 full pages, then 3 SWA pages
  ASSERT_EQ(slots.size(), 25u);
  for (int64_t slot : slots) EXPECT_LE(slot / 16, 3);
  for (int64_t slot : slots) EXPECT_GE(f.mapping[slot] / 16, 4);
  EXPECT_EQ(f.alloc.full_available_size(), 128 - 6 * 16);
  EXPECT_EQ(f.alloc.swa_available_size(), f.alloc.full_available_size());
  EXPECT_TRUE(f.alloc.new_pages_available(1, 1));
  EXPECT_FALSE(f.alloc.new_pages_available(2, 1));
  f.alloc.check_invariants();
  f.alloc.free(slots);
  EXPECT_EQ(f.alloc.available_size(), 128);
  f.alloc.check_invariants();
}

TEST(Shared, RefusalIsAgainstTheSumAndAtomic) {
  Fixture f(128, 128, 16, false, true);
  f.extend({0}, {48}, {-1}, 48);  // 3 + 3 pages of 8
  const auto before = f.alloc.backup_state();
  EXPECT_TRUE(f.extend({0}, {32}, {-1}, 32).empty());  // 2 + 2 pages: only 2 free
  EXPECT_TRUE(f.alloc.backup_state() == before);
  EXPECT_EQ(f.extend({0}, {16}, {-1}, 16).size(), 16u);  // 1 + 1
}

TEST(Shared, AFreeOfTheOtherKindIsCaughtAndChangesNothing) {
  Fixture f(128, 128, 4, false, true);
  const V a = f.extend({0}, {8}, {-1}, 8);
  const V swa_slots{f.mapping[a[0]], f.mapping[a[4]]};
  const auto before = f.alloc.backup_state();
  EXPECT_THROW(f.alloc.free_full(swa_slots), ArgumentError);
  EXPECT_THROW(f.alloc.free(swa_slots), ArgumentError);
  EXPECT_THROW(f.alloc.free_full_segment(V{swa_slots[0], swa_slots[0] + 1, swa_slots[0] + 2, swa_slots[0] + 3}, 0),
               ArgumentError);
  EXPECT_THROW(f.alloc.swa().claim_page_ids(V{a[0] / 4}, kCallFreePageIds), ArgumentError);  // a full page, freed as SWA
  f.alloc.swa().undo_claims();
  EXPECT_TRUE(f.alloc.backup_state() == before);
  f.alloc.check_invariants();
}

TEST(Shared, ARequestWhoseWindowSlidGivesItsSwaPagesBackToTheOneList) {
  Fixture f(128, 128, 4, false, true);
  const V a = f.extend({0}, {16}, {-1}, 16);  // 4 full pages, 4 SWA pages
  EXPECT_EQ(f.alloc.available_size(), 128 - 32);
  f.alloc.free_swa_segment(V(a.begin(), a.begin() + 8), 0);  // two SWA pages out of the window
  EXPECT_EQ(f.alloc.available_size(), 128 - 24);
  EXPECT_EQ(f.extend({0}, {4}, {-1}, 4).size(), 4u);  // they are full and SWA pages again
  f.alloc.check_invariants();
}

TEST(Shared, SizeSwaMustEqualSize) {
  EXPECT_THROW(HybridAllocator::mapping_size(128, 64, 16, true), ArgumentError);
  EXPECT_EQ(HybridAllocator::mapping_size(128, 128, 16, true), 128 + 16 + 1);
}

TEST(Shared, TheMappingCoversEveryFullSlotWhereTheFullSideIsSmall) {
  // 8 parents of 16 SWA slots, 3 full child pages each: the full slots span (8 + 1) * 3 pages
  // (parent 0's included), two pages more than SGLang's size + page_size.
  EXPECT_EQ(HybridAllocator::mapping_size(3 * 128, 128, 16, true, ParentLayout{3, Side::kFull}), 9 * 3 * 16 + 1);
  EXPECT_EQ(HybridAllocator::mapping_size(128, 3 * 128, 16, true, ParentLayout{3, Side::kSwa}), 128 + 16 + 1);
}

// Parent pages at k 3, the full side small: a binding planted behind the allocator's back
// (a page state written directly) is caught by check_invariants().
TEST(Parents, InvariantCheckCatchesAPlantedWrongBinding) {
  const int64_t ps = 4, k = 3;
  const auto planted = [&](const auto& plant) {
    Fixture f(8 * ps * k, 8 * ps, ps, false, true, ParentLayout{k, Side::kFull});
    const V a = f.extend({0}, {2 * ps}, {-1}, 2 * ps);  // two full child pages of one parent, two SWA parents
    f.alloc.check_invariants();
    auto& full = dynamic_cast<PagePool&>(f.alloc.full());
    auto& swa = dynamic_cast<PagePool&>(f.alloc.swa());
    const int64_t full_parent = parent_of(a[0] / ps, k), swa_parent = f.mapping[a[0]] / ps;
    ASSERT_EQ(full.state(first_child(full_parent, k) + 2), PageState::kFree);  // the parent's free child page
    plant(full, swa, full_parent, swa_parent);
    try {
      f.alloc.check_invariants();
      ADD_FAILURE() << "a planted binding passed check_invariants()";
    } catch (const std::logic_error& e) {
      EXPECT_NE(std::string(e.what()).find("invariant broken"), std::string::npos) << e.what();
    }
  };
  // A full child page held in a parent the SWA side holds.
  planted([&](PagePool& full, PagePool&, int64_t, int64_t swa_parent) {
    full.states()[first_child(swa_parent, k)] = full.kind().held;
  });
  // The full side's parent marked as an SWA page.
  planted([&](PagePool&, PagePool& swa, int64_t full_parent, int64_t) { swa.states()[full_parent] = swa.kind().held; });
  // The free child page of a partly used parent marked held, its counts left as they were.
  planted([&](PagePool& full, PagePool&, int64_t full_parent, int64_t) {
    full.states()[first_child(full_parent, k) + 2] = full.kind().held;
  });
  // An SWA page marked free while its parent stays out of the list.
  planted([&](PagePool&, PagePool& swa, int64_t, int64_t swa_parent) { swa.states()[swa_parent] = PageState::kFree; });
}

TEST(Hybrid, InvariantCheckCatchesAStaleMapping) {
  Fixture f(256, 128, 16);
  const V a = f.extend({0}, {16}, {-1}, 16);
  const int64_t swa_slot = f.mapping[a[0]];
  f.alloc.free_swa(a);
  f.mapping[a[0]] = swa_slot;  // a caller writing behind the allocator's back
  EXPECT_THROW(f.alloc.check_invariants(), std::logic_error);
}

// The message of a call that throws ArgumentError ("" when it does not throw).
template <class Call>
std::string argument_error(const Call& call) {
  try {
    call();
  } catch (const ArgumentError& e) {
    return e.what();
  }
  return "";
}

// The host store checks a batch, or claims a segment on both pools, in one fast pass and
// names a fault from the ordered checks: the full pool's before the SWA pool's, whatever
// the order of the requests or slots at fault.
TEST(Hybrid, AFaultIsNamedByTheFullPoolsChecksFirst) {
  for (const int64_t ps : {1, 16}) {
    Fixture f(512, 512, ps);
    const V a = f.extend({0, 0}, {20, 20}, {-1, -1}, 40);
    // Request 0's SWA slot is gone (free_swa), request 1's last_loc is out of the pool.
    f.alloc.free_swa(V{a[19]});
    const auto before = f.alloc.backup_state();
    const std::string decode = argument_error([&] { f.decode({21, 21}, {a[19], 1 << 20}); });
    EXPECT_NE(decode.find("last_loc"), std::string::npos) << decode;
    EXPECT_NE(decode.find("entry 1"), std::string::npos) << decode;
    // Three pages' representatives: a[19]'s page (SWA side unmapped now) first, then
    // a[20]'s twice (a full double free in one call).
    V segment_slots;
    for (const int64_t rep : {a[19] - a[19] % ps, a[20], a[20]})
      for (int64_t k = 0; k < ps; ++k) segment_slots.push_back(rep + k);
    const std::string segment = argument_error([&] { f.alloc.free_segment(segment_slots, 0); });
    EXPECT_NE(segment.find("freed twice in one call"), std::string::npos) << segment;
    EXPECT_TRUE(f.alloc.backup_state() == before) << "ps=" << ps;
    f.alloc.check_invariants();
  }
}

TEST(Hybrid, AFaultySegmentNamingMorePagesThanAreHeldChangesNothing) {
  // The one-pass free places pages as it claims them; a segment of more pages than the
  // pools hold must not place any where a free page lies, at any destination.
  for (const int64_t ps : {1, 4}) {
    for (const bool need_sort : {false, true}) {
      for (const bool grouped : {false, true}) {
        Fixture f(64 * ps, 64 * ps, ps, need_sort);
        const V a = f.extend({0}, {2 * ps}, {-1}, 2 * ps);  // two pages held on each side
        if (grouped) f.alloc.free_group_begin();
        const auto before = f.alloc.backup_state();
        V segment(a);
        for (int64_t page = 10; page < 60; ++page)  // free pages after the held ones
          for (int64_t k = 0; k < ps; ++k) segment.push_back(page * ps + k);
        EXPECT_THROW(f.alloc.free_segment(segment, 0), ArgumentError);
        EXPECT_THROW(f.alloc.free_swa_segment(segment, 0), ArgumentError);
        EXPECT_THROW(f.alloc.free_full_segment(segment, 0), ArgumentError);
        EXPECT_TRUE(f.alloc.backup_state() == before) << "ps=" << ps << " need_sort=" << need_sort;
        f.alloc.free_segment(a, 0);
        if (grouped) f.alloc.free_group_end();
        EXPECT_EQ(f.alloc.full_available_size(), 64 * ps);
        EXPECT_EQ(f.alloc.swa_available_size(), 64 * ps);
        f.alloc.check_invariants();
      }
    }
  }
}
