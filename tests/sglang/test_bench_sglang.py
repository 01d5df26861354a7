"""The benchmark's SGLang reference (swa_ext_bench.vs_sglang, sglang_ref).

Where sglang is importable: SGLang's own ``SWATokenToKVPoolAllocator`` is the
third reference of every case it has a call for, and on the benchmark's calls it
returns what the native allocator returns, with the same available sizes and
mapping after (the drop-in contract). Without sglang (simulated here) the
benchmark says so in one line and measures the other references. Smoke sizes
only; no timing is asserted. Like all of tests/sglang, these run where sglang is
importable (conftest.py).
"""

import math
import sys
from pathlib import Path

import pytest
import torch

import swa_ext

ROOT = Path(__file__).resolve().parents[2]

try:
    from swa_ext_bench import micro, sglang_ref, vs_sglang
except ImportError:  # the source tree without the installed package
    # Appended, not prepended: the source tree's swa_ext/ must not shadow the built one.
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    from bench import micro, sglang_ref, vs_sglang


def _no_sglang_call(op, page_size):
    # SGLang 0.5.23 has alloc_extend_swa_tail for paged pools only.
    return op == "alloc_extend_swa_tail" and page_size == 1


def test_sglang_is_the_third_reference_of_every_case_it_has_a_call_for():
    rows = vs_sglang.run(smoke=True)
    assert {(r["op"], r["page_size"]) for r in rows} == {
        (op, ps) for op in micro.OPS for ps in micro.DEFAULT_PAGE_SIZES
    }
    for r in rows:
        if _no_sglang_call(r["op"], r["page_size"]):
            assert not r["sglang_measured"] and r["speedup_vs_sglang"] is None, r
            continue
        assert r["sglang_measured"], r
        for stat in ("median", "p10", "p90"):
            assert math.isfinite(r[f"sglang_{stat}_us"]) and r[f"sglang_{stat}_us"] > 0, r
        assert r["sglang_p10_us"] <= r["sglang_median_us"] <= r["sglang_p90_us"]
        assert r["speedup_vs_sglang"] == pytest.approx(r["sglang_median_us"] / r["native_median_us"])
        assert r["sglang_results_match"], (r["op"], r["batch_size"], r["page_size"], r["sglang_mismatch"])
    md = vs_sglang.to_markdown(rows)
    assert "| sglang |" in md and "⚠" not in md


@pytest.mark.parametrize("page_size", micro.DEFAULT_PAGE_SIZES)
@pytest.mark.parametrize("op", micro.OPS)
def test_sglang_returns_what_native_returns_on_the_same_call(op, page_size):
    case = vs_sglang.Case(micro.SMOKE_MAX_BATCH, page_size, "cpu", with_sglang=True)
    floor = swa_ext._C.bench_floor
    sgl = case.sglang_op(op, floor)
    if _no_sglang_call(op, page_size):
        assert sgl is None
        return
    native = case.op(op, floor)[0]
    case.restore_native()
    case.restore_sglang()
    r_native, r_sglang = native(), sgl()
    assert case.sglang_mismatch(r_native, r_sglang) is None
    # The same again after the restores: the measured calls all start from this state.
    case.restore_native()
    case.restore_sglang()
    assert case.sglang_mismatch(native(), sgl()) is None


def test_a_difference_from_native_is_reported():
    case = vs_sglang.Case(micro.SMOKE_MAX_BATCH, 16, "cpu", with_sglang=True)
    floor = swa_ext._C.bench_floor
    native, sgl = case.op("alloc_extend", floor)[0], case.sglang_op("alloc_extend", floor)
    # SGLang's free list reversed: the same number of pages free, handed out in another order.
    pool = case.sgl.full_attn_allocator
    pool.free_pages = pool.free_pages.flip(0)
    assert case.sglang_mismatch(native(), sgl()) == "returned indices"
    case.restore_native()
    case.restore_sglang()
    pool.free_pages = pool.free_pages[1:]
    assert case.sglang_mismatch().startswith("available sizes")


def test_sglang_allocator_state_round_trips_and_keeps_its_mapping_registered():
    alloc = sglang_ref.make_allocator(64, 64, 1, "cpu")  # alloc() is page-size-1 only in SGLang
    kv = alloc.get_kvcache()
    assert isinstance(kv, sglang_ref.BaseSWAKVPool)
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


def test_without_sglang_the_run_says_so_in_one_line_and_measures_the_rest(monkeypatch, capsys):
    monkeypatch.setattr(sglang_ref, "_import_error", "ModuleNotFoundError: No module named 'sglang'")
    rc = vs_sglang.main(["--smoke", "--ops", "alloc_decode,free", "--batch-sizes", "1", "--page-sizes", "16",
                         "--quiet"])
    assert rc == 0
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "not importable" in err[0] and "No module named 'sglang'" in err[0], err
    rows = [line for line in captured.out.splitlines() if line.startswith("| cpu |")]
    assert len(rows) == 2
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[6] == "n/a" and cells[9] == "n/a", line  # sglang µs, vs sglang
        assert cells[4] != "n/a" and cells[5] != "n/a" and cells[7] != "n/a", line


def test_asking_for_sglang_without_it_fails(monkeypatch):
    monkeypatch.setattr(sglang_ref, "_import_error", "ModuleNotFoundError: No module named 'sglang'")
    with pytest.raises(RuntimeError, match="not importable"):
        vs_sglang.run(ops=["free"], batch_sizes=[1], page_sizes=[16], smoke=True, with_sglang=True)


def test_goals_follow_the_measured_ratios():
    rows = vs_sglang.run(ops=["alloc_decode", "free", "free_segment", "evict_out_of_window"],
                         batch_sizes=[1], page_sizes=[64], smoke=True)
    # Smoke caps the batch, so the goals' cells are absent; relabel the measured ones.
    rows = [dict(r, batch_size=256) for r in rows]
    gs = {g["goal"]: g for g in vs_sglang.goals(rows)}
    by_op = {r["op"]: r for r in rows}
    expected = [("free", "baseline", 20), ("free_segment", "baseline", 30), ("evict_out_of_window", "baseline", 30),
                ("alloc_decode", "sglang", 20)]
    for op, ref, least in expected:
        (goal,) = [g for name, g in gs.items() if name.startswith(f"cpu {op} ")]
        assert goal["speedup"] == by_op[op][f"speedup_vs_{ref}"]
        assert goal["met"] == (goal["speedup"] >= least)
    slowest = min(r["speedup_vs_baseline"] for r in rows)
    assert gs["no cell slower than the baseline"]["met"] == (slowest >= 1.0)
    md = vs_sglang.to_markdown(rows)
    for name, g in gs.items():
        assert f"- {name}: " in md and ("**met**" if g["met"] else "**not met**") in md
