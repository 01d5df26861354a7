#include "device_allocator.h"

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

// The device's view of a batch: where each request's tokens and new pages begin, and
// its lengths (BatchView's layout).
std::vector<int64_t> batch_words(const BatchLengths& batch, const PageGeometry& page) {
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
  return words;
}

}  // namespace

// ---------------------------------------------------------------- DeviceControl

DeviceControl::DeviceControl(std::shared_ptr<Executor> executor, int num_pools, bool debug)
    : executor_(std::move(executor)), num_pools_(num_pools), debug_(debug) {
  words_ = executor_->allocate(dev::kErrWords + 2 * dev::kCtlWords * num_pools_);
}

void DeviceControl::check_usable() const {
  if (!poisoned_.empty()) throw DeferredError(poisoned_);
}

void DeviceControl::start_count_readback() {
  for (DevicePool* pool : pools_) pool->count_readback_started();
  executor_->start_readback(words_, dev::kErrWords + 2 * dev::kCtlWords * num_pools_);
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
  check_usable();
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

void DeviceControl::raise_found_errors() {
  check_usable();
  const std::string message = take_error();
  if (!message.empty()) poison(message);
  check_usable();
}

void DeviceControl::poison(const std::string& message) {
  poisoned_ = message +
              " (found on the device after the call returned; the allocator refuses every call until clear() or "
              "restore_state(); SWA_EXT_DEBUG=1 checks each call before it changes anything)";
}

void DeviceControl::reset() {
  finish_pending_readback();  // the pools just reset ignore it; any other pool still needs it
  clear_error_record();
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
          m << "page " << value << claim_refusal(static_cast<PageState>(detail));
          break;
        case dev::kUnmapped:
          m << "full slot " << value << kUnmappedRefusal;
          break;
        default:
          m << "error " << r[dev::kErrCode];
      }
  }
  m << " [in " << name_of(kCallNames, std::size(kCallNames), r[dev::kErrCall]) << "]";
  return m.str();
}

// ---------------------------------------------------------------- DevicePool

DevicePool::DevicePool(std::shared_ptr<DeviceControl> control, int slot, int64_t size, int64_t page_size,
                       bool need_sort)
    : control_(std::move(control)), slot_(slot), size_(size), num_pages_(0), capacity_(size), page_(page_size),
      need_sort_(need_sort) {
  check_pool_shape("size", size, page_size);
  num_pages_ = size / page_size;
  Executor& exec = control_->exec();
  ring_ = exec.allocate(num_pages_);
  staged_ = exec.allocate(num_pages_);
  group_index_ = exec.allocate(num_pages_);
  group_pages_ = exec.allocate(num_pages_);
  list_ = exec.allocate(num_pages_);
  selected_ = exec.allocate(num_pages_);
  selected_count_ = exec.allocate(1);
  state_ = reinterpret_cast<dev::StateWord*>(exec.allocate((num_pages_ + 2) / 2));
  control_->attach(this);
  clear();
}

dev::PoolView DevicePool::view() {
  int64_t* ctl = control_->ctl(slot_);
  return dev::PoolView{num_pages_, page_, ring_, staged_, group_index_, group_pages_, state_,
                       ctl + parity_ * dev::kCtlWords, ctl + (1 - parity_) * dev::kCtlWords};
}

int64_t DevicePool::free_page_count() {
  if (base_unknown_) control_->resolve_counts();
  return free_count_;
}

int64_t DevicePool::staged_page_count() {
  if (base_unknown_) control_->resolve_counts();
  return staged_count_;
}

void DevicePool::count_readback_finished(const int64_t* record) {
  if (!base_unknown_) return;
  const int64_t* ctl = record + dev::kErrWords + 2 * dev::kCtlWords * slot_ + base_parity_ * dev::kCtlWords;
  free_count_ += ctl[dev::kFreeCount];
  staged_count_ += ctl[dev::kStagedCount];
  base_unknown_ = false;
}

void DevicePool::clear() {
  control_->exec().run(num_pages_ + 1, dev::ResetPoolOp{view(), control_->ctl(slot_)});
  parity_ = 0;
  free_count_ = num_pages_;
  staged_count_ = 0;
  base_unknown_ = false;
  group_open_ = group_has_index_frees_ = false;
  group_index_count_ = group_page_count_ = 0;
}

void DevicePool::resize(int64_t size, const char* arg) {
  check_resize(arg, size, page_.size, capacity_);
  size_ = size;
  num_pages_ = size / page_.size;
  clear();
}

void DevicePool::merge_and_sort_free() {
  if (staged_page_count() == 0) return;
  Executor& exec = control_->exec();
  exec.select_pages(state_, num_pages_, dev::kFree, dev::kStaged, selected_, selected_count_);
  exec.run(num_pages_, dev::RebuildFreeListOp{view(), selected_, selected_count_});
  flip();
  free_count_ += staged_count_;
  staged_count_ = 0;
}

void DevicePool::merge_if_due(const AllocPlan& plan, PoolRole role) {
  if (merge_due(plan, role, free_page_count(), page_)) merge_and_sort_free();
}

bool DevicePool::allocate(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc, DeviceCall call,
                          OutBuffer& out) {
  Executor& exec = control_->exec();
  dev::BatchView words{nullptr, batch.size()};
  const auto check_last_loc = [&] {
    const dev::PoolView pool = view();
    return dev::LastLocCheck{pool, false, pool, nullptr, last_loc.data, control_->origin(call, kArgLastLoc)};
  };
  if (control_->debug()) {  // a bad last_loc raises even where the pool is short, as on the CPU
    words.words = exec.upload(batch_words(batch, page_));
    exec.run(batch.size(), dev::ValidateBatchOp{words, check_last_loc()});
    control_->check_now([] {});
  }
  merge_if_due(plan, PoolRole::kFull);
  if (pool_refused(plan, free_page_count())) return false;
  if (words.words == nullptr) words.words = exec.upload(batch_words(batch, page_));  // a refusal uploads nothing
  int64_t* slots = out.get(plan.num_tokens);
  if (plan.num_tokens > 0) {
    exec.run(plan.num_tokens, dev::AllocSlotsOp{words, check_last_loc(), plan.full_pages, 0, -1, nullptr, slots});
    flip();
  }
  took(plan.full_pages);
  return true;
}

bool DevicePool::alloc(int64_t need_size, OutBuffer& out) {
  control_->check_usable();
  const AllocPlan plan = plan_alloc(need_size, page_);
  const int64_t zero = 0;
  return allocate(plan, BatchLengths{Span(&zero, 1), Span(&need_size, 1), false}, LastLoc(), kCallAlloc, out);
}

bool DevicePool::alloc_extend(const BatchLengths& batch, const LastLoc& last_loc, int64_t extend_num_tokens,
                              int64_t num_new_pages, OutBuffer& out) {
  control_->check_usable();
  const AllocPlan plan = plan_extend(batch, last_loc, extend_num_tokens, page_);
  check_num_new_pages(num_new_pages, plan);
  return allocate(plan, batch, last_loc, kCallAllocExtend, out);
}

bool DevicePool::alloc_decode(const BatchLengths& batch, const LastLoc& last_loc, OutBuffer& out) {
  control_->check_usable();
  return allocate(plan_decode(batch, last_loc, page_), batch, last_loc, kCallAllocDecode, out);
}

void DevicePool::check_page_count(const char* arg, int64_t pages) const {
  if (pages > num_pages_)
    fail(arg, "names ", pages, " pages to free but the pool has ", num_pages_, ", so some page is freed twice");
}

void DevicePool::claim_slots(const int64_t* indices, int64_t n, const dev::Origin& origin) {
  if (token_mode()) check_page_count("indices", n);
  if (n == 0) return;
  control_->exec().run(n, dev::ClaimOp{view(), indices, dev::ClaimSource::kSlot, !token_mode(),
                                       token_mode() ? list_ : nullptr, origin});
}

void DevicePool::claim_segment(const int64_t* indices, int64_t n, int64_t start_pos, const dev::Origin& origin) {
  check_segment_start(start_pos, page_);
  const int64_t reps = page_.pages_for(n);
  check_page_count("indices", reps);
  if (reps == 0) return;
  control_->exec().run(reps, dev::ClaimOp{view(), indices, dev::ClaimSource::kSegmentRep, false, list_, origin});
}

void DevicePool::undo_claims() {
  control_->exec().run(num_pages_, dev::RestateOp{state_, dev::kClaimed, dev::kHeld});
}

Destination DevicePool::destination(bool by_index) const {
  return release_destination(group_open_, by_index, need_sort_, token_mode());
}

void DevicePool::release(const int64_t* pages, int64_t n, const int64_t* device_count, int64_t launch,
                         Destination dest, int64_t reset_word) {
  if (device_count == nullptr && n == 0) return;
  control_->exec().run(std::max<int64_t>(std::min(launch, num_pages_), 1),
                       dev::ReleaseOp{view(), pages, n, device_count, dest, reset_word});
  flip();
  if (reset_word == dev::kGroupIndexCount) group_index_count_ = 0;
  if (reset_word == dev::kGroupPageCount) group_page_count_ = 0;
  const bool counted = dest == Destination::kPrepend || dest == Destination::kAppend ||
                       dest == Destination::kStaged;
  if (device_count != nullptr) {
    if (counted) control_->start_count_readback();
    return;
  }
  switch (dest) {
    case Destination::kPrepend:
    case Destination::kAppend:
      free_count_ += n;
      break;
    case Destination::kStaged:
      staged_count_ += n;
      break;
    case Destination::kGroupIndex:
      group_index_count_ += n;
      break;
    case Destination::kGroupPages:
      group_page_count_ += n;
      break;
  }
}

void DevicePool::release_list(const int64_t* pages, int64_t n, bool by_index) {
  release(pages, n, nullptr, n, destination(by_index), -1);
}

void DevicePool::finish(bool by_index, int64_t count) {
  if (count == 0) return;
  if (!by_index || token_mode()) return release_list(list_, count, by_index);
  // free() of a page pool: the claimed pages in page order, however many there were.
  if (group_open_) {
    control_->exec().run(num_pages_, dev::RestateOp{state_, dev::kClaimed, dev::kQueuedByIndex});
    group_has_index_frees_ = true;
    return;
  }
  control_->exec().select_pages(state_, num_pages_, dev::kClaimed, dev::kClaimed, selected_, selected_count_);
  release(selected_, 0, selected_count_, count, destination(true), -1);
}

void DevicePool::free(const int64_t* indices, int64_t n) {
  control_->check_usable();
  claim_slots(indices, n, control_->origin(kCallFree, kArgIndices));
  control_->check_now([this] { undo_claims(); });
  finish(true, n);
}

void DevicePool::free_page_ids(const int64_t* pages, int64_t n) {
  control_->check_usable();
  check_page_count("page_ids", n);
  if (n == 0) return;
  control_->exec().run(n, dev::ClaimOp{view(), pages, dev::ClaimSource::kPageId, false, list_,
                                       control_->origin(kCallFreePageIds, kArgPageIds)});
  control_->check_now([this] { undo_claims(); });
  release_list(list_, n, false);
}

void DevicePool::free_segment(const int64_t* indices, int64_t n, int64_t start_pos) {
  control_->check_usable();
  claim_segment(indices, n, start_pos, control_->origin(kCallFreeSegment, kArgIndices));
  control_->check_now([this] { undo_claims(); });
  finish(false, page_.pages_for(n));
}

void DevicePool::free_group_begin() {
  check_group_begin(group_open_);
  group_open_ = true;
  group_has_index_frees_ = false;
}

void DevicePool::free_group_end(GroupOrder order) {
  check_group_end(group_open_);
  group_open_ = false;
  const auto by_index = [this] {
    if (token_mode()) {
      release(group_index_, group_index_count_, nullptr, group_index_count_, destination(true), dev::kGroupIndexCount);
    } else if (group_has_index_frees_) {
      control_->exec().select_pages(state_, num_pages_, dev::kQueuedByIndex, dev::kQueuedByIndex, selected_,
                                    selected_count_);
      release(selected_, 0, selected_count_, num_pages_, destination(true), -1);
    }
  };
  const auto by_page = [this] {
    release(group_pages_, group_page_count_, nullptr, group_page_count_, destination(false), dev::kGroupPageCount);
  };
  if (order == GroupOrder::kPageIdsFirst) {
    by_page();
    by_index();
  } else {
    by_index();
    by_page();
  }
  group_has_index_frees_ = false;
}

PagePool DevicePool::snapshot() {
  Executor& exec = control_->exec();
  int64_t ctl[dev::kCtlWords];
  exec.copy_to_host(ctl, control_->ctl(slot_) + parity_ * dev::kCtlWords, dev::kCtlWords);
  std::vector<int64_t> ring(static_cast<size_t>(num_pages_)), free_list(static_cast<size_t>(ctl[dev::kFreeCount]));
  exec.copy_to_host(ring.data(), ring_, num_pages_);
  for (int64_t k = 0; k < ctl[dev::kFreeCount]; ++k) free_list[k] = ring[(ctl[dev::kHead] + k) % num_pages_];
  const auto download = [&](const int64_t* src, int64_t n) {
    std::vector<int64_t> v(static_cast<size_t>(n));
    exec.copy_to_host(v.data(), src, n);
    return v;
  };
  std::vector<int64_t> state_words((num_pages_ + 2) / 2);
  exec.copy_to_host(state_words.data(), reinterpret_cast<const int64_t*>(state_), (num_pages_ + 2) / 2);
  const dev::StateWord* words = reinterpret_cast<const dev::StateWord*>(state_words.data());
  std::vector<PageState> state(static_cast<size_t>(num_pages_ + 1));
  std::vector<int64_t> queued_by_index =
      token_mode() ? download(group_index_, ctl[dev::kGroupIndexCount]) : std::vector<int64_t>();
  for (int64_t p = 0; p <= num_pages_; ++p) {
    state[p] = static_cast<PageState>(words[p]);
    if (!token_mode() && words[p] == dev::kQueuedByIndex) queued_by_index.push_back(p);
  }
  return PagePool::from_parts(size_, page_.size, need_sort_, free_list, download(staged_, ctl[dev::kStagedCount]),
                              std::move(state), group_open_, std::move(queued_by_index),
                              download(group_pages_, ctl[dev::kGroupPageCount]));
}

void DevicePool::restore(const PagePool& pool) {
  Executor& exec = control_->exec();
  const std::vector<int64_t> free_list = pool.free_pages();
  exec.copy_to_device(ring_, free_list.data(), static_cast<int64_t>(free_list.size()));
  const std::vector<int64_t>& staged = pool.staged_pages();
  exec.copy_to_device(staged_, staged.data(), static_cast<int64_t>(staged.size()));
  const std::vector<int64_t>& by_index = pool.group_index_pages();
  if (token_mode()) exec.copy_to_device(group_index_, by_index.data(), static_cast<int64_t>(by_index.size()));
  const std::vector<int64_t>& by_page = pool.group_page_ids();
  exec.copy_to_device(group_pages_, by_page.data(), static_cast<int64_t>(by_page.size()));
  std::vector<int64_t> state_words((num_pages_ + 2) / 2, 0);
  dev::StateWord* words = reinterpret_cast<dev::StateWord*>(state_words.data());
  for (int64_t p = 0; p <= num_pages_; ++p) words[p] = dev::state_word(pool.state(p));
  exec.copy_to_device(reinterpret_cast<int64_t*>(state_), state_words.data(), static_cast<int64_t>(state_words.size()));
  int64_t ctl[dev::kCtlWords] = {};
  ctl[dev::kFreeCount] = static_cast<int64_t>(free_list.size());
  ctl[dev::kStagedCount] = static_cast<int64_t>(staged.size());
  group_index_count_ = token_mode() ? static_cast<int64_t>(by_index.size()) : 0;
  group_page_count_ = static_cast<int64_t>(by_page.size());
  ctl[dev::kGroupIndexCount] = group_index_count_;
  ctl[dev::kGroupPageCount] = group_page_count_;
  exec.copy_to_device(control_->ctl(slot_), ctl, dev::kCtlWords);
  parity_ = 0;
  free_count_ = ctl[dev::kFreeCount];
  staged_count_ = ctl[dev::kStagedCount];
  base_unknown_ = false;
  group_open_ = pool.in_free_group();
  group_has_index_frees_ = !token_mode() && !by_index.empty();
}

// ---------------------------------------------------------------- DeviceHybridAllocator

DeviceHybridAllocator::DeviceHybridAllocator(std::shared_ptr<Executor> executor, int64_t size, int64_t size_swa,
                                             int64_t page_size, bool need_sort, bool debug, int64_t* mapping)
    : page_((check_hybrid_shape(size, size_swa, page_size), page_size)),
      control_(std::make_shared<DeviceControl>(std::move(executor), 2, debug)),
      full_(std::make_shared<DevicePool>(control_, 0, size, page_size, need_sort)),
      swa_(std::make_shared<DevicePool>(control_, 1, size_swa, page_size, need_sort)),
      mapping_(mapping),
      mapping_len_(HybridAllocator::mapping_size(size, page_size)) {
  full_pages_ = control_->exec().allocate(full_->num_pages());
  reset_mapping();
}

void DeviceHybridAllocator::reset_mapping() {
  std::vector<int64_t> mapping(static_cast<size_t>(mapping_len_), 0);
  mapping.back() = -1;  // last_loc == -1 translates to -1
  control_->exec().copy_to_device(mapping_, mapping.data(), mapping_len_);
}

int64_t DeviceHybridAllocator::available_size() {
  return hybrid_available_size(full_->available_size(), swa_->available_size());
}

bool DeviceHybridAllocator::new_pages_available(int64_t num_full_pages, int64_t num_swa_pages) {
  return swa::new_pages_available(num_full_pages, num_swa_pages, full_->available_pages(), swa_->available_pages());
}

bool DeviceHybridAllocator::allocate(const AllocPlan& plan, const BatchLengths& batch, const LastLoc& last_loc,
                                     DeviceCall call, OutBuffer& out) {
  const int64_t bs = batch.size();
  Executor& exec = control_->exec();
  dev::BatchView words{nullptr, bs};
  const auto check_last_loc = [&] {
    return dev::LastLocCheck{full_->view(), true, swa_->view(), mapping_, last_loc.data,
                             control_->origin(call, kArgLastLoc)};
  };
  if (control_->debug()) {  // a bad last_loc raises even where the pools are short, as on the CPU
    words.words = exec.upload(batch_words(batch, page_));
    exec.run(bs, dev::ValidateBatchOp{words, check_last_loc()});
    control_->check_now([] {});
  }
  if (hybrid_refused(plan, full_->available_pages(), swa_->available_pages())) return false;
  if (words.words == nullptr) words.words = exec.upload(batch_words(batch, page_));  // a refusal uploads nothing
  full_->merge_if_due(plan, PoolRole::kFull);
  swa_->merge_if_due(plan, PoolRole::kSwa);
  int64_t* slots = out.get(plan.num_tokens);
  if (plan.num_tokens > 0) {
    const int64_t swa_head = plan.call == AllocCall::kExtendSwaTail ? plan.swa_head_len() : -1;
    exec.run(plan.num_tokens,
             dev::AllocSlotsOp{words, check_last_loc(), plan.full_pages, plan.swa_pages, swa_head, mapping_, slots});
    full_->flip();
    swa_->flip();
  }
  full_->took(plan.full_pages);
  swa_->took(plan.swa_pages);
  return true;
}

bool DeviceHybridAllocator::alloc(int64_t need_size, OutBuffer& out) {
  control_->check_usable();
  const AllocPlan plan = plan_alloc(need_size, page_);
  const int64_t zero = 0;
  return allocate(plan, BatchLengths{Span(&zero, 1), Span(&need_size, 1), false}, LastLoc(), kCallAlloc, out);
}

bool DeviceHybridAllocator::alloc_extend(const BatchLengths& batch, const LastLoc& last_loc,
                                         int64_t extend_num_tokens, OutBuffer& out) {
  control_->check_usable();
  return allocate(plan_extend(batch, last_loc, extend_num_tokens, page_), batch, last_loc, kCallAllocExtend, out);
}

bool DeviceHybridAllocator::alloc_extend_swa_tail(const BatchLengths& batch, const LastLoc& last_loc,
                                                  int64_t extend_num_tokens, int64_t swa_tail_len, OutBuffer& out) {
  control_->check_usable();
  return allocate(plan_extend_swa_tail(batch, last_loc, extend_num_tokens, swa_tail_len, page_), batch, last_loc,
                  kCallAllocExtendSwaTail, out);
}

bool DeviceHybridAllocator::alloc_decode(const BatchLengths& batch, const LastLoc& last_loc, OutBuffer& out) {
  control_->check_usable();
  return allocate(plan_decode(batch, last_loc, page_), batch, last_loc, kCallAllocDecode, out);
}

void DeviceHybridAllocator::translate(const int64_t* indices, int64_t n, int64_t* out) {
  if (n == 0) return;
  control_->exec().run(n, dev::TranslateOp{mapping_, mapping_len_, indices, out,
                                           control_->origin(kCallTranslate, kArgKvIndices)});
  control_->check_now([] {});
}

void DeviceHybridAllocator::set_mapping(const int64_t* full_indices, int64_t n, const int64_t* swa_indices,
                                        int64_t n_swa) {
  control_->check_usable();
  if (swa_indices != nullptr && n_swa != n)
    fail("swa_indices", "has ", n_swa, " entries for ", n, " full indices");
  if (n == 0) return;
  const DeviceCall call = swa_indices != nullptr ? kCallSetMapping : kCallClearMapping;
  dev::SetMappingOp op{mapping_, full_->view(), swa_->view(), full_indices, swa_indices, true,
                       control_->origin(call, kArgFullIndices), control_->origin(call, kArgSwaIndices)};
  Executor& exec = control_->exec();
  if (control_->debug()) {
    exec.run(n, op);
    control_->check_now([] {});
  }
  op.validate_only = false;
  exec.run(n, op);
}

void DeviceHybridAllocator::clear_mapping(const int64_t* full_indices, int64_t n) {
  set_mapping(full_indices, n, nullptr, n);
}

void DeviceHybridAllocator::check_swa_claim(int64_t count, bool slots_of_page) const {
  if (slots_of_page) return;
  swa_->check_page_count("indices", count);
  full_->check_page_count("indices", count);
}

void DeviceHybridAllocator::claim_swa(const int64_t* input, int64_t count, bool slots_of_page,
                                      const dev::Origin& origin) {
  if (count == 0) return;
  control_->exec().run(count, dev::ClaimSwaOp{full_->view(), swa_->view(), mapping_, input, slots_of_page,
                                              swa_->list(), full_pages_, origin});
}

void DeviceHybridAllocator::finish_swa(const int64_t* indices, int64_t n, int64_t reps, bool slots_of_page,
                                       bool by_index) {
  Executor& exec = control_->exec();
  if (slots_of_page) {
    if (n > 0) exec.run(n, dev::ClearMappedPagesOp{mapping_, page_, full_->num_pages(), indices, true});
    swa_->finish(by_index, n * page_.size);
  } else {
    if (reps > 0) exec.run(reps, dev::ClearMappedPagesOp{mapping_, page_, full_->num_pages(), full_pages_, false});
    swa_->finish(by_index, reps);
  }
}

void DeviceHybridAllocator::free(const int64_t* indices, int64_t n) {
  control_->check_usable();
  const dev::Origin origin = control_->origin(kCallFree, kArgIndices);
  const bool slots_of_page = !swa_free_by_segment(page_.size);
  check_swa_claim(n, slots_of_page);  // every host-side check before the first launch
  full_->claim_slots(indices, n, origin);
  claim_swa(indices, n, slots_of_page, origin);
  control_->check_now([this] { undo_claims(); });
  finish_swa(indices, n, n, slots_of_page, true);
  full_->finish(true, n);
}

void DeviceHybridAllocator::free_swa(const int64_t* indices, int64_t n) {
  control_->check_usable();
  const bool slots_of_page = !swa_free_by_segment(page_.size);
  check_swa_claim(n, slots_of_page);
  claim_swa(indices, n, slots_of_page, control_->origin(kCallFreeSwa, kArgIndices));
  control_->check_now([this] { undo_claims(); });
  finish_swa(indices, n, n, slots_of_page, true);
}

void DeviceHybridAllocator::free_full(const int64_t* indices, int64_t n) {
  control_->check_usable();
  full_->claim_slots(indices, n, control_->origin(kCallFreeFull, kArgIndices));
  control_->check_now([this] { undo_claims(); });
  full_->finish(true, n);
}

void DeviceHybridAllocator::free_segment(const int64_t* indices, int64_t n, int64_t start_pos) {
  control_->check_usable();
  const dev::Origin origin = control_->origin(kCallFreeSegment, kArgIndices);
  const int64_t reps = page_.pages_for(n);
  check_swa_claim(reps, false);  // every host-side check before the first launch
  full_->claim_segment(indices, n, start_pos, origin);
  claim_swa(indices, reps, false, origin);
  control_->check_now([this] { undo_claims(); });
  finish_swa(indices, n, reps, false, false);
  full_->finish(false, reps);
}

void DeviceHybridAllocator::free_swa_segment(const int64_t* indices, int64_t n, int64_t start_pos) {
  control_->check_usable();
  check_segment_start(start_pos, page_);
  const int64_t reps = page_.pages_for(n);
  check_swa_claim(reps, false);
  claim_swa(indices, reps, false, control_->origin(kCallFreeSwaSegment, kArgIndices));
  control_->check_now([this] { undo_claims(); });
  finish_swa(indices, n, reps, false, false);
}

void DeviceHybridAllocator::free_full_segment(const int64_t* indices, int64_t n, int64_t start_pos) {
  control_->check_usable();
  full_->claim_segment(indices, n, start_pos, control_->origin(kCallFreeFullSegment, kArgIndices));
  control_->check_now([this] { undo_claims(); });
  full_->finish(false, page_.pages_for(n));
}

void DeviceHybridAllocator::free_group_begin() {
  check_group_begin(full_->in_free_group() || swa_->in_free_group());
  full_->free_group_begin();
  swa_->free_group_begin();
}

void DeviceHybridAllocator::free_group_end() {
  check_group_end(full_->in_free_group() && swa_->in_free_group());
  swa_->free_group_end(kSwaGroupOrder);
  full_->free_group_end(kPoolGroupOrder);
}

void DeviceHybridAllocator::evict_out_of_window(const int32_t* req_to_token32, const int64_t* req_to_token64,
                                                int64_t num_rows, int64_t row_len, Span rows, Span pre_lens,
                                                Span evicted_seqlens, int64_t window, int64_t interval,
                                                bool prefix_sharing, int64_t* new_evicted) {
  control_->check_usable();
  plan_window_eviction(num_rows, row_len, rows, pre_lens, evicted_seqlens, window, interval, prefix_sharing,
                       page_.size, new_evicted);
  std::vector<int64_t> page_begin{0}, row, evicted;
  for (int64_t j = 0; j < rows.size; ++j) {
    if (new_evicted[j] == evicted_seqlens[j]) continue;
    page_begin.push_back(page_begin.back() + page_.page(new_evicted[j] - evicted_seqlens[j]));
    row.push_back(rows[j]);
    evicted.push_back(evicted_seqlens[j]);
  }
  const int64_t num_due = static_cast<int64_t>(row.size()), total = page_begin.back();
  swa_->check_page_count("req_to_token", total);
  full_->check_page_count("req_to_token", total);
  if (total == 0) return;
  // Each due request is released as one free_swa_segment call after another would be:
  // successive prepends put the last request's pages first.
  const bool prepend = release_destination(swa_->in_free_group(), false, swa_->need_sort(), swa_->token_mode()) ==
                       Destination::kPrepend;
  std::vector<int64_t> due = page_begin;
  due.insert(due.end(), row.begin(), row.end());
  due.insert(due.end(), evicted.begin(), evicted.end());
  for (int64_t j = 0; j < num_due; ++j) due.push_back(prepend ? total - page_begin[j + 1] : page_begin[j]);
  Executor& exec = control_->exec();
  const int64_t* due_device = exec.upload(due);
  exec.run(total, dev::ClaimEvictedOp{full_->view(), swa_->view(), mapping_, req_to_token32, req_to_token64, row_len,
                                      due_device, num_due, swa_->list(), full_pages_,
                                      control_->origin(kCallEvict, kArgReqToToken)});
  control_->check_now([this] { undo_claims(); });
  exec.run(total, dev::ClearMappedPagesOp{mapping_, page_, full_->num_pages(), full_pages_, false});
  swa_->release_list(swa_->list(), total, false);
}

void DeviceHybridAllocator::clear() {
  full_->clear();
  swa_->clear();
  reset_mapping();
  control_->reset();
}

void DeviceHybridAllocator::resize(int64_t size, int64_t size_swa) {
  check_hybrid_resize(size, size_swa, page_.size, full_->capacity(), swa_->capacity());
  full_->resize(size, "size");
  swa_->resize(size_swa, "size_swa");
  reset_mapping();
  control_->reset();
}

HybridAllocator::State DeviceHybridAllocator::backup_state() {
  control_->raise_found_errors();
  std::vector<int64_t> mapping(static_cast<size_t>(mapping_len_));
  control_->exec().copy_to_host(mapping.data(), mapping_, mapping_len_);
  return HybridAllocator::State{full_->snapshot(), swa_->snapshot(), std::move(mapping)};
}

void DeviceHybridAllocator::restore_state(const HybridAllocator::State& state) {
  check_state_shape("an allocator", state.fits(full_->size(), swa_->size(), page_.size, mapping_len_));
  full_->restore(state.full);
  swa_->restore(state.swa);
  control_->exec().copy_to_device(mapping_, state.mapping.data(), mapping_len_);
  control_->reset();
}

void DeviceHybridAllocator::check_invariants() {
  const HybridAllocator::State state = backup_state();
  HybridAllocator::check_invariants(state.full, state.swa, state.mapping.data(), mapping_len_);
}

std::string DeviceHybridAllocator::debug_string() {
  const HybridAllocator::State state = backup_state();
  return HybridAllocator::debug_string(state.full, state.swa);
}

}  // namespace swa
