// swa_ext._C.sglang: the decode branch of SGLang's ScheduleBatch.maybe_evict_swa for a
// whole batch, as swa_ext/sglang/hooks.py calls it every decode step. The batch is read
// by batch_reader.cpp; the allocator is called through the core's public API, under the
// binding layer's guard (../torch/extension_modules.h).
#include <string>
#include <utility>
#include <vector>

#include "../core/allocator.h"
#include "../core/plan.h"
#include "../torch/extension_modules.h"
#include "batch_reader.h"

namespace py = pybind11;

namespace {

constexpr char kModuleDoc[] =
    "SGLang's decode-step window eviction on swa_ext's allocator (swa_ext.sglang.hooks).";

constexpr char kWindowEvictionDoc[] =
    "The decode branch of SGLang's ScheduleBatch.maybe_evict_swa for a whole batch, read from\n"
    "SGLang's own objects (swa_ext.sglang.hooks makes one when it installs). req_type, kv_type:\n"
    "SGLang's Req and ReqKvInfo classes; only requests of exactly these types are read.\n"
    "swa_component: ComponentType.SWA, the key of a request's SWA evicted length.";

constexpr char kEvictDoc[] =
    "Evicts the decode batch `reqs` (a list of Req): each request with decode_batch_idx >= 1, a\n"
    "req_to_token row and at least `interval` tokens out of its window since its SWA evicted\n"
    "length frees its SWA pages in [max(evicted, swa_dead_lo), the window's page-aligned start)\n"
    "through the allocator's evict_out_of_window, in batch order, and gets its evicted length set\n"
    "as SGLang's free_swa_out_of_window_slots sets it. Returns None, or a str saying why SGLang's\n"
    "own loop must evict this batch (a request or length it does not read, lengths the allocator\n"
    "refuses), nothing changed then. free_group: open and close the free group around the frees\n"
    "(false: the caller holds one open); no group is opened when no due request frees a page.\n"
    "record: None or a list that gets an (index, start, evicted length after) tuple for each due\n"
    "request.";

class WindowEviction {
 public:
  WindowEviction(py::object req_type, py::object kv_type, py::object swa_component)
      : classes_(std::move(req_type), std::move(kv_type), std::move(swa_component)) {}

  // The lists of a call are its own: a CUDA allocator's wait lets another thread in with
  // the same reader.
  py::object evict(const py::object& allocator, const py::object& reqs, const py::object& req_to_token,
                   int64_t window, int64_t interval, bool prefix_sharing, bool free_group,
                   const py::object& record) const {
    const swa_bindings::HybridRef alloc("allocator", allocator);
    // A request's lengths may be anything below 2**62 here (the reader refuses the rest),
    // so these are bounded too: then the due test cannot overflow.
    for (const auto& [arg, value] : {std::pair<const char*, int64_t>{"window", window}, {"interval", interval}})
      if (swa::check_at_least_one(arg, value) >= swa_sglang::kMaxLength)
        swa::fail(arg, "must be below 2**62, got ", value);
    if (!record.is_none() && !PyList_Check(record.ptr())) throw py::type_error("record: expected a list or None");
    const swa::PageGeometry page(alloc.page_size());
    swa_sglang::DueRequests due;
    const std::string reason = swa_sglang::read_due_requests(classes_, reqs, window, interval, page, due);
    if (!reason.empty()) return py::str(reason);
    // A due request frees pages only once its window's page-aligned start has passed
    // where its frees start (rules.h's window rule); the others only have their evicted
    // length moved there, and take no part in the plan or the free group. At interval 1
    // that is most of them: a request frees a page every page_size steps.
    std::vector<int64_t> new_evicted(due.size()), rows, pre_lens, starts;
    std::vector<size_t> freeing;
    for (size_t j = 0; j < due.size(); ++j) {
      new_evicted[j] = due[j].start;
      if (swa::evicted_after_step(due[j].start, due[j].pre_len, window, page, 1, prefix_sharing) == due[j].start)
        continue;
      freeing.push_back(j);
      rows.push_back(due[j].row);
      pre_lens.push_back(due[j].pre_len);
      starts.push_back(due[j].start);
    }
    if (!freeing.empty()) {
      std::vector<int64_t> freed_to(freeing.size());
      std::string refused;
      alloc.guarded([&](swa::HybridAllocator& a) {
        refused = free_out_of_window(a, alloc.slot_rows(req_to_token), rows, pre_lens, starts, window, prefix_sharing,
                                     free_group, freed_to.data());
      });
      if (!refused.empty()) return py::str("the native call refused this batch (" + refused + ")");
      for (size_t k = 0; k < freeing.size(); ++k) new_evicted[freeing[k]] = freed_to[k];
    }
    swa_sglang::write_evicted_lengths(classes_, due, new_evicted.data());
    if (!record.is_none())
      for (size_t j = 0; j < due.size(); ++j)
        if (PyList_Append(record.ptr(), py::make_tuple(due[j].index, due[j].start, new_evicted[j]).ptr()) != 0)
          throw py::error_already_set();
    return py::none();
  }

 private:
  // The frees, inside the allocator's guard; "" or why the allocator refused them
  // (before any change).
  static std::string free_out_of_window(swa::HybridAllocator& a, const swa::SlotRows& table,
                                        const std::vector<int64_t>& rows, const std::vector<int64_t>& pre_lens,
                                        const std::vector<int64_t>& starts, int64_t window, bool prefix_sharing,
                                        bool free_group, int64_t* freed_to) {
    if (free_group) a.free_group_begin();
    try {
      a.evict_out_of_window(table, rows, pre_lens, starts, window, 1, prefix_sharing, freed_to);
    } catch (const swa::ArgumentError& refused) {
      if (free_group) a.free_group_end();  // the group is empty: nothing was freed
      return refused.what();
    } catch (...) {
      if (free_group) end_group_after_failure(a);
      throw;
    }
    if (free_group) a.free_group_end();
    return std::string();
  }
  static void end_group_after_failure(swa::HybridAllocator& a) {
    try {
      a.free_group_end();
    } catch (...) {  // the first error is the one to report
    }
  }

  const swa_sglang::RequestClasses classes_;
};

void define(py::module_& m) {
  m.doc() = kModuleDoc;
  py::class_<WindowEviction>(m, "WindowEviction", kWindowEvictionDoc)
      .def(py::init<py::object, py::object, py::object>(), py::arg("req_type"), py::arg("kv_type"),
           py::arg("swa_component"))
      .def("evict", &WindowEviction::evict, kEvictDoc, py::arg("allocator"), py::arg("reqs"), py::arg("req_to_token"),
           py::arg("window"), py::arg("interval"), py::arg("prefix_sharing"), py::kw_only(),
           py::arg("free_group") = true, py::arg("record") = py::none());
}

[[maybe_unused]] const bool registered = swa_bindings::register_submodule("sglang", &define);

}  // namespace
