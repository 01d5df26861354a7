#include "hybrid_allocator.h"

#include <algorithm>
#include <sstream>

namespace swa {

HybridAllocator::HybridAllocator(int64_t size, int64_t size_swa, int64_t page_size, bool need_sort,
                                 int64_t* mapping)
    : page_size_((check_hybrid_shape(size, size_swa, page_size), page_size)),
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
  return hybrid_available_size(full_->available_size(), swa_->available_size());
}

bool HybridAllocator::new_pages_available(int64_t num_full_pages, int64_t num_swa_pages) const {
  return swa::new_pages_available(num_full_pages, num_swa_pages, full_->available_pages(), swa_->available_pages());
}

void HybridAllocator::write_mapping(const int64_t* full_slots, const int64_t* swa_slots, int64_t n) {
  for (int64_t i = 0; i < n; ++i) mapping_[full_slots[i]] = swa_slots[i];
}

void HybridAllocator::check_swa_continuation(const BatchLengths& batch, const LastLoc& last_loc) const {
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

void HybridAllocator::write_batch(const AllocPlan& plan, const BatchLengths& batch, const int64_t* last_loc,
                                  OutBuffer& out) {
  int64_t* full_slots = out.get(plan.num_tokens);
  swa_slots_.resize(static_cast<size_t>(plan.num_tokens));
  const auto full_end = [last_loc](int64_t j) { return last_loc != nullptr ? last_loc[j] : int64_t{-1}; };
  full_->write_slots(batch, full_end, full_slots);
  swa_->write_slots(batch, [&](int64_t j) { return swa_last_loc(full_end(j)); }, swa_slots_.data());
  write_mapping(full_slots, swa_slots_.data(), plan.num_tokens);
  full_->take(plan.full_pages);
  swa_->take(plan.swa_pages);
}

bool HybridAllocator::merge_unless_refused(const AllocPlan& plan) {
  if (hybrid_refused(plan, full_->available_pages(), swa_->available_pages())) return false;
  full_->merge_if_due(plan, PoolRole::kFull);
  swa_->merge_if_due(plan, PoolRole::kSwa);
  return true;
}

bool HybridAllocator::alloc(int64_t need_size, OutBuffer& out) {
  const AllocPlan plan = plan_alloc(need_size, full_->geometry());
  if (!merge_unless_refused(plan)) return false;
  const int64_t zero = 0;
  write_batch(plan, BatchLengths{Span(&zero, 1), Span(&need_size, 1), false}, nullptr, out);
  return true;
}

bool HybridAllocator::alloc_extend(const BatchLengths& batch, const LastLoc& last_loc, int64_t extend_num_tokens,
                                   OutBuffer& out) {
  return allocate(plan_extend(batch, last_loc, extend_num_tokens, full_->geometry()), batch, last_loc, out);
}

bool HybridAllocator::alloc_decode(const BatchLengths& batch, const LastLoc& last_loc, OutBuffer& out) {
  return allocate(plan_decode(batch, last_loc, full_->geometry()), batch, last_loc, out);
}

bool HybridAllocator::allocate(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc,
                               OutBuffer& out) {
  full_->check_last_loc(batch, last_loc);
  check_swa_continuation(batch, last_loc);
  if (!merge_unless_refused(plan)) return false;  // atomic: both pools are checked before either is touched
  write_batch(plan, batch, last_loc.data, out);
  return true;
}

bool HybridAllocator::alloc_extend_swa_tail(const BatchLengths& batch, const LastLoc& last_loc,
                                            int64_t extend_num_tokens, int64_t swa_tail_len, OutBuffer& out) {
  const AllocPlan plan = plan_extend_swa_tail(batch, last_loc, extend_num_tokens, swa_tail_len, full_->geometry());
  full_->check_last_loc(batch, last_loc);
  if (!merge_unless_refused(plan)) return false;
  int64_t* full_slots = out.get(plan.num_tokens);
  full_->write_slots(batch, [&](int64_t j) { return last_loc.data[j]; }, full_slots);
  full_->take(plan.full_pages);
  const int64_t head_len = plan.swa_head_len();
  for (int64_t i = 0; i < head_len; ++i) mapping_[full_slots[i]] = 0;
  const int64_t zero = 0;
  const BatchLengths tail{Span(&zero, 1), Span(&plan.swa_tokens, 1), false};
  swa_slots_.resize(static_cast<size_t>(plan.swa_tokens));
  swa_->write_slots(tail, [](int64_t) { return int64_t{-1}; }, swa_slots_.data());
  write_mapping(full_slots + head_len, swa_slots_.data(), plan.swa_tokens);
  swa_->take(plan.swa_pages);
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
  if (swa_free_by_segment(page_size_)) return claim_swa_of_segment(claim, indices, 0, full_pages);
  claim_swa_of_pages(claim, indices, full_pages);
}

void HybridAllocator::claim_swa_of_segment(PageClaim& claim, Span indices, int64_t start_pos,
                                           std::vector<int64_t>& full_pages) const {
  check_segment_start(start_pos, full_->geometry());
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
  check_group_begin(full_->in_free_group() || swa_->in_free_group());
  full_->free_group_begin();
  swa_->free_group_begin();  // holds the SWA-side frees until the group ends
}

void HybridAllocator::free_group_end() {
  check_group_end(full_->in_free_group() && swa_->in_free_group());
  swa_->free_group_end(kSwaGroupOrder);
  full_->free_group_end(kPoolGroupOrder);
}

void HybridAllocator::clear() {
  full_->clear();
  swa_->clear();
  reset_mapping();
}

std::string HybridAllocator::debug_string() const { return debug_string(*full_, *swa_); }

std::string HybridAllocator::debug_string(const PagePool& full, const PagePool& swa) {
  return "full: " + full.debug_string() + "\nswa: " + swa.debug_string();
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
  check_hybrid_resize(size, size_swa, page_size_, full_->capacity(), swa_->capacity());
  full_->resize(size, "size");
  swa_->resize(size_swa, "size_swa");
  reset_mapping();
}

HybridAllocator::State HybridAllocator::backup_state() const {
  return State{*full_, *swa_, std::vector<int64_t>(mapping_, mapping_ + mapping_len_)};
}

void HybridAllocator::restore_state(const State& state) {
  check_state_shape("an allocator", state.fits(full_->size(), swa_->size(), page_size_, mapping_len_));
  *full_ = state.full;  // in place: the pool objects handed out stay valid
  *swa_ = state.swa;
  std::copy(state.mapping.begin(), state.mapping.end(), mapping_);
}

}  // namespace swa
