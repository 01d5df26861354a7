"""The swa-ext command line: simulate's outputs, bad input, bench dispatch."""

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from swa_ext import cli
from swa_ext.simulator import POLICIES

DATA = Path(__file__).with_name("data")
SMALL = ["--trace", str(DATA / "azure_small.csv"), "--page-size", "16", "--kv-memory-gib", "2"]
REPORT_KEYS = (
    "completed",
    "retractions",
    "max_running",
    "mean_running",
    "peak_full_pages",
    "peak_swa_pages",
    "max_swa_pages_per_request",
    "queue_wait_p50_steps",
    "queue_wait_p99_steps",
    "decode_tokens_per_step",
    "alloc_us_per_step_median",
)


def test_simulate_writes_table_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    assert cli.main(["simulate", *SMALL, "--json", str(out_json), "--plot", str(out_png)]) == 0
    table = capsys.readouterr().out
    for policy in POLICIES:
        assert policy in table
    report = json.loads(out_json.read_text())
    assert list(report) == list(POLICIES)
    for metrics in report.values():
        assert set(REPORT_KEYS) <= set(metrics)
        assert metrics["completed"] == 48
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_one_policy(tmp_path):
    out_json = tmp_path / "r.json"
    assert cli.main(["simulate", *SMALL, "--policy", "tail", "--max-requests", "10", "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    assert list(report) == ["tail"] and report["tail"]["completed"] == 10


@pytest.mark.parametrize(
    "args",
    [
        ["simulate", "--trace", "/nonexistent/trace.csv"],
        ["simulate", "--trace", str(DATA / "mooncake_small.jsonl"), "--model", "no-such-model"],
        ["simulate", *SMALL[:4], "--kv-memory-gib", "0.001"],
        ["simulate", *SMALL, "--swa-ratio", "1.5"],
        ["simulate", *SMALL, "--json", "/nonexistent/dir/r.json"],
        ["simulate", "--max-requests", "0"],
        ["nosuchcommand"],
        [],
    ],
)
def test_bad_input_is_one_line_exit_2(args, capsys):
    assert cli.main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
    assert "error" in captured.err


def test_malformed_trace_through_console(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,5\n")
    proc = subprocess.run(
        [sys.executable, "-m", "swa_ext", "simulate", "--trace", str(bad)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_bench_dispatch(monkeypatch):
    seen = []
    package = types.ModuleType("swa_ext_bench")
    micro = types.ModuleType("swa_ext_bench.micro")
    micro.main = lambda argv: seen.append(argv) or 3
    package.micro = micro
    monkeypatch.setitem(sys.modules, "swa_ext_bench", package)
    monkeypatch.setitem(sys.modules, "swa_ext_bench.micro", micro)
    assert cli.main(["bench", "--quick", "x"]) == 3
    assert seen == [["--quick", "x"]]


def test_bench_unavailable(monkeypatch, capsys):
    # A None entry makes the import fail as if the package were absent.
    monkeypatch.setitem(sys.modules, "swa_ext_bench", None)
    assert cli.main(["bench"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "swa_ext_bench" in err
