#include "plan.h"

namespace swa {

namespace {

// More tokens than any pool can hold, and few enough that the page arithmetic on a
// length or a pool size (rounding up to a page, the mapping's size) cannot overflow.
constexpr int64_t kMaxLength = int64_t{1} << 62;

// Checks a batch's lengths and the size of its last_loc; returns its new pages.
AllocPlan plan_batch(AllocCall call, const BatchLengths& batch, const LastLoc& last_loc, int64_t extend_num_tokens,
                     const PageGeometry& page) {
  const int64_t bs = batch.size();
  if (batch.decode)
    check_batch_lengths({{"seq_lens", bs}, {"last_loc", last_loc.size}});
  else
    check_batch_lengths({{"prefix_lens", batch.prefix_lens.size}, {"seq_lens", bs}, {"last_loc", last_loc.size}});
  int64_t tokens = 0, pages = 0;
  for (int64_t j = 0; j < bs; ++j) {
    const int64_t seq = batch.seq_lens[j], prefix = batch.prefix(j);
    if (batch.decode && seq < 1) fail("seq_lens", "entry ", j, " is ", seq, "; a decode step needs >= 1");
    if (prefix < 0) fail("prefix_lens", "entry ", j, " is negative (", prefix, ")");
    if (seq < prefix) fail("seq_lens", "entry ", j, " (", seq, ") is below its prefix length ", prefix);
    if (seq > kMaxLength) fail("seq_lens", "entry ", j, " (", seq, ") is above ", kMaxLength, " tokens");
    // A sum that wrapped could pass the extend_num_tokens check and size the output
    // below what the lengths write.
    if (__builtin_add_overflow(tokens, seq - prefix, &tokens) ||
        __builtin_add_overflow(pages, new_page_count(prefix, seq, page), &pages))
      fail("seq_lens", "the batch's lengths sum past the int64 range");
  }
  if (!batch.decode && tokens != extend_num_tokens)
    fail("extend_num_tokens", "is ", extend_num_tokens, " but seq_lens - prefix_lens sums to ", tokens);
  return AllocPlan{call, bs, tokens, pages, pages, tokens};
}

// The shared mode's small side has parent_k times the other side's slots (its pages are
// parent_k to a parent): equal sizes at parent_k 1.
void check_shared_list_sizes(int64_t size, int64_t size_swa, bool shares_list, const ParentLayout& parents) {
  if (!shares_list) return;
  const bool small_full = parents.small_side == Side::kFull;
  const int64_t large = small_full ? size_swa : size, small = small_full ? size : size_swa;
  if (static_cast<Wide>(large) * parents.k == small) return;
  const char* large_name = small_full ? "size_swa" : "size";
  if (parents.k == 1)
    fail(small_full ? "size" : "size_swa", "must equal ", large_name, " (", large,
         ") in the shared mode, whose one list serves both kinds, got ", small);
  fail(small_full ? "size" : "size_swa", "must be parent_k (", parents.k, ") times ", large_name, " (", large,
       ") in the shared mode: a parent page holds parent_k of its pages, got ", small);
}

}  // namespace

void check_pool_shape(const char* size_arg, int64_t size, int64_t page_size) {
  check_at_least_one("page_size", page_size);
  if (size < page_size) fail(size_arg, "must hold at least one page of ", page_size, " tokens, got ", size);
  if (size > kMaxLength) fail(size_arg, "is above ", kMaxLength, " tokens, got ", size);
}

ParentLayout check_parent_layout(int64_t parent_k, const std::string& small_side, bool shares_list) {
  if (parent_k < 1 || parent_k > kMaxParentK) fail("parent_k", "must be in [1, ", kMaxParentK, "], got ", parent_k);
  if (parent_k > 1 && !shares_list) fail("parent_k", "above 1 needs the shared mode (shared=True), got ", parent_k);
  if (small_side != "full" && small_side != "swa")
    fail("small_side", "must be 'full' or 'swa' (the side whose KV entry is smaller), got '", small_side, "'");
  return ParentLayout{parent_k, small_side == "full" ? Side::kFull : Side::kSwa};
}

void check_hybrid_shape(int64_t size, int64_t size_swa, int64_t page_size, bool shares_list,
                        const ParentLayout& parents) {
  check_pool_shape("size_swa", size_swa, page_size);
  check_pool_shape("size", size, page_size);
  check_shared_list_sizes(size, size_swa, shares_list, parents);
}

void check_resize(const char* arg, int64_t size, int64_t page_size, int64_t capacity) {
  if (size < page_size) fail(arg, "must hold at least one page of ", page_size, " tokens, got ", size);
  if (size > capacity) fail(arg, "cannot grow past the ", capacity, " tokens the pool was built with, got ", size);
}

void check_pool_alone(const char* call, bool shares_list) {
  if (shares_list) {
    fail(call, "a side of the shared mode has no pool of its own (one free list serves full and SWA pages); call ",
         call, "() on the SWATokenToKVPoolAllocator");
  }
}

void check_hybrid_resize(int64_t size, int64_t size_swa, int64_t page_size, int64_t full_capacity,
                         int64_t swa_capacity, bool shares_list, const ParentLayout& parents) {
  check_resize("size", size, page_size, full_capacity);
  check_resize("size_swa", size_swa, page_size, swa_capacity);
  check_shared_list_sizes(size, size_swa, shares_list, parents);
}

void check_state_shape(const char* what, bool same_shape) {
  if (!same_shape) fail("state", "was taken from ", what, " of another shape");
}

AllocPlan plan_alloc(int64_t need_size, const PageGeometry& page) {
  if (need_size < 0) fail("need_size", "is negative (", need_size, ")");
  if (page.offset(need_size) != 0) fail("need_size", need_size, " is not a multiple of the page size ", page.size);
  const int64_t pages = page.page(need_size);
  return AllocPlan{AllocCall::kAlloc, 1, need_size, pages, pages, need_size};
}

AllocPlan plan_extend(const BatchLengths& batch, const LastLoc& last_loc, int64_t extend_num_tokens,
                      const PageGeometry& page) {
  return plan_batch(AllocCall::kExtend, batch, last_loc, extend_num_tokens, page);
}

AllocPlan plan_extend_swa_tail(const BatchLengths& batch, const LastLoc& last_loc, int64_t extend_num_tokens,
                               int64_t swa_tail_len, const PageGeometry& page) {
  if (batch.size() != 1) fail("seq_lens", "alloc_extend_swa_tail takes one request, got ", batch.size());
  AllocPlan plan = plan_batch(AllocCall::kExtendSwaTail, batch, last_loc, extend_num_tokens, page);
  if (swa_tail_len < 0 || swa_tail_len > extend_num_tokens)
    fail("swa_tail_len", swa_tail_len, " is outside [0, extend_num_tokens = ", extend_num_tokens, "]");
  // The tail gets fresh SWA pages of its own; the head has no SWA KV.
  plan.swa_tokens = swa_tail_len;
  plan.swa_pages = page.pages_for(swa_tail_len);
  return plan;
}

AllocPlan plan_decode(const BatchLengths& batch, const LastLoc& last_loc, const PageGeometry& page) {
  return plan_batch(AllocCall::kDecode, batch, last_loc, -1, page);
}

void check_num_new_pages(int64_t num_new_pages, const AllocPlan& plan) {
  if (num_new_pages >= 0 && num_new_pages != plan.full_pages)
    fail("num_new_pages", "is ", num_new_pages, " but the lengths need ", plan.full_pages, " new pages");
}

void check_reservation(const Reservation& r) {
  const auto check = [](const char* arg, int64_t tokens) {
    if (tokens < 0) fail(arg, "is negative (", tokens, ")");
    if (tokens > kMaxLength) fail(arg, "is above ", kMaxLength, " tokens, got ", tokens);
  };
  check("full_tokens", r.full_tokens);
  check("swa_tokens", r.swa_tokens);
  check("full_evictable_tokens", r.full_evictable_tokens);
  check("swa_evictable_tokens", r.swa_evictable_tokens);
}

void check_segment_start(int64_t start_pos, const PageGeometry& page) {
  if (start_pos < 0 || page.offset(start_pos) != 0)
    fail("start_pos", start_pos, " is not page-aligned (page size ", page.size, ")");
}

void check_batch_lengths(std::initializer_list<BatchArg> args) {
  const int64_t first = args.begin()->size;
  bool same = true;
  for (const BatchArg& a : args) same = same && a.size == first;
  if (same) return;
  std::string names, sizes;
  for (const BatchArg& a : args) {
    names += (names.empty() ? "" : ", ") + std::string(a.name);
    sizes += (sizes.empty() ? "" : ", ") + std::string(a.name) + " " + std::to_string(a.size);
  }
  fail(names.c_str(), "differ in length (", sizes, "); each holds one entry per request");
}

void check_group_begin(bool open) {
  if (open) fail("free_group_begin", "a free group is already open (groups do not nest)");
}

void check_group_end(bool open) {
  if (!open) fail("free_group_end", "no free group is open");
}

void check_mapping_pairs(int64_t num_full, int64_t num_swa) {
  if (num_full != num_swa) fail("swa_indices", "has ", num_swa, " entries for ", num_full, " full indices");
}

void plan_window_eviction(int64_t num_rows, int64_t row_len, Span rows, Span pre_lens, Span evicted_seqlens,
                          int64_t window, int64_t interval, bool prefix_sharing, const PageGeometry& page,
                          Destination dest, bool child_pages, int64_t* new_evicted, EvictionPlan& plan) {
  const int64_t bs = rows.size;
  check_batch_lengths({{"rows", bs}, {"pre_lens", pre_lens.size}, {"evicted_seqlens", evicted_seqlens.size}});
  check_at_least_one("window", window);
  check_at_least_one("interval", interval);
  plan.row.clear();
  plan.evicted.clear();
  plan.page_begin.assign(1, 0);
  plan.release_offset.clear();
  for (int64_t j = 0; j < bs; ++j) {
    const int64_t row = rows[j], pre_len = pre_lens[j], evicted = evicted_seqlens[j];
    if (row < 0 || row >= num_rows) fail("rows", "entry ", j, " (", row, ") is outside [0, ", num_rows, ")");
    if (pre_len < 0 || pre_len > row_len) fail("pre_lens", "entry ", j, " (", pre_len, ") is outside [0, ", row_len, "]");
    if (!evicted_len_ok(evicted, pre_len, page))
      fail("evicted_seqlens", "entry ", j, " (", evicted, ") must be page-aligned and within [0, pre_len]");
    new_evicted[j] = evicted_after_step(evicted, pre_len, window, page, interval, prefix_sharing);
    if (new_evicted[j] == evicted) continue;
    plan.row.push_back(row);
    plan.evicted.push_back(evicted);
    plan.page_begin.push_back(plan.page_begin.back() + page.page(new_evicted[j] - evicted));
  }
  const int64_t total = plan.total_pages();
  plan.release_each = child_pages;
  const bool reversed = dest == Destination::kPrepend && !child_pages;  // one block, the last request's first
  for (int64_t j = 0; j < plan.num_due(); ++j)
    plan.release_offset.push_back(reversed ? total - plan.page_begin[j + 1] : plan.page_begin[j]);
}

void check_evicted_len(int64_t evicted, int64_t pre_len, const PageGeometry& page) {
  if (pre_len < 0) fail("pre_len", "is negative (", pre_len, ")");
  if (!evicted_len_ok(evicted, pre_len, page))
    fail("evicted", evicted, " must be page-aligned and within [0, pre_len = ", pre_len, "]");
}

int64_t check_at_least_one(const char* arg, int64_t value) {
  if (value < 1) fail(arg, "must be >= 1, got ", value);
  return value;
}

}  // namespace swa
