// The planner: decisions from host values only.
#include <gtest/gtest.h>

#include <vector>

#include "plan.h"

using namespace swa;
using V = std::vector<int64_t>;

TEST(Plan, ExtendCountsTokensAndNewPagesAndChecksLastLocSize) {
  const PageGeometry page(16);
  const V prefix{0, 20}, seq{17, 33}, last{-1, 40};
  const AllocPlan plan = plan_extend(BatchLengths{prefix, seq, false}, last, 30, page);
  EXPECT_EQ(plan.num_tokens, 30);
  EXPECT_EQ(plan.full_pages, 2 + 1);  // 17 tokens: 2 pages; 20 -> 33: page 3 of 3
  EXPECT_EQ(plan.swa_pages, plan.full_pages);
  EXPECT_THROW(plan_extend(BatchLengths{prefix, seq, false}, V{-1}, 30, page), ArgumentError);
  EXPECT_THROW(plan_extend(BatchLengths{prefix, seq, false}, last, 29, page), ArgumentError);
  EXPECT_THROW(plan_extend(BatchLengths{prefix, seq, false}, last, -1, page), ArgumentError);
}

TEST(Plan, SwaTailTakesSwaPagesForTheTailOnly) {
  const PageGeometry page(16);
  const V prefix{0}, seq{68}, last{-1};
  const AllocPlan plan = plan_extend_swa_tail(BatchLengths{prefix, seq, false}, last, 68, 52, page);
  EXPECT_EQ(plan.full_pages, 5);
  EXPECT_EQ(plan.swa_pages, 4);
  EXPECT_EQ(plan.swa_head_len(), 16);
  EXPECT_THROW(plan_extend_swa_tail(BatchLengths{prefix, seq, false}, last, 68, 69, page), ArgumentError);
  const V two{0, 0}, seqs{4, 4}, lasts{-1, -1};
  EXPECT_THROW(plan_extend_swa_tail(BatchLengths{two, seqs, false}, lasts, 8, 8, page), ArgumentError);
}

TEST(Plan, MergeTriggersDifferByCall) {
  const PageGeometry page(16);
  const AllocPlan alloc = plan_alloc(32, page);
  EXPECT_TRUE(merge_due(alloc, PoolRole::kFull, 1, page));
  EXPECT_FALSE(merge_due(alloc, PoolRole::kFull, 2, page));
  const V seq{17, 5}, last{40, 60};
  const AllocPlan decode = plan_decode(BatchLengths{Span(), seq, true}, last, page);
  EXPECT_EQ(decode.full_pages, 1);
  EXPECT_TRUE(merge_due(decode, PoolRole::kFull, 1, page));  // decode merges when free < batch size
  EXPECT_FALSE(merge_due(decode, PoolRole::kFull, 2, page));
  // An extend merges early, when the free list is merely low: ext / page + batch + 1 pages.
  const V prefix{0}, seq1{16}, last1{-1};
  const AllocPlan extend = plan_extend(BatchLengths{prefix, seq1, false}, last1, 16, page);
  EXPECT_TRUE(merge_due(extend, PoolRole::kFull, 2, page));
  EXPECT_FALSE(merge_due(extend, PoolRole::kFull, 3, page));
  // A tail of 0 tokens never merges the SWA pool.
  const AllocPlan no_tail = plan_extend_swa_tail(BatchLengths{prefix, seq1, false}, last1, 16, 0, page);
  EXPECT_FALSE(merge_due(no_tail, PoolRole::kSwa, 0, page));
  EXPECT_TRUE(merge_due(no_tail, PoolRole::kFull, 0, page));
}

// A pool's room of `parents` available parents (pages where pages_per_parent is 1).
PoolRoom room(int64_t parents, int64_t pages_per_parent = 1, int64_t free_children = 0) {
  return PoolRoom{parents, pages_per_parent, free_children, 8, 128};
}

TEST(Plan, HybridRefusalNeedsBothPools) {
  const AllocPlan plan = plan_alloc(32, PageGeometry(16));
  EXPECT_FALSE(hybrid_refused(plan, room(2), room(2), false));
  EXPECT_TRUE(hybrid_refused(plan, room(2), room(1), false));
  EXPECT_TRUE(hybrid_refused(plan, room(1), room(2), false));
  EXPECT_EQ(hybrid_available_size(64, 48), 48);
}

TEST(Plan, SharedRefusalNeedsTheSumInTheOneList) {
  const AllocPlan plan = plan_alloc(32, PageGeometry(16));  // 2 full pages and 2 SWA pages
  EXPECT_FALSE(hybrid_refused(plan, room(4), room(4), true));
  EXPECT_TRUE(hybrid_refused(plan, room(3), room(3), true));
  EXPECT_TRUE(demand_fits(1, 2, room(3), room(3), true));
  EXPECT_FALSE(demand_fits(2, 2, room(3), room(3), true));
  EXPECT_FALSE(demand_fits(INT64_MAX, INT64_MAX, room(3), room(3), true));  // no overflow into a yes
  EXPECT_THROW(check_hybrid_shape(64, 32, 16, true, ParentLayout{}), ArgumentError);
}

TEST(Plan, ParentPagesPriceTheSmallSideInParents) {
  // 3 parents; the SWA side is small (k = 3) with 2 free child pages in partly used parents.
  const PoolRoom full = room(3), swa = room(3, 3, 2);
  EXPECT_TRUE(demand_fits(3, 2, full, swa, true));    // its free children serve the SWA pages
  EXPECT_FALSE(demand_fits(3, 3, full, swa, true));   // a third needs a parent
  EXPECT_TRUE(demand_fits(2, 5, full, swa, true));    // 2 + 1 parents
  EXPECT_FALSE(demand_fits(2, 6, full, swa, true));   // 2 + 2
  EXPECT_EQ(room_pages(swa), 11);
  EXPECT_EQ(room_pages(full), 3);
  EXPECT_EQ(parent_k(200 * 1024, 20 * 1024), 10);  // MiMo-V2-Flash
  EXPECT_EQ(parent_k(144, 48), 3);                   // Llama 4 Scout
  EXPECT_EQ(parent_k(37, 36), 2);                    // padded up
  EXPECT_EQ(parent_k(36, 36), 1);
  EXPECT_EQ(child_page_count(4, 3), 14);
  // The small side's size is k times the other's.
  EXPECT_NO_THROW(check_hybrid_shape(64, 192, 16, true, ParentLayout{3, Side::kSwa}));
  EXPECT_THROW(check_hybrid_shape(64, 64, 16, true, ParentLayout{3, Side::kSwa}), ArgumentError);
  EXPECT_NO_THROW(check_hybrid_shape(192, 64, 16, true, ParentLayout{3, Side::kFull}));
  EXPECT_THROW(check_parent_layout(0, "swa", true), ArgumentError);
  EXPECT_THROW(check_parent_layout(2, "swa", false), ArgumentError);
  EXPECT_THROW(check_parent_layout(2, "both", true), ArgumentError);
}

TEST(Plan, ReservationPricesWholePagesAndTheEvictablePagesOfEachSide) {
  const PageGeometry page(16);
  const PoolRoom full = room(4), swa = room(2);  // available pages; 8 pages, 128 slots each
  const auto fits = [&](Reservation r, bool shares_list) { return reservation_fits(r, full, swa, shares_list, page); };
  // Two pools: 17 tokens take 2 pages; the SWA side's 2 free pages and 1 evictable page.
  EXPECT_TRUE(fits({64, 32, 0, 0, false, false}, false));
  EXPECT_FALSE(fits({65, 32, 0, 0, false, false}, false));
  EXPECT_FALSE(fits({64, 33, 0, 0, false, false}, false));
  EXPECT_TRUE(fits({64, 33, 0, 31, false, false}, false));  // 31 evictable tokens give back 1 whole page
  EXPECT_FALSE(fits({64, 49, 0, 31, false, false}, false));
  EXPECT_FALSE(fits({64, 33, 16, 0, false, false}, false));  // the other side's evictable pages do not count
  // The one list (4 available pages): the sum, the evictable pages of both sides.
  EXPECT_TRUE(fits({48, 16, 0, 0, false, false}, true));
  EXPECT_FALSE(fits({48, 17, 0, 0, false, false}, true));
  EXPECT_TRUE(fits({48, 17, 15, 16, false, false}, true));
  EXPECT_FALSE(fits({48, 17, 15, 15, false, false}, true));  // whole pages of each side: 0 + 0
  // A side's evictable pages beyond its own demand count once: the full side's one page
  // (16 tokens) and none of its demand leave 5 pages for the SWA side, not 6.
  EXPECT_TRUE(fits({0, 80, 16, 0, false, false}, true));
  EXPECT_FALSE(fits({0, 81, 16, 0, false, false}, true));
  // The empty pool: every page, nothing evictable; the slack is a token.
  EXPECT_TRUE(fits({64, 64, 0, 0, true, false}, true));
  EXPECT_FALSE(fits({64, 64, 0, 0, true, true}, true));
  EXPECT_TRUE(fits({64, 63, 0, 0, true, true}, true));
  EXPECT_TRUE(fits({127, 127, 0, 0, true, true}, false));
  EXPECT_FALSE(fits({128, 0, 0, 0, true, true}, false));
  EXPECT_TRUE(fits({Reservation{int64_t{1} << 62, 0, int64_t{1} << 62, int64_t{1} << 62, false, false}}, true));
  EXPECT_THROW(check_reservation({-1, 0, 0, 0, false, false}), ArgumentError);
  EXPECT_THROW(check_reservation({0, 0, 0, (int64_t{1} << 62) + 1, false, false}), ArgumentError);
  EXPECT_NO_THROW(check_reservation({int64_t{1} << 62, 0, 0, 0, false, false}));
}

TEST(Plan, SharedMergeSetsTheOtherSidesPagesAside) {
  const PageGeometry page(16);
  const AllocPlan plan = plan_alloc(32, page);  // 2 + 2 pages
  EXPECT_FALSE(shared_list_merge_due(plan, room(4), room(4), page));
  EXPECT_TRUE(shared_list_merge_due(plan, room(3), room(3), page));  // either side alone fits 3, both do not
  EXPECT_FALSE(merge_due(plan, PoolRole::kFull, 3, page));
}

TEST(Plan, ReleaseDestination) {
  EXPECT_EQ(release_destination(true, true, false, false), Destination::kGroupIndex);
  EXPECT_EQ(release_destination(true, false, true, false), Destination::kGroupPages);
  EXPECT_EQ(release_destination(true, false, false, true), Destination::kGroupIndex);  // token pool: one queue
  EXPECT_EQ(release_destination(false, true, true, false), Destination::kStaged);
  EXPECT_EQ(release_destination(false, false, false, true), Destination::kAppend);
  EXPECT_EQ(release_destination(false, true, false, false), Destination::kPrepend);
}

TEST(Plan, ShapeAndGroupChecksNameTheArgument) {
  try {
    check_hybrid_shape(64, 8, 16, false, ParentLayout{});
    FAIL();
  } catch (const ArgumentError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("size_swa:", 0), 0u) << e.what();
  }
  EXPECT_THROW(check_pool_shape("size", 64, 0), ArgumentError);
  EXPECT_THROW(check_group_begin(true), ArgumentError);
  EXPECT_NO_THROW(check_group_begin(false));
  EXPECT_THROW(check_group_end(false), ArgumentError);
  EXPECT_THROW(check_num_new_pages(3, plan_alloc(32, PageGeometry(16))), ArgumentError);
  EXPECT_NO_THROW(check_num_new_pages(2, plan_alloc(32, PageGeometry(16))));
}
