// The allocators, one of each for every backend: PoolAllocator is SGLang's
// PagedTokenToKVPoolAllocator / TokenToKVPoolAllocator, HybridAllocator its
// SWATokenToKVPoolAllocator (SPEC.md sections 1-4) plus the batched window eviction of
// the decode side (section 5). Each call is check, then plan (plan.h), then store
// (store.h: host or device memory); every decision is taken here, from host values, so
// the host store and the device store carry out the same one. A call checks all of its
// input before it changes anything, so a rejected or refused call leaves no trace.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "host_store.h"

namespace swa {

class PoolAllocator {
 public:
  explicit PoolAllocator(std::shared_ptr<PoolStore> store) : store_(std::move(store)) {}
  PoolStore& store() { return *store_; }
  const PoolStore& store() const { return *store_; }

  int64_t available_size() { return store_->available_pages() * store_->geometry().size; }
  // An allocation returns false, changing nothing, when the pool is short; bad arguments
  // throw ArgumentError, changing nothing.
  bool alloc(int64_t need_size, OutBuffer& out);
  // num_new_pages < 0: not given (SGLang computes it when it is None).
  bool alloc_extend(const BatchLengths& batch, const LastLoc& last_loc, int64_t extend_num_tokens,
                    int64_t num_new_pages, OutBuffer& out);
  bool alloc_decode(const BatchLengths& batch, const LastLoc& last_loc, OutBuffer& out);
  void free(Span indices);
  void free_page_ids(Span pages);
  void free_segment(Span indices, int64_t start_pos);
  void free_group_begin();
  void free_group_end();
  void merge_and_sort_free();

  void clear() {
    check_pool_alone("clear", store_->shares_list());
    store_->clear();
  }
  void resize(int64_t size);
  PagePool backup_state() { return store_->snapshot(); }
  void restore_state(const PagePool& state);
  void check_invariants() { store_->snapshot().check_invariants(); }
  std::string debug_string() { return store_->snapshot().debug_string(); }

 private:
  bool allocate(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc, Call call,
                OutBuffer& out);

  std::shared_ptr<PoolStore> store_;
};

class HybridAllocator {
 public:
  explicit HybridAllocator(std::unique_ptr<HybridStore> store);
  // The mapping table's length for pools of this shape, which it checks first.
  static int64_t mapping_size(int64_t size, int64_t size_swa, int64_t page_size, bool shares_list,
                              const ParentLayout& parents = ParentLayout{});

  HybridStore& store() { return *store_; }
  PoolStore& full() { return store_->full(); }
  PoolStore& swa() { return store_->swa(); }
  int64_t page_size() const { return page_.size; }

  int64_t available_size();
  int64_t full_available_size() { return full().available_pages() * page_.size; }
  int64_t swa_available_size() { return swa().available_pages() * page_.size; }
  // Tokens in the pages each kind holds (PoolStore::held_pages); in the shared mode
  // full_used_size() + swa_used_size() + available_size() covers the one list.
  int64_t full_used_size() { return full().held_pages() * page_.size; }
  int64_t swa_used_size() { return swa().held_pages() * page_.size; }
  bool new_pages_available(int64_t num_full_pages, int64_t num_swa_pages);
  // Whether a reservation fits both pools (plan.h's reservation_fits), its counts checked.
  bool reservation_fits(const Reservation& reservation);

  bool alloc(int64_t need_size, OutBuffer& out);
  bool alloc_extend(const BatchLengths& batch, const LastLoc& last_loc, int64_t extend_num_tokens, OutBuffer& out);
  bool alloc_extend_swa_tail(const BatchLengths& batch, const LastLoc& last_loc, int64_t extend_num_tokens,
                             int64_t swa_tail_len, OutBuffer& out);
  bool alloc_decode(const BatchLengths& batch, const LastLoc& last_loc, OutBuffer& out);

  void translate(Span indices, int64_t* out);
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

  // For a batch of running requests whose rows of req_to_token hold their slots, frees
  // the SWA pages that slid out of the window, exactly as free_swa_segment per due
  // request in batch order would, and writes each request's new evicted length.
  void evict_out_of_window(const SlotRows& req_to_token, Span rows, Span pre_lens, Span evicted_seqlens,
                           int64_t window, int64_t interval, bool prefix_sharing, int64_t* new_evicted);

  void clear() { store_->clear(); }
  // Both pools cleared at new sizes (SGLang's post-capture KV sizing); the mapping table
  // keeps its length and is cleared.
  void resize(int64_t size, int64_t size_swa);
  AllocatorState backup_state() { return store_->backup(); }
  void restore_state(const AllocatorState& state);
  void check_invariants();
  std::string debug_string();

 private:
  // free / free_swa / free_full: the slots' pages on the pools named.
  void free_slots(Span indices, Call call, bool full_side, bool swa_side);
  // Frees the full pages of the representatives indices[::page_size] (full_side) and the
  // SWA pages they map to (swa_side); by_index: as free() frees them (page size 1).
  void free_by_representatives(Span indices, Call call, bool full_side, bool swa_side, bool by_index);
  // free_segment / free_swa_segment / free_full_segment.
  void free_pages_of_segment(Span indices, int64_t start_pos, Call call, bool full_side, bool swa_side);
  // The SWA side of a free, once claimed: mapping cleared, pages released (releases: as
  // PoolStore::release_claims; an eviction's, one a request, where its pages are child pages).
  void release_swa(bool by_index, Span releases = Span());
  bool allocate(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc, Call call,
                OutBuffer& out);

  std::unique_ptr<HybridStore> store_;
  PageGeometry page_;
  EvictionPlan eviction_;  // evict_out_of_window's plan, its lists kept from call to call
};

// Throws std::logic_error naming the first broken invariant of a hybrid allocator's state
// (of either mode: its pools say whether they share one list).
void check_invariants(const AllocatorState& state);

}  // namespace swa
