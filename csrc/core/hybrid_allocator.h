// The SWA hybrid allocator: a full-attention pool, an SWA pool of the same page size,
// and the full-to-SWA slot mapping (SPEC.md section 4), plus the batched window
// eviction of the decode side (section 5). Every call validates all of its input
// before it changes anything, so a rejected or refused call leaves no trace.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "page_pool.h"

namespace swa {

// The error of a request whose partial page has no live SWA slot to continue (the
// CPU's and the device's).
std::string swa_continuation_message(int64_t entry, int64_t last_loc, int64_t swa_last);
// The error of a kv_indices entry that translate_loc_from_full_to_swa cannot translate.
std::string untranslatable_message(int64_t entry, int64_t slot, int64_t mapping_len);
// Why a full slot freed by page representative cannot free an SWA page.
constexpr const char* kUnmappedRefusal = " has no SWA slot (already evicted or never mapped)";

// Checks the host arguments of a batched window eviction and writes each request's new
// evicted length (equal to the old one when nothing is due).
void plan_window_eviction(int64_t num_rows, int64_t row_len, Span rows, Span pre_lens, Span evicted_seqlens,
                          int64_t window, int64_t interval, bool prefix_sharing, int64_t page_size,
                          int64_t* new_evicted);

class HybridAllocator {
 public:
  // mapping: caller-owned storage of mapping_size(size, page_size) int64 values; it is
  // initialised here and must outlive the allocator.
  HybridAllocator(int64_t size, int64_t size_swa, int64_t page_size, bool need_sort, int64_t* mapping);
  static int64_t mapping_size(int64_t size, int64_t page_size) { return size + page_size + 1; }

  PagePool& full() { return *full_; }
  PagePool& swa() { return *swa_; }
  const PagePool& full() const { return *full_; }
  const PagePool& swa() const { return *swa_; }
  const std::shared_ptr<PagePool>& full_ptr() const { return full_; }
  const std::shared_ptr<PagePool>& swa_ptr() const { return swa_; }
  int64_t page_size() const { return page_size_; }
  const int64_t* mapping() const { return mapping_; }
  int64_t mapping_len() const { return mapping_len_; }

  int64_t available_size() const;
  bool new_pages_available(int64_t num_full_pages, int64_t num_swa_pages) const;

  bool alloc(int64_t need_size, OutBuffer& out);
  bool alloc_extend(const BatchLengths& batch, const LastLoc& last_loc, int64_t extend_num_tokens, OutBuffer& out);
  bool alloc_extend_swa_tail(const BatchLengths& batch, const LastLoc& last_loc, int64_t extend_num_tokens,
                             int64_t swa_tail_len, OutBuffer& out);
  bool alloc_decode(const BatchLengths& batch, const LastLoc& last_loc, OutBuffer& out);

  void translate(Span indices, int64_t* out) const;
  void set_mapping(Span full_indices, Span swa_indices);
  void clear_mapping(Span full_indices);

  void free(Span indices);
  void free_swa(Span indices);
  void free_full(Span indices);
  void free_segment(Span indices, int64_t start_pos);
  void free_swa_segment(Span indices, int64_t start_pos);
  void free_full_segment(Span indices, int64_t start_pos);
  void free_group_begin();
  void free_group_end();
  bool in_free_group() const { return full_->in_free_group(); }

  // For a batch of running requests whose rows of req_to_token hold their slots,
  // frees the SWA pages that slid out of the window, exactly as free_swa_segment per
  // due request in batch order would, and writes each request's new evicted length.
  template <class Slot>
  void evict_out_of_window(const Slot* req_to_token, int64_t num_rows, int64_t row_len, Span rows,
                           Span pre_lens, Span evicted_seqlens, int64_t window, int64_t interval,
                           bool prefix_sharing, int64_t* new_evicted);

  void clear();
  // Both pools cleared at new sizes (SGLang's post-capture KV sizing); the mapping table
  // keeps its length and is cleared.
  void resize(int64_t size, int64_t size_swa);
  std::string debug_string() const;
  static std::string debug_string(const PagePool& full, const PagePool& swa);
  void check_invariants() const;
  static void check_invariants(const PagePool& full, const PagePool& swa, const int64_t* mapping, int64_t mapping_len);

  struct State {
    PagePool full, swa;
    std::vector<int64_t> mapping;
    bool operator==(const State& o) const { return full == o.full && swa == o.swa && mapping == o.mapping; }
    bool fits(int64_t size, int64_t size_swa, int64_t page_size, int64_t mapping_len) const {
      return static_cast<int64_t>(mapping.size()) == mapping_len && full.size() == size && swa.size() == size_swa &&
             full.page_size() == page_size;
    }
  };
  State backup_state() const;
  void restore_state(const State& state);

 private:
  void reset_mapping();
  // SWA slot of full slot `last` for continuing a prefix; checked where it is used.
  int64_t swa_last_loc(int64_t last) const { return last < 0 ? -1 : mapping_[last]; }
  void check_swa_continuation(const BatchLengths& batch, const LastLoc& last_loc) const;
  void write_mapping(const int64_t* full_slots, const int64_t* swa_slots, int64_t n);
  // Both pools grow the batch from the heads of their free lists (capacity already checked).
  // last_loc: null for a batch without prefixes (alloc).
  void write_batch(const AllocPlan& plan, const BatchLengths& batch, const int64_t* last_loc, OutBuffer& out);
  // The refusal, then the merges that are due; false: refused, nothing changed.
  bool merge_unless_refused(const AllocPlan& plan);
  // alloc_extend / alloc_decode once planned.
  bool allocate(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc, OutBuffer& out);
  // SWA pages mapped from the pages of `indices` (free_swa), claimed; full pages noted.
  void claim_swa_of_pages(PageClaim& claim, Span indices, std::vector<int64_t>& full_pages) const;
  // SWA pages of num_reps page representatives (free_swa_segment: indices[::page_size]),
  // claimed; rep_at(i) reads the i-th. The full pages are noted for clearing.
  template <class RepAt>
  void claim_swa_of_reps(PageClaim& claim, const char* arg, int64_t num_reps, const RepAt& rep_at,
                         std::vector<int64_t>& full_pages) const;
  void claim_swa_of_segment(PageClaim& claim, Span indices, int64_t start_pos, std::vector<int64_t>& full_pages) const;
  void clear_mapping_of_pages(const std::vector<int64_t>& full_pages);
  // The SWA side of free() / free_swa().
  void claim_swa_of_free(PageClaim& claim, Span indices, std::vector<int64_t>& full_pages) const;
  // Clears the mapping of the noted full pages and hands the claimed SWA pages back.
  void finish_swa_free(PageClaim& claim, const std::vector<int64_t>& full_pages);

  int64_t page_size_;
  std::shared_ptr<PagePool> full_, swa_;
  int64_t* mapping_;
  int64_t mapping_len_;
  std::vector<int64_t> swa_slots_;  // scratch for the SWA half of an allocation
};

template <class Slot>
void HybridAllocator::evict_out_of_window(const Slot* req_to_token, int64_t num_rows, int64_t row_len,
                                          Span rows, Span pre_lens, Span evicted_seqlens, int64_t window,
                                          int64_t interval, bool prefix_sharing, int64_t* new_evicted) {
  const int64_t bs = rows.size;
  plan_window_eviction(num_rows, row_len, rows, pre_lens, evicted_seqlens, window, interval, prefix_sharing,
                       page_size_, new_evicted);
  // Claim everything first; the frees happen only if all of it holds.
  PageClaim claim(*swa_, false);
  std::vector<int64_t> full_pages, request_end(static_cast<size_t>(bs));
  for (int64_t j = 0; j < bs; ++j) {
    const int64_t row = rows[j], evicted = evicted_seqlens[j], next = new_evicted[j];
    if (next > evicted) {
      const Slot* segment = req_to_token + row * row_len + evicted;  // page-aligned: one rep per page
      const auto rep_at = [segment, this](int64_t i) { return static_cast<int64_t>(segment[i * page_size_]); };
      claim_swa_of_reps(claim, "req_to_token", full_->geometry().page(next - evicted), rep_at, full_pages);
    }
    request_end[j] = static_cast<int64_t>(claim.pages().size());
  }
  if (swa_->in_free_group()) {  // the group queues the pages in call order
    finish_swa_free(claim, full_pages);
    return;
  }
  claim.commit();
  clear_mapping_of_pages(full_pages);
  // Release request by request: successive prepends, as successive calls would do.
  std::vector<int64_t> pages;
  int64_t begin = 0;
  for (int64_t j = 0; j < bs; ++j) {
    pages.assign(claim.pages().begin() + begin, claim.pages().begin() + request_end[j]);
    begin = request_end[j];
    swa_->release(pages);
  }
}

template <class RepAt>
void HybridAllocator::claim_swa_of_reps(PageClaim& claim, const char* arg, int64_t num_reps, const RepAt& rep_at,
                                        std::vector<int64_t>& full_pages) const {
  for (int64_t i = 0; i < num_reps; ++i) {
    const int64_t full_slot = rep_at(i);
    const int64_t page = full_->page_of(arg, full_slot);
    const int64_t swa_slot = mapping_[full_slot];
    if (swa_slot <= 0) fail(arg, "full slot ", full_slot, kUnmappedRefusal);
    claim.add(arg, swa_->page_of(arg, swa_slot), false);
    full_pages.push_back(page);
  }
}

}  // namespace swa
