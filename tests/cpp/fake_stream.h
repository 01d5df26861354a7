// One CUDA stream as the fakes of csrc/cuda's host-side templates see it: copies are
// enqueued and run in order, reading their source when they run, up to an event when a
// wait (or the test) lets the device catch up.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

struct FakeStream {
  struct Copy {
    int64_t* dst;
    const int64_t* src;
    int64_t words;
  };
  std::vector<Copy> queue;  // enqueued; the first `ran` have run
  std::vector<std::vector<int64_t>> delivered;  // what each copy read, as it ran
  size_t marks[16] = {};  // slot -> queue position its event stands at (copies run before it)
  size_t ran = 0;

  void enqueue(int64_t* dst, const int64_t* src, int64_t words) { queue.push_back(Copy{dst, src, words}); }
  void mark(int slot) { marks[slot] = queue.size(); }
  bool passed(int slot) const { return ran >= marks[slot]; }
  // Whether a copy not yet run reads or writes block.
  bool pending_on(const int64_t* block) const {
    for (size_t k = ran; k < queue.size(); ++k)
      if (queue[k].src == block || queue[k].dst == block) return true;
    return false;
  }
  void run_until(size_t end) {
    for (; ran < end; ++ran) {
      const Copy& c = queue[ran];
      std::copy(c.src, c.src + c.words, c.dst);
      delivered.emplace_back(c.src, c.src + c.words);
    }
  }
  void run_all() { run_until(queue.size()); }
};
