#include "errors.h"

namespace swa {

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

const char* claim_refusal(PageState state, const PageKind& kind) {
  switch (state) {
    case PageState::kFree:
    case PageState::kStaged:
      return " is already free (double free)";
    case PageState::kQueuedByIndex:
    case PageState::kQueuedByPage:
    case PageState::kQueuedByIndexSwa:
      return " is already freed in the open free group (double free)";
    case PageState::kHeld:
    case PageState::kHeldSwa:  // not this pool's kind: the shared mode's other side holds it
      return state == PageState::kHeld ? " holds full KV, not SWA KV (freed as the wrong kind)"
                                       : " holds SWA KV, not full KV (freed as the wrong kind)";
    default:
      return state == kind.claimed ? " is freed twice in one call" : " is freed as both kinds in one call";
  }
}

std::string swa_continuation_message(int64_t entry, int64_t last_loc, int64_t swa_last) {
  std::ostringstream m;
  m << "last_loc: entry " << entry << " (" << last_loc << ")";
  if (swa_last <= 0) m << " has no SWA slot to continue its partial page (evicted?)";
  else m << " maps to SWA slot " << swa_last << ", which is not a live slot at the same page offset";
  return m.str();
}

std::string untranslatable_message(int64_t entry, int64_t slot, int64_t mapping_len) {
  std::ostringstream m;
  m << "kv_indices: entry " << entry << " (" << slot << ") is outside [-1, " << mapping_len - 1 << ")";
  return m.str();
}

}  // namespace swa
