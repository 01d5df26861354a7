// The device store: the pools and the mapping live in device memory and change only
// through the ops of device_ops.h; the host keeps the counts the allocator decides by
// (how many pages are free or staged) and never reads device memory for them, except
// after a free whose page count depends on index values (free / free_swa / free_full of
// a page pool, a free group holding such frees): its count is read back once, lazily,
// when a later call needs it.
//
// Checks that need index values run on the device into an error record. With
// debug=true (SWA_EXT_DEBUG=1) every call waits for them and a bad call raises before
// it changes anything, as on the CPU. Otherwise every call first enqueues a copy of the
// record (when an op that can write it ran since the last copy) and reads the copies
// that have landed, without waiting (and the host reads the
// record where it waits anyway): a bad call found so raises DeferredError in the next
// call the device has caught up with, and the allocator refuses every call until clear()
// or restore_state(). Until the host reads it, the device
// keeps its pools whole: once the record holds an error no release moves a page or a
// count (the refused call's claimed pages stay out of every list), and an allocation
// takes only pages its free list holds, handing out slot 0 (the padding page) when the
// host's counts promise more.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "executor.h"
#include "page_pool.h"

namespace swa {

struct DeferredError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class DevicePool;

// What the pools of one allocator share: the executor, the error record, the counter
// copies, and the lazy read-back of counts.
class DeviceControl {
 public:
  DeviceControl(std::shared_ptr<Executor> executor, int num_pools, bool debug);
  Executor& exec() { return *executor_; }
  bool debug() const { return debug_; }
  int64_t* counters(int pool) { return words_ + dev::kErrWords + 2 * dev::kCounterWords * pool; }
  // Each origin stands for one launch, numbered in the order they are made (and launched).
  dev::Origin origin(Call call, Arg arg) { return dev::Origin{words_, call, arg, ++launches_}; }
  // A release's: it blames no argument (its counts come from the call's claims).
  dev::Origin release_origin() { return dev::Origin{words_, -1, -1, ++launches_}; }
  void attach(DevicePool* pool) { pools_.push_back(pool); }
  // A pool going away (a hybrid allocator's pool view can outlive the other pool).
  void detach(DevicePool* pool);

  // Every call's first step: throws the deferred error that poisoned the allocator, or
  // that a copy of the error record which has landed holds (never waiting for one).
  void check_usable();
  void throw_if_poisoned() const;
  // Some counts are now known only on the device: read them back (asynchronously).
  void start_count_readback();
  // Waits for a pending read-back (the only wait on the hot path) and raises an error it carries.
  void resolve_counts();
  // Waits for everything enqueued; returns the error message, if the record holds one,
  // and clears the record.
  std::string take_error();
  // debug mode: raises a bad call's error before anything changes (the caller puts back
  // what the call had claimed).
  void check_now();
  // A call's claims are launched only once every host-side check of the call has passed,
  // so that a call refused on the host leaves nothing in the error record.
  void defer_claim(std::function<void()> launch) { deferred_claims_.push_back(std::move(launch)); }
  // Launches the deferred claims, then (debug mode) raises what they found.
  void launch_claims();
  // Drops the claims not launched; true when launched ones must be put back.
  bool drop_claims();
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
  std::vector<std::function<void()>> deferred_claims_;
  bool claims_unconfirmed_ = false;  // launched, and their check raised
  int64_t launches_ = 0;
  int64_t watched_launches_ = 0;  // launches_ when the record's last copy was enqueued
};

// A free list in device memory (with its staging list, page states and counter block)
// and the host's counts of it: a pool's own, or in the shared mode the one list of the
// full and the SWA side.
struct DeviceList {
  int slot;  // its counter block in the control's words
  int64_t *ring, *staged, *ring_pos;
  dev::StateWord* state;
  int parity = 0;  // the current counter copy
  // Host counts. While base_unknown, they are changes since the read-back that will
  // supply the base (taken at counter copy base_parity).
  int64_t free_count = 0, staged_count = 0;
  bool base_unknown = false;
  int base_parity = 0;
};

// One pool in device memory; the page pool or the token pool (page size 1).
class DevicePool final : public PoolStore {
 public:
  DevicePool(std::shared_ptr<DeviceControl> control, int slot, int64_t size, int64_t page_size, bool need_sort);
  // The shared mode's SWA side: full_side's list, its own kind (SWA pages), claims and
  // free group queues.
  static std::shared_ptr<DevicePool> swa_side_of(DevicePool& full_side);
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;
  ~DevicePool() override { control_->detach(this); }

  // PoolStore
  int64_t size() const override { return size_; }
  int64_t capacity() const override { return capacity_; }
  const PageGeometry& geometry() const override { return page_; }
  int64_t num_pages() const override { return num_pages_; }
  int64_t num_parents() const override { return num_pages_; }
  // Parent pages at parent_k > 1 are the host store's alone (the bindings refuse them here).
  int64_t pages_per_parent() const override { return 1; }
  int64_t free_children() override { return 0; }
  bool need_sort() const override { return need_sort_; }
  int64_t free_pages() override;  // may wait for a pending read-back
  int64_t staged_pages() override;
  bool shares_list() const override { return shares_list_; }
  int64_t held_pages() override;
  bool group_open() const override { return group_open_; }
  void set_group_open(bool open) override;
  void check_usable() override { control_->check_usable(); }
  void merge() override;
  void validate_batch(const BatchLengths& batch, const LastLoc& last_loc, Call call) override;
  void write_batch(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc, Call call,
                   OutBuffer& out) override;
  void claim_slots(Span indices, Call call) override;
  void claim_segment(Span indices, Call call) override;
  void claim_page_ids(Span pages, Call call) override;
  void confirm_claims() override { control_->launch_claims(); }
  void undo_claims() override;
  void release_claims(Destination dest, ReleaseOrder order, Span releases) override;
  void release_group(GroupQueue queue, Destination dest, ReleaseOrder order) override;
  void clear() override;
  void resize(int64_t size) override;
  PagePool snapshot() override;  // waits
  void restore(const PagePool& state) override;

  DeviceControl& control() { return *control_; }
  // Building blocks for the hybrid store.
  dev::PoolView view();  // reads the current counter copy, writes the other
  void flip() { list_->parity ^= 1; }
  int64_t* claim_list() { return claims_; }
  void took(int64_t n) {
    list_->free_count -= n;
    held_count_ += n;
  }
  // Defers the launch of a claim of up to n pages (into list() in claim order when listed).
  template <class Op>
  void defer_claim(int64_t launch, int64_t n, const Op& op) {
    claim_count_ += n;
    control_->defer_claim([this, launch, op] { control_->exec().run(launch, op); });
  }
  // The claimed pages held again (the claims were launched).
  void unclaim_all();
  // The device's buffers hold num_pages entries: a free naming more pages frees one twice.
  void check_page_count(const char* arg, int64_t pages) const;
  void reset_pool();  // clear() without the control's reset, which the hybrid store does once
  void restore_pool(const PagePool& state);
  void count_readback_started() {
    list_->base_parity = list_->parity, list_->base_unknown = true, list_->free_count = list_->staged_count = 0;
    held_unknown_ = true, held_count_ = 0;
  }
  void count_readback_finished(const int64_t* ctl_copies);

 private:
  DevicePool(std::shared_ptr<DeviceControl> control, std::shared_ptr<DeviceList> list, int64_t size,
             int64_t page_size, bool need_sort, const PageKind& kind);
  void release(const int64_t* pages, int64_t n, const int64_t* device_count, int64_t launch, Destination dest,
               int64_t reset_word);
  dev::StateWord word(PageState s) const { return dev::state_word(s); }

  std::shared_ptr<DeviceControl> control_;
  std::shared_ptr<DeviceList> list_;
  bool shares_list_ = false;  // a side of the shared mode
  int64_t size_, num_pages_, capacity_;
  PageGeometry page_;
  bool need_sort_;
  PageKind kind_;
  dev::CounterWord group_index_word_, group_page_word_, held_word_;
  // held_pages(), on the host; while held_unknown_, the change since the read-back that
  // will supply the base (taken with the list's counts).
  int64_t held_count_ = 0;
  bool held_unknown_ = false;
  // device arrays of this side: the free group queues, the claims in claim order, scratch
  int64_t *group_index_, *group_pages_, *claims_, *selected_, *selected_count_;
  bool group_open_ = false, group_has_index_frees_ = false;
  int64_t group_index_count_ = 0, group_page_count_ = 0;  // host-known group queues
  int64_t claim_count_ = 0;  // the current call's claims (a bound for page-order releases)
};

// The two pools of a hybrid allocator and the mapping, in device memory.
class DeviceHybridStore final : public HybridStore {
 public:
  // shares_list: the shared mode, whose pools are two sides of one list (SPEC.md section 8).
  DeviceHybridStore(std::shared_ptr<Executor> executor, int64_t size, int64_t size_swa, int64_t page_size,
                    bool need_sort, bool shares_list, bool debug, int64_t* mapping, int64_t mapping_len);

  PoolStore& full() override { return *full_; }
  PoolStore& swa() override { return *swa_; }
  std::shared_ptr<PoolStore> full_ptr() const override { return full_; }
  std::shared_ptr<PoolStore> swa_ptr() const override { return swa_; }
  int64_t mapping_len() const override { return mapping_len_; }
  const char* kernels() const override { return control_->exec().kernels(); }
  int64_t device_waits() const override { return control_->waits(); }
  void check_usable() override { control_->check_usable(); }
  void raise_found_errors() override { control_->raise_found_errors(); }
  void validate_batch(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc, Call call) override;
  void write_batch(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc, Call call,
                   OutBuffer& out) override;
  void translate(Span indices, int64_t* out) override;
  void set_mapping(Span full_indices, Span swa_indices) override;
  void clear_mapping(Span full_indices) override;
  void claim_swa_of_pages(Span indices, bool full_claimed, Call call) override;
  void claim_swa_of_representatives(Span indices, Call call) override;
  bool free_representatives_at_once(Span, bool, bool, Destination, Destination) override { return false; }
  void claim_swa_of_evicted(const SlotRows& rows, const EvictionPlan& plan) override;
  void confirm_claims() override { control_->launch_claims(); }
  void undo_claims() override;
  void clear_claimed_mapping() override;
  void clear() override;
  void resize(int64_t size, int64_t size_swa) override;
  AllocatorState backup() override;  // waits
  void restore(const AllocatorState& state) override;

  DeviceControl& control() { return *control_; }

 private:
  void reset_mapping();
  dev::LastLocCheck last_loc_check(const AllocPlan& plan, const LastLoc& last_loc, Call call);
  // set_mapping (swa_indices set) or clear_mapping.
  void write_mapping(Span full_indices, const int64_t* swa_indices, Call call);
  // Marks what clear_claimed_mapping() clears: the full pages of slots, or full_pages_.
  void note_mapped(const int64_t* slots, int64_t count);

  PageGeometry page_;
  std::shared_ptr<DeviceControl> control_;
  std::shared_ptr<DevicePool> full_, swa_;
  int64_t* mapping_;
  int64_t mapping_len_;
  int64_t* mapping_owner_ = nullptr;  // SetMappingOp's, made by the first set or clear
  int64_t* full_pages_;  // scratch: full pages whose mapping a free clears
  const int64_t* mapped_slots_ = nullptr;  // else full_pages_
  int64_t mapped_count_ = 0;
};

}  // namespace swa
