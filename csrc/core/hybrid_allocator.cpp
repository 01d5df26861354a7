#include "hybrid_allocator.h"

#include <algorithm>
#include <sstream>

namespace swa {

HybridAllocator::HybridAllocator(int64_t size, int64_t size_swa, int64_t page_size, bool need_sort,
                                 int64_t* mapping)
    : page_size_(page_size),
      full_(std::make_shared<PagePool>(size, page_size, need_sort)),
      swa_(std::make_shared<PagePool>(size_swa, page_size, need_sort)),
      mapping_(mapping),
      mapping_len_(mapping_size(size, page_size)) {
  reset_mapping();
}

void HybridAllocator::reset_mapping() {
  std::fill(mapping_, mapping_ + mapping_len_ - 1, 0);
  mapping_[mapping_len_ - 1] = -1;  // last_loc == -1 translates to -1
}

int64_t HybridAllocator::available_size() const {
  return std::min(full_->available_size(), swa_->available_size());
}

bool HybridAllocator::new_pages_available(int64_t num_full_pages, int64_t num_swa_pages) const {
  return num_full_pages <= full_->available_pages() && num_swa_pages <= swa_->available_pages();
}

void HybridAllocator::write_mapping(const int64_t* full_slots, const int64_t* swa_slots, int64_t n) {
  for (int64_t i = 0; i < n; ++i) mapping_[full_slots[i]] = swa_slots[i];
}

void HybridAllocator::check_swa_continuation(const Batch& batch) const {
  const PageGeometry& page = full_->geometry();
  const auto swa_state = [this](int64_t p) { return swa_->state(p); };
  for (int64_t j = 0; j < batch.size(); ++j) {
    const int64_t prefix = batch.prefix(j);
    if (!continues_partial_page(prefix, batch.seq_lens[j], page)) continue;
    const int64_t last = batch.last_loc[j], swa_last = mapping_[last];
    if (!swa_continuation_ok(last, swa_last, page, swa_->num_pages(), swa_state))
      throw ArgumentError(swa_continuation_message(j, last, swa_last));
  }
}

std::string untranslatable_message(int64_t entry, int64_t slot, int64_t mapping_len) {
  std::ostringstream m;
  m << "kv_indices: entry " << entry << " (" << slot << ") is outside [-1, " << mapping_len - 1 << ")";
  return m.str();
}

std::string swa_continuation_message(int64_t entry, int64_t last_loc, int64_t swa_last) {
  std::ostringstream m;
  m << "last_loc: entry " << entry << " (" << last_loc << ")";
  if (swa_last <= 0) m << " has no SWA slot to continue its partial page (evicted?)";
  else m << " maps to SWA slot " << swa_last << ", which is not a live slot at the same page offset";
  return m.str();
}

void HybridAllocator::write_batch(const Batch& batch, int64_t num_slots, int64_t need_pages, OutBuffer& out) {
  int64_t* full_slots = out.get(num_slots);
  swa_slots_.resize(static_cast<size_t>(num_slots));
  full_->write_slots(batch, [&](int64_t j) { return batch.last_loc[j]; }, full_slots);
  swa_->write_slots(batch, [&](int64_t j) { return swa_last_loc(batch.last_loc[j]); }, swa_slots_.data());
  write_mapping(full_slots, swa_slots_.data(), num_slots);
  full_->take(need_pages);
  swa_->take(need_pages);
}

bool HybridAllocator::alloc(int64_t need_size, OutBuffer& out) {
  if (need_size < 0) fail("need_size", "is negative (", need_size, ")");
  if (need_size % page_size_ != 0) fail("need_size", need_size, " is not a multiple of the page size ", page_size_);
  const int64_t need_pages = need_size / page_size_;
  if (!new_pages_available(need_pages, need_pages)) return false;
  full_->merge_before_alloc(need_pages);
  swa_->merge_before_alloc(need_pages);
  const int64_t zero = 0, minus_one = -1;
  write_batch(Batch{Span(&zero, 1), Span(&need_size, 1), Span(&minus_one, 1), false}, need_size, need_pages, out);
  return true;
}

bool HybridAllocator::alloc_extend(const Batch& batch, int64_t extend_num_tokens, OutBuffer& out) {
  const int64_t need = full_->check_batch(batch, extend_num_tokens);
  check_swa_continuation(batch);
  if (!new_pages_available(need, need)) return false;
  full_->merge_before_extend(need, extend_num_tokens, batch.size());
  swa_->merge_before_extend(need, extend_num_tokens, batch.size());
  write_batch(batch, extend_num_tokens, need, out);
  return true;
}

bool HybridAllocator::alloc_extend_swa_tail(const Batch& batch, int64_t extend_num_tokens, int64_t swa_tail_len,
                                            OutBuffer& out) {
  if (batch.size() != 1) fail("seq_lens", "alloc_extend_swa_tail takes one request, got ", batch.size());
  const int64_t need_full = full_->check_batch(batch, extend_num_tokens);
  if (swa_tail_len < 0 || swa_tail_len > extend_num_tokens)
    fail("swa_tail_len", swa_tail_len, " is outside [0, extend_num_tokens = ", extend_num_tokens, "]");
  const int64_t need_swa = cdiv(swa_tail_len, page_size_);
  if (!new_pages_available(need_full, need_swa)) return false;
  full_->merge_before_extend(need_full, extend_num_tokens, 1);
  int64_t* full_slots = out.get(extend_num_tokens);
  full_->write_slots(batch, [&](int64_t j) { return batch.last_loc[j]; }, full_slots);
  full_->take(need_full);
  // The tail gets fresh SWA pages of its own; the head has no SWA KV.
  const int64_t head_len = extend_num_tokens - swa_tail_len;
  for (int64_t i = 0; i < head_len; ++i) mapping_[full_slots[i]] = 0;
  if (swa_tail_len == 0) return true;
  const int64_t zero = 0, minus_one = -1;
  const Batch tail{Span(&zero, 1), Span(&swa_tail_len, 1), Span(&minus_one, 1), false};
  swa_->merge_before_extend(need_swa, swa_tail_len, 1);
  swa_slots_.resize(static_cast<size_t>(swa_tail_len));
  swa_->write_slots(tail, [](int64_t) { return int64_t{-1}; }, swa_slots_.data());
  write_mapping(full_slots + head_len, swa_slots_.data(), swa_tail_len);
  swa_->take(need_swa);
  return true;
}

bool HybridAllocator::alloc_decode(const Batch& batch, OutBuffer& out) {
  const int64_t need = full_->check_batch(batch, -1);
  check_swa_continuation(batch);
  // Atomic: both pools are checked before either is touched.
  if (!new_pages_available(need, need)) return false;
  full_->merge_before_alloc(batch.size());
  swa_->merge_before_alloc(batch.size());
  write_batch(batch, batch.size(), need, out);
  return true;
}

void HybridAllocator::translate(Span indices, int64_t* out) const {
  for (int64_t i = 0; i < indices.size; ++i) {
    const int64_t idx = indices[i];
    if (!translatable(idx, mapping_len_)) throw ArgumentError(untranslatable_message(i, idx, mapping_len_));
    out[i] = idx < 0 ? mapping_[mapping_len_ - 1] : mapping_[idx];
  }
}

void HybridAllocator::set_mapping(Span full_indices, Span swa_indices) {
  if (full_indices.size != swa_indices.size)
    fail("swa_indices", "has ", swa_indices.size, " entries for ", full_indices.size, " full indices");
  for (int64_t i = 0; i < full_indices.size; ++i) {
    full_->page_of("full_indices", full_indices[i]);
    if (swa_indices[i] != 0) swa_->page_of("swa_indices", swa_indices[i]);
  }
  write_mapping(full_indices.data, swa_indices.data, full_indices.size);
}

void HybridAllocator::clear_mapping(Span full_indices) {
  for (int64_t i = 0; i < full_indices.size; ++i) full_->page_of("full_indices", full_indices[i]);
  for (int64_t i = 0; i < full_indices.size; ++i) mapping_[full_indices[i]] = 0;
}

void HybridAllocator::claim_swa_of_pages(PageClaim& claim, Span indices, std::vector<int64_t>& full_pages) const {
  int64_t previous = -1;
  for (int64_t i = 0; i < indices.size; ++i) {
    const int64_t page = full_->page_of("indices", indices[i]);
    if (page == previous) continue;  // runs of one page are common; their slots are read once
    previous = page;
    full_pages.push_back(page);
    for (int64_t slot = page * page_size_; slot < (page + 1) * page_size_; ++slot) {
      const int64_t swa_slot = mapping_[slot];
      if (swa_slot > 0) claim.add("indices", swa_->page_of("indices", swa_slot), true);
    }
  }
}

void HybridAllocator::claim_swa_of_free(PageClaim& claim, Span indices, std::vector<int64_t>& full_pages) const {
  if (page_size_ > 1) return claim_swa_of_pages(claim, indices, full_pages);
  claim_swa_of_segment(claim, indices, 0, full_pages);  // page size 1: one slot is one page
}

void HybridAllocator::claim_swa_of_segment(PageClaim& claim, Span indices, int64_t start_pos,
                                           std::vector<int64_t>& full_pages) const {
  full_->check_segment_start(start_pos);
  const auto rep_at = [&](int64_t i) { return indices[i * page_size_]; };
  claim_swa_of_reps(claim, "indices", full_->geometry().pages_for(indices.size), rep_at, full_pages);
}

void HybridAllocator::clear_mapping_of_pages(const std::vector<int64_t>& full_pages) {
  for (int64_t page : full_pages) std::fill(mapping_ + page * page_size_, mapping_ + (page + 1) * page_size_, 0);
}

void HybridAllocator::finish_swa_free(PageClaim& claim, const std::vector<int64_t>& full_pages) {
  clear_mapping_of_pages(full_pages);
  swa_->finish(claim);
}

void HybridAllocator::free_swa(Span indices) {
  PageClaim swa_claim(*swa_, true);
  std::vector<int64_t> full_pages;
  claim_swa_of_free(swa_claim, indices, full_pages);
  finish_swa_free(swa_claim, full_pages);
}

void HybridAllocator::free_swa_segment(Span indices, int64_t start_pos) {
  PageClaim swa_claim(*swa_, false);
  std::vector<int64_t> full_pages;
  claim_swa_of_segment(swa_claim, indices, start_pos, full_pages);
  finish_swa_free(swa_claim, full_pages);
}

void HybridAllocator::free_full(Span indices) { full_->free(indices); }

void HybridAllocator::free_full_segment(Span indices, int64_t start_pos) { full_->free_segment(indices, start_pos); }

// free and free_segment claim both halves before either is changed.
void HybridAllocator::free(Span indices) {
  PageClaim full_claim(*full_, true);
  full_->claim_indices(full_claim, "indices", indices);
  PageClaim swa_claim(*swa_, true);
  std::vector<int64_t> full_pages;
  claim_swa_of_free(swa_claim, indices, full_pages);
  finish_swa_free(swa_claim, full_pages);
  full_->finish(full_claim);
}

void HybridAllocator::free_segment(Span indices, int64_t start_pos) {
  PageClaim full_claim(*full_, false);
  full_->claim_segment(full_claim, "indices", indices, start_pos);
  PageClaim swa_claim(*swa_, false);
  std::vector<int64_t> full_pages;
  claim_swa_of_segment(swa_claim, indices, start_pos, full_pages);
  finish_swa_free(swa_claim, full_pages);
  full_->finish(full_claim);
}

void HybridAllocator::free_group_begin() {
  if (full_->in_free_group() || swa_->in_free_group())
    fail("free_group_begin", "a free group is already open (groups do not nest)");
  full_->free_group_begin();
  swa_->free_group_begin();  // holds the SWA-side frees until the group ends
}

void HybridAllocator::free_group_end() {
  if (!full_->in_free_group() || !swa_->in_free_group()) fail("free_group_end", "no free group is open");
  // SWA first: the page ids held from free_swa_segment, then the slots from free_swa.
  swa_->free_group_end(PagePool::GroupOrder::kPageIdsFirst);
  full_->free_group_end(PagePool::GroupOrder::kIndicesFirst);
}

void HybridAllocator::clear() {
  full_->clear();
  swa_->clear();
  reset_mapping();
}

std::string HybridAllocator::debug_string() const {
  std::ostringstream s;
  s << "full: " << full_->debug_string() << "\nswa: " << swa_->debug_string();
  return s.str();
}

void HybridAllocator::check_invariants() const { check_invariants(*full_, *swa_, mapping_, mapping_len_); }

void HybridAllocator::check_invariants(const PagePool& full, const PagePool& swa, const int64_t* mapping,
                                       int64_t mapping_len) {
  full.check_invariants();
  swa.check_invariants();
  if (mapping[mapping_len - 1] != -1) throw std::logic_error("mapping invariant broken: the -1 sentinel changed");
  for (int64_t slot = 0; slot < mapping_len - 1; ++slot) {
    const int64_t swa_slot = mapping[slot];
    if (swa_slot == 0) continue;
    if (!slot_in_pool(swa_slot, swa.geometry(), swa.num_pages()) ||
        swa.state(swa.geometry().page(swa_slot)) != PageState::kHeld)
      throw std::logic_error("mapping invariant broken: full slot " + std::to_string(slot) + " maps to SWA slot " +
                             std::to_string(swa_slot) + ", which is not held");
  }
}

void plan_window_eviction(int64_t num_rows, int64_t row_len, Span rows, Span pre_lens, Span evicted_seqlens,
                          int64_t window, int64_t interval, bool prefix_sharing, int64_t page_size,
                          int64_t* new_evicted) {
  const int64_t bs = rows.size;
  if (pre_lens.size != bs) fail("pre_lens", "has ", pre_lens.size, " entries for ", bs, " rows");
  if (evicted_seqlens.size != bs) fail("evicted_seqlens", "has ", evicted_seqlens.size, " entries for ", bs, " rows");
  if (window < 1) fail("window", "must be >= 1, got ", window);
  if (interval < 1) fail("interval", "must be >= 1, got ", interval);
  for (int64_t j = 0; j < bs; ++j) {
    const int64_t row = rows[j], pre_len = pre_lens[j], evicted = evicted_seqlens[j];
    if (row < 0 || row >= num_rows) fail("rows", "entry ", j, " (", row, ") is outside [0, ", num_rows, ")");
    if (pre_len < 0 || pre_len > row_len) fail("pre_lens", "entry ", j, " (", pre_len, ") is outside [0, ", row_len, "]");
    if (evicted < 0 || evicted > pre_len || evicted % page_size != 0)
      fail("evicted_seqlens", "entry ", j, " (", evicted, ") must be page-aligned and within [0, pre_len]");
    new_evicted[j] = evicted_after_step(evicted, pre_len, window, page_size, interval, prefix_sharing);
  }
}

void HybridAllocator::resize(int64_t size, int64_t size_swa) {
  check_resize("size", size, page_size_, full_->capacity());
  check_resize("size_swa", size_swa, page_size_, swa_->capacity());
  full_->resize(size, "size");
  swa_->resize(size_swa, "size_swa");
  reset_mapping();
}

HybridAllocator::State HybridAllocator::backup_state() const {
  return State{*full_, *swa_, std::vector<int64_t>(mapping_, mapping_ + mapping_len_)};
}

void HybridAllocator::restore_state(const State& state) {
  if (static_cast<int64_t>(state.mapping.size()) != mapping_len_ || state.full.size() != full_->size() ||
      state.swa.size() != swa_->size() || state.full.page_size() != page_size_)
    fail("state", "was taken from an allocator of another shape");
  *full_ = state.full;  // in place: the pool objects handed out stay valid
  *swa_ = state.swa;
  std::copy(state.mapping.begin(), state.mapping.end(), mapping_);
}

}  // namespace swa
