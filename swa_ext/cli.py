"""The ``swa-ext`` command: ``simulate`` (a decode node replaying a request trace)
and ``bench`` (allocator micro-benchmarks, from the ``swa_ext_bench`` package)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

PROG = "swa-ext"

# Defaults of the simulate command; the README's description of the default run
# depends on them.
DEFAULT_MODEL = "gpt-oss-20b"
DEFAULT_MAX_REQUESTS = 10000
DEFAULT_TIME_SCALE = 0.02
DEFAULT_STEP_MS = 20.0


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


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _simulate_parser() -> argparse.ArgumentParser:
    from swa_ext.models import load_models
    from swa_ext.simulator import POLICIES

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
    p.add_argument("--page-size", type=int, default=64, help="tokens per page (default 64)")
    p.add_argument("--kv-memory-gib", type=_positive_float, default=40.0,
                   help="KV cache memory of the node, both pools together (default 40)")
    p.add_argument("--swa-ratio", type=_positive_float,
                   help="SWA pool tokens per full pool token for evict and tail (full uses 1); "
                   "default: the share of the requests' tokens that stay in the window")
    p.add_argument("--policy", choices=POLICIES, action="append",
                   help="run only this policy (repeatable; default: all three)")
    p.add_argument("--max-requests", type=_positive_int, default=DEFAULT_MAX_REQUESTS,
                   help=f"replay the first N requests of the trace (default {DEFAULT_MAX_REQUESTS})")
    p.add_argument("--time-scale", type=_positive_float, default=DEFAULT_TIME_SCALE,
                   help="multiply trace arrival times by this (smaller: denser load; "
                   f"default {DEFAULT_TIME_SCALE})")
    p.add_argument("--step-ms", type=_positive_float, default=DEFAULT_STEP_MS,
                   help=f"simulated time of one decode step (default {DEFAULT_STEP_MS:g})")
    p.add_argument("--json", metavar="PATH", help="write the per-policy metrics as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of running requests and pool use")
    return p


def simulate_main(argv: list[str]) -> int:
    from swa_ext import simulator
    from swa_ext.models import get_model
    from swa_ext.traces import TraceError, load_trace

    args = _simulate_parser().parse_args(argv)
    for out in (args.json, args.plot):
        # Fail before the run, not after it.
        if out and not Path(out).resolve().parent.is_dir():
            raise UsageError(f"{PROG} simulate: error: no directory for {out}")
    started = time.perf_counter()
    try:
        requests = load_trace(args.trace, args.max_requests)
        node = simulator.plan_node(
            requests,
            get_model(args.model),
            page_size=args.page_size,
            kv_memory_gib=args.kv_memory_gib,
            swa_ratio=args.swa_ratio,
            step_ms=args.step_ms,
            time_scale=args.time_scale,
        )
    except (TraceError, simulator.SimulationError) as e:
        raise UsageError(f"{PROG} simulate: error: {e}") from None
    policies = tuple(dict.fromkeys(args.policy)) if args.policy else simulator.POLICIES
    results = simulator.run(node, policies, progress=True)
    print(simulator.format_table(node, results))
    print(f"\nwall time {time.perf_counter() - started:.1f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(simulator.report(results), f, indent=2)
            f.write("\n")
    if args.plot:
        simulator.plot(node, results, args.plot)
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
    except OSError as e:
        # Output paths that cannot be written.
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
