// pybind11 refuses a call it cannot bind with a multi-line text: every signature of the
// function and the repr of every value passed (a whole tensor's, say). Here that refusal
// becomes one line saying what is wrong, worded as Python words its own functions'.
//
// How: pybind11 calls every bound function through one dispatcher, the ml_meth of the
// function's PyMethodDef. explain_argument_errors points our functions' ml_meth at
// explained_dispatch, which calls that dispatcher and, only when it refused the call,
// works out why from the function's record (its parameters' names, defaults, which are
// keyword-only, and the types in its signature). A call that binds pays one C call and
// no Python frame. A catch-all (py::args, py::kwargs) overload would do the same in
// pybind11's own terms, but it turns each function into an overloaded one: its
// docstring then starts with "Overloaded function", the first overload is tried without
// conversions, so the catch-all would take calls that only needed one (need_sort=1), and
// every call pays for the overload machinery.
#include "argument_errors.h"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace swa_bindings {

namespace {

using Dispatcher = PyObject* (*)(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames);

// pybind11's dispatcher, as found in the first function explain_calls_of took over.
Dispatcher pybind_dispatcher = nullptr;

std::string type_name(py::handle obj) { return py::str(py::type::handle_of(obj).attr("__name__")); }

std::string with_article(const std::string& noun) {
  const bool vowel = !noun.empty() && std::string("aeiouAEIOU").find(noun[0]) != std::string::npos;
  return (vowel ? "an " : "a ") + noun;
}

std::string quoted_list(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) out += (i ? ", '" : "'") + names[i] + "'";
  return out;
}

// Where sep first occurs in text from `from` on, at bracket depth 0 and outside quotes;
// npos when it does not.
size_t top_level_find(const std::string& text, const std::string& sep, size_t from = 0) {
  int depth = 0;
  char quote = 0;
  for (size_t i = from; i < text.size(); ++i) {
    const char c = text[i];
    if (quote) {
      if (c == quote) quote = 0;
    } else if (depth == 0 && text.compare(i, sep.size(), sep) == 0) {
      return i;
    } else if (c == '\'' || c == '"') {
      quote = c;
    } else if (c == '(' || c == '[' || c == '{') {
      ++depth;
    } else if (c == ')' || c == ']' || c == '}') {
      --depth;
    }
  }
  return std::string::npos;
}

// The type text of each named parameter in pybind11's signature
// "(self: T, a: int, *, b: str = 'x') -> R".
std::vector<std::pair<std::string, std::string>> parameter_types(const std::string& signature) {
  std::vector<std::pair<std::string, std::string>> types;
  const size_t open = signature.find('(');
  if (open == std::string::npos) return types;
  const std::string inner = signature.substr(open + 1);
  const size_t close = top_level_find(inner, ")");
  const std::string params = inner.substr(0, close);
  for (size_t begin = 0; begin <= params.size();) {
    size_t end = top_level_find(params, ", ", begin);
    if (end == std::string::npos) end = params.size();
    const std::string piece = params.substr(begin, end - begin);
    begin = end + 2;
    const size_t colon = piece.find(": ");
    if (colon == std::string::npos || piece[0] == '*') continue;  // "*", "/", *args, **kwargs
    std::string type = piece.substr(colon + 2);
    type = type.substr(0, top_level_find(type, " = "));
    types.emplace_back(piece.substr(0, colon), type);
  }
  return types;
}

// What a parameter's type text in the signature accepts, for the types this module uses.
struct Expected {
  enum Kind { kAny, kInt, kBool, kStr, kClass, kUnknown } kind = kUnknown;
  bool or_none = false;
  py::object cls;  // kClass
};

Expected expected_of(const std::string& type_text) {
  Expected expected;
  std::optional<Expected::Kind> kind;
  for (size_t begin = 0; begin <= type_text.size();) {
    size_t end = top_level_find(type_text, " | ", begin);
    if (end == std::string::npos) end = type_text.size();
    const std::string alt = type_text.substr(begin, end - begin);
    begin = end + 3;
    Expected::Kind k = Expected::kUnknown;
    if (alt == "None") {
      expected.or_none = true;
      continue;
    } else if (alt == "object" || alt == "typing.Any") {
      k = Expected::kAny;
    } else if (alt == "int" || alt == "typing.SupportsInt" || alt == "typing.SupportsIndex") {
      k = Expected::kInt;
    } else if (alt == "bool") {
      k = Expected::kBool;
    } else if (alt == "str") {
      k = Expected::kStr;
    } else if (const size_t dot = alt.rfind('.'); dot != std::string::npos) {
      try {
        expected.cls = py::module_::import(alt.substr(0, dot).c_str()).attr(alt.substr(dot + 1).c_str());
        if (PyType_Check(expected.cls.ptr())) k = Expected::kClass;
      } catch (const py::error_already_set&) {
      }
    }
    if (kind && *kind != k) k = Expected::kUnknown;  // a union of kinds: not ours to judge
    kind = k;
  }
  expected.kind = kind.value_or(Expected::kUnknown);
  return expected;
}

// Why value does not fit the parameter, in the words of the bindings' own checks; nothing
// when it fits (or the type is not one judged here).
std::optional<std::string> type_fault(const std::string& name, const Expected& expected, py::handle value) {
  if (expected.or_none && value.is_none()) return std::nullopt;
  const std::string or_none = expected.or_none ? " or None" : "";
  std::string wanted;
  switch (expected.kind) {
    case Expected::kInt: {
      py::detail::make_caster<int64_t> caster;
      if (caster.load(value, true)) return std::nullopt;
      PyErr_Clear();
      if (PyLong_Check(value.ptr())) return name + ": outside the int64 range";
      wanted = "an int";
      break;
    }
    case Expected::kBool: {
      py::detail::make_caster<bool> caster;
      if (caster.load(value, true)) return std::nullopt;
      PyErr_Clear();
      wanted = "a bool";
      break;
    }
    case Expected::kStr: {
      py::detail::make_caster<std::string> caster;
      if (caster.load(value, true)) return std::nullopt;
      PyErr_Clear();
      wanted = "a str";
      break;
    }
    case Expected::kClass:
      if (py::isinstance(value, expected.cls)) return std::nullopt;
      wanted = with_article(py::str(expected.cls.attr("__name__")));
      break;
    case Expected::kAny:
    case Expected::kUnknown:
      return std::nullopt;
  }
  return name + ": expected " + wanted + or_none + ", got " + type_name(value);
}

// One parameter of an overload, self left out.
struct Param {
  std::string name;
  bool positional;  // may be passed by position
  bool keyword;     // may be passed by keyword
  bool required;
  py::handle value;  // what the call binds to it
};

// The call as one overload binds it: the parameters with their values, or why the
// argument list does not fit.
struct Binding {
  std::vector<Param> params;
  std::optional<std::string> list_fault;
};

Binding bind(const py::detail::function_record& rec, const std::string& display, PyObject* const* args,
             size_t nargs, PyObject* kwnames) {
  Binding b;
  const size_t skip = rec.is_method ? 1 : 0;
  const size_t count = rec.nargs - rec.has_args - rec.has_kwargs;
  size_t num_positional = 0, num_required_positional = 0;
  for (size_t i = skip; i < count; ++i) {
    const py::detail::argument_record* a = i < rec.args.size() ? &rec.args[i] : nullptr;
    const bool named = a != nullptr && a->name != nullptr;
    Param p{named ? a->name : "arg" + std::to_string(i - skip), i < rec.nargs_pos, named && i >= rec.nargs_pos_only,
            a == nullptr || !a->value, py::handle()};
    num_positional += p.positional;
    num_required_positional += p.positional && p.required;
    b.params.push_back(std::move(p));
  }

  const size_t given = nargs > skip ? nargs - skip : 0;
  if (given > num_positional && !rec.has_args) {
    const std::string range = num_required_positional < num_positional
                                  ? "from " + std::to_string(num_required_positional) + " to " +
                                        std::to_string(num_positional)
                                  : std::to_string(num_positional);
    b.list_fault = display + "() takes " + range + " positional argument" + (num_positional == 1 ? "" : "s") +
                   " but " + std::to_string(given) + (given == 1 ? " was" : " were") + " given";
    return b;
  }
  for (size_t k = 0; k < given && k < num_positional; ++k) b.params[k].value = args[skip + k];

  const size_t num_keywords = kwnames ? static_cast<size_t>(PyTuple_GET_SIZE(kwnames)) : 0;
  for (size_t j = 0; j < num_keywords; ++j) {
    const std::string keyword = py::str(PyTuple_GET_ITEM(kwnames, j));
    Param* target = nullptr;
    for (Param& p : b.params)
      if (p.keyword && p.name == keyword) {
        target = &p;
        break;
      }
    if (target == nullptr) {
      if (rec.has_kwargs) continue;
      py::list names;
      for (const Param& p : b.params)
        if (p.keyword) names.append(p.name);
      const py::list close = py::module_::import("difflib").attr("get_close_matches")(keyword, names, 1);
      b.list_fault = display + "() got an unexpected keyword argument '" + keyword + "'" +
                     (close.empty() ? "" : " (did you mean '" + std::string(py::str(close[0])) + "'?)");
      return b;
    }
    if (target->value) {
      b.list_fault = display + "() got multiple values for argument '" + keyword + "'";
      return b;
    }
    target->value = args[nargs + j];
  }

  std::vector<std::string> missing;
  bool all_keyword_only = true;
  for (const Param& p : b.params) {
    if (p.value || !p.required) continue;
    missing.push_back(p.name);
    all_keyword_only = all_keyword_only && !p.positional;
  }
  if (!missing.empty())
    b.list_fault = display + "() missing required " + (all_keyword_only ? "keyword " : "") +
                   (missing.size() == 1 ? "argument " : "arguments ") + quoted_list(missing);
  return b;
}

// The one-line text for a call pybind11 refused, from the overloads of the function.
std::string explain(const py::detail::function_record& first, PyObject* const* args, size_t nargs, PyObject* kwnames) {
  const std::string display = first.is_constructor ? std::string(py::str(first.scope.attr("__name__"))) : first.name;
  std::optional<std::string> first_list_fault;
  for (const py::detail::function_record* rec = &first; rec != nullptr; rec = rec->next) {
    const Binding b = bind(*rec, display, args, nargs, kwnames);
    if (b.list_fault) {
      if (!first_list_fault) first_list_fault = b.list_fault;
      continue;
    }
    // The argument list fits this overload: a value's type does not.
    std::vector<std::pair<std::string, std::string>> types = parameter_types(rec->signature);
    auto type_of = [&](const std::string& name) {
      for (const auto& [param, type] : types)
        if (param == name) return expected_of(type);
      return Expected{};
    };
    if (rec->is_method && nargs > 0)
      if (auto fault = type_fault("self", type_of("self"), args[0])) return *fault;
    for (const Param& p : b.params)
      if (p.value)
        if (auto fault = type_fault(p.name, type_of(p.name), p.value)) return *fault;
  }
  if (first_list_fault) return *first_list_fault;
  return display + "(): the arguments do not fit " + display + first.signature;
}

// Refusals of pybind11's binding start so; an error raised by the function itself stays as it is.
bool is_binding_refusal(const py::detail::function_record& rec, const std::string& message) {
  return message.rfind(std::string(rec.name) + "(): incompatible ", 0) == 0;
}

PyObject* explained_dispatch(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  PyObject* result = pybind_dispatcher(self, args, nargsf, kwnames);
  if (result != nullptr || !PyErr_ExceptionMatches(PyExc_TypeError)) return result;
  const py::detail::function_record* rec = py::detail::function_record_ptr_from_PyObject(self);
  py::error_already_set refusal;
  std::string message;
  try {
    if (rec == nullptr || !is_binding_refusal(*rec, py::str(refusal.value()))) {
      refusal.restore();
      return nullptr;
    }
    message = explain(*rec, args, static_cast<size_t>(PyVectorcall_NARGS(nargsf)), kwnames);
  } catch (const std::exception&) {
    PyErr_Clear();
    refusal.restore();  // no explanation: pybind11's own text
    return nullptr;
  }
  PyErr_SetString(PyExc_TypeError, message.c_str());
  return nullptr;
}

// Takes over obj's calls when it is a function (or method) bound by pybind11.
void explain_calls_of(py::handle obj) {
  PyObject* func = obj.ptr();
  if (PyInstanceMethod_Check(func)) func = PyInstanceMethod_GET_FUNCTION(func);
  if (!PyCFunction_Check(func)) return;
  PyObject* self = PyCFunction_GET_SELF(func);
  if (self == nullptr || py::detail::function_record_ptr_from_PyObject(self) == nullptr) return;
  PyMethodDef* def = reinterpret_cast<PyCFunctionObject*>(func)->m_ml;
  if (def->ml_flags != (METH_FASTCALL | METH_KEYWORDS)) return;
  const auto dispatch = reinterpret_cast<Dispatcher>(reinterpret_cast<void (*)()>(def->ml_meth));
  if (dispatch == &explained_dispatch) return;
  if (pybind_dispatcher == nullptr) pybind_dispatcher = dispatch;
  if (dispatch != pybind_dispatcher) return;  // not pybind11's dispatcher: leave it
  def->ml_meth = reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&explained_dispatch));
}

}  // namespace

void explain_argument_errors(py::module_& m) {
  const py::str module_name = m.attr("__name__");
  for (const auto item : py::reinterpret_borrow<py::dict>(m.attr("__dict__"))) {
    explain_calls_of(item.second);
    if (PyType_Check(item.second.ptr()) && module_name.equal(item.second.attr("__module__")))
      for (const auto member : item.second.attr("__dict__").attr("values")()) explain_calls_of(member);
  }
}

}  // namespace swa_bindings
