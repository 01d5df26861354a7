#include "page_pool.h"

#include <algorithm>
#include <sstream>

namespace swa {

PagePool::PagePool(int64_t size, int64_t page_size, bool need_sort, const PageKind& kind)
    : size_(size), num_pages_(0), num_parents_(0), capacity_(size), geometry_(page_size), need_sort_(need_sort),
      kind_(kind) {
  check_pool_shape("size", size, page_size);
  num_pages_ = num_parents_ = size / page_size;
  list_->ring.resize(static_cast<size_t>(num_pages_));
  list_->state.resize(static_cast<size_t>(num_pages_ + 1));
  reset_state();
}

std::pair<std::shared_ptr<PagePool>, std::shared_ptr<PagePool>> PagePool::shared_sides(
    int64_t size, int64_t size_swa, int64_t page_size, bool need_sort, const ParentLayout& parents) {
  const bool small_full = parents.small_side == Side::kFull;
  // The large side's pool holds the list: its pages are the parents.
  auto large = std::make_shared<PagePool>(small_full ? size_swa : size, page_size, need_sort,
                                          small_full ? PageKind::swa() : PageKind::full());
  auto small = std::make_shared<PagePool>(page_size, page_size, need_sort,
                                          small_full ? PageKind::full() : PageKind::swa());  // its lists replaced below
  small->list_.share(large->list_);
  small->shares_list_ = large->shares_list_ = true;
  small->pages_per_parent_ = parents.k;
  small->capacity_ = small_full ? size : size_swa;
  small->resize(small->capacity_);
  return small_full ? std::pair{small, large} : std::pair{large, small};
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
  for (int64_t k = 0; k < num_parents_; ++k) list_->ring[k] = k + 1;
  list_->head = 0;
  list_->free_count = num_parents_;
  list_->staged.clear();
  std::fill(list_->state.begin(), list_->state.end(), PageState::kFree);
  list_->state[0] = PageState::kHeld;  // the padding page is never handed out nor freed
  if (pages_per_parent_ > 1) {  // the small side: every parent unbound, parent 0's child pages padding
    std::fill(child_state_.begin(), child_state_.end(), PageState::kFree);
    std::fill(child_state_.begin() + 1, child_state_.begin() + pages_per_parent_, PageState::kPadding);
    child_state_[0] = PageState::kHeld;
    std::fill(free_in_parent_.begin(), free_in_parent_.end(), 0);
    partial_head_ = free_children_ = 0;
  }
  group_open_ = false;
  group_index_pages_.clear();
  group_page_ids_.clear();
  claimed_.clear();
  held_count_ = 0;
}

void PagePool::clear() { reset_state(); }

void PagePool::resize(int64_t size) {
  if (pages_per_parent_ > 1) {
    // The small side: its child pages over the list the large side sizes (hybrid resize
    // resizes both; the list's parents are its size / parent_k in pages).
    size_ = size;
    num_parents_ = size / geometry_.size / pages_per_parent_;
    num_pages_ = child_page_count(num_parents_, pages_per_parent_);
    list_->ring.resize(static_cast<size_t>(num_parents_));
    list_->state.resize(static_cast<size_t>(num_parents_ + 1));
    child_state_.assign(static_cast<size_t>(num_pages_ + 1), PageState::kFree);
    free_in_parent_.assign(static_cast<size_t>(num_parents_ + 1), 0);
    partial_next_.assign(static_cast<size_t>(num_parents_ + 1), 0);
    partial_prev_.assign(static_cast<size_t>(num_parents_ + 1), 0);
    group_open_ = false;
    reset_state();
    return;
  }
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
  held_count_ += n;
  const int64_t parents = pages_per_parent_ > 1 ? take_children(n) : n;
  // The parents bound from the head: the large side's pages, the small side's parents.
  PageState* const state = list_->state.data();
  const PageState held = kind_.held;
  head_ranges(parents, [state, held](const int64_t* first, const int64_t* last) {
    for (const int64_t* p = first; p != last; ++p) state[*p] = held;
  });
  list_->head += parents;
  if (list_->head >= num_parents_) list_->head -= num_parents_;
  list_->free_count -= parents;
}

const int64_t* PagePool::next_pages(int64_t skip, int64_t n) const {
  next_pages_.resize(static_cast<size_t>(n));
  const int64_t k = pages_per_parent_;
  int64_t got = 0;
  for (int64_t parent = partial_head_; parent != 0 && got < n; parent = partial_next_[parent])
    for (int64_t c = first_child(parent, k); c < first_child(parent, k) + k && got < n; ++c)
      if (child_state_[c] == PageState::kFree) next_pages_[got++] = c;
  for (int64_t q = skip; q < list_->free_count && got < n; ++q)
    for (int64_t c = first_child(page_at(q), k); c < first_child(page_at(q), k) + k && got < n; ++c)
      next_pages_[got++] = c;
  return next_pages_.data();
}

int64_t PagePool::take_children(int64_t n) {
  const int64_t k = pages_per_parent_;
  PageState* const child = child_state_.data();
  while (n > 0 && partial_head_ != 0) {  // the partly used parents first, each one's free pages in order
    const int64_t parent = partial_head_;
    for (int64_t c = first_child(parent, k); c < first_child(parent, k) + k && n > 0; ++c) {
      if (child[c] != PageState::kFree) continue;
      child[c] = kind_.held;
      --n;
      --free_in_parent_[parent];
      --free_children_;
    }
    if (free_in_parent_[parent] == 0) unlink_partial(parent);
  }
  const int64_t parents = (n + k - 1) / k;
  for (int64_t q = 0; q < parents; ++q) {  // fresh parents, their child pages in order
    const int64_t parent = page_at(q), first = first_child(parent, k);
    const int64_t used = n < k ? n : k;
    std::fill_n(child + first, used, kind_.held);
    n -= used;
    if (used < k) {  // the last one, partly used: its free pages are the next to go
      free_in_parent_[parent] = k - used;
      free_children_ += k - used;
      link_partial(parent);
    }
  }
  return parents;
}

void PagePool::return_children(const std::vector<int64_t>& pages, std::vector<int64_t>& whole) {
  const int64_t k = pages_per_parent_;
  for (int64_t c : pages) {
    child_state_[c] = PageState::kFree;
    const int64_t parent = parent_of(c, k);
    if (++free_in_parent_[parent] == k) {  // its last child page: the parent goes back to the list
      if (k > 1) unlink_partial(parent);
      free_in_parent_[parent] = 0;
      free_children_ -= k - 1;
      whole.push_back(parent);
    } else {
      ++free_children_;
      if (free_in_parent_[parent] == 1) link_partial(parent);
    }
  }
}

void PagePool::link_partial(int64_t parent) {
  partial_prev_[parent] = 0;
  partial_next_[parent] = partial_head_;
  if (partial_head_ != 0) partial_prev_[partial_head_] = parent;
  partial_head_ = parent;
}

void PagePool::unlink_partial(int64_t parent) {
  const int64_t prev = partial_prev_[parent], next = partial_next_[parent];
  (prev != 0 ? partial_next_[prev] : partial_head_) = next;
  if (next != 0) partial_prev_[next] = prev;
  partial_next_[parent] = partial_prev_[parent] = 0;
}

std::vector<int64_t> PagePool::partly_used_parents() const {
  std::vector<int64_t> parents;
  for (int64_t parent = partial_head_; parent != 0; parent = partial_next_[parent]) parents.push_back(parent);
  return parents;
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
  const auto state_of_page = [this](int64_t page) { return holds(page) ? PageState::kHeld : states()[page]; };
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

void PagePool::refuse_claim(const char* arg, int64_t page) const {
  PageState state = states()[page];
  // A small side's free child page of a parent it has not bound: the parent's state says why.
  if (pages_per_parent_ > 1 && state == PageState::kFree) state = list_->state[parent_of(page, pages_per_parent_)];
  fail(arg, "page ", page, claim_refusal(state, kind_));
}

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
  PageState* const state = states();
  for (size_t k = mark; k < claimed_.size(); ++k) state[claimed_[k]] = kind_.held;
  claimed_.resize(mark);
}

void PagePool::undo_claims() { undo_claims_after(0); }

void PagePool::release_claims(Destination dest, ReleaseOrder order, Span releases) {
  if (releases.size > 0) {
    std::vector<int64_t> pages;
    for (int64_t j = 0; j + 1 < releases.size; ++j) {
      pages.assign(claimed_.begin() + releases[j], claimed_.begin() + releases[j + 1]);
      place_released(pages, dest, order);
    }
    claimed_.clear();
    return;
  }
  const int64_t n = static_cast<int64_t>(claimed_.size());
  int64_t log_n = 1;
  while ((int64_t{1} << log_n) < n) ++log_n;
  if (order == ReleaseOrder::kPageOrder && num_pages_ <= 4 * n * log_n) {
    // Many claims: one pass over the page states lists them in page order faster than a sort.
    claimed_.clear();
    const PageState* const state = states();
    for (int64_t page = 1; page <= num_pages_; ++page)
      if (state[page] == kind_.claimed) claimed_.push_back(page);
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
  if (pages_per_parent_ > 1 && dest != Destination::kGroupIndex && dest != Destination::kGroupPages) {
    // The small side's child pages go back to their parents; the parents whose last child
    // came back go where the pages would.
    std::vector<int64_t> whole;
    return_children(pages, whole);
    held_count_ -= static_cast<int64_t>(pages.size());
    Releaser placed(*this, static_cast<int64_t>(whole.size()), dest, 0, 0, true);
    for (int64_t parent : whole) placed.place(parent);
    placed.commit();
    return;
  }
  Releaser placed(*this, static_cast<int64_t>(pages.size()), dest);
  for (int64_t page : pages) placed.place(page);
  placed.commit();
}

PagePool::Releaser::Releaser(PagePool& pool, int64_t n, Destination dest, int64_t before, int64_t after,
                             bool parents)
    : pool_(pool), dest_(dest), state_(parents ? pool.list_->state.data() : pool.states()), geometry_(pool.geometry_),
      num_pages_(pool.num_parents_), held_(pool.kind_.held), parents_(parents) {
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
  // Parents: their child pages left the count when they came back.
  if (dest_ != Destination::kGroupIndex && dest_ != Destination::kGroupPages && !parents_) pool_.held_count_ -= count_;
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
  if (list_->free_count < 0 || list_->free_count > num_parents_) broken("free count out of range");
  if (list_->state[0] != PageState::kHeld) broken("the padding page changed state");
  // Pages seen in a list or queue: parents (the list's, and the queues of a side whose pages
  // are parents), and the small side's child pages.
  std::vector<int> seen(static_cast<size_t>(num_parents_ + 1), 0), seen_child;
  auto expect = [&](const PagePool& side, int64_t page, PageState want, const char* where) {
    const bool child = side.pages_per_parent_ > 1 && want != PageState::kFree && want != PageState::kStaged;
    std::vector<int>& seen_in = child ? seen_child : seen;
    const int64_t end = child ? side.num_pages_ : num_parents_;
    if (page < 1 || page > end) broken(std::string(where) + " holds a page id out of range");
    if (seen_in[page]++) broken("page " + std::to_string(page) + " is in two places (last seen in " + where + ")");
    if ((child ? side.child_state_[page] : list_->state[page]) != want)
      broken("page " + std::to_string(page) + " in " + where + " has the wrong state");
  };
  for (int64_t k = 0; k < list_->free_count; ++k) expect(*this, page_at(k), PageState::kFree, "the free list");
  for (int64_t page : list_->staged) expect(*this, page, PageState::kStaged, "the staging list");
  std::vector<const PagePool*> sides{this};
  if (other_side != nullptr) {
    const PageList& other = *other_side->list_;
    if (other_side->num_parents_ != num_parents_ || other_side->free_list() != free_list() ||
        other.staged != list_->staged || other.state != list_->state)
      broken("the shared mode's two sides do not hold one list");
    sides.push_back(other_side);
  }
  for (const PagePool* side : sides) {
    if (side->pages_per_parent_ > 1) seen_child.assign(static_cast<size_t>(side->num_pages_ + 1), 0);
    for (int64_t page : side->group_index_pages_) expect(*side, page, side->kind_.queued_by_index, "the free group");
    for (int64_t page : side->group_page_ids_) expect(*side, page, PageState::kQueuedByPage, "the free group");
    if (!side->group_open_ && !(side->group_index_pages_.empty() && side->group_page_ids_.empty()))
      broken("pages queued without an open free group");
    if (side->held_count_ != side->count_held()) broken("the count of held pages is off");
    if (side->pages_per_parent_ > 1) side->check_children();
  }
  // Every other parent is a side's: a page it holds, or (the small side's) bound to it.
  const bool alone = shares_list_ && other_side == nullptr;
  for (int64_t page = 1; page <= num_parents_; ++page) {
    if (seen[page]) continue;
    bool held = false;
    for (const PagePool* side : sides) held = held || list_->state[page] == side->kind_.held;
    const PageState s = list_->state[page];
    if (!held && !(alone && s != PageState::kFree && s != PageState::kStaged)) broken("page " + std::to_string(page) + " is marked free but is in no list");
  }
}

void PagePool::check_children() const {
  auto broken = [](const std::string& what) { throw std::logic_error("parent invariant broken: " + what); };
  const int64_t k = pages_per_parent_;
  if (child_state_[0] != PageState::kHeld ||
      std::any_of(child_state_.begin() + 1, child_state_.begin() + k, [](PageState s) { return s != PageState::kPadding; }))
    broken("a child page of parent 0 (padding) changed state");
  std::vector<char> linked(static_cast<size_t>(num_parents_ + 1), 0);
  int64_t prev = 0;
  for (int64_t parent = partial_head_; parent != 0; prev = parent, parent = partial_next_[parent]) {
    if (parent < 1 || parent > num_parents_ || linked[parent]++) broken("the partly used parents do not form a list");
    if (partial_prev_[parent] != prev) broken("the partly used parents' back links are off");
  }
  int64_t free_children = 0;
  for (int64_t parent = 1; parent <= num_parents_; ++parent) {
    const std::string name = "parent " + std::to_string(parent);
    const bool bound = list_->state[parent] == kind_.held;
    int64_t free = 0;
    for (int64_t c = first_child(parent, k); c < first_child(parent, k) + k; ++c) {
      const PageState s = child_state_[c];
      free += s == PageState::kFree;
      if (!bound && s != PageState::kFree) broken(name + ", not bound to this side, has child page " + std::to_string(c) + " out");
    }
    if (!bound) {
      if (linked[parent] || free_in_parent_[parent] != 0) broken(name + ", not bound to this side, is partly used");
      continue;
    }
    if (free == k) broken(name + " is bound with every child page free (it belongs in the free list)");
    if (free_in_parent_[parent] != free) broken(name + "'s count of free child pages is off");
    if ((free > 0) != (linked[parent] != 0)) broken(name + (free > 0 ? " has a free child page but is not in" : " is full but in") + " the partly used list");
    free_children += free;
  }
  if (free_children != free_children_) broken("the count of free child pages is off");
}

int64_t PagePool::count_held() const {
  int64_t held = static_cast<int64_t>(group_page_ids_.size());  // their state names no kind
  const PageState* const state = states();
  for (int64_t page = 1; page <= num_pages_; ++page) {
    const PageState s = state[page];
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
         queued_by_index() == o.queued_by_index() && group_page_ids_ == o.group_page_ids_ &&
         pages_per_parent_ == o.pages_per_parent_ && child_state_ == o.child_state_ &&
         partly_used_parents() == o.partly_used_parents();
}

}  // namespace swa
