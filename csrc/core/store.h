// Where an allocator's pages and mapping are kept, with no decisions: the host store
// (host_store.h: host memory, sequential) and the device store (device_store.h: device
// memory, changed only through the ops of device_ops.h). allocator.h takes every
// decision through plan.h and calls these to carry it out.
#pragma once

#include <cstdint>
#include <memory>

#include "plan.h"

namespace swa {

class PagePool;
struct AllocatorState;

// The call an operation belongs to and the argument it reads: a check the device runs
// in its ops names them when it fails.
enum Call : int64_t {
  kCallAlloc, kCallAllocExtend, kCallAllocDecode, kCallAllocExtendSwaTail, kCallFree, kCallFreeSwa, kCallFreeFull,
  kCallFreeSegment, kCallFreeSwaSegment, kCallFreeFullSegment, kCallFreePageIds, kCallEvict, kCallTranslate,
  kCallSetMapping, kCallClearMapping,
};
enum Arg : int64_t { kArgLastLoc, kArgIndices, kArgPageIds, kArgReqToToken, kArgKvIndices, kArgFullIndices, kArgSwaIndices };

// One page pool's storage.
class PoolStore {
 public:
  virtual ~PoolStore() = default;
  virtual int64_t size() const = 0;
  // The size at construction: the arrays were sized then, so resize() never grows past it.
  virtual int64_t capacity() const = 0;
  virtual const PageGeometry& geometry() const = 0;
  virtual int64_t num_pages() const = 0;
  virtual bool need_sort() const = 0;
  bool token_mode() const { return geometry().size == 1; }
  // Host counts of the free list and the staging list (a device store may first wait
  // for the read-back of a count only the device knew): pages, or in the shared mode the
  // one list's parent pages.
  virtual int64_t free_pages() = 0;
  virtual int64_t staged_pages() = 0;
  // The shared mode's small side: its pages to a parent (parent_k; 1 on every other pool)
  // and the free pages of its partly used parents (0 on every other pool).
  virtual int64_t pages_per_parent() const = 0;
  virtual int64_t free_children() = 0;
  // What this pool can take (plan.h's PoolRoom): from its free and staged parents, or with
  // staged false (a merge decision) its free ones.
  PoolRoom room(bool staged = true) {
    return PoolRoom{free_pages() + (staged ? staged_pages() : 0), pages_per_parent(), free_children(),
                    num_parents(), size()};
  }
  // The pages an allocation can take from it: available (free and staged) or free alone.
  int64_t available_pages() { return room_pages(room()); }
  int64_t free_side_pages() { return room_pages(room(false)); }
  // Its list's parents (its pages but on the shared mode's small side).
  virtual int64_t num_parents() const = 0;
  // The pages this pool holds: out of the free and the staging list, those its open free
  // group queues included (they come back when the group ends). In the shared mode each
  // side counts its own kind; both sides' and the available pages make the one list.
  virtual int64_t held_pages() = 0;
  virtual bool group_open() const = 0;
  virtual void set_group_open(bool open) = 0;

  // Throws the error that poisoned a device store (DeferredError); nothing on the host.
  virtual void check_usable() = 0;
  // The staged pages into the free list, all of it sorted.
  virtual void merge() = 0;
  // The checks of last_loc's values, made now where the store can make them before
  // anything changes (always on the host; on the device in debug mode, else in the write).
  virtual void validate_batch(const BatchLengths& batch, const LastLoc& last_loc, Call call) = 0;
  // The plan's slots, new pages from the head of the free list in batch order, into out;
  // those pages taken.
  virtual void write_batch(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc, Call call,
                           OutBuffer& out) = 0;

  // Claims mark the pages a free is about to release, so that a double free is caught
  // before anything is released: the pages of slots (free), of indices[::page_size]
  // (free_segment), or named by id.
  virtual void claim_slots(Span indices, Call call) = 0;
  virtual void claim_segment(Span indices, Call call) = 0;
  virtual void claim_page_ids(Span pages, Call call) = 0;
  // Raises what the claims found where that is known only now (the device in debug mode).
  virtual void confirm_claims() = 0;
  // The claimed pages held again, as before the call.
  virtual void undo_claims() = 0;
  // The claimed pages to dest, in claim order or page order; releases: empty (one
  // release), or the claim offsets that bound successive releases (one more entry than
  // releases), each placed as a call of its own would place it.
  virtual void release_claims(Destination dest, ReleaseOrder order, Span releases) = 0;
  // An open free group's queue to dest (the group is already closed).
  virtual void release_group(GroupQueue queue, Destination dest, ReleaseOrder order) = 0;

  // Whether this pool is a side of a hybrid store that shares one free list
  // (HybridStore::shares_list), which it shares with the other side.
  virtual bool shares_list() const = 0;
  // A cleared pool; resize() of size slots, checked by the caller.
  virtual void clear() = 0;
  virtual void resize(int64_t size) = 0;
  // The pool as the host store holds it (a device store waits for the device, and
  // raises DeferredError for what its ops found).
  virtual PagePool snapshot() = 0;
  // Of this shape, checked by the caller.
  virtual void restore(const PagePool& state) = 0;
};

// Where a batched eviction reads the requests' slots: a req_to_token table of int32 or
// int64 entries (one of the two set), in the store's memory.
struct SlotRows {
  const int32_t* rows32 = nullptr;
  const int64_t* rows64 = nullptr;
  int64_t num_rows = 0, row_len = 0;
  int64_t at(int64_t row, int64_t pos) const {
    const int64_t k = row * row_len + pos;
    return rows32 != nullptr ? rows32[k] : rows64[k];
  }
};

// The two pools of a hybrid allocator and the full-to-SWA mapping table.
class HybridStore {
 public:
  virtual ~HybridStore() = default;
  // Whether full() and swa() are the two sides of one free list (the shared mode, Python's
  // shared=True; SPEC.md section 8): fixed when the store is built, and read here by every
  // layer that serves the two modes differently.
  bool shares_list() const { return shares_list_; }
  // The shared mode's parent pages (which side is small, parent_k); parent_k 1 otherwise.
  const ParentLayout& parents() const { return parents_; }
  virtual PoolStore& full() = 0;
  virtual PoolStore& swa() = 0;
  // The pools as a lone pool allocator sees them (SGLang's sub-allocators).
  virtual std::shared_ptr<PoolStore> full_ptr() const = 0;
  virtual std::shared_ptr<PoolStore> swa_ptr() const = 0;
  virtual int64_t mapping_len() const = 0;
  // Which code runs the ops: "cpu", "emulated" (the device algorithm on the host) or "cuda".
  virtual const char* kernels() const = 0;
  // How many times the host has waited for the device.
  virtual int64_t device_waits() const = 0;

  virtual void check_usable() = 0;
  // Waits for the device and raises an error its checks found since the last wait.
  virtual void raise_found_errors() = 0;
  // As PoolStore::validate_batch, on both pools: where last_loc ends each prefix and,
  // when the plan continues SWA pages (swa_continues_prefix), the SWA slot it maps to.
  virtual void validate_batch(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc,
                              Call call) = 0;
  // The plan on both pools and the mapping (the SWA tail's layout for alloc_extend_swa_tail).
  virtual void write_batch(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc, Call call,
                           OutBuffer& out) = 0;

  // The mapping entries of full slots, checked there.
  virtual void translate(Span indices, int64_t* out) = 0;
  virtual void set_mapping(Span full_indices, Span swa_indices) = 0;
  virtual void clear_mapping(Span full_indices) = 0;

  // The SWA side of a free, claimed on the SWA pool: the pages mapped from every slot of
  // the pages of `indices` (free_swa), from the page representatives indices[::page_size]
  // (free_swa_segment), or from the evicted pages of each due request, placed where the
  // eviction plan releases them. The full pages they come from are noted.
  // full_claimed: the call claimed the full pages of indices just before (free()), so
  // the store may take the pages from those claims.
  virtual void claim_swa_of_pages(Span indices, bool full_claimed, Call call) = 0;
  virtual void claim_swa_of_representatives(Span indices, Call call) = 0;
  // The whole free of the pages of the representatives indices[::page_size] (full_side)
  // and of the SWA pages they map to (swa_side), released in claim order to full_dest and
  // swa_dest, in one pass: claimed, placed, mapping cleared. False, with nothing changed,
  // where the store does not do it so (the device store, whose claims are ops) or finds a
  // fault; the caller's ordered claims then free or name the fault.
  virtual bool free_representatives_at_once(Span indices, bool full_side, bool swa_side, Destination full_dest,
                                 Destination swa_dest) = 0;
  virtual void claim_swa_of_evicted(const SlotRows& rows, const EvictionPlan& plan) = 0;
  // As PoolStore's, on both pools.
  virtual void confirm_claims() = 0;
  virtual void undo_claims() = 0;
  // Zeroes the mapping of the noted full pages.
  virtual void clear_claimed_mapping() = 0;

  virtual void clear() = 0;
  virtual void resize(int64_t size, int64_t size_swa) = 0;
  virtual AllocatorState backup() = 0;
  virtual void restore(const AllocatorState& state) = 0;

 protected:
  HybridStore(bool shares_list, const ParentLayout& parents) : shares_list_(shares_list), parents_(parents) {}

 private:
  const bool shares_list_;
  const ParentLayout parents_;
};

}  // namespace swa
