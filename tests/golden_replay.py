"""Replay golden traces recorded from SGLang against any allocator.

The same driver checks the plain-Python reference (lists in, lists out) and the
native allocator (tensors in, tensors out): the caller says how to build the
allocator and how to convert arguments and results. Every record is checked
exactly: returned indices, available sizes, mapping snapshots, translations and
new_pages_available answers. The trace format is SPEC.md section 6.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"


def trace_paths() -> list[Path]:
    return sorted(GOLDEN_DIR.glob("*.jsonl.gz"))


def load_trace(path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def _identity(x):
    return x


def _short_diff(got, want) -> str:
    if got is None or want is None:
        return f"got {_clip(got)}, want {_clip(want)}"
    if isinstance(got, list) and isinstance(want, list):
        for k, (g, w) in enumerate(zip(got, want)):
            if g != w:
                return (f"first difference at position {k}: got {g}, want {w}; "
                        f"got[{k}:] {_clip(got[k:])}, want[{k}:] {_clip(want[k:])}; "
                        f"lengths {len(got)} / {len(want)}")
        return f"lengths differ: got {len(got)}, want {len(want)}; got {_clip(got)}, want {_clip(want)}"
    return f"got {_clip(got)}, want {_clip(want)}"


def _clip(x, n: int = 12) -> str:
    if isinstance(x, list) and len(x) > n:
        return f"[{', '.join(map(str, x[:n]))}, ... ({len(x)} items)]"
    return repr(x)


def replay(records, make_allocator, to_arg=_identity, to_list=_identity, name: str = "trace",
           to_host_arg=None) -> int:
    """Run every record of a trace in order and check it; returns the number of records.

    make_allocator(init_record) builds the allocator (the record has size,
    size_swa, page_size, need_sort); to_arg(list_of_ints) converts an input
    list to the allocator's argument type; to_list(result) converts a returned
    index sequence to a list of ints (None is passed through untouched);
    to_host_arg (default to_arg) converts the lengths given as the *_cpu arguments.
    Raises AssertionError naming the trace, record number and op on the first
    mismatch.
    """
    records = list(records)
    if not records or records[0].get("op") != "init":
        raise AssertionError(f"{name}: the first record must be 'init'")
    init = records[0]
    alloc = make_allocator(init)

    def as_list(result):
        return None if result is None else [int(v) for v in to_list(result)]

    def check(no, rec, what, got, want):
        if got != want:
            raise AssertionError(f"{name} record {no} op {rec['op']}: {what} differs: {_short_diff(got, want)}")

    for no, rec in enumerate(records[1:], start=1):
        op = rec["op"]
        try:
            got = _run_op(alloc, rec, to_arg, to_host_arg or to_arg, as_list)
        except AssertionError:
            raise
        except Exception as e:
            raise AssertionError(f"{name} record {no} op {op}: raised {type(e).__name__}: {e}") from e

        if op in ("alloc", "alloc_extend", "alloc_extend_swa_tail", "alloc_decode", "translate"):
            check(no, rec, "out", got, rec["out"])
        elif op == "new_pages_available":
            check(no, rec, "out", got, rec["out"])
        elif op == "mapping":
            mapping = got
            check(no, rec, "mapping length", len(mapping), rec["len"])
            check(no, rec, "mapping sentinel", mapping[-1], -1)
            nonzero = [[i, v] for i, v in enumerate(mapping[:-1]) if v != 0]
            check(no, rec, "mapping nonzero entries", nonzero, rec["nonzero"])
        elif op == "end":
            whole = [int(alloc.size_full), int(alloc.size_swa)]
            check(no, rec, "pools at end (full, swa) vs (size_full, size_swa)", rec["avail"], whole)

        if "avail" in rec:
            avail = [int(alloc.full_available_size()), int(alloc.swa_available_size())]
            check(no, rec, "avail [full, swa]", avail, rec["avail"])
    return len(records)


def _run_op(alloc, rec, to_arg, to_host_arg, as_list):
    """Perform one record's call with SGLang's method and keyword names; return its result."""
    op = rec["op"]
    if op == "alloc":
        return as_list(alloc.alloc(rec["need_size"]))
    if op == "alloc_extend":
        pre, seq = to_arg(rec["prefix_lens"]), to_arg(rec["seq_lens"])
        pre_cpu, seq_cpu = to_host_arg(rec["prefix_lens"]), to_host_arg(rec["seq_lens"])
        return as_list(alloc.alloc_extend(
            prefix_lens=pre, prefix_lens_cpu=pre_cpu, seq_lens=seq, seq_lens_cpu=seq_cpu,
            last_loc=to_arg(rec["last_loc"]), extend_num_tokens=rec["extend_num_tokens"]))
    if op == "alloc_extend_swa_tail":
        pre, seq = to_arg(rec["prefix_lens"]), to_arg(rec["seq_lens"])
        pre_cpu, seq_cpu = to_host_arg(rec["prefix_lens"]), to_host_arg(rec["seq_lens"])
        return as_list(alloc.alloc_extend_swa_tail(
            prefix_lens=pre, prefix_lens_cpu=pre_cpu, seq_lens=seq, seq_lens_cpu=seq_cpu,
            last_loc=to_arg(rec["last_loc"]), extend_num_tokens=rec["extend_num_tokens"],
            swa_tail_len=rec["swa_tail_len"]))
    if op == "alloc_decode":
        seq, seq_cpu = to_arg(rec["seq_lens"]), to_host_arg(rec["seq_lens"])
        return as_list(alloc.alloc_decode(seq_lens=seq, seq_lens_cpu=seq_cpu, last_loc=to_arg(rec["last_loc"])))
    if op in ("free", "free_swa", "free_full"):
        return getattr(alloc, op)(to_arg(rec["indices"]))
    if op in ("free_segment", "free_swa_segment", "free_full_segment"):
        return getattr(alloc, op)(to_arg(rec["indices"]), start_pos=rec["start_pos"])
    if op in ("free_group_begin", "free_group_end"):
        return getattr(alloc, op)()
    if op == "new_pages_available":
        return bool(alloc.new_pages_available(rec["num_full_pages"], rec["num_swa_pages"]))
    if op == "translate":
        return as_list(alloc.translate_loc_from_full_to_swa(to_arg(rec["indices"])))
    if op == "mapping":
        return as_list(alloc.full_to_swa_index_mapping)
    if op == "end":
        return None
    raise AssertionError(f"unknown op {op!r}")
