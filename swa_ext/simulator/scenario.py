"""The simulated node's settings: the scenario every policy shares, the pool sizes a
policy's SWA ratio gives, and what a request needs of an empty node (docs/simulator.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from swa_ext.models import ModelConfig
from swa_ext.traces import Request

POLICIES = ("full", "evict", "tail")
EVICTING = ("evict", "tail")
# The two nodes the conclusion compares, both ``tail`` (window-tail preallocation, then
# eviction): SGLang 0.5.23 as it ships (its own pool sizing, its eviction interval) and
# swa_ext in SGLang (eviction every step, which its hook makes affordable, at the SWA
# ratio the sweep finds).
SGLANG = "sglang"
SWA_EXT = "swa_ext"
SWA_EXT_EVICTION_INTERVAL = 1
# The two columns with one budget for full and SWA KV, no ratio to choose: SGLang 0.5.23
# with --enable-unified-memory (one byte arena, its own interval) and swa_ext's shared mode
# (one free list of parent pages for both, eviction every step).
SGLANG_UNIFIED = "sglang_unified"
SWA_EXT_SHARED = "swa_ext_shared"
# swa_ext at the SWA ratio its sweep finds best on another trace (``run``'s ``tuned_on``).
TUNED_ELSEWHERE = "swa_ext_tuned_elsewhere"
# The columns that are SGLang 0.5.23 itself or swa_ext inside it, as configured: a what-if
# for a model SGLang does not serve hybrid (``ModelConfig.sglang_hybrid``).
IN_SGLANG = (SGLANG, SWA_EXT, SGLANG_UNIFIED, SWA_EXT_SHARED, TUNED_ELSEWHERE)
# How a column's KV memory is cut: two pools at a ratio, SGLang's byte arena, or
# swa_ext's shared slots.
SPLIT, ARENA, SHARED = "split", "arena", "shared"
# The comparison's columns, in the table's order.
COLUMNS = (*POLICIES, SGLANG, SWA_EXT, SGLANG_UNIFIED, SWA_EXT_SHARED)

# SGLang's swa_full_tokens_ratio when the server is not told one.
SGLANG_DEFAULT_SWA_RATIO = 0.8
# SGLang's num_reserved_decode_tokens default.
DEFAULT_RESERVED_DECODE_TOKENS = 512
# SGLang's SGLANG_SWA_EVICTION_INTERVAL default: a request's out-of-window SWA KV is
# freed once at least this many tokens have slid out of its window.
SGLANG_DEFAULT_EVICTION_INTERVAL = 128
# SWA ratios tried for evict and tail: a coarse grid from 1% to 1.
SWA_RATIO_SWEEP = (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 1.0)
# req_to_token holds int32 slot ids, as SGLang's does.
MAX_POOL_TOKENS = 2**31 - 1

GIB = 1 << 30


class SimulationError(ValueError):
    """The simulation cannot run with these settings; the message says why."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tail_swa_pages_bound(window: int, page_size: int, interval: int = 1) -> int:
    """The most SWA pages one request holds under window eviction. Eviction at
    committed length L moves the page-aligned eviction point once
    L - window >= point + interval, and then by whole pages only, so the tokens
    from that point up to the one just allocated span at most
    window + max(interval, page_size) + 1 tokens, starting on a page boundary."""
    return _cdiv(window + max(interval, page_size) + 1, page_size)


def sglang_swa_request_cap(window: int, page_size: int, interval: int) -> int:
    """SWA tokens SGLang 0.5.23 budgets per running request when it sizes the SWA
    pool from ``--max-running-requests`` (``pool_configurator.compute_swa_request_cap``,
    no speculative decoding): the window, the interval's overshoot, a page of
    padding that keeps the eviction point page-aligned and a page of decode room."""
    return window + interval + page_size + page_size


def sglang_decode_extra_slots(max_running: int) -> int:
    """SGLang's default ``--disaggregation-decode-extra-slots`` on a decode node: twice a
    batch of at most 32 requests, for requests still in transfer; none for larger ones."""
    return 2 * max_running if max_running <= 32 else 0


def sglang_swa_pool_tokens(window: int, page_size: int, interval: int, max_running: int) -> int:
    """The SWA pool SGLang's decode node sizes from ``--max-running-requests``
    (``compute_swa_request_cap`` in decode mode, page-aligned): the per-request cap
    for every running request, and a window and a page for each extra slot."""
    cap = (sglang_swa_request_cap(window, page_size, interval) * max_running
           + (window + page_size) * sglang_decode_extra_slots(max_running))
    return _cdiv(cap, page_size) * page_size


def pool_sizes(model: ModelConfig, kv_memory_bytes: float, page_size: int, swa_ratio: float) -> tuple[int, int]:
    """Token sizes (size_full, size_swa) of the two pools as SGLang 0.5.23 splits the
    KV memory at SWA ratio ``swa_ratio`` (``swa_full_tokens_ratio``;
    ``HybridSWAPoolConfigurator.calculate_pool_sizes``): full tokens are the memory over
    the bytes of a full token plus ``swa_ratio`` SWA tokens, the SWA pool that many
    times the full pool, both in whole pages."""
    cell_bytes = model.full_bytes_per_token + swa_ratio * model.swa_bytes_per_token
    size_full = int(kv_memory_bytes // cell_bytes) // page_size * page_size
    return size_full, int(size_full * swa_ratio) // page_size * page_size


def request_cap_pool_sizes(model: ModelConfig, kv_memory_bytes: float, page_size: int, interval: int,
                           max_running: int) -> tuple[int, int]:
    """Token sizes (size_full, size_swa) as SGLang 0.5.23's decode node splits the KV
    memory when ``--max-running-requests`` is set (its radix cache is off there;
    ``SWARequestCapPoolConfigurator``): the SWA pool from the request cap, the rest of
    the memory for the full pool, in whole pages."""
    size_swa = sglang_swa_pool_tokens(model.window, page_size, interval, max_running)
    rest = kv_memory_bytes - size_swa * model.swa_bytes_per_token
    return int(rest // model.full_bytes_per_token) // page_size * page_size, size_swa


@dataclass(frozen=True)
class Scenario:
    """What every policy's run shares: the model, the node's KV memory and page
    size, the step and time scale, the admission reserve, SGLang's eviction interval,
    the cap on running requests (None: no cap) and the requests."""

    model: ModelConfig
    trace: str
    page_size: int
    kv_memory_gib: float
    step_ms: float
    time_scale: float
    reserved_decode_tokens: int
    eviction_interval: int
    max_running_requests: int | None
    requests: list[Request]
    trace_requests: int  # read from the trace
    skipped_over_context: int
    skipped_no_output: int


def plan_scenario(
    requests: list[Request],
    model: ModelConfig,
    *,
    trace: str = "",
    page_size: int = 64,
    kv_memory_gib: float = 40.0,
    step_ms: float = 20.0,
    time_scale: float = 1.0,
    reserved_decode_tokens: int = DEFAULT_RESERVED_DECODE_TOKENS,
    eviction_interval: int = SGLANG_DEFAULT_EVICTION_INTERVAL,
    max_running_requests: int | None = None,
) -> Scenario:
    """Check the settings and keep the requests a node of this model can serve at
    all: prompt plus output within the model's context, at least one token to
    decode. These are skipped under every policy alike; memory is judged per policy."""
    if page_size < 1:
        raise SimulationError(f"page size must be positive, got {page_size}")
    for name, value in (("KV memory", kv_memory_gib), ("step time", step_ms), ("time scale", time_scale)):
        if not (value > 0 and math.isfinite(value)):
            raise SimulationError(f"{name} must be positive and finite, got {value}")
    if reserved_decode_tokens < 0:
        raise SimulationError(f"reserved decode tokens must be >= 0, got {reserved_decode_tokens}")
    if eviction_interval < 1:
        raise SimulationError(f"eviction interval must be >= 1, got {eviction_interval}")
    if max_running_requests is not None and max_running_requests < 1:
        raise SimulationError(f"max running requests must be >= 1, got {max_running_requests}")
    in_context = [r for r in requests if r.prompt_len + r.output_len <= model.context_len]
    with_output = [r for r in in_context if r.output_len > 0]
    if not with_output:
        raise SimulationError("no request of the trace fits the model's context and has output")
    return Scenario(
        model=model,
        trace=trace,
        page_size=page_size,
        kv_memory_gib=kv_memory_gib,
        step_ms=step_ms,
        time_scale=time_scale,
        reserved_decode_tokens=reserved_decode_tokens,
        eviction_interval=eviction_interval,
        max_running_requests=max_running_requests,
        requests=with_output,
        trace_requests=len(requests),
        skipped_over_context=len(requests) - len(in_context),
        skipped_no_output=len(in_context) - len(with_output),
    )


@dataclass(frozen=True)
class PolicyConfig:
    """One column's node: its policy, SWA ratio (None: one budget, no ratio), the pool
    sizes (tokens) it gives, its eviction interval, the cap on running requests (None:
    no cap) and how its memory is cut (``SPLIT``, ``ARENA``, ``SHARED``). An arena's
    sizes are what each side could hold alone, and so are a shared pool's, whose parent
    pages hold ``parent_k`` pages of ``small_side`` or one page of the other side."""

    policy: str
    swa_ratio: float | None
    size_full: int
    size_swa: int
    eviction_interval: int
    max_running: int | None = None
    budget: str = SPLIT
    parent_k: int = 1
    small_side: str = "swa"


def _checked(scenario: Scenario, label: str, config: PolicyConfig) -> PolicyConfig:
    if config.size_full > MAX_POOL_TOKENS:
        raise SimulationError(
            f"{scenario.kv_memory_gib:g} GiB of KV memory gives the {label!r} column a full pool of "
            f"{config.size_full} tokens, more than the {MAX_POOL_TOKENS} int32 slot ids of req_to_token")
    return config


def policy_config(scenario: Scenario, policy: str, swa_ratio: float, interval: int | None = None) -> PolicyConfig:
    """A policy's node at an SWA ratio, evicting at ``interval`` (default: the
    scenario's). ``full`` always gets ratio 1: its SWA pool holds the same tokens as its
    full pool, so any other ratio would leave memory unused."""
    if policy not in POLICIES:
        raise SimulationError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    ratio = 1.0 if policy == "full" else swa_ratio
    size_full, size_swa = pool_sizes(scenario.model, scenario.kv_memory_gib * GIB, scenario.page_size, ratio)
    interval = scenario.eviction_interval if interval is None else interval
    return _checked(scenario, policy, PolicyConfig(policy, ratio, size_full, size_swa, interval,
                                                   scenario.max_running_requests))


def sglang_config(scenario: Scenario, interval: int | None = None, label: str = SGLANG) -> PolicyConfig:
    """The ``tail`` node SGLang 0.5.23 configures itself, evicting at ``interval``
    (default: the scenario's): with ``--max-running-requests`` its decode node (radix
    cache off) sizes the SWA pool from the request cap; without, it splits the memory at
    its fallback SWA ratio 0.8."""
    interval = scenario.eviction_interval if interval is None else interval
    max_running = scenario.max_running_requests
    if max_running is None:
        return policy_config(scenario, "tail", SGLANG_DEFAULT_SWA_RATIO, interval)
    size_full, size_swa = request_cap_pool_sizes(scenario.model, scenario.kv_memory_gib * GIB, scenario.page_size,
                                                 interval, max_running)
    if size_full <= 0:
        raise SimulationError(
            f"{scenario.kv_memory_gib:g} GiB of KV memory leaves the {label!r} column no full pool: SGLang's SWA pool "
            f"for {max_running} running requests at eviction interval {interval} takes it all")
    ratio = size_swa / size_full
    return _checked(scenario, label, PolicyConfig("tail", ratio, size_full, size_swa, interval, max_running))


# SGLang pads a token's entry in its unified arena to this many bytes
# (``mem_cache/layout/token_major.py``, ``ENTRY_ALIGN_BYTES``).
ENTRY_ALIGN_BYTES = 32


def entry_bytes(model: ModelConfig) -> tuple[int, int]:
    """Bytes of one token's full entry and SWA entry (every layer of the side) as SGLang
    0.5.23's unified arena lays them out (``MHASubPoolSpec.entry_bytes``)."""
    return tuple(_cdiv(b, ENTRY_ALIGN_BYTES) * ENTRY_ALIGN_BYTES
                 for b in (model.full_bytes_per_token, model.swa_bytes_per_token))


@dataclass(frozen=True)
class ArenaGeometry:
    """SGLang 0.5.23's ``--enable-unified-memory`` arena: a page's bytes on each side, the
    free band between the two sides when both are empty, and the pages each side can
    address (its index space past the sink; the SWA side also no more than the full
    side's virtual page ids)."""

    full_page_bytes: int
    swa_page_bytes: int
    gap_bytes: int
    full_pages: int
    swa_pages: int


def arena_geometry(scenario: Scenario) -> ArenaGeometry:
    """The arena SGLang builds for the scenario: its bytes are the two pools its
    configurator sizes as for the ``sglang`` column (``_unified_pool_bytes``); each side's
    index space is those bytes over its page (``UnifiedKVPool``), its first pages covered
    by the sink, one page of the larger entry at the low end (``_reserved_floor_bytes``);
    the full side grows down from its top page, the SWA side up from past the sink
    (``_empty_shared_gap_bytes``)."""
    m, ps = scenario.model, scenario.page_size
    sized = sglang_config(scenario, label=SGLANG_UNIFIED)
    total = sized.size_full * m.full_bytes_per_token + sized.size_swa * m.swa_bytes_per_token
    entries = entry_bytes(m)
    sink = ps * max(entries)
    # Per side: (pages of its index space, its first page past the sink).
    (full_top, full_first), (swa_top, swa_first) = ((total // e // ps, _cdiv(_cdiv(sink, e), ps)) for e in entries)
    full_pages = full_top - full_first
    return ArenaGeometry(ps * entries[0], ps * entries[1], full_top * ps * entries[0] - swa_first * ps * entries[1],
                         full_pages, min(full_pages, swa_top - swa_first))


def unified_refusal(model: ModelConfig) -> str | None:
    """Why SGLang's unified arena cannot be built for this model, or None
    (``init_unified_swa_pools`` asserts both kinds of layer)."""
    if model.full_layers and model.swa_layers:
        return None
    return (f"{model.name} has no full-attention layers, and one budget for full and SWA KV needs both kinds "
            f"(SGLang's init_unified_swa_pools asserts them)")


def unified_config(scenario: Scenario, interval: int | None = None) -> PolicyConfig:
    """SGLang 0.5.23's ``--enable-unified-memory`` node (``init_unified_swa_pools``): one
    byte arena (``arena_geometry``), the full side from the top, the SWA side from the
    bottom. At page size 1 its decode node preallocates whole prompts on both sides
    (``_uses_swa_tail_prealloc`` needs a page size above 1), so the column's policy is
    ``evict`` there, ``tail`` above."""
    refusal = unified_refusal(scenario.model)
    if refusal is not None:
        raise SimulationError(f"the {SGLANG_UNIFIED!r} column cannot run: {refusal}")
    ps = scenario.page_size
    arena = arena_geometry(scenario)
    policy = "tail" if ps > 1 else "evict"
    interval = scenario.eviction_interval if interval is None else interval
    return _checked(scenario, SGLANG_UNIFIED, PolicyConfig(policy, None, arena.full_pages * ps, arena.swa_pages * ps,
                                                           interval, scenario.max_running_requests, ARENA))


def _small_and_large_entry(model: ModelConfig) -> tuple[int, int]:
    """The smaller and the larger of a token's full and SWA KV bytes, unpadded, as swa_ext's
    shared storage lays them out in SGLang (``shared_pool.kv_entries``)."""
    return tuple(sorted((model.full_bytes_per_token, model.swa_bytes_per_token)))


def parent_page_k(model: ModelConfig) -> int:
    """Pages of the smaller entry a parent page of the shared mode holds: the larger entry
    over the smaller, rounded up (the larger padded to k smaller ones; SPEC.md 8.1), by
    the allocator's own rule (``swa_ext.parent_k``). For a model with both kinds of layer."""
    from swa_ext import parent_k

    small, large = _small_and_large_entry(model)
    return parent_k(large, small)


def small_side(model: ModelConfig) -> str:
    """The shared mode's small side, "full" or "swa" (``one_budget.small_side``), which
    takes ``parent_page_k`` pages of a parent."""
    from swa_ext.one_budget import small_side as side

    return side(model.full_bytes_per_token, model.swa_bytes_per_token)


def parent_padding(model: ModelConfig) -> float:
    """The share of a parent page a large-side page leaves unused: its entry padded to
    ``parent_page_k`` smaller ones, (k * E_small - E_large) / (k * E_small)."""
    small, large = _small_and_large_entry(model)
    parent = parent_page_k(model) * small
    return (parent - large) / parent


def shared_refusal(model: ModelConfig) -> str | None:
    """Why the ``swa_ext_shared`` column cannot be priced for this model, or None: like
    SGLang's arena, one budget for full and SWA KV needs both kinds of layer."""
    return unified_refusal(model)


def shared_config(scenario: Scenario) -> PolicyConfig:
    """swa_ext's shared mode (``shared=True``): one free list of parent pages, a parent
    ``parent_page_k`` pages of the small side or one page of the other, the larger entry
    padded to k smaller ones (SPEC.md 8.1; at k = 1 a page of either kind). The KV memory
    over a parent's bytes, in whole parents (the same bytes as a fixed split of the
    memory, give or take its rounding); each side's size is what it could hold alone, the
    small side's k times the large side's."""
    m, ps = scenario.model, scenario.page_size
    refusal = shared_refusal(m)
    if refusal is not None:
        raise SimulationError(f"the {SWA_EXT_SHARED!r} column cannot run: {refusal}")
    from swa_ext.one_budget import one_budget_slots

    size_full, size_swa, k = one_budget_slots(int(scenario.kv_memory_gib * GIB), full_entry=m.full_bytes_per_token,
                                              swa_entry=m.swa_bytes_per_token, page_size=ps)
    return _checked(scenario, SWA_EXT_SHARED, PolicyConfig("tail", None, size_full, size_swa, SWA_EXT_EVICTION_INTERVAL,
                                                           scenario.max_running_requests, SHARED, k,
                                                           small_side(m)))


def _pages_a_parent(config: PolicyConfig) -> tuple[int, int]:
    """Full and SWA pages a parent of a shared pool holds: ``parent_k`` on its small side,
    one on the other."""
    return (config.parent_k, 1) if config.small_side == "full" else (1, config.parent_k)


def _shared_parents(config: PolicyConfig, page_size: int) -> int:
    """A shared pool's parents: its large side's pages (the small side's are k times as many)."""
    return min(config.size_full, config.size_swa) // page_size


def _pages_needed(policy: str, total_len: int, window: int, page_size: int, interval: int) -> tuple[int, int]:
    """Full and SWA pages a request of final length ``total_len`` may hold at
    once, plus one: enough for any (re)admission and the decode step after it."""
    full = _cdiv(total_len, page_size)
    swa = full if policy != "tail" else min(full, tail_swa_pages_bound(window, page_size, interval))
    return full + 1, swa + 1


def fits_empty_node(scenario: Scenario, config: PolicyConfig, request: Request) -> bool:
    """Whether the request runs to its end alone on an empty node of this column (an
    arena also prices its admission's reserve, as SGLang's ``prealloc_ceiling_fits``)."""
    ps = scenario.page_size
    full, swa = _pages_needed(config.policy, request.prompt_len + request.output_len, scenario.model.window, ps,
                              config.eviction_interval)
    if config.budget == SHARED:
        full_a_parent, swa_a_parent = _pages_a_parent(config)
        return _cdiv(full, full_a_parent) + _cdiv(swa, swa_a_parent) <= _shared_parents(config, ps)
    if config.budget == ARENA:
        arena = arena_geometry(scenario)
        admission = _cdiv(request.prompt_len, ps) + _cdiv(scenario.reserved_decode_tokens, ps)
        return (full <= config.size_full // ps and swa <= config.size_swa // ps
                and max(full, admission) * arena.full_page_bytes + swa * arena.swa_page_bytes <= arena.gap_bytes)
    return full <= config.size_full // ps and swa <= config.size_swa // ps


def _sum_cdiv(n: int, page_size: int) -> int:
    """sum(ceil(x / page_size) for x in 1..n)."""
    if n <= 0:
        return 0
    q, r = divmod(n, page_size)
    return page_size * q * (q + 1) // 2 + r * (q + 1)


def _sum_floor(n: int, page_size: int) -> int:
    """sum(floor(y / page_size) for y in 0..n); 0 for n < 0."""
    if n < 0:
        return 0
    q, r = divmod(n + 1, page_size)
    return page_size * q * (q - 1) // 2 + r * q


def capacity_bound(scenario: Scenario, config: PolicyConfig, requests: list[Request]) -> float:
    """The most requests the policy's pools can hold on average over the run: the
    pool's pages over the pages a running request of these requests holds at
    least, averaged over its decode steps. Every request decodes each of its
    tokens once, in a step where it holds at least the pages of its length so
    far (full pool, and ``full``'s SWA pool) or of its last ``window`` tokens
    (an evicting SWA pool), so no run's ``mean_running`` exceeds this."""
    ps, window = scenario.page_size, scenario.model.window
    decode_steps = full_page_steps = swa_page_steps = 0
    for r in requests:
        start, end = r.prompt_len, r.prompt_len + r.output_len  # lengths after each step: start+1..end
        full = _sum_cdiv(end, ps) - _sum_cdiv(start, ps)
        decode_steps += r.output_len
        full_page_steps += full
        if config.policy == "full":
            swa_page_steps += full
        else:
            # Pages spanning [max(0, len - window), len).
            swa_page_steps += full - (_sum_floor(end - window, ps) - _sum_floor(start - window, ps))
    if not decode_steps:
        return 0.0
    if config.budget == SHARED:
        # One budget: its parents over the parents a running request holds at least (a
        # small side that strands no partly used parent).
        full_a_parent, swa_a_parent = _pages_a_parent(config)
        return _shared_parents(config, ps) * decode_steps / (full_page_steps / full_a_parent
                                                            + swa_page_steps / swa_a_parent)
    if config.budget == ARENA:
        # Its bytes over the bytes a running request holds at least.
        arena = arena_geometry(scenario)
        return arena.gap_bytes * decode_steps / (full_page_steps * arena.full_page_bytes
                                                 + swa_page_steps * arena.swa_page_bytes)
    return min(
        config.size_full // ps * decode_steps / full_page_steps,
        config.size_swa // ps * decode_steps / swa_page_steps,
    )
