#include "allocator.h"

#include <algorithm>

namespace swa {

namespace {

// Puts back the claims of a call that throws before it releases them.
template <class Store>
class ClaimScope {
 public:
  explicit ClaimScope(Store& store) : store_(store) {}
  ClaimScope(const ClaimScope&) = delete;
  ClaimScope& operator=(const ClaimScope&) = delete;
  ~ClaimScope() {
    if (!confirmed_) store_.undo_claims();
  }
  // Raises what the claims found, if the store learns it only now; else they stand.
  void confirm() {
    store_.confirm_claims();
    confirmed_ = true;
  }

 private:
  Store& store_;
  bool confirmed_ = false;
};

Destination destination(PoolStore& pool, bool by_index) {
  return release_destination(pool.group_open(), by_index, pool.need_sort(), pool.token_mode());
}

// by_index: the claims are free()'s (slots), else pages by id or segment; releases: as
// PoolStore::release_claims.
void release_claims(PoolStore& pool, bool by_index, Span releases = Span()) {
  pool.release_claims(destination(pool, by_index), release_order(by_index, pool.geometry().size), releases);
}

void merge_staged(PoolStore& pool) {
  if (pool.staged_pages() > 0) pool.merge();
}

void merge_if_due(PoolStore& pool, const AllocPlan& plan, PoolRole role) {
  if (merge_due(plan, role, pool.free_side_pages(), pool.geometry())) merge_staged(pool);
}

void end_group(PoolStore& pool, GroupOrder order) {
  pool.set_group_open(false);
  for (const GroupQueue queue : {first_queue(order), second_queue(order)}) {
    const bool by_index = queue == GroupQueue::kByIndex;
    pool.release_group(queue, destination(pool, by_index), release_order(by_index, pool.geometry().size));
  }
}

// alloc(need_size) as a batch: one request of need_size new tokens and no prefix.
struct UnprefixedRequest {
  int64_t prefix_len = 0, seq_len;
  BatchLengths batch() const { return BatchLengths{Span(&prefix_len, 1), Span(&seq_len, 1), false}; }
};

}  // namespace

// ---------------------------------------------------------------- PoolAllocator

bool PoolAllocator::allocate(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc, Call call,
                             OutBuffer& out) {
  store_->validate_batch(batch, last_loc, call);
  merge_if_due(*store_, plan, PoolRole::kFull);
  if (pool_refused(plan, store_->free_side_pages())) return false;
  store_->write_batch(plan, batch, last_loc, call, out);
  return true;
}

bool PoolAllocator::alloc(int64_t need_size, OutBuffer& out) {
  store_->check_usable();
  const AllocPlan plan = plan_alloc(need_size, store_->geometry());
  const UnprefixedRequest request{0, need_size};
  return allocate(plan, request.batch(), LastLoc(), kCallAlloc, out);
}

bool PoolAllocator::alloc_extend(const BatchLengths& batch, const LastLoc& last_loc, int64_t extend_num_tokens,
                                 int64_t num_new_pages, OutBuffer& out) {
  store_->check_usable();
  const AllocPlan plan = plan_extend(batch, last_loc, extend_num_tokens, store_->geometry());
  check_num_new_pages(num_new_pages, plan);
  return allocate(plan, batch, last_loc, kCallAllocExtend, out);
}

bool PoolAllocator::alloc_decode(const BatchLengths& batch, const LastLoc& last_loc, OutBuffer& out) {
  store_->check_usable();
  return allocate(plan_decode(batch, last_loc, store_->geometry()), batch, last_loc, kCallAllocDecode, out);
}

void PoolAllocator::free(Span indices) {
  store_->check_usable();
  ClaimScope<PoolStore> scope(*store_);
  store_->claim_slots(indices, kCallFree);
  scope.confirm();
  release_claims(*store_, true);
}

void PoolAllocator::free_page_ids(Span pages) {
  store_->check_usable();
  ClaimScope<PoolStore> scope(*store_);
  store_->claim_page_ids(pages, kCallFreePageIds);
  scope.confirm();
  release_claims(*store_, false);
}

void PoolAllocator::free_segment(Span indices, int64_t start_pos) {
  store_->check_usable();
  check_segment_start(start_pos, store_->geometry());
  ClaimScope<PoolStore> scope(*store_);
  store_->claim_segment(indices, kCallFreeSegment);
  scope.confirm();
  release_claims(*store_, false);
}

void PoolAllocator::free_group_begin() {
  store_->check_usable();
  check_group_begin(store_->group_open());
  store_->set_group_open(true);
}

void PoolAllocator::free_group_end() {
  store_->check_usable();
  check_group_end(store_->group_open());
  end_group(*store_, kPoolGroupOrder);
}

void PoolAllocator::merge_and_sort_free() {
  store_->check_usable();
  merge_staged(*store_);
}

void PoolAllocator::resize(int64_t size) {
  check_pool_alone("resize", store_->shares_list());
  check_resize("size", size, store_->geometry().size, store_->capacity());
  store_->resize(size);
}

void PoolAllocator::restore_state(const PagePool& state) {
  check_pool_alone("restore_state", store_->shares_list());
  check_state_shape("a pool", state.size() == store_->size() && state.page_size() == store_->geometry().size);
  store_->restore(state);
}

// ---------------------------------------------------------------- HybridAllocator

HybridAllocator::HybridAllocator(std::unique_ptr<HybridStore> store)
    : store_(std::move(store)), page_(store_->full().geometry()) {}

int64_t HybridAllocator::mapping_size(int64_t size, int64_t size_swa, int64_t page_size, bool shares_list,
                                      const ParentLayout& parents) {
  check_hybrid_shape(size, size_swa, page_size, shares_list, parents);
  // SGLang's size + page_size slots and the -1 sentinel; where the full side's pages are
  // child pages, every slot they span (rules.h's child_slot_end), which can be more.
  const bool full_children = shares_list && parents.k > 1 && parents.small_side == Side::kFull;
  const int64_t slot_end = full_children ? child_slot_end(size_swa / page_size, parents.k, page_size) : 0;
  return std::max(size + page_size, slot_end) + 1;
}

int64_t HybridAllocator::available_size() {
  return hybrid_available_size(full_available_size(), swa_available_size());
}

bool HybridAllocator::new_pages_available(int64_t num_full_pages, int64_t num_swa_pages) {
  return demand_fits(num_full_pages, num_swa_pages, full().room(), swa().room(), store_->shares_list());
}

bool HybridAllocator::reservation_fits(const Reservation& reservation) {
  check_reservation(reservation);
  return swa::reservation_fits(reservation, full().room(), swa().room(), store_->shares_list(), page_);
}

bool HybridAllocator::allocate(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc, Call call,
                               OutBuffer& out) {
  store_->validate_batch(plan, batch, last_loc, call);
  // Atomic: both pools are checked before either is touched, merges included.
  if (hybrid_refused(plan, full().room(), swa().room(), store_->shares_list())) return false;
  if (store_->shares_list()) {  // one list: one merge, for the pages of both kinds
    if (shared_list_merge_due(plan, full().room(false), swa().room(false), page_)) merge_staged(full());
  } else {
    merge_if_due(full(), plan, PoolRole::kFull);
    merge_if_due(swa(), plan, PoolRole::kSwa);
  }
  store_->write_batch(plan, batch, last_loc, call, out);
  return true;
}

bool HybridAllocator::alloc(int64_t need_size, OutBuffer& out) {
  store_->check_usable();
  const AllocPlan plan = plan_alloc(need_size, page_);
  const UnprefixedRequest request{0, need_size};
  return allocate(plan, request.batch(), LastLoc(), kCallAlloc, out);
}

bool HybridAllocator::alloc_extend(const BatchLengths& batch, const LastLoc& last_loc, int64_t extend_num_tokens,
                                   OutBuffer& out) {
  store_->check_usable();
  return allocate(plan_extend(batch, last_loc, extend_num_tokens, page_), batch, last_loc, kCallAllocExtend, out);
}

bool HybridAllocator::alloc_extend_swa_tail(const BatchLengths& batch, const LastLoc& last_loc,
                                            int64_t extend_num_tokens, int64_t swa_tail_len, OutBuffer& out) {
  store_->check_usable();
  return allocate(plan_extend_swa_tail(batch, last_loc, extend_num_tokens, swa_tail_len, page_), batch, last_loc,
                  kCallAllocExtendSwaTail, out);
}

bool HybridAllocator::alloc_decode(const BatchLengths& batch, const LastLoc& last_loc, OutBuffer& out) {
  store_->check_usable();
  return allocate(plan_decode(batch, last_loc, page_), batch, last_loc, kCallAllocDecode, out);
}

void HybridAllocator::translate(Span indices, int64_t* out) { store_->translate(indices, out); }

void HybridAllocator::set_mapping(Span full_indices, Span swa_indices) {
  store_->check_usable();
  check_mapping_pairs(full_indices.size, swa_indices.size);
  store_->set_mapping(full_indices, swa_indices);
}

void HybridAllocator::clear_mapping(Span full_indices) {
  store_->check_usable();
  store_->clear_mapping(full_indices);
}

void HybridAllocator::release_swa(bool by_index, Span releases) {
  store_->clear_claimed_mapping();
  release_claims(swa(), by_index, releases);
}

// The hybrid free sequence: claim the full side, claim the SWA side (checked all of it),
// then clear the mapping and release the SWA side, then release the full side.
void HybridAllocator::free_slots(Span indices, Call call, bool full_side, bool swa_side) {
  store_->check_usable();
  if (swa_side && swa_free_by_segment(page_.size)) {  // at page size 1 each slot stands for its page
    free_by_representatives(indices, call, full_side, true, true);
    return;
  }
  ClaimScope<HybridStore> scope(*store_);
  if (full_side) full().claim_slots(indices, call);
  if (swa_side) store_->claim_swa_of_pages(indices, full_side, call);
  scope.confirm();
  if (swa_side) release_swa(true);
  if (full_side) release_claims(full(), true);
}

void HybridAllocator::free_pages_of_segment(Span indices, int64_t start_pos, Call call, bool full_side,
                                            bool swa_side) {
  store_->check_usable();
  check_segment_start(start_pos, page_);
  free_by_representatives(indices, call, full_side, swa_side, false);
}

void HybridAllocator::free_by_representatives(Span indices, Call call, bool full_side, bool swa_side, bool by_index) {
  // Pages of representatives are released in claim order (release_order: segments, and
  // every free at page size 1), so the store may claim and place them in one pass.
  if (store_->free_representatives_at_once(indices, full_side, swa_side, destination(full(), by_index),
                                destination(swa(), by_index)))
    return;
  ClaimScope<HybridStore> scope(*store_);
  if (full_side) full().claim_segment(indices, call);
  if (swa_side) store_->claim_swa_of_representatives(indices, call);
  scope.confirm();
  if (swa_side) release_swa(by_index);
  if (full_side) release_claims(full(), by_index);
}

void HybridAllocator::free(Span indices) { free_slots(indices, kCallFree, true, true); }
void HybridAllocator::free_swa(Span indices) { free_slots(indices, kCallFreeSwa, false, true); }
void HybridAllocator::free_full(Span indices) { free_slots(indices, kCallFreeFull, true, false); }

void HybridAllocator::free_segment(Span indices, int64_t start_pos) {
  free_pages_of_segment(indices, start_pos, kCallFreeSegment, true, true);
}
void HybridAllocator::free_swa_segment(Span indices, int64_t start_pos) {
  free_pages_of_segment(indices, start_pos, kCallFreeSwaSegment, false, true);
}
void HybridAllocator::free_full_segment(Span indices, int64_t start_pos) {
  free_pages_of_segment(indices, start_pos, kCallFreeFullSegment, true, false);
}

void HybridAllocator::free_group_begin() {
  store_->check_usable();
  check_group_begin(full().group_open() || swa().group_open());
  full().set_group_open(true);
  swa().set_group_open(true);  // holds the SWA-side frees until the group ends
}

void HybridAllocator::free_group_end() {
  store_->check_usable();
  check_group_end(full().group_open() && swa().group_open());
  end_group(swa(), kSwaGroupOrder);
  end_group(full(), kPoolGroupOrder);
}

void HybridAllocator::evict_out_of_window(const SlotRows& req_to_token, Span rows, Span pre_lens,
                                          Span evicted_seqlens, int64_t window, int64_t interval,
                                          bool prefix_sharing, int64_t* new_evicted) {
  store_->check_usable();
  plan_window_eviction(req_to_token.num_rows, req_to_token.row_len, rows, pre_lens, evicted_seqlens, window, interval,
                       prefix_sharing, page_, destination(swa(), false), swa().pages_per_parent() > 1, new_evicted,
                       eviction_);
  if (eviction_.total_pages() == 0) return;
  ClaimScope<HybridStore> scope(*store_);
  store_->claim_swa_of_evicted(req_to_token, eviction_);
  scope.confirm();
  release_swa(false, eviction_.release_each ? Span(eviction_.page_begin) : Span());
}

void HybridAllocator::resize(int64_t size, int64_t size_swa) {
  check_hybrid_resize(size, size_swa, page_.size, full().capacity(), swa().capacity(), store_->shares_list(),
                      store_->parents());
  store_->resize(size, size_swa);
}

void HybridAllocator::restore_state(const AllocatorState& state) {
  check_state_shape("an allocator", static_cast<int64_t>(state.mapping.size()) == store_->mapping_len() &&
                                        state.full.size() == full().size() && state.swa.size() == swa().size() &&
                                        state.full.page_size() == page_.size &&
                                        state.swa.shares_list() == store_->shares_list() &&
                                        state.full.pages_per_parent() == full().pages_per_parent() &&
                                        state.swa.pages_per_parent() == swa().pages_per_parent());
  store_->restore(state);
}

void HybridAllocator::check_invariants() { swa::check_invariants(store_->backup()); }

std::string HybridAllocator::debug_string() {
  const AllocatorState state = store_->backup();
  return "full: " + state.full.debug_string() + "\nswa: " + state.swa.debug_string();
}

void check_invariants(const AllocatorState& state) {
  const PagePool &full = state.full, &swa = state.swa;
  if (full.shares_list()) {
    full.check_invariants(&swa);
  } else {
    full.check_invariants();
    swa.check_invariants();
  }
  const std::vector<int64_t>& mapping = state.mapping;
  if (mapping.back() != -1) throw std::logic_error("mapping invariant broken: the -1 sentinel changed");
  for (size_t slot = 0; slot + 1 < mapping.size(); ++slot) {
    const int64_t swa_slot = mapping[slot];
    if (swa_slot == 0) continue;
    if (!slot_in_pool(swa_slot, swa.geometry(), swa.num_pages()) ||
        !swa.holds(swa.geometry().page(swa_slot)))
      throw std::logic_error("mapping invariant broken: full slot " + std::to_string(slot) + " maps to SWA slot " +
                             std::to_string(swa_slot) + ", which is not held");
  }
}

}  // namespace swa
