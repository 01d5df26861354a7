// Errors of the core. ArgumentError becomes Python's ValueError through pybind11
// (it derives from std::invalid_argument); its message starts with the argument name.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

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

}  // namespace swa
