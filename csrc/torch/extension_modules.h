// What the extension's engine modules (csrc/sglang) use of the binding layer: a submodule
// of swa_ext._C defined from their own file, and the hybrid allocator behind a
// _C.HybridAllocator object, called through the core's public API under the guard that
// every changing call of the binding takes.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <functional>

#include "../core/allocator.h"

namespace swa_bindings {

// Adds swa_ext._C.<name>, made by `define` when the extension loads, after the
// allocator's classes (so its functions may take them). Call it from a static
// initializer in the module's own file.
bool register_submodule(const char* name, void (*define)(pybind11::module_& submodule));

struct HybridHandle;  // bindings.cpp's _C.HybridAllocator

// The allocator of a _C.HybridAllocator object, as long as that object lives.
class HybridRef {
 public:
  // TypeError naming `arg` when obj is not a _C.HybridAllocator.
  HybridRef(const char* arg, pybind11::handle obj);
  int64_t page_size() const;
  // req_to_token checked as the allocator's evict_out_of_window checks it: a contiguous
  // 2-D int32 or int64 tensor on the allocator's device.
  swa::SlotRows slot_rows(pybind11::handle req_to_token) const;
  // Runs body on the allocator with its guard held, then (SWA_EXT_DEBUG) checks its
  // invariants, as every changing call does.
  void guarded(const std::function<void(swa::HybridAllocator&)>& body) const;

 private:
  HybridHandle* handle_;
};

}  // namespace swa_bindings
