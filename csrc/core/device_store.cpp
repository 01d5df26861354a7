#include "device_store.h"

#include <algorithm>
#include <sstream>

namespace swa {

namespace {

const char* const kCallNames[] = {
    "alloc", "alloc_extend", "alloc_decode", "alloc_extend_swa_tail", "free", "free_swa", "free_full",
    "free_segment", "free_swa_segment", "free_full_segment", "free_page_ids", "evict_out_of_window",
    "translate_loc_from_full_to_swa", "set_full_to_swa_mapping", "clear_full_to_swa_mapping",
};
const char* const kArgNames[] = {"last_loc", "indices", "page_ids", "req_to_token", "kv_indices", "full_indices",
                                 "swa_indices"};

const char* name_of(const char* const* names, size_t count, int64_t id) {
  return id >= 0 && static_cast<size_t>(id) < count ? names[id] : "?";
}

}  // namespace

// ---------------------------------------------------------------- DeviceControl

DeviceControl::DeviceControl(std::shared_ptr<Executor> executor, int num_pools, bool debug)
    : executor_(std::move(executor)), num_pools_(num_pools), debug_(debug) {
  words_ = executor_->allocate(dev::kErrWords + 2 * dev::kCounterWords * num_pools_);
}

void DeviceControl::detach(DevicePool* pool) { pools_.erase(std::find(pools_.begin(), pools_.end(), pool)); }

void DeviceControl::check_usable() {
  if (poisoned_.empty() && !debug_) {  // (debug mode reads the record in every call)
    // Only launches with an origin write the record: with none since the last copy, a new
    // one would be the same (a free group's begin, eviction and end make one or two a step).
    if (launches_ != watched_launches_) {
      executor_->watch_errors(words_);
      watched_launches_ = launches_;
    }
    const int64_t* record = executor_->landed_errors();
    if (record != nullptr && record[dev::kErrCode] != dev::kNoError) poison(describe(record));
  }
  throw_if_poisoned();
}

void DeviceControl::throw_if_poisoned() const {
  if (!poisoned_.empty()) throw DeferredError(poisoned_);
}

void DeviceControl::start_count_readback() {
  for (DevicePool* pool : pools_) pool->count_readback_started();
  executor_->start_readback(words_, dev::kErrWords + 2 * dev::kCounterWords * num_pools_);
  readback_pending_ = true;
}

const int64_t* DeviceControl::finish_pending_readback() {
  if (!readback_pending_) return nullptr;
  readback_pending_ = false;
  const int64_t* record = executor_->finish_readback();
  for (DevicePool* pool : pools_) pool->count_readback_finished(record);
  return record;
}

void DeviceControl::resolve_counts() {
  const int64_t* record = finish_pending_readback();
  if (record != nullptr && record[dev::kErrCode] != dev::kNoError) poison(describe(record));
  throw_if_poisoned();
}

std::string DeviceControl::take_error() {
  int64_t record[dev::kErrWords];
  executor_->copy_to_host(record, words_, dev::kErrWords);
  if (record[dev::kErrCode] == dev::kNoError) return {};
  clear_error_record();
  return describe(record);
}

void DeviceControl::clear_error_record() {
  const int64_t zeros[dev::kErrWords] = {};
  executor_->copy_to_device(words_, zeros, dev::kErrWords);
}

void DeviceControl::check_now() {
  if (!debug_) return;
  const std::string message = take_error();
  if (!message.empty()) throw ArgumentError(message);
}

void DeviceControl::launch_claims() {
  for (const std::function<void()>& launch : deferred_claims_) launch();
  deferred_claims_.clear();
  claims_unconfirmed_ = true;
  check_now();
  claims_unconfirmed_ = false;
}

bool DeviceControl::drop_claims() {
  deferred_claims_.clear();
  const bool launched = claims_unconfirmed_;
  claims_unconfirmed_ = false;
  return launched;
}

void DeviceControl::raise_found_errors() {
  throw_if_poisoned();
  const std::string message = take_error();
  if (!message.empty()) poison(message);
  throw_if_poisoned();
}

void DeviceControl::poison(const std::string& message) {
  poisoned_ = message +
              " (found on the device after the call returned; the allocator refuses every call until clear() or "
              "restore_state(); SWA_EXT_DEBUG=1 checks each call before it changes anything)";
}

void DeviceControl::reset() {
  finish_pending_readback();  // the pools just reset ignore it; any other pool still needs it
  clear_error_record();
  executor_->forget_errors();  // copies of the record made before it was cleared
  poisoned_.clear();
}

std::string DeviceControl::describe(const int64_t* r) const {
  const int64_t entry = r[dev::kErrEntry], value = r[dev::kErrValue], detail = r[dev::kErrDetail];
  const DevicePool& full = *pools_.front();  // last_loc always lies in the first pool
  std::ostringstream m;
  switch (r[dev::kErrCode]) {
    case dev::kLastLocFault:
      m << last_loc_fault_message(static_cast<LastLocFault>(r[dev::kErrKind]), entry, value, detail, full.geometry(),
                                  full.num_pages());
      break;
    case dev::kSwaContinuation:
      m << swa_continuation_message(entry, value, detail);
      break;
    case dev::kTranslateRange:
      m << untranslatable_message(entry, value, detail);
      break;
    case dev::kCountsOff:
      m << "the device's page counts do not allow " << value << " pages (they allow " << detail
        << "): an earlier call's pages were refused on the device";
      break;
    default:
      m << name_of(kArgNames, std::size(kArgNames), r[dev::kErrArg]) << ": ";
      switch (r[dev::kErrCode]) {
        case dev::kSlotOutOfPool:
          m << "entry " << entry << ": index " << value << " is outside the pool's slots (page 0 is the padding page)";
          break;
        case dev::kPageIdOutOfPool:
          m << "entry " << entry << ": page id " << value << " is outside the pool (page 0 is the padding page)";
          break;
        case dev::kClaimRefused:
          m << "page " << value
            << claim_refusal(static_cast<PageState>(detail), r[dev::kErrKind] == 1 ? PageKind::swa() : PageKind::full());
          break;
        case dev::kUnmapped:
          m << "full slot " << value << kUnmappedRefusal;
          break;
        default:
          m << "error " << r[dev::kErrCode];
      }
  }
  if (r[dev::kErrCall] >= 0) m << " [in " << name_of(kCallNames, std::size(kCallNames), r[dev::kErrCall]) << "]";
  return m.str();
}

// ---------------------------------------------------------------- DevicePool

DevicePool::DevicePool(std::shared_ptr<DeviceControl> control, int slot, int64_t size, int64_t page_size,
                       bool need_sort)
    : DevicePool(control, std::make_shared<DeviceList>(), size, page_size, need_sort, PageKind::full()) {
  Executor& exec = control_->exec();
  list_->slot = slot;
  list_->ring = exec.allocate(num_pages_);
  list_->staged = exec.allocate(num_pages_);
  list_->ring_pos = exec.allocate(num_pages_ + 1);
  list_->state = reinterpret_cast<dev::StateWord*>(exec.allocate((num_pages_ + 2) / 2));
  reset_pool();
}

DevicePool::DevicePool(std::shared_ptr<DeviceControl> control, std::shared_ptr<DeviceList> list, int64_t size,
                       int64_t page_size, bool need_sort, const PageKind& kind)
    : control_(std::move(control)), list_(std::move(list)), size_(size), num_pages_(0), capacity_(size),
      page_(page_size), need_sort_(need_sort), kind_(kind),
      group_index_word_(kind.held == PageState::kHeldSwa ? dev::kSwaSideGroupIndexCount : dev::kGroupIndexCount),
      group_page_word_(kind.held == PageState::kHeldSwa ? dev::kSwaSideGroupPageCount : dev::kGroupPageCount),
      held_word_(kind.held == PageState::kHeldSwa ? dev::kSwaSideHeldCount : dev::kHeldCount) {
  check_pool_shape("size", size, page_size);
  num_pages_ = size / page_size;
  Executor& exec = control_->exec();
  group_index_ = exec.allocate(num_pages_);
  group_pages_ = exec.allocate(num_pages_);
  claims_ = exec.allocate(num_pages_);
  selected_ = exec.allocate(num_pages_);
  selected_count_ = exec.allocate(1);
  control_->attach(this);
}

std::shared_ptr<DevicePool> DevicePool::swa_side_of(DevicePool& full_side) {
  // The list is full_side's, already reset; the side's own queues start empty.
  std::shared_ptr<DevicePool> swa(new DevicePool(full_side.control_, full_side.list_, full_side.size_,
                                                 full_side.page_.size, full_side.need_sort_, PageKind::swa()));
  swa->shares_list_ = full_side.shares_list_ = true;
  return swa;
}

dev::PoolView DevicePool::view() {
  int64_t* counters = control_->counters(list_->slot);
  const int parity = list_->parity;
  return dev::PoolView{num_pages_, page_, list_->ring, list_->staged, group_index_, group_pages_, list_->state,
                       list_->ring_pos, counters + parity * dev::kCounterWords,
                       counters + (1 - parity) * dev::kCounterWords, kind_, group_index_word_, group_page_word_,
                       held_word_};
}

int64_t DevicePool::free_pages() {
  if (list_->base_unknown) control_->resolve_counts();
  return list_->free_count;
}

int64_t DevicePool::staged_pages() {
  if (list_->base_unknown) control_->resolve_counts();
  return list_->staged_count;
}

int64_t DevicePool::held_pages() {
  if (held_unknown_) control_->resolve_counts();  // the read-back that brings the free count
  return held_count_;
}

void DevicePool::set_group_open(bool open) {
  group_open_ = open;
  if (open) group_has_index_frees_ = false;
}

void DevicePool::count_readback_finished(const int64_t* record) {
  DeviceList& list = *list_;
  const int64_t* counters =
      record + dev::kErrWords + 2 * dev::kCounterWords * list.slot + list.base_parity * dev::kCounterWords;
  if (held_unknown_) held_count_ += counters[held_word_];
  held_unknown_ = false;
  if (!list.base_unknown) return;  // (the shared mode's other side took it)
  list.free_count += counters[dev::kFreeCount];
  list.staged_count += counters[dev::kStagedCount];
  list.base_unknown = false;
}

void DevicePool::reset_pool() {
  // (In the shared mode both sides are reset together: the counter block, both sides'
  // queue counts included, is zeroed.)
  control_->exec().run(num_pages_ + 1, dev::ResetPoolOp{view(), control_->counters(list_->slot)});
  list_->parity = 0;
  list_->free_count = num_pages_;
  list_->staged_count = 0;
  list_->base_unknown = false;
  held_count_ = 0;
  held_unknown_ = false;
  group_open_ = group_has_index_frees_ = false;
  group_index_count_ = group_page_count_ = 0;
  claim_count_ = 0;
}

void DevicePool::clear() {
  reset_pool();
  control_->reset();
}

void DevicePool::resize(int64_t size) {
  size_ = size;
  num_pages_ = size / page_.size;
  clear();
}

void DevicePool::merge() {
  Executor& exec = control_->exec();
  exec.select_pages(list_->state, num_pages_, dev::kFree, dev::kStaged, selected_, selected_count_);
  exec.run(num_pages_, dev::RebuildFreeListOp{view(), selected_, selected_count_});
  flip();
  list_->free_count += list_->staged_count;
  list_->staged_count = 0;
}

namespace {

// The device's view of a batch: where each request's tokens and new pages begin, and
// its lengths (BatchView's layout).
dev::BatchView upload_batch(Executor& exec, const BatchLengths& batch, const PageGeometry& page) {
  const int64_t bs = batch.size();
  std::vector<int64_t> words(static_cast<size_t>(dev::BatchView::words_for(bs)));
  int64_t* token_begin = words.data();
  int64_t* page_begin = token_begin + bs + 1;
  int64_t* prefix = page_begin + bs;
  int64_t* seq = prefix + bs;
  int64_t tokens = 0, pages = 0;
  for (int64_t j = 0; j < bs; ++j) {
    token_begin[j] = tokens;
    page_begin[j] = pages;
    prefix[j] = batch.prefix(j);
    seq[j] = batch.seq_lens[j];
    tokens += seq[j] - prefix[j];
    pages += new_page_count(prefix[j], seq[j], page);
  }
  token_begin[bs] = tokens;
  return dev::BatchView{exec.upload(words), bs};
}

}  // namespace

void DevicePool::validate_batch(const BatchLengths& batch, const LastLoc& last_loc, Call call) {
  if (!control_->debug()) return;  // the write checks each request, reporting later
  const dev::PoolView pool = view();
  const dev::LastLocCheck check{pool, false, false, pool, nullptr, last_loc.data, control_->origin(call, kArgLastLoc)};
  control_->exec().run(batch.size(), dev::ValidateBatchOp{upload_batch(control_->exec(), batch, page_), check});
  control_->check_now();
}

void DevicePool::write_batch(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc, Call call,
                             OutBuffer& out) {
  Executor& exec = control_->exec();
  const dev::BatchView words = upload_batch(exec, batch, page_);
  int64_t* slots = out.get(plan.num_tokens);
  if (plan.num_tokens > 0) {
    const dev::PoolView pool = view();
    const dev::LastLocCheck check{pool, false, false, pool, nullptr, last_loc.data, control_->origin(call, kArgLastLoc)};
    exec.run(plan.num_tokens, dev::AllocSlotsOp{words, check, plan.full_pages, 0, -1, nullptr, slots});
    flip();
  }
  took(plan.full_pages);
}

void DevicePool::check_page_count(const char* arg, int64_t pages) const {
  if (pages > num_pages_)
    fail(arg, "names ", pages, " pages to free but the pool has ", num_pages_, ", so some page is freed twice");
}

void DevicePool::claim_slots(Span indices, Call call) {
  const int64_t n = indices.size;
  if (token_mode()) check_page_count("indices", n);
  if (n == 0) return;
  // A page pool releases free()'s pages in page order, from a scan of the states; the
  // token pool in the order given.
  defer_claim(n, n, dev::ClaimOp{view(), indices.data, dev::ClaimSource::kSlot, !token_mode(),
                                token_mode() ? claims_ : nullptr, control_->origin(call, kArgIndices)});
}

void DevicePool::claim_segment(Span indices, Call call) {
  const int64_t pages = page_.pages_for(indices.size);
  check_page_count("indices", pages);
  if (pages == 0) return;
  defer_claim(pages, pages, dev::ClaimOp{view(), indices.data, dev::ClaimSource::kSegmentRepresentative, false, claims_,
                                       control_->origin(call, kArgIndices)});
}

void DevicePool::claim_page_ids(Span pages, Call call) {
  check_page_count("page_ids", pages.size);
  if (pages.size == 0) return;
  defer_claim(pages.size, pages.size, dev::ClaimOp{view(), pages.data, dev::ClaimSource::kPageId, false, claims_,
                                                   control_->origin(call, kArgPageIds)});
}

void DevicePool::unclaim_all() {
  control_->exec().run(num_pages_, dev::ReplaceStateOp{list_->state, word(kind_.claimed), word(kind_.held)});
  claim_count_ = 0;
}

void DevicePool::undo_claims() {
  if (control_->drop_claims()) unclaim_all();
  claim_count_ = 0;
}

void DevicePool::release(const int64_t* pages, int64_t n, const int64_t* device_count, int64_t launch,
                         Destination dest, int64_t reset_word) {
  if (device_count == nullptr && n == 0) return;
  const int64_t elements = std::max<int64_t>(std::min(launch, num_pages_), 1);
  control_->exec().run(elements, dev::ReleaseOp{view(), pages, n, device_count, elements, dest, reset_word,
                                                control_->release_origin()});
  flip();
  if (reset_word == group_index_word_) group_index_count_ = 0;
  if (reset_word == group_page_word_) group_page_count_ = 0;
  const bool counted = dest == Destination::kPrepend || dest == Destination::kAppend ||
                       dest == Destination::kStaged;
  if (device_count != nullptr) {
    if (counted) control_->start_count_readback();
    return;
  }
  switch (dest) {
    case Destination::kPrepend:
    case Destination::kAppend:
      list_->free_count += n;
      held_count_ -= n;
      break;
    case Destination::kStaged:
      list_->staged_count += n;
      held_count_ -= n;
      break;
    case Destination::kGroupIndex:
      group_index_count_ += n;
      break;
    case Destination::kGroupPages:
      group_page_count_ += n;
      break;
  }
}

// releases: always empty, since this store's pages are whole pages (pages_per_parent 1),
// which an eviction releases as one block.
void DevicePool::release_claims(Destination dest, ReleaseOrder order, Span) {
  const int64_t count = claim_count_;
  claim_count_ = 0;
  if (count == 0) return;
  if (order == ReleaseOrder::kClaimOrder) return release(claims_, count, nullptr, count, dest, -1);
  // Page order: the claimed pages, however many there were, from a scan of the states
  // (in the shared mode, of this side's kind only).
  const dev::StateWord claimed = word(kind_.claimed);
  if (dest == Destination::kGroupIndex) {
    control_->exec().run(num_pages_, dev::ReplaceStateOp{list_->state, claimed, word(kind_.queued_by_index)});
    group_has_index_frees_ = true;
    return;
  }
  control_->exec().select_pages(list_->state, num_pages_, claimed, claimed, selected_, selected_count_);
  release(selected_, 0, selected_count_, count, dest, -1);
}

void DevicePool::release_group(GroupQueue queue, Destination dest, ReleaseOrder order) {
  if (queue == GroupQueue::kByPage)
    return release(group_pages_, group_page_count_, nullptr, group_page_count_, dest, group_page_word_);
  if (order == ReleaseOrder::kClaimOrder)  // the token pool queues its free() pages in a list
    return release(group_index_, group_index_count_, nullptr, group_index_count_, dest, group_index_word_);
  if (!group_has_index_frees_) return;
  group_has_index_frees_ = false;
  const dev::StateWord queued = word(kind_.queued_by_index);
  control_->exec().select_pages(list_->state, num_pages_, queued, queued, selected_, selected_count_);
  release(selected_, 0, selected_count_, num_pages_, dest, -1);
}

PagePool DevicePool::snapshot() {
  // A pool whose ops found an error is no state to keep or check: raise it (as the
  // hybrid store's backup does) rather than hand out what the refused call left.
  control_->raise_found_errors();
  Executor& exec = control_->exec();
  int64_t counters[dev::kCounterWords];
  exec.copy_to_host(counters, control_->counters(list_->slot) + list_->parity * dev::kCounterWords, dev::kCounterWords);
  // The ops keep every count within the pool; one that is not would size the copies below.
  for (const dev::CounterWord word : {dev::kHead, dev::kFreeCount, dev::kStagedCount, group_index_word_,
                                  group_page_word_})
    if (counters[word] < 0 || counters[word] > num_pages_ || (word == dev::kHead && counters[word] == num_pages_))
      throw std::logic_error("device pool counter " + std::to_string(word) + " is " + std::to_string(counters[word]) +
                             ", outside a pool of " + std::to_string(num_pages_) + " pages");
  std::vector<int64_t> ring(static_cast<size_t>(num_pages_)), free_list(static_cast<size_t>(counters[dev::kFreeCount]));
  exec.copy_to_host(ring.data(), list_->ring, num_pages_);
  for (int64_t k = 0; k < counters[dev::kFreeCount]; ++k) free_list[k] = ring[(counters[dev::kHead] + k) % num_pages_];
  const auto download = [&](const int64_t* src, int64_t n) {
    std::vector<int64_t> v(static_cast<size_t>(n));
    exec.copy_to_host(v.data(), src, n);
    return v;
  };
  std::vector<int64_t> state_words((num_pages_ + 2) / 2);
  exec.copy_to_host(state_words.data(), reinterpret_cast<const int64_t*>(list_->state), (num_pages_ + 2) / 2);
  const dev::StateWord* words = reinterpret_cast<const dev::StateWord*>(state_words.data());
  std::vector<PageState> state(static_cast<size_t>(num_pages_ + 1));
  std::vector<int64_t> queued_by_index =
      token_mode() ? download(group_index_, counters[group_index_word_]) : std::vector<int64_t>();
  for (int64_t p = 0; p <= num_pages_; ++p) {
    state[p] = static_cast<PageState>(words[p]);
    if (!token_mode() && words[p] == word(kind_.queued_by_index)) queued_by_index.push_back(p);
  }
  return PagePool::from_parts(size_, page_.size, need_sort_, free_list, download(list_->staged, counters[dev::kStagedCount]),
                              std::move(state), group_open_, std::move(queued_by_index),
                              download(group_pages_, counters[group_page_word_]), kind_,
                              shares_list_);
}

void DevicePool::restore_pool(const PagePool& pool) {
  Executor& exec = control_->exec();
  const std::vector<int64_t> free_list = pool.free_list();
  DeviceList& list = *list_;
  exec.copy_to_device(list.ring, free_list.data(), static_cast<int64_t>(free_list.size()));
  std::vector<int64_t> ring_pos(static_cast<size_t>(num_pages_ + 1), 0);
  for (size_t k = 0; k < free_list.size(); ++k) ring_pos[free_list[k]] = static_cast<int64_t>(k);
  exec.copy_to_device(list.ring_pos, ring_pos.data(), num_pages_ + 1);
  const std::vector<int64_t>& staged = pool.staged_list();
  exec.copy_to_device(list.staged, staged.data(), static_cast<int64_t>(staged.size()));
  const std::vector<int64_t>& by_index = pool.group_index_pages();
  if (token_mode()) exec.copy_to_device(group_index_, by_index.data(), static_cast<int64_t>(by_index.size()));
  const std::vector<int64_t>& by_page = pool.group_page_ids();
  exec.copy_to_device(group_pages_, by_page.data(), static_cast<int64_t>(by_page.size()));
  std::vector<int64_t> state_words((num_pages_ + 2) / 2, 0);
  dev::StateWord* words = reinterpret_cast<dev::StateWord*>(state_words.data());
  for (int64_t p = 0; p <= num_pages_; ++p) words[p] = dev::state_word(pool.state(p));
  exec.copy_to_device(reinterpret_cast<int64_t*>(list.state), state_words.data(), static_cast<int64_t>(state_words.size()));
  // Counter copy 0: the list's words, and this side's queue words (the shared mode's other
  // side writes its own).
  int64_t* const counters = control_->counters(list.slot);
  const int64_t list_words[] = {0, static_cast<int64_t>(free_list.size()), static_cast<int64_t>(staged.size())};
  static_assert(dev::kHead == 0 && dev::kFreeCount == 1 && dev::kStagedCount == 2, "the list's words come first");
  exec.copy_to_device(counters, list_words, 3);
  group_index_count_ = token_mode() ? static_cast<int64_t>(by_index.size()) : 0;
  group_page_count_ = static_cast<int64_t>(by_page.size());
  exec.copy_to_device(counters + group_index_word_, &group_index_count_, 1);
  exec.copy_to_device(counters + group_page_word_, &group_page_count_, 1);
  held_count_ = pool.held_count();
  held_unknown_ = false;
  exec.copy_to_device(counters + held_word_, &held_count_, 1);
  list.parity = 0;
  list.free_count = list_words[dev::kFreeCount];
  list.staged_count = list_words[dev::kStagedCount];
  list.base_unknown = false;
  group_open_ = pool.group_open();
  group_has_index_frees_ = !token_mode() && !by_index.empty();
  claim_count_ = 0;
}

void DevicePool::restore(const PagePool& state) {
  restore_pool(state);
  control_->reset();
}

// ---------------------------------------------------------------- DeviceHybridStore

DeviceHybridStore::DeviceHybridStore(std::shared_ptr<Executor> executor, int64_t size, int64_t size_swa,
                                     int64_t page_size, bool need_sort, bool shares_list, bool debug, int64_t* mapping,
                                     int64_t mapping_len)
    : HybridStore(shares_list, ParentLayout{}),
      page_(page_size),
      control_(std::make_shared<DeviceControl>(std::move(executor), shares_list ? 1 : 2, debug)),
      full_(std::make_shared<DevicePool>(control_, 0, size, page_size, need_sort)),
      swa_(shares_list ? DevicePool::swa_side_of(*full_)
                       : std::make_shared<DevicePool>(control_, 1, size_swa, page_size, need_sort)),
      mapping_(mapping),
      mapping_len_(mapping_len) {
  full_pages_ = control_->exec().allocate(full_->num_pages());
  reset_mapping();
}

void DeviceHybridStore::reset_mapping() {
  std::vector<int64_t> mapping(static_cast<size_t>(mapping_len_), 0);
  mapping.back() = -1;  // last_loc == -1 translates to -1
  control_->exec().copy_to_device(mapping_, mapping.data(), mapping_len_);
}

dev::LastLocCheck DeviceHybridStore::last_loc_check(const AllocPlan& plan, const LastLoc& last_loc, Call call) {
  return dev::LastLocCheck{full_->view(), true, swa_continues_prefix(plan.call), swa_->view(), mapping_,
                           last_loc.data, control_->origin(call, kArgLastLoc)};
}

void DeviceHybridStore::validate_batch(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc,
                                       Call call) {
  if (!control_->debug()) return;  // the write checks each request, reporting later
  Executor& exec = control_->exec();
  exec.run(batch.size(), dev::ValidateBatchOp{upload_batch(exec, batch, page_), last_loc_check(plan, last_loc, call)});
  control_->check_now();
}

void DeviceHybridStore::write_batch(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc,
                                    Call call, OutBuffer& out) {
  Executor& exec = control_->exec();
  const dev::BatchView words = upload_batch(exec, batch, page_);
  int64_t* slots = out.get(plan.num_tokens);
  if (plan.num_tokens > 0) {
    const int64_t swa_head = swa_continues_prefix(plan.call) ? -1 : plan.swa_head_len();
    exec.run(plan.num_tokens, dev::AllocSlotsOp{words, last_loc_check(plan, last_loc, call), plan.full_pages,
                                                plan.swa_pages, swa_head, mapping_, slots, shares_list()});
    full_->flip();
    if (!shares_list()) swa_->flip();  // the shared mode's one list has one counter block
  }
  full_->took(plan.full_pages);
  swa_->took(plan.swa_pages);
}

void DeviceHybridStore::translate(Span indices, int64_t* out) {
  if (indices.size == 0) return;
  control_->exec().run(indices.size, dev::TranslateOp{mapping_, mapping_len_, indices.data, out,
                                                      control_->origin(kCallTranslate, kArgKvIndices)});
  control_->check_now();
}

void DeviceHybridStore::write_mapping(Span full_indices, const int64_t* swa_indices, Call call) {
  if (full_indices.size == 0) return;
  Executor& exec = control_->exec();
  if (mapping_owner_ == nullptr) mapping_owner_ = exec.allocate(mapping_len_);  // zeroed: no owners
  const dev::Origin full_origin = control_->origin(call, kArgFullIndices);
  dev::Origin swa_origin = control_->origin(call, kArgSwaIndices);
  swa_origin.launch = full_origin.launch;  // one launch checks both
  dev::SetMappingOp op{mapping_, mapping_owner_, full_->view(), swa_->view(), full_indices.data, swa_indices,
                       dev::SetMappingOp::kValidate, full_origin, swa_origin};
  if (control_->debug()) {
    exec.run(full_indices.size, op);
    control_->check_now();
  }
  for (const auto phase : {dev::SetMappingOp::kClaimEntries, dev::SetMappingOp::kWrite}) {
    op.phase = phase;
    exec.run(full_indices.size, op);
  }
}

void DeviceHybridStore::set_mapping(Span full_indices, Span swa_indices) {
  write_mapping(full_indices, swa_indices.data, kCallSetMapping);
}

void DeviceHybridStore::clear_mapping(Span full_indices) { write_mapping(full_indices, nullptr, kCallClearMapping); }

void DeviceHybridStore::note_mapped(const int64_t* slots, int64_t count) {
  mapped_slots_ = slots;
  mapped_count_ = count;
}

void DeviceHybridStore::claim_swa_of_pages(Span indices, bool, Call call) {
  if (indices.size == 0) return;
  swa_->defer_claim(indices.size, indices.size * page_.size,
                    dev::ClaimSwaOp{full_->view(), swa_->view(), mapping_, indices.data, true, swa_->claim_list(),
                                    full_pages_, control_->origin(call, kArgIndices)});
  note_mapped(indices.data, indices.size);
}

void DeviceHybridStore::claim_swa_of_representatives(Span indices, Call call) {
  const int64_t pages = page_.pages_for(indices.size);
  swa_->check_page_count("indices", pages);
  full_->check_page_count("indices", pages);
  if (pages == 0) return;
  swa_->defer_claim(pages, pages, dev::ClaimSwaOp{full_->view(), swa_->view(), mapping_, indices.data, false,
                                                swa_->claim_list(), full_pages_, control_->origin(call, kArgIndices)});
  note_mapped(nullptr, pages);
}

void DeviceHybridStore::claim_swa_of_evicted(const SlotRows& rows, const EvictionPlan& plan) {
  const int64_t total = plan.total_pages(), num_due = plan.num_due();
  swa_->check_page_count("req_to_token", total);
  full_->check_page_count("req_to_token", total);
  std::vector<int64_t> due = plan.page_begin;  // ClaimEvictedOp's layout
  due.insert(due.end(), plan.row.begin(), plan.row.end());
  due.insert(due.end(), plan.evicted.begin(), plan.evicted.end());
  due.insert(due.end(), plan.release_offset.begin(), plan.release_offset.end());
  swa_->defer_claim(total, total,
                    dev::ClaimEvictedOp{full_->view(), swa_->view(), mapping_, rows.rows32, rows.rows64, rows.row_len,
                                        control_->exec().upload(due), num_due, swa_->claim_list(), full_pages_,
                                        control_->origin(kCallEvict, kArgReqToToken)});
  note_mapped(nullptr, total);
}

void DeviceHybridStore::undo_claims() {
  if (control_->drop_claims()) {  // (in the shared mode, each side's claims by their kind)
    full_->unclaim_all();
    swa_->unclaim_all();
  }
  full_->undo_claims();
  swa_->undo_claims();
  note_mapped(nullptr, 0);
}

void DeviceHybridStore::clear_claimed_mapping() {
  if (mapped_count_ > 0) {
    const bool slots = mapped_slots_ != nullptr;
    control_->exec().run(mapped_count_, dev::ClearMappedPagesOp{mapping_, page_, full_->num_pages(),
                                                                slots ? mapped_slots_ : full_pages_, slots});
  }
  note_mapped(nullptr, 0);
}

void DeviceHybridStore::clear() {
  full_->reset_pool();
  swa_->reset_pool();
  reset_mapping();
  control_->reset();
}

void DeviceHybridStore::resize(int64_t size, int64_t size_swa) {
  full_->resize(size);
  swa_->resize(size_swa);
  reset_mapping();
}

AllocatorState DeviceHybridStore::backup() {
  control_->raise_found_errors();
  std::vector<int64_t> mapping(static_cast<size_t>(mapping_len_));
  control_->exec().copy_to_host(mapping.data(), mapping_, mapping_len_);
  return AllocatorState{full_->snapshot(), swa_->snapshot(), std::move(mapping)};
}

void DeviceHybridStore::restore(const AllocatorState& state) {
  full_->restore_pool(state.full);
  swa_->restore_pool(state.swa);
  control_->exec().copy_to_device(mapping_, state.mapping.data(), mapping_len_);
  control_->reset();
}

}  // namespace swa
