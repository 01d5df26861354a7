#include <gtest/gtest.h>

#include <vector>

#include "rules.h"

using namespace swa;

TEST(Rules, PageGeometryMatchesDivision) {
  // Shifts for powers of two, division otherwise: both must agree with plain arithmetic.
  for (int64_t size = 1; size <= 130; ++size) {
    const PageGeometry page(size);
    EXPECT_EQ(page.shift >= 0, (size & (size - 1)) == 0) << size;
    for (int64_t n = 0; n < 4 * size + 3; ++n) {
      ASSERT_EQ(page.page(n), n / size) << size << " " << n;
      ASSERT_EQ(page.offset(n), n % size) << size << " " << n;
      ASSERT_EQ(page.pages_for(n), (n + size - 1) / size) << size << " " << n;
      ASSERT_EQ(page.floor(n), n / size * size) << size << " " << n;
    }
  }
}

TEST(Rules, NewPageCount) {
  const PageGeometry p16(16), p1(1), p3(3);
  EXPECT_EQ(new_page_count(0, 0, p16), 0);
  EXPECT_EQ(new_page_count(0, 1, p16), 1);
  EXPECT_EQ(new_page_count(5, 16, p16), 0);  // stays in the partial page
  EXPECT_EQ(new_page_count(16, 17, p16), 1);
  EXPECT_EQ(new_page_count(3, 40, p16), 2);
  EXPECT_EQ(new_page_count(7, 9, p1), 2);
  EXPECT_EQ(new_page_count(2, 7, p3), 2);  // a page size that is not a power of two
}

TEST(Rules, ExtendSlotThreeParts) {
  // prefix 5 ending at slot 36 (page 2, offset 4), growing to 40 with page size 16:
  // 11 tokens finish page 2, 16 fill new page 9, 8 start new page 4.
  const std::vector<int64_t> pages = {9, 4};
  const auto page_at = [&](int64_t k) { return pages[k]; };
  std::vector<int64_t> slots;
  for (int64_t t = 0; t < 35; ++t) slots.push_back(extend_slot(t, 5, 40, 36, PageGeometry(16), page_at));
  EXPECT_EQ(slots[0], 37);
  EXPECT_EQ(slots[10], 47);
  EXPECT_EQ(slots[11], 9 * 16);
  EXPECT_EQ(slots[26], 9 * 16 + 15);
  EXPECT_EQ(slots[27], 4 * 16);
  EXPECT_EQ(slots[34], 4 * 16 + 7);
}

TEST(Rules, DecodeIsAnExtendByOne) {
  const auto page_at = [](int64_t) { return int64_t{7}; };
  EXPECT_EQ(extend_slot(0, 16, 17, 31, PageGeometry(16), page_at), 7 * 16);  // crosses into a new page
  EXPECT_EQ(extend_slot(0, 17, 18, 112, PageGeometry(16), page_at), 113);    // continues its page
  EXPECT_EQ(extend_slot(0, 3, 4, 99, PageGeometry(1), page_at), 7);          // token pool: always fresh
}

TEST(Rules, SwaTailLen) {
  EXPECT_EQ(swa_tail_len(0, 40, PageGeometry(16), false), 0);
  EXPECT_EQ(swa_tail_len(30, 40, PageGeometry(16), false), 30);   // shorter than the window: all of it
  EXPECT_EQ(swa_tail_len(68, 40, PageGeometry(16), false), 52);   // start 28 -> 16
  EXPECT_EQ(swa_tail_len(68, 40, PageGeometry(16), true), 52);    // 68-1-40 = 27 -> 16
  EXPECT_EQ(swa_tail_len(100, 40, PageGeometry(16), true), 52);   // 100-1-40 = 59 -> 48
  EXPECT_EQ(swa_tail_len(100, 4, PageGeometry(16), true), 20);    // keep max(W, ps) = 16: 83 -> 80
  EXPECT_EQ(swa_tail_len(10, 24, PageGeometry(1), false), 10);
  EXPECT_EQ(swa_tail_len(30, 24, PageGeometry(1), false), 24);
}

TEST(Rules, EvictedAfterStep) {
  EXPECT_EQ(evicted_after_step(0, 40, 40, PageGeometry(16), 1, false), 0);   // nothing out of window yet
  EXPECT_EQ(evicted_after_step(0, 56, 40, PageGeometry(16), 1, false), 16);  // 16 tokens out: one page
  EXPECT_EQ(evicted_after_step(16, 60, 40, PageGeometry(16), 1, false), 16); // 20 out, not yet a new page
  EXPECT_EQ(evicted_after_step(0, 56, 40, PageGeometry(16), 32, false), 0);  // interval not reached
  EXPECT_EQ(evicted_after_step(0, 120, 40, PageGeometry(16), 1, true), 64);  // keeps 40 rounded up to a page, 48: 72 -> 64
  EXPECT_EQ(evicted_after_step(5, 30, 24, PageGeometry(1), 1, false), 6);
}

TEST(Rules, WindowEvictionDue) {  // SGLang's trigger: pre_len - window >= evicted + interval
  EXPECT_FALSE(window_eviction_due(16, 56, 40, 1));  // nothing left the window since 16
  EXPECT_TRUE(window_eviction_due(16, 57, 40, 1));
  EXPECT_FALSE(window_eviction_due(0, 40 + 127, 40, 128));
  EXPECT_TRUE(window_eviction_due(0, 40 + 128, 40, 128));
  EXPECT_FALSE(window_eviction_due(0, 3, 40, 1));  // shorter than the window
}

TEST(Rules, SwaDeadLo) {  // SGLang's ReqKvInfo.swa_dead_lo
  EXPECT_EQ(swa_dead_lo(32, 0, PageGeometry(16)), 32);   // the tree's prefix
  EXPECT_EQ(swa_dead_lo(32, 20, PageGeometry(16)), 32);  // a shield inside the prefix
  EXPECT_EQ(swa_dead_lo(32, 37, PageGeometry(16)), 48);  // a shield above it, up to a page
  EXPECT_EQ(swa_dead_lo(32, 48, PageGeometry(16)), 48);
  EXPECT_EQ(swa_dead_lo(0, 37, PageGeometry(1)), 37);
  EXPECT_EQ(swa_dead_lo(3, 0, PageGeometry(16)), 3);  // a prefix is not rounded (SGLang asserts it aligned)
}
