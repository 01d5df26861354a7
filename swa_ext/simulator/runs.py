"""The comparison: the columns planned from a scenario, each policy's best SWA ratio of
a sweep, the conclusion against ``full`` and what eviction every step buys."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from .node import DecodeNode, PolicyResult, default_allocator
from .scenario import (EVICTING, POLICIES, SGLANG_DEFAULT_EVICTION_INTERVAL, SGLANG_DEFAULT_SWA_RATIO,
                       SWA_RATIO_SWEEP, PolicyConfig, Scenario, SimulationError, capacity_bound, fits_empty_node,
                       policy_config, sglang_request_cap_config, sglang_swa_request_cap)

def simulate(scenario: Scenario, policy: str, swa_ratio: float = SGLANG_DEFAULT_SWA_RATIO, *,
             allocator_factory=default_allocator, progress: bool = False) -> PolicyResult:
    """Replay the scenario under one policy at one SWA ratio."""
    return simulate_config(scenario, policy_config(scenario, policy, swa_ratio),
                           allocator_factory=allocator_factory, progress=progress)


def simulate_config(scenario: Scenario, config: PolicyConfig, *, allocator_factory=default_allocator,
                    progress: bool = False) -> PolicyResult:
    """Replay the scenario on one policy's node."""
    node = DecodeNode(scenario, config, allocator_factory=allocator_factory)
    return node.run(progress=progress, desc=f"{scenario.model.name} {config.policy} {config.swa_ratio:g}")


@dataclass(frozen=True)
class PlannedRun:
    """One column of the comparison: a policy and the SWA ratios it is tried at
    (one, or a sweep whose best is kept)."""

    label: str
    policy: str
    ratios: tuple[float, ...]


def plan_runs(scenario: Scenario, policies=POLICIES, swa_ratio: float | None = None,
              sweep: tuple[float, ...] = SWA_RATIO_SWEEP) -> list[PlannedRun]:
    """``full`` at ratio 1; ``evict`` and ``tail`` at ``swa_ratio`` when given, else
    at their best of ``sweep`` and at SGLang's default ratio. Refuses, before any
    run, a column that no request of the scenario fits."""
    if swa_ratio is not None and not 0 < swa_ratio <= 1:
        raise SimulationError(f"SWA ratio must be in (0, 1], got {swa_ratio}")
    runs = []
    for policy in dict.fromkeys(policies):
        if policy == "full":
            runs.append(PlannedRun("full", "full", (1.0,)))
        elif swa_ratio is not None:
            runs.append(PlannedRun(policy, policy, (swa_ratio,)))
        else:
            runs.append(PlannedRun(policy, policy, tuple(sweep)))
            runs.append(PlannedRun(f"{policy}@{SGLANG_DEFAULT_SWA_RATIO:g}", policy, (SGLANG_DEFAULT_SWA_RATIO,)))
    shortest = min(scenario.requests, key=lambda r: r.prompt_len + r.output_len)
    for planned in runs:
        configs = [policy_config(scenario, planned.policy, r) for r in planned.ratios]
        if not any(fits_empty_node(scenario, c, shortest) for c in configs):
            c = configs[-1]
            ratios = "any SWA ratio of the sweep" if len(configs) > 1 else f"SWA ratio {c.swa_ratio:g}"
            raise SimulationError(
                f"{scenario.kv_memory_gib:g} GiB of KV memory at {ratios} is too small for one request "
                f"under the {planned.policy!r} policy: its pools hold {c.size_full} full and {c.size_swa} SWA "
                f"tokens, the shortest request needs {shortest.prompt_len + shortest.output_len} plus a page"
            )
    return runs


def _rank(r: PolicyResult) -> tuple:
    # Every request served first; then the most concurrency (the shortest run);
    # then the fewest retractions.
    return (r.rejected, -r.mean_running, r.retractions)


def _timed(label: str, scenario: Scenario, config: PolicyConfig, *, allocator_factory, progress: bool,
           on_run) -> PolicyResult:
    started = time.perf_counter()
    result = simulate_config(scenario, config, allocator_factory=allocator_factory, progress=progress)
    if on_run is not None:
        on_run(label, result, time.perf_counter() - started)
    return result


def _best_of(scenario: Scenario, label: str, policy: str, ratios: tuple[float, ...], *, allocator_factory,
             progress: bool, on_run=None) -> PolicyResult:
    """The policy's best run over ``ratios``. Ratios are tried from the highest
    capacity bound down; one whose bound is below the best mean concurrency found
    so far, with no fewer rejections, cannot win (no run's mean exceeds its bound)
    and is not run: its sweep point has ``mean_running`` None."""
    configs = [policy_config(scenario, policy, r) for r in ratios]
    served = {c.swa_ratio: [r for r in scenario.requests if fits_empty_node(scenario, c, r)] for c in configs}
    bounds = {c.swa_ratio: capacity_bound(scenario, c, served[c.swa_ratio]) for c in configs}
    best = None
    points = {}
    for config in sorted(configs, key=lambda c: -bounds[c.swa_ratio]):
        rejected = len(scenario.requests) - len(served[config.swa_ratio])
        if best is not None and rejected >= best.rejected and bounds[config.swa_ratio] < best.mean_running:
            points[config.swa_ratio] = {"swa_ratio": config.swa_ratio, "rejected": rejected, "retractions": None,
                                        "mean_running": None, "capacity_bound": bounds[config.swa_ratio]}
            continue
        result = _timed(label, scenario, config, allocator_factory=allocator_factory, progress=progress,
                        on_run=on_run)
        points[config.swa_ratio] = result.sweep_point()
        if best is None or _rank(result) < _rank(best):
            best = result
    if len(configs) > 1:
        best.sweep = [points[c.swa_ratio] for c in configs]
    return best


def run(scenario: Scenario, policies=POLICIES, *, swa_ratio: float | None = None,
        sweep: tuple[float, ...] = SWA_RATIO_SWEEP, allocator_factory=default_allocator,
        progress: bool = False, on_run=None) -> dict[str, PolicyResult]:
    """The comparison: one result per planned column (``plan_runs``), by label.
    ``on_run(label, result, seconds)`` is called after every run, sweeps included."""
    return {
        planned.label: _best_of(scenario, planned.label, planned.policy, planned.ratios,
                                allocator_factory=allocator_factory, progress=progress, on_run=on_run)
        for planned in plan_runs(scenario, policies, swa_ratio, sweep)
    }


def _best_label(results: dict[str, PolicyResult], policies) -> str | None:
    """The best column of these policies; of two alike (concurrency within 0.1%), the
    one that receives less KV."""
    def rank(label):
        r = results[label]
        return (r.rejected, -round(r.mean_running, 1), r.retractions, r.transfer_gib)

    labels = [label for label, r in results.items() if r.policy in policies]
    return min(labels, key=rank) if labels else None


def conclusion(results: dict[str, PolicyResult]) -> dict | None:
    """The best column against ``full``: its concurrency, the transfer it saves and the
    SWA ratio to give SGLang. None without ``full`` or without another column."""
    best = _best_label(results, EVICTING)
    if "full" not in results or best is None:
        return None
    b, f = results[best], results["full"]
    return {
        "best": best,
        "swa_ratio": b.swa_ratio,
        "mean_running": b.mean_running,
        "full_mean_running": f.mean_running,
        "concurrency_vs_full": b.mean_running / f.mean_running if f.mean_running else None,
        "transfer_gib": b.transfer_gib,
        "full_transfer_gib": f.transfer_gib,
        "transfer_saved": 1 - b.transfer_gib / f.transfer_gib if f.transfer_gib else 0.0,
        "queue_wait_p50_s": b.queue_wait_p50_s,
        "full_queue_wait_p50_s": f.queue_wait_p50_s,
        "sglang_flag": f"--swa-full-tokens-ratio {b.swa_ratio:g}",
    }


def interval_comparison(scenario: Scenario, results: dict[str, PolicyResult], *,
                        allocator_factory=default_allocator, progress: bool = False, on_run=None) -> dict | None:
    """What eviction every step (interval 1) buys over the scenario's interval (over
    SGLang's 128 when the scenario's is 1): ``tail`` (what SGLang's decode node does:
    SWA KV for the window tail only, which its request-cap sizing assumes) on nodes that
    SGLang sizes for as many running requests as the best ``tail`` column reached, one
    per interval (``sglang_request_cap_config``). None without a ``tail`` column."""
    best = _best_label(results, ("tail",))
    if best is None:
        return None
    policy, max_running = results[best].policy, results[best].max_running
    other = scenario.eviction_interval if scenario.eviction_interval > 1 else SGLANG_DEFAULT_EVICTION_INTERVAL
    out = {"policy": policy, "max_running_requests": max_running, "intervals": {}}
    for interval in (1, other):
        at = replace(scenario, eviction_interval=interval)
        try:
            config = sglang_request_cap_config(at, policy, max_running, interval)
        except SimulationError as e:
            return {**out, "not_run": str(e)}
        r = _timed(f"{policy} interval {interval}", at, config, allocator_factory=allocator_factory,
                   progress=progress, on_run=on_run)
        cap = sglang_swa_request_cap(scenario.model.window, scenario.page_size, interval)
        out["intervals"][str(interval)] = {
            "swa_tokens_per_request": cap,
            "swa_pages_per_request": cap / scenario.page_size,
            "pool_full_pages": r.pool_full_pages,
            "pool_swa_pages": r.pool_swa_pages,
            "rejected": r.rejected,
            "mean_running": r.mean_running,
            "max_swa_pages_per_request": r.max_swa_pages_per_request,
            "queue_wait_p50_s": r.queue_wait_p50_s,
        }
    return out
