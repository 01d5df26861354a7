#include "batch_reader.h"

#include <structmember.h>

namespace swa_sglang __attribute__((visibility("hidden"))) {

namespace {

// A KV state's fields the reader reads, in RequestClasses::KvField order, and as errors name them.
constexpr const char* kKvFields[] = {"req_pool_idx", "component_evicted_seqlens", "cache_protected_len",
                                     "swa_evict_floor"};
constexpr const char* kKvFieldLabels[] = {"kv.req_pool_idx", "kv.component_evicted_seqlens",
                                          "kv.cache_protected_len", "kv.swa_evict_floor"};

// A Req's attributes the reader reads from its instance dict, in RequestFields order.
constexpr const char* kReqFields[] = {"decode_batch_idx", "kv", "origin_input_ids", "output_ids"};
constexpr int kNumReqFields = 4;

// The attribute names, interned once (the lookups then compare pointers).
struct Names {
  PyObject* req_fields[kNumReqFields];
  PyObject* kv_fields[RequestClasses::kNumKvFields];
  Names() {
    for (int f = 0; f < kNumReqFields; ++f) req_fields[f] = PyUnicode_InternFromString(kReqFields[f]);
    for (int f = 0; f < RequestClasses::kNumKvFields; ++f) kv_fields[f] = PyUnicode_InternFromString(kKvFields[f]);
  }
};
const Names& names() {
  static const Names interned;  // made under the GIL on the first call, kept for the process
  return interned;
}

// Why the reader stopped: the batch goes to SGLang's loop with this reason.
struct Refusal {
  std::string reason;
};

std::string type_name(PyObject* obj) { return Py_TYPE(obj)->tp_name; }

// A Python exception raised by an attribute read, as a refusal (SGLang's loop then reads
// the same attribute and raises it where SGLang would).
[[noreturn]] void refuse_on_python_error(int64_t index, const char* what) {
  py::error_already_set error;
  throw Refusal{"reading request " + std::to_string(index) + "'s " + what + " raised " + error.what()};
}

// The Req attributes the reader reads, from the request's instance dict: the class
// defines none of these names (RequestClasses checks), so this is what the attribute
// reads would find. Looked up together, before any is used: the lookups do not depend on
// each other, so their cache misses overlap. A missing one is refused where it is needed
// (SGLang reads output_ids only of a request past its first decode step).
struct RequestFields {
  py::object decode_batch_idx, kv, origin_input_ids, output_ids;
};

RequestFields request_fields(PyObject* req_dict, int64_t index) {
  const Names& name = names();
  PyObject* found[kNumReqFields];
  for (int f = 0; f < kNumReqFields; ++f) found[f] = PyDict_GetItemWithError(req_dict, name.req_fields[f]);
  if (PyErr_Occurred()) refuse_on_python_error(index, "attributes");
  const auto held = [](PyObject* value) { return py::reinterpret_borrow<py::object>(value); };
  return RequestFields{held(found[0]), held(found[1]), held(found[2]), held(found[3])};
}

PyObject* required(const py::object& value, int64_t index, const char* what) {
  if (!value) throw Refusal{"request " + std::to_string(index) + " has no " + what};
  return value.ptr();
}

py::object attr(PyObject* obj, PyObject* name, int64_t index, const char* what) {
  PyObject* value = PyObject_GetAttr(obj, name);
  if (value == nullptr) refuse_on_python_error(index, what);
  return py::reinterpret_steal<py::object>(value);
}

// A field of a request's KV state: from its slot where ReqKvInfo keeps it in one (what
// the attribute read finds there, without the lookup), else through the attribute.
py::object kv_field(const RequestClasses& classes, PyObject* kv, RequestClasses::KvField field, int64_t index) {
  const Py_ssize_t offset = classes.kv_slot_offsets[field];
  if (offset < 0) return attr(kv, names().kv_fields[field], index, kKvFieldLabels[field]);
  PyObject* value = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(kv) + offset);
  if (value == nullptr) throw Refusal{"request " + std::to_string(index) + " has no " + kKvFieldLabels[field]};
  return py::reinterpret_borrow<py::object>(value);
}

// An int (or anything with __index__, a numpy integer say) as a long long; overflow: the
// sign of a value past its range (then the value is meaningless), else 0.
long long int_value(PyObject* value, int64_t index, const char* what, int& overflow) {
  overflow = 0;
  long long v;
  if (PyLong_Check(value)) {
    v = PyLong_AsLongLongAndOverflow(value, &overflow);
  } else {
    const py::object held = py::reinterpret_borrow<py::object>(value);  // __index__ may run Python code
    const py::object as_int = py::reinterpret_steal<py::object>(PyNumber_Index(value));
    if (!as_int) refuse_on_python_error(index, what);
    v = PyLong_AsLongLongAndOverflow(as_int.ptr(), &overflow);
  }
  if (v == -1 && PyErr_Occurred()) refuse_on_python_error(index, what);
  return v;
}

// An int in [lo, kMaxLength).
int64_t length(PyObject* value, int64_t lo, int64_t index, const char* what) {
  int overflow;
  const long long v = int_value(value, index, what, overflow);
  if (overflow != 0 || v < lo || v >= kMaxLength)
    throw Refusal{"request " + std::to_string(index) + "'s " + what + " is outside [" + std::to_string(lo) +
                  ", 2**62)"};
  return v;
}

// decode_batch_idx >= 1: under the overlap scheduler the extend batch before a request's
// first decode step may still be running.
bool past_first_decode(PyObject* value, int64_t index) {
  int overflow;
  const long long v = int_value(value, index, "decode_batch_idx", overflow);
  return overflow > 0 || (overflow == 0 && v >= 1);
}

// Req.seqlen: the prompt's tokens and the output's, the last of which has no KV yet.
int64_t seqlen(const RequestFields& req, int64_t index) {
  int64_t tokens = 0;
  const std::pair<const py::object*, const char*> token_lists[] = {{&req.origin_input_ids, "origin_input_ids"},
                                                                  {&req.output_ids, "output_ids"}};
  for (const auto& [ids, label] : token_lists) {
    const Py_ssize_t n = PyObject_Size(required(*ids, index, label));  // a list's or array's length
    if (n < 0) refuse_on_python_error(index, label);
    tokens += n;
  }
  if (tokens < 1) throw Refusal{"request " + std::to_string(index) + " has no tokens (seqlen 0)"};
  return tokens;
}

// The SWA entry of a request's evicted lengths, or nullptr (ReqKvInfo.get_evicted_seqlen: 0).
PyObject* evicted_entry(const RequestClasses& classes, PyObject* lengths, int64_t index) {
#if PY_VERSION_HEX < 0x030D0000
  PyObject* value = _PyDict_GetItem_KnownHash(lengths, classes.swa_component.ptr(), classes.swa_hash);
#else
  PyObject* value = PyDict_GetItemWithError(lengths, classes.swa_component.ptr());
#endif
  if (value == nullptr && PyErr_Occurred()) refuse_on_python_error(index, "SWA evicted length");
  return value;
}

// A request past its first decode step that holds KV, for the pass that tests it due.
struct HoldingRequest {
  int64_t index;
  PyObject* kv;  // held by the request's fields
  py::object row, lengths;
  int64_t pre_len;
};

// Starts loading a dict's tables (prefetching is a hint: it changes nothing).
void prefetch_tables(PyObject* dict) {
  const auto* d = reinterpret_cast<PyDictObject*>(dict);
  __builtin_prefetch(d->ma_keys);
  if (d->ma_values != nullptr) __builtin_prefetch(d->ma_values);
}

// reqs: a list or tuple (PySequence_Fast's). The batch is read in passes, each starting
// the memory reads the next one needs: a request's objects lie scattered, and after the
// model's forward pass few of them are in the CPU caches, so passes over independent
// requests let the misses of several overlap where reading request by request waits for
// each in turn. The first passes run no Python code (exact types, interned names), so the
// list cannot change under them; from then on each request's fields are held, as a
// length's __index__ or __len__ is Python code that could change them.
void read(const RequestClasses& classes, PyObject* reqs, int64_t window, int64_t interval,
          const swa::PageGeometry& page, DueRequests& due) {
  const auto* req_type = reinterpret_cast<PyTypeObject*>(classes.req_type.ptr());
  const auto* kv_type = reinterpret_cast<PyTypeObject*>(classes.kv_type.ptr());
  const int64_t n = PySequence_Fast_GET_SIZE(reqs);
  PyObject* const* items = PySequence_Fast_ITEMS(reqs);
  for (int64_t i = 0; i < n; ++i) {  // the requests, and the words before each (where CPython keeps its dict)
    __builtin_prefetch(items[i]);
    __builtin_prefetch(reinterpret_cast<const char*>(items[i]) - 3 * sizeof(PyObject*));
  }
  std::vector<py::object> dicts;  // each request's instance dict
  dicts.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    PyObject* req = items[i];
    if (Py_TYPE(req) != req_type) throw Refusal{"a request of type " + type_name(req) + ", not SGLang's Req"};
    dicts.push_back(py::reinterpret_steal<py::object>(PyObject_GenericGetDict(req, nullptr)));
    if (!dicts.back()) refuse_on_python_error(i, "__dict__");
    prefetch_tables(dicts.back().ptr());
  }
  std::vector<RequestFields> fields;  // each request's instance-dict fields
  fields.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    fields.push_back(request_fields(dicts[static_cast<size_t>(i)].ptr(), i));
    for (const py::object* next : {&fields.back().kv, &fields.back().origin_input_ids, &fields.back().output_ids})
      if (*next) __builtin_prefetch(next->ptr());
  }
  std::vector<HoldingRequest> holding;  // SGLang's test, in its order: decode_batch_idx >= 1, holds KV
  holding.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const RequestFields& req = fields[static_cast<size_t>(i)];
    if (!past_first_decode(required(req.decode_batch_idx, i, "decode_batch_idx"), i)) continue;
    PyObject* kv = required(req.kv, i, "kv");
    if (Py_TYPE(kv) != kv_type)
      throw Refusal{"a request's KV state of type " + type_name(kv) + ", not SGLang's ReqKvInfo"};
    py::object row = kv_field(classes, kv, RequestClasses::kRow, i);
    if (row.is_none()) continue;  // holds no KV
    const int64_t pre_len = seqlen(req, i) - 1;
    py::object lengths = kv_field(classes, kv, RequestClasses::kEvictedLengths, i);
    if (!PyDict_CheckExact(lengths.ptr()))
      throw Refusal{"a request's component_evicted_seqlens of type " + type_name(lengths.ptr()) + ", not a dict"};
    holding.push_back(HoldingRequest{i, kv, std::move(row), std::move(lengths), pre_len});
  }
  for (const HoldingRequest& req : holding) prefetch_tables(req.lengths.ptr());
  for (HoldingRequest& req : holding) {  // last pass: due
    const int64_t i = req.index;
    PyObject* entry = evicted_entry(classes, req.lengths.ptr(), i);
    const int64_t evicted = entry == nullptr ? 0 : length(entry, 0, i, "SWA evicted length");
    if (!swa::window_eviction_due(evicted, req.pre_len, window, interval)) continue;
    const int64_t protected_len = length(kv_field(classes, req.kv, RequestClasses::kProtectedLen, i).ptr(), 0, i,
                                         kKvFieldLabels[RequestClasses::kProtectedLen]);
    const int64_t floor = length(kv_field(classes, req.kv, RequestClasses::kEvictFloor, i).ptr(), 0, i,
                                 kKvFieldLabels[RequestClasses::kEvictFloor]);
    const int64_t dead_lo = swa::swa_dead_lo(protected_len, floor, page);
    due.push_back(DueRequest{i, length(req.row.ptr(), 0, i, kKvFieldLabels[RequestClasses::kRow]), req.pre_len,
                             evicted, evicted > dead_lo ? evicted : dead_lo, entry != nullptr,
                             std::move(req.lengths)});
  }
}

// What a class's attribute is now (a borrowed reference, nullptr when it has none).
PyObject* class_attribute(const py::object& owner, const py::object& name) {
  return _PyType_Lookup(reinterpret_cast<PyTypeObject*>(owner.ptr()), name.ptr());
}

// An attribute name, interned: a lookup of it then goes through Python's method cache,
// which gives the class a version tag.
py::str interned(const char* name) {
  PyObject* str = PyUnicode_InternFromString(name);
  if (str == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(str);
}

// A class's version tag, 0 when it has none valid (changed since, or Python ran out of tags).
unsigned int version_tag(const py::object& cls) {
  auto* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
#if PY_VERSION_HEX < 0x030C0000
  if (!PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG)) return 0;
#endif
  return type->tp_version_tag;
}

}  // namespace

RequestClasses::RequestClasses(py::object req, py::object kv, py::object swa)
    : req_type(std::move(req)), kv_type(std::move(kv)), swa_component(std::move(swa)) {
  if (!PyType_Check(req_type.ptr())) throw py::type_error("req_type: expected a class");
  if (!PyType_Check(kv_type.ptr())) throw py::type_error("kv_type: expected a class");
  swa_hash = PyObject_Hash(swa_component.ptr());
  if (swa_hash == -1) throw py::error_already_set();
  const std::pair<const py::object*, const char*> read_in_place[] = {
      {&req_type, "seqlen"}, {&kv_type, "get_evicted_seqlen"}, {&kv_type, "set_evicted_seqlen"},
      {&kv_type, "holds_kv"}, {&kv_type, "swa_dead_lo"}};
  for (const auto& [owner, method] : read_in_place) {
    py::str name = interned(method);
    PyObject* found = class_attribute(*owner, name);
    if (found == nullptr)
      throw py::type_error(std::string(reinterpret_cast<PyTypeObject*>(owner->ptr())->tp_name) + " has no " + method +
                           ": not SGLang's class");
    methods.push_back(Method{*owner, name, py::reinterpret_borrow<py::object>(found)});
  }
  // The KV state's fields kept in slots: read there while the class's descriptors stay.
  for (int f = 0; f < kNumKvFields; ++f) {
    py::str name = interned(kKvFields[f]);
    PyObject* found = class_attribute(kv_type, name);
    kv_slot_offsets[f] = -1;
    if (found == nullptr || !Py_IS_TYPE(found, &PyMemberDescr_Type)) continue;
    const PyMemberDef* member = reinterpret_cast<PyMemberDescrObject*>(found)->d_member;
    if (member->type != T_OBJECT_EX) continue;
    kv_slot_offsets[f] = member->offset;
    methods.push_back(Method{kv_type, name, py::reinterpret_borrow<py::object>(found)});
  }
  // The Req fields read from the instance dict: the class must define none of them.
  for (const char* plain : kReqFields) {
    py::str name = interned(plain);
    if (class_attribute(req_type, name) != nullptr)
      throw py::type_error(std::string(reinterpret_cast<PyTypeObject*>(req_type.ptr())->tp_name) + "." + plain +
                           " is defined by the class: not SGLang's Req");
    methods.push_back(Method{req_type, name, py::none()});
  }
}

bool RequestClasses::tags_unchanged() const {
  return checked_tags_[0] != 0 && checked_tags_[0] == version_tag(req_type) && checked_tags_[1] != 0 &&
         checked_tags_[1] == version_tag(kv_type);
}

std::string RequestClasses::changed_attribute() const {
  if (tags_unchanged()) return std::string();
  for (const Method& m : methods)
    if (class_attribute(m.owner, m.name) != (m.found.is_none() ? nullptr : m.found.ptr()))
      return std::string(reinterpret_cast<PyTypeObject*>(m.owner.ptr())->tp_name) + "." +
             py::cast<std::string>(m.name) + " changed since the reader was made (SGLang's loop reads it)";
  // The lookups gave both classes a valid tag again (unless Python ran out of them).
  checked_tags_[0] = version_tag(req_type);
  checked_tags_[1] = version_tag(kv_type);
  return std::string();
}

std::string read_due_requests(const RequestClasses& classes, py::handle reqs, int64_t window, int64_t interval,
                              const swa::PageGeometry& page, DueRequests& due) {
  due.clear();
  std::string changed = classes.changed_attribute();
  if (!changed.empty()) return changed;
  // A list is read in place; any other sequence through one fast copy.
  const py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(reqs.ptr(), "reqs: expected a sequence"));
  if (!seq) throw py::error_already_set();
  try {
    due.reserve(static_cast<size_t>(PySequence_Fast_GET_SIZE(seq.ptr())));
    read(classes, seq.ptr(), window, interval, page, due);
  } catch (const Refusal& refusal) {
    due.clear();
    return refusal.reason;
  }
  return std::string();
}

void write_evicted_lengths(const RequestClasses& classes, const DueRequests& due, const int64_t* new_evicted) {
  for (size_t j = 0; j < due.size(); ++j) {
    if (new_evicted[j] == due[j].evicted && due[j].has_entry) continue;
    const py::object value = py::reinterpret_steal<py::object>(PyLong_FromLongLong(new_evicted[j]));
    if (!value) throw py::error_already_set();
#if PY_VERSION_HEX < 0x030D0000
    const int failed = _PyDict_SetItem_KnownHash(due[j].evicted_lengths.ptr(), classes.swa_component.ptr(),
                                                 value.ptr(), classes.swa_hash);
#else
    const int failed = PyDict_SetItem(due[j].evicted_lengths.ptr(), classes.swa_component.ptr(), value.ptr());
#endif
    if (failed != 0) throw py::error_already_set();
  }
}

}  // namespace swa_sglang
