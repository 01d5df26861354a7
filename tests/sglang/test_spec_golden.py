"""The speculative-decoding golden traces (tests/golden/spec_*.jsonl.gz) are what SGLang 0.5.23's
own code records (tests/golden/record_spec.py, recorded again here in-process), and they hold the
patterns they are kept for. tests/test_golden.py replays them on swa_ext's backends."""
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
sys.path.insert(0, str(GOLDEN))
sys.path.insert(0, str(GOLDEN.parent))

import record_spec  # noqa: E402  (tests/golden/record_spec.py)
from golden_replay import load_trace  # noqa: E402


@pytest.mark.parametrize("params", record_spec.TRACES, ids=lambda p: record_spec.trace_name(*p))
def test_stored_trace_is_what_sglang_records(params):
    stored = load_trace(GOLDEN / (record_spec.trace_name(*params) + ".jsonl.gz"))
    recorded = record_spec.record(*params)
    assert len(recorded) == len(stored)
    for no, (got, want) in enumerate(zip(recorded, stored)):
        assert got == want, f"record {no} differs"


@pytest.mark.parametrize("params", record_spec.TRACES, ids=lambda p: record_spec.trace_name(*p))
def test_trace_holds_the_speculative_patterns(params):
    """Each trace reserves past the committed length, evicts while a request holds more than it
    committed, frees the over-allocated tail, retracts, and ends with both pools whole."""
    records = load_trace(GOLDEN / (record_spec.trace_name(*params) + ".jsonl.gz"))
    init = records[0]
    reserves = [r["meta"] for r in records if r["op"] in ("alloc", "alloc_extend") and "reserve" in r.get("meta", {})]
    assert reserves and all(m["reserve"] == init["spec"]["reserve_per_decode"] for m in reserves)
    lagging = [m for m in reserves if any(a > c + 1 for a, c in zip(m["allocated"], m["committed"]))]
    assert lagging  # a step allocated for requests already holding slots past their committed length
    evictions = [r["meta"] for r in records if r["op"] == "free_swa_segment" and "meta" in r]
    assert any(m["allocated"] > m["pre_len"] + 1 for m in evictions)  # the window slid under a reserve
    assert init["spec"]["released_past_committed"] > 0 and init["spec"]["retracted"] > 0
    assert records[-1]["op"] == "end" and records[-1]["avail"] == [init["size"], init["size_swa"]]
