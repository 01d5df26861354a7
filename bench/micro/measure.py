"""Timing: the implementations of a case alternating in one loop, one row of
statistics and ratios per case, and the row's progress line."""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

import swa_ext

from .._floor import floor

from .. import sglang_ref
from .cases import (DEFAULT_BATCH_SIZES, DEFAULT_PAGE_SIZES, DEFAULT_SECONDS_PER_CASE, EVICT_IMPL, FLOOR_IMPL, IMPLS,
                    MAX_ITERS, MIN_ITERS, NOTES, OPS, SMOKE_ITERS, SMOKE_MAX_BATCH, _Case, default_devices)

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
                    times, n, mismatches = _measure(case, case.op(op, floor), iters, seconds_per_case,
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
    for mode in ("shared", "parents"):  # the shared mode, and on parent pages, against the default mode
        median = row[f"{mode}_median_us"]
        row[f"{mode}_vs_default"] = None if median is None else median / row["native_median_us"]
    return row


def _progress(r) -> str:
    """A row as one progress line."""
    impls = [impl for impl in IMPLS if r[f"{impl}_median_us"] is not None]
    refs = ["baseline"] + (["sglang"] if r["sglang_measured"] else [])
    return (f"{r['device']} {r['op']} B={r['batch_size']} ps={r['page_size']}: "
            + ", ".join(f"{impl} {_fmt_us(r[f'{impl}_median_us'])} µs" for impl in impls)
            + " (" + ", ".join(f"{_fmt_ratio(r[f'speedup_vs_{ref}'])} vs {ref}" for ref in refs)
            + f", {_fmt_ratio(r['ratio_to_floor'])} vs floor"
            + "".join(f", {mode} {r[f'{mode}_vs_default']:.2f}x default" for mode in ("shared", "parents")
                      if r[f"{mode}_vs_default"] is not None)
            + f", {r['iters']} iters)"
            + "".join(f"  {ref.upper()} DIFFERS: {r[f'{ref}_mismatch']}" for ref in refs if r[f"{ref}_mismatch"]))


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
