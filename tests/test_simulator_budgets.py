"""The simulator's one-budget columns: sglang_unified (SGLang 0.5.23's byte arena, its
fit rule, holes and compaction blocked while transfers are in flight) and
swa_ext_shared (swa_ext's shared mode); the shifted-mix trace."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from swa_ext import simulator, traces
from swa_ext.models import get_model
from swa_ext.simulator import Arena, plan_scenario
from swa_ext.traces import Request, load_trace

DATA = Path(__file__).with_name("data")
AZURE_SMALL = DATA / "azure_small.csv"
GPT_OSS = get_model("gpt-oss-20b")
PAGE_BYTES = GPT_OSS.full_bytes_per_token * 64  # a page of either kind at page 64


def test_arena_prices_both_sides_in_bytes():
    """An allocation fits when full pages x full page bytes + SWA pages x SWA page bytes
    fit the gap, whatever the split between the sides."""
    equal = Arena(10, 1, 1, 10, 10)
    assert equal.fits(6, 4, compacted=False) and equal.fits(0, 10, compacted=False)
    assert not equal.fits(6, 5, compacted=False) and not equal.fits(11, 0, compacted=True)
    unequal = Arena(10, 2, 1, 5, 10)  # a full page twice an SWA page's bytes
    assert unequal.fits(3, 4, compacted=False) and unequal.fits(5, 0, compacted=False)
    assert not unequal.fits(3, 5, compacted=False) and not unequal.fits(4, 3, compacted=False)
    assert not Arena(100, 1, 1, 4, 100).fits(5, 0, compacted=True)  # the side's page ids run out first


def test_arena_holes_serve_their_own_side_until_compaction():
    arena = Arena(10, 1, 1, 10, 10)
    arena.take(5, 5)
    arena.free(2, 0)  # two holes on the full side; the gap stays closed
    assert arena.gap() == 0 and arena.live(0) == 3
    assert arena.fits(2, 0, compacted=False) and not arena.fits(3, 0, compacted=False)
    assert not arena.fits(0, 1, compacted=False)  # the SWA side cannot use the full side's holes
    assert arena.fits(0, 2, compacted=True) and not arena.fits(0, 3, compacted=True)
    assert not arena.ensure(0, 1, moves_allowed=False)
    assert (arena.extent, arena.holes, arena.compactions) == ([5, 5], [2, 0], 0)  # refused: nothing moved
    assert arena.ensure(0, 1, moves_allowed=True)
    assert (arena.extent, arena.holes, arena.compactions) == ([3, 5], [0, 0], 1)
    arena.take(0, 2)
    assert arena.gap() == 0 and arena.extent == [3, 7]
    arena.free(1, 1)
    arena.take(1, 1)  # from the holes: the gap stays as it was
    assert arena.extent == [3, 7] and arena.holes == [0, 0]
    with pytest.raises(AssertionError, match="overdrawn"):
        arena.take(1, 0)


def _node(kv_pages: int, requests: list[Request], reserve: int = 0, page_size: int = 64):
    scenario = plan_scenario(requests, GPT_OSS, page_size=page_size, kv_memory_gib=kv_pages * PAGE_BYTES / simulator.GIB,
                             reserved_decode_tokens=reserve)
    config = simulator.unified_config(scenario)
    return simulator.UnifiedDecodeNode(scenario, config)


def test_unified_arena_is_sglangs_pools_less_the_sink():
    """The arena holds the bytes of the two pools SGLang sizes at its ratio 0.8 (20 pages of
    memory: 11 full and 8 SWA pages), less the sink page at its low end; at page size 1
    SGLang's decode node preallocates whole prompts on both sides."""
    node = _node(20, [Request(0, 0.0, 100, 10)])
    assert node.arena.empty_gap == 18 * PAGE_BYTES
    assert node.config.size_full == node.config.size_swa == 18 * 64
    assert node.config.swa_ratio is None and node.config.budget == simulator.ARENA
    assert _node(20 * 64, [Request(0, 0.0, 100, 10)], page_size=1).config.policy == "evict"
    assert node.config.policy == "tail"


def test_unified_arena_prices_each_side_at_its_entry():
    """Unequal entries (MiMo-V2-Flash: 20 KiB full, 200 KiB SWA a token): the sink is one
    page of the larger entry, each side addresses the arena's bytes over its own page (the
    SWA side no more than the full side's page ids), and the gap is the full side's top
    less the sink."""
    mimo = get_model("mimo-v2-flash")
    assert simulator.entry_bytes(mimo) == (20 * 1024, 200 * 1024) and simulator.parent_page_k(mimo) == 10
    scenario = plan_scenario([Request(0, 0.0, 100, 10)], mimo, page_size=64, kv_memory_gib=8.0)
    sized = simulator.sglang_config(scenario)
    total = sized.size_full * 20 * 1024 + sized.size_swa * 200 * 1024
    full_page, swa_page = 64 * 20 * 1024, 64 * 200 * 1024
    arena = simulator.arena_geometry(scenario)
    assert (arena.full_page_bytes, arena.swa_page_bytes) == (full_page, swa_page)
    assert arena.full_pages == total // full_page - 10  # its first 10 pages lie under the sink
    assert arena.swa_pages == total // swa_page - 1
    assert arena.gap_bytes == total // full_page * full_page - swa_page
    config = simulator.unified_config(scenario)
    assert (config.size_full, config.size_swa) == (arena.full_pages * 64, arena.swa_pages * 64)


def test_unified_compaction_is_blocked_while_transfers_are_in_flight():
    """Holes left by a released request serve the other side only after compaction, which
    waits until no preallocation of the step is in flight."""
    node = _node(40, [Request(0, 0.0, 576, 10), Request(1, 0.0, 300, 10)])
    node.arena = Arena(11 * PAGE_BYTES, PAGE_BYTES, PAGE_BYTES, 38, 38)  # 11 pages to share
    rows = [node.req_pool.alloc(1)[0]]
    node.in_flight = 0
    assert node._pre_alloc(rows[0], 576) is not None  # 9 full pages and the 2-page window tail
    assert node.arena.extent == [9, 2] and node.arena.gap() == 0 and node.in_flight == 1
    node.batch_req, node.seq_lens = [0], node.seq_lens.new_tensor([576])
    node.rows, node.evicted = node.rows.new_tensor([rows[0]]), node.evicted.new_tensor([576 - 128])
    node.target_lens = node.seq_lens.new_tensor([586])
    node._release(0)  # its pages become holes: 9 on the full side, 2 on the SWA side
    assert node.arena.holes == [9, 2] and node.arena.live(0) == node.arena.live(1) == 0
    rows.append(node.req_pool.alloc(1)[0])
    # 5 full pages (holes) and 3 SWA pages: 2 holes and no gap, so it needs a compaction.
    assert node._pre_alloc(rows[1], 300) is None  # a transfer is in flight: no compaction, refused
    assert node.arena.compactions == 0 and not bool(node.req_to_token[rows[1]].any())
    assert not node._fits(320, 192)  # admission prices it the same way
    node.in_flight = 0  # the next step, before its first preallocation
    assert node._fits(320, 192)
    assert node._pre_alloc(rows[1], 300) is not None
    assert node.arena.compactions == 1 and node.arena.extent == [5, 3] and node.arena.holes == [0, 0]


def test_sglang_prealloc_demand():
    """SGLang's decode-node demand: the full side asks for the request and the reserve of
    every active request; the SWA side for the request's own SWA tokens and the reserve
    capped by what the active windows can still grow; no window, no cap."""
    demand = simulator.sglang_prealloc_demand
    # 3 active requests, reserve 256, window 128: SWA room min(768, 3 x 128 - held).
    assert demand(128, 128 + 256, 128, 3, 256, 0) == (128 + 256 + 768, 128 + 384)
    assert demand(128, 128 + 256, 128, 3, 256, 64) == (128 + 256 + 768, 128 + 320)
    assert demand(128, 128 + 256, 128, 3, 256, 10**6) == (128 + 256 + 768, 128)
    assert demand(4096, 128 + 256, 128, 3, 256, 0) == (128 + 256 + 768, 128 + 768)
    assert demand(None, 128 + 256, 128 + 256, 3, 256, 10**6) == (128 + 256 + 768, 128 + 256 + 768)


def test_unified_admission_prices_the_reserve_of_every_active_request():
    """SGLang's prealloc_fits on the arena: the demand in pages, both sides against the gap
    (30 pages of memory: pools of 16 and 12 pages, 27 pages past the sink)."""
    node = _node(30, [Request(0, 0.0, 100, 10)], reserve=256)
    node.in_flight = 0
    assert node.arena.gap() == 27 * PAGE_BYTES

    def fits(n_active, swa_held):
        return node._fits(*simulator.sglang_prealloc_demand(128, 128 + 256, 128, n_active, 256, swa_held))

    # n running requests: full 2 + 4 + 4n pages, SWA 2 + min(4n, 2n) pages.
    assert fits(3, 0) and not fits(4, 0)  # 18 + 8 = 26, 22 + 10 = 32
    node.arena.take(0, 2)  # two SWA pages in use: two pages less of gap, two less to grow into
    assert fits(3, 128) and not fits(3, 0)  # 18 + 6 = 24 of 25; without the cap 18 + 8 = 26


def test_every_column_admits_by_sglangs_demand(monkeypatch):
    """One admission rule: every node, split, arena or shared, asks its ``_fits`` for
    exactly ``sglang_prealloc_demand``'s tokens; a rule of its own in any column fails this."""
    from swa_ext.simulator import node as node_module

    scenario = plan_scenario(load_trace(AZURE_SMALL), GPT_OSS, page_size=16, kv_memory_gib=0.5)
    asked, priced = [], []
    real = node_module.sglang_prealloc_demand

    def recorded(*args):
        asked.append(real(*args))
        return asked[-1]

    monkeypatch.setattr(node_module, "sglang_prealloc_demand", recorded)
    for node_type in (simulator.DecodeNode, simulator.UnifiedDecodeNode, simulator.SharedDecodeNode):
        monkeypatch.setattr(node_type, "_fits", lambda self, f, s, fits=node_type._fits: (priced.append((f, s)),
                                                                                           fits(self, f, s))[1])
    configs = [simulator.policy_config(scenario, p, 0.2) for p in simulator.POLICIES]
    configs += [simulator.sglang_config(scenario), simulator.unified_config(scenario),
                simulator.shared_config(scenario)]
    for config in configs:
        asked.clear(), priced.clear()
        simulator.simulate_config(scenario, config)
        assert priced and priced == asked, config.policy


def test_one_budget_pools_hold_the_same_kv_bytes_as_the_fixed_split():
    scenario = plan_scenario(load_trace(AZURE_SMALL), GPT_OSS, page_size=64, kv_memory_gib=40.0)
    memory = 40 * simulator.GIB
    shared = simulator.shared_config(scenario)
    assert shared.size_full == shared.size_swa and shared.swa_ratio is None and shared.budget == simulator.SHARED
    shared_bytes = shared.size_full * GPT_OSS.full_bytes_per_token
    assert memory - PAGE_BYTES < shared_bytes <= memory
    for ratio in simulator.SWA_RATIO_SWEEP:
        c = simulator.policy_config(scenario, "tail", ratio)
        fixed = c.size_full * GPT_OSS.full_bytes_per_token + c.size_swa * GPT_OSS.swa_bytes_per_token
        assert fixed <= shared_bytes < fixed + 3 * PAGE_BYTES, ratio
        # N = the full tokens + SWA tokens the fixed split has, give or take its page rounding.
        assert 0 <= shared.size_full - (c.size_full + c.size_swa) < 3 * 64
    arena = simulator.arena_geometry(scenario)
    assert memory - 4 * PAGE_BYTES < arena.gap_bytes <= memory - PAGE_BYTES


# Models whose full and SWA entries differ: (name, k = ceil(larger / smaller entry)).
UNEQUAL_ENTRIES = [("gemma-3-27b", 6), ("llama-4-scout", 3), ("mimo-v2-flash", 10), ("step-3.5-flash", 3)]


def _small_and_large(model):
    return sorted((model.full_bytes_per_token, model.swa_bytes_per_token))


@pytest.mark.parametrize("name, k", UNEQUAL_ENTRIES)
def test_shared_column_runs_on_parent_pages(name, k):
    """Entries that differ get parent pages of k = ceil(larger / smaller entry): k pages of
    the full side (the smaller entry of every such model) or one SWA page. The column is
    in the default run, and its node builds the real allocator at that k."""
    model = get_model(name)
    small, large = _small_and_large(model)
    assert simulator.parent_page_k(model) == k == -(-large // small)
    assert simulator.small_side(model) == "full"
    assert simulator.left_out_columns(model) == {} and simulator.default_columns(model) == simulator.COLUMNS
    scenario = plan_scenario(load_trace(AZURE_SMALL), model, page_size=64, kv_memory_gib=8.0)
    config = simulator.shared_config(scenario)
    assert (config.parent_k, config.small_side, config.budget) == (k, "full", simulator.SHARED)
    node = simulator.SharedDecodeNode(scenario, config)
    assert (node.allocator.parent_k, node.allocator.small_side) == (k, "full")
    result = node.run()
    assert result.completed == len(scenario.requests) - result.rejected > 0
    assert result.mean_running <= result.capacity_bound


@pytest.mark.parametrize("name, k", UNEQUAL_ENTRIES)
def test_shared_pool_is_the_kv_memory_in_parent_pages(name, k):
    """A parent is k full pages' bytes (an SWA page padded to them): the pool is the KV
    memory over those bytes, in whole parents; each side's size is what it holds alone,
    and one SWA page takes a whole parent, k full pages' worth, from the full side."""
    model = get_model(name)
    small, large = _small_and_large(model)
    ps, memory = 64, 8 * simulator.GIB
    scenario = plan_scenario(load_trace(AZURE_SMALL), model, page_size=ps, kv_memory_gib=8.0)
    config = simulator.shared_config(scenario)
    parent_bytes = ps * k * small
    parents = config.size_swa // ps
    assert memory - parent_bytes < parents * parent_bytes <= memory
    assert config.size_full == k * config.size_swa
    alloc = simulator.SharedDecodeNode(scenario, config).allocator
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (config.size_full, config.size_swa)
    alloc.swa_attn_allocator.alloc(ps)
    assert alloc.full_available_size() == config.size_full - k * ps
    alloc.full_attn_allocator.alloc(ps)  # binds a parent whose other k - 1 full pages wait for the full side
    assert alloc.swa_available_size() == config.size_swa - 2 * ps
    assert alloc.full_available_size() == config.size_full - k * ps - ps
    # The padding a parent holding an SWA page leaves.
    assert simulator.parent_padding(model) == pytest.approx((k * small - large) / (k * small))


@pytest.mark.parametrize("name", ["llama-4-scout", "step-3.5-flash"])
def test_shared_pages_in_use_never_hold_more_kv_than_the_memory(name):
    """The full and SWA pages the shared column holds at every step, at each side's own
    entry bytes, fit the KV memory: what a pool priced as if every page were the smaller
    entry's (k ignored) overdraws as soon as the SWA side holds pages. A load that fills
    the node (the long-prompt sample on 2 GiB)."""
    model = get_model(name)
    ps = 64
    scenario = plan_scenario(load_trace(DATA / "mooncake_small.jsonl"), model, page_size=ps, kv_memory_gib=2.0,
                             time_scale=0.01)
    result = simulator.simulate_config(scenario, simulator.shared_config(scenario))
    held = [f * ps * model.full_bytes_per_token + s * ps * model.swa_bytes_per_token
            for f, s in zip(result.timeline_full_pages, result.timeline_swa_pages)]
    assert result.completed > 0 and max(held) <= 2 * simulator.GIB
    # The node was full: the pages it held at its peak leave less than a request's room.
    assert max(held) > 1.5 * simulator.GIB


def test_report_states_the_parent_pages():
    """The model line and the JSON name k, the small side and a large-side parent's padding
    where k > 1; a model without both kinds of layer has no parent pages to state."""
    step = get_model("step-3.5-flash")
    k, padding = simulator.parent_page_k(step), simulator.parent_padding(step)
    scenario = plan_scenario(load_trace(AZURE_SMALL), step, page_size=64, kv_memory_gib=8.0)
    results = simulator.run(scenario, (simulator.SWA_EXT_SHARED,))
    line = simulator.format_table(scenario, results).splitlines()[0]
    assert f"parent page: {k} full pages or one SWA page, {padding:.1%} of it padding when SWA" in line
    facts = simulator.report(scenario, results)["model"]
    assert (facts["parent_page_k"], facts["parent_small_side"], facts["parent_padding"]) == (k, "full", padding)
    oss = plan_scenario(load_trace(AZURE_SMALL), GPT_OSS, page_size=64, kv_memory_gib=8.0)
    assert "parent page" not in simulator.format_table(oss, simulator.run(oss, (simulator.SWA_EXT_SHARED,)))
    mistral = plan_scenario(load_trace(AZURE_SMALL), get_model("mistral-7b-v0.1"), page_size=64, kv_memory_gib=8.0)
    facts = simulator.report(mistral, simulator.run(mistral, ("tail",), swa_ratio=0.5))["model"]
    assert facts["parent_page_k"] is facts["parent_small_side"] is facts["parent_padding"] is None


def test_one_budget_columns_need_both_kinds_of_layer(capsys):
    """A model without full-attention layers has no one budget to share: the default run
    leaves both columns out and says why, and asking for one is refused."""
    model = get_model("mistral-7b-v0.1")
    left_out = simulator.left_out_columns(model)
    assert set(left_out) == {simulator.SGLANG_UNIFIED, simulator.SWA_EXT_SHARED}
    assert all("no full-attention layers" in why for why in left_out.values())
    scenario = plan_scenario(load_trace(AZURE_SMALL), model, page_size=64, kv_memory_gib=8.0)
    with pytest.raises(simulator.SimulationError, match="'swa_ext_shared' column cannot run: .* no full-attention"):
        simulator.plan_runs(scenario, (simulator.SWA_EXT_SHARED,))
    from swa_ext import cli

    assert cli.main(["simulate", "--model", model.name, "--policy", "swa_ext_shared"]) == 2
    assert "no full-attention layers" in capsys.readouterr().err


def test_shared_column_runs_where_entries_match():
    assert simulator.parent_page_k(GPT_OSS) == 1 and simulator.left_out_columns(GPT_OSS) == {}
    assert simulator.default_columns(GPT_OSS) == simulator.COLUMNS


def test_one_budget_capacity_bound_is_bytes_over_bytes_held():
    scenario = plan_scenario(load_trace(AZURE_SMALL), GPT_OSS, page_size=64, kv_memory_gib=4.0)
    shared = simulator.shared_config(scenario)
    unified = simulator.unified_config(scenario)
    b_shared = simulator.capacity_bound(scenario, shared, scenario.requests)
    b_unified = simulator.capacity_bound(scenario, unified, scenario.requests)
    # Equal page bytes: the shared pool's pages against the arena's less its two sinks.
    assert b_unified == pytest.approx(b_shared * (shared.size_full // 64 - 1) / (shared.size_full // 64), rel=1e-3)
    best_split = max(simulator.capacity_bound(scenario, simulator.policy_config(scenario, "tail", r), scenario.requests)
                     for r in simulator.SWA_RATIO_SWEEP)
    assert b_shared > best_split


def test_unified_column_runs_every_request_and_its_pages_match_sglangs_pricing():
    """The node raises when swa_ext's allocator takes other pages than SGLang's pricing
    says; a run to the end means every allocation agreed, and the arena ends empty."""
    scenario = plan_scenario(load_trace(AZURE_SMALL), GPT_OSS, page_size=64, kv_memory_gib=0.5,
                             reserved_decode_tokens=0)
    node = simulator.UnifiedDecodeNode(scenario, simulator.unified_config(scenario))
    result = node.run()
    assert result.completed == len(scenario.requests) - result.rejected > 0
    assert node.arena.live(0) == node.arena.live(1) == 0
    assert result.mean_running <= result.capacity_bound


def test_shared_column_runs_on_the_shared_allocator():
    scenario = plan_scenario(load_trace(AZURE_SMALL), GPT_OSS, page_size=64, kv_memory_gib=0.5,
                             reserved_decode_tokens=0)
    results = simulator.run(scenario, (simulator.SWA_EXT_SHARED, simulator.SGLANG_UNIFIED, simulator.SWA_EXT),
                            sweep=(0.1, 0.3))
    shared = results[simulator.SWA_EXT_SHARED]
    assert shared.completed == len(scenario.requests) and shared.swa_ratio is None
    assert shared.mean_running <= shared.capacity_bound
    line = simulator.format_conclusion(scenario, results).splitlines()[0]
    assert line.startswith("conclusion: swa_ext_shared (one budget") and "sglang_unified's" in line
    assert f"swa_ext's {results[simulator.SWA_EXT].mean_running:.1f}" in line


def test_tuned_elsewhere_runs_swa_ext_here_at_the_other_traces_best_ratio():
    here = plan_scenario(load_trace(AZURE_SMALL), GPT_OSS, page_size=64, kv_memory_gib=0.5)
    there = replace(here, trace="other", requests=[replace(r, prompt_len=r.prompt_len * 8) for r in here.requests])
    results = simulator.run(here, (simulator.SWA_EXT,), sweep=(0.02, 0.3), tuned_on=there)
    elsewhere = results[simulator.TUNED_ELSEWHERE]
    best_there = simulator.run(there, (simulator.SWA_EXT,), sweep=(0.02, 0.3))[simulator.SWA_EXT].swa_ratio
    assert elsewhere.swa_ratio == best_there and elsewhere.tuned_on == "other"
    point = next(p for p in results[simulator.SWA_EXT].sweep if p["swa_ratio"] == best_there)
    if point["mean_running"] is not None:
        assert elsewhere.mean_running == point["mean_running"]


def test_the_shifted_mix_trace_is_what_its_builder_writes(tmp_path):
    built = traces.build_shifted_mix(tmp_path / "mix.csv")
    shipped = load_trace(traces.SHIFTED_MIX_TRACE)
    assert (tmp_path / "mix.csv").read_bytes() == traces.SHIFTED_MIX_TRACE.read_bytes()
    assert [(r.prompt_len, r.output_len) for r in shipped] == [(r.prompt_len, r.output_len) for r in built]
    # chat, then long context, then code, each from the start of its source, one after another.
    start = 0
    for source, count, stretch in traces.SHIFTED_MIX_SEGMENTS:
        segment, original = shipped[start:start + count], load_trace(source, count)
        assert [(r.prompt_len, r.output_len) for r in segment] == [(r.prompt_len, r.output_len) for r in original]
        span = segment[-1].arrival_s - segment[0].arrival_s
        assert span == pytest.approx((original[-1].arrival_s - original[0].arrival_s) * stretch, abs=1e-3)
        if start:
            assert segment[0].arrival_s > shipped[start - 1].arrival_s
        start += count
    assert start == len(shipped)
    means = [sum(r.prompt_len for r in shipped[a:b]) / (b - a) for a, b in ((0, 3000), (3000, 4000), (4000, 7000))]
    assert means[1] > 5 * max(means[0], means[2])  # the long-context segment


def test_the_traces_credit_their_sources():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for name in ("AzureLLMInferenceTrace_code.csv", "shifted_mix_trace.csv"):
        assert f"swa_ext/data/{name}" in readme
    assert readme.count("Azure Public Dataset, Microsoft") >= 1 and "LICENSE-Mooncake-traces.txt" in readme


def test_cli_tuned_on(tmp_path, capsys):
    from swa_ext import cli

    out_json = tmp_path / "r.json"
    args = ["simulate", "--trace", str(AZURE_SMALL), "--page-size", "16", "--kv-memory-gib", "2", "--policy", "swa_ext",
            "--policy", "swa_ext_shared", "--tuned-on", str(DATA / "mooncake_small.jsonl"), "--tuned-on-time-scale",
            "0.5", "--json", str(out_json)]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "run swa_ext on " in out and ", the best on mooncake_small.jsonl, swa_ext runs " in out
    report = json.loads(out_json.read_text())
    assert list(report["policies"]) == ["swa_ext", "swa_ext_shared", "swa_ext_tuned_elsewhere"]
    assert report["conclusion"]["one_budget"]["swa_ext_tuned_elsewhere"]["tuned_on"] == str(DATA / "mooncake_small.jsonl")
