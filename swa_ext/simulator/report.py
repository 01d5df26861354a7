"""What a comparison reports: the JSON document, the table and conclusion printed, and
the plot (matplotlib, imported when drawing)."""

from __future__ import annotations

from pathlib import Path

from .node import PolicyResult
from .runs import conclusion
from .scenario import GIB, POLICIES, Scenario

# What each row of the table and of the JSON's per-column metrics means.
ROW_DESCRIPTIONS = {
    "swa_ratio": "SWA pool tokens per full pool token (SGLang's --swa-full-tokens-ratio)",
    "pool_full_pages": "pages of the full-attention pool",
    "pool_swa_pages": "pages of the SWA pool",
    "rejected": "requests that cannot run even on an empty node of this column",
    "completed": "requests served to their last token",
    "retractions": "running requests pushed back to the queue when a decode step found no room",
    "retracted_tokens": "tokens those requests held, to be transferred or recomputed again",
    "retracted_gib": "the KV bytes of those tokens, GiB",
    "transfer_gib": "KV the prefill node sends to this node, GiB, resumed requests included",
    "max_running": "most requests decoding in one step",
    "mean_running": "requests decoding per step, on average over the run",
    "capacity_bound": "the highest mean_running the pools allow: pool pages over the pages a running request "
                      "holds at least (single steps can exceed it, the mean cannot)",
    "bound_reached": "mean_running / capacity_bound",
    "peak_full_pages": "most full pool pages in use at once",
    "peak_swa_pages": "most SWA pool pages in use at once",
    "max_swa_pages_per_request": "most SWA pages one request held",
    "queue_wait_p50_steps": "median wait of a request in the queue, decode steps",
    "queue_wait_p50_s": "the same in simulated seconds (steps x step time)",
    "queue_wait_p99_steps": "99th percentile of the wait, decode steps",
    "queue_wait_p99_s": "the same in simulated seconds",
    "steps": "decode steps from the first arrival to the last completion",
    "alloc_us_per_step_median": "median wall time of the allocator calls of one step, microseconds",
    "swa_ratio_sweep": "the ratios tried for this column: mean_running null marks a ratio not run because its "
                       "capacity_bound is below the best mean_running already found, so it cannot win",
}
SWEEP_NOTE = ("not run: a ratio whose capacity bound is below the best mean_running found so far "
              "cannot win (no run's mean exceeds its bound), so it is skipped")


def report(scenario: Scenario, results: dict[str, PolicyResult], intervals: dict | None = None) -> dict:
    """The JSON report: the swa_ext version, the settings and model facts that tell two
    runs apart, each column's metrics, what each metric means and the conclusion."""
    from swa_ext._version import __version__

    m = scenario.model
    return {
        "swa_ext_version": __version__,
        "config": {
            "model": m.name,
            "trace": scenario.trace,
            "page_size": scenario.page_size,
            "kv_memory_gib": scenario.kv_memory_gib,
            "swa_ratio": {label: r.swa_ratio for label, r in results.items()},
            "eviction_interval": scenario.eviction_interval,
            "time_scale": scenario.time_scale,
            "step_ms": scenario.step_ms,
            "reserved_decode_tokens": scenario.reserved_decode_tokens,
            "trace_requests": scenario.trace_requests,
            "requests": len(scenario.requests),
            "skipped_over_context": scenario.skipped_over_context,
            "skipped_no_output": scenario.skipped_no_output,
        },
        "model": {
            "window": m.window,
            "swa_layers": m.swa_layers,
            "full_layers": m.full_layers,
            "kv_heads": m.kv_heads,
            "head_dim": m.head_dim,
            "context_len": m.context_len,
            "full_bytes_per_token": m.full_bytes_per_token,
            "swa_bytes_per_token": m.swa_bytes_per_token,
        },
        "policies": {label: r.summary() for label, r in results.items()},
        "rows": ROW_DESCRIPTIONS,
        "conclusion": conclusion(results),
        "eviction_interval_comparison": intervals,
    }


_FORMATS = {"swa_ratio": ".3f", "retracted_gib": ".2f", "transfer_gib": ".1f", "bound_reached": ".2f",
            "queue_wait_p50_s": ".2f", "queue_wait_p99_s": ".2f"}


def _cell(key: str, value) -> str:
    if isinstance(value, float):
        return format(value, _FORMATS.get(key, ".1f"))
    return str(value)


def _sweep_cell(point: dict) -> str:
    if point["mean_running"] is None:
        text = f"{point['swa_ratio']:g}: not run (bound {point['capacity_bound']:.1f})"
    else:
        text = f"{point['swa_ratio']:g}: {point['mean_running']:.1f}"
    return text + (f" ({point['rejected']} rejected)" if point["rejected"] else "")


def format_table(scenario: Scenario, results: dict[str, PolicyResult]) -> str:
    m = scenario.model
    lines = [
        f"model {m.name}: window {m.window}, {m.swa_layers} SWA + {m.full_layers} full layers, "
        f"{m.kv_heads} KV heads x {m.head_dim}; page {scenario.page_size}; KV memory {scenario.kv_memory_gib:g} GiB",
        f"trace {scenario.trace}: {len(scenario.requests)} requests replayed "
        f"({scenario.skipped_over_context} over context and {scenario.skipped_no_output} without output skipped); "
        f"step {scenario.step_ms:g} ms, time scale {scenario.time_scale:g}, "
        f"{scenario.reserved_decode_tokens} reserved decode tokens, eviction interval {scenario.eviction_interval}",
    ]
    labels = list(results)
    keys = PolicyResult.SUMMARY_KEYS
    cells = {label: [_cell(k, getattr(results[label], k)) for k in keys] for label in labels}
    name_w = max(len(k) for k in keys)
    # Columns as wide as their widest cell, so they never run together.
    col_w = {label: 2 + max(len(label), *(len(c) for c in cells[label])) for label in labels}
    lines.append("")
    lines.append(" " * name_w + "".join(f"{label:>{col_w[label]}}" for label in labels))
    for row, key in enumerate(keys):
        lines.append(f"{key:<{name_w}}" + "".join(f"{cells[label][row]:>{col_w[label]}}" for label in labels))
    skipped = False
    for label, r in results.items():
        if r.sweep:
            points = ", ".join(_sweep_cell(p) for p in r.sweep)
            lines.append(f"\n{label} SWA ratio sweep (mean_running): {points}; best {r.swa_ratio:g}")
            skipped |= any(p["mean_running"] is None for p in r.sweep)
    if skipped:
        lines.append(f"({SWEEP_NOTE}.)")
    return "\n".join(lines)


def format_conclusion(scenario: Scenario, results: dict[str, PolicyResult], intervals: dict | None) -> str:
    """The result in a few lines: the best column against ``full`` and what interval 1 buys."""
    lines = []
    c = conclusion(results)
    if c is not None:
        times = f"{c['concurrency_vs_full']:.2f} times" if c["concurrency_vs_full"] else "against"
        lines.append(
            f"conclusion: {c['best']} at SWA ratio {c['swa_ratio']:g} runs {c['mean_running']:.1f} requests at once "
            f"on average, {times} full's {c['full_mean_running']:.1f}; it receives {c['transfer_gib']:.1f} GiB of KV "
            f"instead of {c['full_transfer_gib']:.1f} ({c['transfer_saved']:.0%} less), and a request waits "
            f"{c['queue_wait_p50_s']:.1f} s instead of {c['full_queue_wait_p50_s']:.1f} s (median). "
            f"In SGLang: {c['sglang_flag']}.")
    if intervals is not None:
        if "not_run" in intervals:
            lines.append(f"eviction interval: not compared ({intervals['not_run']})")
        else:
            (one, a), (other, b) = intervals["intervals"].items()
            lines.append(
                f"eviction interval {one} instead of {other} ({intervals['policy']}, SWA pool sized as SGLang sizes "
                f"it for {intervals['max_running_requests']} running requests): {a['swa_tokens_per_request']} "
                f"instead of {b['swa_tokens_per_request']} SWA tokens a request ({a['swa_pages_per_request']:.2f} "
                f"instead of {b['swa_pages_per_request']:.2f} pages), a full pool of {a['pool_full_pages']} instead of "
                f"{b['pool_full_pages']} pages, mean_running {a['mean_running']:.1f} instead of "
                f"{b['mean_running']:.1f}, median wait {a['queue_wait_p50_s']:.1f} s instead of "
                f"{b['queue_wait_p50_s']:.1f} s.")
    return "\n".join(lines)


def plot(scenario: Scenario, results: dict[str, PolicyResult], path: str) -> None:
    """Running requests (with each policy's mean and capacity bound), the full pool in
    use (GiB) and each SWA pool's use as a share of its size, over simulated time, for
    the columns without a pinned default ratio. The format follows ``path``'s suffix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    ps = scenario.page_size
    full_page_gib = scenario.model.full_bytes_per_token * ps / GIB
    swa_page_gib = scenario.model.swa_bytes_per_token * ps / GIB
    shown = {label: r for label, r in results.items() if label in POLICIES}
    # Each policy its own colour and dash, and evict drawn above tail, so neither hides the other.
    styles = {"full": ("tab:gray", "-", 2), "tail": ("tab:blue", "-", 2), "evict": ("tab:orange", (0, (3, 3)), 3)}
    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    for label, r in shown.items():
        color, dash, z = styles[label]
        style = {"color": color, "ls": dash, "lw": 1.0, "zorder": z}
        t = [s * scenario.step_ms / 1000.0 for s in r.timeline_step]
        axes[0].plot(t, r.timeline_running, label=f"{label} (SWA ratio {r.swa_ratio:g}, mean {r.mean_running:.0f})",
                     **style)
        axes[0].axhline(r.capacity_bound, color=color, ls=":", lw=1.2)
        axes[1].plot(t, [p * full_page_gib for p in r.timeline_full_pages], **style)
        axes[1].axhline(r.pool_full_pages * full_page_gib, color=color, ls=":", lw=0.8)
        pool = max(r.pool_swa_pages, 1)
        axes[2].plot(t, [100.0 * p / pool for p in r.timeline_swa_pages],
                     label=f"{label}: pool {r.pool_swa_pages * swa_page_gib:.1f} GiB", **style)
    bound = Line2D([], [], color="black", ls=":", lw=1.2)
    handles, labels = axes[0].get_legend_handles_labels()
    axes[0].legend(handles + [bound], labels + ["dotted: bound of the mean (one step may be above it)"],
                   loc="upper right", fontsize="small")
    axes[1].legend([Line2D([], [], color="black", ls=":", lw=0.8)], ["dotted: pool size"], loc="upper right",
                   fontsize="small")
    axes[2].legend(loc="upper right", fontsize="small")
    axes[0].set_ylabel("running requests")
    axes[1].set_ylabel("full pool in use (GiB)")
    axes[2].set_ylabel("SWA pool in use\n(% of each policy's pool)")
    axes[2].set_xlabel("simulated time (s)")
    ratios = ", ".join(f"{label} {r.swa_ratio:g}" for label, r in shown.items())
    title = (f"{scenario.model.name} on {Path(scenario.trace).name}, {len(scenario.requests)} requests, "
             f"{scenario.kv_memory_gib:g} GiB KV, page {ps}, time scale {scenario.time_scale:g}\nSWA ratio: {ratios}")
    if _coincide(shown.get("evict"), shown.get("tail")):
        title += ("\nevict and tail coincide: evict holds a whole prompt on the SWA pool only until its first\n"
                  "eviction, which these prompts leave room for, so both pick the same ratio and run alike")
    axes[0].set_title(title, fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _coincide(a: PolicyResult | None, b: PolicyResult | None) -> bool:
    """Whether two runs draw nearly the same lines: same ratio, mean concurrency within 1%."""
    if a is None or b is None or a.swa_ratio != b.swa_ratio:
        return False
    return abs(a.mean_running - b.mean_running) <= 0.01 * max(a.mean_running, b.mean_running)
