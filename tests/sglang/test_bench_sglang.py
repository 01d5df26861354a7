"""``swa-ext bench`` with SGLang's own allocator as a reference (swa_ext_bench.micro, sglang_ref).

Where sglang is importable: SGLang's own ``SWATokenToKVPoolAllocator`` is measured
in every case it has a call for, and on the benchmark's calls it returns what the
native allocator returns, with the same available sizes and mapping after (the
drop-in contract); ``--no-sglang`` leaves it out. Without sglang (simulated in
tests/test_bench_smoke.py) the benchmark says so in one line and measures the
rest. Smoke sizes only; no timing is asserted. Like all of tests/sglang, these
run where sglang is importable (conftest.py).
"""

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool

import swa_ext

ROOT = Path(__file__).resolve().parents[2]

try:
    from swa_ext_bench import micro, sglang_ref
except ImportError:  # the source tree without the installed package
    # Appended, not prepended: the source tree's swa_ext/ must not shadow the built one.
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    from bench import micro, sglang_ref


def _no_sglang_call(op, page_size):
    # SGLang 0.5.23 has alloc_extend_swa_tail for paged pools only.
    return op == "alloc_extend_swa_tail" and page_size == 1


def test_sglang_is_measured_in_every_case_it_has_a_call_for():
    rows = micro.run(smoke=True, devices=["cpu"])
    assert {(r["op"], r["page_size"]) for r in rows} == {
        (op, ps) for op in micro.OPS for ps in micro.DEFAULT_PAGE_SIZES
    }
    for r in rows:
        if _no_sglang_call(r["op"], r["page_size"]):
            assert not r["sglang_measured"] and r["speedup_vs_sglang"] is None, r
            assert r["sglang_results_match"] is None and r["sglang_median_us"] is None, r
            continue
        assert r["sglang_measured"], r
        for stat in ("median", "p10", "p90"):
            assert math.isfinite(r[f"sglang_{stat}_us"]) and r[f"sglang_{stat}_us"] > 0, r
        assert r["sglang_p10_us"] <= r["sglang_median_us"] <= r["sglang_p90_us"]
        assert r["speedup_vs_sglang"] == pytest.approx(r["sglang_median_us"] / r["native_median_us"])
        assert r["sglang_results_match"], (r["op"], r["batch_size"], r["page_size"], r["sglang_mismatch"])
    md = micro.to_markdown(rows)
    assert "| sglang µs |" in md and "| vs sglang |" in md and "⚠" not in md


def test_the_command_measures_sglang_with_cold_caches_and_reports_it(tmp_path, capsys):
    js, md = tmp_path / "bench.json", tmp_path / "bench.md"
    rc = micro.main(["--smoke", "--device", "cpu", "--ops", "alloc_decode,free", "--batch-sizes", "4",
                     "--page-sizes", "16", "--flush-cache-mb", "1", "--json", str(js), "--markdown", str(md)])
    assert rc == 0
    captured = capsys.readouterr()
    assert "not importable" not in captured.err
    progress = [line for line in captured.err.splitlines() if line.startswith("[")]
    assert len(progress) == 2 and all(" sglang " in line and " vs sglang, " in line for line in progress)
    assert re.fullmatch(r"wall time [\d.]+ s: sglang imported in [\d.]+ s, 2 cases measured in .*",
                        captured.err.splitlines()[-1])
    doc = json.loads(js.read_text())
    assert doc["meta"]["sglang"] == "0.5.23"
    for r in doc["rows"]:
        assert r["sglang_measured"] and r["sglang_results_match"] and r["flush_cache_mb"] == 1, r
        assert r["speedup_vs_sglang"] == pytest.approx(r["sglang_median_us"] / r["native_median_us"])
    header = [c.strip() for c in md.read_text().splitlines()[2].strip("|").split("|")]
    assert header[4:15] == ["native µs", "shared µs", "parents µs", "baseline µs", "sglang µs", "floor µs",
                            "vs baseline", "vs sglang", "vs floor", "shared/default", "parents/default"], header


def test_no_sglang_leaves_it_out(tmp_path, capsys):
    js = tmp_path / "bench.json"
    assert micro.main(["--smoke", "--device", "cpu", "--ops", "free", "--batch-sizes", "4", "--page-sizes", "16",
                       "--no-sglang", "--quiet", "--json", str(js)]) == 0
    captured = capsys.readouterr()
    report = [line for line in captured.out.splitlines() if not line.startswith("wrote ")]  # paths name the test
    assert captured.err == "" and f"wrote {js}" in captured.out and not [l for l in report if "sglang" in l.lower()]
    (row,) = json.loads(js.read_text())["rows"]
    assert not row["sglang_measured"] and row["sglang_median_us"] is None


@pytest.mark.parametrize("page_size", micro.DEFAULT_PAGE_SIZES)
@pytest.mark.parametrize("op", micro.OPS)
def test_sglang_returns_what_native_returns_on_the_same_call(op, page_size):
    case = micro._Case(micro.SMOKE_MAX_BATCH, page_size, "cpu", with_sglang=True)
    calls = case.op(op, micro.floor)
    if _no_sglang_call(op, page_size):
        assert "sglang" not in calls
        return
    native, sgl = calls["native"], calls["sglang"]
    for _ in range(2):  # the same again after the restores: the measured calls all start from this state
        case.restore["native"]()
        case.restore["sglang"]()
        r_native, r_sglang = native(), sgl()
        assert case.mismatch("sglang", r_native, r_sglang) is None


def test_a_difference_from_native_is_reported_on_the_row():
    case = micro._Case(micro.SMOKE_MAX_BATCH, 16, "cpu", with_sglang=True)
    calls = case.op("alloc_extend", micro.floor)
    # SGLang's free list reversed after every restore: the same number of pages free,
    # handed out in another order.
    pool = case.allocs["sglang"].full_attn_allocator
    restore = case.restore["sglang"]

    def restore_reversed():
        restore()
        pool.free_pages = pool.free_pages.flip(0)

    case.restore["sglang"] = restore_reversed
    times, n, mismatches = micro._measure(case, calls, 1, 0.1, 1)
    assert mismatches == {"baseline": None, "sglang": "returned indices"}
    row = micro._row("cpu", "alloc_extend", case.batch, 16, n, times, mismatches, None)
    assert row["results_match"] and row["sglang_measured"] and row["sglang_results_match"] is False
    md = micro.to_markdown([row])
    assert "| cpu | alloc_extend ⚠ |" in md and "B=8 ps=16: sglang: returned indices" in md
    assert micro._progress(row).endswith("  SGLANG DIFFERS: returned indices")
    restore()
    pool.free_pages = pool.free_pages[1:]
    assert case.mismatch("sglang").startswith("available sizes")


def test_sglang_allocator_state_round_trips_and_keeps_its_mapping_registered():
    alloc = sglang_ref.make_allocator(64, 64, 1, "cpu")  # alloc() is page-size-1 only in SGLang
    kv = alloc.get_kvcache()
    assert isinstance(kv, BaseSWAKVPool)
    assert kv.full_to_swa_index_mapping is alloc.full_to_swa_index_mapping
    before = sglang_ref.backup_state(alloc)
    avail = (alloc.full_available_size(), alloc.swa_available_size())
    out = alloc.alloc(32)
    assert out is not None and alloc.full_available_size() == avail[0] - 32
    assert torch.count_nonzero(alloc.full_to_swa_index_mapping[:-1]) == 32
    sglang_ref.restore_state(alloc, before)
    assert (alloc.full_available_size(), alloc.swa_available_size()) == avail
    assert torch.equal(alloc.full_to_swa_index_mapping, before[2])
    assert kv.full_to_swa_index_mapping is alloc.full_to_swa_index_mapping
    assert torch.equal(alloc.alloc(32), out)


def test_goals_follow_the_measured_ratios():
    rows = micro.run(ops=["alloc_decode", "free", "free_segment", "evict_out_of_window"],
                     batch_sizes=[1], page_sizes=[64], devices=["cpu"], smoke=True)
    # Smoke caps the batch, so the goals' cells are absent; relabel the measured ones.
    rows = [dict(r, batch_size=256) for r in rows]
    gs = {g["goal"]: g for g in micro.goals(rows)}
    by_op = {r["op"]: r for r in rows}
    expected = {
        "cpu alloc_decode B=256 ps=64: >= 10x vs baseline": ("alloc_decode", "speedup_vs_baseline"),
        "cpu alloc_decode B=256 ps=64: <= 3x vs floor": ("alloc_decode", "ratio_to_floor"),
        "cpu alloc_decode B=256 ps=64: >= 20x vs sglang": ("alloc_decode", "speedup_vs_sglang"),
        "cpu free B=256 ps=64: >= 20x vs baseline": ("free", "speedup_vs_baseline"),
        "cpu free_segment B>=256: >= 30x vs baseline": ("free_segment", "speedup_vs_baseline"),
        "cpu evict_out_of_window B>=256: >= 30x vs baseline": ("evict_out_of_window", "speedup_vs_baseline"),
    }
    assert sorted(gs) == sorted(list(expected) + ["cpu: shared mode <= 1.1x default",
                                                "cpu: parent pages (k 3) <= 1.1x default",
                                                "every cell: >= 1x vs baseline"])
    for name, (op, ratio) in expected.items():
        g = gs[name]
        assert g["value"] == by_op[op][ratio]
        assert g["met"] == (g["value"] <= g["bound"] if ratio == "ratio_to_floor" else g["value"] >= g["bound"])
    slowest = min(r["speedup_vs_baseline"] for r in rows)
    assert gs["every cell: >= 1x vs baseline"]["met"] == (slowest >= 1.0)
    md = micro.to_markdown(rows)
    for name, g in gs.items():
        assert f"- {name}: " in md and ("**met**" if g["met"] else "**not met**") in md
