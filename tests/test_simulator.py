"""Invariants of the decode-node simulator on small traces."""

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swa_ext import simulator
from swa_ext.models import get_model, load_models
from swa_ext.simulator import POLICIES, plan_node, simulate
from swa_ext.traces import Request, TraceError, load_trace

DATA = Path(__file__).with_name("data")
AZURE_SMALL = DATA / "azure_small.csv"
MOONCAKE_SMALL = DATA / "mooncake_small.jsonl"

FREE_METHODS = ("free", "free_full", "free_segment", "free_full_segment")


class RecordingAllocator:
    """Wraps the real allocator and follows every full-pool token from its
    allocation to its release."""

    def __init__(self, inner):
        self.inner = inner
        self.live: set[int] = set()
        self.allocated = 0
        self.released = 0

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name in FREE_METHODS:
            def freeing(indices, *args, **kwargs):
                for i in indices.tolist():
                    assert i in self.live, f"{name} of token {i}, which is not allocated"
                    self.live.remove(i)
                    self.released += 1
                return attr(indices, *args, **kwargs)
            return freeing
        if name.startswith("alloc"):
            def allocating(*args, **kwargs):
                out = attr(*args, **kwargs)
                if out is not None:
                    for i in out.tolist():
                        assert i not in self.live, f"token {i} handed out twice"
                        self.live.add(i)
                        self.allocated += 1
                return out
            return allocating
        return attr


def run_recorded(node, policy):
    made = []

    def factory(size_full, size_swa, page_size):
        made.append(RecordingAllocator(simulator.default_allocator(size_full, size_swa, page_size)))
        return made[0]

    result = simulate(node, policy, allocator_factory=factory)
    return result, made[0]


def check_invariants(node, results):
    for policy, (result, rec) in results.items():
        by_rid = {r.rid: r for r in node.requests}
        assert result.completed == len(node.requests)
        assert set(result.completed_lens) == set(by_rid)
        for rid, length in result.completed_lens.items():
            assert length == by_rid[rid].prompt_len + by_rid[rid].output_len
        # Every token of every completed request was allocated and released, once
        # per residency (a retracted request is preallocated again).
        expected = sum(result.completed_lens.values()) + result.retracted_tokens
        assert rec.allocated == expected
        assert rec.released == expected
        assert not rec.live
        # Pools whole at the end.
        assert rec.full_available_size() == result.size_full
        assert rec.swa_available_size() == result.size_swa
        ps = node.page_size
        assert result.peak_full_pages <= result.size_full // ps
        assert result.peak_swa_pages <= result.size_swa // ps
    per_req = {p: results[p][0].max_swa_pages_per_request for p in results}
    assert per_req["tail"] <= per_req["evict"] <= per_req["full"]


def test_uncongested_trace_invariants():
    # Ample memory: every policy admits at the same steps, so the pool peaks
    # follow the per-request SWA use.
    node = plan_node(load_trace(AZURE_SMALL), get_model("gpt-oss-20b"), page_size=16, kv_memory_gib=4.0)
    results = {p: run_recorded(node, p) for p in POLICIES}
    check_invariants(node, results)
    peaks = {p: results[p][0] for p in POLICIES}
    assert all(r.retractions == 0 for r in peaks.values())
    assert peaks["tail"].peak_swa_pages <= peaks["evict"].peak_swa_pages <= peaks["full"].peak_swa_pages
    assert peaks["tail"].peak_full_pages == peaks["evict"].peak_full_pages == peaks["full"].peak_full_pages
    # The tail policy holds at most a window and two pages of SWA KV per request.
    assert peaks["tail"].max_swa_pages_per_request <= simulator.tail_swa_pages_bound(128, 16)


def test_congested_trace_invariants():
    # Dense arrivals into a small node: requests queue and get retracted.
    node = plan_node(
        load_trace(AZURE_SMALL), get_model("gpt-oss-20b"), page_size=16, kv_memory_gib=0.25, time_scale=0.01
    )
    results = {p: run_recorded(node, p) for p in POLICIES}
    check_invariants(node, results)
    assert results["full"][0].queue_wait_p99_steps > 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.tuples(st.integers(1, 700), st.integers(1, 90)), min_size=1, max_size=14),
    gaps=st.lists(st.integers(0, 400), min_size=14, max_size=14),
    page_size=st.sampled_from([1, 4, 16, 64]),
    model=st.sampled_from(["gpt-oss-20b", "gemma-3-27b", "mistral-7b-v0.1"]),
    pages=st.integers(20, 200),
)
def test_random_traces_invariants(lens, gaps, page_size, model, pages):
    cfg = get_model(model)
    # A budget of about `pages` pages of the full policy's pools.
    gib = pages * page_size * (cfg.full_bytes_per_token + cfg.swa_bytes_per_token) / simulator.GIB
    t, requests = 0.0, []
    for i, ((prompt, output), gap) in enumerate(zip(lens, gaps)):
        t += gap / 1000
        requests.append(Request(i, t, prompt, output))
    try:
        node = plan_node(requests, cfg, page_size=page_size, kv_memory_gib=gib, time_scale=0.05)
    except simulator.SimulationError:
        return  # nothing fits this node
    results = {p: run_recorded(node, p) for p in POLICIES}
    check_invariants(node, results)


def test_same_memory_for_every_policy():
    cfg = get_model("gemma-3-27b")
    node = plan_node(load_trace(AZURE_SMALL), cfg, kv_memory_gib=10.0)
    budget = 10.0 * simulator.GIB
    for policy, (size_full, size_swa) in node.pools.items():
        used = size_full * cfg.full_bytes_per_token + size_swa * cfg.swa_bytes_per_token
        # The same budget, less rounding to whole pages and the padding pages
        # (under four pages of each pool).
        assert budget - 4 * 64 * (cfg.full_bytes_per_token + cfg.swa_bytes_per_token) < used <= budget
        if policy == "full":
            assert size_full == size_swa
        else:
            assert size_swa <= size_full


def test_skips_are_counted_and_shared():
    cfg = get_model("gemma-2-27b")  # context 8192
    requests = [
        Request(0, 0.0, 100, 10),
        Request(1, 0.1, 8190, 10),  # over the context
        Request(2, 0.2, 50, 0),  # nothing to decode
        Request(3, 0.3, 7000, 10),
    ]
    node = plan_node(requests, cfg, kv_memory_gib=0.5)
    assert node.skipped_over_context == 1 and node.skipped_no_output == 1
    # 0.5 GiB holds ~1400 tokens of gemma-2-27b: request 3 does not fit.
    assert node.skipped_over_memory == 1
    assert [r.rid for r in node.requests] == [0]
    results = simulator.run(node)
    assert all(r.completed == 1 and r.skipped == 3 for r in results.values())


def test_budget_too_small_for_one_request():
    with pytest.raises(simulator.SimulationError, match="too small for one request"):
        plan_node(load_trace(AZURE_SMALL), get_model("gpt-oss-20b"), kv_memory_gib=0.001)


def test_report_keys():
    node = plan_node(load_trace(MOONCAKE_SMALL), get_model("gpt-oss-120b"), page_size=16, kv_memory_gib=1.0)
    report = simulator.report(simulator.run(node))
    assert list(report) == list(POLICIES)
    for metrics in report.values():
        for key in simulator.PolicyResult.SUMMARY_KEYS:
            assert key in metrics


def test_named_models():
    models = load_models()
    for name in ("gpt-oss-20b", "gpt-oss-120b", "gemma-2-27b", "gemma-3-27b", "mistral-7b-v0.1"):
        assert name in models
    oss = models["gpt-oss-20b"]
    assert oss.full_bytes_per_token == 2 * 12 * 8 * 64 * 2 == oss.swa_bytes_per_token
    assert models["mistral-7b-v0.1"].full_bytes_per_token == 0
    with pytest.raises(KeyError):
        get_model("no-such-model")


def test_trace_formats(tmp_path):
    azure = load_trace(AZURE_SMALL)
    assert len(azure) == 48 and azure[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(azure, azure[1:]))
    assert load_trace(AZURE_SMALL, limit=5) == azure[:5]
    mooncake = load_trace(MOONCAKE_SMALL)
    records = [json.loads(line) for line in MOONCAKE_SMALL.read_text().splitlines()]
    assert len(mooncake) == len(records) == 24
    first, last = records[0], records[-1]
    assert (mooncake[0].prompt_len, mooncake[0].output_len) == (first["input_length"], first["output_length"])
    assert mooncake[-1].arrival_s == pytest.approx((last["timestamp"] - first["timestamp"]) / 1000)
    numeric = tmp_path / "numeric.csv"
    numeric.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2.5,10,3\n1.0,20,4\n")
    assert load_trace(numeric) == [Request(1, 0.0, 20, 4), Request(0, 1.5, 10, 3)]
    assert len(load_trace(limit=10)) == 10  # the bundled default


@pytest.mark.parametrize(
    "name, text",
    [
        ("missing_column.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:00:00,5\n"),
        ("bad_count.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,five,3\n"),
        ("bad_time.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,3\n"),
        ("negative.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,-5,3\n"),
        ("empty.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"),
        ("not_json.jsonl", '{"timestamp": 1, "input_length": 5\n'),
        ("missing_key.jsonl", '{"timestamp": 1, "input_length": 5}\n'),
        ("bad_time.jsonl", '{"timestamp": "x", "input_length": 5, "output_length": 2}\n'),
    ],
)
def test_malformed_traces(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceError):
        load_trace(path)


def test_missing_trace(tmp_path):
    with pytest.raises(TraceError, match="no such trace"):
        load_trace(tmp_path / "absent.csv")
