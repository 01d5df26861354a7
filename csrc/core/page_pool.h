// PagePool: one pool of pages in host memory (an ordered free list of page ids, the
// need_sort staging list, free-group queues, a state per page). It is the CPU store's
// pool and also the value a snapshot of any pool takes, the device store's included
// (AllocatorState: a hybrid allocator's), which is why both stores include this header.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "errors.h"
#include "store.h"

namespace swa {

// The page of slot if it lies in a pool of num_pages pages and is held (in state
// `held`), so that a free may claim it; -1 where claiming it (a repeat being a double
// free) would throw.
inline int64_t held_page(int64_t slot, const PageGeometry& geometry, int64_t num_pages, const PageState* state,
                         PageState held) {
  if (!slot_in_pool(slot, geometry, num_pages)) return -1;
  const int64_t page = geometry.page(slot);
  return state[page] == held ? page : -1;
}

// A pool's free list, staging list and page states: its own, or in the shared mode one
// for the full and the SWA side. A copy of a pool (a snapshot) copies them; an
// assignment (restore, resize) writes them in place, so that both sides keep sharing.
struct PageList {
  // The free list is ring[head .. head + free_count) modulo the pool's pages: the page
  // pool prepends and the token pool appends, and both fit because a page is in at
  // most one place.
  std::vector<int64_t> ring;
  int64_t head = 0, free_count = 0;
  std::vector<int64_t> staged;
  std::vector<PageState> state;  // indexed by page id; page 0 is the padding page
};
class PageListRef {
 public:
  PageListRef() : list_(std::make_shared<PageList>()) {}
  PageListRef(const PageListRef& other) : list_(std::make_shared<PageList>(*other.list_)) {}
  PageListRef& operator=(const PageListRef& other) {
    if (list_ != other.list_) *list_ = *other.list_;
    return *this;
  }
  void share(const PageListRef& other) { list_ = other.list_; }
  PageList* operator->() const { return list_.get(); }
  const PageList& operator*() const { return *list_; }

 private:
  std::shared_ptr<PageList> list_;
};

class PagePool final : public PoolStore {
 public:
  PagePool(int64_t size, int64_t page_size, bool need_sort, const PageKind& kind = PageKind::full());
  // The shared mode's two sides (full, SWA) over one list of parent pages, each of its own
  // kind, with its own claims and free-group queues; the small side's pages are child pages,
  // parents.k to a parent.
  static std::pair<std::shared_ptr<PagePool>, std::shared_ptr<PagePool>> shared_sides(
      int64_t size, int64_t size_swa, int64_t page_size, bool need_sort, const ParentLayout& parents);
  // A pool with the given contents (a device pool's snapshot); check_invariants() vets it.
  // shares_list: a side of the shared mode, holding pages of `kind`.
  static PagePool from_parts(int64_t size, int64_t page_size, bool need_sort, const std::vector<int64_t>& free_list,
                             std::vector<int64_t> staged, std::vector<PageState> state, bool group_open,
                             std::vector<int64_t> group_index_pages, std::vector<int64_t> group_page_ids,
                             const PageKind& kind, bool shares_list);

  // PoolStore
  int64_t size() const override { return size_; }
  int64_t capacity() const override { return capacity_; }
  const PageGeometry& geometry() const override { return geometry_; }
  int64_t num_pages() const override { return num_pages_; }
  int64_t num_parents() const override { return num_parents_; }
  int64_t pages_per_parent() const override { return pages_per_parent_; }
  int64_t free_children() override { return free_children_; }
  bool need_sort() const override { return need_sort_; }
  int64_t free_pages() override { return list_->free_count; }
  int64_t staged_pages() override { return static_cast<int64_t>(list_->staged.size()); }
  int64_t held_pages() override { return held_count_; }
  int64_t held_count() const { return held_count_; }
  bool group_open() const override { return group_open_; }
  bool shares_list() const override { return shares_list_; }
  void set_group_open(bool open) override { group_open_ = open; }
  void check_usable() override {}
  void merge() override;
  void validate_batch(const BatchLengths& batch, const LastLoc& last_loc, Call call) override;
  void write_batch(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc, Call call,
                   OutBuffer& out) override;
  void claim_slots(Span indices, Call call) override;
  void claim_segment(Span indices, Call call) override;
  void claim_page_ids(Span pages, Call call) override;
  void confirm_claims() override {}
  void undo_claims() override;
  void release_claims(Destination dest, ReleaseOrder order, Span releases) override;
  void release_group(GroupQueue queue, Destination dest, ReleaseOrder order) override;
  void clear() override;
  void resize(int64_t size) override;
  PagePool snapshot() override { return *this; }
  void restore(const PagePool& state) override;

  int64_t page_size() const { return geometry_.size; }
  // One past the largest token index this pool hands out.
  int64_t index_end() const { return (num_pages_ + 1) * geometry_.size; }

  // Building blocks for the hybrid store; the checks inline, their failures out of line.
  int64_t page_of(const char* arg, int64_t index) const {  // checks the range
    if (!slot_in_pool(index, geometry_, num_pages_)) refuse_slot(arg, index);
    return geometry_.page(index);
  }
  // This pool's page states: the list's (its pages are parents), or the small side's own
  // (child pages; the list's states are then its parents').
  PageState state(int64_t page) const { return states()[page]; }
  const PageState* states() const { return child_state_.empty() ? list_->state.data() : child_state_.data(); }
  PageState* states() { return child_state_.empty() ? list_->state.data() : child_state_.data(); }
  const PageKind& kind() const { return kind_; }
  // Whether this pool holds page (as its kind).
  bool holds(int64_t page) const { return states()[page] == kind_.held; }
  int64_t page_at(int64_t k) const {  // k-th parent of the free list
    int64_t pos = list_->head + k;
    return list_->ring[pos >= num_parents_ ? pos - num_parents_ : pos];
  }
  // The free list from its head, in hand-out order, as a loop reads it with locals.
  struct HeadPages {
    const int64_t* ring;
    int64_t at, num_pages;
    int64_t next() {
      const int64_t page = ring[at];
      if (++at == num_pages) at = 0;
      return page;
    }
  };
  // skip: parents another side binds first (the shared mode's full side of a call); n: the
  // pages to be read (the small side lists them first: its partly used parents' free
  // pages, then the child pages of the parents it binds).
  HeadPages head_pages(int64_t skip = 0, int64_t n = 0) const {
    if (pages_per_parent_ > 1) return HeadPages{next_pages(skip, n), 0, n};
    const int64_t at = list_->head + skip;
    return HeadPages{list_->ring.data(), at >= num_parents_ ? at - num_parents_ : at, num_parents_};
  }
  // The parents this side binds to take `pages` pages (plan.h's parents_for).
  int64_t parents_for(int64_t pages) const {
    return static_cast<int64_t>(swa::parents_for(pages, pages_per_parent_, free_children_));
  }
  // The end of the run of slots in page `page` that starts at indices[i].
  int64_t run_end(Span indices, int64_t i, int64_t page) const;
  // Checks that each request's last_loc ends its prefix in a page of this pool.
  void check_last_loc(const BatchLengths& batch, const LastLoc& last_loc) const;
  // Writes the slots of the batch, new pages taken from the head of the free list in
  // batch order; prefix_end(j) is where request j's prefix ends. Takes nothing.
  template <class PrefixEnd>
  void write_slots(const BatchLengths& batch, int64_t num_tokens, const PrefixEnd& prefix_end, int64_t* out) const;
  // The next n pages become held: on the small side the free pages of its partly used
  // parents, then the child pages of parents bound from the head of the list.
  void take(int64_t n);
  // Marks page as claimed by this call; repeat_ok: it may already be (free() frees
  // pages, so several slots of one page are one free).
  void claim(const char* arg, int64_t page, bool repeat_ok) {
    PageState& s = states()[page];
    if (s == kind_.held) {
      s = kind_.claimed;
      claimed_.push_back(page);
    } else if (!repeats_a_claim(s, repeat_ok, kind_)) {
      refuse_claim(arg, page);
    }
  }
  // A loop's claims of pages of their own (a repeat is a double free) on this pool,
  // with the pool's arrays in locals: a page-state store (a byte) may alias any member,
  // which the loop would otherwise read again at every claim.
  class Claimer {
   public:
    Claimer(PagePool& pool, int64_t n) : pool_(pool), state_(pool.states()), geometry_(pool.geometry_),
                                         num_pages_(pool.num_pages_), kind_(pool.kind_) {
      pool.claimed_.reserve(pool.claimed_.size() + static_cast<size_t>(n));
    }
    // Claims the page of slot; false, with nothing changed, where claim(arg,
    // page_of(arg, slot), false) would throw.
    bool claim_slot(int64_t slot) {
      const int64_t page = held_page(slot, geometry_, num_pages_, state_, kind_.held);
      if (page < 0) return false;
      state_[page] = kind_.claimed;
      pool_.claimed_.push_back(page);
      return true;
    }
    // Throws what claim_slot(slot) found.
    [[noreturn]] void refuse(const char* arg, int64_t slot) const {
      if (!slot_in_pool(slot, geometry_, num_pages_)) pool_.refuse_slot(arg, slot);
      pool_.refuse_claim(arg, geometry_.page(slot));
    }

   private:
    PagePool& pool_;
    PageState* const state_;
    const PageGeometry geometry_;
    const int64_t num_pages_;
    const PageKind kind_;
  };
  // claim(arg, page_of(arg, slot), false) for the n slots slot_at(0 .. n-1).
  template <class SlotAt>
  void claim_pages_of(const char* arg, int64_t n, const SlotAt& slot_at) {
    Claimer claimer(*this, n);
    for (int64_t k = 0; k < n; ++k) {
      const int64_t slot = slot_at(k);
      if (!claimer.claim_slot(slot)) claimer.refuse(arg, slot);
    }
  }
  // Places pages at a destination in the order given, their states and the list
  // together: the free list (appended, or prepended as one block of the n pages), the
  // staging list or a free group's queue. Nothing is visible until commit(); without it
  // every placed page is held again when the Releaser goes. The pool's arrays are in
  // locals, as in Claimer.
  class Releaser {
   public:
    // n: the pages to be placed. before, after: in the free list, the shared mode's
    // other side places that many pages before and after these, as one block. parents:
    // the small side's parents whose last child page came back (their child pages were
    // released already), not pages it holds.
    Releaser(PagePool& pool, int64_t n, Destination dest, int64_t before = 0, int64_t after = 0,
             bool parents = false);
    Releaser(const Releaser&) = delete;
    Releaser& operator=(const Releaser&) = delete;
    ~Releaser() {
      if (!committed_) undo();
    }
    // Whether the n pages can be placed at all: the free list takes at most as many
    // pages as are not in it (more than that cannot all be held).
    bool fits() const { return fits_; }
    // Places the page of slot, which must be held: the claim and the release of a free
    // in one step. False, with nothing changed, where a claim of it (a repeat being a
    // double free) would throw.
    bool release_slot(int64_t slot) {
      const int64_t page = held_page(slot, geometry_, num_pages_, state_, held_);
      if (page < 0) return false;
      place(page);
      return true;
    }
    // Places a page this call claimed.
    void place(int64_t page) {
      state_[page] = placed_state_;
      *next_ = page;
      if (++next_ == ring_end_) next_ = ring_;
      ++count_;
    }
    void commit();

   private:
    void undo();
    std::vector<int64_t>* list();  // the list dest appends to; nullptr for the free list
    PagePool& pool_;
    const Destination dest_;
    PageState* const state_;
    const PageGeometry geometry_;
    const int64_t num_pages_;
    const PageState held_;
    PageState placed_state_ = PageState::kFree;
    int64_t* ring_ = nullptr;      // the storage placed into: the ring, or the list's new tail
    int64_t* ring_end_ = nullptr;  // where the ring wraps (nullptr for a list)
    int64_t* first_ = nullptr;     // where the first page goes
    int64_t block_start_ = 0;      // where a prepended block starts: the free list's new head
    int64_t* next_ = nullptr;
    int64_t count_ = 0;
    size_t list_size_ = 0;  // the list's size before
    bool fits_ = true, committed_ = false, parents_ = false;
  };
  std::vector<int64_t>& claimed() { return claimed_; }
  // Puts back the claims after the first `mark` of the call's claims.
  void undo_claims_after(size_t mark);

  // The snapshot's contents.
  std::vector<int64_t> free_list() const;  // in hand-out order
  std::vector<int64_t> partly_used_parents() const;  // the small side's, the one taken from first in front
  const std::vector<int64_t>& staged_list() const { return list_->staged; }
  const std::vector<int64_t>& group_index_pages() const { return group_index_pages_; }
  const std::vector<int64_t>& group_page_ids() const { return group_page_ids_; }
  std::string debug_string() const;
  // Throws std::logic_error naming the first broken invariant; other_side: the shared
  // mode's other side, whose queues and held pages are checked with this pool's. A side
  // of the shared mode checked alone leaves the pages out of the one list unchecked.
  void check_invariants(const PagePool* other_side = nullptr) const;
  bool operator==(const PagePool& other) const;

 private:
  [[noreturn]] void refuse_slot(const char* arg, int64_t index) const;
  [[noreturn]] void refuse_claim(const char* arg, int64_t page) const;
  // Calls visit(first, last) on the free list's first n entries as at most two
  // contiguous ranges of the ring.
  template <class Visit>
  void head_ranges(int64_t n, const Visit& visit) const {
    const int64_t* const ring = list_->ring.data();
    const int64_t head = list_->head;
    const int64_t first = n < num_parents_ - head ? n : num_parents_ - head;
    visit(ring + head, ring + head + first);
    if (first < n) visit(ring, ring + (n - first));
  }
  void reset_state();
  // The small side's child pages: the first n it hands out, its partly used parents' free
  // pages and then the child pages of the parents from skip on in the list (scratch
  // storage, valid until the next call).
  const int64_t* next_pages(int64_t skip, int64_t n) const;
  // Takes the first n of next_pages(0, n); returns the parents it binds from the list.
  int64_t take_children(int64_t n);
  // Child pages back to their parents (their states free); the parents whose last child
  // came back, in that order, into `whole`.
  void return_children(const std::vector<int64_t>& pages, std::vector<int64_t>& whole);
  void link_partial(int64_t parent);  // to the front of the partly used parents
  void unlink_partial(int64_t parent);
  void check_children() const;  // check_invariants of the small side's parents
  // Pages to dest, in the order given or sorted.
  void place_released(std::vector<int64_t>& pages, Destination dest, ReleaseOrder order);
  std::vector<int64_t> queued_by_index() const;
  // held_pages() from the page states and the queues (a snapshot's, or the check of the count).
  int64_t count_held() const;

  int64_t size_, num_pages_;
  int64_t num_parents_;  // the list's entries: num_pages_ but on the small side
  int64_t capacity_;
  PageGeometry geometry_;
  bool need_sort_;
  PageKind kind_;
  PageListRef list_;
  bool shares_list_ = false;  // a side of the shared mode
  int64_t held_count_ = 0;    // held_pages(), kept as pages are taken and released
  bool group_open_ = false;
  std::vector<int64_t> group_index_pages_;  // pages of free() calls held by the group
  std::vector<int64_t> group_page_ids_;     // pages of free_page_ids calls held by the group
  std::vector<int64_t> claimed_;            // the current call's claims, in first-seen order
  // The shared mode's small side (pages_per_parent_ = parent_k; 1 elsewhere, where the
  // rest stays empty): its child pages' states; each parent's free child pages while bound
  // to it; its partly used parents (bound, with a free child) as a list linked through
  // partial_next_ / partial_prev_ from partial_head_ (0 ends it: parent 0 is never bound);
  // their free child pages in all.
  int64_t pages_per_parent_ = 1;
  std::vector<PageState> child_state_;
  std::vector<int64_t> free_in_parent_, partial_next_, partial_prev_;
  int64_t partial_head_ = 0, free_children_ = 0;
  mutable std::vector<int64_t> next_pages_;  // next_pages()' scratch
};

template <class PrefixEnd>
void PagePool::write_slots(const BatchLengths& batch, int64_t num_tokens, const PrefixEnd& prefix_end,
                           int64_t* out) const {
  if (token_mode()) {  // extend_slot at page size 1: every token takes the next free page, in order
    if (pages_per_parent_ > 1) {
      std::copy_n(next_pages(0, num_tokens), num_tokens, out);
      return;
    }
    head_ranges(num_tokens, [&out](const int64_t* first, const int64_t* last) { out = std::copy(first, last, out); });
    return;
  }
  // Locals, and out marked as aliasing nothing: else every store into it makes the
  // loop read the pool's members and the lengths again.
  int64_t* __restrict dst = out;
  // The small side reads its pages from next_pages(), which never wraps.
  const HeadPages pages = head_pages(0, pages_per_parent_ > 1 ? geometry_.page(num_tokens) + batch.size() : 0);
  const int64_t* const ring = pages.ring;
  const int64_t num_pages = pages.num_pages;
  int64_t first = pages.at;  // the ring position of the request's first new page
  for (int64_t j = 0; j < batch.size(); ++j) {
    const int64_t prefix = batch.prefix(j), seq = batch.seq_lens[j];
    const int64_t last = prefix_end(j);
    const auto page_at_offset = [ring, num_pages, first](int64_t k) {
      const int64_t at = first + k;
      return ring[at >= num_pages ? at - num_pages : at];
    };
    for (int64_t t = 0; t < seq - prefix; ++t) *dst++ = extend_slot(t, prefix, seq, last, geometry_, page_at_offset);
    first += new_page_count(prefix, seq, geometry_);
  }
}

// A hybrid allocator's whole state: what backup_state() returns and restore_state() takes.
struct AllocatorState {
  PagePool full, swa;
  std::vector<int64_t> mapping;
  bool operator==(const AllocatorState& o) const { return full == o.full && swa == o.swa && mapping == o.mapping; }
};

}  // namespace swa
