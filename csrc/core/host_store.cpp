#include "host_store.h"

#include <algorithm>
#include <sstream>

namespace swa {

// ---------------------------------------------------------------- PagePool

PagePool::PagePool(int64_t size, int64_t page_size, bool need_sort)
    : size_(size), num_pages_(0), capacity_(size), geometry_(page_size), need_sort_(need_sort) {
  check_pool_shape("size", size, page_size);
  num_pages_ = size / page_size;
  ring_.resize(static_cast<size_t>(num_pages_));
  state_.resize(static_cast<size_t>(num_pages_ + 1));
  reset_state();
}

PagePool PagePool::from_parts(int64_t size, int64_t page_size, bool need_sort, const std::vector<int64_t>& free_list,
                              std::vector<int64_t> staged, std::vector<PageState> state, bool group_open,
                              std::vector<int64_t> group_index_pages, std::vector<int64_t> group_page_ids) {
  PagePool pool(size, page_size, need_sort);
  if (static_cast<int64_t>(free_list.size()) > pool.num_pages_ || static_cast<int64_t>(state.size()) != pool.num_pages_ + 1)
    throw std::logic_error("pool snapshot of the wrong shape");
  std::copy(free_list.begin(), free_list.end(), pool.ring_.begin());
  pool.head_ = 0;
  pool.free_count_ = static_cast<int64_t>(free_list.size());
  pool.staged_ = std::move(staged);
  pool.state_ = std::move(state);
  pool.group_open_ = group_open;
  pool.group_index_pages_ = std::move(group_index_pages);
  pool.group_page_ids_ = std::move(group_page_ids);
  return pool;
}

void PagePool::reset_state() {
  for (int64_t k = 0; k < num_pages_; ++k) ring_[k] = k + 1;
  head_ = 0;
  free_count_ = num_pages_;
  staged_.clear();
  std::fill(state_.begin(), state_.end(), PageState::kFree);
  state_[0] = PageState::kHeld;  // the padding page is never handed out nor freed
  group_open_ = false;
  group_index_pages_.clear();
  group_page_ids_.clear();
  claimed_.clear();
}

void PagePool::clear() { reset_state(); }

void PagePool::resize(int64_t size) {
  PagePool resized(size, geometry_.size, need_sort_);
  resized.capacity_ = capacity_;
  *this = std::move(resized);
}

void PagePool::restore(const PagePool& state) {
  const int64_t capacity = capacity_;
  *this = state;
  capacity_ = capacity;
}

void PagePool::merge() {
  std::vector<int64_t> merged = free_list();
  merged.insert(merged.end(), staged_.begin(), staged_.end());
  std::sort(merged.begin(), merged.end());
  for (size_t k = 0; k < merged.size(); ++k) {
    ring_[k] = merged[k];
    state_[merged[k]] = PageState::kFree;
  }
  head_ = 0;
  free_count_ = static_cast<int64_t>(merged.size());
  staged_.clear();
}

void PagePool::take(int64_t n) {
  PageState* const state = state_.data();
  head_ranges(n, [state](const int64_t* first, const int64_t* last) {
    for (const int64_t* p = first; p != last; ++p) state[*p] = PageState::kHeld;
  });
  head_ += n;
  if (head_ >= num_pages_) head_ -= num_pages_;
  free_count_ -= n;
}

void PagePool::validate_batch(const BatchLengths& batch, const LastLoc& last_loc, Call) {
  check_last_loc(batch, last_loc);
}

void PagePool::write_batch(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc, Call,
                           OutBuffer& out) {
  const int64_t* last = last_loc.data;
  write_slots(batch, plan.num_tokens, [last](int64_t j) { return last != nullptr ? last[j] : int64_t{-1}; },
              out.get(plan.num_tokens));
  take(plan.full_pages);
}

void PagePool::check_last_loc(const BatchLengths& batch, const LastLoc& last_loc) const {
  if (last_loc.data == nullptr) return;  // alloc(): no prefixes
  const auto state_of_page = [this](int64_t page) { return state_[page]; };
  for (int64_t j = 0; j < batch.size(); ++j) {
    const int64_t prefix = batch.prefix(j), last = last_loc.data[j];
    const LastLocFault fault = last_loc_fault(last, prefix, geometry_, num_pages_, state_of_page);
    if (fault != LastLocFault::kNone)
      throw ArgumentError(last_loc_fault_message(fault, j, last, prefix, geometry_, num_pages_));
  }
}

void PagePool::refuse_slot(const char* arg, int64_t index) const {
  fail(arg, "index ", index, " is outside the pool's slots [", geometry_.size, ", ", index_end(),
       ") (page 0 is the padding page)");
}

void PagePool::refuse_claim(const char* arg, int64_t page) const { fail(arg, "page ", page, claim_refusal(state_[page])); }

int64_t PagePool::run_end(Span indices, int64_t i, int64_t page) const {
  if (geometry_.shift >= 0) {  // four at a time, without branches between them
    const int shift = geometry_.shift;
    while (i + 4 <= indices.size && (((indices[i] >> shift) == page) & ((indices[i + 1] >> shift) == page) &
                                     ((indices[i + 2] >> shift) == page) & ((indices[i + 3] >> shift) == page)))
      i += 4;
  }
  while (i < indices.size && geometry_.page(indices[i]) == page) ++i;
  return i;
}

void PagePool::claim_slots(Span indices, Call) {
  if (token_mode()) {  // a slot is a page: each is its own claim, and a repeat a double free
    claim_pages_of("indices", indices.size, [indices](int64_t k) { return indices[k]; });
    return;
  }
  // A run of slots in one page (the usual case) is one claim: the rest of the run lies
  // in a page that passed the range check, and its claims would be repeats.
  for (int64_t i = 0; i < indices.size;) {
    const int64_t page = page_of("indices", indices[i]);
    claim("indices", page, true);
    i = run_end(indices, i + 1, page);
  }
}

void PagePool::claim_segment(Span indices, Call) {
  // Every page_size-th index stands for its page.
  const int64_t stride = geometry_.size;
  claim_pages_of("indices", geometry_.pages_for(indices.size), [indices, stride](int64_t k) { return indices[k * stride]; });
}

void PagePool::claim_page_ids(Span pages, Call) {
  for (int64_t i = 0; i < pages.size; ++i)
    if (!page_id_in_pool(pages[i], num_pages_))
      fail("page_ids", "page id ", pages[i], " is outside [1, ", num_pages_, "] (page 0 is the padding page)");
  for (int64_t i = 0; i < pages.size; ++i) claim("page_ids", pages[i], false);
}

void PagePool::undo_claims_after(size_t mark) {
  for (size_t k = mark; k < claimed_.size(); ++k) state_[claimed_[k]] = PageState::kHeld;
  claimed_.resize(mark);
}

void PagePool::undo_claims() { undo_claims_after(0); }

void PagePool::release_claims(Destination dest, ReleaseOrder order) {
  const int64_t n = static_cast<int64_t>(claimed_.size());
  int64_t log_n = 1;
  while ((int64_t{1} << log_n) < n) ++log_n;
  if (order == ReleaseOrder::kPageOrder && num_pages_ <= 4 * n * log_n) {
    // Many claims: one pass over the page states lists them in page order faster than a sort.
    claimed_.clear();
    for (int64_t page = 1; page <= num_pages_; ++page)
      if (state_[page] == PageState::kClaimed) claimed_.push_back(page);
    order = ReleaseOrder::kClaimOrder;
  }
  hand_on(claimed_, dest, order);
  claimed_.clear();
}

void PagePool::release_group(GroupQueue queue, Destination dest, ReleaseOrder order) {
  std::vector<int64_t> pages;
  pages.swap(queue == GroupQueue::kByIndex ? group_index_pages_ : group_page_ids_);
  hand_on(pages, dest, order);
}

void PagePool::hand_on(std::vector<int64_t>& pages, Destination dest, ReleaseOrder order) {
  if (order == ReleaseOrder::kPageOrder) std::sort(pages.begin(), pages.end());
  Releaser placed(*this, static_cast<int64_t>(pages.size()), dest);
  for (int64_t page : pages) placed.place(page);
  placed.commit();
}

PagePool::Releaser::Releaser(PagePool& pool, int64_t n, Destination dest)
    : pool_(pool), dest_(dest), state_(pool.state_.data()), geometry_(pool.geometry_),
      num_pages_(pool.num_pages_) {
  if (std::vector<int64_t>* tail = list()) {
    placed_state_ = dest == Destination::kStaged        ? PageState::kStaged
                    : dest == Destination::kGroupIndex ? PageState::kQueuedByIndex
                                                       : PageState::kQueuedByPage;
    list_size_ = tail->size();
    tail->resize(list_size_ + static_cast<size_t>(n));
    ring_ = first_ = tail->data() + list_size_;
  } else {
    ring_ = first_ = next_ = pool.ring_.data();
    ring_end_ = ring_ + num_pages_;
    fits_ = n <= num_pages_ - pool.free_count_;  // else the block would overwrite free pages
    if (!fits_) return;
    // Appended after the last free page, or prepended: the block ends at the head.
    int64_t at = dest == Destination::kAppend ? pool.head_ + pool.free_count_ : pool.head_ - n;
    if (at >= num_pages_) at -= num_pages_;
    if (at < 0) at += num_pages_;
    first_ = ring_ + at;
  }
  next_ = first_;
}

std::vector<int64_t>* PagePool::Releaser::list() {
  switch (dest_) {
    case Destination::kStaged: return &pool_.staged_;
    case Destination::kGroupIndex: return &pool_.group_index_pages_;
    case Destination::kGroupPages: return &pool_.group_page_ids_;
    default: return nullptr;
  }
}

void PagePool::Releaser::commit() {
  committed_ = true;
  if (std::vector<int64_t>* tail = list()) {
    tail->resize(list_size_ + static_cast<size_t>(count_));
    return;
  }
  if (dest_ == Destination::kPrepend) pool_.head_ = first_ - ring_;  // all n placed: the block ends at the old head
  pool_.free_count_ += count_;
}

void PagePool::Releaser::undo() {
  const int64_t* page = first_;
  for (int64_t k = 0; k < count_; ++k) {
    state_[*page] = PageState::kHeld;
    if (++page == ring_end_) page = ring_;
  }
  if (std::vector<int64_t>* tail = list()) tail->resize(list_size_);
}

std::vector<int64_t> PagePool::free_list() const {
  std::vector<int64_t> pages(static_cast<size_t>(free_count_));
  for (int64_t k = 0; k < free_count_; ++k) pages[k] = page_at(k);
  return pages;
}

std::string PagePool::debug_string() const {
  std::ostringstream s;
  s << "page_size=" << geometry_.size << " pages=" << num_pages_ << " free=" << free_count_
    << " staged=" << staged_.size() << " held=" << num_pages_ - free_count_ - static_cast<int64_t>(staged_.size())
    << (group_open_ ? " (free group open)" : "");
  return s.str();
}

void PagePool::check_invariants() const {
  auto broken = [](const std::string& what) { throw std::logic_error("pool invariant broken: " + what); };
  if (free_count_ < 0 || free_count_ > num_pages_) broken("free count out of range");
  if (state_[0] != PageState::kHeld) broken("the padding page changed state");
  std::vector<int> seen(static_cast<size_t>(num_pages_ + 1), 0);
  auto expect = [&](int64_t page, PageState want, const char* where) {
    if (page < 1 || page > num_pages_) broken(std::string(where) + " holds a page id out of range");
    if (seen[page]++) broken("page " + std::to_string(page) + " is in two places (last seen in " + where + ")");
    if (state_[page] != want) broken("page " + std::to_string(page) + " in " + where + " has the wrong state");
  };
  for (int64_t k = 0; k < free_count_; ++k) expect(page_at(k), PageState::kFree, "the free list");
  for (int64_t page : staged_) expect(page, PageState::kStaged, "the staging list");
  for (int64_t page : group_index_pages_) expect(page, PageState::kQueuedByIndex, "the free group");
  for (int64_t page : group_page_ids_) expect(page, PageState::kQueuedByPage, "the free group");
  if (!group_open_ && !(group_index_pages_.empty() && group_page_ids_.empty()))
    broken("pages queued without an open free group");
  for (int64_t page = 1; page <= num_pages_; ++page)
    if (!seen[page] && state_[page] != PageState::kHeld)
      broken("page " + std::to_string(page) + " is marked free but is in no list");
}

std::vector<int64_t> PagePool::queued_by_index() const {
  std::vector<int64_t> pages = group_index_pages_;
  // A page pool releases them in page order, so their order until then means nothing.
  if (!token_mode()) std::sort(pages.begin(), pages.end());
  return pages;
}

bool PagePool::operator==(const PagePool& o) const {
  return size_ == o.size_ && geometry_.size == o.geometry_.size && need_sort_ == o.need_sort_ &&
         free_list() == o.free_list() && staged_ == o.staged_ && state_ == o.state_ && group_open_ == o.group_open_ &&
         queued_by_index() == o.queued_by_index() && group_page_ids_ == o.group_page_ids_;
}

// ---------------------------------------------------------------- HostHybridStore

HostHybridStore::HostHybridStore(int64_t size, int64_t size_swa, int64_t page_size, bool need_sort, int64_t* mapping,
                                 int64_t mapping_len)
    : full_(std::make_shared<PagePool>(size, page_size, need_sort)),
      swa_(std::make_shared<PagePool>(size_swa, page_size, need_sort)),
      mapping_(mapping),
      mapping_len_(mapping_len) {
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
        !swa_continuation_ok(last, mapping[last], page, swa_pages, swa_state))
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
    if (!swa_continuation_ok(last, swa_last, page, swa_->num_pages(), swa_state))
      throw ArgumentError(swa_continuation_message(j, last, swa_last));
  }
}

void HostHybridStore::write_decode(const BatchLengths& batch, const LastLoc& last_loc, int64_t* full_slots) {
  // extend_slot's two cases for one token: the slot after last_loc in its partial page
  // (the SWA slot after the one it maps to), or the start of each pool's next new page.
  const PageGeometry page = full_->geometry();
  const int64_t* const last = last_loc.data;
  const int64_t* const mapping = mapping_;
  int64_t* __restrict full_out = full_slots;
  int64_t* __restrict swa_out = swa_slots_.data();
  PagePool::HeadPages full_pages = full_->head_pages(), swa_pages = swa_->head_pages();
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
    write_decode(batch, last_loc, full_slots);
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

int64_t HostHybridStore::claim_swa_of_rep(const char* arg, int64_t full_slot) {
  const int64_t swa_slot = mapped_swa_slot(arg, full_slot);
  swa_->claim(arg, swa_->page_of(arg, swa_slot), false);
  return full_->geometry().page(full_slot);
}

void HostHybridStore::claim_swa_of_reps(Span indices, Call) {
  const int64_t page_size = full_->geometry().size;
  swa_->claim_pages_of("indices", full_->geometry().pages_for(indices.size), [this, indices, page_size](int64_t k) {
    return mapped_swa_slot("indices", indices[k * page_size]);
  });
  mapped_reps_ = indices;  // their pages' mapping is cleared from the representatives themselves
}

bool HostHybridStore::free_reps_at_once(Span indices, bool full_side, bool swa_side, Destination full_dest,
                                        Destination swa_dest) {
  const PageGeometry page = full_->geometry();
  const int64_t n = page.pages_for(indices.size), full_pages = full_->num_pages();
  const int64_t* const mapping = mapping_;
  PagePool::Releaser full(*full_, full_side ? n : 0, full_dest), swa(*swa_, swa_side ? n : 0, swa_dest);
  if (!full.fits() || !swa.fits()) return false;
  for (int64_t k = 0; k < n; ++k) {  // a fault returns with the placed pages put back
    const int64_t slot = indices[k * page.size];
    if (full_side ? !full.release_slot(slot) : !slot_in_pool(slot, page, full_pages)) return false;
    if (swa_side && !(mapping[slot] > 0 && swa.release_slot(mapping[slot]))) return false;
  }
  full.commit();
  swa.commit();
  if (swa_side) {
    mapped_reps_ = indices;  // their pages' mapping is cleared from the representatives themselves
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
      claimed_full_pages_.push_back(claim_swa_of_rep("req_to_token", rows.at(plan.row[j], plan.evicted[j] + u * page_size)));
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
  mapped_reps_ = Span();
}

void HostHybridStore::clear_claimed_mapping() {
  const PageGeometry page = full_->geometry();  // a copy: the stores below cannot change it
  int64_t* const mapping = mapping_;
  const auto clear_page = [mapping, size = page.size](int64_t p) {
    if (size == 1) mapping[p] = 0;  // not a call to memset per slot
    else std::fill_n(mapping + p * size, size, 0);
  };
  for (int64_t p : claimed_full_pages_) clear_page(p);
  for (int64_t i = 0; i < mapped_reps_.size; i += page.size) clear_page(page.page(mapped_reps_[i]));
  claimed_full_pages_.clear();
  mapped_reps_ = Span();
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
