"""Microbenchmarks of the native SWA allocator (``swa-ext bench``).

Every measured case is one allocator call (or, for ``alloc_extend_swa_tail``, a
batch-1 operation, one call per request of the batch) made from the same
allocator state every iteration. The implementations are timed in the same
process, alternating inside one loop, in a new random order every round (a rotation
would keep each implementation behind the same one, and what runs before a call decides
how cold its caches are):

* ``native``: ``swa_ext.SWATokenToKVPoolAllocator``;
* ``baseline``: ``swa_ext_bench.BaselineSWAAllocator``, the same contract in
  plain torch tensor operations, the way SGLang 0.5.23 writes it (for
  ``evict_out_of_window``: the per-request loop ``evict_per_request`` over it);
* ``sglang``, whenever sglang is importable (``--no-sglang``: never): SGLang's
  own ``SWATokenToKVPoolAllocator`` (``sglang_ref``), given exactly the
  baseline's calls. At page size 1 its ``alloc_extend`` and ``alloc_decode`` go
  to ``alloc`` (as SGLang's scheduler calls it there), and it has no
  ``alloc_extend_swa_tail``, so those cells have no SGLang time;
* ``floor``: ``swa_ext._C.bench_floor``, the cheapest native call, given the
  same tensors plus a preallocated output tensor that it returns.

Before timing, every case runs each reference (baseline, SGLang) once and
checks that it returns what native returns on the same call, with the same
available sizes and full-to-SWA mapping after it (the drop-in contract); a
difference is reported on the row, not hidden.

Only the call is timed (``time.perf_counter_ns``); restoring the state
(``backup_state`` once, ``restore_state`` before every timed call) and, on
CUDA, synchronising the device happen outside the timed region, so CUDA times
are host time per call. torch runs with one intra-op thread by default
(``--threads``): at these sizes its thread pool only adds barrier waits to the
baseline's small tensor ops, and on a loaded machine outliers of milliseconds.
Each timed call follows another implementation's call and a state restore, so
caches are about as cold for the floor as for the others; measured in a
tight loop of its own, a call (the floor included) is faster.

The state of a case with batch ``B`` and page size ``ps`` (window ``W = 128``
tokens, both pools ``B * 640`` tokens) is ``B`` running requests, request ``j``
with ``pre_j = 128 + 64 * (j % 3) + (j + 1) % ps`` committed tokens, allocated
by one ``alloc_extend``, whose out-of-window SWA KV was evicted as of the
previous decode step. The calls measured on it:

* ``alloc_decode``: one token per request, ``seq = pre + 1``; exactly the
  requests with ``(j + 1) % ps == 0`` (``B // ps`` of them) cross into a new
  page (every request at ``ps == 1``);
* ``alloc_extend``: the next prefill chunk of every request, ``1 + (37 j) % 128``
  tokens on top of its unaligned prefix (all three parts of the layout);
* ``alloc_extend_swa_tail``: ``B`` new requests preallocated one call each
  (prefix 0, ``L = 128 + (37 j) % 128``, tail ``swa_tail_len(L, W, ps)``);
* ``free_segment``: one call on every request's page-aligned in-window run
  ``row[evicted:(pre // ps) * ps]``, concatenated;
* ``free``: one call on every request's in-window tokens ``row[evicted:pre]``,
  concatenated (the requests finishing);
* ``evict_out_of_window``: the decode step's window eviction over the ``B``
  requests (the ``B // ps`` at a page boundary each free one page).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

import swa_ext
from swa_ext import _C, decode
from swa_ext.outputs import OutputError, check_output, write_all

from . import sglang_ref
from .baseline import BaselineSWAAllocator
from .evict_baseline import evict_per_request

__all__ = ["OPS", "DEFAULT_BATCH_SIZES", "DEFAULT_PAGE_SIZES", "GOALS", "run", "goals", "to_markdown", "plot",
           "main"]

OPS = (
    "alloc_decode",
    "alloc_extend",
    "alloc_extend_swa_tail",
    "free_segment",
    "free",
    "evict_out_of_window",
)
DEFAULT_BATCH_SIZES = (1, 16, 256, 2048)
DEFAULT_PAGE_SIZES = (1, 16, 64)
IMPLS = ("native", "baseline", "sglang", "floor")
REFERENCES = ("baseline", "sglang")  # checked against native before timing

WINDOW = 128  # tokens (gpt-oss's sliding window)
POOL_TOKENS_PER_REQUEST = 640
ROW_LEN = 1024  # req_to_token columns
SMOKE_MAX_BATCH = 8
SMOKE_ITERS = 3
DEFAULT_SECONDS_PER_CASE = 0.8  # adaptive iteration count: time spent per case
MIN_ITERS, MAX_ITERS = 5, 400


class Goal(NamedTuple):
    """A goal the README reports against (not a timed test): ``ratio`` (a row's
    ``speedup_vs_baseline``, ``speedup_vs_sglang`` or ``ratio_to_floor``) at least
    ``bound`` (at most, for ``ratio_to_floor``) in every measured cell of ``op`` on
    ``device`` (None: any) with a batch size in ``batch_sizes`` (None: any) of at
    least ``min_batch`` and a page size in ``page_sizes`` (None: any)."""

    device: Optional[str]
    op: Optional[str]
    ratio: str
    bound: float
    batch_sizes: Optional[Tuple[int, ...]] = None
    page_sizes: Optional[Tuple[int, ...]] = None
    min_batch: int = 1


GOALS = (
    Goal("cpu", "alloc_decode", "speedup_vs_baseline", 10.0, (256,), (64,)),
    Goal("cpu", "alloc_decode", "ratio_to_floor", 3.0, (256,), (64,)),
    Goal("cuda", "alloc_decode", "speedup_vs_baseline", 3.0),  # host time
    # Issue 12, "CPU hot path at the floor".
    Goal("cpu", "alloc_decode", "speedup_vs_sglang", 20.0, (256,), (64,)),
    Goal("cpu", "free", "speedup_vs_baseline", 20.0, (256,), (64,)),
    Goal("cpu", "free_segment", "speedup_vs_baseline", 30.0, min_batch=256),
    Goal("cpu", "evict_out_of_window", "speedup_vs_baseline", 30.0, min_batch=256),
    Goal(None, None, "speedup_vs_baseline", 1.0),  # no cell slower than the baseline
)

NOTES = {
    "alloc_decode": "1 call; B//ps requests cross a page (all at ps=1)",
    "alloc_extend": "1 call; B chunks of 1..128 tokens on unaligned prefixes",
    "alloc_extend_swa_tail": "B calls (batch-1 op), one per new request",
    "free_segment": "1 call; B page-aligned in-window runs",
    "free": "1 call; B requests' in-window tokens",
    "evict_out_of_window": "1 batched call vs per-request loop; B//ps evict a page",
}


FLOOR_IMPL = "swa_ext._C.bench_floor"
EVICT_IMPL = "swa_ext.decode.evict_out_of_window"
SGLANG_IMPL = "sglang.srt.mem_cache.allocator.swa.SWATokenToKVPoolAllocator"


def default_devices() -> List[str]:
    devices = ["cpu"]
    if torch.cuda.is_available() and swa_ext.built_with_cuda():
        devices.append("cuda")
    return devices


# ---------------------------------------------------------------------------
# State


def _i64(values, device="cpu"):
    return torch.tensor(values, dtype=torch.int64, device=device)


def comparable(r):
    """A call's result as plain values (tensors as lists), for comparing implementations."""
    if isinstance(r, torch.Tensor):
        return r.cpu().tolist()
    if isinstance(r, (list, tuple)):
        return [comparable(x) for x in r]
    return r


class _Case:
    """The allocators of a case in the same state, and every op's inputs.

    ``allocs``: native's, the baseline's and, with ``with_sglang``, SGLang's, by
    implementation name; ``restore[name]()`` puts that one back in the case's state.
    """

    def __init__(self, batch: int, page_size: int, device: str, with_sglang: bool = False):
        ps, B = page_size, batch
        self.batch, self.page_size, self.device = B, ps, device
        dev = torch.device(device)
        size = -(-B * POOL_TOKENS_PER_REQUEST // ps) * ps
        self.native = swa_ext.SWATokenToKVPoolAllocator(size, size, ps, torch.bfloat16, dev)
        self.allocs = {"native": self.native, "baseline": BaselineSWAAllocator(size, size, ps, torch.bfloat16, dev)}
        if with_sglang:
            self.allocs["sglang"] = sglang_ref.make_allocator(size, size, ps, device)

        pre = [128 + 64 * (j % 3) + (j + 1) % ps for j in range(B)]
        self.pre = pre
        zeros = _i64([0] * B)
        pre_cpu = _i64(pre)
        last = _i64([-1] * B, dev)
        n = sum(pre)
        args = (zeros.to(dev), zeros, pre_cpu.to(dev), pre_cpu, last, n)
        outs = {name: alloc.alloc_extend(*args) for name, alloc in self.allocs.items()}
        flat = outs["native"]
        for name, out in outs.items():
            if out is None or not torch.equal(out.cpu(), flat.cpu()):
                raise RuntimeError(f"state setup: {name}'s alloc_extend diverged from native's (B={B}, ps={ps})")
        flat = flat.cpu()
        r2t = torch.zeros(B, ROW_LEN, dtype=torch.int32)
        off = 0
        for j, L in enumerate(pre):
            r2t[j, :L] = flat[off : off + L].to(torch.int32)
            off += L
        self.req_to_token = r2t.to(dev)
        rows = list(range(B))
        # Window eviction as of the previous decode step (pre_len - 1).
        evicted = {name: evict_per_request(alloc, self.req_to_token, rows, [p - 1 for p in pre], [0] * B, WINDOW, ps)
                   for name, alloc in self.allocs.items()}
        self.evicted = evicted["native"]
        for name in self.references():
            differs = "evicted lengths" if evicted[name] != self.evicted else self.mismatch(name)
            if differs:
                raise RuntimeError(f"state setup: {name} differs from native (B={B}, ps={ps}): {differs}")
        self.restore = {
            name: partial(sglang_ref.restore_state, alloc, sglang_ref.backup_state(alloc)) if name == "sglang"
            else partial(alloc.restore_state, alloc.backup_state())
            for name, alloc in self.allocs.items()
        }

    def references(self) -> List[str]:
        """The implementations in the case that are checked against native."""
        return [name for name in REFERENCES if name in self.allocs]

    def mismatch(self, name: str, r_native=None, r_other=None) -> Optional[str]:
        """What differs between native and implementation ``name`` after the same call
        returned ``r_native`` and ``r_other``: the result, the available sizes or the
        full-to-SWA mapping (None: nothing)."""
        other = self.allocs[name]
        if comparable(r_native) != comparable(r_other):
            return "returned indices"
        a = (self.native.full_available_size(), self.native.swa_available_size())
        b = (other.full_available_size(), other.swa_available_size())
        if a != b:
            return f"available sizes (full, swa): native {a}, {name} {b}"
        if not torch.equal(self.native.full_to_swa_index_mapping.cpu(), other.full_to_swa_index_mapping.cpu()):
            return "full-to-SWA mapping"
        return None

    def op(self, name: str, floor: Callable) -> Dict[str, Callable[[], object]]:
        """The zero-argument call of case ``name`` of every implementation of the case
        (SGLang's only where it has that call), by name in ``IMPLS`` order."""
        on, floor_call = getattr(self, "_op_" + name)(floor)
        calls = {impl: on(alloc) for impl, alloc in self.allocs.items()
                 if impl != "sglang" or sglang_ref.has_call(name, self.page_size)}
        calls["floor"] = floor_call
        return calls

    # Each returns (on, floor_call): on(allocator) is that allocator's zero-argument
    # call of the case, with its method looked up now rather than in the timed call.
    def _op_alloc_decode(self, floor):
        B, dev = self.batch, self.device
        seq_cpu = _i64([p + 1 for p in self.pre])
        seq = seq_cpu.to(dev)
        last = self.req_to_token[torch.arange(B, device=dev), _i64(self.pre, dev) - 1].to(torch.int64)
        out = torch.empty(B, dtype=torch.int64, device=dev)
        return (lambda a: partial(a.alloc_decode, seq, seq_cpu, last),
                partial(floor, seq, seq_cpu, last, out))

    def _op_alloc_extend(self, floor):
        B, dev = self.batch, self.device
        ext = [1 + (37 * j) % 128 for j in range(B)]
        pre_cpu = _i64(self.pre)
        seq_cpu = _i64([p + e for p, e in zip(self.pre, ext)])
        pre, seq = pre_cpu.to(dev), seq_cpu.to(dev)
        last = self.req_to_token[torch.arange(B, device=dev), pre - 1].to(torch.int64)
        n = sum(ext)
        out = torch.empty(n, dtype=torch.int64, device=dev)
        return (lambda a: partial(a.alloc_extend, pre, pre_cpu, seq, seq_cpu, last, n),
                partial(floor, pre, pre_cpu, seq, seq_cpu, last, out))

    def _op_alloc_extend_swa_tail(self, floor):
        B, ps, dev = self.batch, self.page_size, self.device
        calls, floor_calls = [], []
        for j in range(B):
            L = 128 + (37 * j) % 128
            tail = _C.swa_tail_len(L, WINDOW, ps)
            z_cpu, l_cpu = _i64([0]), _i64([L])
            z, l, last = z_cpu.to(dev), l_cpu.to(dev), _i64([-1], dev)
            calls.append((z, z_cpu, l, l_cpu, last, L, tail))
            floor_calls.append((z, z_cpu, l, l_cpu, last, torch.empty(L, dtype=torch.int64, device=dev)))

        def on(alloc):
            f = alloc.alloc_extend_swa_tail
            return lambda: [f(*c) for c in calls]

        return on, lambda: [floor(*c) for c in floor_calls]

    def _segments(self, aligned: bool):
        ps = self.page_size
        parts = []
        for j, (p, e) in enumerate(zip(self.pre, self.evicted)):
            end = (p // ps) * ps if aligned else p
            if end > e:
                parts.append(self.req_to_token[j, e:end])
        if not parts:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(parts).to(torch.int64)

    def _op_free_segment(self, floor):
        idx = self._segments(aligned=True)
        out = torch.empty(0, dtype=torch.int64, device=self.device)
        return lambda a: partial(a.free_segment, idx, start_pos=0), partial(floor, idx, out)

    def _op_free(self, floor):
        idx = self._segments(aligned=False)
        out = torch.empty(0, dtype=torch.int64, device=self.device)
        return lambda a: partial(a.free, idx), partial(floor, idx, out)

    def _op_evict_out_of_window(self, floor):
        r2t = self.req_to_token
        rows = torch.arange(self.batch, dtype=torch.int64)
        pre = _i64(self.pre)
        evicted = _i64(self.evicted)
        out = torch.empty(self.batch, dtype=torch.int64)

        def on(alloc):
            if alloc is self.native:  # the batched native call
                return partial(decode.evict_out_of_window, alloc, r2t, rows, pre, evicted, WINDOW)
            # The references: SGLang's scheduler loop, one free_swa_segment per due request.
            return partial(evict_per_request, alloc, r2t, rows, pre, evicted, WINDOW, self.page_size)

        return on, partial(floor, r2t, rows, pre, evicted, out)


# ---------------------------------------------------------------------------
# Timing


def _stats(ns: Sequence[int]) -> Dict[str, float]:
    xs = sorted(ns)
    q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) > 1 else [xs[0]] * 9
    return {"median": float(statistics.median(xs)), "p10": float(q[0]), "p90": float(q[-1])}


def _measure(case: _Case, calls: Dict[str, Callable], iters: Optional[int], seconds: float, warmup: int,
             flush: Optional[torch.Tensor] = None):
    """Times every implementation of ``calls`` (``_Case.op``): each round calls each once,
    in a new random order (seeded), its state restored first. Before that, untimed, each
    reference's call is checked against native's (``_Case.mismatch``). Returns the
    times (ns) by name, the rounds, and what differed by reference (None: nothing)."""
    cuda = case.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    slots = [(name, fn, case.restore.get(name)) for name, fn in calls.items()]
    times: Dict[str, List[int]] = {name: [] for name in calls}
    clock = time.perf_counter_ns

    for restore in case.restore.values():
        restore()
    r_native = calls["native"]()
    sync()
    mismatches = {}
    for name in case.references():
        if name in calls:
            r_other = calls[name]()
            sync()
            mismatches[name] = case.mismatch(name, r_native, r_other)
            del r_other
    del r_native

    order = list(range(len(slots)))
    shuffle = random.Random(0).shuffle

    def one_round(record):
        shuffle(order)
        for k in order:
            name, fn, restore = slots[k]
            if restore is not None:
                restore()
            if flush is not None:
                flush.add_(1)  # evict the caches: every call starts cold
            sync()
            t0 = clock()
            r = fn()
            t1 = clock()
            sync()
            del r
            if record:
                times[name].append(t1 - t0)

    gc_was_enabled = gc.isenabled()
    gc.disable()  # run() collected once up front; reference counting frees the rest
    try:
        started = time.perf_counter()
        one_round(False)
        per_round = time.perf_counter() - started
        # A second warm-up round unless one round already eats a tenth of the budget.
        for _ in range(1, warmup if per_round * 10 < seconds else 1):
            t = time.perf_counter()
            one_round(False)
            per_round = time.perf_counter() - t
        if iters is None:
            iters = int(max(MIN_ITERS, min(MAX_ITERS, seconds / max(per_round, 1e-9))))
        for _ in range(iters):
            one_round(True)
    finally:
        if gc_was_enabled:
            gc.enable()
    for restore in case.restore.values():
        restore()
    return times, iters, mismatches


def run(
    ops: Optional[Sequence[str]] = None,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    page_sizes: Sequence[int] = DEFAULT_PAGE_SIZES,
    devices: Optional[Sequence[str]] = None,
    iters: Optional[int] = None,
    smoke: bool = False,
    seconds_per_case: float = DEFAULT_SECONDS_PER_CASE,
    progress: bool = False,
    threads: Optional[int] = 1,
    flush_cache_mb: int = 0,
    with_sglang: Optional[bool] = None,
) -> List[dict]:
    """Measure every (device, page size, batch size, op) case; one row dict each.

    ``iters=None`` picks the iteration count per case so that each takes about
    ``seconds_per_case`` (at least 5, at most 400 rounds of the implementations).
    ``smoke`` caps the batch sizes at 8 and runs 3 iterations (unless ``iters`` is
    given), so that the whole thing takes seconds.
    ``threads``: torch's intra-op threads during the run (default 1: at these
    sizes the pool only adds barrier waits, and on a loaded machine large
    outliers, to the baseline's tensor ops; ``None`` leaves torch's setting).
    ``flush_cache_mb > 0``: before every timed call, write a buffer of that
    size (make it bigger than the last-level cache) so that all the
    implementations start from cold caches whatever their restore touched.
    ``with_sglang``: measure SGLang's allocator too (None: whenever sglang is
    importable; True without it raises RuntimeError); rows without it have None
    for its times and ratio.
    """
    ops = list(OPS if ops is None else ops)
    for op in ops:
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")
    batch_sizes = [int(b) for b in batch_sizes]
    page_sizes = [int(p) for p in page_sizes]
    if any(b <= 0 for b in batch_sizes) or any(p <= 0 for p in page_sizes):
        raise ValueError("batch and page sizes must be positive")
    if smoke:
        batch_sizes = sorted({min(b, SMOKE_MAX_BATCH) for b in batch_sizes})
        if iters is None:
            iters = SMOKE_ITERS
    warmup = 1 if smoke else 2
    devices = list(default_devices() if devices is None else devices)
    for d in devices:
        if d.startswith("cuda") and not (torch.cuda.is_available() and swa_ext.built_with_cuda()):
            raise ValueError("CUDA requested, but no GPU is visible or swa_ext was built without CUDA")
    if with_sglang is not False:
        reason = sglang_ref.unavailable_reason()
        if with_sglang and reason is not None:
            raise RuntimeError(f"SGLang's allocator is not importable ({reason})")
        with_sglang = reason is None

    gc.collect()
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(int(threads))
    try:
        flush = None
        if flush_cache_mb > 0:
            flush = torch.zeros(int(flush_cache_mb) * (1 << 20) // 8, dtype=torch.int64)
        return _run(ops, batch_sizes, page_sizes, devices, iters, warmup, seconds_per_case,
                    progress, flush, with_sglang)
    finally:
        torch.set_num_threads(old_threads)


def _run(ops, batch_sizes, page_sizes, devices, iters, warmup, seconds_per_case, progress, flush, with_sglang):
    rows: List[dict] = []
    total = len(devices) * len(page_sizes) * len(batch_sizes) * len(ops)
    for device in devices:
        for ps in page_sizes:
            for B in batch_sizes:
                case = _Case(B, ps, device, with_sglang)
                for op in ops:
                    times, n, mismatches = _measure(case, case.op(op, _C.bench_floor), iters, seconds_per_case,
                                                    warmup, flush)
                    row = _row(device, op, B, ps, n, times, mismatches, flush)
                    rows.append(row)
                    if progress:
                        print(f"[{len(rows)}/{total}] " + _progress(row), file=sys.stderr, flush=True)
                del case
    return rows


def _row(device, op, B, ps, n, times, mismatches, flush) -> dict:
    sglang = "sglang" in times
    row = {
        "device": device,
        "op": op,
        "batch_size": B,
        "page_size": ps,
        "iters": n,
        "calls": B if op == "alloc_extend_swa_tail" else 1,
        "note": NOTES[op],
        "results_match": mismatches["baseline"] is None,
        "baseline_mismatch": mismatches["baseline"],
        "sglang_measured": sglang,
        "sglang_results_match": mismatches["sglang"] is None if sglang else None,
        "sglang_mismatch": mismatches.get("sglang"),
        "floor_impl": FLOOR_IMPL,
        "torch_threads": torch.get_num_threads(),
        "flush_cache_mb": 0 if flush is None else flush.numel() * 8 >> 20,
    }
    if op == "evict_out_of_window":
        row["native_impl"] = EVICT_IMPL
    for impl in IMPLS:
        stats = _stats(times[impl]) if impl in times else dict.fromkeys(("median", "p10", "p90"))
        for k, v in stats.items():
            row[f"{impl}_{k}_us"] = None if v is None else v / 1000.0
    row["speedup_vs_baseline"] = row["baseline_median_us"] / row["native_median_us"]
    row["speedup_vs_sglang"] = row["sglang_median_us"] / row["native_median_us"] if sglang else None
    row["ratio_to_floor"] = row["native_median_us"] / row["floor_median_us"]
    return row


def _progress(r) -> str:
    """A row as one progress line."""
    impls = [impl for impl in IMPLS if r[f"{impl}_median_us"] is not None]
    refs = ["baseline"] + (["sglang"] if r["sglang_measured"] else [])
    return (f"{r['device']} {r['op']} B={r['batch_size']} ps={r['page_size']}: "
            + ", ".join(f"{impl} {_fmt_us(r[f'{impl}_median_us'])} µs" for impl in impls)
            + " (" + ", ".join(f"{_fmt_ratio(r[f'speedup_vs_{ref}'])} vs {ref}" for ref in refs)
            + f", {_fmt_ratio(r['ratio_to_floor'])} vs floor, {r['iters']} iters)"
            + "".join(f"  {ref.upper()} DIFFERS: {r[f'{ref}_mismatch']}" for ref in refs if r[f"{ref}_mismatch"]))


# ---------------------------------------------------------------------------
# Reports


def _goal_name(g: Goal) -> str:
    where = [w for w in (g.device, g.op) if w]
    if g.batch_sizes:
        where.append("B=" + ",".join(map(str, g.batch_sizes)))
    if g.min_batch > 1:
        where.append(f"B>={g.min_batch}")
    if g.page_sizes:
        where.append("ps=" + ",".join(map(str, g.page_sizes)))
    bound = (f"<= {g.bound:g}x vs floor" if g.ratio == "ratio_to_floor"
             else f">= {g.bound:g}x vs {g.ratio[len('speedup_vs_'):]}")
    return f"{' '.join(where) or 'every cell'}: {bound}"


def _goal_cells(g: Goal, rows: Sequence[dict]) -> List[dict]:
    return [r for r in rows
            if (g.device is None or r["device"].split(":")[0] == g.device)
            and (g.op is None or r["op"] == g.op)
            and (g.batch_sizes is None or r["batch_size"] in g.batch_sizes)
            and r["batch_size"] >= g.min_batch
            and (g.page_sizes is None or r["page_size"] in g.page_sizes)
            and r[g.ratio] is not None]


def goals(rows: Sequence[dict]) -> List[dict]:
    """Every goal of ``GOALS`` that ``rows`` measure, at its worst measured cell."""
    out = []
    for g in GOALS:
        cells = _goal_cells(g, rows)
        if not cells:
            continue
        at_most = g.ratio == "ratio_to_floor"
        worst = (max if at_most else min)(cells, key=lambda r: r[g.ratio])
        value = worst[g.ratio]
        cell = [worst[k] for k, fixed in (("device", g.device), ("op", g.op)) if fixed is None]
        out.append({
            "goal": _goal_name(g),
            "ratio": g.ratio,
            "bound": g.bound,
            "worst": " ".join(cell + [f"B={worst['batch_size']}", f"ps={worst['page_size']}"]),
            "value": value,
            "met": bool(value <= g.bound if at_most else value >= g.bound),
        })
    return out


def _fmt_us(x: float) -> str:
    if x >= 1000:
        return f"{x:,.0f}"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _fmt_ratio(x: Optional[float]) -> str:
    """A ratio the one way the progress lines, the table, the goals and the README write it
    (n/a: not measured)."""
    if x is None:
        return "n/a"
    return f"{x:,.0f}x" if x >= 100 else f"{x:.1f}x"


def _cell(r, impl):
    if r[impl + "_median_us"] is None:
        return "n/a"
    return (
        f"{_fmt_us(r[impl + '_median_us'])} "
        f"({_fmt_us(r[impl + '_p10_us'])}–{_fmt_us(r[impl + '_p90_us'])})"
    )


def _differs(r) -> List[str]:
    """What each reference that differed from native on row ``r`` got wrong."""
    return [f"{ref}: {r[f'{ref}_mismatch']}" for ref in REFERENCES if r.get(f"{ref}_mismatch")]


def to_markdown(rows: Sequence[dict]) -> str:
    """Markdown: one table (medians, p10–p90, ratios) and the goals. The SGLang
    columns are there when some row measured SGLang's allocator."""
    sglang = any(r["sglang_measured"] for r in rows)
    impls = [impl for impl in IMPLS if sglang or impl != "sglang"]
    refs = [ref for ref in REFERENCES if sglang or ref != "sglang"]
    lines = [
        "Times in µs per measured call: median (p10–p90). "
        "vs baseline = baseline median / native median"
        + (", vs sglang = SGLang median / native median" if sglang else "")
        + " (above 1x native is faster); vs floor = native median / floor median.",
        "",
        "| device | op | batch | page | " + " | ".join(f"{impl} µs" for impl in impls) + " | "
        + " | ".join(f"vs {ref}" for ref in refs) + " | vs floor | iters |",
        "|---|---|---:|---:|" + "---:|" * (len(impls) + len(refs) + 2),
    ]
    for r in rows:
        flag = " ⚠" if _differs(r) else ""
        lines.append(
            f"| {r['device']} | {r['op']}{flag} | {r['batch_size']} | {r['page_size']} | "
            + " | ".join(_cell(r, impl) for impl in impls) + " | "
            + " | ".join(_fmt_ratio(r[f"speedup_vs_{ref}"]) for ref in refs)
            + f" | {_fmt_ratio(r['ratio_to_floor'])} | {r['iters']} |"
        )
    ops_seen = list(dict.fromkeys(r["op"] for r in rows))
    if ops_seen:
        lines += ["", "What one measured call covers (B = batch size, ps = page size):", ""]
        lines += [f"- `{op}`: {NOTES[op]}" for op in ops_seen]
    differ = [r for r in rows if _differs(r)]
    if differ:
        lines += ["", "⚠: results differed from native's on the same call:", ""]
        lines += [f"- {r['device']} {r['op']} B={r['batch_size']} ps={r['page_size']}: " + "; ".join(_differs(r))
                  for r in differ]
    if rows:
        lines += ["", f"Floor: {rows[0]['floor_impl']}."]
    if sglang:
        lines.append(f"SGLang: {SGLANG_IMPL}; at page size 1 `alloc_extend` and `alloc_decode` call its "
                     "`alloc`, and n/a: it has no `alloc_extend_swa_tail` there.")
    gs = goals(rows)
    if gs:
        lines += ["", "Goals (each at its worst measured cell):", ""]
        lines += [f"- {g['goal']}: {_fmt_ratio(g['value'])} at {g['worst']}: "
                  f"**{'met' if g['met'] else 'not met'}**" for g in gs]
    return "\n".join(lines) + "\n"


def report(rows: Sequence[dict]) -> dict:
    """The JSON document: environment, rows and goals."""
    return {
        "meta": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "sglang": sglang_ref.version() if any(r["sglang_measured"] for r in rows) else None,
            "window": WINDOW,
            "pool_tokens_per_request": POOL_TOKENS_PER_REQUEST,
            "timer": "time.perf_counter_ns around the call only (host time)",
        },
        "rows": list(rows),
        "goals": goals(rows),
    }


# Colour tells the implementations apart, marker and line style the page sizes.
IMPL_COLORS = {"native": "#1f5fbf", "baseline": "#d0342c", "sglang": "#e08a00", "floor": "#8c8c8c"}
IMPL_TITLES = {"native": "native", "baseline": "SGLang-style torch baseline", "sglang": "SGLang's allocator",
               "floor": "native-call floor"}
PAGE_STYLES = (("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."), ("v", (0, (5, 1, 1, 1))))
LEGEND_INCHES = 0.45  # below the panels, so that it covers no data


def plot(rows: Sequence[dict], path) -> None:
    """PNG: median time (p10-p90 bars) vs batch size, one panel per (device, op); colour =
    implementation, marker and line style = page size, the legend below the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    devices = list(dict.fromkeys(r["device"] for r in rows))
    ops = list(dict.fromkeys(r["op"] for r in rows))
    page_sizes = sorted({r["page_size"] for r in rows})
    impls = [impl for impl in IMPLS if any(r[f"{impl}_median_us"] is not None for r in rows)]
    style = {ps: PAGE_STYLES[i % len(PAGE_STYLES)] for i, ps in enumerate(page_sizes)}
    ncols = min(3, max(1, len(ops)))
    per_dev = -(-len(ops) // ncols)
    nrows = max(1, per_dev * len(devices))
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows + LEGEND_INCHES), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for di, dev in enumerate(devices):
        for oi, op in enumerate(ops):
            ax = axes[di * per_dev + oi // ncols][oi % ncols]
            ax.set_visible(True)
            for ps in page_sizes:
                marker, linestyle = style[ps]
                for impl in impls:
                    sel = sorted(
                        (r for r in rows if r["device"] == dev and r["op"] == op and r["page_size"] == ps
                         and r[f"{impl}_median_us"] is not None),
                        key=lambda r: r["batch_size"],
                    )
                    if not sel:
                        continue
                    xs = [r["batch_size"] for r in sel]
                    ys = [r[f"{impl}_median_us"] for r in sel]
                    lo = [r[f"{impl}_median_us"] - r[f"{impl}_p10_us"] for r in sel]
                    hi = [r[f"{impl}_p90_us"] - r[f"{impl}_median_us"] for r in sel]
                    ax.errorbar(xs, ys, yerr=[lo, hi], color=IMPL_COLORS[impl], marker=marker,
                                linestyle=linestyle, capsize=2, linewidth=1.3, markersize=4.5,
                                markerfacecolor="white" if impl == "floor" else IMPL_COLORS[impl])
            ax.set_xscale("log", base=2)
            batch_sizes = sorted({r["batch_size"] for r in rows if r["device"] == dev and r["op"] == op})
            ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_title(f"{dev}: {op}", fontsize=10)
            ax.set_xlabel("batch size")
            ax.set_ylabel("µs per call")
            ax.grid(True, which="both", alpha=0.3)
    handles = [Line2D([], [], color=IMPL_COLORS[impl], linewidth=2.5, label=impl) for impl in impls]
    handles += [Line2D([], [], color="black", marker=style[ps][0], linestyle=style[ps][1], linewidth=1.2,
                       label=f"page size {ps}") for ps in page_sizes]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9, frameon=False)
    fig.suptitle("swa_ext allocator: " + " vs ".join(IMPL_TITLES[impl] for impl in impls)
                 + " (median, bars p10–p90)", fontsize=11)
    fig.tight_layout(rect=(0, LEGEND_INCHES / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------
# Command line

PROG = "swa-ext bench"


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _UsageError(f"{self.prog}: error: {message}")


def _int_list(values: Sequence[str], what: str) -> List[int]:
    out = []
    for v in values:
        for part in str(v).split(","):
            if not part.strip():
                continue
            try:
                n = int(part)
            except ValueError:
                raise _UsageError(f"{PROG}: error: {what}: not an integer: {part!r}") from None
            if n <= 0:
                raise _UsageError(f"{PROG}: error: {what}: must be positive, got {n}")
            out.append(n)
    if not out:
        raise _UsageError(f"{PROG}: error: {what}: empty")
    return out


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Microbenchmarks of the native SWA allocator against the SGLang-style "
        "torch baseline, SGLang's own allocator (whenever sglang is importable) and the "
        "native-call floor, measured alternating in one process.",
    )
    p.add_argument("--ops", nargs="+", metavar="OP",
                   help=f"ops to measure, comma- or space-separated (default: all of {','.join(OPS)})")
    p.add_argument("--batch-sizes", nargs="+", metavar="N",
                   help="batch sizes (default 1,16,256,2048)")
    p.add_argument("--page-sizes", nargs="+", metavar="N", help="page sizes (default 1,16,64)")
    p.add_argument("--device", action="append", choices=["cpu", "cuda", "all"],
                   help="device to measure on (repeatable; default: cpu, and cuda when a GPU is "
                   "visible and swa_ext was built with CUDA)")
    p.add_argument("--iters", type=int, metavar="N",
                   help="timed iterations per case (default: as many as fit in --seconds-per-case)")
    p.add_argument("--seconds-per-case", type=float, default=DEFAULT_SECONDS_PER_CASE, metavar="S",
                   help="time budget of one case when --iters is not given "
                   f"(default {DEFAULT_SECONDS_PER_CASE:g})")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="torch intra-op threads during the run (default 1; 0: leave torch's default)")
    p.add_argument("--flush-cache-mb", type=int, default=0, metavar="MB",
                   help="before every timed call write a buffer of MB megabytes, so that every "
                   "call starts with cold caches (default 0: off; use more than the L3 size)")
    p.add_argument("--no-sglang", action="store_true",
                   help="leave SGLang's allocator out (default: measured whenever sglang is importable)")
    p.add_argument("--smoke", action="store_true",
                   help=f"tiny run: batch sizes capped at {SMOKE_MAX_BATCH}, {SMOKE_ITERS} iterations")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the markdown table")
    p.add_argument("--plot", metavar="PATH", help="write a PNG")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``swa-ext bench``: checks every argument (exit 2, one line, before any work), then
    measures and writes the reports. The wall time it prints runs from here to the last
    report written."""
    started = time.perf_counter()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
        ops = None
        if args.ops:
            ops = [o.strip() for v in args.ops for o in v.split(",") if o.strip()]
            bad = [o for o in ops if o not in OPS]
            if bad:
                raise _UsageError(f"{PROG}: error: unknown op(s) {', '.join(bad)}; known: {', '.join(OPS)}")
        batch_sizes = (_int_list(args.batch_sizes, "--batch-sizes") if args.batch_sizes
                       else DEFAULT_BATCH_SIZES)
        page_sizes = _int_list(args.page_sizes, "--page-sizes") if args.page_sizes else DEFAULT_PAGE_SIZES
        if args.iters is not None and args.iters <= 0:
            raise _UsageError(f"{PROG}: error: --iters must be positive")
        if args.flush_cache_mb < 0:
            raise _UsageError(f"{PROG}: error: --flush-cache-mb must be >= 0")
        if args.threads < 0:
            raise _UsageError(f"{PROG}: error: --threads must be >= 0")
        if not args.seconds_per_case > 0:
            raise _UsageError(f"{PROG}: error: --seconds-per-case must be positive")
        devices = None
        if args.device:
            devices = []
            for d in args.device:
                for x in (default_devices() if d == "all" else [d]):
                    if x not in devices:
                        devices.append(x)
            if "cuda" in devices and not (torch.cuda.is_available() and swa_ext.built_with_cuda()):
                raise _UsageError(
                    f"{PROG}: error: --device cuda: no GPU visible or swa_ext built without CUDA"
                )
        for flag, out in (("--json", args.json), ("--markdown", args.markdown), ("--plot", args.plot)):
            if out is not None:
                try:
                    check_output(f"{PROG}: error: {flag}", out, image=flag == "--plot")
                except OutputError as e:
                    raise _UsageError(str(e)) from None
    except _UsageError as e:
        print(e, file=sys.stderr)
        return 2

    with_sglang, importing = False, time.perf_counter()
    if not args.no_sglang:
        reason = sglang_ref.unavailable_reason()  # imports sglang: seconds
        if reason is not None:
            print(f"{PROG}: SGLang's allocator is not importable ({reason}): "
                  "measuring native, baseline and floor only", file=sys.stderr)
        with_sglang = reason is None
    measuring = time.perf_counter()
    imported = f"sglang imported in {measuring - importing:.1f} s, " if with_sglang else ""
    rows = run(
        ops=ops,
        batch_sizes=batch_sizes,
        page_sizes=page_sizes,
        devices=devices,
        iters=args.iters,
        smoke=args.smoke,
        seconds_per_case=args.seconds_per_case,
        progress=not args.quiet,
        threads=args.threads if args.threads > 0 else None,
        flush_cache_mb=args.flush_cache_mb,
        with_sglang=with_sglang,
    )
    measured = time.perf_counter() - measuring
    md = to_markdown(rows)
    print(md)
    reports = []
    if args.markdown:
        reports.append((args.markdown, lambda tmp: Path(tmp).write_text(md, encoding="utf-8")))
    if args.json:
        def write_json(tmp):
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(report(rows), f, indent=2)
                f.write("\n")

        reports.append((args.json, write_json))
    if args.plot:
        reports.append((args.plot, lambda tmp: plot(rows, tmp)))
    for path in write_all(reports):
        print(f"wrote {path}")
    if not args.quiet:
        print(f"wall time {time.perf_counter() - started:.1f} s: {imported}"
              f"{len(rows)} case{'' if len(rows) == 1 else 's'} measured in {measured:.1f} s, "
              f"then the reports (interpreter and torch start-up not counted)", file=sys.stderr)
    return 0


if __name__ == "__main__":  # as `swa-ext bench`: its errors and Ctrl-C read the same
    from swa_ext.cli import main as cli_main

    sys.exit(cli_main(["bench", *sys.argv[1:]]))
