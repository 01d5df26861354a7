"""``swa-ext bench``: the command line of the micro-benchmarks."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch

import swa_ext
from swa_ext.outputs import OutputError, check_output, write_all

from .. import sglang_ref
from .cases import (DEFAULT_BATCH_SIZES, DEFAULT_PAGE_SIZES, DEFAULT_SECONDS_PER_CASE, OPS, SMOKE_ITERS, SMOKE_MAX_BATCH,
                    default_devices)
from .measure import run
from .report import plot, report, to_markdown

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
