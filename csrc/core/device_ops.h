// The per-element bodies of the device allocator's kernels. Each op is a plain struct
// of raw pointers whose operator()(i) does element i, so one definition runs as a CUDA
// kernel (csrc/cuda/kernels.cu) and element by element on the CPU (HostExecutor), where
// the tests replay every trace through it. Ops never read memory out of bounds: a bad
// value is reported into the error record and its element does nothing else. Every
// position an op forms from the counters is checked against the pool first, so that
// even counters a misbehaving caller could skew never lead an op outside its arrays.
#pragma once

#include <cstdint>

#include "rules.h"

namespace swa {
namespace dev {

using StateWord = int32_t;  // one PageState per page, widened for atomicCAS
constexpr StateWord state_word(PageState s) { return static_cast<StateWord>(s); }
constexpr StateWord kHeld = state_word(PageState::kHeld);
constexpr StateWord kFree = state_word(PageState::kFree);
constexpr StateWord kStaged = state_word(PageState::kStaged);
constexpr StateWord kQueuedByPage = state_word(PageState::kQueuedByPage);
// A pool's claimed and queued-by-index states are its kind's (PoolView::kind).

// Words that several elements of one launch may touch at once. On a GPU, its atomics
// (and volatile loads, which no cache keeps stale); on the host, the compiler's atomic
// builtins, because the emulated executor may run a launch's elements on several
// threads: it then does what the GPU does, and ThreadSanitizer sees every such access.
SWA_HD StateWord compare_and_swap(StateWord* word, StateWord expected, StateWord desired) {
#if defined(__CUDA_ARCH__)
  return atomicCAS(reinterpret_cast<int*>(word), expected, desired);
#else
  __atomic_compare_exchange_n(word, &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return expected;  // the value found
#endif
}

SWA_HD int64_t load_shared(const int64_t* word) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const volatile int64_t*>(word);
#else
  return __atomic_load_n(word, __ATOMIC_RELAXED);
#endif
}

SWA_HD void store_shared(int64_t* word, int64_t value) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<volatile int64_t*>(word) = value;
#else
  __atomic_store_n(word, value, __ATOMIC_RELAXED);
#endif
}

SWA_HD void raise_to(int64_t* word, int64_t value) {
#if defined(__CUDA_ARCH__)
  atomicMax(reinterpret_cast<long long*>(word), static_cast<long long>(value));
#else
  int64_t seen = __atomic_load_n(word, __ATOMIC_RELAXED);
  while (seen < value && !__atomic_compare_exchange_n(word, &seen, value, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
#endif
}

// A lock for the rare writes of several words at once (the error record).
SWA_HD void lock(int64_t* word) {
#if defined(__CUDA_ARCH__)
  while (atomicCAS(reinterpret_cast<unsigned long long*>(word), 0ull, 1ull) != 0ull) {
  }
  __threadfence();
#else
  while (__atomic_exchange_n(word, int64_t{1}, __ATOMIC_ACQUIRE) != 0) {
  }
#endif
}

SWA_HD void unlock(int64_t* word) {
#if defined(__CUDA_ARCH__)
  __threadfence();
  atomicExch(reinterpret_cast<unsigned long long*>(word), 0ull);
#else
  __atomic_store_n(word, int64_t{0}, __ATOMIC_RELEASE);
#endif
}

// Counters of one pool. Each pool keeps two copies: an op that changes them reads one
// and writes the other (element 0 writes), so no element reads a half-updated copy;
// the host flips which copy is current.
// kHeldCount: the pages the pool holds (out of the free and staging lists, its open
// group's queued pages included). The shared mode's two sides keep one list (one counter
// block): the SWA side's queues and held pages count in their own words.
enum CounterWord : int64_t {
  kHead, kFreeCount, kStagedCount, kGroupIndexCount, kGroupPageCount, kHeldCount,
  kSwaSideGroupIndexCount, kSwaSideGroupPageCount, kSwaSideHeldCount,
  kCounterWords = 10
};

// The error a call's ops met: what, in which call, which argument, entry, value and
// what else the host needs to word it as the CPU core does. Of several errors, the
// record keeps the first launch's, and within that launch the one of the lowest order
// (the entry, or where the CPU core makes one check of every entry before another,
// that check's rank first: order_after_range_checks), whatever order the elements ran
// in, so that the message is the CPU store's.
enum ErrorWord : int64_t {
  kErrCode, kErrCall, kErrArg, kErrEntry, kErrValue, kErrDetail, kErrKind, kErrLaunch, kErrOrder, kErrLock,
  kErrWords = 10
};
enum ErrorCode : int64_t {
  kNoError,
  kSlotOutOfPool,     // value: the slot
  kPageIdOutOfPool,   // value: the page id
  kClaimRefused,      // value: the page; detail: its PageState
  kUnmapped,          // value: the full slot
  kLastLocFault,      // value: last_loc; detail: the prefix length; kind: the LastLocFault
  kSwaContinuation,   // value: last_loc; detail: its mapped SWA slot
  kTranslateRange,    // value: the slot; detail: the mapping's length
  kCountsOff,         // value: the pages a launch would place or take; detail: what the counters allow
};

// An error found by a check the CPU core makes of every entry after another check of
// every entry ranks after all errors of the first check.
constexpr int64_t kAfterRangeChecks = int64_t{1} << 48;

SWA_HD int64_t error_code(const int64_t* error) { return load_shared(error + kErrCode); }

struct ErrorReport {
  int64_t code, call, arg, entry, value, detail, kind, launch, order;
};

SWA_HD void report(int64_t* error, const ErrorReport& r) {
  if (error_code(error) != kNoError && load_shared(error + kErrLaunch) != r.launch) return;  // an earlier launch's
  lock(error + kErrLock);
  const int64_t held = error_code(error);
  if (held == kNoError || (load_shared(error + kErrLaunch) == r.launch && r.order < load_shared(error + kErrOrder))) {
    const int64_t words[] = {r.code, r.call, r.arg, r.entry, r.value, r.detail, r.kind, r.launch, r.order};
    for (int64_t w = 0; w < kErrLock; ++w) store_shared(error + w, words[w]);
  }
  unlock(error + kErrLock);
}

// Where the call that reports is, which argument it blames, and which launch (the
// host numbers them) reports.
struct Origin {
  int64_t* error;
  int64_t call;
  int64_t arg;
  int64_t launch;
  SWA_HD void fail(int64_t code, int64_t entry, int64_t value, int64_t detail = 0, int64_t kind = 0) const {
    fail_in_order(entry, code, entry, value, detail, kind);
  }
  SWA_HD void fail_in_order(int64_t order, int64_t code, int64_t entry, int64_t value, int64_t detail = 0,
                            int64_t kind = 0) const {
    report(error, ErrorReport{code, call, arg, entry, value, detail, kind, launch, order});
  }
};

// The counter of the list a destination appends to.
SWA_HD CounterWord count_word(Destination dest) {
  switch (dest) {
    case Destination::kStaged:
      return kStagedCount;
    case Destination::kGroupIndex:
      return kGroupIndexCount;
    case Destination::kGroupPages:
      return kGroupPageCount;
    default:
      return kFreeCount;
  }
}

// One pool's device arrays, seen from an op with the counter copy it reads (counters_in)
// and the one it writes (counters_out).
struct PoolView {
  int64_t num_pages;
  PageGeometry page;
  int64_t* ring;         // the free list: ring[head .. head + free_count) modulo num_pages
  int64_t* staged;       // need_sort staging, in release order
  int64_t* group_index;  // token pool: the open group's free() pages, in call order
  int64_t* group_pages;  // the open group's pages freed by id, in call order
  StateWord* state;      // [num_pages + 1]
  int64_t* ring_pos;     // [num_pages + 1]: where in the ring each page was last written
  const int64_t* counters_in;
  int64_t* counters_out;
  // The states this pool's pages take out of the free list, and the counters of its
  // free group queues: the shared mode's SWA side has its own (its list is the full side's).
  PageKind kind = PageKind::full();
  CounterWord group_index_word = kGroupIndexCount, group_page_word = kGroupPageCount, held_word = kHeldCount;

  // count_word(dest) of this pool.
  SWA_HD CounterWord counter_of(Destination dest) const {
    const CounterWord word = count_word(dest);
    return word == kGroupIndexCount ? group_index_word : word == kGroupPageCount ? group_page_word : word;
  }
  SWA_HD StateWord held() const { return static_cast<StateWord>(kind.held); }

  // Folds one period: the ops form positions within (-num_pages, 2 * num_pages) only,
  // having checked their counts first (can_take, has_room).
  SWA_HD int64_t wrap(int64_t pos) const {
    return pos >= num_pages ? pos - num_pages : pos < 0 ? pos + num_pages : pos;
  }
  SWA_HD int64_t page_at(int64_t k) const { return ring[wrap(counters_in[kHead] + k)]; }
  // Whether the free list holds n pages to take.
  SWA_HD bool can_take(int64_t n) const { return n >= 0 && n <= counters_in[kFreeCount]; }
  // Whether n more pages fit the list whose length is counter `word` (num_pages entries).
  SWA_HD bool has_room(CounterWord word, int64_t n) const { return n >= 0 && counters_in[word] <= num_pages - n; }
  // Whether page p is one of the first n pages of the free list (the pages an allocation
  // of n pages is taking). A page in the free list is at its ring position; a page taken
  // since is not, as only free pages lie in the free list.
  SWA_HD bool among_first_free(int64_t p, int64_t n) const {
    const int64_t pos = ring_pos[p];
    return ring[pos] == p && wrap(pos - counters_in[kHead]) < n;
  }
  // The state page p had before a launch that takes the first `taking` pages of the
  // free list, whose other elements may be marking those held as this one reads.
  SWA_HD PageState state_before(int64_t p, int64_t taking) const {
    return taking > 0 && among_first_free(p, taking) ? PageState::kFree : state_of(p);
  }
  SWA_HD bool holds_slot(int64_t slot) const { return slot_in_pool(slot, page, num_pages); }
  SWA_HD bool holds_page(int64_t p) const { return page_id_in_pool(p, num_pages); }
  SWA_HD PageState state_of(int64_t p) const { return static_cast<PageState>(state[p]); }
  SWA_HD void copy_counters() const {
    for (int64_t w = 0; w < kCounterWords; ++w) counters_out[w] = counters_in[w];
  }
  // Takes the first n pages of the free list (their states are set by the op), `own` of
  // them held by this pool (the shared mode's other side holds the rest).
  SWA_HD void take_counters(int64_t n, int64_t own) const {
    copy_counters();
    counters_out[kHead] = wrap(counters_in[kHead] + n);
    counters_out[kFreeCount] = counters_in[kFreeCount] - n;
    counters_out[held_word] = counters_in[held_word] + own;
  }
};

// Index of the request that element i belongs to: begin[j] <= i < begin[j + 1].
SWA_HD int64_t find_request(const int64_t* begin, int64_t count, int64_t i) {
  int64_t lo = 0, hi = count;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (begin[mid] <= i) lo = mid;
    else hi = mid;
  }
  return lo;
}

// A batch as the host lays it out for the device: token_begin [B + 1], then page_begin,
// prefix_lens and seq_lens [B each]; one upload per call.
struct BatchView {
  const int64_t* words;
  int64_t size;
  SWA_HD int64_t token_begin(int64_t j) const { return words[j]; }
  SWA_HD int64_t page_begin(int64_t j) const { return words[size + 1 + j]; }
  SWA_HD int64_t prefix(int64_t j) const { return words[2 * size + 1 + j]; }
  SWA_HD int64_t seq(int64_t j) const { return words[3 * size + 1 + j]; }
  static int64_t words_for(int64_t batch_size) { return 4 * batch_size + 1; }
};

// The checks of a request's last_loc that need its value (and, for a hybrid allocator,
// its mapped SWA slot): reports and returns false when one fails.
struct LastLocCheck {
  PoolView full;
  bool hybrid;
  bool swa_continuation;  // swa_continues_prefix of the call
  PoolView swa;
  const int64_t* mapping;
  const int64_t* last_loc;  // null when no request has a prefix
  Origin origin;

  // full_taking / swa_taking: the pages the launch takes from each free list (their
  // states are read as before it).
  SWA_HD bool ok(const BatchView& batch, int64_t j, bool report_fault, int64_t full_taking = 0,
                 int64_t swa_taking = 0) const {
    const int64_t prefix = batch.prefix(j);
    const int64_t last = last_loc != nullptr ? last_loc[j] : -1;
    // The rules read a held page as kHeld, whichever kind the pool holds.
    const auto full_state = [this, full_taking](int64_t p) {
      const PageState s = full.state_before(p, full_taking);
      return s == full.kind.held ? PageState::kHeld : s;
    };
    const LastLocFault fault = last_loc_fault(last, prefix, full.page, full.num_pages, full_state);
    if (fault != LastLocFault::kNone) {
      if (report_fault) origin.fail(kLastLocFault, j, last, prefix, static_cast<int64_t>(fault));
      return false;
    }
    if (!hybrid || !swa_continuation || !continues_partial_page(prefix, batch.seq(j), full.page)) return true;
    const auto swa_state = [this, swa_taking](int64_t p) { return swa.state_before(p, swa_taking); };
    const int64_t swa_last = mapping[last];
    if (swa_continuation_ok(last, swa_last, swa.page, swa.num_pages, swa_state, swa.kind.held)) return true;
    if (report_fault) origin.fail(kSwaContinuation, j, last, swa_last);
    return false;
  }
};

// Debug mode's pass before an allocation: one element per request, changes nothing.
struct ValidateBatchOp {
  BatchView batch;
  LastLocCheck check;
  SWA_HD void operator()(int64_t j) const { check.ok(batch, j, true); }
};

// alloc / alloc_extend / alloc_decode (and the SWA tail) in one pass, one element per
// new token: the full slot (extend_slot over the full free list), for a hybrid
// allocator the SWA slot and the mapping entry, and the taken pages marked held.
struct AllocSlotsOp {
  BatchView batch;
  LastLocCheck check;  // check.full and check.swa are the pools written
  int64_t need_full, need_swa;
  // >= 0: the SWA tail of one request; its first swa_head_len new tokens get no SWA slot
  // and the rest fill fresh SWA pages.
  int64_t swa_head_len;
  int64_t* mapping;
  int64_t* out;
  // The shared mode: check.full and check.swa are two sides of one list, which hands out
  // the full pages first, then the SWA pages.
  bool shares_list = false;

  SWA_HD void operator()(int64_t i) const {
    const PoolView& full = check.full;
    const PoolView& swa = check.swa;
    // The pages each free list hands out (their states are read as before the launch),
    // and where the SWA pages start in the SWA side's list.
    const int64_t full_taking = shares_list ? need_full + need_swa : need_full;
    const int64_t swa_taking = !check.hybrid ? 0 : shares_list ? full_taking : need_swa;
    const int64_t swa_skip = shares_list ? need_full : 0;
    // The host plans from its counts; after a call the ops refused they can exceed the
    // device's (its refused pages were never released), and then nothing is handed out.
    const bool fits = full.can_take(full_taking) && (shares_list || !check.hybrid || swa.can_take(need_swa));
    if (i == 0) {
      full.take_counters(fits ? full_taking : 0, fits ? need_full : 0);  // shares_list: both sides' pages
      if (shares_list && fits) full.counters_out[swa.held_word] = full.counters_in[swa.held_word] + need_swa;
      if (check.hybrid && !shares_list) swa.take_counters(fits ? need_swa : 0, fits ? need_swa : 0);
      if (!fits) check.origin.fail_in_order(-1, kCountsOff, 0, full_taking, full.counters_in[kFreeCount]);
    }
    const int64_t j = find_request(batch.words, batch.size, i);
    const int64_t t = i - batch.token_begin(j), prefix = batch.prefix(j), seq = batch.seq(j);
    if (!fits || !check.ok(batch, j, t == 0, full_taking, swa_taking)) {
      out[i] = 0;
      return;
    }
    const int64_t last = prefix > 0 ? check.last_loc[j] : -1;
    const int64_t first_page = batch.page_begin(j);
    const auto full_page_at = [&](int64_t k) { return full.page_at(first_page + k); };
    const int64_t full_slot = extend_slot(t, prefix, seq, last, full.page, full_page_at);
    out[i] = full_slot;
    // A new page's first token is the only slot at offset 0 (a continued page never is).
    if (full.page.offset(full_slot) == 0) full.state[full.page.page(full_slot)] = full.held();
    if (!check.hybrid) return;
    int64_t swa_slot = 0;
    if (swa_head_len < 0) {
      const int64_t swa_last = last < 0 ? -1 : mapping[last];
      const auto swa_page_at = [&](int64_t k) { return swa.page_at(swa_skip + first_page + k); };
      swa_slot = extend_slot(t, prefix, seq, swa_last, swa.page, swa_page_at);
    } else if (t >= swa_head_len) {
      const auto swa_page_at = [&](int64_t k) { return swa.page_at(swa_skip + k); };
      swa_slot = extend_slot(t - swa_head_len, 0, seq - prefix - swa_head_len, -1, swa.page, swa_page_at);
    }
    mapping[full_slot] = swa_slot;
    if (swa_slot > 0 && swa.page.offset(swa_slot) == 0) swa.state[swa.page.page(swa_slot)] = swa.held();
  }
};

// How an input names the pages a free claims.
enum class ClaimSource : int32_t {
  kSlot,        // input[i] is a slot (free, free_full)
  kSegmentRepresentative,  // input[i * page_size] stands for its page (*_segment)
  kPageId,      // input[i] is a page id (free_page_ids)
};

// Marks a page claimed by the call in progress, or reports why it cannot be freed.
// order: the refusal's rank in the error record (Origin).
SWA_HD bool claim_page(const PoolView& pool, int64_t p, bool repeat_ok, const Origin& origin, int64_t entry,
                       int64_t order) {
  const StateWord held = pool.held();
  const StateWord old = compare_and_swap(&pool.state[p], held, static_cast<StateWord>(pool.kind.claimed));
  if (old == held || repeats_a_claim(static_cast<PageState>(old), repeat_ok, pool.kind)) return old == held;
  // kind: which side refused (1: the shared mode's SWA side), for the message.
  origin.fail_in_order(order, kClaimRefused, entry, p, old, pool.kind.held == PageState::kHeldSwa ? 1 : 0);
  return false;
}

// The pages a free names in one pool: claimed, and for ordered releases written to
// list[i] in input order.
struct ClaimOp {
  PoolView pool;
  const int64_t* input;
  ClaimSource source;
  bool repeat_ok;  // free() of a page pool: several slots of one page are one free
  int64_t* list;   // null when the release order comes from a scan of the states
  Origin origin;

  SWA_HD void operator()(int64_t i) const {
    const int64_t p = claimed_page(i);
    if (list != nullptr) list[i] = p;  // 0 for an entry refused, which the release skips
  }

  // The page entry i claims, or 0 when it is refused (the error recorded).
  SWA_HD int64_t claimed_page(int64_t i) const {
    int64_t p;
    if (source == ClaimSource::kPageId) {
      p = input[i];
      if (!pool.holds_page(p)) {
        origin.fail(kPageIdOutOfPool, i, p);
        return 0;
      }
    } else {
      const int64_t entry = source == ClaimSource::kSegmentRepresentative ? i * pool.page.size : i;
      const int64_t slot = input[entry];
      if (!pool.holds_slot(slot)) {
        origin.fail(kSlotOutOfPool, entry, slot);
        return 0;
      }
      p = pool.page.page(slot);
    }
    // The CPU core checks every page id's range before it claims any.
    const int64_t order = source == ClaimSource::kPageId ? kAfterRangeChecks + i : i;
    return claim_page(pool, p, repeat_ok, origin, i, order) ? p : 0;
  }
};

// Claims the SWA page mapped from one full slot standing for its page; notes the
// SWA page at swa_list[dest] and the full page at full_pages[dest].
SWA_HD void claim_swa_of_representative(const PoolView& full, const PoolView& swa, const int64_t* mapping, int64_t full_slot,
                             int64_t entry, int64_t dest, int64_t* swa_list, int64_t* full_pages, const Origin& origin) {
  swa_list[dest] = 0;
  full_pages[dest] = 0;
  if (!full.holds_slot(full_slot)) return origin.fail(kSlotOutOfPool, entry, full_slot);
  const int64_t swa_slot = mapping[full_slot];
  if (swa_slot <= 0) return origin.fail(kUnmapped, entry, full_slot);
  if (!swa.holds_slot(swa_slot)) return origin.fail(kSlotOutOfPool, entry, swa_slot);
  const int64_t p = swa.page.page(swa_slot);
  if (claim_page(swa, p, false, origin, entry, entry)) {
    swa_list[dest] = p;
    full_pages[dest] = full.page.page(full_slot);
  }
}

// The SWA half of a free: free_swa_segment's representatives (slots_of_page false), or
// every slot of the pages of free_swa's indices (true; page size > 1).
struct ClaimSwaOp {
  PoolView full, swa;
  const int64_t* mapping;
  const int64_t* input;
  bool slots_of_page;
  int64_t* swa_list;    // representatives: the SWA pages in input order
  int64_t* full_pages;  // representatives: their full pages, for clearing the mapping
  Origin origin;

  SWA_HD void operator()(int64_t i) const {
    if (!slots_of_page) {
      const int64_t entry = i * full.page.size;
      return claim_swa_of_representative(full, swa, mapping, input[entry], entry, i, swa_list, full_pages, origin);
    }
    const int64_t slot = input[i];
    if (!full.holds_slot(slot)) return origin.fail(kSlotOutOfPool, i, slot);
    const int64_t first = full.page.floor(slot);
    for (int64_t s = first; s < first + full.page.size; ++s) {
      const int64_t swa_slot = mapping[s];
      if (swa_slot <= 0) continue;
      if (!swa.holds_slot(swa_slot)) return origin.fail(kSlotOutOfPool, i, swa_slot);
      claim_page(swa, swa.page.page(swa_slot), true, origin, i, i);
    }
  }
};

// Batched window eviction: element i is the u-th due page of due request j; its
// representative is req_to_token[row_j, evicted_j + u * page_size]. Layout of `due`:
// page_begin [D + 1], row, evicted, dest_begin [D each].
struct ClaimEvictedOp {
  PoolView full, swa;
  const int64_t* mapping;
  const int32_t* req_to_token32;  // one of the two is set
  const int64_t* req_to_token64;
  int64_t row_len;
  const int64_t* due;
  int64_t num_due;
  int64_t* swa_list;
  int64_t* full_pages;
  Origin origin;

  SWA_HD void operator()(int64_t i) const {
    const int64_t j = find_request(due, num_due, i);
    const int64_t u = i - due[j];
    const int64_t row = due[num_due + 1 + j], evicted = due[2 * num_due + 1 + j], dest = due[3 * num_due + 1 + j] + u;
    const int64_t at = row * row_len + evicted + u * full.page.size;
    const int64_t full_slot = req_to_token32 != nullptr ? req_to_token32[at] : req_to_token64[at];
    claim_swa_of_representative(full, swa, mapping, full_slot, j, dest, swa_list, full_pages, origin);
  }
};

// Clears the mapping of whole full pages: given as page ids, or as slots in them.
struct ClearMappedPagesOp {
  int64_t* mapping;
  PageGeometry page;
  int64_t num_pages;
  const int64_t* input;
  bool input_is_slots;

  SWA_HD void operator()(int64_t i) const {
    const int64_t p = input_is_slots ? (slot_in_pool(input[i], page, num_pages) ? page.page(input[i]) : 0) : input[i];
    if (p < 1 || p > num_pages) return;
    // Two slots of one page clear it twice, at once.
    for (int64_t s = p * page.size; s < (p + 1) * page.size; ++s) store_shared(mapping + s, 0);
  }
};

// Changes every page in state `from` to `to`: undoing a rejected call's claims, or
// queueing a free() in an open free group. One element per page id.
struct ReplaceStateOp {
  StateWord* state;
  StateWord from, to;
  SWA_HD void operator()(int64_t i) const {
    if (state[i + 1] == from) state[i + 1] = to;
  }
};

// Puts n pages (n from the host, or from device memory) where they go, in list order,
// and updates the counters. reset_word, when >= 0, is a group counter emptied here.
// Nothing moves once the error record holds an error: then a claim of this call (or of
// an earlier one, which the host has not read yet) was refused, and releasing what the
// call did claim, or counting what it did not, would leave counters the pages do not
// match. Nor does anything move when the pages would not fit their list (reported).
struct ReleaseOp {
  PoolView pool;
  const int64_t* pages;
  int64_t count;
  const int64_t* device_count;  // overrides count when set
  int64_t max_count;            // the launch's elements: n beyond them would count pages never placed
  Destination dest;
  int64_t reset_word;
  Origin origin;

  SWA_HD void operator()(int64_t i) const {
    const int64_t n = device_count != nullptr ? *device_count : count;
    const int64_t* c = pool.counters_in;
    // Element 0 reports only when every element finds n unplaceable, so an element that
    // reads that report refuses as it would have anyway.
    const bool refused = error_code(origin.error) != kNoError;
    const bool placeable = n <= max_count && pool.has_room(pool.counter_of(dest), n);
    if (i == 0) {
      pool.copy_counters();
      if (!refused && !placeable) origin.fail_in_order(-1, kCountsOff, 0, n, pool.num_pages - c[pool.counter_of(dest)]);
      if (!refused && placeable) {
        switch (dest) {
          case Destination::kPrepend:
            pool.counters_out[kHead] = pool.wrap(c[kHead] - n);
            pool.counters_out[kFreeCount] = c[kFreeCount] + n;
            break;
          case Destination::kAppend:
            pool.counters_out[kFreeCount] = c[kFreeCount] + n;
            break;
          default:
            pool.counters_out[pool.counter_of(dest)] = c[pool.counter_of(dest)] + n;
            break;
        }
        // Pages into a free group's queue stay the pool's until the group ends.
        if (dest == Destination::kPrepend || dest == Destination::kAppend || dest == Destination::kStaged)
          pool.counters_out[pool.held_word] = c[pool.held_word] - n;
        if (reset_word >= 0) pool.counters_out[reset_word] = 0;
      }
    }
    if (refused || !placeable || i >= n) return;
    const int64_t p = pages[i];
    if (!pool.holds_page(p)) return;  // a rejected claim; its error is already reported
    switch (dest) {
      case Destination::kPrepend:
      case Destination::kAppend: {
        const int64_t pos =
            pool.wrap(dest == Destination::kPrepend ? c[kHead] - n + i : c[kHead] + c[kFreeCount] + i);
        pool.ring[pos] = p;
        pool.ring_pos[p] = pos;
        pool.state[p] = kFree;
        break;
      }
      case Destination::kStaged:
        pool.staged[c[kStagedCount] + i] = p;
        pool.state[p] = kStaged;
        break;
      case Destination::kGroupIndex:
        pool.group_index[c[pool.group_index_word] + i] = p;
        pool.state[p] = static_cast<StateWord>(pool.kind.queued_by_index);
        break;
      case Destination::kGroupPages:
        pool.group_pages[c[pool.group_page_word] + i] = p;
        pool.state[p] = kQueuedByPage;
        break;
    }
  }
};

// need_sort's merge: the free list becomes every free or staged page in id order
// (`sorted`, *count of them, from a scan of the states).
struct RebuildFreeListOp {
  PoolView pool;
  const int64_t* sorted;
  const int64_t* count;
  SWA_HD void operator()(int64_t i) const {
    const int64_t n = *count;
    if (i == 0) {
      pool.copy_counters();
      pool.counters_out[kHead] = 0;
      pool.counters_out[kFreeCount] = n;
      pool.counters_out[kStagedCount] = 0;
    }
    if (i >= n) return;
    pool.ring[i] = sorted[i];
    pool.ring_pos[sorted[i]] = i;
    pool.state[sorted[i]] = kFree;
  }
};

// A fresh pool: every page free in id order, page 0 held. One element per page id
// 0..num_pages; writes counter copy 0.
struct ResetPoolOp {
  PoolView pool;
  int64_t* counters0;
  SWA_HD void operator()(int64_t i) const {
    if (i == 0) {
      for (int64_t w = 0; w < kCounterWords; ++w) counters0[w] = 0;
      counters0[kFreeCount] = pool.num_pages;
      pool.state[0] = kHeld;
      return;
    }
    pool.ring[i - 1] = i;
    pool.ring_pos[i] = i - 1;
    pool.state[i] = kFree;
  }
};

// translate_loc_from_full_to_swa; -1 (a missing last_loc) reads the sentinel.
struct TranslateOp {
  const int64_t* mapping;
  int64_t mapping_len;  // the sentinel is the last entry
  const int64_t* input;
  int64_t* out;
  Origin origin;
  SWA_HD void operator()(int64_t i) const {
    const int64_t idx = input[i];
    if (!translatable(idx, mapping_len)) {
      out[i] = 0;
      return origin.fail(kTranslateRange, i, idx, mapping_len);
    }
    out[i] = idx < 0 ? mapping[mapping_len - 1] : mapping[idx];
  }
};

// set_full_to_swa_mapping (swa_input set; 0 there clears) and clear_full_to_swa_mapping,
// in phases. A full index named twice keeps its last value, as on the CPU core, though
// a GPU runs the writes of one launch in no order: kClaimEntries raises owner[f] to the
// last entry naming f (plus one), then kWrite writes only that entry's value and zeroes
// owner[f] again (owner is zero between calls). kValidate (debug mode) only checks.
// An entry whose values are out of range is reported and written by no phase.
struct SetMappingOp {
  enum Phase : int32_t { kValidate, kClaimEntries, kWrite };
  int64_t* mapping;
  int64_t* owner;  // [mapping length]
  PoolView full, swa;
  const int64_t* full_input;
  const int64_t* swa_input;  // null: clear
  Phase phase;
  Origin full_origin, swa_origin;
  SWA_HD void operator()(int64_t i) const {
    const int64_t f = full_input[i];
    if (phase == kWrite) {
      if (!full.holds_slot(f) || load_shared(owner + f) != i + 1) return;  // another entry's, or refused
      mapping[f] = swa_input != nullptr ? swa_input[i] : 0;
      store_shared(owner + f, 0);
      return;
    }
    // The CPU core checks each entry's full index, then its SWA index.
    if (!full.holds_slot(f)) return full_origin.fail_in_order(2 * i, kSlotOutOfPool, i, f);
    const int64_t s = swa_input != nullptr ? swa_input[i] : 0;
    if (s != 0 && !swa.holds_slot(s)) return swa_origin.fail_in_order(2 * i + 1, kSlotOutOfPool, i, s);
    if (phase == kClaimEntries) raise_to(owner + f, i + 1);
  }
};

}  // namespace dev
}  // namespace swa

// Every op type, for declaring one launcher (or host loop) per op.
#define SWA_DEVICE_OPS(X)  \
  X(dev::ValidateBatchOp)  \
  X(dev::AllocSlotsOp)     \
  X(dev::ClaimOp)          \
  X(dev::ClaimSwaOp)       \
  X(dev::ClaimEvictedOp)   \
  X(dev::ClearMappedPagesOp) \
  X(dev::ReplaceStateOp)        \
  X(dev::ReleaseOp)        \
  X(dev::RebuildFreeListOp) \
  X(dev::ResetPoolOp)      \
  X(dev::TranslateOp)      \
  X(dev::SetMappingOp)

