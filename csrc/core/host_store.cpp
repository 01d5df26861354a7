#include "host_store.h"

#include <algorithm>
#include <sstream>

namespace swa {

namespace {

std::pair<std::shared_ptr<PagePool>, std::shared_ptr<PagePool>> hybrid_pools(int64_t size, int64_t size_swa,
                                                                             int64_t page_size, bool need_sort,
                                                                             bool shares_list, const ParentLayout& parents) {
  if (shares_list) return PagePool::shared_sides(size, size_swa, page_size, need_sort, parents);
  return {std::make_shared<PagePool>(size, page_size, need_sort), std::make_shared<PagePool>(size_swa, page_size, need_sort)};
}

}  // namespace

HostHybridStore::HostHybridStore(int64_t size, int64_t size_swa, int64_t page_size, bool need_sort, bool shares_list,
                                 const ParentLayout& parents, int64_t* mapping, int64_t mapping_len)
    : HybridStore(shares_list, parents), mapping_(mapping), mapping_len_(mapping_len) {
  std::tie(full_, swa_) = hybrid_pools(size, size_swa, page_size, need_sort, shares_list, parents);
  reset_mapping();
}

void HostHybridStore::reset_mapping() {
  std::fill(mapping_, mapping_ + mapping_len_ - 1, 0);
  mapping_[mapping_len_ - 1] = -1;  // last_loc == -1 translates to -1
}

void HostHybridStore::write_mapping(const int64_t* full_slots, const int64_t* swa_slots, int64_t n) {
  for (int64_t i = 0; i < n; ++i) mapping_[full_slots[i]] = swa_slots[i];
}

bool HostHybridStore::batch_valid(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc) const {
  const PageGeometry page = full_->geometry();
  const int64_t full_pages = full_->num_pages(), swa_pages = swa_->num_pages();
  const PagePool &full = *full_, &swa = *swa_;
  const auto full_state = [&full](int64_t p) { return full.state(p); };
  const auto swa_state = [&swa](int64_t p) { return swa.state(p); };
  const int64_t* const mapping = mapping_;
  const bool swa_side = swa_continues_prefix(plan.call);
  const PageState swa_held = swa.kind().held;
  // The mapping entries read below lie scattered over the table, and a cold allocator
  // (a forward pass ran since its last call) misses on most: asking for each a few
  // requests ahead overlaps the misses instead of stalling on them one by one.
  constexpr int64_t kAhead = 16;
  const uint64_t mapping_len = static_cast<uint64_t>(mapping_len_);
  const auto prefetch = [&](int64_t j) {
    const uint64_t slot = static_cast<uint64_t>(last_loc.data[j]);
    __builtin_prefetch(mapping + (slot < mapping_len ? slot : 0));  // a bad slot is checked below
  };
  // At page size 1 no request continues a partial page, so no mapping entry is read.
  const bool read_ahead = swa_side && page.size > 1;
  const int64_t n = batch.size();
  if (read_ahead)
    for (int64_t j = 0; j < n && j < kAhead; ++j) prefetch(j);
  // At page size 1 instead, a page state per slot makes the states as large as the
  // pool, and the state of each last_loc (its page is the slot) misses: read it 64
  // requests ahead (1.6x faster at B=2048 than not at all).
  constexpr int64_t kStatesAhead = 64;
  const bool read_states_ahead = page.size == 1;
  const PageState* const full_states = full.states();
  const uint64_t slot_end = static_cast<uint64_t>(full.index_end());
  for (int64_t j = 0; j < n; ++j) {
    if (read_states_ahead && j + kStatesAhead < n) {
      const uint64_t slot = static_cast<uint64_t>(last_loc.data[j + kStatesAhead]);
      __builtin_prefetch(full_states + (slot < slot_end ? slot : 0));
    }
    if (read_ahead && j + kAhead < n) prefetch(j + kAhead);
    const int64_t prefix = batch.prefix(j), last = last_loc.data[j];
    if (last_loc_fault(last, prefix, page, full_pages, full_state) != LastLocFault::kNone) return false;
    if (swa_side && continues_partial_page(prefix, batch.seq_lens[j], page) &&
        !swa_continuation_ok(last, mapping[last], page, swa_pages, swa_state, swa_held))
      return false;
  }
  return true;
}

void HostHybridStore::validate_batch(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc,
                                     Call) {
  if (last_loc.data == nullptr || batch_valid(plan, batch, last_loc)) return;
  // A fault: name the first, the full pool's checks before the SWA pool's.
  full_->check_last_loc(batch, last_loc);
  if (!swa_continues_prefix(plan.call)) return;
  const PageGeometry& page = full_->geometry();
  const auto swa_state = [this](int64_t p) { return swa_->state(p); };
  for (int64_t j = 0; j < batch.size(); ++j) {
    const int64_t prefix = batch.prefix(j);
    if (!continues_partial_page(prefix, batch.seq_lens[j], page)) continue;
    const int64_t last = last_loc.data[j], swa_last = mapping_[last];
    if (!swa_continuation_ok(last, swa_last, page, swa_->num_pages(), swa_state, swa_->kind().held))
      throw ArgumentError(swa_continuation_message(j, last, swa_last));
  }
}

void HostHybridStore::write_decode(const BatchLengths& batch, const LastLoc& last_loc, int64_t swa_skip,
                                   int64_t* full_slots) {
  // extend_slot's two cases for one token: the slot after last_loc in its partial page
  // (the SWA slot after the one it maps to), or the start of each pool's next new page.
  const PageGeometry page = full_->geometry();
  const int64_t* const last = last_loc.data;
  const int64_t* const mapping = mapping_;
  int64_t* __restrict full_out = full_slots;
  int64_t* __restrict swa_out = swa_slots_.data();
  const int64_t n = batch.size();  // at most one new page a request on each side
  PagePool::HeadPages full_pages = full_->head_pages(0, n), swa_pages = swa_->head_pages(swa_skip, n);
  for (int64_t j = 0; j < batch.size(); ++j) {
    if (continues_partial_page(batch.prefix(j), batch.seq_lens[j], page)) {
      full_out[j] = last[j] + 1;
      swa_out[j] = mapping[last[j]] + 1;
    } else {
      full_out[j] = full_pages.next() * page.size;
      swa_out[j] = swa_pages.next() * page.size;
    }
  }
  // Written after every read: a bad batch whose requests share a page reads what SGLang's would.
  write_mapping(full_slots, swa_slots_.data(), batch.size());
}

void HostHybridStore::write_batch(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc, Call,
                                  OutBuffer& out) {
  int64_t* full_slots = out.get(plan.num_tokens);
  if (plan.call == AllocCall::kDecode && !full_->token_mode()) {  // at page size 1 the ring copies below are faster
    swa_slots_.resize(static_cast<size_t>(plan.num_tokens));
    // The shared mode's one list hands out the full side's parents first, then the SWA side's.
    write_decode(batch, last_loc, shares_list() ? full_->parents_for(plan.full_pages) : 0, full_slots);
    full_->take(plan.full_pages);
    swa_->take(plan.swa_pages);
    return;
  }
  const int64_t* last = last_loc.data;
  const auto full_end = [last](int64_t j) { return last != nullptr ? last[j] : int64_t{-1}; };
  full_->write_slots(batch, plan.num_tokens, full_end, full_slots);
  full_->take(plan.full_pages);
  swa_slots_.resize(static_cast<size_t>(plan.swa_tokens));
  if (swa_continues_prefix(plan.call)) {
    const auto swa_end = [&](int64_t j) { return full_end(j) < 0 ? int64_t{-1} : mapping_[full_end(j)]; };
    swa_->write_slots(batch, plan.num_tokens, swa_end, swa_slots_.data());
    write_mapping(full_slots, swa_slots_.data(), plan.num_tokens);
  } else {  // the SWA tail: the head gets no SWA slot, the tail fresh SWA pages
    const int64_t head_len = plan.swa_head_len();
    for (int64_t i = 0; i < head_len; ++i) mapping_[full_slots[i]] = 0;
    const int64_t zero = 0;
    const BatchLengths tail{Span(&zero, 1), Span(&plan.swa_tokens, 1), false};
    swa_->write_slots(tail, plan.swa_tokens, [](int64_t) { return int64_t{-1}; }, swa_slots_.data());
    write_mapping(full_slots + head_len, swa_slots_.data(), plan.swa_tokens);
  }
  swa_->take(plan.swa_pages);
}

void HostHybridStore::translate(Span indices, int64_t* out) {
  for (int64_t i = 0; i < indices.size; ++i) {
    const int64_t idx = indices[i];
    if (!translatable(idx, mapping_len_)) throw ArgumentError(untranslatable_message(i, idx, mapping_len_));
    out[i] = idx < 0 ? mapping_[mapping_len_ - 1] : mapping_[idx];
  }
}

void HostHybridStore::set_mapping(Span full_indices, Span swa_indices) {
  for (int64_t i = 0; i < full_indices.size; ++i) {
    full_->page_of("full_indices", full_indices[i]);
    if (swa_indices[i] != 0) swa_->page_of("swa_indices", swa_indices[i]);
  }
  write_mapping(full_indices.data, swa_indices.data, full_indices.size);
}

void HostHybridStore::clear_mapping(Span full_indices) {
  for (int64_t i = 0; i < full_indices.size; ++i) full_->page_of("full_indices", full_indices[i]);
  for (int64_t i = 0; i < full_indices.size; ++i) mapping_[full_indices[i]] = 0;
}

void HostHybridStore::claim_swa_of_full_page(int64_t page) {
  claimed_full_pages_.push_back(page);
  const PageGeometry& swa_page = swa_->geometry();
  const int64_t size = full_->geometry().size;
  const int64_t* slots = mapping_ + page * size;
  int64_t k = 0;
  while (k < size && slots[k] <= 0) ++k;
  if (k == size) return;
  const int64_t first = swa_->page_of("indices", slots[k]);
  swa_->claim("indices", first, true);
  // In every layout an allocation writes, the mapped slots of a full page lie in one
  // SWA page: check that without branches (the loop vectorizes) and claim it once.
  int64_t other = 0;
  if (swa_page.shift >= 0) {
    for (int64_t i = k + 1; i < size; ++i) other |= (slots[i] > 0) & ((slots[i] >> swa_page.shift) != first);
  } else {
    for (int64_t i = k + 1; i < size; ++i) other |= (slots[i] > 0) & (slots[i] / swa_page.size != first);
  }
  if (other == 0) return;
  for (int64_t i = k + 1; i < size; ++i)
    if (slots[i] > 0) swa_->claim("indices", swa_->page_of("indices", slots[i]), true);
}

void HostHybridStore::claim_swa_of_pages(Span indices, bool full_claimed, Call) {
  if (full_claimed) {
    // The full pool's claims of this call are the distinct pages of indices. A page it
    // passed over as a repeat was freed by an earlier free() of the open group, which
    // claimed its SWA side and cleared its mapping then.
    for (int64_t page : full_->claimed()) claim_swa_of_full_page(page);
    return;
  }
  for (int64_t i = 0; i < indices.size;) {  // runs of one page are common: their slots are read once
    const int64_t page = full_->page_of("indices", indices[i]);
    claim_swa_of_full_page(page);
    i = full_->run_end(indices, i + 1, page);
  }
}

int64_t HostHybridStore::mapped_swa_slot(const char* arg, int64_t full_slot) const {
  full_->page_of(arg, full_slot);  // the range check
  const int64_t swa_slot = mapping_[full_slot];
  if (swa_slot <= 0) fail(arg, "full slot ", full_slot, kUnmappedRefusal);
  return swa_slot;
}

int64_t HostHybridStore::claim_swa_of_representative(const char* arg, int64_t full_slot) {
  const int64_t swa_slot = mapped_swa_slot(arg, full_slot);
  swa_->claim(arg, swa_->page_of(arg, swa_slot), false);
  return full_->geometry().page(full_slot);
}

void HostHybridStore::claim_swa_of_representatives(Span indices, Call) {
  const int64_t page_size = full_->geometry().size;
  swa_->claim_pages_of("indices", full_->geometry().pages_for(indices.size), [this, indices, page_size](int64_t k) {
    return mapped_swa_slot("indices", indices[k * page_size]);
  });
  mapped_representatives_ = indices;  // their pages' mapping is cleared from the representatives themselves
}

bool HostHybridStore::free_representatives_at_once(Span indices, bool full_side, bool swa_side, Destination full_dest,
                                        Destination swa_dest) {
  const PageGeometry page = full_->geometry();
  const int64_t n = page.pages_for(indices.size), full_pages = full_->num_pages();
  const int64_t* const mapping = mapping_;
  // The shared mode's one free list takes both sides' pages as one block, placed as the
  // ordered releases (the SWA side's, then the full side's) would: prepended, the full
  // pages first; appended, the SWA pages first. Its one staging list is not split so.
  int64_t full_before = 0, full_after = 0, swa_before = 0, swa_after = 0;
  if (shares_list() && full_side && swa_side && (full_dest == Destination::kPrepend || full_dest == Destination::kAppend)) {
    (full_dest == Destination::kPrepend ? full_after : full_before) = n;
    (full_dest == Destination::kPrepend ? swa_before : swa_after) = n;
  } else if (shares_list() && full_side && swa_side && full_dest == Destination::kStaged) {
    return false;
  }
  // Parent pages (parent_k > 1): the parents a free gives back are known only once its
  // child pages are back, so the ordered claims free them.
  if (full_->pages_per_parent() > 1 || swa_->pages_per_parent() > 1) return false;
  PagePool::Releaser full(*full_, full_side ? n : 0, full_dest, full_before, full_after),
      swa(*swa_, swa_side ? n : 0, swa_dest, swa_before, swa_after);
  if (!full.fits() || !swa.fits()) return false;
  for (int64_t k = 0; k < n; ++k) {  // a fault returns with the placed pages put back
    const int64_t slot = indices[k * page.size];
    if (full_side ? !full.release_slot(slot) : !slot_in_pool(slot, page, full_pages)) return false;
    if (swa_side && !(mapping[slot] > 0 && swa.release_slot(mapping[slot]))) return false;
  }
  full.commit();
  swa.commit();
  if (swa_side) {
    mapped_representatives_ = indices;  // their pages' mapping is cleared from the representatives themselves
    clear_claimed_mapping();
  }
  return true;
}

void HostHybridStore::claim_swa_of_evicted(const SlotRows& rows, const EvictionPlan& plan) {
  const int64_t page_size = full_->geometry().size;
  swa_->claimed().reserve(swa_->claimed().size() + static_cast<size_t>(plan.total_pages()));
  claimed_full_pages_.reserve(claimed_full_pages_.size() + static_cast<size_t>(plan.total_pages()));
  for (int64_t j = 0; j < plan.num_due(); ++j)
    for (int64_t u = 0; u < plan.page_begin[j + 1] - plan.page_begin[j]; ++u)
      claimed_full_pages_.push_back(claim_swa_of_representative("req_to_token", rows.at(plan.row[j], plan.evicted[j] + u * page_size)));
  // Each request's pages, claimed in batch order, go where the plan releases them.
  if (std::equal(plan.release_offset.begin(), plan.release_offset.end(), plan.page_begin.begin())) return;
  std::vector<int64_t>& claimed = swa_->claimed();
  std::vector<int64_t> placed(claimed.size());
  for (int64_t j = 0; j < plan.num_due(); ++j)
    std::copy(claimed.begin() + plan.page_begin[j], claimed.begin() + plan.page_begin[j + 1],
              placed.begin() + plan.release_offset[j]);
  claimed.swap(placed);
}

void HostHybridStore::undo_claims() {
  full_->undo_claims();
  swa_->undo_claims();
  claimed_full_pages_.clear();
  mapped_representatives_ = Span();
}

void HostHybridStore::clear_claimed_mapping() {
  const PageGeometry page = full_->geometry();  // a copy: the stores below cannot change it
  int64_t* const mapping = mapping_;
  const auto clear_page = [mapping, size = page.size](int64_t p) {
    if (size == 1) mapping[p] = 0;  // not a call to memset per slot
    else std::fill_n(mapping + p * size, size, 0);
  };
  for (int64_t p : claimed_full_pages_) clear_page(p);
  for (int64_t i = 0; i < mapped_representatives_.size; i += page.size) clear_page(page.page(mapped_representatives_[i]));
  claimed_full_pages_.clear();
  mapped_representatives_ = Span();
}

void HostHybridStore::clear() {
  full_->clear();
  swa_->clear();
  reset_mapping();
}

void HostHybridStore::resize(int64_t size, int64_t size_swa) {
  full_->resize(size);
  swa_->resize(size_swa);
  reset_mapping();
}

AllocatorState HostHybridStore::backup() {
  return AllocatorState{*full_, *swa_, std::vector<int64_t>(mapping_, mapping_ + mapping_len_)};
}

void HostHybridStore::restore(const AllocatorState& state) {
  full_->restore(state.full);  // in place: the pool objects handed out stay valid
  swa_->restore(state.swa);
  std::copy(state.mapping.begin(), state.mapping.end(), mapping_);
}

}  // namespace swa
