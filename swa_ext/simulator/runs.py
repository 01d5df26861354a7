"""The comparison: the columns planned from a scenario, each column's best SWA ratio of
a sweep, and the conclusion: swa_ext against SGLang as it ships, split into what tuning
the SWA ratio and what eviction every step give, and what window-tail preallocation saves."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .budgets import node_class
from .node import PolicyResult, default_allocator
from .scenario import (COLUMNS, SGLANG, SGLANG_DEFAULT_SWA_RATIO, SGLANG_UNIFIED, SWA_EXT, SWA_EXT_EVICTION_INTERVAL,
                       SWA_EXT_SHARED, SWA_RATIO_SWEEP, TUNED_ELSEWHERE, PolicyConfig, Scenario, SimulationError,
                       capacity_bound, fits_empty_node, policy_config, sglang_config, shared_config, shared_refusal,
                       unified_config, unified_refusal)


def simulate(scenario: Scenario, policy: str, swa_ratio: float = SGLANG_DEFAULT_SWA_RATIO, *,
             allocator_factory=default_allocator, progress: bool = False) -> PolicyResult:
    """Replay the scenario under one policy at one SWA ratio."""
    return simulate_config(scenario, policy_config(scenario, policy, swa_ratio),
                           allocator_factory=allocator_factory, progress=progress)


def simulate_config(scenario: Scenario, config: PolicyConfig, *, allocator_factory=default_allocator,
                    progress: bool = False) -> PolicyResult:
    """Replay the scenario on one policy's node."""
    node = node_class(config.budget)(scenario, config, allocator_factory=allocator_factory)
    ratio = "one budget" if config.swa_ratio is None else f"{config.swa_ratio:g}"
    return node.run(progress=progress, desc=f"{scenario.model.name} {config.policy} {ratio}")


def left_out_columns(model) -> dict[str, str]:
    """The columns the default run leaves out for this model, each with why: the one-budget
    columns that cannot be built or priced for it (``unified_refusal``, ``shared_refusal``)."""
    refusals = {SGLANG_UNIFIED: unified_refusal(model), SWA_EXT_SHARED: shared_refusal(model)}
    return {label: why for label, why in refusals.items() if why is not None}


def default_columns(model) -> tuple[str, ...]:
    """Every column but those ``left_out_columns`` names."""
    left_out = left_out_columns(model)
    return tuple(c for c in COLUMNS if c not in left_out)


@dataclass(frozen=True)
class PlannedRun:
    """One column of the comparison: its nodes (one, or a sweep of SWA ratios whose
    best is kept)."""

    label: str
    configs: tuple[PolicyConfig, ...]

    @property
    def policy(self) -> str:
        return self.configs[0].policy


def _ratios(scenario: Scenario, policy: str, swa_ratio: float | None, sweep, interval: int | None = None):
    ratios = (swa_ratio,) if swa_ratio is not None else tuple(sweep)
    return tuple(policy_config(scenario, policy, r, interval) for r in ratios)


def plan_runs(scenario: Scenario, columns=None, swa_ratio: float | None = None,
              sweep: tuple[float, ...] = SWA_RATIO_SWEEP) -> list[PlannedRun]:
    """``full`` at ratio 1; ``evict`` and ``tail`` at ``swa_ratio`` when given, else at
    their best of ``sweep``; ``sglang`` as SGLang sizes its node (``sglang_config``);
    ``swa_ext``, ``tail`` evicting every step, at ``swa_ratio`` or its best of ``sweep``,
    or, with a cap on running requests, on the node SGLang sizes from it at interval 1.
    ``sglang_unified`` and ``swa_ext_shared`` on their one budget. ``columns`` None: the
    model's ``default_columns``. Refuses, before any run, a column that no request of the
    scenario fits."""
    if swa_ratio is not None and not 0 < swa_ratio <= 1:
        raise SimulationError(f"SWA ratio must be in (0, 1], got {swa_ratio}")
    runs = []
    for label in dict.fromkeys(default_columns(scenario.model) if columns is None else columns):
        if label == "full":
            configs = (policy_config(scenario, "full", 1.0),)
        elif label == SGLANG:
            configs = (sglang_config(scenario),)
        elif label == SWA_EXT and scenario.max_running_requests is not None:
            configs = (sglang_config(scenario, SWA_EXT_EVICTION_INTERVAL, SWA_EXT),)
        elif label == SWA_EXT:
            configs = _ratios(scenario, "tail", swa_ratio, sweep, SWA_EXT_EVICTION_INTERVAL)
        elif label in ("evict", "tail"):
            configs = _ratios(scenario, label, swa_ratio, sweep)
        elif label == SGLANG_UNIFIED:
            configs = (unified_config(scenario),)
        elif label == SWA_EXT_SHARED:
            configs = (shared_config(scenario),)
        else:
            raise SimulationError(f"unknown column {label!r}; known: {', '.join(COLUMNS)}")
        runs.append(PlannedRun(label, configs))
    shortest = min(scenario.requests, key=lambda r: r.prompt_len + r.output_len)
    for planned in runs:
        if not any(fits_empty_node(scenario, c, shortest) for c in planned.configs):
            c = planned.configs[-1]
            ratios = ("any SWA ratio of the sweep" if len(planned.configs) > 1
                      else "one budget" if c.swa_ratio is None else f"SWA ratio {c.swa_ratio:g}")
            raise SimulationError(
                f"{scenario.kv_memory_gib:g} GiB of KV memory at {ratios} is too small for one request "
                f"in the {planned.label!r} column: its pools hold {c.size_full} full and {c.size_swa} SWA "
                f"tokens, the shortest request needs {shortest.prompt_len + shortest.output_len} plus a page"
            )
    return runs


def _rank(r: PolicyResult) -> tuple:
    # Every request served first; then the most concurrency (the shortest run);
    # then the fewest retractions.
    return (r.rejected, -r.mean_running, r.retractions)


def _best_of(scenario: Scenario, planned: PlannedRun, *, allocator_factory, progress: bool,
             on_run=None) -> PolicyResult:
    """The column's best run over its nodes. Nodes are tried from the highest capacity
    bound down; one whose bound is below the best mean concurrency found so far, with
    no fewer rejections, cannot win (no run's mean exceeds its bound) and is not run:
    its sweep point has ``mean_running`` None."""
    configs = planned.configs
    served = {c: [r for r in scenario.requests if fits_empty_node(scenario, c, r)] for c in configs}
    bounds = {c: capacity_bound(scenario, c, served[c]) for c in configs}
    best = None
    points = {}
    for config in sorted(configs, key=lambda c: -bounds[c]):
        rejected = len(scenario.requests) - len(served[config])
        if best is not None and rejected >= best.rejected and bounds[config] < best.mean_running:
            points[config] = {"swa_ratio": config.swa_ratio, "rejected": rejected, "retractions": None,
                              "mean_running": None, "capacity_bound": bounds[config]}
            continue
        started = time.perf_counter()
        result = simulate_config(scenario, config, allocator_factory=allocator_factory, progress=progress)
        if on_run is not None:
            on_run(planned.label, result, time.perf_counter() - started)
        points[config] = result.sweep_point()
        if best is None or _rank(result) < _rank(best):
            best = result
    if len(configs) > 1:
        best.sweep = [points[c] for c in configs]
    return best


def run(scenario: Scenario, columns=None, *, swa_ratio: float | None = None,
        sweep: tuple[float, ...] = SWA_RATIO_SWEEP, allocator_factory=default_allocator,
        progress: bool = False, on_run=None, tuned_on: Scenario | None = None) -> dict[str, PolicyResult]:
    """The comparison: one result per planned column (``plan_runs``), by label; with
    ``sglang`` and ``swa_ext`` (and no cap on running requests) also ``tail``, the step
    between them that the conclusion's split names; with ``tuned_on`` (a scenario of
    another trace) and a swept ``swa_ext``, also ``swa_ext_tuned_elsewhere``: ``swa_ext``
    here at the ratio its sweep finds best there. ``on_run(label, result, seconds)`` is
    called after every run, sweeps included."""
    columns = tuple(dict.fromkeys(default_columns(scenario.model) if columns is None else columns))
    if _splits_at_tail(scenario, columns) and "tail" not in columns:
        columns += ("tail",)
    results = {planned.label: _best_of(scenario, planned, allocator_factory=allocator_factory, progress=progress,
                                       on_run=on_run)
               for planned in plan_runs(scenario, columns, swa_ratio, sweep)}
    if tuned_on is not None and SWA_EXT in results and results[SWA_EXT].sweep:
        there = PlannedRun(f"{SWA_EXT} on {tuned_on.trace}", _ratios(tuned_on, "tail", None, sweep,
                                                                     SWA_EXT_EVICTION_INTERVAL))
        ratio = _best_of(tuned_on, there, allocator_factory=allocator_factory, progress=progress,
                         on_run=on_run).swa_ratio
        started = time.perf_counter()
        here = simulate_config(scenario, policy_config(scenario, "tail", ratio, SWA_EXT_EVICTION_INTERVAL),
                               allocator_factory=allocator_factory, progress=progress)
        here.tuned_on = tuned_on.trace
        if on_run is not None:
            on_run(TUNED_ELSEWHERE, here, time.perf_counter() - started)
        results[TUNED_ELSEWHERE] = here
    return results


def _splits_at_tail(scenario: Scenario, columns) -> bool:
    """Whether swa_ext's lead over sglang splits at ``tail``: SGLang's tail preallocation
    and interval at the best SWA ratio, what tuning SGLang's ratio alone gives; the rest
    is eviction every step. Not with a cap on running requests: SGLang then takes no
    ratio, both size the SWA pool from the cap and the interval."""
    return SGLANG in columns and SWA_EXT in columns and scenario.max_running_requests is None


def _summary(label: str, r: PolicyResult) -> dict:
    return {"column": label, "swa_ratio": r.swa_ratio, "eviction_interval": r.eviction_interval,
            "pool_full_pages": r.pool_full_pages, "pool_swa_pages": r.pool_swa_pages,
            "rejected": r.rejected, "retractions": r.retractions, "mean_running": r.mean_running,
            "queue_wait_p50_s": r.queue_wait_p50_s, "transfer_gib": r.transfer_gib}


def conclusion(scenario: Scenario, results: dict[str, PolicyResult]) -> dict | None:
    """What the run answers, each part where its columns were run: ``swa_ext`` against
    ``sglang`` (concurrency, wait, and how much of the concurrency comes from the SWA
    ratio and how much from evicting every step), window-tail preallocation's transfer
    saving (``tail`` against whole prompts), and ``swa_ext`` against ``full``. None
    when no part applies."""
    out = {}
    if SWA_EXT_SHARED in results:
        out["one_budget"] = _one_budget(results)
    if SGLANG in results and SWA_EXT in results:
        s, x = results[SGLANG], results[SWA_EXT]
        vs = {
            "swa_ext": _summary(SWA_EXT, x),
            "sglang": _summary(SGLANG, s),
            "concurrency_vs_sglang": x.mean_running / s.mean_running if s.mean_running else None,
            "max_running_requests": scenario.max_running_requests,
        }
        if not _splits_at_tail(scenario, results):
            # Both sized from the cap: the interval decides the SWA pool, so all of it is the interval's.
            vs["from_ratio"], vs["from_interval"] = 0.0, x.mean_running - s.mean_running
        else:
            t = results["tail"]
            vs["ratio_step"] = _summary("tail", t)
            vs["from_ratio"] = t.mean_running - s.mean_running
            vs["from_interval"] = x.mean_running - t.mean_running
        out["swa_ext_vs_sglang"] = vs
    whole = next((label for label in ("full", "evict") if label in results), None)
    if "tail" in results and whole is not None:
        t, w = results["tail"], results[whole]
        out["transfer"] = {
            "tail_transfer_gib": t.transfer_gib, "whole_prompt_column": whole, "whole_prompt_transfer_gib":
            w.transfer_gib, "requests": len(scenario.requests),
            "transfer_saved": 1 - t.transfer_gib / w.transfer_gib if w.transfer_gib else 0.0,
        }
    if "full" in results and SWA_EXT in results:
        f, x = results["full"], results[SWA_EXT]
        out["swa_ext_vs_full"] = {
            "concurrency_vs_full": x.mean_running / f.mean_running if f.mean_running else None,
            "full_mean_running": f.mean_running, "full_queue_wait_p50_s": f.queue_wait_p50_s,
        }
    return out or None


def _one_budget(results: dict[str, PolicyResult]) -> dict:
    """``swa_ext_shared`` against ``sglang``, ``sglang_unified`` and the hindsight-best
    fixed-ratio ``swa_ext`` (each where run), with what a ratio tuned on another trace
    gives ``swa_ext`` here, and every column's retractions."""
    x = results[SWA_EXT_SHARED]
    part = {"swa_ext_shared": _summary(SWA_EXT_SHARED, x),
            "retractions": {label: results[label].retractions for label in (SWA_EXT_SHARED, SGLANG_UNIFIED, SGLANG,
                                                                            SWA_EXT) if label in results}}
    for label in (SGLANG, SGLANG_UNIFIED, SWA_EXT, TUNED_ELSEWHERE):
        if label in results:
            r = results[label]
            part[label] = {**_summary(label, r), "tuned_on": r.tuned_on,
                           "shared_vs": x.mean_running / r.mean_running if r.mean_running else None}
    if TUNED_ELSEWHERE in results and SWA_EXT in results:
        best = results[SWA_EXT].mean_running
        part[TUNED_ELSEWHERE]["vs_best"] = results[TUNED_ELSEWHERE].mean_running / best if best else None
    return part
