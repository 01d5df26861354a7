// Errors of the core. ArgumentError becomes Python's ValueError through pybind11
// (it derives from std::invalid_argument); its message starts with the argument name.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

#include "rules.h"

namespace swa {

struct ArgumentError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// Raised when two threads call one allocator at once (see ConcurrencyGuard).
struct ConcurrentUseError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <class... Parts>
[[noreturn]] void fail(const char* arg, const Parts&... parts) {
  std::ostringstream msg;
  msg << arg << ": ";
  (msg << ... << parts);
  throw ArgumentError(msg.str());
}

// The messages of the checks of index values, made by the host store at once and by the
// device's ops into an error record: one text for both.
std::string last_loc_fault_message(LastLocFault fault, int64_t entry, int64_t last_loc, int64_t prefix_len,
                                   const PageGeometry& page, int64_t num_pages);
// Why a page in `state` cannot be freed now by a pool holding pages of `kind`.
const char* claim_refusal(PageState state, const PageKind& kind);
// A request whose partial page has no live SWA slot to continue.
std::string swa_continuation_message(int64_t entry, int64_t last_loc, int64_t swa_last);
// A kv_indices entry that translate_loc_from_full_to_swa cannot translate.
std::string untranslatable_message(int64_t entry, int64_t slot, int64_t mapping_len);
// Why a full slot freed by page representative cannot free an SWA page.
constexpr const char* kUnmappedRefusal = " has no SWA slot (already evicted or never mapped)";

}  // namespace swa
