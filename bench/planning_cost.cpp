// The host cost of a device allocator call: what a GPU call pays before its first
// launch and between launches (checks, plan, batch layout, uploads). HybridAllocator
// runs over the device store with an executor that launches nothing (it counts the
// launches and copies host memory), against the same calls on the host store, in one
// process, alternating, each call from the same restored state. Not a test: run
//   cmake --build build/core --target swa_planning_cost && build/core/swa_planning_cost
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "allocator.h"
#include "device_store.h"

using namespace swa;
using V = std::vector<int64_t>;

namespace {

// HostExecutor's memory, with every op counted instead of run, and uploads counted (each
// costs what bench/staging_cost.py measures on top of the vector copy counted here).
class PlanningExecutor : public HostExecutor {
 public:
  const char* kernels() const override { return "planning"; }
  const int64_t* upload(const std::vector<int64_t>& words) override {
    ++uploads;
    return HostExecutor::upload(words);
  }
  void select_pages(const dev::StateWord*, int64_t, dev::StateWord, dev::StateWord, int64_t*, int64_t*) override {
    ++launches;
  }
#define SWA_COUNT_RUN(Op) \
  void run(int64_t, const Op&) override { ++launches; }
  SWA_DEVICE_OPS(SWA_COUNT_RUN)
#undef SWA_COUNT_RUN
  int64_t launches = 0, uploads = 0;
};

constexpr int64_t kWindow = 128, kTokensPerRequest = 640, kRowLen = 1024;

struct Case {
  int64_t batch, page_size, size;
  V host_mapping, dev_mapping, pre, req_to_token;
  std::shared_ptr<PlanningExecutor> exec = std::make_shared<PlanningExecutor>();
  HybridAllocator host, dev;
  AllocatorState state;

  Case(int64_t b, int64_t ps)
      : batch(b), page_size(ps), size((b * kTokensPerRequest + ps - 1) / ps * ps),
        host_mapping(static_cast<size_t>(HybridAllocator::mapping_size(size, size, ps, false))),
        dev_mapping(host_mapping.size()),
        host(std::make_unique<HostHybridStore>(size, size, ps, false, false, ParentLayout{}, host_mapping.data(), len())),
        dev(std::make_unique<DeviceHybridStore>(exec, size, size, ps, false, false, false, dev_mapping.data(), len())),
        state(host.backup_state()) {
    // The benchmark's state (bench/micro/cases.py): B requests of 128..256 tokens on unaligned lengths.
    V zeros(static_cast<size_t>(b), 0), no_prefix(static_cast<size_t>(b), -1);
    for (int64_t j = 0; j < b; ++j) pre.push_back(128 + 64 * (j % 3) + (j + 1) % ps);
    int64_t n = 0;
    for (int64_t p : pre) n += p;
    VectorOut out;
    host.alloc_extend(BatchLengths{zeros, pre, false}, no_prefix, n, out);
    req_to_token.assign(static_cast<size_t>(b * kRowLen), 0);
    for (int64_t j = 0, at = 0; j < b; at += pre[j], ++j)
      std::copy(out.values.begin() + at, out.values.begin() + at + pre[j], req_to_token.begin() + j * kRowLen);
    state = host.backup_state();
  }
  int64_t len() const { return static_cast<int64_t>(host_mapping.size()); }
  V last_of(const V& prefix) const {
    V last;
    for (int64_t j = 0; j < batch; ++j) last.push_back(prefix[j] > 0 ? req_to_token[j * kRowLen + prefix[j] - 1] : -1);
    return last;
  }
};

double median(std::vector<double> xs) {
  std::sort(xs.begin(), xs.end());
  return xs[xs.size() / 2];
}

// Times call(allocator) on both stores, alternating, each from the case's state.
void measure(const char* op, Case& c, const std::function<void(HybridAllocator&)>& call, int iters) {
  std::vector<double> host_ns, dev_ns;
  int64_t launches = 0, uploads = 0;
  for (int i = 0; i < iters; ++i) {
    for (const bool on_device : {i % 2 == 0, i % 2 != 0}) {
      HybridAllocator& a = on_device ? c.dev : c.host;
      a.restore_state(c.state);
      const int64_t before = c.exec->launches, uploads_before = c.exec->uploads;
      const auto t0 = std::chrono::steady_clock::now();
      call(a);
      const auto t1 = std::chrono::steady_clock::now();
      (on_device ? dev_ns : host_ns).push_back(std::chrono::duration<double, std::nano>(t1 - t0).count());
      if (on_device) launches = c.exec->launches - before, uploads = c.exec->uploads - uploads_before;
    }
  }
  const double h = median(host_ns), d = median(dev_ns);
  std::printf("| %s | %lld | %lld | %.2f | %.2f | %.2fx | %lld | %lld |\n", op, static_cast<long long>(c.batch),
              static_cast<long long>(c.page_size), h / 1e3, d / 1e3, d / h, static_cast<long long>(launches),
              static_cast<long long>(uploads));
}

// free_segment of every request's in-window pages (bench/micro/cases.py's case) on the host
// store, against the one write the contract requires of it and nothing else: zeroing
// the mapping of those pages (consecutive pages as one range), from the same state. A
// free cannot take less; its ratio to a reference is bounded by this clear.
void measure_free_segment_floor(Case& c, const V& evicted, int iters) {
  const int64_t ps = c.page_size;
  V slots, pages;
  for (int64_t j = 0; j < c.batch; ++j)
    for (int64_t t = evicted[j]; t < c.pre[j] / ps * ps; ++t) slots.push_back(c.req_to_token[j * kRowLen + t]);
  for (size_t i = 0; i < slots.size(); i += static_cast<size_t>(ps)) pages.push_back(slots[i] / ps);
  std::vector<double> free_ns, clear_ns;
  for (int i = 0; i < iters; ++i) {
    for (const bool clear_only : {i % 2 == 0, i % 2 != 0}) {
      c.host.restore_state(c.state);
      const auto t0 = std::chrono::steady_clock::now();
      if (clear_only) {
        int64_t* mapping = c.host_mapping.data();
        for (size_t k = 0; k < pages.size();) {
          size_t run = k + 1;
          while (run < pages.size() && pages[run] == pages[run - 1] + 1) ++run;
          std::fill(mapping + pages[k] * ps, mapping + (pages[run - 1] + 1) * ps, 0);
          k = run;
        }
      } else {
        c.host.free_segment(slots, 0);
      }
      const auto t1 = std::chrono::steady_clock::now();
      (clear_only ? clear_ns : free_ns).push_back(std::chrono::duration<double, std::nano>(t1 - t0).count());
    }
  }
  const double f = median(free_ns), z = median(clear_ns);
  std::printf("| free_segment | %lld | %lld | %zu | %.2f | %.2f | %.2fx |\n", static_cast<long long>(c.batch),
              static_cast<long long>(ps), slots.size(), f / 1e3, z / 1e3, f / z);
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::stoi(argv[1]) : 200;
  std::printf("Host cost per call, µs (median of %d, alternating): the host store's whole call against the device "
              "store's host side (ops counted, not run).\n\n", iters);
  std::printf("| op | batch | page | host store µs | device planning µs | planning / host | launches | uploads |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const int64_t ps : {1, 16, 64}) {
    for (const int64_t b : {1, 16, 256, 2048}) {
      Case c(b, ps);
      V seq;
      for (int64_t p : c.pre) seq.push_back(p + 1);
      const V decode_last = c.last_of(c.pre);
      measure("alloc_decode", c, [&](HybridAllocator& a) {
        VectorOut out;
        a.alloc_decode(BatchLengths{Span(), seq, true}, decode_last, out);
      }, iters);
      V ext_seq;
      int64_t ext = 0;
      for (int64_t j = 0; j < b; ++j) ext_seq.push_back(c.pre[j] + 1 + (37 * j) % 128), ext += ext_seq[j] - c.pre[j];
      measure("alloc_extend", c, [&](HybridAllocator& a) {
        VectorOut out;
        a.alloc_extend(BatchLengths{c.pre, ext_seq, false}, decode_last, ext, out);
      }, iters);
      V slots;
      for (int64_t j = 0; j < b; ++j)
        slots.insert(slots.end(), c.req_to_token.begin() + j * kRowLen, c.req_to_token.begin() + j * kRowLen + c.pre[j]);
      measure("free", c, [&](HybridAllocator& a) { a.free(slots); }, iters);
      V rows, pre_lens, evicted(static_cast<size_t>(b), 0), next(static_cast<size_t>(b));
      for (int64_t j = 0; j < b; ++j) rows.push_back(j), pre_lens.push_back(c.pre[j]);
      const SlotRows table{nullptr, c.req_to_token.data(), b, kRowLen};
      measure("evict_out_of_window", c, [&](HybridAllocator& a) {
        a.evict_out_of_window(table, rows, pre_lens, evicted, kWindow, 1, false, next.data());
      }, iters);
    }
  }
  std::printf("\nThe write a segment free cannot skip, µs (median of %d, alternating): the host store's "
              "free_segment against zeroing the mapping of the same pages alone.\n\n", iters);
  std::printf("| op | batch | page | slots | host store µs | mapping clear µs | host / clear |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|\n");
  for (const int64_t ps : {1, 16, 64})
    for (const int64_t b : {256, 2048}) {
      Case c(b, ps);
      // As bench/micro/cases.py: the out-of-window SWA KV evicted as of the previous step.
      V rows, pre_lens, evicted(static_cast<size_t>(b), 0), next(static_cast<size_t>(b));
      for (int64_t j = 0; j < b; ++j) rows.push_back(j), pre_lens.push_back(c.pre[j] - 1);
      c.host.evict_out_of_window(SlotRows{nullptr, c.req_to_token.data(), b, kRowLen}, rows, pre_lens, evicted,
                                 kWindow, 1, false, next.data());
      c.state = c.host.backup_state();
      measure_free_segment_floor(c, next, iters);
    }
  return 0;
}
