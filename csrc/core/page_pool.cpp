#include "page_pool.h"

#include <algorithm>
#include <sstream>

namespace swa {

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

}  // namespace swa
