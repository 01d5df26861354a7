#include "page_pool.h"

#include <algorithm>
#include <sstream>

namespace swa {

PageClaim::~PageClaim() {
  if (committed_) return;
  for (int64_t page : pages_) pool_.state_[page] = PageState::kHeld;
}

PageClaim::PageClaim(PagePool& pool, bool by_index) : pool_(pool), by_index_(by_index || pool.token_mode()) {
  switch (release_destination(pool.group_open_, by_index, pool.need_sort_, pool.token_mode())) {
    case Destination::kGroupIndex:
      target_ = PageState::kQueuedByIndex;
      break;
    case Destination::kGroupPages:
      target_ = PageState::kQueuedByPage;
      break;
    default:
      target_ = PageState::kClaimed;
  }
}

void PageClaim::add(const char* arg, int64_t page, bool repeat_ok) {
  PageState& s = pool_.state_[page];
  if (s == PageState::kHeld) {
    s = target_;
    pages_.push_back(page);
    return;
  }
  if (s == target_ && repeat_ok) return;
  fail(arg, "page ", page, claim_refusal(s));
}

PagePool::PagePool(int64_t size, int64_t page_size, bool need_sort)
    : size_(size), page_size_(page_size), num_pages_(0), capacity_(size), geometry_(page_size), need_sort_(need_sort) {
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
}

void PagePool::clear() { reset_state(); }

void PagePool::resize(int64_t size, const char* arg) {
  check_resize(arg, size, page_size_, capacity_);
  PagePool resized(size, page_size_, need_sort_);
  resized.capacity_ = capacity_;
  *this = std::move(resized);
}

void PagePool::merge_and_sort_free() {
  if (staged_.empty()) return;
  std::vector<int64_t> merged = free_pages();
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

void PagePool::merge_if_due(const AllocPlan& plan, PoolRole role) {
  if (merge_due(plan, role, free_count_, geometry_)) merge_and_sort_free();
}

void PagePool::take(int64_t n) {
  for (int64_t k = 0; k < n; ++k) state_[page_at(k)] = PageState::kHeld;
  head_ += n;
  if (head_ >= num_pages_) head_ -= num_pages_;
  free_count_ -= n;
}

void PagePool::release(const std::vector<int64_t>& pages) {
  const int64_t n = static_cast<int64_t>(pages.size());
  if (n == 0) return;
  const Destination dest = release_destination(false, false, need_sort_, token_mode());
  if (dest == Destination::kStaged) {
    for (int64_t page : pages) state_[page] = PageState::kStaged;
    staged_.insert(staged_.end(), pages.begin(), pages.end());
    return;
  }
  for (int64_t page : pages) state_[page] = PageState::kFree;
  int64_t pos;
  if (dest == Destination::kAppend) {
    pos = head_ + free_count_;  // append
  } else {
    head_ -= n;  // prepend: the pages freed last are handed out first
    if (head_ < 0) head_ += num_pages_;
    pos = head_;
  }
  for (int64_t k = 0; k < n; ++k, ++pos) ring_[pos >= num_pages_ ? pos - num_pages_ : pos] = pages[k];
  free_count_ += n;
}

void PagePool::finish(PageClaim& claim) {
  claim.commit();
  const std::vector<int64_t>& pages = claim.pages();
  const Destination dest = release_destination(group_open_, claim.by_index(), need_sort_, token_mode());
  if (dest == Destination::kGroupIndex || dest == Destination::kGroupPages) {
    std::vector<int64_t>& queue = dest == Destination::kGroupIndex ? group_index_pages_ : group_page_ids_;
    queue.insert(queue.end(), pages.begin(), pages.end());
  } else if (claim.by_index() && !token_mode()) {
    std::vector<int64_t> sorted = pages;  // free() releases its pages in page order
    std::sort(sorted.begin(), sorted.end());
    release(sorted);
  } else {
    release(pages);
  }
}

int64_t PagePool::page_of(const char* arg, int64_t index) const {
  if (!slot_in_pool(index, geometry_, num_pages_))
    fail(arg, "index ", index, " is outside the pool's slots [", page_size_, ", ", index_end(),
         ") (page 0 is the padding page)");
  return geometry_.page(index);
}

void PagePool::check_page_id(const char* arg, int64_t page) const {
  if (!page_id_in_pool(page, num_pages_))
    fail(arg, "page id ", page, " is outside [1, ", num_pages_, "] (page 0 is the padding page)");
}

std::string last_loc_fault_message(LastLocFault fault, int64_t entry, int64_t last_loc, int64_t prefix_len,
                                   const PageGeometry& page, int64_t num_pages) {
  std::ostringstream m;
  m << "last_loc: entry " << entry;
  switch (fault) {
    case LastLocFault::kNone:
      return {};
    case LastLocFault::kNotEmpty:
      m << " is " << last_loc << " but the request has no prefix (expected -1)";
      break;
    case LastLocFault::kOutOfPool:
      m << ": index " << last_loc << " is outside the pool's slots [" << page.size << ", " << (num_pages + 1) * page.size
        << ") (page 0 is the padding page)";
      break;
    case LastLocFault::kWrongOffset:
      m << " (" << last_loc << ") is not where a prefix of " << prefix_len << " tokens ends in its page (page size "
        << page.size << ")";
      break;
    case LastLocFault::kPageNotHeld:
      m << " (" << last_loc << ") lies in page " << page.page(last_loc) << ", which is not allocated";
      break;
  }
  return m.str();
}

const char* claim_refusal(PageState state) {
  switch (state) {
    case PageState::kFree:
    case PageState::kStaged:
      return " is already free (double free)";
    case PageState::kQueuedByIndex:
    case PageState::kQueuedByPage:
      return " is already freed in the open free group (double free)";
    default:
      return " is freed twice in one call";
  }
}

void PagePool::check_last_loc(const BatchLengths& batch, const LastLoc& last_loc) const {
  const auto state_of_page = [this](int64_t page) { return state_[page]; };
  for (int64_t j = 0; j < batch.size(); ++j) {
    const int64_t prefix = batch.prefix(j), last = last_loc.data[j];
    const LastLocFault fault = last_loc_fault(last, prefix, geometry_, num_pages_, state_of_page);
    if (fault != LastLocFault::kNone)
      throw ArgumentError(last_loc_fault_message(fault, j, last, prefix, geometry_, num_pages_));
  }
}

bool PagePool::alloc(int64_t need_size, OutBuffer& out) {
  const AllocPlan plan = plan_alloc(need_size, geometry_);
  merge_if_due(plan, PoolRole::kFull);
  if (pool_refused(plan, free_count_)) return false;
  const int64_t zero = 0;
  const BatchLengths whole{Span(&zero, 1), Span(&need_size, 1), false};
  write_slots(whole, [](int64_t) { return int64_t{-1}; }, out.get(need_size));
  take(plan.full_pages);
  return true;
}

bool PagePool::alloc_extend(const BatchLengths& batch, const LastLoc& last_loc, int64_t extend_num_tokens,
                            int64_t num_new_pages, OutBuffer& out) {
  return allocate(plan_extend(batch, last_loc, extend_num_tokens, geometry_), batch, last_loc, num_new_pages, out);
}

bool PagePool::alloc_decode(const BatchLengths& batch, const LastLoc& last_loc, OutBuffer& out) {
  return allocate(plan_decode(batch, last_loc, geometry_), batch, last_loc, -1, out);
}

bool PagePool::allocate(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc,
                        int64_t num_new_pages, OutBuffer& out) {
  check_last_loc(batch, last_loc);
  check_num_new_pages(num_new_pages, plan);
  merge_if_due(plan, PoolRole::kFull);
  if (pool_refused(plan, free_count_)) return false;
  write_slots(batch, [&](int64_t j) { return last_loc.data[j]; }, out.get(plan.num_tokens));
  take(plan.full_pages);
  return true;
}

void PagePool::claim_indices(PageClaim& claim, const char* arg, Span indices) const {
  // Page mode frees whole pages: several tokens of one page are one free. A token
  // listed twice in the token pool is a double free.
  for (int64_t i = 0; i < indices.size; ++i) claim.add(arg, page_of(arg, indices[i]), !token_mode());
}

void PagePool::claim_segment(PageClaim& claim, const char* indices_arg, Span indices, int64_t start_pos) const {
  check_segment_start(start_pos, geometry_);
  // Every page_size-th index stands for its page.
  for (int64_t i = 0; i < indices.size; i += page_size_) claim.add(indices_arg, page_of(indices_arg, indices[i]), false);
}

void PagePool::free(Span indices) {
  PageClaim claim(*this, true);
  claim_indices(claim, "indices", indices);
  finish(claim);
}

void PagePool::free_page_ids(Span pages) {
  for (int64_t i = 0; i < pages.size; ++i) check_page_id("page_ids", pages[i]);
  PageClaim claim(*this, false);
  for (int64_t i = 0; i < pages.size; ++i) claim.add("page_ids", pages[i], false);
  finish(claim);
}

void PagePool::free_segment(Span indices, int64_t start_pos) {
  PageClaim claim(*this, false);
  claim_segment(claim, "indices", indices, start_pos);
  finish(claim);
}

void PagePool::free_group_begin() {
  check_group_begin(group_open_);
  group_open_ = true;
}

void PagePool::free_group_end(GroupOrder order) {
  check_group_end(group_open_);
  group_open_ = false;
  std::vector<int64_t> by_index, by_page;
  by_index.swap(group_index_pages_);
  by_page.swap(group_page_ids_);
  // Everything freed by index is one free(): its pages are released in page order.
  if (!token_mode()) std::sort(by_index.begin(), by_index.end());
  const bool pages_first = order == GroupOrder::kPageIdsFirst;
  release(pages_first ? by_page : by_index);
  release(pages_first ? by_index : by_page);
}

std::vector<int64_t> PagePool::free_pages() const {
  std::vector<int64_t> pages(static_cast<size_t>(free_count_));
  for (int64_t k = 0; k < free_count_; ++k) pages[k] = page_at(k);
  return pages;
}

std::string PagePool::debug_string() const {
  std::ostringstream s;
  s << "page_size=" << page_size_ << " pages=" << num_pages_ << " free=" << free_count_
    << " staged=" << staged_.size() << " held=" << num_pages_ - available_pages()
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
  return size_ == o.size_ && page_size_ == o.page_size_ && need_sort_ == o.need_sort_ &&
         free_pages() == o.free_pages() && staged_ == o.staged_ && state_ == o.state_ &&
         group_open_ == o.group_open_ && queued_by_index() == o.queued_by_index() &&
         group_page_ids_ == o.group_page_ids_;
}

}  // namespace swa
