// The allocator's arithmetic, written once. Everything here is a pure function of
// lengths and page ids so the CPU path and the CUDA kernels share it verbatim.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SWA_HD __host__ __device__ __forceinline__
#else
#define SWA_HD inline
#endif

namespace swa {

// Where a page is. The CPU pool stores it in a byte per page, the device pool in a
// 32-bit word per page (for atomicCAS); the values are the same.
enum class PageState : uint8_t {
  kHeld,           // handed out (page 0, the padding page, is always held)
  kFree,           // in the free list
  kStaged,         // freed under need_sort, waiting for the next merge
  kQueuedByIndex,  // freed by free() inside an open free group
  kQueuedByPage,   // freed by page id (free_page_ids / *_segment) inside an open free group
  kClaimed,        // transient: claimed by the call in progress
  // The shared mode's SWA pages: one free list serves both kinds, so a page's state
  // says which kind holds it, and a free of the other kind is caught as misuse.
  kHeldSwa,
  kClaimedSwa,
  kQueuedByIndexSwa,
  // A child page of parent 0 past the first (the shared mode at parent_k > 1): padding, never handed out.
  kPadding,
};

// The states a pool's pages take while out of the free list: a pool of the default mode
// (and the shared mode's full side) holds full pages, the shared mode's SWA side SWA pages.
// Functions, not constants: device code may call them, but not read a host constant of class type.
struct PageKind {
  PageState held, claimed, queued_by_index;
  SWA_HD static constexpr PageKind full() { return {PageState::kHeld, PageState::kClaimed, PageState::kQueuedByIndex}; }
  SWA_HD static constexpr PageKind swa() {
    return {PageState::kHeldSwa, PageState::kClaimedSwa, PageState::kQueuedByIndexSwa};
  }
};

// The shared mode's parent pages (SPEC.md section 8): a parent holds one page of the side
// whose KV entry (bytes a token) is larger, or parent_k pages of the other side, the larger
// entry padded to parent_k smaller ones. The one rule for parent_k.
SWA_HD int64_t parent_k(int64_t larger_entry_bytes, int64_t smaller_entry_bytes) {
  return (larger_entry_bytes - 1) / smaller_entry_bytes + 1;  // ceil, without overflow near 2**63
}
// The index layout: slots stay physical, so the smaller side's child page c lies in parent
// c / parent_k, and parent q holds child pages q * parent_k .. q * parent_k + parent_k - 1
// (the larger side's page q). Parent 0, all its child pages, is padding.
SWA_HD int64_t parent_of(int64_t child_page, int64_t k) { return child_page / k; }
SWA_HD int64_t first_child(int64_t parent, int64_t k) { return parent * k; }
// The child pages of num_parents parents: ids 1 .. child_page_count, those of parent 0 padding.
SWA_HD int64_t child_page_count(int64_t num_parents, int64_t k) { return (num_parents + 1) * k - 1; }
// One past the small side's last slot: its slots span the child pages of parent 0 too,
// (num_parents + 1) * k pages, k - 1 pages more than k times the large side's.
SWA_HD int64_t child_slot_end(int64_t num_parents, int64_t k, int64_t page_size) {
  return (child_page_count(num_parents, k) + 1) * page_size;
}

// Where released pages go.
enum class Destination : int32_t {
  kPrepend,     // page pool: the pages freed last are handed out first
  kAppend,      // token pool
  kStaged,      // need_sort
  kGroupIndex,  // open free group: the free() queue (every free of a token pool)
  kGroupPages,  // open free group: pages freed by id
};

// The one rule for it: an open free group holds them (the token pool has one queue:
// its free_page_ids is free()); else need_sort stages them; else the free list takes
// them, appended by the token pool, prepended by the page pool. by_index: freed as
// free() frees (by slot) rather than by page id.
SWA_HD Destination release_destination(bool group_open, bool by_index, bool need_sort, bool token_mode) {
  if (group_open) return by_index || token_mode ? Destination::kGroupIndex : Destination::kGroupPages;
  if (need_sort) return Destination::kStaged;
  return token_mode ? Destination::kAppend : Destination::kPrepend;
}

// A free may name a held page; with repeat_ok (free() and free_swa() of a page pool,
// whose slots stand for their pages) also a page this call or an earlier free() of the
// open group already names: the group's end frees the union of its free() calls.
SWA_HD bool repeats_a_claim(PageState state, bool repeat_ok, const PageKind& kind) {
  return repeat_ok && (state == kind.claimed || state == kind.queued_by_index);
}

// Page arithmetic of one page size on non-negative slots and lengths. Page sizes are
// powers of two in practice; shifts and masks then keep integer division (tens of
// cycles each) off the per-request paths.
struct PageGeometry {
  int64_t size;
  int shift;  // log2(size) when size is a power of two, else -1

  SWA_HD explicit PageGeometry(int64_t page_size) : size(page_size), shift(-1) {
    if (page_size > 0 && (page_size & (page_size - 1)) == 0)
      for (shift = 0; (int64_t{1} << shift) < page_size; ++shift) {
      }
  }
  SWA_HD int64_t page(int64_t slot) const { return shift >= 0 ? slot >> shift : slot / size; }
  SWA_HD int64_t offset(int64_t slot) const { return shift >= 0 ? slot & (size - 1) : slot % size; }
  SWA_HD int64_t pages_for(int64_t tokens) const { return page(tokens + size - 1); }
  SWA_HD int64_t floor(int64_t tokens) const { return tokens - offset(tokens); }
};

// Whether a slot lies in the pages of a pool of num_pages pages; page 0, the padding
// page, is never handed out, so no valid slot lies in it.
SWA_HD bool slot_in_pool(int64_t slot, const PageGeometry& page, int64_t num_pages) {
  return slot >= page.size && slot < (num_pages + 1) * page.size;
}

// Whether a page id names a page of a pool of num_pages pages (not the padding page 0).
SWA_HD bool page_id_in_pool(int64_t page, int64_t num_pages) { return page >= 1 && page <= num_pages; }

// Whether translate_loc_from_full_to_swa accepts a full slot: one of the mapping's
// mapping_len - 1 slots, or -1 (a request without a prefix), which reads the sentinel.
SWA_HD bool translatable(int64_t slot, int64_t mapping_len) { return slot >= -1 && slot < mapping_len - 1; }

// Why last_loc cannot end the prefix_len-token prefix of a request, given the state of
// the page it lies in; kNone when it can. A request without a prefix has last_loc -1.
enum class LastLocFault { kNone, kNotEmpty, kOutOfPool, kWrongOffset, kPageNotHeld };
template <class StateOfPage>
SWA_HD LastLocFault last_loc_fault(int64_t last_loc, int64_t prefix_len, const PageGeometry& page,
                                   int64_t num_pages, const StateOfPage& state_of_page) {
  if (prefix_len == 0) return last_loc == -1 ? LastLocFault::kNone : LastLocFault::kNotEmpty;
  if (!slot_in_pool(last_loc, page, num_pages)) return LastLocFault::kOutOfPool;
  if (page.offset(last_loc) != page.offset(prefix_len - 1)) return LastLocFault::kWrongOffset;
  if (state_of_page(page.page(last_loc)) != PageState::kHeld) return LastLocFault::kPageNotHeld;
  return LastLocFault::kNone;
}

// Whether a request writes into the partial page its prefix ends in, so that its SWA
// half needs the SWA slot of last_loc.
SWA_HD bool continues_partial_page(int64_t prefix_len, int64_t seq_len, const PageGeometry& page) {
  return page.offset(prefix_len) != 0 && seq_len > prefix_len;
}

// Whether a request's evicted length fits its committed length pre_len: page-aligned,
// within [0, pre_len].
SWA_HD bool evicted_len_ok(int64_t evicted, int64_t pre_len, const PageGeometry& page) {
  return evicted >= 0 && evicted <= pre_len && page.offset(evicted) == 0;
}

// Whether swa_last, the mapped SWA slot of full slot last_loc, can be continued: its
// page held as an SWA page (swa_held: the state the SWA pool's held pages take).
template <class StateOfPage>
SWA_HD bool swa_continuation_ok(int64_t last_loc, int64_t swa_last, const PageGeometry& page, int64_t swa_num_pages,
                                const StateOfPage& swa_state_of_page, PageState swa_held) {
  return swa_last > 0 && slot_in_pool(swa_last, page, swa_num_pages) && page.offset(swa_last) == page.offset(last_loc) &&
         swa_state_of_page(page.page(swa_last)) == swa_held;
}

// need_sort's merge trigger before an extend-shaped allocation: the free list is
// "low". The page pool merges early, when it is merely low; the token pool (page size
// 1) only when it is short. Before alloc() and decode the trigger is need > free.
SWA_HD bool extend_merge_due(int64_t need_pages, int64_t extend_num_tokens, int64_t batch_size, int64_t free_pages,
                             const PageGeometry& page) {
  const int64_t low_mark = page.size == 1 ? need_pages : page.page(extend_num_tokens) + batch_size + 1;
  return low_mark > free_pages;
}

// Pages a request gains when it grows from prefix_len to seq_len tokens.
SWA_HD int64_t new_page_count(int64_t prefix_len, int64_t seq_len, const PageGeometry& page) {
  return page.pages_for(seq_len) - page.pages_for(prefix_len);
}

// Slot of the t-th new token of one request growing from prefix_len to seq_len.
// The tokens first continue the partial page that ends at last_loc, then fill the
// request's new pages in order; page_at(k) is the k-th of those pages. A decode
// step is the case prefix_len = seq_len - 1, a fresh allocation prefix_len = 0.
template <class PageAt>
SWA_HD int64_t extend_slot(int64_t t, int64_t prefix_len, int64_t seq_len, int64_t last_loc,
                           const PageGeometry& page, const PageAt& page_at) {
  const int64_t prefix_page_end = page.pages_for(prefix_len) * page.size;
  const int64_t in_partial_page =
      (seq_len < prefix_page_end ? seq_len : prefix_page_end) - prefix_len;
  if (t < in_partial_page) return last_loc + 1 + t;
  const int64_t u = t - in_partial_page;
  return page_at(page.page(u)) * page.size + page.offset(u);
}

// Decode side of disaggregation: how many of the last tokens of a seq_len-token
// prompt need SWA KV. The cut is page-aligned so evicted lengths stay aligned.
SWA_HD int64_t swa_tail_len(int64_t seq_len, int64_t window, const PageGeometry& page, bool radix_cache) {
  if (seq_len <= 0) return 0;
  int64_t start;
  if (radix_cache) {
    // Keep a whole window behind the page-aligned insert boundary of the radix cache.
    const int64_t keep = window > page.size ? window : page.size;
    start = seq_len - 1 - keep;
  } else {
    start = seq_len - window;
  }
  if (start < 0) start = 0;
  return seq_len - page.floor(start);
}

// Whether a request's window eviction is due: `interval` tokens have left the window since
// its evicted length (SGLang's _swa_eviction_trigger). Written as pre_len - window >=
// evicted + interval rearranged so that no step overflows, given window, interval >= 1
// and either 0 <= evicted <= pre_len or all four below 2**62 (the callers check one).
SWA_HD bool window_eviction_due(int64_t evicted, int64_t pre_len, int64_t window, int64_t interval) {
  return pre_len - evicted - window >= interval;
}

// The lowest position a request frees its SWA KV from itself (SGLang's
// ReqKvInfo.swa_dead_lo): above the prefix the radix tree owns and above the eviction
// shield; a shield above the prefix is rounded up to a whole page.
SWA_HD int64_t swa_dead_lo(int64_t protected_len, int64_t evict_floor, const PageGeometry& page) {
  if (evict_floor <= protected_len) return protected_len;
  return page.size > 1 ? page.pages_for(evict_floor) * page.size : evict_floor;
}

// Window eviction during decode: the new evicted length of a request whose committed
// length is pre_len; equal to `evicted` when nothing is due. It runs for every request of
// every decode step, so it takes the page geometry made once per call, not a page size.
SWA_HD int64_t evicted_after_step(int64_t evicted, int64_t pre_len, int64_t window, const PageGeometry& page,
                                  int64_t interval, bool prefix_sharing) {
  if (!window_eviction_due(evicted, pre_len, window, interval)) return evicted;
  int64_t keep = window;
  if (prefix_sharing) keep = page.pages_for(window > page.size ? window : page.size) * page.size;
  const int64_t target = pre_len - keep > evicted ? pre_len - keep : evicted;
  const int64_t aligned = page.floor(target);
  return aligned > evicted ? aligned : evicted;
}

}  // namespace swa
