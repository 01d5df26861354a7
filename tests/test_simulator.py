"""Invariants of the decode-node simulator on small traces."""

import json
from pathlib import Path

import pytest

import swa_ext
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swa_ext import simulator
from swa_ext.models import get_model, load_models
from swa_ext.simulator import POLICIES, plan_scenario, policy_config, simulate
from swa_ext.traces import Request, TraceError, load_trace

DATA = Path(__file__).with_name("data")
AZURE_SMALL = DATA / "azure_small.csv"
MOONCAKE_SMALL = DATA / "mooncake_small.jsonl"
# The bundled long-prompt sample (Mooncake conversation trace, mean prompt about 14k tokens).
MOONCAKE_LONG = Path(swa_ext.__file__).with_name("data") / "mooncake_conversation_trace_2000.jsonl"

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


def run_recorded(scenario, policy, swa_ratio=simulator.SGLANG_DEFAULT_SWA_RATIO):
    made = []

    def factory(size_full, size_swa, page_size):
        made.append(RecordingAllocator(simulator.default_allocator(size_full, size_swa, page_size)))
        return made[0]

    result = simulate(scenario, policy, swa_ratio, allocator_factory=factory)
    # No allocator is made for a node that rejects every request.
    return result, made[0] if made else None


def check_invariants(scenario, results):
    for policy, (result, rec) in results.items():
        config = policy_config(scenario, policy, result.swa_ratio)
        served = {r.rid: r for r in scenario.requests if simulator.fits_empty_node(scenario, config, r)}
        # No request dropped: each one is completed, or rejected by this policy
        # because it cannot run on its empty node.
        assert result.requests == len(scenario.requests)
        assert result.rejected == len(scenario.requests) - len(served)
        assert result.completed == len(served)
        assert set(result.completed_lens) == set(served)
        for rid, length in result.completed_lens.items():
            assert length == served[rid].prompt_len + served[rid].output_len
        # The capacity bound is an upper bound of the concurrency reached.
        assert result.mean_running <= result.capacity_bound + 1e-9
        if rec is None:
            assert not served
            continue
        # Every token of every completed request was allocated and released, once
        # per residency (a retracted request is preallocated again).
        expected = sum(result.completed_lens.values()) + result.retracted_tokens
        assert rec.allocated == expected
        assert rec.released == expected
        assert not rec.live
        # Pools whole at the end.
        assert rec.full_available_size() == result.size_full
        assert rec.swa_available_size() == result.size_swa
        assert result.peak_full_pages <= result.pool_full_pages
        assert result.peak_swa_pages <= result.pool_swa_pages
        assert (result.retractions == 0) == (result.retracted_tokens == 0) == (result.retracted_gib == 0)


def test_uncongested_trace_invariants():
    # Ample memory: every policy admits at the same steps, so the pool peaks
    # follow the per-request SWA use.
    scenario = plan_scenario(load_trace(AZURE_SMALL), get_model("gpt-oss-20b"), page_size=16, kv_memory_gib=4.0)
    results = {p: run_recorded(scenario, p) for p in POLICIES}
    check_invariants(scenario, results)
    peaks = {p: results[p][0] for p in POLICIES}
    assert all(r.retractions == 0 and r.rejected == 0 for r in peaks.values())
    assert peaks["tail"].peak_swa_pages <= peaks["evict"].peak_swa_pages <= peaks["full"].peak_swa_pages
    assert peaks["tail"].peak_full_pages == peaks["evict"].peak_full_pages == peaks["full"].peak_full_pages
    per_req = [peaks[p].max_swa_pages_per_request for p in ("tail", "evict", "full")]
    assert per_req == sorted(per_req)
    # The tail policy holds at most a window, the eviction interval and a page of SWA KV per request.
    assert peaks["tail"].max_swa_pages_per_request <= simulator.tail_swa_pages_bound(128, 16, 128)
    # tail receives SWA KV for the window tail only; the others for the whole prompt.
    assert peaks["tail"].transfer_gib < peaks["evict"].transfer_gib == peaks["full"].transfer_gib


def test_congested_trace_invariants():
    # Dense arrivals into a small node without decode reserve: requests queue and
    # get retracted.
    scenario = plan_scenario(load_trace(AZURE_SMALL), get_model("gpt-oss-20b"), page_size=16, kv_memory_gib=0.25,
                             time_scale=0.01, reserved_decode_tokens=0)
    results = {p: run_recorded(scenario, p) for p in POLICIES}
    check_invariants(scenario, results)
    assert results["full"][0].queue_wait_p99_steps > 0
    assert any(r.retractions for r, _ in results.values())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.tuples(st.integers(1, 700), st.integers(1, 90)), min_size=1, max_size=14),
    gaps=st.lists(st.integers(0, 400), min_size=14, max_size=14),
    page_size=st.sampled_from([1, 4, 16, 64]),
    model=st.sampled_from(["gpt-oss-20b", "gemma-3-27b", "mistral-7b-v0.1"]),
    pages=st.integers(20, 200),
    swa_ratio=st.sampled_from([0.05, 0.2, 0.8]),
    reserve=st.sampled_from([0, 16, 512]),
)
def test_random_traces_invariants(lens, gaps, page_size, model, pages, swa_ratio, reserve):
    cfg = get_model(model)
    # A budget of about `pages` pages of the full policy's pools.
    gib = pages * page_size * (cfg.full_bytes_per_token + cfg.swa_bytes_per_token) / simulator.GIB
    t, requests = 0.0, []
    for i, ((prompt, output), gap) in enumerate(zip(lens, gaps)):
        t += gap / 1000
        requests.append(Request(i, t, prompt, output))
    scenario = plan_scenario(requests, cfg, page_size=page_size, kv_memory_gib=gib, time_scale=0.05,
                             reserved_decode_tokens=reserve)
    results = {p: run_recorded(scenario, p, swa_ratio) for p in POLICIES}
    check_invariants(scenario, results)


def test_rejection_is_per_policy():
    # A request too long for the full policy's pools fits tail's: only full rejects it.
    cfg = get_model("gemma-3-27b")
    requests = [Request(0, 0.0, 2000, 20), Request(1, 0.1, 14000, 20), Request(2, 0.2, 1500, 20)]
    scenario = plan_scenario(requests, cfg, kv_memory_gib=4.0)
    full = policy_config(scenario, "full", 1.0)
    assert full.size_full < 14000 < policy_config(scenario, "tail", 0.1).size_full
    results = simulator.run(scenario, swa_ratio=0.1)
    assert results["full"].rejected == 1 and results["full"].completed == 2
    assert 1 not in results["full"].completed_lens
    assert results["tail"].rejected == 0 and results["tail"].completed == 3
    # evict needs the whole prompt on its (small) SWA pool.
    assert results["evict"].rejected == 1


def test_tail_retractions_bounded_on_long_prompts():
    # The long-prompt sample on a small node: the admission reserve keeps the retractions
    # well below greedy admission's (no reserve). Not to none on tail's 2% SWA pool: SGLang
    # caps the SWA reserve at what the windows can still grow, and a request whose window
    # is full still takes a page at a page boundary before eviction frees one.
    requests = load_trace(MOONCAKE_LONG, 150)
    assert sum(r.prompt_len for r in requests) / len(requests) > 10000
    counts = {}
    for reserve in (simulator.DEFAULT_RESERVED_DECODE_TOKENS, 0):
        scenario = plan_scenario(requests, get_model("gpt-oss-20b"), kv_memory_gib=8.0, time_scale=0.1,
                                 reserved_decode_tokens=reserve)
        results = {p: simulate(scenario, p, 0.02) for p in ("full", "tail")}
        assert all(r.completed == len(requests) for r in results.values())
        counts[reserve] = {p: r.retractions for p, r in results.items()}
        if reserve:
            assert results["tail"].mean_running > 1.5 * results["full"].mean_running
    reserved = counts[simulator.DEFAULT_RESERVED_DECODE_TOKENS]
    assert reserved["full"] <= counts[0]["full"] and reserved["tail"] <= len(requests) // 10
    assert counts[0]["tail"] > 2 * max(reserved["tail"], 1)


def test_capacity_bound_sums():
    # The closed forms against the per-step count they replace.
    cfg = get_model("gpt-oss-20b")
    for ps in (1, 3, 16, 64):
        requests = [Request(0, 0.0, p, o) for p, o in ((1, 1), (5, 300), (127, 2), (128, 129), (700, 64))]
        scenario = plan_scenario(requests, cfg, page_size=ps, kv_memory_gib=1.0)
        for policy in POLICIES:
            config = policy_config(scenario, policy, 0.5)
            steps = full_steps = swa_steps = 0
            for r in requests:
                for length in range(r.prompt_len + 1, r.prompt_len + r.output_len + 1):
                    full = -(-length // ps)
                    steps += 1
                    full_steps += full
                    swa_steps += full if policy == "full" else full - max(0, length - cfg.window) // ps
            expected = min(config.size_full // ps * steps / full_steps, config.size_swa // ps * steps / swa_steps)
            assert simulator.capacity_bound(scenario, config, requests) == pytest.approx(expected)


def test_sweep_keeps_the_best_ratio():
    # The pruned sweep picks what running every ratio would.
    scenario = plan_scenario(load_trace(MOONCAKE_LONG, 60), get_model("gpt-oss-20b"), kv_memory_gib=4.0,
                             time_scale=0.05)
    ratios = (0.01, 0.05, 0.2, 1.0)
    results = simulator.run(scenario, ("tail",), sweep=ratios)
    assert list(results) == ["tail"]
    best = results["tail"]
    assert [p["swa_ratio"] for p in best.sweep] == list(ratios)
    every = [simulate(scenario, "tail", r) for r in ratios]
    top = min(every, key=lambda r: (r.rejected, -r.mean_running, r.retractions))
    assert (best.rejected, best.mean_running) == (top.rejected, top.mean_running)
    for point, full_run in zip(best.sweep, every):
        if point["mean_running"] is None:
            assert point["capacity_bound"] < best.mean_running
        else:
            assert point["mean_running"] == full_run.mean_running


def test_planned_columns():
    scenario = plan_scenario(load_trace(AZURE_SMALL), get_model("gpt-oss-20b"), page_size=16, kv_memory_gib=2.0)
    def columns(runs):
        return [(r.label, r.policy, tuple(c.swa_ratio for c in r.configs), {c.eviction_interval for c in r.configs})
                for r in runs]

    sweep = simulator.SWA_RATIO_SWEEP
    assert columns(simulator.plan_runs(scenario)) == [
        ("full", "full", (1.0,), {128}), ("evict", "evict", sweep, {128}), ("tail", "tail", sweep, {128}),
        ("sglang", "tail", (0.8,), {128}), ("swa_ext", "tail", sweep, {1}),
        ("sglang_unified", "tail", (None,), {128}), ("swa_ext_shared", "tail", (None,), {1})]
    assert columns(simulator.plan_runs(scenario, swa_ratio=0.3)) == [
        ("full", "full", (1.0,), {128}), ("evict", "evict", (0.3,), {128}), ("tail", "tail", (0.3,), {128}),
        ("sglang", "tail", (0.8,), {128}), ("swa_ext", "tail", (0.3,), {1}),
        ("sglang_unified", "tail", (None,), {128}), ("swa_ext_shared", "tail", (None,), {1})]
    # A pinned ratio that leaves the SWA pool no room names the column it starves.
    with pytest.raises(simulator.SimulationError, match="'evict' column"):
        simulator.plan_runs(scenario, swa_ratio=1e-9)
    with pytest.raises(simulator.SimulationError, match="'tail' column"):
        simulator.plan_runs(scenario, ("full", "tail"), swa_ratio=1e-9)


def test_same_memory_for_every_policy():
    cfg = get_model("gemma-3-27b")
    scenario = plan_scenario(load_trace(AZURE_SMALL), cfg, kv_memory_gib=10.0)
    budget = 10.0 * simulator.GIB
    for policy in POLICIES:
        config = policy_config(scenario, policy, 0.3)
        used = config.size_full * cfg.full_bytes_per_token + config.size_swa * cfg.swa_bytes_per_token
        # The same budget, less rounding to whole pages (under two pages of each pool).
        assert budget - 2 * 64 * (cfg.full_bytes_per_token + cfg.swa_bytes_per_token) < used <= budget
        if policy == "full":
            assert config.size_full == config.size_swa and config.swa_ratio == 1.0
        else:
            assert config.size_swa <= config.size_full and config.swa_ratio == 0.3


def test_skips_are_counted_and_shared():
    cfg = get_model("gemma-2-27b")  # context 8192
    requests = [
        Request(0, 0.0, 100, 10),
        Request(1, 0.1, 8190, 10),  # over the context
        Request(2, 0.2, 50, 0),  # nothing to decode
        Request(3, 0.3, 7000, 10),
    ]
    scenario = plan_scenario(requests, cfg, kv_memory_gib=0.5)
    assert scenario.skipped_over_context == 1 and scenario.skipped_no_output == 1
    assert [r.rid for r in scenario.requests] == [0, 3]
    # 0.5 GiB holds ~1400 tokens of gemma-2-27b: every policy rejects request 3.
    results = simulator.run(scenario, swa_ratio=0.5)
    assert all(r.completed == 1 and r.rejected == 1 for r in results.values())


def test_budget_too_small_for_one_request():
    scenario = plan_scenario(load_trace(AZURE_SMALL), get_model("gpt-oss-20b"), kv_memory_gib=0.001)
    with pytest.raises(simulator.SimulationError, match="too small for one request in the 'full' column"):
        simulator.plan_runs(scenario)


@pytest.mark.parametrize("kwargs", [{"kv_memory_gib": float("inf")}, {"time_scale": float("nan")},
                                    {"step_ms": 0.0}, {"page_size": 0}, {"reserved_decode_tokens": -1},
                                    {"eviction_interval": 0}])
def test_bad_settings(kwargs):
    with pytest.raises(simulator.SimulationError):
        plan_scenario(load_trace(AZURE_SMALL), get_model("gpt-oss-20b"), **kwargs)


def test_report_has_config_and_policies():
    scenario = plan_scenario(load_trace(MOONCAKE_SMALL), get_model("gpt-oss-120b"), trace="mooncake_small.jsonl",
                             page_size=16, kv_memory_gib=1.0)
    results = simulator.run(scenario, swa_ratio=0.4)
    report = json.loads(json.dumps(simulator.report(scenario, results)))
    assert list(report) == ["swa_ext_version", "config", "model", "notes", "policies", "rows", "conclusion"]
    assert report["swa_ext_version"] == swa_ext.__version__
    model = get_model("gpt-oss-120b")
    assert report["model"] == {"window": 128, "swa_layers": 18, "full_layers": 18, "kv_heads": 8, "head_dim": 64,
                               "v_head_dim": 64, "swa_kv_heads": 8, "swa_head_dim": 64, "swa_v_head_dim": 64,
                               "context_len": 131072, "full_bytes_per_token": model.full_bytes_per_token,
                               "swa_bytes_per_token": model.swa_bytes_per_token, "parent_page_k": 1,
                               "parent_small_side": "full", "parent_padding": 0.0, "sglang_hybrid": True, "sglang_source": model.sglang_source}
    assert report["notes"] == []
    assert model.full_bytes_per_token == 2 * 18 * 8 * 64 * 2
    # Every metric and the sweep are described.
    assert set(report["rows"]) == {*simulator.PolicyResult.SUMMARY_KEYS, "swa_ratio_sweep"}
    assert all(len(text.split()) >= 3 for text in report["rows"].values())
    vs = report["conclusion"]["swa_ext_vs_sglang"]
    assert vs["swa_ext"]["swa_ratio"] == 0.4 and vs["sglang"]["swa_ratio"] == 0.8
    assert vs["ratio_step"]["column"] == "tail"  # tail is at swa_ext's ratio already
    config = report["config"]
    assert config["model"] == "gpt-oss-120b" and config["trace"] == "mooncake_small.jsonl"
    assert config["page_size"] == 16 and config["kv_memory_gib"] == 1.0
    assert config["swa_ratio"] == {"full": 1.0, "evict": 0.4, "tail": 0.4, "sglang": 0.8, "swa_ext": 0.4,
                                   "sglang_unified": None, "swa_ext_shared": None}
    assert config["eviction_interval"] == 128 and config["max_running_requests"] is None
    assert config["reserved_decode_tokens"] == simulator.DEFAULT_RESERVED_DECODE_TOKENS
    assert config["requests"] == config["trace_requests"] == 24
    assert list(report["policies"]) == list(simulator.COLUMNS)
    for metrics in report["policies"].values():
        assert list(metrics) == list(simulator.PolicyResult.SUMMARY_KEYS)


def test_table_columns_stay_apart():
    # A slow replay of short steps makes the step counts longer than a column of
    # twelve; every row still splits into its cells.
    scenario = plan_scenario(load_trace(AZURE_SMALL), get_model("gpt-oss-20b"), page_size=16, kv_memory_gib=2.0,
                             time_scale=1000.0, step_ms=1e-5)
    results = simulator.run(scenario, swa_ratio=0.5)
    assert results["full"].steps > 10**12
    table = simulator.format_table(scenario, results).splitlines()
    header = table.index("") + 1
    assert table[header].split() == list(simulator.COLUMNS)
    rows = table[header + 1:]
    assert [row.split()[0] for row in rows] == list(simulator.PolicyResult.SUMMARY_KEYS)
    assert all(len(row.split()) == 1 + len(simulator.COLUMNS) for row in rows)


def test_named_models():
    models = load_models()
    for name in ("gpt-oss-20b", "gpt-oss-120b", "gemma-2-27b", "gemma-3-27b", "mistral-7b-v0.1"):
        assert name in models
    oss = models["gpt-oss-20b"]
    assert oss.full_bytes_per_token == 2 * 12 * 8 * 64 * 2 == oss.swa_bytes_per_token
    assert models["mistral-7b-v0.1"].full_bytes_per_token == 0
    with pytest.raises(KeyError, match="unknown model 'no-such-model'; known: .*mimo-v2-flash"):
        get_model("no-such-model")


# The models SGLang 0.5.23 builds hybrid, as its code reads their published configs:
# configs/model_config.py get_hybrid_layer_ids (which layers are full and which SWA),
# get_num_kv_heads / get_swa_num_kv_heads and head_dim, v_head_dim, swa_head_dim,
# swa_v_head_dim (each side's KV rows), the window its decode node evicts with
# (Llama 4: its attention chunk); bf16 KV of K and V of every layer of a side.
# (name, full layers, SWA layers, full KV heads, K and V head dims, SWA KV heads, K and V
# head dims, window, full and SWA KiB a token)
SGLANG_HYBRID = [
    ("gpt-oss-20b", 12, 12, 8, 64, 64, 8, 64, 64, 128, 24, 24),
    ("gpt-oss-120b", 18, 18, 8, 64, 64, 8, 64, 64, 128, 36, 36),
    ("llama-4-scout", 12, 36, 8, 128, 128, 8, 128, 128, 8192, 48, 144),
    ("mimo-v2-flash", 8, 40, 4, 192, 128, 8, 192, 128, 128, 20, 200),
    ("step-3.5-flash", 12, 33, 8, 128, 128, 8, 128, 128, 512, 48, 132),
]


@pytest.mark.parametrize("facts", SGLANG_HYBRID, ids=[f[0] for f in SGLANG_HYBRID])
def test_models_sglang_serves_hybrid(facts):
    name, full, swa, kv, hd, vhd, swa_kv, swa_hd, swa_vhd, window, full_kib, swa_kib = facts
    m = get_model(name)
    assert (m.full_layers, m.swa_layers, m.kv_heads, m.head_dim, m.v_head_dim) == (full, swa, kv, hd, vhd)
    assert (m.swa_kv_heads, m.swa_head_dim, m.swa_v_head_dim, m.window) == (swa_kv, swa_hd, swa_vhd, window)
    assert (m.full_bytes_per_token, m.swa_bytes_per_token) == (full_kib * 1024, swa_kib * 1024)
    assert m.sglang_hybrid and "is_hybrid_swa_model" in m.sglang_source


@pytest.mark.parametrize("name", ["gemma-2-27b", "gemma-3-27b"])
def test_gemma_is_marked_not_served_hybrid_by_sglang(name, tmp_path, capsys):
    """SGLang 0.5.23 forces disable_hybrid_swa_memory for Gemma 2 and 3: wherever a Gemma
    run shows SGLang columns, the table, the conclusion and the JSON say they are a what-if."""
    from swa_ext import cli

    m = get_model(name)
    assert not m.sglang_hybrid and "gemma2_gemma3.py" in m.sglang_source
    out_json = tmp_path / "r.json"
    assert cli.main(["simulate", "--model", name, "--trace", str(AZURE_SMALL), "--kv-memory-gib", "4",
                     "--policy", "tail", "--policy", "sglang", "--policy", "swa_ext", "--swa-ratio", "0.5",
                     "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    caveat = f"{name} is not served hybrid by SGLang 0.5.23"
    assert f"note: {caveat}" in out and f"not served hybrid: {caveat}" in out
    assert "sglang, swa_ext are what SGLang would do if it did" in out
    report = json.loads(out_json.read_text())
    assert report["model"]["sglang_hybrid"] is False and report["notes"][0].startswith(caveat)
    # Without an SGLang column there is nothing to mark.
    scenario = plan_scenario(load_trace(AZURE_SMALL), m, kv_memory_gib=4.0)
    assert simulator.notes(scenario, simulator.run(scenario, ("tail",), swa_ratio=0.5)) == []


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
    # As a spreadsheet saves it: a byte-order mark and CRLF line ends.
    spreadsheet = tmp_path / "spreadsheet.csv"
    spreadsheet.write_bytes(b"\xef\xbb\xbfTIMESTAMP,ContextTokens,GeneratedTokens\r\n2.5,10,3\r\n1.0,20,4\r\n")
    assert load_trace(spreadsheet) == load_trace(numeric)
    assert len(load_trace(limit=10)) == 10  # the bundled default
    long_prompts = load_trace(MOONCAKE_LONG)
    assert len(long_prompts) == 2000


@pytest.mark.parametrize(
    "name, text",
    [
        ("missing_column.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:00:00,5\n"),
        ("bad_count.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,five,3\n"),
        ("bad_time.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,3\n"),
        ("negative.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,-5,3\n"),
        ("negative_time.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n-1.0,5,3\n"),
        ("infinite_time.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\ninf,5,3\n"),
        ("empty.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"),
        ("not_json.jsonl", '{"timestamp": 1, "input_length": 5\n'),
        ("missing_key.jsonl", '{"timestamp": 1, "input_length": 5}\n'),
        ("bad_time.jsonl", '{"timestamp": "x", "input_length": 5, "output_length": 2}\n'),
        ("negative_time.jsonl", '{"timestamp": -3, "input_length": 5, "output_length": 2}\n'),
        ("nan_time.jsonl", '{"timestamp": NaN, "input_length": 5, "output_length": 2}\n'),
        ("bool_length.jsonl", '{"timestamp": 1, "input_length": true, "output_length": 2}\n'),
        ("float_length.jsonl", '{"timestamp": 1, "input_length": 5, "output_length": 2.5}\n'),
        ("string_length.jsonl", '{"timestamp": 1, "input_length": "5", "output_length": 2}\n'),
    ],
)
def test_malformed_traces(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceError, match=name):
        load_trace(path)


def test_missing_trace(tmp_path):
    with pytest.raises(TraceError, match="no such trace"):
        load_trace(tmp_path / "absent.csv")
    with pytest.raises(TraceError, match="empty"):
        load_trace("")


@pytest.mark.parametrize("interval", [1, 8, 128])
def test_eviction_interval_bounds_the_swa_a_request_holds(interval):
    """A request holds up to the interval's worth of dead SWA KV beyond its window, and
    no more; at interval 1 the bound is a window and two pages."""
    scenario = plan_scenario(load_trace(AZURE_SMALL), get_model("gpt-oss-20b"), page_size=16, kv_memory_gib=4.0,
                             eviction_interval=interval)
    results = {p: run_recorded(scenario, p) for p in ("evict", "tail")}
    check_invariants(scenario, results)
    held = results["tail"][0].max_swa_pages_per_request  # evict holds a whole prompt until its first eviction
    assert held <= simulator.tail_swa_pages_bound(128, 16, interval)
    if interval > 16:
        # More than eviction every step would allow: the interval is modelled.
        assert held > simulator.tail_swa_pages_bound(128, 16, 1)
    assert simulator.tail_swa_pages_bound(128, 16, 1) == 128 // 16 + 2
