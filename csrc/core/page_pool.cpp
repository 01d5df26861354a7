#include "page_pool.h"

#include <algorithm>
#include <sstream>

namespace swa {

PagePool::PagePool(int64_t size, int64_t page_size, bool need_sort, const PageKind& kind)
    : size_(size), num_pages_(0), capacity_(size), geometry_(page_size), need_sort_(need_sort), kind_(kind) {
  check_pool_shape("size", size, page_size);
  num_pages_ = size / page_size;
  list_->ring.resize(static_cast<size_t>(num_pages_));
  list_->state.resize(static_cast<size_t>(num_pages_ + 1));
  reset_state();
}

std::shared_ptr<PagePool> PagePool::swa_side_of(PagePool& full_side) {
  auto swa = std::make_shared<PagePool>(full_side.geometry_.size, full_side.geometry_.size, full_side.need_sort_,
                                        PageKind::swa());  // the smallest pool: its lists are replaced below
  swa->size_ = full_side.size_;
  swa->num_pages_ = full_side.num_pages_;
  swa->capacity_ = full_side.capacity_;
  swa->list_.share(full_side.list_);
  swa->shares_list_ = full_side.shares_list_ = true;
  return swa;
}

PagePool PagePool::from_parts(int64_t size, int64_t page_size, bool need_sort, const std::vector<int64_t>& free_list,
                              std::vector<int64_t> staged, std::vector<PageState> state, bool group_open,
                              std::vector<int64_t> group_index_pages, std::vector<int64_t> group_page_ids,
                              const PageKind& kind, bool shares_list) {
  PagePool pool(size, page_size, need_sort, kind);
  pool.shares_list_ = shares_list;
  if (static_cast<int64_t>(free_list.size()) > pool.num_pages_ || static_cast<int64_t>(state.size()) != pool.num_pages_ + 1)
    throw std::logic_error("pool snapshot of the wrong shape");
  std::copy(free_list.begin(), free_list.end(), pool.list_->ring.begin());
  pool.list_->head = 0;
  pool.list_->free_count = static_cast<int64_t>(free_list.size());
  pool.list_->staged = std::move(staged);
  pool.list_->state = std::move(state);
  pool.group_open_ = group_open;
  pool.group_index_pages_ = std::move(group_index_pages);
  pool.group_page_ids_ = std::move(group_page_ids);
  pool.held_count_ = pool.count_held();
  return pool;
}

void PagePool::reset_state() {
  for (int64_t k = 0; k < num_pages_; ++k) list_->ring[k] = k + 1;
  list_->head = 0;
  list_->free_count = num_pages_;
  list_->staged.clear();
  std::fill(list_->state.begin(), list_->state.end(), PageState::kFree);
  list_->state[0] = PageState::kHeld;  // the padding page is never handed out nor freed
  group_open_ = false;
  group_index_pages_.clear();
  group_page_ids_.clear();
  claimed_.clear();
  held_count_ = 0;
}

void PagePool::clear() { reset_state(); }

void PagePool::resize(int64_t size) {
  PagePool resized(size, geometry_.size, need_sort_, kind_);
  resized.capacity_ = capacity_;
  resized.shares_list_ = shares_list_;
  *this = std::move(resized);
}

void PagePool::restore(const PagePool& state) {
  const int64_t capacity = capacity_;
  *this = state;
  capacity_ = capacity;
}

void PagePool::merge() {
  std::vector<int64_t> merged = free_list();
  merged.insert(merged.end(), list_->staged.begin(), list_->staged.end());
  std::sort(merged.begin(), merged.end());
  for (size_t k = 0; k < merged.size(); ++k) {
    list_->ring[k] = merged[k];
    list_->state[merged[k]] = PageState::kFree;
  }
  list_->head = 0;
  list_->free_count = static_cast<int64_t>(merged.size());
  list_->staged.clear();
}

void PagePool::take(int64_t n) {
  PageState* const state = list_->state.data();
  const PageState held = kind_.held;
  head_ranges(n, [state, held](const int64_t* first, const int64_t* last) {
    for (const int64_t* p = first; p != last; ++p) state[*p] = held;
  });
  list_->head += n;
  if (list_->head >= num_pages_) list_->head -= num_pages_;
  list_->free_count -= n;
  held_count_ += n;
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
  // The rules read a held page as kHeld, whichever kind this pool holds.
  const auto state_of_page = [this](int64_t page) { return holds(page) ? PageState::kHeld : list_->state[page]; };
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

void PagePool::refuse_claim(const char* arg, int64_t page) const { fail(arg, "page ", page, claim_refusal(list_->state[page], kind_)); }

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
  for (size_t k = mark; k < claimed_.size(); ++k) list_->state[claimed_[k]] = kind_.held;
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
      if (list_->state[page] == kind_.claimed) claimed_.push_back(page);
    order = ReleaseOrder::kClaimOrder;
  }
  place_released(claimed_, dest, order);
  claimed_.clear();
}

void PagePool::release_group(GroupQueue queue, Destination dest, ReleaseOrder order) {
  std::vector<int64_t> pages;
  pages.swap(queue == GroupQueue::kByIndex ? group_index_pages_ : group_page_ids_);
  place_released(pages, dest, order);
}

void PagePool::place_released(std::vector<int64_t>& pages, Destination dest, ReleaseOrder order) {
  if (order == ReleaseOrder::kPageOrder) std::sort(pages.begin(), pages.end());
  Releaser placed(*this, static_cast<int64_t>(pages.size()), dest);
  for (int64_t page : pages) placed.place(page);
  placed.commit();
}

PagePool::Releaser::Releaser(PagePool& pool, int64_t n, Destination dest, int64_t before, int64_t after)
    : pool_(pool), dest_(dest), state_(pool.list_->state.data()), geometry_(pool.geometry_),
      num_pages_(pool.num_pages_), held_(pool.kind_.held) {
  if (std::vector<int64_t>* tail = list()) {
    placed_state_ = dest == Destination::kStaged        ? PageState::kStaged
                    : dest == Destination::kGroupIndex ? pool.kind_.queued_by_index
                                                       : PageState::kQueuedByPage;
    list_size_ = tail->size();
    tail->resize(list_size_ + static_cast<size_t>(n));
    ring_ = first_ = tail->data() + list_size_;
  } else {
    ring_ = first_ = next_ = pool.list_->ring.data();
    ring_end_ = ring_ + num_pages_;
    const int64_t total = before + n + after;
    fits_ = total <= num_pages_ - pool.list_->free_count;  // else the block would overwrite free pages
    if (!fits_) return;
    // Appended after the last free page, or prepended: the block ends at the head.
    const auto wrap = [this](int64_t at) { return at >= num_pages_ ? at - num_pages_ : at < 0 ? at + num_pages_ : at; };
    block_start_ = wrap(dest == Destination::kAppend ? pool.list_->head + pool.list_->free_count
                                                     : pool.list_->head - total);
    first_ = ring_ + wrap(block_start_ + before);
  }
  next_ = first_;
}

std::vector<int64_t>* PagePool::Releaser::list() {
  switch (dest_) {
    case Destination::kStaged: return &pool_.list_->staged;
    case Destination::kGroupIndex: return &pool_.group_index_pages_;
    case Destination::kGroupPages: return &pool_.group_page_ids_;
    default: return nullptr;
  }
}

void PagePool::Releaser::commit() {
  committed_ = true;
  if (count_ == 0) return;  // nothing placed: the shared mode's other side may have moved the list since
  // Pages into a free group's queue stay the pool's until the group ends.
  if (dest_ != Destination::kGroupIndex && dest_ != Destination::kGroupPages) pool_.held_count_ -= count_;
  if (std::vector<int64_t>* tail = list()) {
    tail->resize(list_size_ + static_cast<size_t>(count_));
    return;
  }
  if (dest_ == Destination::kPrepend) pool_.list_->head = block_start_;  // all placed: the block ends at the old head
  pool_.list_->free_count += count_;
}

void PagePool::Releaser::undo() {
  const int64_t* page = first_;
  for (int64_t k = 0; k < count_; ++k) {
    state_[*page] = held_;
    if (++page == ring_end_) page = ring_;
  }
  if (std::vector<int64_t>* tail = list()) tail->resize(list_size_);
}

std::vector<int64_t> PagePool::free_list() const {
  std::vector<int64_t> pages(static_cast<size_t>(list_->free_count));
  for (int64_t k = 0; k < list_->free_count; ++k) pages[k] = page_at(k);
  return pages;
}

std::string PagePool::debug_string() const {
  std::ostringstream s;
  s << "page_size=" << geometry_.size << " pages=" << num_pages_ << " free=" << list_->free_count
    << " staged=" << list_->staged.size() << " held=" << num_pages_ - list_->free_count - static_cast<int64_t>(list_->staged.size())
    << (group_open_ ? " (free group open)" : "");
  return s.str();
}

void PagePool::check_invariants(const PagePool* other_side) const {
  auto broken = [](const std::string& what) { throw std::logic_error("pool invariant broken: " + what); };
  if (list_->free_count < 0 || list_->free_count > num_pages_) broken("free count out of range");
  if (list_->state[0] != PageState::kHeld) broken("the padding page changed state");
  std::vector<int> seen(static_cast<size_t>(num_pages_ + 1), 0);
  auto expect = [&](int64_t page, PageState want, const char* where) {
    if (page < 1 || page > num_pages_) broken(std::string(where) + " holds a page id out of range");
    if (seen[page]++) broken("page " + std::to_string(page) + " is in two places (last seen in " + where + ")");
    if (list_->state[page] != want) broken("page " + std::to_string(page) + " in " + where + " has the wrong state");
  };
  for (int64_t k = 0; k < list_->free_count; ++k) expect(page_at(k), PageState::kFree, "the free list");
  for (int64_t page : list_->staged) expect(page, PageState::kStaged, "the staging list");
  std::vector<const PagePool*> sides{this};
  if (other_side != nullptr) {
    const PageList& other = *other_side->list_;
    if (other_side->num_pages_ != num_pages_ || other_side->free_list() != free_list() ||
        other.staged != list_->staged || other.state != list_->state)
      broken("the shared mode's two sides do not hold one list");
    sides.push_back(other_side);
  }
  for (const PagePool* side : sides) {
    for (int64_t page : side->group_index_pages_) expect(page, side->kind_.queued_by_index, "the free group");
    for (int64_t page : side->group_page_ids_) expect(page, PageState::kQueuedByPage, "the free group");
    if (!side->group_open_ && !(side->group_index_pages_.empty() && side->group_page_ids_.empty()))
      broken("pages queued without an open free group");
  }
  for (const PagePool* side : sides)
    if (side->held_count_ != side->count_held()) broken("the count of held pages is off");
  const bool alone = shares_list_ && other_side == nullptr;
  for (int64_t page = 1; page <= num_pages_; ++page) {
    if (seen[page]) continue;
    bool held = false;
    for (const PagePool* side : sides) held = held || side->holds(page);
    const PageState s = list_->state[page];
    if (!held && !(alone && s != PageState::kFree && s != PageState::kStaged)) broken("page " + std::to_string(page) + " is marked free but is in no list");
  }
}

int64_t PagePool::count_held() const {
  int64_t held = static_cast<int64_t>(group_page_ids_.size());  // their state names no kind
  for (int64_t page = 1; page <= num_pages_; ++page) {
    const PageState s = list_->state[page];
    held += s == kind_.held || s == kind_.claimed || s == kind_.queued_by_index;
  }
  return held;
}

std::vector<int64_t> PagePool::queued_by_index() const {
  std::vector<int64_t> pages = group_index_pages_;
  // A page pool releases them in page order, so their order until then means nothing.
  if (!token_mode()) std::sort(pages.begin(), pages.end());
  return pages;
}

bool PagePool::operator==(const PagePool& o) const {
  return size_ == o.size_ && geometry_.size == o.geometry_.size && need_sort_ == o.need_sort_ &&
         free_list() == o.free_list() && list_->staged == o.list_->staged && list_->state == o.list_->state && group_open_ == o.group_open_ &&
         queued_by_index() == o.queued_by_index() && group_page_ids_ == o.group_page_ids_;
}

}  // namespace swa
