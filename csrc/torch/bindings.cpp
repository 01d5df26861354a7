// The torch/pybind11 layer: checks and unpacks tensors, takes the concurrency guard,
// and calls the torch-free core in csrc/core. No allocator rule lives here.
#include <torch/extension.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <optional>

#include "../core/hybrid_allocator.h"

namespace py = pybind11;

namespace {

bool debug_checks_enabled() {
  const char* flag = std::getenv("SWA_EXT_DEBUG");
  return flag != nullptr && flag[0] != '\0' && flag[0] != '0';
}

// Allocators are not thread-safe. Calls hold the GIL, so Python threads are serialised;
// anything that would interleave two calls anyway (a free-threaded interpreter, a
// caller that dropped the GIL) gets an error instead of a corrupted free list.
class UseGuard {
 public:
  explicit UseGuard(std::atomic<bool>& busy) : busy_(busy) {
    if (busy_.exchange(true, std::memory_order_acquire))
      throw swa::ConcurrentUseError("allocator used from two threads at once; serialise calls to it");
  }
  ~UseGuard() { busy_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool>& busy_;
};

// A 1-D int64 view of an index or length argument. int32 input (req_to_token rows are
// int32 in SGLang) is widened into a temporary the view keeps alive.
struct IntArg {
  at::Tensor tensor;
  swa::Span span() const { return swa::Span(tensor.data_ptr<int64_t>(), tensor.numel()); }
};

IntArg int_arg(const char* name, const py::handle& obj, const c10::Device& device) {
  if (!THPVariable_Check(obj.ptr()))
    throw py::type_error(std::string(name) + ": expected a torch.Tensor, got " + std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  const at::Tensor& t = THPVariable_Unpack(obj.ptr());
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
  if (device.is_cpu() && !device_obj.is(cpu_obj)) {
    IntArg dev = int_arg(name, device_obj, device);
    const int64_t n = cpu.tensor.numel();
    if (dev.tensor.numel() != n || (n > 0 && std::memcmp(dev.span().data, cpu.span().data, sizeof(int64_t) * n) != 0))
      throw py::value_error(std::string(name) + ": does not match " + cpu_name);
  } else if (!device.is_cpu()) {
    throw py::type_error("this build of swa_ext runs allocators on the CPU only");
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

c10::Device device_arg(const py::object& device) {
  const c10::Device d = py::isinstance<py::str>(device) ? c10::Device(device.cast<std::string>())
                                                         : device.cast<c10::Device>();
  if (!d.is_cpu()) throw py::type_error("device: this build of swa_ext has no CUDA kernels; use device='cpu'");
  return d;
}

// One page pool as SGLang's PagedTokenToKVPoolAllocator / TokenToKVPoolAllocator sees it.
// Pools of a hybrid allocator share its core pool and its guard.
struct PoolHandle {
  std::shared_ptr<swa::PagePool> pool;
  c10::Device device;
  std::shared_ptr<std::atomic<bool>> busy;
  bool debug;

  void after_change() const {
    if (debug) pool->check_invariants();
  }
};

struct HybridHandle {
  HybridHandle(int64_t size, int64_t size_swa, int64_t page_size, bool need_sort, const c10::Device& dev)
      : device(dev), busy(std::make_shared<std::atomic<bool>>(false)), debug(debug_checks_enabled()) {
    if (size_swa < page_size) swa::fail("size_swa", "must hold at least one page of ", page_size, " tokens, got ", size_swa);
    if (size < page_size) swa::fail("size", "must hold at least one page of ", page_size, " tokens, got ", size);
    // One tensor for the allocator's life: serving engines register it with their KV cache.
    mapping = at::zeros({swa::HybridAllocator::mapping_size(size, page_size)}, at::TensorOptions().dtype(at::kLong).device(device));
    core = std::make_unique<swa::HybridAllocator>(size, size_swa, page_size, need_sort, mapping.data_ptr<int64_t>());
  }
  void after_change() const {
    if (debug) core->check_invariants();
  }
  PoolHandle pool_view(const std::shared_ptr<swa::PagePool>& pool) const { return PoolHandle{pool, device, busy, debug}; }

  c10::Device device;
  at::Tensor mapping;
  std::shared_ptr<std::atomic<bool>> busy;
  bool debug;
  std::unique_ptr<swa::HybridAllocator> core;
};

swa::Batch extend_batch(const IntArg& prefix, const IntArg& seq, const IntArg& last) {
  return swa::Batch{prefix.span(), seq.span(), last.span(), false};
}

template <class Slot>
void evict_rows(swa::HybridAllocator& core, const at::Tensor& req_to_token, const IntArg& rows, const IntArg& pre_lens,
                const IntArg& evicted, int64_t window, int64_t interval, bool prefix_sharing, int64_t* out) {
  core.evict_out_of_window(req_to_token.data_ptr<Slot>(), req_to_token.size(0), req_to_token.size(1), rows.span(),
                           pre_lens.span(), evicted.span(), window, interval, prefix_sharing, out);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "swa_ext native core: SWA hybrid KV page allocator";
  py::register_exception<swa::ConcurrentUseError>(m, "ConcurrentUseError", PyExc_RuntimeError);
  m.def("built_with_cuda", []() { return false; });
  m.def("swa_tail_len", &swa::swa_tail_len, py::arg("seq_len"), py::arg("window"), py::arg("page_size"),
        py::arg("radix_cache") = false);
  m.def("evicted_after_step", &swa::evicted_after_step, py::arg("evicted"), py::arg("pre_len"), py::arg("window"),
        py::arg("page_size"), py::arg("interval") = 1, py::arg("prefix_sharing") = false);
  // The cheapest native call over an allocation's arguments: the floor benchmarks compare with.
  m.def("bench_floor", [](const py::args& args) { return args[args.size() - 1]; });

  py::class_<swa::HybridAllocator::State>(m, "AllocatorState")
      .def("__eq__", [](const swa::HybridAllocator::State& a, const swa::HybridAllocator::State& b) { return a == b; });
  py::class_<swa::PagePool>(m, "PoolState")
      .def("__eq__", [](const swa::PagePool& a, const swa::PagePool& b) { return a == b; });

  py::class_<PoolHandle>(m, "PagePool")
      .def(py::init([](int64_t size, int64_t page_size, const py::object& device, bool need_sort) {
             return PoolHandle{std::make_shared<swa::PagePool>(size, page_size, need_sort), device_arg(device),
                               std::make_shared<std::atomic<bool>>(false), debug_checks_enabled()};
           }),
           py::arg("size"), py::arg("page_size"), py::arg("device"), py::arg("need_sort") = false)
      // A second handle on the same pool: the pools of a hybrid allocator.
      .def(py::init([](const PoolHandle& shared) { return shared; }), py::arg("shared"))
      .def_property_readonly("page_size", [](const PoolHandle& h) { return h.pool->page_size(); })
      .def_property_readonly("size", [](const PoolHandle& h) { return h.pool->size(); })
      .def_property_readonly("size_full", [](const PoolHandle& h) { return h.pool->size(); })
      .def_property_readonly("num_pages", [](const PoolHandle& h) { return h.pool->num_pages(); })
      .def_property_readonly("need_sort", [](const PoolHandle& h) { return h.pool->need_sort(); })
      .def_property_readonly("device", [](const PoolHandle& h) { return h.device; })
      .def_property_readonly("free_pages", [](const PoolHandle& h) { return at::tensor(h.pool->free_pages(), at::kLong); })
      .def_property_readonly("release_pages", [](const PoolHandle& h) { return at::tensor(h.pool->staged_pages(), at::kLong); })
      .def_property_readonly("is_not_in_free_group", [](const PoolHandle& h) { return !h.pool->in_free_group(); })
      .def("available_size", [](const PoolHandle& h) { return h.pool->available_size(); })
      .def("alloc", [](PoolHandle& h, int64_t need_size) {
             UseGuard guard(*h.busy);
             TensorOut out(h.device);
             const bool ok = h.pool->alloc(need_size, out);
             h.after_change();
             return result(ok, out);
           }, py::arg("need_size"))
      .def("alloc_extend", [](PoolHandle& h, const py::object& prefix_lens, const py::object& prefix_lens_cpu,
                              const py::object& seq_lens, const py::object& seq_lens_cpu, const py::object& last_loc,
                              int64_t extend_num_tokens, std::optional<int64_t> num_new_pages) {
             UseGuard guard(*h.busy);
             const IntArg pre = lengths_arg("prefix_lens", prefix_lens, "prefix_lens_cpu", prefix_lens_cpu, h.device);
             const IntArg seq = lengths_arg("seq_lens", seq_lens, "seq_lens_cpu", seq_lens_cpu, h.device);
             const IntArg last = int_arg("last_loc", last_loc, h.device);
             TensorOut out(h.device);
             const bool ok = h.pool->alloc_extend(extend_batch(pre, seq, last), extend_num_tokens, num_new_pages.value_or(-1), out);
             h.after_change();
             return result(ok, out);
           }, py::arg("prefix_lens"), py::arg("prefix_lens_cpu"), py::arg("seq_lens"), py::arg("seq_lens_cpu"),
           py::arg("last_loc"), py::arg("extend_num_tokens"), py::arg("num_new_pages") = py::none())
      .def("alloc_decode", [](PoolHandle& h, const py::object& seq_lens, const py::object& seq_lens_cpu, const py::object& last_loc) {
             UseGuard guard(*h.busy);
             const IntArg seq = lengths_arg("seq_lens", seq_lens, "seq_lens_cpu", seq_lens_cpu, h.device);
             const IntArg last = int_arg("last_loc", last_loc, h.device);
             TensorOut out(h.device);
             const bool ok = h.pool->alloc_decode(swa::Batch{swa::Span(), seq.span(), last.span(), true}, out);
             h.after_change();
             return result(ok, out);
           }, py::arg("seq_lens"), py::arg("seq_lens_cpu"), py::arg("last_loc"))
      .def("free", [](PoolHandle& h, const py::object& free_index) {
             UseGuard guard(*h.busy);
             h.pool->free(int_arg("free_index", free_index, h.device).span());
             h.after_change();
           }, py::arg("free_index"))
      .def("free_page_ids", [](PoolHandle& h, const py::object& page_ids) {
             UseGuard guard(*h.busy);
             h.pool->free_page_ids(int_arg("page_ids", page_ids, h.device).span());
             h.after_change();
           }, py::arg("page_ids"))
      .def("free_segment", [](PoolHandle& h, const py::object& indices, int64_t start_pos) {
             UseGuard guard(*h.busy);
             h.pool->free_segment(int_arg("indices", indices, h.device).span(), start_pos);
             h.after_change();
           }, py::arg("indices"), py::kw_only(), py::arg("start_pos"))
      .def("free_group_begin", [](PoolHandle& h) { UseGuard guard(*h.busy); h.pool->free_group_begin(); })
      .def("free_group_end", [](PoolHandle& h) {
             UseGuard guard(*h.busy);
             h.pool->free_group_end();
             h.after_change();
           })
      .def("merge_and_sort_free", [](PoolHandle& h) { UseGuard guard(*h.busy); h.pool->merge_and_sort_free(); })
      .def("clear", [](PoolHandle& h) { UseGuard guard(*h.busy); h.pool->clear(); })
      .def("debug_print", [](const PoolHandle& h) { return h.pool->debug_string(); })
      .def("check_invariants", [](const PoolHandle& h) { h.pool->check_invariants(); })
      .def("backup_state", [](const PoolHandle& h) { return *h.pool; })
      .def("restore_state", [](PoolHandle& h, const swa::PagePool& state) {
             UseGuard guard(*h.busy);
             if (state.size() != h.pool->size() || state.page_size() != h.pool->page_size())
               swa::fail("state", "was taken from a pool of another shape");
             *h.pool = state;
           }, py::arg("state"));

  py::class_<HybridHandle>(m, "HybridAllocator")
      .def(py::init([](int64_t size, int64_t size_swa, int64_t page_size, const py::object& device, bool need_sort) {
             return std::make_unique<HybridHandle>(size, size_swa, page_size, need_sort, device_arg(device));
           }),
           py::arg("size"), py::arg("size_swa"), py::arg("page_size"), py::arg("device"), py::arg("need_sort"))
      .def_property_readonly("page_size", [](const HybridHandle& h) { return h.core->page_size(); })
      .def_property_readonly("size", [](const HybridHandle& h) { return std::min(h.core->full().size(), h.core->swa().size()); })
      .def_property_readonly("size_full", [](const HybridHandle& h) { return h.core->full().size(); })
      .def_property_readonly("size_swa", [](const HybridHandle& h) { return h.core->swa().size(); })
      .def_property_readonly("need_sort", [](const HybridHandle& h) { return h.core->full().need_sort(); })
      .def_property_readonly("device", [](const HybridHandle& h) { return h.device; })
      .def_property_readonly("full_to_swa_index_mapping", [](const HybridHandle& h) { return h.mapping; })
      .def("_full_pool", [](const HybridHandle& h) { return h.pool_view(h.core->full_ptr()); })
      .def("_swa_pool", [](const HybridHandle& h) { return h.pool_view(h.core->swa_ptr()); })
      .def("available_size", [](const HybridHandle& h) { return h.core->available_size(); })
      .def("full_available_size", [](const HybridHandle& h) { return h.core->full().available_size(); })
      .def("swa_available_size", [](const HybridHandle& h) { return h.core->swa().available_size(); })
      .def("new_pages_available", [](const HybridHandle& h, int64_t num_full_pages, int64_t num_swa_pages) {
             return h.core->new_pages_available(num_full_pages, num_swa_pages);
           }, py::arg("num_full_pages"), py::arg("num_swa_pages"))
      .def("alloc", [](HybridHandle& h, int64_t need_size) {
             UseGuard guard(*h.busy);
             TensorOut out(h.device);
             const bool ok = h.core->alloc(need_size, out);
             h.after_change();
             return result(ok, out);
           }, py::arg("need_size"))
      .def("alloc_extend", [](HybridHandle& h, const py::object& prefix_lens, const py::object& prefix_lens_cpu,
                              const py::object& seq_lens, const py::object& seq_lens_cpu, const py::object& last_loc,
                              int64_t extend_num_tokens) {
             UseGuard guard(*h.busy);
             const IntArg pre = lengths_arg("prefix_lens", prefix_lens, "prefix_lens_cpu", prefix_lens_cpu, h.device);
             const IntArg seq = lengths_arg("seq_lens", seq_lens, "seq_lens_cpu", seq_lens_cpu, h.device);
             const IntArg last = int_arg("last_loc", last_loc, h.device);
             TensorOut out(h.device);
             const bool ok = h.core->alloc_extend(extend_batch(pre, seq, last), extend_num_tokens, out);
             h.after_change();
             return result(ok, out);
           }, py::arg("prefix_lens"), py::arg("prefix_lens_cpu"), py::arg("seq_lens"), py::arg("seq_lens_cpu"),
           py::arg("last_loc"), py::arg("extend_num_tokens"))
      .def("alloc_extend_swa_tail", [](HybridHandle& h, const py::object& prefix_lens, const py::object& prefix_lens_cpu,
                                       const py::object& seq_lens, const py::object& seq_lens_cpu,
                                       const py::object& last_loc, int64_t extend_num_tokens, int64_t swa_tail_len) {
             UseGuard guard(*h.busy);
             const IntArg pre = lengths_arg("prefix_lens", prefix_lens, "prefix_lens_cpu", prefix_lens_cpu, h.device);
             const IntArg seq = lengths_arg("seq_lens", seq_lens, "seq_lens_cpu", seq_lens_cpu, h.device);
             const IntArg last = int_arg("last_loc", last_loc, h.device);
             TensorOut out(h.device);
             const bool ok = h.core->alloc_extend_swa_tail(extend_batch(pre, seq, last), extend_num_tokens, swa_tail_len, out);
             h.after_change();
             return result(ok, out);
           }, py::arg("prefix_lens"), py::arg("prefix_lens_cpu"), py::arg("seq_lens"), py::arg("seq_lens_cpu"),
           py::arg("last_loc"), py::arg("extend_num_tokens"), py::arg("swa_tail_len"))
      .def("alloc_decode", [](HybridHandle& h, const py::object& seq_lens, const py::object& seq_lens_cpu, const py::object& last_loc) {
             UseGuard guard(*h.busy);
             const IntArg seq = lengths_arg("seq_lens", seq_lens, "seq_lens_cpu", seq_lens_cpu, h.device);
             const IntArg last = int_arg("last_loc", last_loc, h.device);
             TensorOut out(h.device);
             const bool ok = h.core->alloc_decode(swa::Batch{swa::Span(), seq.span(), last.span(), true}, out);
             h.after_change();
             return result(ok, out);
           }, py::arg("seq_lens"), py::arg("seq_lens_cpu"), py::arg("last_loc"))
      .def("translate_loc_from_full_to_swa", [](const HybridHandle& h, const py::object& kv_indices) {
             const IntArg idx = int_arg("kv_indices", kv_indices, h.device);
             at::Tensor out = empty_indices(idx.tensor.numel(), h.device);
             h.core->translate(idx.span(), out.data_ptr<int64_t>());
             return out;
           }, py::arg("kv_indices"))
      .def("set_full_to_swa_mapping", [](HybridHandle& h, const py::object& full_indices, const py::object& swa_indices) {
             UseGuard guard(*h.busy);
             h.core->set_mapping(int_arg("full_indices", full_indices, h.device).span(),
                                 int_arg("swa_indices", swa_indices, h.device).span());
           }, py::arg("full_indices"), py::arg("swa_indices"))
      .def("clear_full_to_swa_mapping", [](HybridHandle& h, const py::object& full_indices) {
             UseGuard guard(*h.busy);
             h.core->clear_mapping(int_arg("full_indices", full_indices, h.device).span());
           }, py::arg("full_indices"))
#define SWA_EXT_FREE(name, arg_name)                                                                 \
  .def(#name, [](HybridHandle& h, const py::object& indices) {                                   \
        UseGuard guard(*h.busy);                                                                  \
        h.core->name(int_arg(arg_name, indices, h.device).span());                                  \
        h.after_change();                                                                         \
      }, py::arg(arg_name))
#define SWA_EXT_FREE_SEGMENT(name)                                                                \
  .def(#name, [](HybridHandle& h, const py::object& indices, int64_t start_pos) {                \
        UseGuard guard(*h.busy);                                                                  \
        h.core->name(int_arg("indices", indices, h.device).span(), start_pos);                    \
        h.after_change();                                                                         \
      }, py::arg("indices"), py::kw_only(), py::arg("start_pos"))
      SWA_EXT_FREE(free, "free_index")
      SWA_EXT_FREE(free_swa, "free_index")
      SWA_EXT_FREE(free_full, "free_index")
      SWA_EXT_FREE_SEGMENT(free_segment)
      SWA_EXT_FREE_SEGMENT(free_swa_segment)
      SWA_EXT_FREE_SEGMENT(free_full_segment)
#undef SWA_EXT_FREE
#undef SWA_EXT_FREE_SEGMENT
      .def("free_group_begin", [](HybridHandle& h) { UseGuard guard(*h.busy); h.core->free_group_begin(); })
      .def("free_group_end", [](HybridHandle& h) {
             UseGuard guard(*h.busy);
             h.core->free_group_end();
             h.after_change();
           })
      .def("evict_out_of_window", [](HybridHandle& h, const at::Tensor& req_to_token, const py::object& rows,
                                     const py::object& pre_lens, const py::object& evicted_seqlens, int64_t window,
                                     int64_t interval, bool prefix_sharing) {
             UseGuard guard(*h.busy);
             if (req_to_token.dim() != 2 || !req_to_token.is_contiguous())
               throw py::value_error("req_to_token: expected a contiguous 2-D tensor");
             if (req_to_token.device() != h.device)
               throw py::type_error("req_to_token: expected a tensor on " + h.device.str());
             const c10::Device cpu(c10::kCPU);
             const IntArg row_ids = int_arg("rows", rows, cpu), pre = int_arg("pre_lens", pre_lens, cpu);
             const IntArg evicted = int_arg("evicted_seqlens", evicted_seqlens, cpu);
             at::Tensor out = empty_indices(row_ids.tensor.numel(), cpu);
             int64_t* out_ptr = out.data_ptr<int64_t>();
             if (req_to_token.scalar_type() == at::kInt)
               evict_rows<int32_t>(*h.core, req_to_token, row_ids, pre, evicted, window, interval, prefix_sharing, out_ptr);
             else if (req_to_token.scalar_type() == at::kLong)
               evict_rows<int64_t>(*h.core, req_to_token, row_ids, pre, evicted, window, interval, prefix_sharing, out_ptr);
             else
               throw py::type_error("req_to_token: expected an int32 or int64 tensor");
             h.after_change();
             return out;
           }, py::arg("req_to_token"), py::arg("rows"), py::arg("pre_lens"), py::arg("evicted_seqlens"),
           py::arg("window"), py::arg("interval") = 1, py::arg("prefix_sharing") = false)
      .def("clear", [](HybridHandle& h) { UseGuard guard(*h.busy); h.core->clear(); })
      .def("debug_print", [](const HybridHandle& h) { return h.core->debug_string(); })
      .def("check_invariants", [](const HybridHandle& h) { h.core->check_invariants(); })
      .def("backup_state", [](const HybridHandle& h) { return h.core->backup_state(); })
      .def("restore_state", [](HybridHandle& h, const swa::HybridAllocator::State& state) {
             UseGuard guard(*h.busy);
             h.core->restore_state(state);
           }, py::arg("state"));
}
