// The device allocator: the pools and the mapping live in device memory and change only
// through the ops of device_ops.h; the host keeps the counts it decides by (how many
// pages are free or staged) and never reads device memory to make a decision, except
// after a free whose page count depends on index values (free / free_swa / free_full of
// a page pool, a free group holding such frees): its count is read back once, lazily,
// when a later call needs it.
//
// Checks that need index values run on the device into an error record. With
// debug=true (SWA_EXT_DEBUG=1) every call waits for them and a bad call raises before
// it changes anything, as on the CPU. Otherwise the record is read where the host
// waits anyway; a bad call found there raises DeferredError, and the allocator refuses
// every call until clear() or restore_state().
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "executor.h"
#include "hybrid_allocator.h"

namespace swa {

struct DeferredError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The calls and arguments an error record can name.
enum DeviceCall : int64_t {
  kCallAlloc, kCallAllocExtend, kCallAllocDecode, kCallAllocExtendSwaTail, kCallFree, kCallFreeSwa, kCallFreeFull,
  kCallFreeSegment, kCallFreeSwaSegment, kCallFreeFullSegment, kCallFreePageIds, kCallEvict, kCallTranslate,
  kCallSetMapping, kCallClearMapping,
};
enum DeviceArg : int64_t { kArgLastLoc, kArgIndices, kArgPageIds, kArgReqToToken, kArgKvIndices, kArgFullIndices, kArgSwaIndices };

class DevicePool;

// What the pools of one allocator share: the executor, the error record, the counter
// copies, and the lazy read-back of counts.
class DeviceControl {
 public:
  DeviceControl(std::shared_ptr<Executor> executor, int num_pools, bool debug);
  Executor& exec() { return *executor_; }
  bool debug() const { return debug_; }
  int64_t* ctl(int pool) { return words_ + dev::kErrWords + 2 * dev::kCtlWords * pool; }
  dev::Origin origin(DeviceCall call, DeviceArg arg) { return dev::Origin{words_, call, arg}; }
  void attach(DevicePool* pool) { pools_.push_back(pool); }

  // Throws the deferred error that poisoned the allocator, if any.
  void check_usable() const;
  // Some counts are now known only on the device: read them back (asynchronously).
  void start_count_readback();
  // Waits for a pending read-back (the only wait on the hot path) and raises an error it carries.
  void resolve_counts();
  // Waits for everything enqueued; returns the error message, if the record holds one,
  // and clears the record.
  std::string take_error();
  // debug mode: raises a bad call's error before anything changes (undo() puts back
  // what the call had claimed).
  template <class Undo>
  void check_now(const Undo& undo) {
    if (!debug_) return;
    const std::string message = take_error();
    if (message.empty()) return;
    undo();
    throw ArgumentError(message);
  }
  // Waits for everything enqueued and raises (and keeps) an error the record holds.
  void raise_found_errors();
  void reset();  // clear() / restore_state(): a usable allocator again
  int64_t waits() const { return executor_->waits(); }

 private:
  std::string describe(const int64_t* record) const;
  void poison(const std::string& message);
  void clear_error_record();
  // Waits for a pending read-back and hands its counts to the pools; null when none.
  const int64_t* finish_pending_readback();

  std::shared_ptr<Executor> executor_;
  int num_pools_;
  bool debug_;
  int64_t* words_;  // error record, then two counter copies per pool
  std::vector<DevicePool*> pools_;
  bool readback_pending_ = false;
  std::string poisoned_;
};

// One pool in device memory; the page pool or the token pool (page size 1).
class DevicePool {
 public:
  DevicePool(std::shared_ptr<DeviceControl> control, int slot, int64_t size, int64_t page_size, bool need_sort);
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;

  int64_t size() const { return size_; }
  int64_t page_size() const { return page_.size; }
  const PageGeometry& geometry() const { return page_; }
  int64_t num_pages() const { return num_pages_; }
  bool need_sort() const { return need_sort_; }
  bool token_mode() const { return page_.size == 1; }
  bool in_free_group() const { return group_open_; }
  DeviceControl& control() { return *control_; }

  int64_t free_page_count();  // may wait for a pending read-back
  int64_t staged_page_count();
  int64_t available_pages() { return free_page_count() + staged_page_count(); }
  int64_t available_size() { return available_pages() * page_.size; }

  void clear();
  // As PagePool::resize: the device arrays were sized at construction and are kept.
  void resize(int64_t size, const char* arg = "size");
  int64_t capacity() const { return capacity_; }
  void merge_and_sort_free();
  bool alloc(int64_t need_size, OutBuffer& out);
  bool alloc_extend(const BatchLengths& batch, const LastLoc& last_loc, int64_t extend_num_tokens,
                    int64_t num_new_pages, OutBuffer& out);
  bool alloc_decode(const BatchLengths& batch, const LastLoc& last_loc, OutBuffer& out);
  void free(const int64_t* indices, int64_t n);
  void free_page_ids(const int64_t* pages, int64_t n);
  void free_segment(const int64_t* indices, int64_t n, int64_t start_pos);
  void free_group_begin();
  void free_group_end(GroupOrder order = kPoolGroupOrder);

  PagePool snapshot();  // waits; the pool as the CPU core would hold it
  void restore(const PagePool& pool);
  void check_invariants() { snapshot().check_invariants(); }

  // Building blocks for the hybrid allocator.
  dev::PoolView view();  // reads the current counter copy, writes the other
  void flip() { parity_ ^= 1; }
  int64_t* list() { return list_; }
  // As PagePool::merge_if_due.
  void merge_if_due(const AllocPlan& plan, PoolRole role);
  void took(int64_t n) { free_count_ -= n; }
  // Claims the pages of slots as free() does; with `into_list` (token pool) in input order.
  void claim_slots(const int64_t* indices, int64_t n, const dev::Origin& origin);
  void claim_segment(const int64_t* indices, int64_t n, int64_t start_pos, const dev::Origin& origin);
  // Releases what the claims of one call marked: by_index as free() does (page order in a
  // page pool), else list()[0 .. n) in order.
  void finish(bool by_index, int64_t n);
  void release_list(const int64_t* pages, int64_t n, bool by_index);
  void undo_claims();
  void check_page_count(const char* arg, int64_t pages) const;
  void count_readback_started() { base_parity_ = parity_, base_unknown_ = true, free_count_ = staged_count_ = 0; }
  void count_readback_finished(const int64_t* ctl_copies);

 private:
  Destination destination(bool by_index) const;
  void release(const int64_t* pages, int64_t n, const int64_t* device_count, int64_t launch, Destination dest,
               int64_t reset_word);
  // The checked plan of an allocation, carried out; its merge trigger runs after the
  // debug checks and before the refusal.
  bool allocate(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc, DeviceCall call,
                OutBuffer& out);

  std::shared_ptr<DeviceControl> control_;
  int slot_;
  int64_t size_, num_pages_, capacity_;
  PageGeometry page_;
  bool need_sort_;
  // device arrays
  int64_t *ring_, *staged_, *group_index_, *group_pages_, *list_, *selected_, *selected_count_;
  dev::StateWord* state_;
  int parity_ = 0;
  // Host counts. While base_unknown_, they are changes since the read-back that will
  // supply the base (taken at counter copy base_parity_).
  int64_t free_count_ = 0, staged_count_ = 0;
  bool base_unknown_ = false;
  int base_parity_ = 0;
  bool group_open_ = false, group_has_index_frees_ = false;
  int64_t group_index_count_ = 0, group_page_count_ = 0;  // host-known group queues
};

// SWATokenToKVPoolAllocator on the device.
class DeviceHybridAllocator {
 public:
  DeviceHybridAllocator(std::shared_ptr<Executor> executor, int64_t size, int64_t size_swa, int64_t page_size,
                        bool need_sort, bool debug, int64_t* mapping);

  DevicePool& full() { return *full_; }
  DevicePool& swa() { return *swa_; }
  const std::shared_ptr<DevicePool>& full_ptr() const { return full_; }
  const std::shared_ptr<DevicePool>& swa_ptr() const { return swa_; }
  int64_t page_size() const { return page_.size; }
  DeviceControl& control() { return *control_; }

  int64_t available_size();
  bool new_pages_available(int64_t num_full_pages, int64_t num_swa_pages);

  bool alloc(int64_t need_size, OutBuffer& out);
  bool alloc_extend(const BatchLengths& batch, const LastLoc& last_loc, int64_t extend_num_tokens, OutBuffer& out);
  bool alloc_extend_swa_tail(const BatchLengths& batch, const LastLoc& last_loc, int64_t extend_num_tokens,
                             int64_t swa_tail_len, OutBuffer& out);
  bool alloc_decode(const BatchLengths& batch, const LastLoc& last_loc, OutBuffer& out);

  void translate(const int64_t* indices, int64_t n, int64_t* out);
  void set_mapping(const int64_t* full_indices, int64_t n, const int64_t* swa_indices, int64_t n_swa);
  void clear_mapping(const int64_t* full_indices, int64_t n);

  void free(const int64_t* indices, int64_t n);
  void free_swa(const int64_t* indices, int64_t n);
  void free_full(const int64_t* indices, int64_t n);
  void free_segment(const int64_t* indices, int64_t n, int64_t start_pos);
  void free_swa_segment(const int64_t* indices, int64_t n, int64_t start_pos);
  void free_full_segment(const int64_t* indices, int64_t n, int64_t start_pos);
  void free_group_begin();
  void free_group_end();
  bool in_free_group() const { return full_->in_free_group(); }

  // As HybridAllocator::evict_out_of_window; rows, pre_lens and evicted_seqlens are
  // host values, req_to_token device memory (one of the two pointers set).
  void evict_out_of_window(const int32_t* req_to_token32, const int64_t* req_to_token64, int64_t num_rows,
                           int64_t row_len, Span rows, Span pre_lens, Span evicted_seqlens, int64_t window,
                           int64_t interval, bool prefix_sharing, int64_t* new_evicted);

  void clear();
  void resize(int64_t size, int64_t size_swa);  // as HybridAllocator::resize
  HybridAllocator::State backup_state();  // waits
  void restore_state(const HybridAllocator::State& state);
  void check_invariants();
  std::string debug_string();

 private:
  void reset_mapping();
  // The checked plan of an allocation, carried out.
  bool allocate(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc, DeviceCall call,
                OutBuffer& out);
  // The SWA half of free() / free_swa(): claims (pages of slots, or representatives);
  // check_swa_claim does its host-side checks, before anything is launched.
  void check_swa_claim(int64_t count, bool slots_of_page) const;
  void claim_swa(const int64_t* input, int64_t reps, bool slots_of_page, const dev::Origin& origin);
  void finish_swa(const int64_t* indices, int64_t n, int64_t reps, bool slots_of_page, bool by_index);
  void undo_claims() {
    full_->undo_claims();
    swa_->undo_claims();
  }

  PageGeometry page_;
  std::shared_ptr<DeviceControl> control_;
  std::shared_ptr<DevicePool> full_, swa_;
  int64_t* mapping_;
  int64_t mapping_len_;
  int64_t* full_pages_;  // scratch: full pages whose mapping a free clears
};

}  // namespace swa
