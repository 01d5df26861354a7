import os
import sys
from pathlib import Path

# The tests' shared helpers (golden_replay) live beside them.
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_addoption(parser):
    parser.addoption(
        "--slow",
        action="store_true",
        default=False,
        help="run the tests marked slow (the million-call soak) and the long property-test budgets",
    )
    parser.addoption(
        "--emulated-order-offset",
        type=int,
        default=None,
        help="shift the element order of every emulated launch (sets SWA_EXT_EMULATED_ORDER_OFFSET), so that "
        "each launch of each kernels='emulated' test runs in another order than with the default 0",
    )
    parser.addoption(
        "--emulated-threads",
        type=int,
        default=None,
        help="run each emulated launch's elements on 3 to N threads at once (sets SWA_EXT_EMULATED_THREADS, "
        "N from 3 to 32), as a GPU runs them in parallel",
    )


def pytest_configure(config):
    offset = config.getoption("--emulated-order-offset")
    if offset is not None:
        os.environ["SWA_EXT_EMULATED_ORDER_OFFSET"] = str(offset)
    threads = config.getoption("--emulated-threads")
    if threads is not None:
        os.environ["SWA_EXT_EMULATED_THREADS"] = str(threads)


def pytest_report_header(config):
    threads = os.environ.get("SWA_EXT_EMULATED_THREADS", "0")
    return (f"emulated element-order offset: {os.environ.get('SWA_EXT_EMULATED_ORDER_OFFSET', '0')}; "
            f"emulated launches on threads: {threads if threads not in ('', '0') else 'no (one element after another)'}")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow"):
        return
    import pytest

    skip_slow = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


# The groups of tests a run may skip, each by a fragment of its skip reason: what they are
# and the command that runs them. A reason of no group is shown as it is.
SKIPPED_GROUPS = (
    ("slow: run with --slow", "slow tests (the soak, long property-test budgets, the documented long runs, tests/sglang's "
     "further engine, PD and fault configurations)",
     "scripts/run-tests.sh --slow"),
    ("no CUDA kernels", "CUDA tests (this build has no CUDA kernels)",
     "scripts/device-check.sh on a machine with a GPU"),
    ("no GPU on this machine", "CUDA tests (no GPU here)", "scripts/device-check.sh on a machine with a GPU"),
    ("a GPU-only check", "GPU-only checks", "scripts/device-check.sh on a machine with a GPU"),
    ("sglang is not importable", "tests/sglang (SGLang's engine, PD node and pair, the eviction hook)",
     "scripts/setup-sglang.sh, then scripts/run-tests.sh"),
    ("the pair needs Mooncake's transfer engine", "the prefill/decode pair (Mooncake's engine, SGLang's router)",
     "scripts/setup-sglang.sh, then scripts/run-tests.sh"),
)


def skipped_group(reason: str) -> tuple[str, str | None]:
    """(what was skipped, the command that runs it or None) for a skip reason."""
    for fragment, what, command in SKIPPED_GROUPS:
        if fragment in reason:
            return what, command
    return reason, None


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line per group of skipped tests, with the command that runs them, in place of
    pytest's per-test list (-rs still gives that)."""
    from collections import Counter

    groups = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        groups[skipped_group(reason.removeprefix("Skipped: "))] += 1
    for (what, command), count in groups.items():
        terminalreporter.write_line(f"not run: {count} {what}" + (f": {command}" if command else ""))
