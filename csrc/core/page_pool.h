// One KV page pool: an ordered free list of page ids with SGLang's exact hand-out
// order, the need_sort staging list, free groups, and a per-page state that catches
// double frees before anything changes. Page size 1 is the token pool, whose frees
// append instead of prepend (SPEC.md sections 1-3).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "errors.h"
#include "plan.h"
#include "rules.h"
#include "span.h"

namespace swa {

class PagePool;

// The error of a last_loc entry that cannot end its prefix (the CPU's and the device's).
std::string last_loc_fault_message(LastLocFault fault, int64_t entry, int64_t last_loc, int64_t prefix_len,
                                   const PageGeometry& page, int64_t num_pages);
// Why a page in `state` cannot be freed now (the CPU's and the device's message).
const char* claim_refusal(PageState state);

// Pages a call is about to free, marked so that repeats and double frees are caught
// before anything changes. Unless committed, the marks are undone when it goes away,
// so a call that throws leaves the pool as it was.
class PageClaim {
 public:
  // by_index: the pages are freed as free() frees them (else by page id); this and
  // whether a free group is open decide the mark.
  PageClaim(PagePool& pool, bool by_index);
  PageClaim(const PageClaim&) = delete;
  PageClaim& operator=(const PageClaim&) = delete;
  ~PageClaim();
  // repeat_ok: the page may already carry this claim's mark (free() frees pages, not
  // tokens, so several tokens of one page are one free).
  void add(const char* arg, int64_t page, bool repeat_ok);
  const std::vector<int64_t>& pages() const { return pages_; }
  bool by_index() const { return by_index_; }
  void commit() { committed_ = true; }

 private:
  PagePool& pool_;
  bool by_index_;
  PageState target_;  // the state a claimed page takes now
  std::vector<int64_t> pages_;  // newly claimed, in first-seen order
  bool committed_ = false;
};

class PagePool {
 public:
  PagePool(int64_t size, int64_t page_size, bool need_sort);
  // A pool with the given contents (a device pool's snapshot); check_invariants() vets it.
  static PagePool from_parts(int64_t size, int64_t page_size, bool need_sort, const std::vector<int64_t>& free_list,
                             std::vector<int64_t> staged, std::vector<PageState> state, bool group_open,
                             std::vector<int64_t> group_index_pages, std::vector<int64_t> group_page_ids);

  int64_t size() const { return size_; }
  int64_t page_size() const { return page_size_; }
  const PageGeometry& geometry() const { return geometry_; }
  int64_t num_pages() const { return num_pages_; }
  bool need_sort() const { return need_sort_; }
  bool token_mode() const { return page_size_ == 1; }
  int64_t free_page_count() const { return free_count_; }
  int64_t staged_page_count() const { return static_cast<int64_t>(staged_.size()); }
  int64_t available_pages() const { return free_count_ + staged_page_count(); }
  int64_t available_size() const { return available_pages() * page_size_; }
  // One past the largest token index this pool hands out.
  int64_t index_end() const { return (num_pages_ + 1) * page_size_; }
  bool in_free_group() const { return group_open_; }

  void clear();
  // A cleared pool of `size` slots (check_resize); the object stays, so views of it stay valid.
  void resize(int64_t size, const char* arg = "size");
  int64_t capacity() const { return capacity_; }
  void merge_and_sort_free();

  // SGLang's calls on one pool. An allocation returns false, changing nothing, when the
  // pool is short; bad arguments throw ArgumentError, changing nothing.
  bool alloc(int64_t need_size, OutBuffer& out);
  // num_new_pages < 0: computed here from the lengths.
  bool alloc_extend(const BatchLengths& batch, const LastLoc& last_loc, int64_t extend_num_tokens,
                    int64_t num_new_pages, OutBuffer& out);
  bool alloc_decode(const BatchLengths& batch, const LastLoc& last_loc, OutBuffer& out);
  void free(Span indices);
  void free_page_ids(Span pages);
  void free_segment(Span indices, int64_t start_pos);
  void free_group_begin();
  void free_group_end(GroupOrder order = kPoolGroupOrder);

  // Building blocks for the hybrid allocator.
  int64_t page_of(const char* arg, int64_t index) const;  // checks the range
  void check_page_id(const char* arg, int64_t page) const;
  PageState state(int64_t page) const { return state_[page]; }
  int64_t page_at(int64_t k) const {  // k-th page of the free list
    int64_t pos = head_ + k;
    return ring_[pos >= num_pages_ ? pos - num_pages_ : pos];
  }
  // Checks that each request's last_loc ends its prefix in a page of this pool.
  void check_last_loc(const BatchLengths& batch, const LastLoc& last_loc) const;
  // The call's merge trigger (merge_due) on this pool, in its role.
  void merge_if_due(const AllocPlan& plan, PoolRole role);
  // Writes the slots of the batch, new pages taken from the head of the free list in
  // batch order; prefix_end(j) is where request j's prefix ends. Takes nothing.
  template <class PrefixEnd>
  void write_slots(const BatchLengths& batch, const PrefixEnd& prefix_end, int64_t* out) const;
  void take(int64_t n);  // the first n free pages become held
  // Claims the pages of token indices as free() does.
  void claim_indices(PageClaim& claim, const char* arg, Span indices) const;
  void claim_segment(PageClaim& claim, const char* indices_arg, Span indices, int64_t start_pos) const;
  // Commits a claim: the pages go to the open group's queue, or are released now.
  void finish(PageClaim& claim);
  // Pages into the free list or staging (release_destination outside a group), in this order.
  void release(const std::vector<int64_t>& pages);

  std::vector<int64_t> free_pages() const;  // in hand-out order
  const std::vector<int64_t>& staged_pages() const { return staged_; }
  const std::vector<int64_t>& group_index_pages() const { return group_index_pages_; }
  const std::vector<int64_t>& group_page_ids() const { return group_page_ids_; }
  std::string debug_string() const;
  // Throws std::logic_error naming the first broken invariant.
  void check_invariants() const;
  bool operator==(const PagePool& other) const;

 private:
  friend class PageClaim;
  void reset_state();
  // The checked plan of alloc_extend / alloc_decode, carried out.
  bool allocate(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc, int64_t num_new_pages,
                OutBuffer& out);
  std::vector<int64_t> queued_by_index() const;

  int64_t size_, page_size_, num_pages_;
  int64_t capacity_;  // the size at construction: resize() never grows past it
  PageGeometry geometry_;
  bool need_sort_;
  // The free list is ring_[head_ .. head_ + free_count_) modulo num_pages_: the page
  // pool prepends and the token pool appends, and both fit because a page is in at
  // most one place.
  std::vector<int64_t> ring_;
  int64_t head_ = 0, free_count_ = 0;
  std::vector<int64_t> staged_;
  std::vector<PageState> state_;  // indexed by page id; page 0 is the padding page
  bool group_open_ = false;
  std::vector<int64_t> group_index_pages_;  // pages of free() calls held by the group
  std::vector<int64_t> group_page_ids_;     // pages of free_page_ids calls held by the group
};

template <class PrefixEnd>
void PagePool::write_slots(const BatchLengths& batch, const PrefixEnd& prefix_end, int64_t* out) const {
  int64_t pos = 0, page_offset = 0;
  for (int64_t j = 0; j < batch.size(); ++j) {
    const int64_t prefix = batch.prefix(j), seq = batch.seq_lens[j];
    const int64_t last = prefix_end(j);
    const auto page_at_offset = [this, page_offset](int64_t k) { return page_at(page_offset + k); };
    for (int64_t t = 0; t < seq - prefix; ++t)
      out[pos++] = extend_slot(t, prefix, seq, last, geometry_, page_at_offset);
    page_offset += new_page_count(prefix, seq, geometry_);
  }
}

}  // namespace swa
