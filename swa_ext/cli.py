"""The ``swa-ext`` command: ``simulate`` (a decode node replaying a request trace)
and ``bench`` (allocator micro-benchmarks, from the ``swa_ext_bench`` package)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from swa_ext._version import __version__

PROG = "swa-ext"

# Defaults of the simulate command; the README's description of the default run
# depends on them.
DEFAULT_MODEL = "gpt-oss-20b"
DEFAULT_MAX_REQUESTS = 10000
DEFAULT_TIME_SCALE = 0.02
DEFAULT_STEP_MS = 20.0

# Bounds of the simulate options beyond which a value is a mistake, not a setting.
MAX_KV_MEMORY_GIB = 4096.0
KV_MEMORY_TOO_LARGE = "is more KV memory than a decode node has (eight 288 GB GPUs hold 2146 GiB)"
MAX_TIME_SCALE = 1000.0
MAX_STEP_MS = 10000.0


class UsageError(Exception):
    """Bad command-line input: reported on one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the usage before the error; keep bad input to one line.
    def error(self, message):
        raise UsageError(f"{self.prog}: error: {message}")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value


def _bounded_float(high: float, why: str):
    """A parser of finite floats in (0, high]; ``why`` says what is beyond ``high``."""

    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
        if value > high:
            raise argparse.ArgumentTypeError(f"{text} {why}; at most {high:g}")
        return value

    return parse


def _swa_ratio(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _simulate_parser() -> argparse.ArgumentParser:
    from swa_ext.models import load_models
    from swa_ext.simulator import DEFAULT_RESERVED_DECODE_TOKENS, POLICIES, SGLANG_DEFAULT_SWA_RATIO

    p = _Parser(
        prog=f"{PROG} simulate",
        description="Replay a request trace through a simulated decode node under the "
        "full, evict and tail SWA policies, with the same KV memory for each.",
    )
    p.add_argument("--trace", help="CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or JSONL "
                   "(timestamp ms, input_length, output_length); default: the bundled Azure "
                   "conversation trace")
    p.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(load_models()), metavar="NAME",
                   help=f"one of: {', '.join(sorted(load_models()))} (default {DEFAULT_MODEL})")
    p.add_argument("--page-size", type=_positive_int, default=64, help="tokens per page (default 64)")
    p.add_argument("--kv-memory-gib", type=_bounded_float(MAX_KV_MEMORY_GIB, KV_MEMORY_TOO_LARGE), default=40.0,
                   help="KV cache memory of the node, both pools together (default 40)")
    p.add_argument("--swa-ratio", type=_swa_ratio,
                   help="SWA pool tokens per full pool token for evict and tail (full uses 1); "
                   f"default: each at its best of a sweep, and at SGLang's default {SGLANG_DEFAULT_SWA_RATIO:g}")
    p.add_argument("--reserved-decode-tokens", type=_non_negative_int, default=DEFAULT_RESERVED_DECODE_TOKENS,
                   help="decode room kept per running request at admission, SGLang's "
                   f"num_reserved_decode_tokens (default {DEFAULT_RESERVED_DECODE_TOKENS})")
    p.add_argument("--policy", choices=POLICIES, action="append",
                   help="run only this policy (repeatable; default: all three)")
    p.add_argument("--max-requests", type=_positive_int, default=DEFAULT_MAX_REQUESTS,
                   help=f"replay the first N requests of the trace (default {DEFAULT_MAX_REQUESTS})")
    p.add_argument("--time-scale", type=_bounded_float(MAX_TIME_SCALE, "slows the trace down more than a replay needs"),
                   default=DEFAULT_TIME_SCALE,
                   help="multiply trace arrival times by this (smaller: denser load; "
                   f"default {DEFAULT_TIME_SCALE})")
    p.add_argument("--step-ms", type=_bounded_float(MAX_STEP_MS, "is longer than any decode step"),
                   default=DEFAULT_STEP_MS,
                   help=f"simulated time of one decode step (default {DEFAULT_STEP_MS:g})")
    p.add_argument("--json", metavar="PATH", help="write the report (config and per-policy metrics) as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="write a PNG of running requests and pool use")
    return p


def _check_output(option: str, path: str, suffix: str | None = None) -> None:
    """Fail before the run, not after it, on a path the report cannot be written to."""
    target = Path(path)
    where = f"{PROG} simulate: error: argument {option}: {path}"
    if not path:
        raise UsageError(f"{PROG} simulate: error: argument {option}: an empty path")
    if target.is_dir():
        raise UsageError(f"{where}: is a directory, not a file name")
    if suffix and target.suffix.lower() != suffix:
        raise UsageError(f"{where}: the file is written as {suffix[1:].upper()}; name it *{suffix}")
    parent = target.resolve().parent
    if not parent.is_dir():
        raise UsageError(f"{where}: no directory {parent}")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise UsageError(f"{where}: not writable")


def simulate_main(argv: list[str]) -> int:
    from swa_ext import simulator
    from swa_ext.models import get_model
    from swa_ext.traces import DEFAULT_TRACE, TraceError, load_trace

    args = _simulate_parser().parse_args(argv)
    if args.json is not None:
        _check_output("--json", args.json)
    if args.plot is not None:
        _check_output("--plot", args.plot, ".png")
    started = time.perf_counter()
    policies = tuple(dict.fromkeys(args.policy)) if args.policy else simulator.POLICIES
    try:
        requests = load_trace(args.trace, args.max_requests)
        scenario = simulator.plan_scenario(
            requests,
            get_model(args.model),
            trace=args.trace if args.trace is not None else DEFAULT_TRACE.name,
            page_size=args.page_size,
            kv_memory_gib=args.kv_memory_gib,
            step_ms=args.step_ms,
            time_scale=args.time_scale,
            reserved_decode_tokens=args.reserved_decode_tokens,
        )
        # Every column is checked here, before the first run.
        simulator.plan_runs(scenario, policies, args.swa_ratio)
    except (TraceError, simulator.SimulationError) as e:
        raise UsageError(f"{PROG} simulate: error: {e}") from None
    results = simulator.run(scenario, policies, swa_ratio=args.swa_ratio, progress=True)
    print(simulator.format_table(scenario, results))
    print(f"\nwall time {time.perf_counter() - started:.1f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(simulator.report(scenario, results), f, indent=2)
            f.write("\n")
    if args.plot:
        simulator.plot(scenario, results, args.plot)
    return 0


def bench_main(argv: list[str]) -> int:
    try:
        from swa_ext_bench import micro
    except ImportError as e:
        raise UsageError(
            f"{PROG} bench: error: the benchmarks are not importable ({e}); install them from bench/"
        ) from None
    return micro.main(argv) or 0


COMMANDS = {"simulate": simulate_main, "bench": bench_main}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _Parser(prog=PROG, description="swa_ext tools.")
    top.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    top.add_argument("command", choices=sorted(COMMANDS),
                     help="simulate: replay a trace on a simulated decode node; "
                     "bench: allocator micro-benchmarks")
    try:
        if not argv or argv[0] not in COMMANDS:
            # Only the command is parsed here; each command parses its own options.
            top.parse_args(argv[:1])
        return COMMANDS[argv[0]](argv[1:])
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except SystemExit as e:
        # --help and --version print and stop.
        return e.code or 0
    except OSError as e:
        # Output paths that cannot be written.
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
