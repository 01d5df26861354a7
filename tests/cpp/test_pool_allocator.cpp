#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "allocator.h"

using namespace swa;
using V = std::vector<int64_t>;

namespace {

// A lone pool on the host store.
struct Pool {
  std::shared_ptr<PagePool> store;
  PoolAllocator alloc;
  Pool(int64_t size, int64_t page_size, bool need_sort)
      : store(std::make_shared<PagePool>(size, page_size, need_sort)), alloc(store) {}
  PoolAllocator* operator->() { return &alloc; }
  V free_pages() const { return store->free_list(); }
  V staged_pages() const { return store->staged_list(); }
};

V alloc_tokens(Pool& pool, int64_t n) {
  VectorOut out;
  EXPECT_TRUE(pool->alloc(n, out));
  return out.values;
}

}  // namespace

TEST(PagePool, HandsOutPagesInOrderAndSkipsThePaddingPage) {
  Pool pool(64, 16, false);
  EXPECT_EQ(pool.store->num_pages(), 4);
  EXPECT_EQ(pool.free_pages(), (V{1, 2, 3, 4}));
  const V slots = alloc_tokens(pool, 32);
  EXPECT_EQ(slots.front(), 16);
  EXPECT_EQ(slots.back(), 47);
  EXPECT_EQ(pool->available_size(), 32);
  pool->check_invariants();
}

TEST(PagePool, FreePrependsSortedUniquePages) {
  Pool pool(64, 16, false);
  alloc_tokens(pool, 48);
  pool->free(V{40, 20, 33, 41});  // pages 2 and 2 and 2 and 1 -> [1, 2]
  EXPECT_EQ(pool.free_pages(), (V{1, 2, 4}));
  pool->check_invariants();
}

TEST(PagePool, FreePageIdsKeepsTheGivenOrder) {
  Pool pool(64, 16, false);
  alloc_tokens(pool, 48);
  pool->free_page_ids(V{3, 1});
  EXPECT_EQ(pool.free_pages(), (V{3, 1, 4}));
}

TEST(PagePool, TokenPoolAppends) {
  Pool pool(4, 1, false);
  alloc_tokens(pool, 3);
  pool->free(V{2, 1});
  EXPECT_EQ(pool.free_pages(), (V{4, 2, 1}));
  pool->check_invariants();
}

TEST(PagePool, NeedSortStagesUntilShort) {
  Pool pool(64, 16, true);
  alloc_tokens(pool, 64);
  pool->free(V{48});
  pool->free(V{16});
  EXPECT_TRUE(pool.free_pages().empty());
  EXPECT_EQ(pool.staged_pages(), (V{3, 1}));
  EXPECT_EQ(pool->available_size(), 32);
  const V slots = alloc_tokens(pool, 16);  // short: merges and sorts first
  EXPECT_EQ(slots.front(), 16);
  EXPECT_EQ(pool.free_pages(), (V{3}));
  pool->check_invariants();
}

TEST(PagePool, DoubleFreeIsRejectedAndChangesNothing) {
  Pool pool(64, 16, false);
  alloc_tokens(pool, 32);
  pool->free(V{16});
  const PagePool before = *pool.store;
  EXPECT_THROW(pool->free(V{32, 17}), ArgumentError);  // page 2 fine, page 1 already free
  EXPECT_TRUE(*pool.store == before);
  EXPECT_THROW(pool->free_page_ids(V{2, 2}), ArgumentError);
  EXPECT_TRUE(*pool.store == before);
  pool->check_invariants();
}

TEST(PagePool, OutOfRangeIndicesAreRejected) {
  Pool pool(64, 16, false);
  alloc_tokens(pool, 64);
  EXPECT_THROW(pool->free(V{3}), ArgumentError);    // page 0
  EXPECT_THROW(pool->free(V{80}), ArgumentError);   // past the last page
  EXPECT_THROW(pool->free_segment(V{16}, 3), ArgumentError);  // unaligned start
  EXPECT_EQ(pool->available_size(), 0);
}

TEST(PagePool, GroupReleasesIndicesThenPageIds) {
  Pool pool(96, 16, false);
  alloc_tokens(pool, 96);
  pool->free_group_begin();
  pool->free_page_ids(V{5});
  pool->free(V{48, 16});
  pool->free(V{20});  // same page again inside the group: one free
  EXPECT_THROW(pool->free_page_ids(V{1}), ArgumentError);  // already freed by the group
  EXPECT_EQ(pool->available_size(), 0);
  pool->free_group_end();
  EXPECT_EQ(pool.free_pages(), (V{5, 1, 3}));
  EXPECT_THROW(pool->free_group_end(), ArgumentError);
  pool->check_invariants();
}

TEST(PagePool, ExtendRefusalChangesNothing) {
  Pool pool(64, 16, false);
  const V prefix{0}, seq{80}, last{-1};
  VectorOut out;
  const PagePool before = *pool.store;
  EXPECT_FALSE(pool->alloc_extend(BatchLengths{prefix, seq, false}, last, 80, -1, out));
  EXPECT_TRUE(*pool.store == before);
}
