#pragma once

#include <cstdint>
#include <vector>

namespace swa {

// A read-only view of int64 values (a tensor's data, a vector).
struct Span {
  const int64_t* data = nullptr;
  int64_t size = 0;
  Span() = default;
  Span(const int64_t* d, int64_t n) : data(d), size(n) {}
  Span(const std::vector<int64_t>& v) : data(v.data()), size(static_cast<int64_t>(v.size())) {}
  int64_t operator[](int64_t i) const { return data[i]; }
};

// Where an allocation writes its indices; the binding hands out a fresh tensor only
// once the call is known to succeed.
struct OutBuffer {
  virtual ~OutBuffer() = default;
  virtual int64_t* get(int64_t n) = 0;
};

struct VectorOut : OutBuffer {
  std::vector<int64_t> values;
  int64_t* get(int64_t n) override {
    values.assign(static_cast<size_t>(n), 0);
    return values.data();
  }
};

}  // namespace swa
