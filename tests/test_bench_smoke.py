"""The micro-benchmarks (swa_ext_bench.micro) in smoke mode, so they cannot rot.

Tiny sizes and 3 iterations: only that every op/size case runs, native and
baseline agree, the numbers are positive and the report files are written.
No timing is asserted.
"""

import json
import math
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

try:
    from swa_ext_bench import micro
except ImportError:  # the source tree without the installed package
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench import micro

NUMBERS = [
    f"{impl}_{stat}_us" for impl in ("native", "baseline", "floor") for stat in ("median", "p10", "p90")
] + ["speedup_vs_baseline", "ratio_to_floor"]


def _check_rows(rows, batch_sizes, page_sizes, devices=("cpu",)):
    keys = [(r["device"], r["op"], r["batch_size"], r["page_size"]) for r in rows]
    assert len(keys) == len(set(keys))
    want = {(d, op, b, p) for d in devices for op in micro.OPS for b in batch_sizes for p in page_sizes}
    assert set(keys) == want
    for r in rows:
        for k in NUMBERS:
            assert math.isfinite(r[k]) and r[k] > 0, (k, r)
        for impl in ("native", "baseline", "floor"):
            assert r[f"{impl}_p10_us"] <= r[f"{impl}_median_us"] <= r[f"{impl}_p90_us"]
        assert r["iters"] == micro.SMOKE_ITERS
        assert r["results_match"], r


def test_run_smoke():
    rows = micro.run(smoke=True, devices=["cpu"])
    # Smoke caps the batch sizes at SMOKE_MAX_BATCH and keeps every page size.
    _check_rows(rows, [1, micro.SMOKE_MAX_BATCH], list(micro.DEFAULT_PAGE_SIZES))
    md = micro.to_markdown(rows)
    for op in micro.OPS:
        assert f"| cpu | {op} |" in md


def test_main_smoke_writes_reports(tmp_path, capsys):
    js, md, png = tmp_path / "bench.json", tmp_path / "bench.md", tmp_path / "bench.png"
    rc = micro.main([
        "--smoke", "--device", "cpu", "--batch-sizes", "1,4", "--page-sizes", "1", "64",
        "--json", str(js), "--markdown", str(md), "--plot", str(png), "--quiet", "--flush-cache-mb", "1",
    ])
    assert rc == 0
    doc = json.loads(js.read_text())
    _check_rows(doc["rows"], [1, 4], [1, 64])
    assert doc["meta"]["torch"]
    text = md.read_text()
    assert text.startswith("Times in µs") and "| device | op |" in text
    assert text in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_goals_reported():
    rows = micro.run(ops=["alloc_decode"], batch_sizes=[256], page_sizes=[64], devices=["cpu"], smoke=True)
    # Smoke caps the batch, so the goal's case is absent; build it from the row.
    row = dict(rows[0], batch_size=256)
    goals = micro.goals([row])
    assert len(goals) == 1 and "alloc_decode" in goals[0]["goal"]
    assert "Goals:" in micro.to_markdown([row])


BAD_ARGUMENTS = {
    "unknown op": (["--ops", "nope"], "unknown op"),
    "zero batch": (["--batch-sizes", "0"], "--batch-sizes"),
    "page size not a number": (["--page-sizes", "x"], "--page-sizes"),
    "zero iterations": (["--iters", "0"], "--iters"),
    "negative flush": (["--flush-cache-mb", "-1"], "--flush-cache-mb"),
    "json in a missing directory": (["--json", "/nonexistent-dir/x.json"], "no directory"),
    "markdown is a directory": (["--markdown", "{tmp}"], "--markdown"),
    "json is a directory": (["--json", "{tmp}"], "--json"),
    "plot is a directory": (["--plot", "{tmp}"], "--plot"),
    "empty markdown path": (["--markdown", ""], "empty path"),
    "plot format unknown": (["--plot", "{tmp}/bench.txt"], "unknown image format"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_bad_arguments_fail_in_one_line_before_any_work(case, tmp_path, capsys, monkeypatch):
    argv, says = BAD_ARGUMENTS[case]
    argv = [a.format(tmp=tmp_path) for a in argv]

    def no_work(*args, **kwargs):
        raise AssertionError("the benchmark ran before its arguments were checked")

    monkeypatch.setattr(micro, "run", no_work)
    assert micro.main(argv + ["--smoke", "--quiet"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("swa-ext bench: error:") and "\n" not in err and says in err, err
    assert captured.out == "" and list(tmp_path.iterdir()) == []


def test_one_ratio_notation_in_progress_table_and_goals(capsys):
    rc = micro.main(["--smoke", "--device", "cpu", "--ops", "alloc_decode", "--batch-sizes", "1",
                     "--page-sizes", "64"])
    assert rc == 0
    captured = capsys.readouterr()
    progress, wall = captured.err.strip().splitlines()
    assert re.fullmatch(r"\[1/1\] cpu alloc_decode B=1 ps=64: native [\d.,]+ µs, baseline [\d.,]+ µs, "
                        r"floor [\d.,]+ µs \([\d.,]+x vs baseline, [\d.,]+x vs floor, 3 iters\)", progress), progress
    row = [line for line in captured.out.splitlines() if line.startswith("| cpu | alloc_decode |")]
    assert len(row) == 1 and re.search(r"\| [\d.,]+x \| [\d.,]+x \| 3 \|$", row[0]), row
    assert "×" not in captured.out and " x" not in progress
    # The wall time covers the whole command after start-up, measuring included.
    total, measured = map(float, re.fullmatch(r"wall time ([\d.]+) s: 1 case measured in ([\d.]+) s, .*",
                                               wall).groups())
    assert total >= measured
    goal_line = micro.to_markdown([dict(micro.run(ops=["alloc_decode"], batch_sizes=[1], page_sizes=[64],
                                                  devices=["cpu"], smoke=True)[0], batch_size=256)])
    assert re.search(r"- cpu alloc_decode B=256 ps=64: >= 10x vs baseline and <= 3x vs floor: "
                     r"[\d.,]+x vs baseline, [\d.,]+x vs floor: \*\*(met|not met)\*\*", goal_line), goal_line
