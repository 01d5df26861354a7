"""The reports of a measurement: the goals, the markdown table, the JSON document
and the plot (matplotlib, imported when drawing)."""

from __future__ import annotations

import os
import platform
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from .. import sglang_ref
from .cases import IMPLS, NOTES, PARENT_K, POOL_TOKENS_PER_REQUEST, REFERENCES, SGLANG_IMPL, WINDOW
from .measure import _fmt_ratio, _fmt_us

class Goal(NamedTuple):
    """A goal the README reports against (not a timed test): ``ratio`` (a row's
    ``speedup_vs_baseline``, ``speedup_vs_sglang``, ``ratio_to_floor``,
    ``shared_vs_default`` or ``parents_vs_default``) at least ``bound`` (at most, for the ratios of ``AT_MOST``)
    in every measured cell of ``op`` on
    ``device`` (None: any) with a batch size in ``batch_sizes`` (None: any) of at
    least ``min_batch`` and a page size in ``page_sizes`` (None: any)."""

    device: Optional[str]
    op: Optional[str]
    ratio: str
    bound: float
    batch_sizes: Optional[Tuple[int, ...]] = None
    page_sizes: Optional[Tuple[int, ...]] = None
    min_batch: int = 1


GOALS = (
    Goal("cpu", "alloc_decode", "speedup_vs_baseline", 10.0, (256,), (64,)),
    Goal("cpu", "alloc_decode", "ratio_to_floor", 3.0, (256,), (64,)),
    Goal("cuda", "alloc_decode", "speedup_vs_baseline", 3.0),  # host time
    # Issue 12, "CPU hot path at the floor".
    Goal("cpu", "alloc_decode", "speedup_vs_sglang", 20.0, (256,), (64,)),
    Goal("cpu", "free", "speedup_vs_baseline", 20.0, (256,), (64,)),
    Goal("cpu", "free_segment", "speedup_vs_baseline", 30.0, min_batch=256),
    Goal("cpu", "evict_out_of_window", "speedup_vs_baseline", 30.0, min_batch=256),
    Goal(None, None, "speedup_vs_baseline", 1.0),  # no cell slower than the baseline
    # Issue 42: every call in the shared mode within 10% of the default mode's time.
    Goal("cpu", None, "shared_vs_default", 1.1),
    # Issue 49: and on parent pages (k > 1).
    Goal("cpu", None, "parents_vs_default", 1.1),
)
AT_MOST = ("ratio_to_floor", "shared_vs_default", "parents_vs_default")  # ratios whose goal is a bound from above


def _goal_name(g: Goal) -> str:
    where = [w for w in (g.device, g.op) if w]
    if g.batch_sizes:
        where.append("B=" + ",".join(map(str, g.batch_sizes)))
    if g.min_batch > 1:
        where.append(f"B>={g.min_batch}")
    if g.page_sizes:
        where.append("ps=" + ",".join(map(str, g.page_sizes)))
    bound = (f"<= {g.bound:g}x vs floor" if g.ratio == "ratio_to_floor"
             else f"shared mode <= {g.bound:g}x default" if g.ratio == "shared_vs_default"
             else f"parent pages (k {PARENT_K}) <= {g.bound:g}x default" if g.ratio == "parents_vs_default"
             else f">= {g.bound:g}x vs {g.ratio[len('speedup_vs_'):]}")
    return f"{' '.join(where) or 'every cell'}: {bound}"


def _goal_cells(g: Goal, rows: Sequence[dict]) -> List[dict]:
    return [r for r in rows
            if (g.device is None or r["device"].split(":")[0] == g.device)
            and (g.op is None or r["op"] == g.op)
            and (g.batch_sizes is None or r["batch_size"] in g.batch_sizes)
            and r["batch_size"] >= g.min_batch
            and (g.page_sizes is None or r["page_size"] in g.page_sizes)
            and r[g.ratio] is not None]


def goals(rows: Sequence[dict]) -> List[dict]:
    """Every goal of ``GOALS`` that ``rows`` measure, at its worst measured cell."""
    out = []
    for g in GOALS:
        cells = _goal_cells(g, rows)
        if not cells:
            continue
        at_most = g.ratio in AT_MOST
        worst = (max if at_most else min)(cells, key=lambda r: r[g.ratio])
        value = worst[g.ratio]
        cell = [worst[k] for k, fixed in (("device", g.device), ("op", g.op)) if fixed is None]
        out.append({
            "goal": _goal_name(g),
            "ratio": g.ratio,
            "bound": g.bound,
            "worst": " ".join(cell + [f"B={worst['batch_size']}", f"ps={worst['page_size']}"]),
            "value": value,
            "met": bool(value <= g.bound if at_most else value >= g.bound),
        })
    return out


def _cell(r, impl):
    if r[impl + "_median_us"] is None:
        return "n/a"
    return (
        f"{_fmt_us(r[impl + '_median_us'])} "
        f"({_fmt_us(r[impl + '_p10_us'])}–{_fmt_us(r[impl + '_p90_us'])})"
    )


def _differs(r) -> List[str]:
    """What each reference that differed from native on row ``r`` got wrong."""
    return [f"{ref}: {r[f'{ref}_mismatch']}" for ref in REFERENCES if r.get(f"{ref}_mismatch")]


def to_markdown(rows: Sequence[dict]) -> str:
    """Markdown: one table (medians, p10–p90, ratios) and the goals. The SGLang
    columns are there when some row measured SGLang's allocator."""
    sglang = any(r["sglang_measured"] for r in rows)
    impls = [impl for impl in IMPLS if sglang or impl != "sglang"]
    refs = [ref for ref in REFERENCES if sglang or ref != "sglang"]
    lines = [
        "Times in µs per measured call: median (p10–p90). "
        "vs baseline = baseline median / native median"
        + (", vs sglang = SGLang median / native median" if sglang else "")
        + " (above 1x native is faster); vs floor = native median / floor median;"
        + " shared/default = shared-mode median / native (default mode) median;"
        + f" parents/default = the same on parent pages (k {PARENT_K}, the full side small).",
        "",
        "| device | op | batch | page | " + " | ".join(f"{impl} µs" for impl in impls) + " | "
        + " | ".join(f"vs {ref}" for ref in refs) + " | vs floor | shared/default | parents/default | iters |",
        "|---|---|---:|---:|" + "---:|" * (len(impls) + len(refs) + 4),
    ]
    for r in rows:
        flag = " ⚠" if _differs(r) else ""
        lines.append(
            f"| {r['device']} | {r['op']}{flag} | {r['batch_size']} | {r['page_size']} | "
            + " | ".join(_cell(r, impl) for impl in impls) + " | "
            + " | ".join(_fmt_ratio(r[f"speedup_vs_{ref}"]) for ref in refs)
            + f" | {_fmt_ratio(r['ratio_to_floor'])} | "
            + " | ".join("n/a" if r[f"{mode}_vs_default"] is None else f"{r[f'{mode}_vs_default']:.2f}x"
                         for mode in ("shared", "parents"))
            + f" | {r['iters']} |"
        )
    ops_seen = list(dict.fromkeys(r["op"] for r in rows))
    if ops_seen:
        lines += ["", "What one measured call covers (B = batch size, ps = page size):", ""]
        lines += [f"- `{op}`: {NOTES[op]}" for op in ops_seen]
    differ = [r for r in rows if _differs(r)]
    if differ:
        lines += ["", "⚠: results differed from native's on the same call:", ""]
        lines += [f"- {r['device']} {r['op']} B={r['batch_size']} ps={r['page_size']}: " + "; ".join(_differs(r))
                  for r in differ]
    if rows:
        lines += ["", f"Floor: {rows[0]['floor_impl']}."]
    if sglang:
        lines.append(f"SGLang: {SGLANG_IMPL}; at page size 1 `alloc_extend` and `alloc_decode` call its "
                     "`alloc`, and n/a: it has no `alloc_extend_swa_tail` there.")
    gs = goals(rows)
    if gs:
        lines += ["", "Goals (each at its worst measured cell):", ""]
        lines += [f"- {g['goal']}: {_fmt_ratio(g['value'])} at {g['worst']}: "
                  f"**{'met' if g['met'] else 'not met'}**" for g in gs]
    return "\n".join(lines) + "\n"


def report(rows: Sequence[dict]) -> dict:
    """The JSON document: environment, rows and goals."""
    return {
        "meta": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "sglang": sglang_ref.version() if any(r["sglang_measured"] for r in rows) else None,
            "window": WINDOW,
            "pool_tokens_per_request": POOL_TOKENS_PER_REQUEST,
            "timer": "time.perf_counter_ns around the call only (host time)",
        },
        "rows": list(rows),
        "goals": goals(rows),
    }


# Colour tells the implementations apart, marker and line style the page sizes.
IMPL_COLORS = {"native": "#1f5fbf", "shared": "#2a9d4b", "parents": "#7b3fb0", "baseline": "#d0342c", "sglang": "#e08a00",
               "floor": "#8c8c8c"}
IMPL_TITLES = {"native": "native", "shared": "native, shared mode", "parents": f"native, parent pages (k {PARENT_K})",
               "baseline": "SGLang-style torch baseline",
               "sglang": "SGLang's allocator", "floor": "native-call floor"}
PAGE_STYLES = (("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."), ("v", (0, (5, 1, 1, 1))))
LEGEND_INCHES = 0.45  # below the panels, so that it covers no data


def plot(rows: Sequence[dict], path) -> None:
    """PNG: median time (p10-p90 bars) vs batch size, one panel per (device, op); colour =
    implementation, marker and line style = page size, the legend below the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    devices = list(dict.fromkeys(r["device"] for r in rows))
    ops = list(dict.fromkeys(r["op"] for r in rows))
    page_sizes = sorted({r["page_size"] for r in rows})
    impls = [impl for impl in IMPLS if any(r[f"{impl}_median_us"] is not None for r in rows)]
    style = {ps: PAGE_STYLES[i % len(PAGE_STYLES)] for i, ps in enumerate(page_sizes)}
    ncols = min(3, max(1, len(ops)))
    per_dev = -(-len(ops) // ncols)
    nrows = max(1, per_dev * len(devices))
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows + LEGEND_INCHES), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for di, dev in enumerate(devices):
        for oi, op in enumerate(ops):
            ax = axes[di * per_dev + oi // ncols][oi % ncols]
            ax.set_visible(True)
            for ps in page_sizes:
                marker, linestyle = style[ps]
                for impl in impls:
                    sel = sorted(
                        (r for r in rows if r["device"] == dev and r["op"] == op and r["page_size"] == ps
                         and r[f"{impl}_median_us"] is not None),
                        key=lambda r: r["batch_size"],
                    )
                    if not sel:
                        continue
                    xs = [r["batch_size"] for r in sel]
                    ys = [r[f"{impl}_median_us"] for r in sel]
                    lo = [r[f"{impl}_median_us"] - r[f"{impl}_p10_us"] for r in sel]
                    hi = [r[f"{impl}_p90_us"] - r[f"{impl}_median_us"] for r in sel]
                    ax.errorbar(xs, ys, yerr=[lo, hi], color=IMPL_COLORS[impl], marker=marker,
                                linestyle=linestyle, capsize=2, linewidth=1.3, markersize=4.5,
                                markerfacecolor="white" if impl == "floor" else IMPL_COLORS[impl])
            ax.set_xscale("log", base=2)
            batch_sizes = sorted({r["batch_size"] for r in rows if r["device"] == dev and r["op"] == op})
            ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_title(f"{dev}: {op}", fontsize=10)
            ax.set_xlabel("batch size")
            ax.set_ylabel("µs per call")
            ax.grid(True, which="both", alpha=0.3)
    handles = [Line2D([], [], color=IMPL_COLORS[impl], linewidth=2.5, label=impl) for impl in impls]
    handles += [Line2D([], [], color="black", marker=style[ps][0], linestyle=style[ps][1], linewidth=1.2,
                       label=f"page size {ps}") for ps in page_sizes]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9, frameon=False)
    fig.suptitle("swa_ext allocator: " + " vs ".join(IMPL_TITLES[impl] for impl in impls)
                 + " (median, bars p10–p90)", fontsize=11)
    fig.tight_layout(rect=(0, LEGEND_INCHES / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
