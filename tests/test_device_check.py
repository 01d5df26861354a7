"""scripts/device-check.sh's plumbing, on a machine without a GPU (DEVICE_CHECK_DRY=1).

The GPU run happens rarely and in a short window; this keeps the script from rotting
between runs: every phase's command is composed, the pytest selections it passes
collect (counted here), the bench's results_match assertion runs on a tiny CPU bench,
and what it leaves under $OUT fits what comes back from the machine (at most 8 files,
none in a folder).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PHASES = ["env", "build", "floor", "smoke", "tests", "layer", "latency", "bench", "sanitizer"]
GOLDEN_TRACES = len(list((ROOT / "tests" / "golden").glob("*.jsonl.gz")))


def run_dry(out, **env_vars):
    env = dict(os.environ, DEVICE_CHECK_DRY="1", OUT=str(out), PYTHON=sys.executable)
    env.update({"DEVICE_CHECK_SECONDS": "300", **env_vars})
    env.pop("DEVICE_CHECK_TIMED", None)
    return subprocess.run(["bash", str(ROOT / "scripts" / "device-check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device-out")
    return run_dry(out), out


def read(out, name):
    """A file the script wrote, without the shell quoting of the commands it composed."""
    return (out / name).read_text().replace("\\", "")


def test_the_dry_run_passes_and_fits_what_comes_back(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    entries = list(out.iterdir())
    assert len(entries) <= 8, sorted(e.name for e in entries)
    assert all(e.is_file() and re.fullmatch(r"[A-Za-z0-9._-]+", e.name) for e in entries), entries
    summary = read(out, "summary.txt")
    for phase in PHASES:
        assert re.search(rf"^{phase}: ", summary, re.M), f"no line for phase {phase}:\n{summary}"
    assert summary.rstrip().endswith("ALL PASSED"), summary


def test_the_selections_collect_only_cuda_parameters(dry_run):
    proc, out = dry_run
    summary = read(out, "summary.txt")
    counts = dict(re.findall(r"(\w+) (\d+)", re.search(r"^selected: (.*)$", summary, re.M).group(1)))
    counts = {k: int(v) for k, v in counts.items()}
    assert counts["golden"] == GOLDEN_TRACES > 0  # one cuda parameter per trace
    assert counts["cuda"] >= 20
    # two hostile-value tests x 3 kinds (the shared mode's included) x 4 page sizes, and the shared mode against the
    # CPU store at 2 page sizes
    assert counts["bad_input"] == 26
    assert counts["layer"] >= 6
    assert counts["sanitized"] >= 2
    if (ROOT / "tests" / "test_misuse.py").exists():
        assert counts["misuse"] > 0
    assert counts["reader"] == 18  # the reader against SGLang's loop: page sizes x intervals x sharing
    tests = read(out, "tests.log")
    nodes = re.findall(r"tests/test_\w+\.py::\S+", tests)
    assert len(nodes) == counts["golden"] + counts["cuda"] + counts["bad_input"] + counts["misuse"] + counts["reader"]
    assert all(re.search(r"[\[-]cuda[\]-]", n) for n in nodes), [n for n in nodes if "cuda" not in n]
    assert "emulated" not in read(out, "layer.log")


def test_each_phase_composes_the_command_the_issue_asks_for(dry_run):
    proc, out = dry_run
    smoke = read(out, "smoke.log")
    assert "CUDA_LAUNCH_BLOCKING=1" in smoke and "timeout 60 " in smoke
    assert re.search(r"test_golden\.py::\S+ps1_\S+cuda", smoke), smoke
    sanitizer = read(out, "sanitizer.log")
    assert "compute-sanitizer --tool memcheck" in sanitizer and "PYTORCH_NO_CUDA_MEMORY_CACHING=1" in sanitizer
    assert re.search(r"ps1_\S+cuda", sanitizer) and re.search(r"ps16_\S+cuda", sanitizer), sanitizer
    for log in ("smoke.log", "tests.log", "layer.log", "sanitizer.log"):
        assert re.search(r"--timeout \d+|faulthandler_timeout=\d+", read(out, log)), log  # a per-test limit
    assert "build_ext --inplace" in read(out, "build.log")
    env = read(out, "env.txt")
    assert "torch " in env and "CUDA_HOME=" in env
    assert re.search(r"^bench: \d+ rows; results_match on every row: True", read(out, "summary.txt"), re.M)
    # The emulated device raises in the call after the planted double free.
    assert re.search(r"^deferred-error latency: largest 1 calls$", read(out, "summary.txt"), re.M)


def test_an_unsupported_sanitizer_is_unavailable_and_keeps_its_share_of_the_budget(tmp_path):
    """compute-sanitizer on a GPU runtime it does not support says "Device not supported"
    and fails: that is no failed check. Its phase gets SANITIZER_SECONDS whatever the
    phases before it were allowed (here the budget leaves them less than their caps)."""
    fake = tmp_path / "fake-sanitizer"
    fake.write_text("#!/bin/sh\necho '========= Error: Device not supported'\nexit 9\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    proc = run_dry(out, DEVICE_CHECK_SANITIZER=str(fake), DEVICE_CHECK_SECONDS="200", SANITIZER_SECONDS="100")
    summary = read(out, "summary.txt")
    assert proc.returncode == 0, summary + proc.stderr[-3000:]
    assert re.search(r"^sanitizer: unavailable \(compute-sanitizer: Device not supported", summary, re.M), summary
    assert summary.rstrip().endswith("ALL PASSED"), summary
    limits = dict(re.findall(r"^(\w+): rc=\d+ in \d+ s \(limit (\d+) s\)", summary, re.M))
    assert int(limits["sanitizer"]) == 100, summary
    assert all(int(limit) <= 200 - 15 - 100 for name, limit in limits.items() if name != "sanitizer"), summary
    # A sanitizer that fails for another reason fails the check.
    fake.write_text("#!/bin/sh\necho '========= Invalid __global__ read'\nexit 9\n")
    out2 = tmp_path / "out2"
    proc = run_dry(out2, DEVICE_CHECK_SANITIZER=str(fake))
    assert proc.returncode != 0 and "FAILED: sanitizer" in read(out2, "summary.txt")


def test_a_failed_bench_row_fails_the_check(tmp_path):
    """The results_match assertion is the script's own: fed a row that differs, it fails."""
    script = (ROOT / "scripts" / "device-check.sh").read_text()
    check = re.search(r"<<'EOF' \|\| failed\+=\(bench_results_match\)\n(.*?)\nEOF\n", script, re.S).group(1)
    report = tmp_path / "bench.json"
    rows = [{"op": "alloc_decode", "batch_size": 1, "page_size": 1, "results_match": True, "baseline_mismatch": None},
            {"op": "free", "batch_size": 256, "page_size": 64, "results_match": False, "baseline_mismatch": "slots"}]
    report.write_text(__import__("json").dumps({"rows": rows}))
    proc = subprocess.run([sys.executable, "-", str(report)], input=check, capture_output=True, text=True)
    assert proc.returncode == 1 and "('free', 256, 64, 'slots')" in proc.stdout, proc.stdout + proc.stderr
    rows[1]["results_match"] = True
    report.write_text(__import__("json").dumps({"rows": rows}))
    proc = subprocess.run([sys.executable, "-", str(report)], input=check, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
