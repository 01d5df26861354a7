"""The ``swa-ext`` command: ``simulate`` (a decode node replaying a request trace),
``bench`` (allocator micro-benchmarks, found at run time as the ``swa_ext.commands``
entry point that the bench package of a checkout installs) and ``sglang-check``
(whether swa_ext would serve in SGLang from this environment)."""

from __future__ import annotations

import os
import signal
import sys

import swa_ext

PROG = "swa-ext"
# Exit status of a run stopped by Ctrl-C (128 + SIGINT), as a shell reports it.
INTERRUPTED = 130


def _interrupted() -> int:
    """Ctrl-C: one line (after the ^C a terminal shows) and the status."""
    print(f"\n{PROG}: interrupted" if sys.stderr.isatty() else f"{PROG}: interrupted", file=sys.stderr)
    return INTERRUPTED


def _exit_interrupted(signum=None, frame=None):
    # While the command starts nothing is written yet, and a KeyboardInterrupt could be
    # swallowed by a library loading (a bare except): the process ends here.
    _interrupted()
    sys.stderr.flush()
    os._exit(INTERRUPTED)


# Run as the command, a Ctrl-C until the command has loaded what it runs (_started), or after
# it returned, ends it at once; so does one that swa_ext noted before this module loaded.
_AS_COMMAND = swa_ext._AS_COMMAND
if _AS_COMMAND:
    signal.signal(signal.SIGINT, _exit_interrupted)
    if swa_ext._noted_interrupts:
        _exit_interrupted()


def _started() -> None:
    """The command has loaded what it runs: from here Ctrl-C is a KeyboardInterrupt, which
    lets it clean up before run_command reports it."""
    if _AS_COMMAND:
        signal.signal(signal.SIGINT, signal.default_int_handler)

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

from swa_ext._version import __version__  # noqa: E402
from swa_ext.outputs import OutputError, check_output, write_all  # noqa: E402

# Where commands shipped outside this package (the bench) register themselves.
COMMAND_ENTRY_POINTS = "swa_ext.commands"

# Defaults of the simulate command; the README's description of the default run
# depends on them.
DEFAULT_MODEL = "gpt-oss-20b"
DEFAULT_MAX_REQUESTS = 10000
DEFAULT_TIME_SCALE = 0.02
DEFAULT_STEP_MS = 20.0
# The default trace's --tuned-on: the other bundled trace, at the rate the docs replay it.
DEFAULT_TUNED_ON = ("mooncake_conversation_trace_2000.jsonl", 0.1)

# Where the per-step cost of eviction at each interval is measured.
EVICTION_COST_DOC = "docs/sglang-eviction.md"

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
    from swa_ext.simulator import COLUMNS, DEFAULT_RESERVED_DECODE_TOKENS, SGLANG_DEFAULT_EVICTION_INTERVAL

    p = _Parser(
        prog=f"{PROG} simulate",
        description="Replay a request trace through a simulated decode node under the "
        "full, evict and tail SWA policies, SGLang 0.5.23 as it ships (sglang) and swa_ext in "
        "SGLang (swa_ext), with the same KV memory for each.",
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
                   help="SWA pool tokens per full pool token for evict, tail and swa_ext (full uses 1, "
                   "sglang its own sizing); default: each at its best of a sweep")
    p.add_argument("--reserved-decode-tokens", type=_non_negative_int, default=DEFAULT_RESERVED_DECODE_TOKENS,
                   help="decode room kept per running request at admission, SGLang's "
                   f"num_reserved_decode_tokens (default {DEFAULT_RESERVED_DECODE_TOKENS})")
    p.add_argument("--eviction-interval", type=_positive_int, default=SGLANG_DEFAULT_EVICTION_INTERVAL,
                   metavar="N", help="free a request's out-of-window SWA KV once N tokens have slid out of its "
                   f"window, SGLang's SGLANG_SWA_EVICTION_INTERVAL (default {SGLANG_DEFAULT_EVICTION_INTERVAL}); "
                   "swa_ext evicts every step")
    p.add_argument("--max-running-requests", type=_positive_int, metavar="N",
                   help="cap every column's running batch at N, SGLang's --max-running-requests; sglang and swa_ext "
                   "then size the SWA pool from it as SGLang's decode node does (default: no cap, SGLang's ratio)")
    p.add_argument("--policy", choices=COLUMNS, action="append",
                   help="run only this column (repeatable; default: every column the model can run, the others "
                   "named with why: sglang_unified and swa_ext_shared need both full and SWA layers)")
    p.add_argument("--tuned-on", metavar="TRACE", help="also run swa_ext here at the SWA ratio its sweep finds best "
                   "on TRACE (same settings; what a ratio tuned on another trace costs); default with the bundled "
                   f"trace: the bundled {DEFAULT_TUNED_ON[0]} at time scale {DEFAULT_TUNED_ON[1]:g}")
    p.add_argument("--tuned-on-time-scale", type=_bounded_float(MAX_TIME_SCALE, "slows the trace down more than a "
                   "replay needs"), metavar="X", help="the time scale for --tuned-on's trace (default: --time-scale)")
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
    p.add_argument("--plot", metavar="PATH", help="write a plot of running requests and pool use; the "
                   "format follows the suffix (.png, .jpg, .pdf, .svg, ...)")
    return p


def _progress_line(label: str, result, seconds: float) -> None:
    """One line per run, for a log: without a terminal there is no progress bar."""
    ratio = "one budget" if result.swa_ratio is None else f"SWA ratio {result.swa_ratio:.3g}"
    print(f"run {label} at {ratio}: mean_running {result.mean_running:.1f}, "
          f"{result.completed} completed, {seconds:.1f} s", flush=True)


def simulate_main(argv: list[str]) -> int:
    try:
        from swa_ext import simulator
    except ImportError as e:  # the sim extra is not installed: the message says what to install
        print(f"{PROG} simulate: error: {e}", file=sys.stderr)
        return 1
    args = _simulate_parser().parse_args(argv)
    from swa_ext.models import get_model
    from swa_ext.traces import DEFAULT_TRACE, TraceError, load_trace

    _started()
    try:
        if args.json is not None:
            check_output(f"{PROG} simulate: error: argument --json", args.json)
        if args.plot is not None:
            check_output(f"{PROG} simulate: error: argument --plot", args.plot, image=True)
    except OutputError as e:
        raise UsageError(str(e)) from None
    started = time.perf_counter()
    model = get_model(args.model)
    columns = tuple(dict.fromkeys(args.policy)) if args.policy else simulator.default_columns(model)
    settings = dict(page_size=args.page_size, kv_memory_gib=args.kv_memory_gib, step_ms=args.step_ms,
                    reserved_decode_tokens=args.reserved_decode_tokens, eviction_interval=args.eviction_interval,
                    max_running_requests=args.max_running_requests)
    tuned_on, tuned_on_trace, tuned_on_scale = None, args.tuned_on, args.tuned_on_time_scale or args.time_scale
    if tuned_on_trace is None and args.trace is None and simulator.SWA_EXT in columns:
        tuned_on_trace = str(DEFAULT_TRACE.with_name(DEFAULT_TUNED_ON[0]))
        tuned_on_scale = args.tuned_on_time_scale or DEFAULT_TUNED_ON[1]
    try:
        requests = load_trace(args.trace, args.max_requests)
        scenario = simulator.plan_scenario(
            requests, model, trace=args.trace if args.trace is not None else DEFAULT_TRACE.name,
            time_scale=args.time_scale, **settings)
        # Every column is checked here, before the first run.
        simulator.plan_runs(scenario, columns, args.swa_ratio)
        if tuned_on_trace is not None:
            tuned_on = simulator.plan_scenario(load_trace(tuned_on_trace, args.max_requests), model,
                                               trace=tuned_on_trace, time_scale=tuned_on_scale, **settings)
            simulator.plan_runs(tuned_on, (simulator.SWA_EXT,))
    except (TraceError, simulator.SimulationError) as e:
        raise UsageError(f"{PROG} simulate: error: {e}") from None
    on_run = None if sys.stdout.isatty() else _progress_line
    results = simulator.run(scenario, columns, swa_ratio=args.swa_ratio, progress=True, on_run=on_run,
                            tuned_on=tuned_on)
    print(simulator.format_table(scenario, results))
    summary = simulator.format_conclusion(scenario, results)
    if summary:
        print("\n" + summary)
    if simulator.SWA_EXT in results:
        print(f"(what eviction costs per decode step at each interval: {EVICTION_COST_DOC})")
    reports = []
    if args.json:
        def write_json(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(simulator.report(scenario, results), f, indent=2)
                f.write("\n")

        reports.append((args.json, write_json))
    if args.plot:
        reports.append((args.plot, lambda tmp: simulator.plot(scenario, results, tmp)))
    written = write_all(reports)
    print(f"\nwall time {time.perf_counter() - started:.1f} s")
    for path in written:
        print(f"wrote {path}")
    return 0


def bench_main(argv: list[str]) -> int:
    from importlib.metadata import entry_points

    found = entry_points(group=COMMAND_ENTRY_POINTS, name="bench")
    if not found:
        raise UsageError(f"{PROG} bench: error: the benchmarks are not installed; "
                         "from a checkout of swa_ext: pip install ./bench")
    bench = next(iter(found)).load()
    _started()
    return bench(argv) or 0


def _sglang_check_parser() -> argparse.ArgumentParser:
    return _Parser(prog=f"{PROG} sglang-check",
                   description="Say, without starting a server, whether swa_ext would serve in an SGLang process "
                   "started from this environment: the SGLang found, each seam of SGLang's that swa_ext patches or "
                   "calls, and what the current SWA_EXT_SGLANG serves. Exit status 0 only when it would serve.")


def sglang_check_main(argv: list[str]) -> int:
    _sglang_check_parser().parse_args(argv)
    from swa_ext import sglang_plugin, sglang_seams

    _started()
    found = sglang_seams.installed_version()
    print(f"SGLang: {found or 'not installed'} (swa_ext supports {sglang_seams.SUPPORTED_VERSION})")
    if found is not None:
        moved = dict(sglang_seams.moved())
        print(f"seams: {len(sglang_seams.SEAMS) - len(moved)} of {len(sglang_seams.SEAMS)} where swa_ext expects them")
        for module, path, _ in sglang_seams.SEAMS:
            seam = f"{module}:{path}"
            print(f"  {'moved' if seam in moved else 'ok':5}  {seam}" + (f": {moved[seam]}" if seam in moved else ""))
    try:
        mode = sglang_plugin.checked_mode()
    except SystemExit as refused:
        print(refused)
        return 1
    if mode is None:
        print(f"{sglang_plugin.MODE_VARIABLE} is unset: swa_ext serves nothing, SGLang's own allocators serve")
        return 1
    print(f"{sglang_plugin.MODE_VARIABLE}={mode} serves {sglang_plugin.MODES_SERVE[mode]}")
    return 0


COMMANDS = {"simulate": simulate_main, "bench": bench_main, "sglang-check": sglang_check_main}


def run_command(command, argv: list[str]) -> int:
    """``command(argv)``, its exit status, with the failures every ``swa-ext`` command reports
    alike: bad input in one line (2), Ctrl-C (130), a report that could not be written (1)."""
    try:
        return command(argv)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except SystemExit as e:
        # --help and --version print and stop.
        return e.code or 0
    except KeyboardInterrupt:
        # Ctrl-C, torch's import included: the reports are written through temporary
        # files, so nothing is left.
        return _interrupted()
    except OSError as e:
        # A report that could not be written after all (the disk filled up).
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    finally:
        if _AS_COMMAND:
            signal.signal(signal.SIGINT, _exit_interrupted)


def _chosen(args: list[str]) -> int:
    if not args or args[0] not in COMMANDS:
        # Only the command is parsed here; each command parses its own options.
        top = _Parser(prog=PROG, description="swa_ext tools.")
        top.add_argument("--version", action="version", version=f"{PROG} {__version__}")
        top.add_argument("command", choices=sorted(COMMANDS),
                         help="simulate: replay a trace on a simulated decode node; "
                         "bench: allocator micro-benchmarks; "
                         "sglang-check: whether swa_ext would serve in SGLang from this environment")
        top.parse_args(args[:1])
    return COMMANDS[args[0]](args[1:])


def main(argv: list[str] | None = None) -> int:
    return run_command(_chosen, list(sys.argv[1:] if argv is None else argv))
