"""The micro-benchmarks (swa_ext_bench.micro) in smoke mode, so they cannot rot.

Tiny sizes and 3 iterations: only that every op/size case runs, native and
baseline agree, the numbers are positive and the report files are written.
No timing is asserted.
"""

import json
import math
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


@pytest.mark.parametrize("argv", [
    ["--ops", "nope"],
    ["--batch-sizes", "0"],
    ["--page-sizes", "x"],
    ["--iters", "0"],
    ["--flush-cache-mb", "-1"],
    ["--json", "/nonexistent-dir/x.json"],
])
def test_main_bad_input(argv, capsys):
    assert micro.main(argv + ["--smoke", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("swa-ext bench: error:") and "\n" not in err
