"""What a comparison reports: the JSON document, the table and conclusion printed, and
the plot (matplotlib, imported when drawing)."""

from __future__ import annotations

from pathlib import Path

from .node import PolicyResult
from .runs import conclusion, default_columns, left_out_columns
from .scenario import (GIB, IN_SGLANG, SGLANG, SGLANG_UNIFIED, SWA_EXT, SWA_EXT_SHARED, TUNED_ELSEWHERE, Scenario,
                       parent_padding, parent_page_k, shared_refusal, small_side)

# What each row of the table and of the JSON's per-column metrics means.
ROW_DESCRIPTIONS = {
    "swa_ratio": "SWA pool tokens per full pool token (SGLang's --swa-full-tokens-ratio); null (-): one budget "
                 "for both, no ratio (sglang_unified, swa_ext_shared)",
    "eviction_interval": "out-of-window SWA KV is freed once this many tokens have left the window "
                         "(SGLang's SGLANG_SWA_EVICTION_INTERVAL; full never frees it)",
    "pool_full_pages": "pages of the full-attention pool (sglang_unified: the most its full side can take, the "
                       "whole arena; swa_ext_shared: the same, its parent pages times the full pages a parent holds)",
    "pool_swa_pages": "pages of the SWA pool (the one-budget columns: the most the SWA side can take)",
    "rejected": "requests that cannot run even on an empty node of this column",
    "completed": "requests served to their last token",
    "retractions": "running requests pushed back to the queue when a decode step found no room",
    "retracted_tokens": "tokens those requests held, to be transferred or recomputed again",
    "retracted_gib": "the KV bytes of those tokens, GiB",
    "transfer_gib": "KV the prefill node sends to this node, GiB, in total over the run, resumed requests included",
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


def _not_hybrid(scenario: Scenario, results: dict[str, PolicyResult]) -> str | None:
    """The caveat of a model SGLang 0.5.23 does not serve hybrid, where its SGLang columns run."""
    m = scenario.model
    shown = [label for label in results if label in IN_SGLANG]
    if m.sglang_hybrid or not shown:
        return None
    return (f"{m.name} is not served hybrid by SGLang 0.5.23 ({m.sglang_source}): {', '.join(shown)} are what SGLang "
            f"would do if it did, not what it runs")


def notes(scenario: Scenario, results: dict[str, PolicyResult]) -> list[str]:
    """What the table does not say by itself: the caveat of a model SGLang does not serve
    hybrid, and, in a run of every column, those left out for this model, with why."""
    caveat = _not_hybrid(scenario, results)
    left_out = (left_out_columns(scenario.model) if set(default_columns(scenario.model)) <= set(results) else {})
    return ([caveat] if caveat else []) + [f"{label} left out: {why}" for label, why in left_out.items()]


def _parent_pages(m) -> dict:
    """The shared mode's parent pages for the model (None without both kinds of layer): k,
    the side whose k pages a parent holds, and the share of a parent a page of the other
    side leaves unused."""
    if shared_refusal(m) is not None:
        return {"parent_page_k": None, "parent_small_side": None, "parent_padding": None}
    return {"parent_page_k": parent_page_k(m), "parent_small_side": small_side(m), "parent_padding": parent_padding(m)}


_SIDE_NAMES = {"full": "full", "swa": "SWA"}


def _parent_pages_text(m) -> str:
    """The model line's parent pages, where they differ from a page of either kind (k > 1)."""
    facts = _parent_pages(m)
    if (facts["parent_page_k"] or 1) == 1:
        return ""
    small = facts["parent_small_side"]
    large = _SIDE_NAMES["swa" if small == "full" else "full"]
    return (f"; shared mode's parent page: {facts['parent_page_k']} {_SIDE_NAMES[small]} pages or one {large} page, "
            f"{facts['parent_padding']:.1%} of it padding when {large}")


def report(scenario: Scenario, results: dict[str, PolicyResult]) -> dict:
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
            "max_running_requests": scenario.max_running_requests,
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
            "v_head_dim": m.v_head_dim,
            "swa_kv_heads": m.swa_kv_heads,
            "swa_head_dim": m.swa_head_dim,
            "swa_v_head_dim": m.swa_v_head_dim,
            "context_len": m.context_len,
            "full_bytes_per_token": m.full_bytes_per_token,
            "swa_bytes_per_token": m.swa_bytes_per_token,
            **_parent_pages(m),
            "sglang_hybrid": m.sglang_hybrid,
            "sglang_source": m.sglang_source,
        },
        "notes": notes(scenario, results),
        "policies": {label: r.summary() for label, r in results.items()},
        "rows": ROW_DESCRIPTIONS,
        "conclusion": conclusion(scenario, results),
    }


_FORMATS = {"swa_ratio": ".3f", "retracted_gib": ".2f", "transfer_gib": ".1f", "bound_reached": ".2f",
            "queue_wait_p50_s": ".2f", "queue_wait_p99_s": ".2f"}


def _cell(key: str, value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, _FORMATS.get(key, ".1f"))
    return str(value)


def _sweep_cell(point: dict) -> str:
    if point["mean_running"] is None:
        text = f"{point['swa_ratio']:g}: not run (bound {point['capacity_bound']:.1f})"
    else:
        text = f"{point['swa_ratio']:g}: {point['mean_running']:.1f}"
    return text + (f" ({point['rejected']} rejected)" if point["rejected"] else "")


def _kv_sides(m) -> str:
    """Each side's layers, KV rows and KV bytes a token."""
    sides = (("full", m.full_layers, m.kv_heads, m.head_dim, m.v_head_dim, m.full_bytes_per_token),
             ("SWA", m.swa_layers, m.swa_kv_heads, m.swa_head_dim, m.swa_v_head_dim, m.swa_bytes_per_token))
    return "; ".join(f"{side} layers {layers} x {heads} KV heads x {k if k == v else f'(K {k} + V {v})'}, "
                     f"{per_token / 1024:g} KiB a token" for side, layers, heads, k, v, per_token in sides)


def format_table(scenario: Scenario, results: dict[str, PolicyResult]) -> str:
    m = scenario.model
    lines = [
        f"model {m.name}: window {m.window}; {_kv_sides(m)}{_parent_pages_text(m)}; page {scenario.page_size}; "
        f"KV memory {scenario.kv_memory_gib:g} GiB",
        f"trace {scenario.trace}: {len(scenario.requests)} requests replayed "
        f"({scenario.skipped_over_context} over context and {scenario.skipped_no_output} without output skipped); "
        f"step {scenario.step_ms:g} ms, time scale {scenario.time_scale:g}, "
        f"{scenario.reserved_decode_tokens} reserved decode tokens, eviction interval {scenario.eviction_interval} "
        f"(swa_ext: 1), "
        + ("no cap on running requests" if scenario.max_running_requests is None
           else f"at most {scenario.max_running_requests} running requests"),
        *(f"note: {line}" for line in notes(scenario, results)),
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


def _every(interval: int) -> str:
    return "every step" if interval == 1 else f"every {interval} tokens"


def _sglang_sizing(scenario: Scenario, r: PolicyResult) -> str:
    if scenario.max_running_requests is not None:
        return f"SWA pool from --max-running-requests {scenario.max_running_requests} ({r.pool_swa_pages} pages)"
    return f"SWA ratio {r.swa_ratio:g}, its fallback"


def format_conclusion(scenario: Scenario, results: dict[str, PolicyResult]) -> str:
    """The result in a few lines: swa_ext against SGLang as it ships and where the
    difference comes from, what window-tail preallocation saves, swa_ext against full."""
    c = conclusion(scenario, results)
    if c is None:
        return ""
    caveat = _not_hybrid(scenario, results)
    lines = [f"not served hybrid: {caveat}"] if caveat else []
    if "one_budget" in c:
        lines.append(_one_budget_line(c["one_budget"]))
    if "swa_ext_vs_sglang" in c:
        v = c["swa_ext_vs_sglang"]
        x, s = v["swa_ext"], v["sglang"]
        times = f"{v['concurrency_vs_sglang']:.2f} times" if v["concurrency_vs_sglang"] else "against"
        more = x["mean_running"] - s["mean_running"]
        if "ratio_step" in v:
            step = v["ratio_step"]
            best = "its best " if results["tail"].sweep else ""
            split = (f"Of the {more:+.1f}, {v['from_ratio']:+.1f} come from the SWA ratio (tail, SGLang at {best}"
                     f"ratio {step['swa_ratio']:g}: {step['mean_running']:.1f}) and {v['from_interval']:+.1f} from "
                     f"evicting every step.")
            flags = f"--swa-full-tokens-ratio {x['swa_ratio']:g}"
        else:
            split = (f"All {more:+.1f} come from evicting every step: SGLang sizes the SWA pool for "
                     f"{v['max_running_requests']} running requests at {x['pool_swa_pages']} pages instead of "
                     f"{s['pool_swa_pages']} and gives the rest to the full pool ({x['pool_full_pages']} pages "
                     f"instead of {s['pool_full_pages']}).")
            flags = f"--max-running-requests {v['max_running_requests']}"
        lines.append(
            f"fixed ratio: swa_ext (tail, SWA ratio {x['swa_ratio']:.3g}, eviction {_every(x['eviction_interval'])}) "
            f"runs {x['mean_running']:.1f} requests at once on average, {times} sglang's {s['mean_running']:.1f} "
            f"(SGLang 0.5.23 as it ships: tail, {_sglang_sizing(scenario, results[SGLANG])}, eviction "
            f"{_every(s['eviction_interval'])}), and a request waits {x['queue_wait_p50_s']:.1f} s instead of "
            f"{s['queue_wait_p50_s']:.1f} s (median). {split} In SGLang: SWA_EXT_SGLANG=1 "
            f"SGLANG_SWA_EVICTION_INTERVAL=1 with {flags}.")
    if "transfer" in c:
        t = c["transfer"]
        lines.append(
            f"transfer: tail (SWA KV for the window tail only, as sglang and swa_ext preallocate) receives "
            f"{t['tail_transfer_gib']:.1f} GiB of KV in total over the {t['requests']} requests instead of "
            f"{t['whole_prompt_transfer_gib']:.1f} GiB for whole prompts ({t['whole_prompt_column']}): "
            f"{t['transfer_saved']:.0%} less.")
    if "swa_ext_vs_full" in c:
        f, x = c["swa_ext_vs_full"], results[SWA_EXT]
        times = f"{f['concurrency_vs_full']:.2f} times" if f["concurrency_vs_full"] else "against"
        lines.append(
            f"against full (no SWA support): swa_ext runs {times} full's {f['full_mean_running']:.1f} requests at "
            f"once, with a median wait of {x.queue_wait_p50_s:.1f} s instead of {f['full_queue_wait_p50_s']:.1f} s.")
    return "\n".join(lines)


_ONE_BUDGET_NAMES = {
    SGLANG: "SGLang 0.5.23 as it ships",
    SGLANG_UNIFIED: "SGLang 0.5.23 with --enable-unified-memory: one byte arena, compaction blocked while "
                    "transfers are in flight",
}


def _one_budget_line(b: dict) -> str:
    """swa_ext_shared first: against SGLang both ways, then against the fixed ratio."""
    x = b[SWA_EXT_SHARED]
    against = [f"{b[label]['shared_vs']:.2f} times {label}'s {b[label]['mean_running']:.1f} ({name})"
               for label, name in _ONE_BUDGET_NAMES.items() if label in b and b[label]["shared_vs"]]
    text = (f"conclusion: swa_ext_shared (one budget for full and SWA KV, no ratio, eviction every step) runs "
            f"{x['mean_running']:.1f} requests at once on average")
    text += ": " + ", ".join(against) if against else ""
    if SWA_EXT in b and b[SWA_EXT]["shared_vs"]:
        f = b[SWA_EXT]
        text += (f"; {f['shared_vs']:.1%} of swa_ext's {f['mean_running']:.1f} at SWA ratio {f['swa_ratio']:g}, the "
                 f"best of its sweep on this trace in hindsight")
    if TUNED_ELSEWHERE in b and b[TUNED_ELSEWHERE]["vs_best"] is not None:
        t = b[TUNED_ELSEWHERE]
        text += (f"; at SWA ratio {t['swa_ratio']:g}, the best on {Path(t['tuned_on']).name}, swa_ext runs "
                 f"{t['mean_running']:.1f} here ({t['vs_best'] - 1:+.0%})")
    retractions = ", ".join(f"{label} {n}" for label, n in b["retractions"].items())
    return (f"{text}. Retractions: {retractions}. In SGLang: SWA_EXT_SGLANG=shared "
            f"SGLANG_SWA_EVICTION_INTERVAL=1.")


# Each column its colour and dash; the wider a line, the lower it is drawn, so a column
# that runs like another (evict like tail on short prompts) shows as a band around it.
_STYLES = {"full": ("tab:gray", "-", 1.0), "evict": ("tab:orange", "-", 4.0), "tail": ("tab:blue", "-", 1.2),
           SGLANG: ("tab:red", (0, (4, 2)), 1.2), SWA_EXT: ("tab:green", "-", 1.6),
           SGLANG_UNIFIED: ("tab:brown", (0, (2, 1)), 1.4), SWA_EXT_SHARED: ("black", "-", 1.4)}
_OTHER_STYLE = ("tab:purple", (0, (1, 1)), 1.2)


def plot(scenario: Scenario, results: dict[str, PolicyResult], path: str) -> None:
    """Four panels over simulated time, one line per column: running requests (each
    column's bound of the mean dotted in its colour), the full pool in use (GiB), each
    SWA pool's use as a share of its size, and the KV received so far (GiB), where
    window-tail preallocation's saving shows. Legends stand beside the panels, outside
    the data. The format follows ``path``'s suffix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = scenario.page_size
    full_page_gib = scenario.model.full_bytes_per_token * ps / GIB
    swa_page_gib = scenario.model.swa_bytes_per_token * ps / GIB
    fig, axes = plt.subplots(4, 1, figsize=(12, 12), sharex=True)
    for label, r in results.items():
        color, dash, width = _STYLES.get(label, _OTHER_STYLE)
        style = {"color": color, "ls": dash, "lw": width, "alpha": 0.45 if width > 2 else 1.0,
                 "zorder": 10 - width}
        t = [s * scenario.step_ms / 1000.0 for s in r.timeline_step]
        ratio = "one budget" if r.swa_ratio is None else f"ratio {r.swa_ratio:.3g}"
        axes[0].plot(t, r.timeline_running, label=f"{label} ({ratio}, mean {r.mean_running:.0f})",
                     **style)
        axes[0].axhline(r.capacity_bound, color=color, ls=":", lw=1.2,
                        label=f"{label}: bound of the mean {r.capacity_bound:.0f}")
        axes[1].plot(t, [p * full_page_gib for p in r.timeline_full_pages],
                     label=f"{label}: pool {r.pool_full_pages * full_page_gib:.1f} GiB", **style)
        pool = max(r.pool_swa_pages, 1)
        axes[2].plot(t, [100.0 * p / pool for p in r.timeline_swa_pages],
                     label=f"{label}: pool {r.pool_swa_pages * swa_page_gib:.1f} GiB", **style)
        axes[3].plot(t, r.timeline_transfer_gib, label=f"{label}: {r.transfer_gib:.1f} GiB in total", **style)
    axes[0].set_ylabel("running requests\n(dotted: bound of the mean;\none step may be above it)")
    axes[1].set_ylabel("full pool in use (GiB)")
    axes[2].set_ylabel("SWA pool in use\n(% of each column's pool)")
    axes[3].set_ylabel("KV received so far\n(GiB, resumed requests\nincluded)")
    axes[3].set_xlabel("simulated time (s)")
    for ax in axes:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", borderaxespad=0.0)
    title = (f"{scenario.model.name} on {Path(scenario.trace).name}, {len(scenario.requests)} requests, "
             f"{scenario.kv_memory_gib:g} GiB KV, page {ps}, time scale {scenario.time_scale:g}")
    if _coincide(results.get("evict"), results.get("tail")):
        title += ("\nevict (the wide band) runs as tail: it holds a whole prompt on the SWA pool only until its first "
                  "eviction,\nwhich these prompts leave room for; only the KV received (last panel) tells them apart")
    axes[0].set_title(title, fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _coincide(a: PolicyResult | None, b: PolicyResult | None) -> bool:
    """Whether two runs draw nearly the same lines: same ratio, mean concurrency within 1%."""
    if a is None or b is None or a.swa_ratio != b.swa_ratio:
        return False
    return abs(a.mean_running - b.mean_running) <= 0.01 * max(a.mean_running, b.mean_running)
