// The host store: pools and mapping in host memory, changed in place, one element
// after another. HostHybridStore holds two PagePools (page_pool.h), in the shared mode
// the two sides of one list, and the full-to-SWA mapping.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "page_pool.h"

namespace swa {

class HostHybridStore final : public HybridStore {
 public:
  // mapping: caller-owned storage of mapping_len int64 values; it must outlive the store.
  // parents: the shared mode's parent pages (parent_k 1 otherwise).
  HostHybridStore(int64_t size, int64_t size_swa, int64_t page_size, bool need_sort, bool shares_list,
                  const ParentLayout& parents, int64_t* mapping, int64_t mapping_len);

  PoolStore& full() override { return *full_; }
  PoolStore& swa() override { return *swa_; }
  std::shared_ptr<PoolStore> full_ptr() const override { return full_; }
  std::shared_ptr<PoolStore> swa_ptr() const override { return swa_; }
  int64_t mapping_len() const override { return mapping_len_; }
  const char* kernels() const override { return "cpu"; }
  int64_t device_waits() const override { return 0; }
  void check_usable() override {}
  void raise_found_errors() override {}
  void validate_batch(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc, Call call) override;
  void write_batch(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc, Call call,
                   OutBuffer& out) override;
  void translate(Span indices, int64_t* out) override;
  void set_mapping(Span full_indices, Span swa_indices) override;
  void clear_mapping(Span full_indices) override;
  void claim_swa_of_pages(Span indices, bool full_claimed, Call call) override;
  void claim_swa_of_representatives(Span indices, Call call) override;
  bool free_representatives_at_once(Span indices, bool full_side, bool swa_side, Destination full_dest,
                         Destination swa_dest) override;
  void claim_swa_of_evicted(const SlotRows& rows, const EvictionPlan& plan) override;
  void confirm_claims() override {}
  void undo_claims() override;
  void clear_claimed_mapping() override;
  void clear() override;
  void resize(int64_t size, int64_t size_swa) override;
  AllocatorState backup() override;
  void restore(const AllocatorState& state) override;

 private:
  // Whether every request passes validate_batch's checks: one pass over the batch for
  // both pools; the ordered checks run only to name a fault.
  bool batch_valid(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc) const;
  void reset_mapping();
  void write_mapping(const int64_t* full_slots, const int64_t* swa_slots, int64_t n);
  // write_batch of a decode step: one token per request, both pools' slots in one pass;
  // the SWA pages start swa_skip pages into the SWA pool's free list.
  void write_decode(const BatchLengths& batch, const LastLoc& last_loc, int64_t swa_skip, int64_t* full_slots);
  // Claims the SWA pages mapped from the slots of full page `page`, noted for clearing.
  void claim_swa_of_full_page(int64_t page);
  // The SWA slot that full slot full_slot maps to; throws naming arg unless the slot is
  // in the full pool and mapped.
  int64_t mapped_swa_slot(const char* arg, int64_t full_slot) const;
  // Claims the SWA page mapped from full slot full_slot, a page representative; returns its full page.
  int64_t claim_swa_of_representative(const char* arg, int64_t full_slot);

  std::shared_ptr<PagePool> full_, swa_;
  int64_t* mapping_;
  int64_t mapping_len_;
  std::vector<int64_t> swa_slots_;         // scratch for the SWA half of an allocation
  // The full pages whose mapping the claimed free clears: listed, or the pages of
  // page representatives (mapped_representatives_[::page_size]).
  std::vector<int64_t> claimed_full_pages_;
  Span mapped_representatives_;
};

}  // namespace swa
