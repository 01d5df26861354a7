// swa_ext._C.sglang: the decode branch of SGLang's ScheduleBatch.maybe_evict_swa for a
// whole batch, as swa_ext/sglang/hooks.py calls it every decode step. The batch is read
// by batch_reader.cpp; the allocator is called through the core's public API, under the
// binding layer's guard (../torch/extension_modules.h).
#include <memory>
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

constexpr char kAdmitDoc[] =
    "Lets evict_batch evict the decode batches of one scheduler: those whose tree_cache and\n"
    "token_to_kv_pool_allocator are these objects and whose forward_mode is decode_mode, with this\n"
    "window, interval and prefix_sharing, as long as each (source, key, value) of `settings` still\n"
    "reads value: source.get(key) for a dict (None: absent), getattr(source, key) otherwise, compared\n"
    "by identity. swa_ext.sglang.hooks admits what it has checked; an admission replaces the last.";

constexpr char kWithdrawDoc[] = "Forgets the admission: evict_batch evicts nothing until the next admit.";

constexpr char kCountersDoc[] =
    "What evict and evict_batch did in this process: {'batches': batches evicted (nothing to\n"
    "refuse), 'admitted_batches': those of them evict_batch evicted, 'freeing_batches': those in which\n"
    "a request freed pages, 'freed_requests': the requests that freed pages}.";

// METH_O: its signature line is Python's, for inspect.
constexpr char kEvictBatchDoc[] =
    "evict_batch($self, batch, /)\n--\n\n"
    "Evicts a decode ScheduleBatch as evict would, from the batch itself (its reqs and its\n"
    "req_to_token_pool's req_to_token) and what admit was given, when the batch is admitted: returns\n"
    "None when evicted, a str saying why SGLang's own loop must evict it (nothing changed), or False\n"
    "when admit did not cover it (another scheduler's batch, another forward mode, a setting that\n"
    "reads another value, or no admission), nothing read beyond that. One call a decode step: it is\n"
    "a plain CPython method, without pybind11's argument matching.";

// An attribute name interned once: the lookups then compare pointers.
PyObject* interned_name(const char* name) {
  PyObject* str = PyUnicode_InternFromString(name);
  if (str == nullptr) throw py::error_already_set();
  return str;  // kept for the process
}

// obj.name, or error_already_set as Python raises it.
py::object attribute(py::handle obj, PyObject* name) {
  PyObject* value = PyObject_GetAttr(obj.ptr(), name);
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

// What admit was given: one scheduler's objects, the eviction's parameters, and the
// settings they were decided under with the values read then.
struct Admission {
  struct Setting {
    py::object source, key, value;
    bool in_dict;  // read as source.get(key), else as getattr(source, key)
    bool reads_as_admitted() const {
      if (!in_dict) return attribute(source, key.ptr()).ptr() == value.ptr();
      PyObject* now = PyDict_GetItemWithError(source.ptr(), key.ptr());
      if (now == nullptr && PyErr_Occurred()) throw py::error_already_set();
      return (now == nullptr ? Py_None : now) == value.ptr();
    }
  };
  py::object tree_cache, allocator, decode_mode;
  swa_bindings::HybridRef alloc;
  int64_t window, interval;
  bool prefix_sharing;
  std::vector<Setting> settings;
};

class WindowEviction {
 public:
  WindowEviction(py::object req_type, py::object kv_type, py::object swa_component)
      : classes_(std::move(req_type), std::move(kv_type), std::move(swa_component)) {}

  py::object evict(const py::object& allocator, const py::object& reqs, const py::object& req_to_token,
                   int64_t window, int64_t interval, bool prefix_sharing, bool free_group, const py::object& record) {
    const swa_bindings::HybridRef alloc("allocator", allocator);
    check_parameters(window, interval);
    if (!record.is_none() && !PyList_Check(record.ptr())) throw py::type_error("record: expected a list or None");
    return evict_with(alloc, reqs, req_to_token, window, interval, prefix_sharing, free_group, record.ptr());
  }

  void admit(const py::object& tree_cache, const py::object& allocator, const py::object& decode_mode,
             int64_t window, int64_t interval, bool prefix_sharing, const py::object& settings) {
    check_parameters(window, interval);
    auto admitted = std::make_shared<Admission>(Admission{tree_cache, allocator, decode_mode,
                                                          swa_bindings::HybridRef("allocator", allocator), window,
                                                          interval, prefix_sharing, {}});
    if (!PyList_Check(settings.ptr())) throw py::type_error("settings: expected a list of (source, key, value)");
    for (const py::handle entry : settings) {
      if (!PyTuple_Check(entry.ptr()) || PyTuple_GET_SIZE(entry.ptr()) != 3)
        throw py::type_error("settings: expected a list of (source, key, value)");
      const py::tuple setting = py::reinterpret_borrow<py::tuple>(entry);
      const bool in_dict = PyDict_Check(setting[0].ptr());
      if (!in_dict && !PyUnicode_Check(setting[1].ptr()))
        throw py::type_error("settings: an attribute's key must be a str");
      admitted->settings.push_back(Admission::Setting{setting[0], setting[1], setting[2], in_dict});
    }
    admitted_ = std::move(admitted);
  }

  void withdraw() { admitted_.reset(); }

  py::dict counters() const {
    py::dict out;
    out["batches"] = batches_;
    out["admitted_batches"] = admitted_batches_;
    out["freeing_batches"] = freeing_batches_;
    out["freed_requests"] = freed_requests_;
    return out;
  }

  // evict_batch's work: False when the admission does not cover the batch.
  py::object evict_batch(py::handle batch) {
    // Held for the call: a CUDA allocator's wait lets another thread in to admit.
    const std::shared_ptr<const Admission> admitted = admitted_;
    static PyObject* const tree_cache = interned_name("tree_cache");
    static PyObject* const allocator = interned_name("token_to_kv_pool_allocator");
    static PyObject* const forward_mode = interned_name("forward_mode");
    static PyObject* const reqs = interned_name("reqs");
    static PyObject* const req_to_token_pool = interned_name("req_to_token_pool");
    static PyObject* const req_to_token = interned_name("req_to_token");
    if (!admitted || attribute(batch, tree_cache).ptr() != admitted->tree_cache.ptr() ||
        attribute(batch, allocator).ptr() != admitted->allocator.ptr() ||
        attribute(batch, forward_mode).ptr() != admitted->decode_mode.ptr())
      return py::bool_(false);
    for (const Admission::Setting& setting : admitted->settings)
      if (!setting.reads_as_admitted()) return py::bool_(false);
    py::object reason = evict_with(admitted->alloc, attribute(batch, reqs),
                                   attribute(attribute(batch, req_to_token_pool), req_to_token), admitted->window,
                                   admitted->interval, admitted->prefix_sharing, true, Py_None);
    admitted_batches_ += reason.is_none();
    return reason;
  }

 private:
  // A request's lengths may be anything below 2**62 here (the reader refuses the rest),
  // so these are bounded too: then the due test cannot overflow.
  static void check_parameters(int64_t window, int64_t interval) {
    for (const auto& [arg, value] : {std::pair<const char*, int64_t>{"window", window}, {"interval", interval}})
      if (swa::check_at_least_one(arg, value) >= swa_sglang::kMaxLength)
        swa::fail(arg, "must be below 2**62, got ", value);
  }

  // The lists of a call are its own: a CUDA allocator's wait lets another thread in with
  // the same reader.
  py::object evict_with(const swa_bindings::HybridRef& alloc, const py::object& reqs, const py::object& req_to_token,
                        int64_t window, int64_t interval, bool prefix_sharing, bool free_group, PyObject* record) {
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
    if (record != Py_None)
      for (size_t j = 0; j < due.size(); ++j)
        if (PyList_Append(record, py::make_tuple(due[j].index, due[j].start, new_evicted[j]).ptr()) != 0)
          throw py::error_already_set();
    ++batches_;
    freeing_batches_ += !freeing.empty();
    freed_requests_ += static_cast<int64_t>(freeing.size());
    return py::none();
  }

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
  std::shared_ptr<const Admission> admitted_;
  int64_t batches_ = 0, admitted_batches_ = 0, freeing_batches_ = 0, freed_requests_ = 0;
};

// WindowEviction's pybind11 record, for evict_batch's own entry.
const py::detail::type_info* window_eviction_type = nullptr;

// evict_batch as a METH_O method: the scheduler calls it every decode step, and
// pybind11's dispatch (matching the call against the signature, converting each argument)
// costs several microseconds on the cold caches a model's forward pass leaves.
PyObject* evict_batch_entry(PyObject* self, PyObject* batch) {
  try {
    // The method descriptor has checked that self is a WindowEviction (or a subclass).
    const py::detail::value_and_holder held =
        reinterpret_cast<py::detail::instance*>(self)->get_value_and_holder(window_eviction_type, false);
    if (!held || !held.holder_constructed()) throw py::type_error("evict_batch: WindowEviction.__init__ was not called");
    return held.value_ptr<WindowEviction>()->evict_batch(batch).release().ptr();
  } catch (...) {
    py::detail::try_translate_exceptions();
    return nullptr;
  }
}

PyMethodDef evict_batch_method = {"evict_batch", evict_batch_entry, METH_O, kEvictBatchDoc};

void define(py::module_& m) {
  m.doc() = kModuleDoc;
  py::class_<WindowEviction> cls(m, "WindowEviction", kWindowEvictionDoc);
  cls.def(py::init<py::object, py::object, py::object>(), py::arg("req_type"), py::arg("kv_type"),
          py::arg("swa_component"))
      .def("evict", &WindowEviction::evict, kEvictDoc, py::arg("allocator"), py::arg("reqs"), py::arg("req_to_token"),
           py::arg("window"), py::arg("interval"), py::arg("prefix_sharing"), py::kw_only(),
           py::arg("free_group") = true, py::arg("record") = py::none())
      .def("admit", &WindowEviction::admit, kAdmitDoc, py::arg("tree_cache"), py::arg("allocator"),
           py::arg("decode_mode"), py::arg("window"), py::arg("interval"), py::arg("prefix_sharing"),
           py::arg("settings"))
      .def("withdraw", &WindowEviction::withdraw, kWithdrawDoc)
      .def("counters", &WindowEviction::counters, kCountersDoc);
  window_eviction_type = py::detail::get_type_info(typeid(WindowEviction));
  PyObject* method = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), &evict_batch_method);
  if (method == nullptr) throw py::error_already_set();
  cls.attr("evict_batch") = py::reinterpret_steal<py::object>(method);
}

[[maybe_unused]] const bool registered = swa_bindings::register_submodule("sglang", &define);

}  // namespace
