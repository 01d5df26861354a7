"""``swa-ext bench`` with SGLang's own allocator as a third reference.

The cases, inputs and timing rules are those of ``swa_ext_bench.micro``; this
adds SGLang 0.5.23's ``SWATokenToKVPoolAllocator`` (``sglang_ref``), whenever
sglang is importable, as a fourth implementation in the same alternating loop:

* ``native``, ``baseline``, ``floor``: as in ``micro``;
* ``sglang``: SGLang's allocator, driven by exactly the calls the baseline gets
  (the baseline's call of each case is rebuilt with SGLang's allocator in its
  place), from the same state, restored before every timed call. At page size 1
  SGLang's ``alloc_extend`` and ``alloc_decode`` assert a paged pool (its
  scheduler calls ``alloc(n)`` there instead), so those two go to ``alloc``;
  ``alloc_extend_swa_tail`` exists in SGLang at page sizes above 1 only, so its
  page-size-1 cells have no SGLang time. ``evict_out_of_window`` is SGLang's
  scheduler loop, one ``free_swa_segment`` per due request (``evict_per_request``).

Before timing, every case checks that SGLang's allocator returns what the native
one returns on the same call, with the same available sizes and mapping after it
(the drop-in contract); a difference is reported on the row, not hidden.

Without sglang the run says so in one line and measures the other three.

Run: ``python -m swa_ext_bench.vs_sglang --json out/bench3.json --markdown out/bench3.md``
(flags as ``swa-ext bench``, less ``--plot`` and ``--flush-cache-mb``).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

import swa_ext

from . import micro, sglang_ref
from .evict_baseline import evict_per_request

__all__ = ["IMPLS", "GOALS", "Case", "run", "goals", "to_markdown", "main"]

IMPLS = ("native", "baseline", "sglang", "floor")

# Issue 12's goals: (op, batch sizes, page sizes, reference, at least this many times faster).
# None: every measured size.
GOALS = (
    ("alloc_decode", (256,), (64,), "sglang", 20.0),
    ("free", (256,), (64,), "baseline", 20.0),
    ("free_segment", "B>=256", None, "baseline", 30.0),
    ("evict_out_of_window", "B>=256", None, "baseline", 30.0),
)


class _SGLangAtPageSize1:
    """SGLang's allocator at page size 1 under the names the benchmark calls:
    ``alloc_extend``/``alloc_decode`` become ``alloc`` of that many tokens, which
    is what SGLang's scheduler calls at page size 1."""

    def __init__(self, alloc):
        self._alloc = alloc

    def __getattr__(self, name):
        return getattr(self._alloc, name)

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens):
        return self._alloc.alloc(extend_num_tokens)

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        return self._alloc.alloc(len(seq_lens))


class Case(micro._Case):
    """``micro``'s case (native and baseline in the same state), plus SGLang's
    allocator in that state too when ``with_sglang``."""

    def __init__(self, batch: int, page_size: int, device: str, with_sglang: bool):
        super().__init__(batch, page_size, device)
        self.sgl = None
        if not with_sglang:
            return
        ps = page_size
        sgl = sglang_ref.make_allocator(self.native.size_full, self.native.size_swa, ps, device)
        self.sgl = sgl
        self.sgl_calls = sgl if ps > 1 else _SGLangAtPageSize1(sgl)
        # The setup micro._Case made: one alloc_extend of every prefix, then the
        # window eviction of the previous decode step.
        B, dev = batch, torch.device(device)
        zeros = torch.zeros(B, dtype=torch.int64)
        pre_cpu = torch.tensor(self.pre, dtype=torch.int64)
        out = self.sgl_calls.alloc_extend(zeros.to(dev), zeros, pre_cpu.to(dev), pre_cpu,
                                          torch.full((B,), -1, dtype=torch.int64, device=dev), sum(self.pre))
        want = torch.cat([self.req_to_token[j, :L] for j, L in enumerate(self.pre)]).to(torch.int64)
        if out is None or not torch.equal(out.cpu(), want.cpu()):
            raise RuntimeError(f"SGLang's setup alloc_extend diverged from native (B={B}, ps={ps})")
        evicted = evict_per_request(sgl, self.req_to_token, list(range(B)), [p - 1 for p in self.pre],
                                    [0] * B, micro.WINDOW, ps)
        if evicted != self.evicted:
            raise RuntimeError(f"SGLang's setup eviction diverged from native (B={B}, ps={ps})")
        mismatch = self.sglang_mismatch()
        if mismatch:
            raise RuntimeError(f"SGLang's setup state diverged from native (B={B}, ps={ps}): {mismatch}")
        self.state_sgl = sglang_ref.backup_state(sgl)

    def restore_sglang(self):
        sglang_ref.restore_state(self.sgl, self.state_sgl)

    def sglang_op(self, name: str, floor):
        """SGLang's call of case ``name``, or None where SGLang has no such call:
        the baseline's call with SGLang's allocator in the baseline's place."""
        if name == "alloc_extend_swa_tail" and self.page_size == 1:
            return None
        base = self.base
        self.base = self.sgl_calls
        try:
            return self.op(name, floor)[1]
        finally:
            self.base = base

    def sglang_mismatch(self, r_native=None, r_sglang=None) -> Optional[str]:
        """What differs between native and SGLang after the same call (None: nothing)."""
        if micro.comparable(r_native) != micro.comparable(r_sglang):
            return "returned indices"
        a = (self.native.full_available_size(), self.native.swa_available_size())
        b = (self.sgl.full_available_size(), self.sgl.swa_available_size())
        if a != b:
            return f"available sizes (full, swa): native {a}, SGLang {b}"
        if not torch.equal(self.native.full_to_swa_index_mapping.cpu(), self.sgl.full_to_swa_index_mapping.cpu()):
            return "full-to-SWA mapping"
        return None


def _measure(case: Case, fns, sglang, iters: Optional[int], seconds: float, warmup: int, flush):
    """``micro._measure`` with SGLang's call as a fourth slot, checked first against native's."""
    slots = micro._slots(case, fns)
    sglang_mismatch = None
    if sglang is not None:
        case.restore_native()
        r_nat = fns[0]()
        case.restore_sglang()
        r_sgl = sglang()
        if case.device.startswith("cuda"):
            torch.cuda.synchronize()
        sglang_mismatch = case.sglang_mismatch(r_nat, r_sgl)
        del r_nat, r_sgl
        slots.append(("sglang", sglang, case.restore_sglang))
    times, iters, match = micro._measure(case, slots, iters, seconds, warmup, flush)
    return times, iters, match, sglang_mismatch


def run(
    ops: Optional[Sequence[str]] = None,
    batch_sizes: Sequence[int] = micro.DEFAULT_BATCH_SIZES,
    page_sizes: Sequence[int] = micro.DEFAULT_PAGE_SIZES,
    devices: Sequence[str] = ("cpu",),
    iters: Optional[int] = None,
    smoke: bool = False,
    seconds_per_case: float = micro.DEFAULT_SECONDS_PER_CASE,
    progress: bool = False,
    threads: Optional[int] = 1,
    with_sglang: Optional[bool] = None,
    flush_cache_mb: int = 0,
) -> List[dict]:
    """One row per (device, page size, batch size, op), as ``micro.run`` plus the
    ``sglang_*`` columns. ``with_sglang=None``: whenever sglang is importable.
    ``flush_cache_mb`` as for ``micro.run``."""
    ops = list(micro.OPS if ops is None else ops)
    unknown = [op for op in ops if op not in micro.OPS]
    if unknown:
        raise ValueError(f"unknown op(s) {', '.join(unknown)}; known: {', '.join(micro.OPS)}")
    reason = sglang_ref.unavailable_reason()
    if with_sglang is None:
        with_sglang = reason is None
    elif with_sglang and reason is not None:
        raise RuntimeError(f"SGLang's allocator is not importable ({reason})")
    if smoke:
        batch_sizes = sorted({min(b, micro.SMOKE_MAX_BATCH) for b in batch_sizes})
        if iters is None:
            iters = micro.SMOKE_ITERS
    warmup = 1 if smoke else 2
    floor, floor_name, evict_name = swa_ext._C.bench_floor, micro.FLOOR_IMPL, micro.EVICT_IMPL
    flush = torch.zeros(flush_cache_mb * (1 << 20) // 8, dtype=torch.int64) if flush_cache_mb > 0 else None

    gc.collect()
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(int(threads))
    rows: List[dict] = []
    total = len(devices) * len(page_sizes) * len(batch_sizes) * len(ops)
    try:
        for device in devices:
            for ps in page_sizes:
                for B in batch_sizes:
                    case = Case(B, ps, device, with_sglang)
                    for op in ops:
                        fns = case.op(op, floor)
                        sgl = case.sglang_op(op, floor) if with_sglang else None
                        times, n, match, sglang_mismatch = _measure(case, fns, sgl, iters, seconds_per_case, warmup,
                                                                    flush)
                        row = _row(device, op, B, ps, n, times, match, sglang_mismatch, floor_name, evict_name)
                        rows.append(row)
                        if progress:
                            print(f"[{len(rows)}/{total}] " + _progress(row), file=sys.stderr, flush=True)
                    del case
    finally:
        torch.set_num_threads(old_threads)
    return rows


def _row(device, op, B, ps, n, times, match, sglang_mismatch, floor_name, evict_name) -> dict:
    row = {
        "device": device,
        "op": op,
        "batch_size": B,
        "page_size": ps,
        "iters": n,
        "calls": B if op == "alloc_extend_swa_tail" else 1,
        "note": micro.NOTES[op],
        "results_match": match,
        "sglang_measured": "sglang" in times,
        "sglang_results_match": None if "sglang" not in times else sglang_mismatch is None,
        "sglang_mismatch": sglang_mismatch,
        "floor_impl": floor_name,
        "torch_threads": torch.get_num_threads(),
    }
    if op == "evict_out_of_window":
        row["native_impl"] = evict_name
    for impl in IMPLS:
        stats = micro._stats(times[impl]) if impl in times else {"median": None, "p10": None, "p90": None}
        for k, v in stats.items():
            row[f"{impl}_{k}_us"] = None if v is None else v / 1000.0
    row["speedup_vs_baseline"] = row["baseline_median_us"] / row["native_median_us"]
    row["speedup_vs_sglang"] = (None if row["sglang_median_us"] is None
                                else row["sglang_median_us"] / row["native_median_us"])
    row["ratio_to_floor"] = row["native_median_us"] / row["floor_median_us"]
    return row


def _ratio(x) -> str:
    return "n/a" if x is None else micro._fmt_ratio(x)


def _us(x) -> str:
    return "n/a" if x is None else micro._fmt_us(x)


def _progress(r) -> str:
    return (f"{r['device']} {r['op']} B={r['batch_size']} ps={r['page_size']}: "
            + ", ".join(f"{impl} {_us(r[f'{impl}_median_us'])}" + ("" if r[f"{impl}_median_us"] is None else " µs")
                        for impl in IMPLS)
            + f" ({_ratio(r['speedup_vs_baseline'])} vs baseline, {_ratio(r['speedup_vs_sglang'])} vs sglang, "
            f"{r['iters']} iters)"
            + ("" if r["results_match"] else "  BASELINE RESULTS DIFFER")
            + ("" if r["sglang_results_match"] in (None, True) else f"  SGLANG DIFFERS: {r['sglang_mismatch']}"))


def _goal_rows(rows, op, batches, pages):
    for r in rows:
        if r["device"] != "cpu" or r["op"] != op:
            continue
        if batches == "B>=256":
            if r["batch_size"] < 256:
                continue
        elif r["batch_size"] not in batches:
            continue
        if pages is not None and r["page_size"] not in pages:
            continue
        yield r


def goals(rows: Sequence[dict]) -> List[dict]:
    """Issue 12's goals on the CPU rows that measure them; a goal whose rows or
    reference were not measured is left out."""
    out = []
    for op, batches, pages, ref, least in GOALS:
        sel = [r for r in _goal_rows(rows, op, batches, pages) if r[f"speedup_vs_{ref}"] is not None]
        if not sel:
            continue
        where = batches if isinstance(batches, str) else f"B={','.join(map(str, batches))}"
        where += "" if pages is None else f" ps={','.join(map(str, pages))}"
        worst = min(sel, key=lambda r: r[f"speedup_vs_{ref}"])
        out.append({
            "goal": f"cpu {op} {where}: >= {least:g}x vs {ref}",
            "worst": f"B={worst['batch_size']} ps={worst['page_size']}",
            "speedup": worst[f"speedup_vs_{ref}"],
            "met": worst[f"speedup_vs_{ref}"] >= least,
        })
    if rows:
        worst = min(rows, key=lambda r: r["speedup_vs_baseline"])
        out.append({
            "goal": "no cell slower than the baseline",
            "worst": f"{worst['device']} {worst['op']} B={worst['batch_size']} ps={worst['page_size']}",
            "speedup": worst["speedup_vs_baseline"],
            "met": worst["speedup_vs_baseline"] >= 1.0,
        })
    return out


def to_markdown(rows: Sequence[dict]) -> str:
    """Markdown: the medians, the ratios vs each reference and the goals."""
    lines = [
        "Median µs per measured call. vs baseline = baseline / native, vs sglang = SGLang / native "
        "(above 1x native is faster); vs floor = native / floor.",
        "",
        "| device | op | batch | page | native | baseline | sglang | floor | vs baseline | vs sglang | vs floor | iters |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        flag = "" if r["results_match"] and r["sglang_results_match"] in (None, True) else " ⚠"
        lines.append(
            f"| {r['device']} | {r['op']}{flag} | {r['batch_size']} | {r['page_size']} | "
            + " | ".join(_us(r[f"{impl}_median_us"]) for impl in IMPLS)
            + f" | {_ratio(r['speedup_vs_baseline'])} | {_ratio(r['speedup_vs_sglang'])} | "
            f"{_ratio(r['ratio_to_floor'])} | {r['iters']} |"
        )
    differ = [r for r in rows if r["sglang_results_match"] is False]
    if differ or any(not r["results_match"] for r in rows):
        lines += ["", "⚠: results differed from native's on the same call:", ""]
        lines += [f"- {r['op']} B={r['batch_size']} ps={r['page_size']}: "
                  + (f"SGLang: {r['sglang_mismatch']}" if r["sglang_results_match"] is False else "baseline")
                  for r in rows if r["sglang_results_match"] is False or not r["results_match"]]
    gs = goals(rows)
    if gs:
        lines += ["", "Goals (issue 12; worst measured cell):", ""]
        lines += [f"- {g['goal']}: {_ratio(g['speedup'])} at {g['worst']}: **{'met' if g['met'] else 'not met'}**"
                  for g in gs]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m swa_ext_bench.vs_sglang",
                                description="swa-ext bench with SGLang's own allocator as a third reference.")
    p.add_argument("--ops", default=",".join(micro.OPS), help="comma-separated ops (default: all)")
    p.add_argument("--batch-sizes", default=",".join(map(str, micro.DEFAULT_BATCH_SIZES)))
    p.add_argument("--page-sizes", default=",".join(map(str, micro.DEFAULT_PAGE_SIZES)))
    p.add_argument("--device", choices=["cpu", "cuda"], action="append",
                   help="repeatable (default cpu)")
    p.add_argument("--iters", type=int, help="timed rounds per case (default: fit --seconds-per-case)")
    p.add_argument("--seconds-per-case", type=float, default=micro.DEFAULT_SECONDS_PER_CASE)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--flush-cache-mb", type=int, default=0, metavar="MB",
                   help="write MB megabytes before every timed call: cold caches (default 0: off)")
    p.add_argument("--smoke", action="store_true", help="batch sizes capped at 8, 3 rounds")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", metavar="PATH")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    try:
        ops = [o for o in args.ops.split(",") if o]
        batch_sizes = micro._int_list([args.batch_sizes], "--batch-sizes")
        page_sizes = micro._int_list([args.page_sizes], "--page-sizes")
        for flag, out in (("--json", args.json), ("--markdown", args.markdown)):
            if out is not None:
                micro._check_output(flag, out)
    except micro._UsageError as e:
        print(e, file=sys.stderr)
        return 2
    if (args.iters is not None and args.iters <= 0) or args.threads < 0 or not args.seconds_per_case > 0:
        print(f"{p.prog}: error: --iters and --seconds-per-case must be positive, --threads >= 0", file=sys.stderr)
        return 2
    reason = sglang_ref.unavailable_reason()
    if reason is not None:
        print(f"SGLang's allocator not importable ({reason}): measuring native, baseline and floor only",
              file=sys.stderr)
    try:
        rows = run(ops=ops, batch_sizes=batch_sizes, page_sizes=page_sizes, devices=args.device or ["cpu"],
                   iters=args.iters, smoke=args.smoke, seconds_per_case=args.seconds_per_case,
                   progress=not args.quiet, threads=args.threads or None,
                   flush_cache_mb=max(0, args.flush_cache_mb))
    except ValueError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    md = to_markdown(rows)
    print(md)
    if args.markdown:
        Path(args.markdown).write_text(md, encoding="utf-8")
    if args.json:
        doc = micro.report([])
        doc["rows"], doc["goals"] = rows, goals(rows)
        doc["meta"]["sglang"] = None if reason else _sglang_version()
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


def _sglang_version() -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
