"""The simulator's sglang and swa_ext columns and its conclusion: SGLang's own pool
sizing (ratio and request cap), swa_ext's lead over sglang split into ratio and
interval, the transfer line a total."""

from dataclasses import replace
from pathlib import Path

import pytest

import swa_ext
from swa_ext import simulator
from swa_ext.models import get_model
from swa_ext.simulator import plan_scenario
from swa_ext.traces import load_trace

DATA = Path(__file__).with_name("data")
AZURE_SMALL = DATA / "azure_small.csv"
MOONCAKE_SMALL = DATA / "mooncake_small.jsonl"
MOONCAKE_LONG = Path(swa_ext.__file__).with_name("data") / "mooncake_conversation_trace_2000.jsonl"


def test_sglang_swa_pool_sizing():
    """SGLang 0.5.23's compute_swa_request_cap for gpt-oss-20b at page 64: window, interval,
    a page of padding and a page of decode room per request, and on a decode node a window
    and a page for each of twice as many extra slots when the batch is 32 or fewer."""
    assert simulator.sglang_swa_request_cap(128, 64, 128) == 384
    assert simulator.sglang_swa_request_cap(128, 64, 1) == 257
    assert simulator.sglang_decode_extra_slots(32) == 64 and simulator.sglang_decode_extra_slots(33) == 0
    assert simulator.sglang_swa_pool_tokens(128, 64, 128, 100) == 384 * 100
    assert simulator.sglang_swa_pool_tokens(128, 64, 1, 10) == -(-(257 * 10 + 192 * 20) // 64) * 64
    scenario = plan_scenario(load_trace(AZURE_SMALL), get_model("gpt-oss-20b"), page_size=64, kv_memory_gib=4.0,
                             max_running_requests=10)
    model = scenario.model
    configs = {interval: simulator.sglang_config(scenario, interval) for interval in (1, 128)}
    for interval, config in configs.items():
        assert config.size_swa == simulator.sglang_swa_pool_tokens(128, 64, interval, 10)
        assert config.eviction_interval == interval and config.max_running == 10
        used = config.size_swa * model.swa_bytes_per_token + config.size_full * model.full_bytes_per_token
        assert used <= 4.0 * simulator.GIB < used + 64 * model.full_bytes_per_token
        result = simulator.simulate_config(scenario, config)
        assert result.max_running <= 10 and result.completed == len(scenario.requests)
    # Eviction every step shrinks the SWA pool SGLang sizes and gives the full pool the rest.
    assert configs[1].size_swa < configs[128].size_swa and configs[1].size_full > configs[128].size_full
    # Without a cap SGLang splits the memory at its fallback ratio.
    uncapped = plan_scenario(load_trace(AZURE_SMALL), get_model("gpt-oss-20b"), page_size=64, kv_memory_gib=4.0)
    assert simulator.sglang_config(uncapped) == simulator.policy_config(uncapped, "tail", 0.8)
    with pytest.raises(simulator.SimulationError, match="no full pool"):
        simulator.sglang_config(replace(scenario, max_running_requests=10**5))


def test_conclusion_splits_ratio_and_interval():
    """swa_ext against sglang, the difference split at tail (SGLang at its best ratio,
    what tuning SGLang alone gives), which is run for the split when not asked for."""
    scenario = plan_scenario(load_trace(MOONCAKE_LONG, 40), get_model("gpt-oss-20b"), kv_memory_gib=4.0,
                             time_scale=0.1)
    seen = []
    results = simulator.run(scenario, ("full", "sglang", "swa_ext"), sweep=(0.05, 0.1, 0.3),
                            on_run=lambda label, *_: seen.append(label))
    assert list(results) == ["full", "sglang", "swa_ext", "tail"] and seen[-1] == "tail"
    s, x, t = results["sglang"], results["swa_ext"], results["tail"]
    assert t.eviction_interval == 128 and x.eviction_interval == 1 and s.swa_ratio == 0.8
    assert x.sweep and t.sweep  # both at their best ratio of the sweep
    c = simulator.conclusion(scenario, results)["swa_ext_vs_sglang"]
    assert c["from_ratio"] == pytest.approx(t.mean_running - s.mean_running)
    assert c["from_interval"] == pytest.approx(x.mean_running - t.mean_running)
    assert c["from_ratio"] + c["from_interval"] == pytest.approx(x.mean_running - s.mean_running)
    assert x.mean_running > s.mean_running
    first = simulator.format_conclusion(scenario, results).splitlines()[0]
    assert first.startswith(f"fixed ratio: swa_ext (tail, SWA ratio {x.swa_ratio:g}, eviction every step) runs "
                            f"{x.mean_running:.1f} requests")
    assert f"sglang's {s.mean_running:.1f}" in first and "eviction every 128 tokens" in first
    assert f"SGLang at its best ratio {t.swa_ratio:g}: {t.mean_running:.1f})" in first
    # Each figure is one of a column of the table.
    assert f"waits {x.queue_wait_p50_s:.1f} s instead of {s.queue_wait_p50_s:.1f} s" in first
    assert simulator.format_table(scenario, results).splitlines()[3].split() == list(results)


def test_conclusion_with_a_running_request_cap():
    """With --max-running-requests both sglang and swa_ext take SGLang's request-cap sizing;
    the SWA pool swa_ext gets is the smaller one of interval 1, and all of the difference
    is the interval's."""
    scenario = plan_scenario(load_trace(MOONCAKE_LONG, 40), get_model("gpt-oss-20b"), kv_memory_gib=4.0,
                             time_scale=0.1, max_running_requests=24)
    results = simulator.run(scenario, ("full", "tail", "sglang", "swa_ext"), sweep=(0.05, 0.3))
    assert list(results) == ["full", "tail", "sglang", "swa_ext"]
    assert all(r.max_running <= 24 for r in results.values())
    s, x = results["sglang"], results["swa_ext"]
    assert s.pool_swa_pages * 64 == simulator.sglang_swa_pool_tokens(128, 64, 128, 24)
    assert x.pool_swa_pages * 64 == simulator.sglang_swa_pool_tokens(128, 64, 1, 24)
    assert x.pool_full_pages > s.pool_full_pages
    c = simulator.conclusion(scenario, results)["swa_ext_vs_sglang"]
    assert c["from_ratio"] == 0.0 and c["from_interval"] == pytest.approx(x.mean_running - s.mean_running)
    first = simulator.format_conclusion(scenario, results).splitlines()[0]
    assert "--max-running-requests 24" in first and "come from evicting every step" in first


def test_transfer_line_is_tails_total():
    scenario = plan_scenario(load_trace(MOONCAKE_SMALL), get_model("gpt-oss-20b"), page_size=16, kv_memory_gib=2.0)
    results = simulator.run(scenario, ("full", "tail"), swa_ratio=0.3)
    lines = simulator.format_conclusion(scenario, results).splitlines()
    assert len(lines) == 1 and lines[0].startswith("transfer: tail ")
    t, f = results["tail"], results["full"]
    assert t.transfer_gib < f.transfer_gib
    assert (f"{t.transfer_gib:.1f} GiB of KV in total over the {len(scenario.requests)} requests instead of "
            f"{f.transfer_gib:.1f} GiB") in lines[0]
    assert t.timeline_transfer_gib[-1] == t.transfer_gib  # the plot's last panel ends at the total


def test_plot_shows_every_column_legends_outside_and_the_transfer(tmp_path, monkeypatch):
    """Each column its own line in every panel (evict a wide band under tail, so neither
    hides the other), each bound its own legend entry, the legends beside the data, and a
    panel for the KV received."""
    import matplotlib.figure

    scenario = plan_scenario(load_trace(AZURE_SMALL), get_model("gpt-oss-20b"), page_size=16, kv_memory_gib=2.0)
    results = simulator.run(scenario, swa_ratio=0.3)
    drawn = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), save(fig, *a, **k)))
    simulator.plot(scenario, results, str(tmp_path / "p.png"))
    (fig,) = drawn
    axes = fig.axes
    assert len(axes) == 4 and "KV received" in axes[3].get_ylabel()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()  # the figure is closed: a canvas to measure it on
    for ax in axes:
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert all(any(name.startswith(label) for name in lines) for label in results), list(lines)
        assert ax.get_legend().get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1
    legend = [t.get_text() for t in axes[0].get_legend().get_texts()]
    assert all(f"{label}: bound of the mean" in " ".join(legend) for label in results)
    evict, tail = (next(line for line in axes[0].get_lines() if line.get_label().startswith(f"{label} (")) for label in
                   ("evict", "tail"))
    assert evict.get_linewidth() > tail.get_linewidth() and evict.get_zorder() < tail.get_zorder()
    assert axes[3].get_lines()[0].get_ydata()[-1] == pytest.approx(results["full"].transfer_gib)


def test_conclusion_at_a_pinned_ratio_names_it():
    scenario = plan_scenario(load_trace(MOONCAKE_SMALL), get_model("gpt-oss-20b"), page_size=16, kv_memory_gib=2.0)
    results = simulator.run(scenario, ("tail", "sglang", "swa_ext"), swa_ratio=0.3)
    first = simulator.format_conclusion(scenario, results).splitlines()[0]
    assert f"(tail, SGLang at ratio 0.3: {results['tail'].mean_running:.1f})" in first and "best" not in first
