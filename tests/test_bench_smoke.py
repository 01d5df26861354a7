"""The micro-benchmarks (swa_ext_bench.micro) in smoke mode, so they cannot rot.

Tiny sizes and 3 iterations: only that every op/size case runs, native and
baseline agree, the numbers are positive and the report files are written.
No timing is asserted. SGLang's allocator as a reference is simulated absent
here (or left out with --no-sglang), so these run in either venv; where sglang is
importable, tests/sglang/test_bench_sglang.py measures it.
"""

import json
import math
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

try:
    from swa_ext_bench import micro, sglang_ref
except ImportError:  # the source tree without the installed package
    if str(ROOT) not in sys.path:  # last: never a swa_ext that PYTHONPATH puts first
        sys.path.append(str(ROOT))
    from bench import micro, sglang_ref

NUMBERS = [
    f"{impl}_{stat}_us" for impl in ("native", "shared", "parents", "baseline", "floor")
    for stat in ("median", "p10", "p90")
] + ["speedup_vs_baseline", "ratio_to_floor"]


def _check_rows(rows, batch_sizes, page_sizes, devices=("cpu",), ops=micro.OPS):
    keys = [(r["device"], r["op"], r["batch_size"], r["page_size"]) for r in rows]
    assert len(keys) == len(set(keys))
    want = {(d, op, b, p) for d in devices for op in ops for b in batch_sizes for p in page_sizes}
    assert set(keys) == want
    for r in rows:
        for k in NUMBERS:
            assert math.isfinite(r[k]) and r[k] > 0, (k, r)
        for impl in ("native", "shared", "parents", "baseline", "floor"):
            assert r[f"{impl}_p10_us"] <= r[f"{impl}_median_us"] <= r[f"{impl}_p90_us"]
        assert r["iters"] == micro.SMOKE_ITERS
        assert r["results_match"] and r["baseline_mismatch"] is None, r
        if not r["sglang_measured"]:
            assert r["sglang_median_us"] is None and r["speedup_vs_sglang"] is None, r


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
    rows = micro.run(ops=["alloc_decode"], batch_sizes=[256], page_sizes=[64], devices=["cpu"], smoke=True,
                     with_sglang=False)
    # Smoke caps the batch, so the goal's case is absent; build it from the row.
    row = dict(rows[0], batch_size=256)
    goals = {g["goal"]: g for g in micro.goals([row])}
    # The SGLang goal needs SGLang's time; the others are all there.
    assert sorted(goals) == ["cpu alloc_decode B=256 ps=64: <= 3x vs floor",
                             "cpu alloc_decode B=256 ps=64: >= 10x vs baseline",
                             "cpu: parent pages (k 3) <= 1.1x default",
                             "cpu: shared mode <= 1.1x default",
                             "every cell: >= 1x vs baseline"]
    floor = goals["cpu alloc_decode B=256 ps=64: <= 3x vs floor"]
    assert floor["value"] == row["ratio_to_floor"] and floor["met"] == (row["ratio_to_floor"] <= 3)
    shared = goals["cpu: shared mode <= 1.1x default"]  # the shared mode against the default, same process
    assert shared["value"] == row["shared_median_us"] / row["native_median_us"] == row["shared_vs_default"]
    assert shared["met"] == (row["shared_vs_default"] <= 1.1)
    parents = goals["cpu: parent pages (k 3) <= 1.1x default"]  # parent pages against the default, same process
    assert parents["value"] == row["parents_median_us"] / row["native_median_us"] == row["parents_vs_default"]
    assert "Goals (each at its worst measured cell):" in micro.to_markdown([row])


def test_a_goal_is_judged_at_its_worst_cell():
    row = micro.run(ops=["free_segment"], batch_sizes=[1], page_sizes=[64], devices=["cpu"], smoke=True,
                    with_sglang=False)[0]
    rows = [dict(row, batch_size=b, speedup_vs_baseline=x) for b, x in ((16, 0.5), (256, 40.0), (2048, 31.0))]
    (goal,) = [g for g in micro.goals(rows) if g["goal"].startswith("cpu free_segment")]
    assert goal == {"goal": "cpu free_segment B>=256: >= 30x vs baseline", "ratio": "speedup_vs_baseline",
                    "bound": 30.0, "worst": "B=2048 ps=64", "value": 31.0, "met": True}
    slowest = [g for g in micro.goals(rows) if g["goal"] == "every cell: >= 1x vs baseline"]
    assert slowest[0]["worst"] == "cpu free_segment B=16 ps=64" and not slowest[0]["met"]


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
    "no-sglang given a value": (["--no-sglang=yes"], "--no-sglang"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_bad_arguments_fail_in_one_line_before_any_work(case, tmp_path, capsys, monkeypatch):
    argv, says = BAD_ARGUMENTS[case]
    argv = [a.format(tmp=tmp_path) for a in argv]

    def no_work(*args, **kwargs):
        raise AssertionError("the benchmark ran before its arguments were checked")

    monkeypatch.setattr(micro, "run", no_work)
    monkeypatch.setattr(sglang_ref, "unavailable_reason", no_work)  # importing sglang takes seconds
    assert micro.main(argv + ["--smoke", "--quiet"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("swa-ext bench: error:") and "\n" not in err and says in err, err
    assert captured.out == "" and list(tmp_path.iterdir()) == []


def test_one_ratio_notation_in_progress_table_and_goals(capsys):
    rc = micro.main(["--smoke", "--device", "cpu", "--ops", "alloc_decode", "--batch-sizes", "1",
                     "--page-sizes", "64", "--no-sglang"])
    assert rc == 0
    captured = capsys.readouterr()
    progress, wall = captured.err.strip().splitlines()
    assert re.fullmatch(r"\[1/1\] cpu alloc_decode B=1 ps=64: native [\d.,]+ µs, shared [\d.,]+ µs, "
                        r"parents [\d.,]+ µs, baseline [\d.,]+ µs, floor [\d.,]+ µs \([\d.,]+x vs baseline, "
                        r"[\d.,]+x vs floor, shared [\d.]+x default, parents [\d.]+x default, 3 iters\)",
                        progress), progress
    row = [line for line in captured.out.splitlines() if line.startswith("| cpu | alloc_decode |")]
    assert len(row) == 1 and re.search(r"\| [\d.,]+x \| [\d.,]+x \| [\d.]+x \| [\d.]+x \| 3 \|$", row[0]), row
    assert "×" not in captured.out and " x" not in progress
    # The wall time covers the whole command after start-up, measuring included.
    total, measured = map(float, re.fullmatch(r"wall time ([\d.]+) s: 1 case measured in ([\d.]+) s, .*",
                                               wall).groups())
    assert total >= measured
    goal_line = micro.to_markdown([dict(micro.run(ops=["alloc_decode"], batch_sizes=[1], page_sizes=[64],
                                                  devices=["cpu"], smoke=True, with_sglang=False)[0],
                                        batch_size=256)])
    assert re.search(r"- cpu alloc_decode B=256 ps=64: >= 10x vs baseline: [\d.,]+x at B=256 ps=64: "
                     r"\*\*(met|not met)\*\*", goal_line), goal_line
    assert re.search(r"- cpu alloc_decode B=256 ps=64: <= 3x vs floor: [\d.,]+x at B=256 ps=64: "
                     r"\*\*(met|not met)\*\*", goal_line), goal_line


NO_SGLANG = "ModuleNotFoundError: No module named 'sglang'"
SMALL = ["--smoke", "--device", "cpu", "--ops", "alloc_decode,free", "--batch-sizes", "1", "--page-sizes", "16"]


def _table(out):
    """The header and the cpu rows of the markdown table in ``out``, as lists of cells."""
    lines = [line for line in out.splitlines() if line.startswith(("| device |", "| cpu |"))]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def test_without_sglang_the_run_says_so_in_one_line_and_measures_the_rest(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sglang_ref, "unavailable_reason", lambda: NO_SGLANG)
    js = tmp_path / "bench.json"
    assert micro.main(SMALL + ["--quiet", "--json", str(js)]) == 0
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert err == [f"swa-ext bench: SGLang's allocator is not importable ({NO_SGLANG}): "
                   "measuring native, baseline and floor only"], err
    header, *rows = _table(captured.out)
    assert len(rows) == 2 and not any("sglang" in h for h in header), header
    doc = json.loads(js.read_text())
    _check_rows(doc["rows"], [1], [16], ops=["alloc_decode", "free"])
    assert not any(r["sglang_measured"] for r in doc["rows"]) and doc["meta"]["sglang"] is None


def test_no_sglang_leaves_it_out_without_asking_for_it(monkeypatch, capsys):
    def no_import():
        raise AssertionError("--no-sglang imported sglang")

    monkeypatch.setattr(sglang_ref, "unavailable_reason", no_import)
    assert micro.main(SMALL + ["--quiet", "--no-sglang"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    header, *rows = _table(captured.out)
    assert len(rows) == 2 and not any("sglang" in h for h in header), header


def test_asking_run_for_sglang_without_it_fails(monkeypatch):
    monkeypatch.setattr(sglang_ref, "unavailable_reason", lambda: NO_SGLANG)
    with pytest.raises(RuntimeError, match="not importable"):
        micro.run(ops=["free"], batch_sizes=[1], page_sizes=[16], devices=["cpu"], smoke=True, with_sglang=True)


def test_a_reference_that_differs_from_native_is_reported_on_its_row(monkeypatch, capsys):
    checked = micro._Case.mismatch

    def baseline_off(case, name, r_native=None, r_other=None):
        # The setup's checks (no results) pass; the check of alloc_decode's result fails.
        return checked(case, name) if r_native is None else "returned indices"

    monkeypatch.setattr(micro._Case, "mismatch", baseline_off)
    assert micro.main(["--smoke", "--device", "cpu", "--ops", "alloc_decode", "--batch-sizes", "1",
                       "--page-sizes", "16", "--no-sglang"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines()[0].endswith("  BASELINE DIFFERS: returned indices"), captured.err
    assert "| cpu | alloc_decode ⚠ |" in captured.out
    assert "- cpu alloc_decode B=1 ps=16: baseline: returned indices" in captured.out


def test_every_implementation_runs_behind_every_other():
    """What ran just before a call decides how cold its caches are, so no implementation
    may always follow the same ones (rotating one order of four never puts native
    behind the baseline)."""
    case = micro._Case(2, 16, "cpu")
    sequence = []
    names = ("native", "baseline", "sglang", "floor")
    calls = {name: (lambda name=name: sequence.append(name)) for name in names}
    micro._measure(case, calls, 40, 1.0, 1)
    timed = sequence[-4 * 40:]
    assert sorted(timed) == sorted(list(names) * 40)
    follows = {(a, b) for a, b in zip(timed, timed[1:]) if a != b}
    assert follows == {(a, b) for a in names for b in names if a != b}, follows
