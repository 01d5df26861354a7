"""The swa-ext command line: simulate's outputs, bad input, --version, bench dispatch."""

import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import swa_ext
from swa_ext import cli, simulator

DATA = Path(__file__).with_name("data")
SMALL = ["--trace", str(DATA / "azure_small.csv"), "--page-size", "16", "--kv-memory-gib", "2"]
COLUMNS = ["full", "evict", "tail", "sglang", "swa_ext", "sglang_unified", "swa_ext_shared"]


def test_simulate_writes_table_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    assert cli.main(["simulate", *SMALL, "--json", str(out_json), "--plot", str(out_png)]) == 0
    table = capsys.readouterr().out
    # The files written, named last; the conclusion before them.
    assert table.splitlines()[-2:] == [f"wrote {out_json}", f"wrote {out_png}"]
    assert "\nconclusion: swa_ext_shared (one budget for full and SWA KV, no ratio" in table
    assert "\nfixed ratio: swa_ext (tail, SWA ratio " in table and cli.EVICTION_COST_DOC in table
    assert "In SGLang: SWA_EXT_SGLANG=1 SGLANG_SWA_EVICTION_INTERVAL=1 with --swa-full-tokens-ratio " in table
    assert "\ntransfer: tail " in table and "\nagainst full (no SWA support): swa_ext runs " in table
    # Without a terminal, one progress line per run (the sweeps' included).
    runs = [line for line in table.splitlines() if line.startswith("run ")]
    assert len(runs) >= 7 and any(line.startswith("run sglang at SWA ratio 0.8:") for line in runs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.png"]
    header = next(line for line in table.splitlines() if line.split() == COLUMNS)
    rows = table.splitlines()[table.splitlines().index(header) + 1:][: len(simulator.PolicyResult.SUMMARY_KEYS)]
    assert [row.split()[0] for row in rows] == list(simulator.PolicyResult.SUMMARY_KEYS)
    assert "evict SWA ratio sweep" in table and "tail SWA ratio sweep" in table
    report = json.loads(out_json.read_text())
    assert report["swa_ext_version"] == swa_ext.__version__
    assert report["model"]["window"] == 128 and report["model"]["swa_bytes_per_token"] > 0
    assert "null" in report["rows"]["swa_ratio_sweep"] and "seconds" in report["rows"]["queue_wait_p50_s"]
    assert report["conclusion"]["swa_ext_vs_sglang"]["sglang"]["swa_ratio"] == 0.8
    assert report["conclusion"]["transfer"]["whole_prompt_column"] == "full"
    assert report["config"]["trace"] == str(DATA / "azure_small.csv")
    assert report["config"]["swa_ratio"]["sglang"] == 0.8
    assert list(report["policies"]) == COLUMNS
    for label, metrics in report["policies"].items():
        assert metrics["completed"] + metrics["rejected"] == 48
        assert metrics["swa_ratio"] == report["config"]["swa_ratio"][label]
        assert ("swa_ratio_sweep" in metrics) == (label in ("evict", "tail", "swa_ext"))
        assert metrics["eviction_interval"] == (1 if label in ("swa_ext", "swa_ext_shared") else 128)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_pinned_ratio_one_policy(tmp_path):
    out_json = tmp_path / "r.json"
    args = ["simulate", *SMALL, "--policy", "tail", "--swa-ratio", "0.3", "--max-requests", "10",
            "--reserved-decode-tokens", "0", "--json", str(out_json)]
    assert cli.main(args) == 0
    report = json.loads(out_json.read_text())
    assert list(report["policies"]) == ["tail"] and report["policies"]["tail"]["completed"] == 10
    assert report["config"]["swa_ratio"] == {"tail": 0.3}
    assert report["config"]["reserved_decode_tokens"] == 0


def test_simulate_with_a_running_request_cap(tmp_path, capsys):
    out_json = tmp_path / "r.json"
    args = ["simulate", *SMALL, "--policy", "sglang", "--policy", "swa_ext", "--max-running-requests", "8",
            "--json", str(out_json)]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "at most 8 running requests" in out and "SWA pool from --max-running-requests 8" in out
    assert "In SGLang: SWA_EXT_SGLANG=1 SGLANG_SWA_EVICTION_INTERVAL=1 with --max-running-requests 8." in out
    report = json.loads(out_json.read_text())
    assert report["config"]["max_running_requests"] == 8 and list(report["policies"]) == ["sglang", "swa_ext"]
    assert all(m["max_running"] <= 8 for m in report["policies"].values())
    assert report["conclusion"]["swa_ext_vs_sglang"]["from_ratio"] == 0.0


def test_spreadsheet_csv_is_read(tmp_path, capsys):
    # A byte-order mark and CRLF line ends, as a spreadsheet saves a CSV.
    csv = tmp_path / "saved.csv"
    csv.write_bytes(b"\xef\xbb\xbf" + (DATA / "azure_small.csv").read_bytes().replace(b"\n", b"\r\n"))
    assert cli.main(["simulate", "--trace", str(csv), *SMALL[2:], "--swa-ratio", "0.5"]) == 0
    assert capsys.readouterr().err == ""


def _jsonl(tmp_path, name, record):
    path = tmp_path / name
    path.write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 2, **record}) + "\n")
    return str(path)


# (arguments after "simulate", given the test's tmp_path; a fragment of the one error line)
BAD_SIMULATE_ARGS = [
    (lambda d: ["--kv-memory-gib", "inf"], "positive finite"),
    (lambda d: ["--kv-memory-gib", "1e6"], "more KV memory than a decode node"),
    (lambda d: ["--kv-memory-gib", "1e30"], "more KV memory than a decode node"),
    (lambda d: ["--kv-memory-gib", "0.001"], "too small for one request in the 'full' column"),
    (lambda d: ["--time-scale", "inf"], "positive finite"),
    (lambda d: ["--time-scale", "1e30"], "at most 1000"),
    (lambda d: ["--step-ms", "inf"], "positive finite"),
    (lambda d: ["--step-ms", "nan"], "positive finite"),
    (lambda d: ["--plot", str(d / "x.txt")], "name it *.png"),
    (lambda d: ["--json", "/proc/x.json"], "not writable"),
    (lambda d: ["--json", str(d / "part.json"), "--plot", "/sys/x.png"], "not writable"),
    (lambda d: ["--plot", "/proc/self/x.jpg"], "not writable"),
    (lambda d: ["--json", "/dev/null"], "not a regular file"),
    (lambda d: ["--eviction-interval", "0"], "positive integer"),
    (lambda d: ["--json", str(d)], "is a directory"),
    (lambda d: ["--json", str(d / "no" / "r.json")], "no directory"),
    (lambda d: ["--json", ""], "empty path"),
    (lambda d: ["--swa-ratio", "1e-9"], "'evict' column"),
    (lambda d: ["--max-running-requests", "0"], "positive integer"),
    (lambda d: ["--max-running-requests", "1000000", "--policy", "sglang"], "leaves the 'sglang' column no full pool"),
    (lambda d: ["--swa-ratio", "1.5"], "(0, 1]"),
    (lambda d: ["--trace", ""], "trace path is empty"),
    (lambda d: ["--trace", str(d / "absent.csv")], "no such trace"),
    (lambda d: ["--trace", _jsonl(d, "bool.jsonl", {"input_length": True})], "input_length is not an integer"),
    (lambda d: ["--trace", _jsonl(d, "float.jsonl", {"output_length": 2.0})], "output_length is not an integer"),
    (lambda d: ["--trace", _jsonl(d, "early.jsonl", {"timestamp": -5})], "timestamp is negative"),
    (lambda d: ["--model", "no-such-model"], "--model"),
    (lambda d: ["--max-requests", "0"], "positive integer"),
    (lambda d: ["--page-size", "0"], "positive integer"),
    (lambda d: ["--reserved-decode-tokens", "-1"], "non-negative"),
]


@pytest.mark.parametrize("make_args, fragment", BAD_SIMULATE_ARGS)
def test_bad_simulate_value_is_one_line_exit_2_before_the_run(make_args, fragment, tmp_path, capsys, monkeypatch):
    """Checked by trying, so it holds for root too (the tests run as root in CI): exit
    status 2, one stderr line, nothing on stdout and nothing left behind."""
    def no_run(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(simulator.DecodeNode, "run", no_run)
    args = make_args(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    base = [] if "--trace" in args else SMALL[:2]
    assert cli.main(["simulate", *base, *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("swa-ext simulate: error:")
    assert fragment in lines[0]
    assert sorted(tmp_path.rglob("*")) == before


def test_plot_formats_follow_the_suffix(tmp_path, capsys):
    """One rule for simulate and bench: the suffix names any format matplotlib writes."""
    jpg = tmp_path / "r.jpg"
    assert cli.main(["simulate", *SMALL, "--policy", "tail", "--swa-ratio", "0.5", "--plot", str(jpg)]) == 0
    assert jpg.read_bytes()[:2] == b"\xff\xd8"
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {jpg}"


def test_an_existing_output_is_kept_until_the_run_succeeds(tmp_path, capsys, monkeypatch):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    out_json.write_text("old")

    def failing_plot(scenario, results, path):
        Path(path).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(simulator, "plot", failing_plot)
    args = ["simulate", *SMALL, "--policy", "full", "--json", str(out_json), "--plot", str(out_png)]
    assert cli.main(args) == 1
    assert "No space left on device" in capsys.readouterr().err
    # The old report stays, the new one is not half there, and no temporary file is left.
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"] and out_json.read_text() == "old"


def _interrupted(args, tmp_path, ready: str, stream: str, module="swa_ext"):
    """Runs ``python -m MODULE ARGS`` without a terminal, sends SIGINT once a line
    starting with ``ready`` appears on ``stream``, and returns (exit status, stderr lines)."""
    # SIGINT back to its default in the child: a shell's background job (nohup ... &)
    # ignores it, and Python then never turns it into KeyboardInterrupt.
    proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    watched = proc.stdout if stream == "stdout" else proc.stderr
    for line in watched:
        if line.startswith(ready):
            break
    else:
        raise AssertionError(f"the run ended before {ready!r}: {proc.wait()}")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err.splitlines()


def test_ctrl_c_in_simulate_is_one_line_status_130_and_leaves_nothing(tmp_path):
    code, err = _interrupted(["simulate", "--max-requests", "3000", "--json", "r.json", "--plot", "r.png"],
                             tmp_path, "run full", "stdout")
    assert code == cli.INTERRUPTED == 130
    assert err == ["swa-ext: interrupted"]
    assert list(tmp_path.iterdir()) == []


# Where Ctrl-C lands in swa-ext simulate's start-up: after the importtime line of a module
# (printed once it has loaded), plus a delay. "swa_ext": the package has loaded, the command
# module loads next (CPython's own start-up comes before it); "numpy" and "torch._C": the
# simulator's imports, torch's import in progress (seconds on a busy machine); then the
# delays reach the run itself.
START_UP_MOMENTS = [("swa_ext", 0.0), ("swa_ext", 0.05), ("swa_ext.cli", 0.0), ("numpy", 0.0), ("torch._C", 0.0),
                    ("swa_ext", 0.5), ("swa_ext", 1.5), ("swa_ext", 3.0)]


@pytest.mark.parametrize("module, delay", START_UP_MOMENTS, ids=[f"{m}+{d}s" for m, d in START_UP_MOMENTS])
def test_ctrl_c_at_any_moment_of_simulate_start_up_is_one_line_status_130(module, delay, tmp_path):
    """The installed swa-ext command itself, interrupted while it starts: one line, status
    130, no traceback, whatever was loading (PYTHONPROFILEIMPORTTIME says what has)."""
    command = Path(sys.executable).with_name("swa-ext")
    proc = subprocess.Popen([str(command), "simulate", "--max-requests", "3000", "--json", "r.json"], cwd=tmp_path,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPROFILEIMPORTTIME="1"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in proc.stderr:
        if line.rstrip().rpartition("|")[2].strip() == module:
            break
    else:
        raise AssertionError(f"{module} never loaded: {proc.wait()}")
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if not line.startswith("import time:")]
    assert (proc.returncode, lines) == (cli.INTERRUPTED, ["swa-ext: interrupted"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("module, command", [("swa_ext", ["bench"]), ("swa_ext_bench", [])])
def test_ctrl_c_in_bench_is_one_line_status_130_and_leaves_nothing(module, command, tmp_path):
    code, err = _interrupted([*command, "--no-sglang", "--ops", "alloc_decode", "--seconds-per-case", "0.5",
                              "--json", "b.json", "--plot", "b.jpg"], tmp_path, "[1/", "stderr", module)
    assert code == 130
    assert err[-1] == "swa-ext: interrupted" and not any("Traceback" in line for line in err)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [["nosuchcommand"], []])
def test_bad_command_is_one_line_exit_2(args, capsys):
    assert cli.main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1 and "error" in captured.err


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"swa-ext {swa_ext.__version__}"
    assert "__version__" in swa_ext.__all__
    version_file = Path(swa_ext.__file__).with_name("_version.py").read_text()
    assert f'__version__ = "{swa_ext.__version__}"' in version_file


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


class _EntryPoint:
    def __init__(self, main):
        self.main = main

    def load(self):
        return self.main


def test_bench_dispatch(monkeypatch):
    """``swa-ext bench`` runs whatever the bench package registered as the command's entry point."""
    seen, asked = [], []

    def entry_points(group, name):
        asked.append((group, name))
        return [_EntryPoint(lambda argv: seen.append(argv) or 3)]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    assert cli.main(["bench", "--quick", "x"]) == 3
    assert seen == [["--quick", "x"]] and asked == [(cli.COMMAND_ENTRY_POINTS, "bench")]


def test_bench_unavailable(monkeypatch, capsys):
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group, name: [])
    assert cli.main(["bench"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "not installed" in err and "./bench" in err


def test_installed_bench_is_the_command_entry_point():
    """The checkout's bench package (scripts/setup-env.sh installs it) registers ``swa-ext bench``."""
    (found,) = importlib.metadata.entry_points(group=cli.COMMAND_ENTRY_POINTS, name="bench")
    from swa_ext_bench import micro

    assert found.load() is micro.main


def test_simulate_without_the_sim_extra_is_one_line(monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tqdm" else real_find_spec(name, *a))
    for name in [m for m in sys.modules if m == "swa_ext.simulator" or m.startswith("swa_ext.simulator.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(swa_ext, "simulator")
    assert cli.main(["simulate", "--max-requests", "3"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "swa-ext simulate: error: the simulator needs tqdm: pip install 'swa_ext[sim]'\n"


def test_sglang_check_bad_option_is_one_line_exit_2(capsys):
    assert cli.main(["sglang-check", "--serve"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip() == "swa-ext sglang-check: error: unrecognized arguments: --serve"


def test_sglang_check_without_sglang_says_so_exit_1(monkeypatch, capsys):
    """Where SGLang is not installed (tests/sglang checks it where it is)."""
    from swa_ext import sglang_seams

    monkeypatch.setattr(sglang_seams, "installed_version", lambda: None)
    monkeypatch.delenv("SWA_EXT_SGLANG", raising=False)
    monkeypatch.delenv("SWA_EXT_SHARED", raising=False)
    assert cli.main(["sglang-check"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"SGLang: not installed (swa_ext supports {sglang_seams.SUPPORTED_VERSION})",
        "SWA_EXT_SGLANG is unset: swa_ext serves nothing, SGLang's own allocators serve"]
