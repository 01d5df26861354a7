// SGLang's running batch as the scheduler hook (swa_ext/sglang/hooks.py) needs it: the
// decode branch of ScheduleBatch.maybe_evict_swa reads a handful of lengths from every
// request's Python objects each step, and reading them here, through the CPython API,
// costs a few tens of nanoseconds each instead of a Python frame a request. It reads the
// requests and writes their evicted lengths back; window_eviction.cpp frees.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../core/rules.h"

// Hidden, as pybind11 declares its own types: these hold py::objects.
namespace swa_sglang __attribute__((visibility("hidden"))) {

namespace py = pybind11;

// Lengths at or past this take SGLang's loop: below it no sum or difference of two overflows.
constexpr int64_t kMaxLength = int64_t{1} << 62;

// The SGLang classes whose objects the reader reads, fixed when the hook is installed.
// The reader reads their fields where SGLang's methods would: Req.seqlen as
// len(origin_input_ids) + len(output_ids), ReqKvInfo's get/set_evicted_seqlen as its
// dict, holds_kv and swa_dead_lo from their fields, and a Req's plain attributes from its
// instance dict. So it reads only objects of exactly these types, and only while those
// methods are the ones it found when it was made and the class still defines no
// attribute of those names (a property would take precedence over the instance dict).
struct RequestClasses {
  RequestClasses(py::object req_type, py::object kv_type, py::object swa_component);
  // "" or which of the class attributes below changed since. Python gives a class a new
  // version tag whenever it or a base changes: while both classes keep the tags they had
  // at the last full check, nothing is looked up.
  std::string changed_attribute() const;
  py::object req_type;       // sglang.srt.managers.schedule_batch.Req
  py::object kv_type;        // ReqKvInfo, a Req's `kv`
  py::object swa_component;  // ComponentType.SWA, the key of the SWA evicted length
  Py_hash_t swa_hash;        // its hash, computed once (an Enum hashes in Python)
  struct Method {
    py::object owner, name, found;  // found: None for a name the class must not define
  };
  std::vector<Method> methods;  // the class attributes read in place, as found
  // Where a ReqKvInfo keeps each field it stores in a slot (its member descriptor's
  // offset; -1: read through the attribute), in KvField order.
  enum KvField { kRow, kEvictedLengths, kProtectedLen, kEvictFloor, kNumKvFields };
  Py_ssize_t kv_slot_offsets[kNumKvFields];

 private:
  bool tags_unchanged() const;
  mutable unsigned int checked_tags_[2] = {0, 0};  // Req's and ReqKvInfo's at the last full check; 0: none
};

// A due request of one decode batch that holds KV: what SGLang's loop would hand to
// free_swa_out_of_window_slots.
struct DueRequest {
  int64_t index;    // position in the batch
  int64_t row;      // req_to_token row (kv.req_pool_idx)
  int64_t pre_len;  // seqlen - 1, the committed length
  int64_t evicted;  // the SWA evicted length the request holds
  int64_t start;    // where its frees start: max(evicted, swa_dead_lo)
  bool has_entry;   // whether its evicted lengths hold an SWA entry (absent: 0)
  py::object evicted_lengths;  // its kv.component_evicted_seqlens, to write back
};

// A batch's due requests, in batch order.
using DueRequests = std::vector<DueRequest>;

// Reads the due requests of a decode batch (decode_batch_idx >= 1, a req_to_token row,
// the due test of rules.h on the evicted length it holds). Returns why SGLang's own loop
// must evict this batch instead, or "" when `due` holds it; it reads, it changes nothing.
std::string read_due_requests(const RequestClasses& classes, py::handle reqs, int64_t window, int64_t interval,
                              const swa::PageGeometry& page, DueRequests& due);

// Sets each due request's SWA evicted length to new_evicted[j], as SGLang's
// free_swa_out_of_window_slots sets it through ReqKvInfo.set_evicted_seqlen (the dict
// written only where the value moved or the entry was absent: the state is the same).
void write_evicted_lengths(const RequestClasses& classes, const DueRequests& due, const int64_t* new_evicted);

}  // namespace swa_sglang
