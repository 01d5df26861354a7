// The torch/pybind11 layer: checks and unpacks tensors, takes the concurrency guard,
// and calls the torch-free core in csrc/core. No allocator rule lives here.
#include <torch/extension.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/allocator.h"
#include "../core/device_store.h"
#include "argument_errors.h"
#include "docstrings.h"
#include "extension_modules.h"
#ifdef SWA_EXT_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>

#include "cuda_executor.h"
#endif

namespace py = pybind11;

namespace {

bool debug_checks_enabled() {
  const char* flag = std::getenv("SWA_EXT_DEBUG");
  return flag != nullptr && flag[0] != '\0' && flag[0] != '0';
}

// Allocators are not thread-safe. Calls hold the GIL, so Python threads are serialised;
// anything that would interleave two calls anyway (a free-threaded interpreter, a
// caller that dropped the GIL) gets an error instead of a corrupted free list. A CUDA
// allocator's changing call drops the GIL while it waits for the GPU (the guard allows
// it, see WaitsReleaseGil): another thread's call that finds it there waits for it to
// end, as it would have waited for the GIL.
class UseGuard {
 public:
  explicit UseGuard(std::atomic<bool>& busy) : busy_(busy), outer_(innermost_) {
    while (busy_.exchange(true, std::memory_order_acquire)) {
      if (!another_thread_waits_for_the_gpu(busy_))
        throw swa::ConcurrentUseError("allocator used from two threads at once; serialise calls to it");
      py::gil_scoped_release unlocked;
      std::this_thread::yield();
    }
    innermost_ = this;
  }
  ~UseGuard() {
    innermost_ = outer_;
    busy_.store(false, std::memory_order_release);
  }
  // A read-only call takes no guard (a re-entrant one runs beside its caller), but waits
  // for another thread's call that dropped the GIL for the GPU.
  static void wait_for_other_threads(const std::atomic<bool>& busy) {
    while (busy.load(std::memory_order_acquire) && another_thread_waits_for_the_gpu(busy)) {
      py::gil_scoped_release unlocked;
      std::this_thread::yield();
    }
  }

 private:
  static bool another_thread_waits_for_the_gpu(const std::atomic<bool>& busy) {
#ifdef SWA_EXT_WITH_CUDA
    return swa::threads_waiting_for_gpu() > 0 && !held_by_this_thread(busy);
#else
    (void)busy;
    return false;
#endif
  }
  static bool held_by_this_thread(const std::atomic<bool>& busy) {  // a re-entrant call
    for (const UseGuard* g = innermost_; g != nullptr; g = g->outer_)
      if (&g->busy_ == &busy) return true;
    return false;
  }
  std::atomic<bool>& busy_;
  const UseGuard* outer_;
#ifdef SWA_EXT_WITH_CUDA
  swa::WaitsReleaseGil waits_release_gil_;  // other threads' calls on this allocator wait for this one
#endif
  static thread_local const UseGuard* innermost_;
};
thread_local const UseGuard* UseGuard::innermost_ = nullptr;

// A 1-D int64 view of an index or length argument. int32 input (a serving engine's
// req_to_token rows are int32) is widened into a temporary the view keeps alive.
struct IntArg {
  at::Tensor tensor;
  swa::Span span() const { return swa::Span(tensor.data_ptr<int64_t>(), tensor.numel()); }
};

// The name of obj's type, for an error message.
std::string type_name(const py::handle& obj) { return py::str(py::type::handle_of(obj).attr("__name__")); }

// obj as a tensor; TypeError naming the argument for anything else.
const at::Tensor& tensor_arg(const char* name, const py::handle& obj) {
  if (!THPVariable_Check(obj.ptr()))
    throw py::type_error(std::string(name) + ": expected a torch.Tensor, got " + type_name(obj));
  return THPVariable_Unpack(obj.ptr());
}

IntArg int_arg(const char* name, const py::handle& obj, const c10::Device& device) {
  const at::Tensor& t = tensor_arg(name, obj);
  if (t.scalar_type() != at::kLong && t.scalar_type() != at::kInt)
    throw py::type_error(std::string(name) + ": expected an int64 or int32 tensor, got " + std::string(c10::toString(t.scalar_type())));
  if (t.device() != device)
    throw py::type_error(std::string(name) + ": expected a tensor on " + device.str() + ", got one on " + t.device().str());
  if (t.dim() != 1) throw py::value_error(std::string(name) + ": expected a 1-D tensor, got " + std::to_string(t.dim()) + "-D");
  if (t.scalar_type() == at::kLong && t.is_contiguous()) return IntArg{t};
  return IntArg{t.to(at::kLong).contiguous()};
}

// The CPU copy of lengths must agree with the device copy where both can be read.
IntArg lengths_arg(const char* name, const py::handle& device_obj, const char* cpu_name, const py::handle& cpu_obj,
                   const c10::Device& device) {
  IntArg cpu = int_arg(cpu_name, cpu_obj, c10::Device(c10::kCPU));
  const int64_t n = cpu.tensor.numel();
  if (device.is_cpu() && !device_obj.is(cpu_obj)) {
    IntArg dev = int_arg(name, device_obj, device);
    swa::check_batch_lengths({{name, dev.tensor.numel()}, {cpu_name, n}});
    if (n > 0 && std::memcmp(dev.span().data, cpu.span().data, sizeof(int64_t) * n) != 0)
      throw py::value_error(std::string(name) + ": does not match " + cpu_name);
  } else if (!device.is_cpu()) {
    // Comparing with the device copy would wait for the GPU; its size is all we check.
    swa::check_batch_lengths({{name, tensor_arg(name, device_obj).numel()}, {cpu_name, n}});
  }
  return cpu;
}

// Index tensors handed to the caller. CPU tensors skip the dispatcher: this runs on
// every scheduler step.
at::Tensor empty_indices(int64_t n, const c10::Device& device) {
  if (device.is_cpu()) return at::detail::empty_cpu({n}, at::kLong);
  return at::empty({n}, at::TensorOptions().dtype(at::kLong).device(device));
}

struct TensorOut : swa::OutBuffer {
  explicit TensorOut(const c10::Device& d) : device(d) {}
  int64_t* get(int64_t n) override {
    tensor = empty_indices(n, device);
    return tensor.data_ptr<int64_t>();
  }
  c10::Device device;
  at::Tensor tensor;
};

py::object result(bool ok, TensorOut& out) { return ok ? py::cast(out.tensor) : py::none(); }

bool built_with_cuda() {
#ifdef SWA_EXT_WITH_CUDA
  return true;
#else
  return false;
#endif
}

c10::Device device_arg(const py::object& device) {
  c10::Device d = py::isinstance<py::str>(device) ? c10::Device(device.cast<std::string>())
                                                   : device.cast<c10::Device>();
  if (d.is_cuda() && !built_with_cuda())
    throw py::type_error("device: this build of swa_ext has no CUDA kernels; use device='cpu'");
  if (!d.is_cpu() && !d.is_cuda()) throw py::type_error("device: expected 'cpu' or 'cuda', got " + d.str());
#ifdef SWA_EXT_WITH_CUDA
  if (d.is_cuda() && !d.has_index()) d = c10::Device(c10::kCUDA, c10::cuda::current_device());
#endif
  return d;
}

// The executor of a device allocator: the GPU's, or (kernels="emulated", on the CPU)
// the ops run element by element on the host, for testing the device algorithm; none
// for the CPU core. kernels takes the values the `kernels` property reports ('cpu',
// 'cuda', 'emulated') and 'auto', the one its device implies.
std::shared_ptr<swa::Executor> device_executor(const c10::Device& device, const std::string& kernels) {
  if (kernels != "auto" && kernels != "cpu" && kernels != "cuda" && kernels != "emulated")
    throw py::value_error("kernels: expected 'auto', 'cpu', 'cuda' or 'emulated', got '" + kernels + "'");
  if (kernels == "cuda" && !device.is_cuda()) throw py::value_error("kernels: 'cuda' runs on device='cuda' only");
  if (device.is_cpu()) return kernels == "emulated" ? std::make_shared<swa::HostExecutor>() : nullptr;
  if (kernels != "auto" && kernels != "cuda")
    throw py::value_error("kernels: '" + kernels + "' runs on device='cpu' only");
#ifdef SWA_EXT_WITH_CUDA
  return swa::make_cuda_executor(device);
#else
  return nullptr;
#endif
}

// One page pool as a paged (or token) KV allocator of the serving engine sees it.
// The pools of a hybrid allocator share its stores and its guard.
struct PoolHandle {
  std::shared_ptr<swa::PoolAllocator> alloc;
  c10::Device device;
  std::shared_ptr<std::atomic<bool>> busy;
  bool debug;
  swa::PoolStore& store() const { return alloc->store(); }
  void after_change() const {
    if (debug) alloc->check_invariants();
  }
};

// The memory an allocator's pools take grows with a size argument; a lower bound of it
// that holds for every store: an int64 per page for a pool's free list, and for the
// hybrid allocator's size an int64 per slot for the full-to-SWA mapping.
struct PoolDemand {
  const char* arg;
  int64_t slots;
  long double bytes;
};

PoolDemand pool_demand(const char* arg, int64_t slots, int64_t page_size, bool mapped) {
  const long double pages = static_cast<long double>(slots / page_size);
  const long double mapping = mapped ? 8.0L * static_cast<long double>(slots + page_size + 1) : 0.0L;
  return PoolDemand{arg, slots, 8.0L * pages + mapping};
}

// Builds an allocator's pools; when the memory for them cannot be had, a MemoryError names
// the size argument that asks for the most, with the bytes it needs, and nothing is built.
template <class Build>
auto build_pools(const c10::Device& device, std::initializer_list<PoolDemand> demands, const Build& build)
    -> decltype(build()) {
  try {
    return build();
  } catch (const std::bad_alloc&) {
  } catch (const std::length_error&) {  // more elements than a std::vector can hold
  } catch (const c10::OutOfMemoryError&) {
  } catch (const c10::Error&) {
    if (!device.is_cpu()) throw;  // torch's CPU allocator reports running out of memory as a plain c10::Error
  }
  const PoolDemand* most = demands.begin();
  for (const PoolDemand& d : demands)
    if (d.bytes > most->bytes) most = &d;
  const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  long double scaled = most->bytes / 1024.0L;
  int unit = 0;
  for (; scaled >= 1024.0L && unit < 5; ++unit) scaled /= 1024.0L;
  char bytes[96];
  std::snprintf(bytes, sizeof bytes, "%.0Lf bytes (%.1Lf %s)", most->bytes, scaled, units[unit]);
  PyErr_SetString(PyExc_MemoryError, (std::string(most->arg) + ": " + std::to_string(most->slots) +
                                      " slots need at least " + bytes + " of " + device.str() +
                                      " memory for the allocator's tables, more than can be allocated")
                                         .c_str());
  throw py::error_already_set();
}

PoolHandle make_pool(int64_t size, int64_t page_size, const c10::Device& device, bool need_sort,
                     const std::string& kernels) {
  const bool debug = debug_checks_enabled();
  std::shared_ptr<swa::Executor> executor = device_executor(device, kernels);
  std::shared_ptr<swa::PoolStore> store = build_pools(
      device, {pool_demand("size", size, page_size, false)}, [&]() -> std::shared_ptr<swa::PoolStore> {
        if (executor)
          return std::make_shared<swa::DevicePool>(std::make_shared<swa::DeviceControl>(executor, 1, debug), 0, size,
                                                   page_size, need_sort);
        return std::make_shared<swa::PagePool>(size, page_size, need_sort);
      });
  return PoolHandle{std::make_shared<swa::PoolAllocator>(store), device, std::make_shared<std::atomic<bool>>(false),
                    debug};
}

}  // namespace

namespace swa_bindings {

struct HybridHandle {
  HybridHandle(int64_t size, int64_t size_swa, int64_t page_size, bool need_sort, const c10::Device& dev,
               const std::string& kernels, bool shares_list, int64_t parent_k, const std::string& small_side)
      : device(dev), busy(std::make_shared<std::atomic<bool>>(false)), debug(debug_checks_enabled()) {
    const swa::ParentLayout parents = swa::check_parent_layout(parent_k, small_side, shares_list);
    const int64_t mapping_len = swa::HybridAllocator::mapping_size(size, size_swa, page_size, shares_list, parents);
    std::shared_ptr<swa::Executor> executor = device_executor(device, kernels);
    if (executor && parents.k > 1)
      swa::fail("parent_k", "above 1 is served by the CPU store only so far (device='cpu', kernels='auto' or 'cpu'); got ",
                parent_k, " with kernels='", executor->kernels(), "'");
    const auto demands = {pool_demand("size", size, page_size, true),
                          pool_demand("size_swa", size_swa, page_size, false)};
    build_pools(device, demands, [&] {
      // One tensor for the allocator's life: serving engines register it with their KV cache.
      mapping = at::zeros({mapping_len}, at::TensorOptions().dtype(at::kLong).device(device));
      int64_t* table = mapping.data_ptr<int64_t>();
      std::unique_ptr<swa::HybridStore> store;
      if (executor)
        store = std::make_unique<swa::DeviceHybridStore>(executor, size, size_swa, page_size, need_sort, shares_list, debug,
                                                         table, mapping_len);
      else
        store = std::make_unique<swa::HostHybridStore>(size, size_swa, page_size, need_sort, shares_list, parents, table,
                                                       mapping_len);
      alloc = std::make_unique<swa::HybridAllocator>(std::move(store));
    });
  }
  void after_change() const {
    if (debug) alloc->check_invariants();
  }
  PoolHandle view(const std::shared_ptr<swa::PoolStore>& pool) const {
    return PoolHandle{std::make_shared<swa::PoolAllocator>(pool), device, busy, debug};
  }

  c10::Device device;
  at::Tensor mapping;
  std::shared_ptr<std::atomic<bool>> busy;
  bool debug;
  std::unique_ptr<swa::HybridAllocator> alloc;
};

}  // namespace swa_bindings

namespace {

using swa_bindings::HybridHandle;

// A call that only reads an allocator (it may still wait for the GPU).
template <class Handle, class Body>
auto reading(const Handle& h, const Body& body) -> decltype(body()) {
  UseGuard::wait_for_other_threads(*h.busy);
  return body();
}

// Every call that changes an allocator: holds its guard while it runs, then (debug mode)
// checks its invariants.
template <class Handle, class Body>
auto guarded(Handle& h, const Body& body) -> decltype(body()) {
  UseGuard guard(*h.busy);
  if constexpr (std::is_void_v<decltype(body())>) {
    body();
    h.after_change();
  } else {
    auto result = body();
    h.after_change();
    return result;
  }
}

// An allocation: its indices in a fresh tensor, or None when refused.
template <class Handle, class Alloc>
py::object allocation(Handle& h, const Alloc& alloc) {
  return guarded(h, [&] {
    TensorOut out(h.device);
    const bool ok = alloc(out);
    return result(ok, out);
  });
}

swa::BatchLengths extend_batch(const IntArg& prefix, const IntArg& seq) {
  return swa::BatchLengths{prefix.span(), seq.span(), false};
}

swa::BatchLengths decode_batch(const IntArg& seq) { return swa::BatchLengths{swa::Span(), seq.span(), true}; }

// last_loc in the allocator's memory (device memory on a GPU allocator).
swa::LastLoc last_loc_of(const IntArg& last) { return swa::LastLoc(last.span().data, last.span().size); }

// The arguments of alloc_extend / alloc_extend_swa_tail and of alloc_decode, checked and unpacked.
struct ExtendArgs {
  IntArg prefix, seq, last;
  ExtendArgs(const py::object& prefix_lens, const py::object& prefix_lens_cpu, const py::object& seq_lens,
             const py::object& seq_lens_cpu, const py::object& last_loc, const c10::Device& device)
      : prefix(lengths_arg("prefix_lens", prefix_lens, "prefix_lens_cpu", prefix_lens_cpu, device)),
        seq(lengths_arg("seq_lens", seq_lens, "seq_lens_cpu", seq_lens_cpu, device)),
        last(int_arg("last_loc", last_loc, device)) {}
  swa::BatchLengths batch() const { return extend_batch(prefix, seq); }
  swa::LastLoc last_loc() const { return last_loc_of(last); }
};

struct DecodeArgs {
  IntArg seq, last;
  DecodeArgs(const py::object& seq_lens, const py::object& seq_lens_cpu, const py::object& last_loc,
             const c10::Device& device)
      : seq(lengths_arg("seq_lens", seq_lens, "seq_lens_cpu", seq_lens_cpu, device)),
        last(int_arg("last_loc", last_loc, device)) {}
  swa::BatchLengths batch() const { return decode_batch(seq); }
  swa::LastLoc last_loc() const { return last_loc_of(last); }
};

// An int as operator.index takes it, but not a bool (True is no window length).
int64_t int_value(const char* name, const py::handle& obj) {
  if (PyBool_Check(obj.ptr())) throw py::type_error(std::string(name) + ": expected an int, got bool");
  PyObject* index = PyNumber_Index(obj.ptr());
  if (index == nullptr) {
    PyErr_Clear();
    throw py::type_error(std::string(name) + ": expected an int, got " + type_name(obj));
  }
  const long long value = PyLong_AsLongLong(index);
  Py_DECREF(index);
  if (value == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::value_error(std::string(name) + ": outside the int64 range");
  }
  return value;
}

// Per-request values on the CPU: an integer tensor (int_arg checks it) or a list or tuple
// of ints, made into one.
IntArg cpu_values_arg(const char* name, const py::handle& obj) {
  if (THPVariable_Check(obj.ptr())) return int_arg(name, obj, c10::Device(c10::kCPU));
  if (!PyList_Check(obj.ptr()) && !PyTuple_Check(obj.ptr()))
    throw py::type_error(std::string(name) + ": expected a CPU int64 tensor or a list of ints, got " +
                         type_name(obj));
  const py::sequence values = py::reinterpret_borrow<py::sequence>(obj);
  at::Tensor tensor = at::detail::empty_cpu({static_cast<int64_t>(values.size())}, at::kLong);
  int64_t* out = tensor.data_ptr<int64_t>();
  for (const py::handle value : values) {
    if (PyBool_Check(value.ptr()) || !PyIndex_Check(value.ptr()))
      throw py::type_error(std::string(name) + ": expected a flat list of ints");
    *out++ = int_value(name, value);
  }
  return IntArg{tensor};
}

swa::SlotRows slot_rows(const py::handle& obj, const c10::Device& device) {
  const at::Tensor& req_to_token = tensor_arg("req_to_token", obj);
  if (req_to_token.dim() != 2 || !req_to_token.is_contiguous())
    throw py::value_error("req_to_token: expected a contiguous 2-D tensor");
  if (req_to_token.device() != device) throw py::type_error("req_to_token: expected a tensor on " + device.str());
  const bool int32 = req_to_token.scalar_type() == at::kInt;
  if (!int32 && req_to_token.scalar_type() != at::kLong)
    throw py::type_error("req_to_token: expected an int32 or int64 tensor");
  return swa::SlotRows{int32 ? req_to_token.data_ptr<int32_t>() : nullptr,
                       int32 ? nullptr : req_to_token.data_ptr<int64_t>(), req_to_token.size(0), req_to_token.size(1)};
}

at::Tensor int_tensor(const std::vector<int64_t>& values) { return at::tensor(values, at::kLong); }

// The window eviction of a decode batch: the allocator's method and, with the allocator
// first, swa_ext.decode.evict_out_of_window (no Python frame on this per-step call).
at::Tensor evict_out_of_window(HybridHandle& h, const py::object& req_to_token, const py::object& rows,
                               const py::object& pre_lens, const py::object& evicted_seqlens,
                               const py::object& window, const py::object& interval,
                               const py::object& prefix_sharing) {
  return guarded(h, [&] {
    const swa::SlotRows table = slot_rows(req_to_token, h.device);
    const IntArg row_ids = cpu_values_arg("rows", rows), pre = cpu_values_arg("pre_lens", pre_lens);
    const IntArg evicted = cpu_values_arg("evicted_seqlens", evicted_seqlens);
    const int64_t window_len = int_value("window", window), every = int_value("interval", interval);
    const bool sharing = PyObject_IsTrue(prefix_sharing.ptr()) == 1;
    at::Tensor out = empty_indices(row_ids.tensor.numel(), c10::Device(c10::kCPU));
    h.alloc->evict_out_of_window(table, row_ids.span(), pre.span(), evicted.span(), window_len, every, sharing,
                                 out.data_ptr<int64_t>());
    return out;
  });
}

// The submodules registered from their own files (extension_modules.h), in the order
// registered.
std::vector<std::pair<const char*, void (*)(py::module_&)>>& submodules() {
  static std::vector<std::pair<const char*, void (*)(py::module_&)>> registered;
  return registered;
}

}  // namespace

namespace swa_bindings {

bool register_submodule(const char* name, void (*define)(py::module_& submodule)) {
  submodules().emplace_back(name, define);
  return true;
}

HybridRef::HybridRef(const char* arg, py::handle obj) {
  if (!py::isinstance<HybridHandle>(obj))
    throw py::type_error(std::string(arg) + ": expected a HybridAllocator, got " + type_name(obj));
  handle_ = &obj.cast<HybridHandle&>();
}

int64_t HybridRef::page_size() const { return handle_->alloc->page_size(); }

swa::SlotRows HybridRef::slot_rows(py::handle req_to_token) const { return ::slot_rows(req_to_token, handle_->device); }

void HybridRef::guarded(const std::function<void(swa::HybridAllocator&)>& body) const {
  ::guarded(*handle_, [&] { body(*handle_->alloc); });
}

}  // namespace swa_bindings

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = swa_docs::module_doc;
  py::register_exception<swa::ConcurrentUseError>(m, "ConcurrentUseError", PyExc_RuntimeError);
  py::register_exception<swa::DeferredError>(m, "DeferredError", PyExc_RuntimeError);
  m.def("built_with_cuda", &built_with_cuda, swa_docs::built_with_cuda);
  m.def("parent_k", [](int64_t larger_entry_bytes, int64_t smaller_entry_bytes) {
          swa::check_at_least_one("smaller_entry_bytes", smaller_entry_bytes);
          if (larger_entry_bytes < smaller_entry_bytes)
            swa::fail("larger_entry_bytes", "must be at least smaller_entry_bytes (", smaller_entry_bytes, "), got ",
                      larger_entry_bytes);
          return swa::parent_k(larger_entry_bytes, smaller_entry_bytes);
        }, "The shared mode's parent_k: a larger KV entry (bytes a token) padded to this many smaller ones.",
        py::arg("larger_entry_bytes"), py::arg("smaller_entry_bytes"));
  m.def("swa_tail_len", [](int64_t seq_len, int64_t window, int64_t page_size, bool radix_cache) {
          const swa::PageGeometry page(swa::check_at_least_one("page_size", page_size));
          swa::check_at_least_one("window", window);
          return swa::swa_tail_len(seq_len, window, page, radix_cache);
        }, swa_docs::swa_tail_len, py::arg("seq_len"), py::arg("window"), py::arg("page_size"), py::arg("radix_cache") = false);
  m.def("evicted_after_step", [](int64_t evicted, int64_t pre_len, int64_t window, int64_t page_size, int64_t interval,
                                 bool prefix_sharing) {
          const swa::PageGeometry page(swa::check_at_least_one("page_size", page_size));
          swa::check_at_least_one("window", window);
          swa::check_at_least_one("interval", interval);
          swa::check_evicted_len(evicted, pre_len, page);
          return swa::evicted_after_step(evicted, pre_len, window, page, interval, prefix_sharing);
        }, swa_docs::evicted_after_step, py::arg("evicted"), py::arg("pre_len"), py::arg("window"), py::arg("page_size"),
        py::arg("interval") = 1, py::arg("prefix_sharing") = false);
  // The cheapest native call over an allocation's arguments: the floor benchmarks compare with.

  py::class_<swa::AllocatorState>(m, "AllocatorState")
      .def("__eq__", [](const swa::AllocatorState& a, const swa::AllocatorState& b) { return a == b; });
  py::class_<swa::PagePool>(m, "PagePool")
      .def("__eq__", [](const swa::PagePool& a, const swa::PagePool& b) { return a == b; });

  py::class_<PoolHandle>(m, "PoolAllocator", swa_docs::pool_class)
      .def(py::init([](int64_t size, int64_t page_size, const py::object& device, bool need_sort, const std::string& kernels) {
             return make_pool(size, page_size, device_arg(device), need_sort, kernels);
           }),
           swa_docs::pool_init, py::arg("size"), py::arg("page_size"), py::arg("device"), py::arg("need_sort") = false,
           py::arg("kernels") = "auto")
      // A second handle on the same pool: the pools of a hybrid allocator.
      .def(py::init([](const PoolHandle& shared) { return shared; }), swa_docs::pool_init_shared, py::arg("shared"))
      .def_property_readonly("page_size", [](const PoolHandle& h) { return h.store().geometry().size; }, swa_docs::pool_page_size)
      .def_property_readonly("size", [](const PoolHandle& h) { return h.store().size(); }, swa_docs::pool_size)
      .def_property_readonly("size_full", [](const PoolHandle& h) { return h.store().size(); }, swa_docs::pool_size_full)
      .def_property_readonly("num_pages", [](const PoolHandle& h) { return h.store().num_pages(); }, swa_docs::pool_num_pages)
      .def_property_readonly("need_sort", [](const PoolHandle& h) { return h.store().need_sort(); }, swa_docs::pool_need_sort)
      .def_property_readonly("device", [](const PoolHandle& h) { return h.device; }, swa_docs::pool_device)
      .def_property_readonly("free_pages", [](const PoolHandle& h) { return reading(h, [&] { return int_tensor(h.alloc->backup_state().free_list()); }); },
                             swa_docs::pool_free_pages)
      .def_property_readonly("release_pages", [](const PoolHandle& h) { return reading(h, [&] { return int_tensor(h.alloc->backup_state().staged_list()); }); },
                             swa_docs::pool_release_pages)
      .def_property_readonly("is_not_in_free_group", [](const PoolHandle& h) { return !h.store().group_open(); },
                             swa_docs::pool_is_not_in_free_group)
      .def("available_size", [](PoolHandle& h) { return reading(h, [&] { return h.alloc->available_size(); }); }, swa_docs::pool_available_size)
      .def("alloc", [](PoolHandle& h, int64_t need_size) {
             return allocation(h, [&](TensorOut& out) { return h.alloc->alloc(need_size, out); });
           }, swa_docs::pool_alloc, py::arg("need_size"))
      .def("alloc_extend", [](PoolHandle& h, const py::object& prefix_lens, const py::object& prefix_lens_cpu,
                              const py::object& seq_lens, const py::object& seq_lens_cpu, const py::object& last_loc,
                              int64_t extend_num_tokens, std::optional<int64_t> num_new_pages) {
             return allocation(h, [&](TensorOut& out) {
               const ExtendArgs a(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, h.device);
               return h.alloc->alloc_extend(a.batch(), a.last_loc(), extend_num_tokens, num_new_pages.value_or(-1), out);
             });
           }, swa_docs::pool_alloc_extend, py::arg("prefix_lens"), py::arg("prefix_lens_cpu"), py::arg("seq_lens"), py::arg("seq_lens_cpu"),
           py::arg("last_loc"), py::arg("extend_num_tokens"), py::arg("num_new_pages") = py::none())
      .def("alloc_decode", [](PoolHandle& h, const py::object& seq_lens, const py::object& seq_lens_cpu, const py::object& last_loc) {
             return allocation(h, [&](TensorOut& out) {
               const DecodeArgs a(seq_lens, seq_lens_cpu, last_loc, h.device);
               return h.alloc->alloc_decode(a.batch(), a.last_loc(), out);
             });
           }, swa_docs::pool_alloc_decode, py::arg("seq_lens"), py::arg("seq_lens_cpu"), py::arg("last_loc"))
      .def("free", [](PoolHandle& h, const py::object& free_index) {
             guarded(h, [&] {
               const IntArg idx = int_arg("free_index", free_index, h.device);
               h.alloc->free(idx.span());
             });
           }, swa_docs::pool_free, py::arg("free_index"))
      .def("free_page_ids", [](PoolHandle& h, const py::object& page_ids) {
             guarded(h, [&] {
               const IntArg pages = int_arg("page_ids", page_ids, h.device);
               h.alloc->free_page_ids(pages.span());
             });
           }, swa_docs::pool_free_page_ids, py::arg("page_ids"))
      .def("free_segment", [](PoolHandle& h, const py::object& indices, int64_t start_pos) {
             guarded(h, [&] {
               const IntArg idx = int_arg("indices", indices, h.device);
               h.alloc->free_segment(idx.span(), start_pos);
             });
           }, swa_docs::pool_free_segment, py::arg("indices"), py::kw_only(), py::arg("start_pos"))
      .def("free_group_begin", [](PoolHandle& h) { guarded(h, [&] { h.alloc->free_group_begin(); }); },
           swa_docs::pool_free_group_begin)
      .def("free_group_end", [](PoolHandle& h) { guarded(h, [&] { h.alloc->free_group_end(); }); },
           swa_docs::pool_free_group_end)
      .def("merge_and_sort_free", [](PoolHandle& h) { guarded(h, [&] { h.alloc->merge_and_sort_free(); }); },
           swa_docs::pool_merge_and_sort_free)
      .def("clear", [](PoolHandle& h) { guarded(h, [&] { h.alloc->clear(); }); }, swa_docs::pool_clear)
      .def("resize", [](PoolHandle& h, int64_t size) { guarded(h, [&] { h.alloc->resize(size); }); },
           swa_docs::pool_resize, py::arg("size"))
      .def("debug_print", [](const PoolHandle& h) { return reading(h, [&] { return h.alloc->debug_string(); }); }, swa_docs::pool_debug_print)
      .def("check_invariants", [](const PoolHandle& h) { reading(h, [&] { h.alloc->check_invariants(); }); }, swa_docs::pool_check_invariants)
      .def("backup_state", [](const PoolHandle& h) { return reading(h, [&] { return h.alloc->backup_state(); }); }, swa_docs::pool_backup_state)
      .def("restore_state", [](PoolHandle& h, const swa::PagePool& state) {
             guarded(h, [&] { h.alloc->restore_state(state); });
           }, swa_docs::pool_restore_state, py::arg("state"));

  py::class_<HybridHandle>(m, "HybridAllocator", swa_docs::hybrid_class)
      .def(py::init([](int64_t size, int64_t size_swa, int64_t page_size, const py::object& device, bool need_sort,
                       const std::string& kernels, bool shared, int64_t parent_k, const std::string& small_side) {
             return std::make_unique<HybridHandle>(size, size_swa, page_size, need_sort, device_arg(device), kernels,
                                                   shared, parent_k, small_side);
           }),
           swa_docs::hybrid_init, py::arg("size"), py::arg("size_swa"), py::arg("page_size"), py::arg("device"), py::arg("need_sort"),
           py::arg("kernels") = "auto", py::arg("shared") = false, py::arg("parent_k") = 1, py::arg("small_side") = "swa")
      .def_property_readonly("page_size", [](const HybridHandle& h) { return h.alloc->page_size(); }, swa_docs::hybrid_page_size)
      .def_property_readonly("size", [](const HybridHandle& h) { return std::min(h.alloc->full().size(), h.alloc->swa().size()); },
                             swa_docs::hybrid_size)
      .def_property_readonly("size_full", [](const HybridHandle& h) { return h.alloc->full().size(); }, swa_docs::hybrid_size_full)
      .def_property_readonly("size_swa", [](const HybridHandle& h) { return h.alloc->swa().size(); }, swa_docs::hybrid_size_swa)
      .def_property_readonly("need_sort", [](const HybridHandle& h) { return h.alloc->full().need_sort(); }, swa_docs::hybrid_need_sort)
      .def_property_readonly("shared", [](const HybridHandle& h) { return h.alloc->store().shares_list(); }, swa_docs::hybrid_shared)
      .def_property_readonly("parent_k", [](const HybridHandle& h) { return h.alloc->store().parents().k; },
                             "The shared mode's parent pages: the small side's pages to a parent (1: one page of either kind).")
      .def_property_readonly("small_side", [](const HybridHandle& h) {
             return h.alloc->store().parents().small_side == swa::Side::kFull ? "full" : "swa";
           }, "The side whose pages are parent_k to a parent (the one with the smaller KV entry): 'full' or 'swa'.")
      .def_property_readonly("device", [](const HybridHandle& h) { return h.device; }, swa_docs::hybrid_device)
      .def_property_readonly("kernels", [](const HybridHandle& h) { return h.alloc->store().kernels(); }, swa_docs::hybrid_kernels)
      .def_property_readonly("full_to_swa_index_mapping", [](const HybridHandle& h) { return h.mapping; }, swa_docs::hybrid_full_to_swa_index_mapping)
      // How many times the allocator has waited for the GPU (count read-backs, state snapshots).
      .def_property_readonly("device_waits", [](const HybridHandle& h) { return h.alloc->store().device_waits(); }, swa_docs::hybrid_device_waits)
      .def("_full_pool", [](const HybridHandle& h) { return h.view(h.alloc->store().full_ptr()); })
      .def("_swa_pool", [](const HybridHandle& h) { return h.view(h.alloc->store().swa_ptr()); })
      .def("available_size", [](HybridHandle& h) { return reading(h, [&] { return h.alloc->available_size(); }); }, swa_docs::hybrid_available_size)
      .def("full_available_size", [](HybridHandle& h) { return reading(h, [&] { return h.alloc->full_available_size(); }); }, swa_docs::hybrid_full_available_size)
      .def("swa_available_size", [](HybridHandle& h) { return reading(h, [&] { return h.alloc->swa_available_size(); }); }, swa_docs::hybrid_swa_available_size)
      .def("full_used_size", [](HybridHandle& h) { return reading(h, [&] { return h.alloc->full_used_size(); }); }, swa_docs::hybrid_full_used_size)
      .def("swa_used_size", [](HybridHandle& h) { return reading(h, [&] { return h.alloc->swa_used_size(); }); }, swa_docs::hybrid_swa_used_size)
      .def("new_pages_available", [](HybridHandle& h, int64_t num_full_pages, int64_t num_swa_pages) {
             return reading(h, [&] { return h.alloc->new_pages_available(num_full_pages, num_swa_pages); });
           }, swa_docs::hybrid_new_pages_available, py::arg("num_full_pages"), py::arg("num_swa_pages"))
      .def("reservation_fits", [](HybridHandle& h, int64_t full_tokens, int64_t swa_tokens, int64_t full_evictable_tokens,
                                  int64_t swa_evictable_tokens, bool empty_pool, bool require_token_slack) {
             const swa::Reservation reservation{full_tokens, swa_tokens, full_evictable_tokens, swa_evictable_tokens,
                                                empty_pool, require_token_slack};
             return reading(h, [&] { return h.alloc->reservation_fits(reservation); });
           }, swa_docs::hybrid_reservation_fits, py::arg("full_tokens"), py::arg("swa_tokens"), py::kw_only(),
           py::arg("full_evictable_tokens") = 0, py::arg("swa_evictable_tokens") = 0, py::arg("empty_pool") = false,
           py::arg("require_token_slack") = false)
      .def("alloc", [](HybridHandle& h, int64_t need_size) {
             return allocation(h, [&](TensorOut& out) { return h.alloc->alloc(need_size, out); });
           }, swa_docs::hybrid_alloc, py::arg("need_size"))
      .def("alloc_extend", [](HybridHandle& h, const py::object& prefix_lens, const py::object& prefix_lens_cpu,
                              const py::object& seq_lens, const py::object& seq_lens_cpu, const py::object& last_loc,
                              int64_t extend_num_tokens) {
             return allocation(h, [&](TensorOut& out) {
               const ExtendArgs a(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, h.device);
               return h.alloc->alloc_extend(a.batch(), a.last_loc(), extend_num_tokens, out);
             });
           }, swa_docs::hybrid_alloc_extend, py::arg("prefix_lens"), py::arg("prefix_lens_cpu"), py::arg("seq_lens"), py::arg("seq_lens_cpu"),
           py::arg("last_loc"), py::arg("extend_num_tokens"))
      .def("alloc_extend_swa_tail", [](HybridHandle& h, const py::object& prefix_lens, const py::object& prefix_lens_cpu,
                                       const py::object& seq_lens, const py::object& seq_lens_cpu,
                                       const py::object& last_loc, int64_t extend_num_tokens, int64_t swa_tail_len) {
             return allocation(h, [&](TensorOut& out) {
               const ExtendArgs a(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, h.device);
               return h.alloc->alloc_extend_swa_tail(a.batch(), a.last_loc(), extend_num_tokens, swa_tail_len, out);
             });
           }, swa_docs::hybrid_alloc_extend_swa_tail, py::arg("prefix_lens"), py::arg("prefix_lens_cpu"), py::arg("seq_lens"), py::arg("seq_lens_cpu"),
           py::arg("last_loc"), py::arg("extend_num_tokens"), py::arg("swa_tail_len"))
      .def("alloc_decode", [](HybridHandle& h, const py::object& seq_lens, const py::object& seq_lens_cpu, const py::object& last_loc) {
             return allocation(h, [&](TensorOut& out) {
               const DecodeArgs a(seq_lens, seq_lens_cpu, last_loc, h.device);
               return h.alloc->alloc_decode(a.batch(), a.last_loc(), out);
             });
           }, swa_docs::hybrid_alloc_decode, py::arg("seq_lens"), py::arg("seq_lens_cpu"), py::arg("last_loc"))
      .def("translate_loc_from_full_to_swa", [](HybridHandle& h, const py::object& kv_indices) {
             UseGuard::wait_for_other_threads(*h.busy);
             const IntArg idx = int_arg("kv_indices", kv_indices, h.device);
             at::Tensor out = empty_indices(idx.tensor.numel(), h.device);
             h.alloc->translate(idx.span(), out.data_ptr<int64_t>());
             return out;
           }, swa_docs::hybrid_translate_loc_from_full_to_swa, py::arg("kv_indices"))
      .def("set_full_to_swa_mapping", [](HybridHandle& h, const py::object& full_indices, const py::object& swa_indices) {
             guarded(h, [&] {
               const IntArg full = int_arg("full_indices", full_indices, h.device);
               const IntArg swa_slots = int_arg("swa_indices", swa_indices, h.device);
               h.alloc->set_mapping(full.span(), swa_slots.span());
             });
           }, swa_docs::hybrid_set_full_to_swa_mapping, py::arg("full_indices"), py::arg("swa_indices"))
      .def("clear_full_to_swa_mapping", [](HybridHandle& h, const py::object& full_indices) {
             guarded(h, [&] {
               const IntArg full = int_arg("full_indices", full_indices, h.device);
               h.alloc->clear_mapping(full.span());
             });
           }, swa_docs::hybrid_clear_full_to_swa_mapping, py::arg("full_indices"))
#define SWA_EXT_FREE(name, arg_name)                                            \
  .def(#name, [](HybridHandle& h, const py::object& indices) {                 \
        guarded(h, [&] {                                                        \
          const IntArg idx = int_arg(arg_name, indices, h.device);              \
          h.alloc->name(idx.span());                                            \
        });                                                                     \
      }, swa_docs::hybrid_##name, py::arg(arg_name))
#define SWA_EXT_FREE_SEGMENT(name)                                              \
  .def(#name, [](HybridHandle& h, const py::object& indices, int64_t start_pos) { \
        guarded(h, [&] {                                                        \
          const IntArg idx = int_arg("indices", indices, h.device);             \
          h.alloc->name(idx.span(), start_pos);                                 \
        });                                                                     \
      }, swa_docs::hybrid_##name, py::arg("indices"), py::kw_only(), py::arg("start_pos"))
      SWA_EXT_FREE(free, "free_index")
      SWA_EXT_FREE(free_swa, "free_index")
      SWA_EXT_FREE(free_full, "free_index")
      SWA_EXT_FREE_SEGMENT(free_segment)
      SWA_EXT_FREE_SEGMENT(free_swa_segment)
      SWA_EXT_FREE_SEGMENT(free_full_segment)
#undef SWA_EXT_FREE
#undef SWA_EXT_FREE_SEGMENT
      .def("free_group_begin", [](HybridHandle& h) { guarded(h, [&] { h.alloc->free_group_begin(); }); },
           swa_docs::hybrid_free_group_begin)
      .def("free_group_end", [](HybridHandle& h) { guarded(h, [&] { h.alloc->free_group_end(); }); },
           swa_docs::hybrid_free_group_end)
      .def("evict_out_of_window", &evict_out_of_window, swa_docs::hybrid_evict_out_of_window, py::arg("req_to_token"),
           py::arg("rows"), py::arg("pre_lens"), py::arg("evicted_seqlens"), py::arg("window"), py::arg("interval") = 1,
           py::arg("prefix_sharing") = false)
      .def("clear", [](HybridHandle& h) { guarded(h, [&] { h.alloc->clear(); }); }, swa_docs::hybrid_clear)
      .def("resize", [](HybridHandle& h, int64_t size, int64_t size_swa) {
             guarded(h, [&] { h.alloc->resize(size, size_swa); });
           }, swa_docs::hybrid_resize, py::arg("size"), py::arg("size_swa"))
      // Waits for the device and raises an error its checks found since the last wait
      // (DeferredError); nothing to do on the CPU, whose calls raise at once.
      .def("check_device_errors", [](HybridHandle& h) { reading(h, [&] { h.alloc->store().raise_found_errors(); }); },
           swa_docs::hybrid_check_device_errors)
      .def("debug_print", [](HybridHandle& h) { return reading(h, [&] { return h.alloc->debug_string(); }); }, swa_docs::hybrid_debug_print)
      .def("check_invariants", [](HybridHandle& h) { reading(h, [&] { h.alloc->check_invariants(); }); }, swa_docs::hybrid_check_invariants)
      .def("backup_state", [](HybridHandle& h) { return reading(h, [&] { return h.alloc->backup_state(); }); }, swa_docs::hybrid_backup_state)
      .def("restore_state", [](HybridHandle& h, const swa::AllocatorState& state) {
             guarded(h, [&] { h.alloc->restore_state(state); });
           }, swa_docs::hybrid_restore_state, py::arg("state"));

  // swa_ext.decode's per-step call, after the class its first argument is.
  m.def("evict_out_of_window", &evict_out_of_window, swa_docs::evict_out_of_window, py::arg("allocator"),
        py::arg("req_to_token"), py::arg("rows"), py::arg("pre_lens"), py::arg("evicted_seqlens"), py::arg("window"),
        py::kw_only(), py::arg("interval") = 1, py::arg("prefix_sharing") = false);

  for (const auto& [name, define] : submodules()) {
    py::module_ submodule = m.def_submodule(name);
    define(submodule);
    swa_bindings::explain_argument_errors(submodule);
  }
  // Last: it takes over the calls of every function defined above.
  swa_bindings::explain_argument_errors(m);
}
