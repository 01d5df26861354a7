// The allocator's decisions, taken once for the CPU core and the device algorithm from
// host values only: the counts each pool keeps on the host and the CPU copies of the
// lengths. Nothing here reads index memory (last_loc, indices, the mapping); the
// checks that need index values stay with the pool that holds them.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <tuple>
#include <vector>

#include "errors.h"
#include "rules.h"
#include "span.h"

namespace swa {

// The lengths of a batch of requests growing from prefix to seq tokens: host values
// (the CPU copies), which every decision reads. Decode batches have no prefix span:
// each request grows by one token.
struct BatchLengths {
  Span prefix_lens;  // empty for decode
  Span seq_lens;
  bool decode = false;
  int64_t size() const { return seq_lens.size; }
  int64_t prefix(int64_t j) const { return decode ? seq_lens[j] - 1 : prefix_lens[j]; }
};

// Where each request's prefix ends (its last full slot, -1 for none), in the backend's
// memory: host memory for the CPU core, device memory for the device algorithm, which
// reads it only in its ops. Its size is known on the host.
struct LastLoc {
  const int64_t* data = nullptr;
  int64_t size = 0;
  LastLoc() = default;
  LastLoc(const int64_t* d, int64_t n) : data(d), size(n) {}
  LastLoc(const std::vector<int64_t>& v) : data(v.data()), size(static_cast<int64_t>(v.size())) {}
};

// ---------------------------------------------------------------- shapes

// A pool of `size` slots in pages of page_size slots (constructor and resize rule).
void check_pool_shape(const char* size_arg, int64_t size, int64_t page_size);

// The shared mode's parent pages (rules.h's parent_k): parent_k pages of small_side to a
// parent, one page of the other side. parent_k 1 is one page of either kind to a parent.
enum class Side { kFull, kSwa };
struct ParentLayout {
  int64_t k = 1;
  Side small_side = Side::kSwa;
  // Of a side: its pages to a parent.
  int64_t pages_per_parent(Side side) const { return side == small_side ? k : 1; }
};
constexpr int64_t kMaxParentK = 64;  // far above any served model's (MiMo-V2-Flash: 10)
// parent_k in [1, kMaxParentK], and above 1 only in the shared mode; small_side "full" or "swa".
ParentLayout check_parent_layout(int64_t parent_k, const std::string& small_side, bool shares_list);
// The hybrid allocator's two pools, checked before either is built; shares_list: the
// shared mode, whose one list of parents serves both kinds (the small side's size must be
// parent_k times the other's: size_swa equal to size at parent_k 1).
void check_hybrid_shape(int64_t size, int64_t size_swa, int64_t page_size, bool shares_list,
                        const ParentLayout& parents);
// The rule of resize() for every pool: at least one page, and no more slots than the
// pool was built with (its index arrays, device memory and the mapping table were sized then).
void check_resize(const char* arg, int64_t size, int64_t page_size, int64_t capacity);
// resize() of the hybrid allocator: both pools checked before either changes.
void check_hybrid_resize(int64_t size, int64_t size_swa, int64_t page_size, int64_t full_capacity,
                         int64_t swa_capacity, bool shares_list, const ParentLayout& parents);
// restore_state of a snapshot: it must come from an allocator (pool) of this shape.
void check_state_shape(const char* what, bool same_shape);
// clear, resize and restore_state of one pool: not of a side of the shared mode (its
// free list is the other side's too; the hybrid allocator's call serves both).
void check_pool_alone(const char* call, bool shares_list);

// Arguments that hold one entry per request of a batch must agree in length; the error
// names every one of them with its length (not only the first that differs).
struct BatchArg {
  const char* name;
  int64_t size;
};
void check_batch_lengths(std::initializer_list<BatchArg> args);

// ---------------------------------------------------------------- allocation

enum class AllocCall { kAlloc, kExtend, kExtendSwaTail, kDecode };

// What an allocation call takes, its arguments checked: num_tokens slots on the full
// pool (and, but for alloc_extend_swa_tail, the SWA pool), full_pages / swa_pages new
// pages, and for alloc_extend_swa_tail the swa_tokens of its tail.
struct AllocPlan {
  AllocCall call;
  int64_t batch_size, num_tokens, full_pages, swa_pages, swa_tokens;
  // The full slots of alloc_extend_swa_tail that get no SWA slot (the head).
  int64_t swa_head_len() const { return num_tokens - swa_tokens; }
};

// The argument checks of each allocation call (lengths and the size of last_loc; the
// values of last_loc are the pool's to check).
AllocPlan plan_alloc(int64_t need_size, const PageGeometry& page);
AllocPlan plan_extend(const BatchLengths& batch, const LastLoc& last_loc, int64_t extend_num_tokens,
                      const PageGeometry& page);
AllocPlan plan_extend_swa_tail(const BatchLengths& batch, const LastLoc& last_loc, int64_t extend_num_tokens,
                               int64_t swa_tail_len, const PageGeometry& page);
AllocPlan plan_decode(const BatchLengths& batch, const LastLoc& last_loc, const PageGeometry& page);
// A lone pool's alloc_extend may be told the page count (SGLang's num_new_pages); it must agree.
void check_num_new_pages(int64_t num_new_pages, const AllocPlan& plan);

enum class PoolRole { kFull, kSwa };
using Wide = __int128;  // counts up to 2**62 and their sums and products, which int64 cannot hold
// What one pool offers: `parents` entries of its list (free and staged ones, or free ones
// alone where a merge is decided; in the default mode and on the larger side a parent is a
// page), its pages to a parent (parent_k on the shared mode's small side, else 1), the free
// pages of its partly used parents (the small side's), all the list's parents, its slots.
struct PoolRoom {
  int64_t parents, pages_per_parent, free_children, num_parents, size;
};
// The pages a side can take: its parents' pages and its partly used parents' free ones.
inline int64_t pages_of_parents(int64_t parents, int64_t pages_per_parent, int64_t free_children) {
  return parents * pages_per_parent + free_children;
}
inline int64_t room_pages(const PoolRoom& pool) {
  return pages_of_parents(pool.parents, pool.pages_per_parent, pool.free_children);
}
// The parents a side binds to take `pages` pages: its free children first, then whole
// parents (the last one partly used). A negative count (new_pages_available takes any, as
// SGLang's does) counts as itself.
inline Wide parents_for(Wide pages, int64_t pages_per_parent, Wide free_children) {
  if (pages < 0) return pages;
  const Wide fresh = pages - free_children;
  return fresh <= 0 ? 0 : (fresh + pages_per_parent - 1) / pages_per_parent;
}
// Whether a demand of both kinds fits (pages, or tokens): each within its pool's room, or
// where the two sides share one list (shares_list: the shared mode) the parents both bind
// within the list's.
inline bool demand_fits(Wide full, Wide swa, const PoolRoom& f, const PoolRoom& s, bool shares_list) {
  if (shares_list)
    return parents_for(full, f.pages_per_parent, f.free_children) + parents_for(swa, s.pages_per_parent, s.free_children) <=
           f.parents;
  return full <= f.parents && swa <= s.parents;
}
// SGLang's can_reserve: full_tokens and swa_tokens of KV to come, beside what the radix
// tree could give back of each side (the evictable tokens), or against the empty pool;
// token_slack keeps a token of the pool to spare.
struct Reservation {
  int64_t full_tokens, swa_tokens, full_evictable_tokens, swa_evictable_tokens;
  bool empty_pool, token_slack;
};
// Each count in [0, 2**62] (the longest length a pool holds), else ArgumentError naming it.
void check_reservation(const Reservation& r);
// Whether a checked reservation fits. Each side takes whole pages, as an allocation does
// (pages_for); each side's evictable tokens give back its whole pages: to its own demand
// first (a small side's pages join its free children), the rest as whole parents (at
// parent_k 1 a page is one; on the small side, every parent_k of them count as one, a
// bound: the freed pages may not fill a parent). The empty pool offers all its parents and
// has nothing to evict; the slack is a token, not a page.
inline bool reservation_fits(const Reservation& r, const PoolRoom& full, const PoolRoom& swa, bool shares_list,
                             const PageGeometry& page) {
  const int64_t full_pages = page.pages_for(r.full_tokens), swa_pages = page.pages_for(r.swa_tokens);
  if (!shares_list) {
    if (r.token_slack && !(r.full_tokens < full.size && r.swa_tokens < swa.size)) return false;
    if (r.empty_pool) return full_pages <= full.num_parents && swa_pages <= swa.num_parents;
    return Wide{full_pages} <= Wide{full.parents} + page.page(r.full_evictable_tokens) &&
           Wide{swa_pages} <= Wide{swa.parents} + page.page(r.swa_evictable_tokens);
  }
  // The shared mode: tokens in the small side's slots (a large token is k small ones).
  if (r.token_slack && !(Wide{r.full_tokens} * swa.pages_per_parent + Wide{r.swa_tokens} * full.pages_per_parent <
                         Wide{full.size} * swa.pages_per_parent))
    return false;
  if (r.empty_pool)
    return parents_for(full_pages, full.pages_per_parent, 0) + parents_for(swa_pages, swa.pages_per_parent, 0) <=
           full.num_parents;
  Wide needed = 0, room = full.parents;
  for (const auto& [pages, tokens, pool] : {std::tuple{full_pages, r.full_evictable_tokens, full},
                                            std::tuple{swa_pages, r.swa_evictable_tokens, swa}}) {
    const Wide back = page.page(tokens), own = Wide{pages} - pool.free_children;  // beyond its free children
    if (own > back) needed += parents_for(own - back, pool.pages_per_parent, 0);
    else room += (back - (own > 0 ? own : 0)) / pool.pages_per_parent;  // its demand met, the rest whole parents
  }
  return needed <= room;
}
// need_sort's merge trigger of the call on one pool, given its free (not staged) pages.
// Inline, with the refusals: they run on every allocation.
inline bool merge_due(const AllocPlan& plan, PoolRole pool, int64_t free_pages, const PageGeometry& page) {
  const bool swa = pool == PoolRole::kSwa;
  switch (plan.call) {
    case AllocCall::kAlloc:
      return plan.full_pages > free_pages;
    case AllocCall::kDecode:
      return plan.batch_size > free_pages;
    case AllocCall::kExtend:
      return extend_merge_due(plan.full_pages, plan.num_tokens, plan.batch_size, free_pages, page);
    case AllocCall::kExtendSwaTail:
      if (!swa) return extend_merge_due(plan.full_pages, plan.num_tokens, 1, free_pages, page);
      return plan.swa_tokens > 0 && extend_merge_due(plan.swa_pages, plan.swa_tokens, 1, free_pages, page);
  }
  return false;
}

inline bool hybrid_refused(const AllocPlan& plan, const PoolRoom& full, const PoolRoom& swa, bool shares_list) {
  return !demand_fits(plan.full_pages, plan.swa_pages, full, swa, shares_list);
}
// need_sort's merge trigger of a list both sides share, on its free parents: each side's
// trigger against the pages it can take once the parents the other side binds first are
// set aside, so that a call never takes more parents than the list holds after it.
inline bool shared_list_merge_due(const AllocPlan& plan, const PoolRoom& full, const PoolRoom& swa,
                                  const PageGeometry& page) {
  const auto left = [](const PoolRoom& pool, const PoolRoom& other, int64_t other_pages) {
    const Wide parents = pool.parents - parents_for(other_pages, other.pages_per_parent, other.free_children);
    return static_cast<int64_t>(parents * pool.pages_per_parent + pool.free_children);
  };
  return merge_due(plan, PoolRole::kFull, left(full, swa, plan.swa_pages), page) ||
         merge_due(plan, PoolRole::kSwa, left(swa, full, plan.full_pages), page);
}
// A hybrid allocation is refused, before anything changes (merges included), unless both
// pools hold its pages (hybrid_refused); a lone pool merges first and refuses on its free
// pages then, as SGLang's does.
inline bool pool_refused(const AllocPlan& plan, int64_t free_pages_after_merge) {
  return plan.full_pages > free_pages_after_merge;
}
// available_size() of the hybrid allocator: what both pools can still hold.
inline int64_t hybrid_available_size(int64_t full_available, int64_t swa_available) {
  return full_available < swa_available ? full_available : swa_available;
}

// ---------------------------------------------------------------- frees

// Throws unless start_pos (where a freed segment starts in its request) is page-aligned.
void check_segment_start(int64_t start_pos, const PageGeometry& page);
// Free groups do not nest; begin and end pair up. `open`: whether a group is open
// (on either pool of a hybrid allocator).
void check_group_begin(bool open);
void check_group_end(bool open);
// Which queue of a group is released first at its end (SPEC.md sections 3 and 4 differ).
enum class GroupOrder { kIndicesFirst, kPageIdsFirst };
// The hybrid allocator ends its group SWA first, the page ids held from
// free_swa_segment before the slots from free_swa; a lone pool and the full pool
// release by index first.
constexpr GroupOrder kPoolGroupOrder = GroupOrder::kIndicesFirst;
constexpr GroupOrder kSwaGroupOrder = GroupOrder::kPageIdsFirst;
// The two queues of an open group: pages freed by index (free) and by id or segment.
enum class GroupQueue { kByIndex, kByPage };
inline GroupQueue first_queue(GroupOrder order) {
  return order == GroupOrder::kPageIdsFirst ? GroupQueue::kByPage : GroupQueue::kByIndex;
}
inline GroupQueue second_queue(GroupOrder order) {
  return order == GroupOrder::kPageIdsFirst ? GroupQueue::kByIndex : GroupQueue::kByPage;
}
// How a call's freed pages are ordered when released: free() of a page pool is one
// release of its distinct pages in page order; every other free keeps the order it names
// them in (the token pool's free() included: a slot is a page there).
enum class ReleaseOrder { kClaimOrder, kPageOrder };
inline ReleaseOrder release_order(bool by_index, int64_t page_size) {
  return by_index && page_size > 1 ? ReleaseOrder::kPageOrder : ReleaseOrder::kClaimOrder;
}
// At page size 1 a slot is a page: the SWA half of free() / free_swa() frees the
// mapped slots as a segment (one representative per page) instead of the mapped slots
// of each page.
inline bool swa_free_by_segment(int64_t page_size) { return page_size == 1; }
// An allocation continues each request's SWA pages from the SWA slot its last_loc maps
// to, but for alloc_extend_swa_tail, whose tail starts on fresh SWA pages.
inline bool swa_continues_prefix(AllocCall call) { return call != AllocCall::kExtendSwaTail; }

// ---------------------------------------------------------------- window eviction

// A batched eviction (evict_out_of_window) of the requests whose window moved past a
// page: the due ones in batch order, the first of their pages in the claim list
// (page_begin, one more entry than requests), and where in the released list each
// request's pages go. It releases exactly as one free_swa_segment per due request in
// batch order would: successive prepends put the last request's pages first; staging,
// appends and a group's queue keep batch order. release_each: the SWA side's pages are
// child pages (parent_k > 1), whose parents come back only as their last child does, so
// that no one block can order them: each request's pages (page_begin[j] ..
// page_begin[j + 1] of the claims, in batch order) are then a release of their own.
struct EvictionPlan {
  std::vector<int64_t> row, evicted, page_begin{0}, release_offset;
  bool release_each = false;
  int64_t num_due() const { return static_cast<int64_t>(row.size()); }
  int64_t total_pages() const { return page_begin.back(); }
};
// Checks the host arguments and writes each request's new evicted length (equal to the
// old one when nothing is due) and the plan (its lists reused: this runs every decode
// step); dest: where the SWA pool releases the pages; child_pages: the SWA pool's pages
// are child pages (its pages_per_parent above 1).
void plan_window_eviction(int64_t num_rows, int64_t row_len, Span rows, Span pre_lens, Span evicted_seqlens,
                          int64_t window, int64_t interval, bool prefix_sharing, const PageGeometry& page,
                          Destination dest, bool child_pages, int64_t* new_evicted, EvictionPlan& plan);
// A page size, window or interval of the window rules (rules.h): at least 1; returns it.
int64_t check_at_least_one(const char* arg, int64_t value);
// One request's lengths for evicted_after_step: pre_len >= 0, evicted page-aligned
// within [0, pre_len].
void check_evicted_len(int64_t evicted, int64_t pre_len, const PageGeometry& page);

// ---------------------------------------------------------------- mapping

// set_full_to_swa_mapping pairs its two index lists entry by entry.
void check_mapping_pairs(int64_t num_full, int64_t num_swa);

}  // namespace swa
