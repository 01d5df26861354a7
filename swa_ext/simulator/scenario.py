"""The simulated node's settings: the scenario every policy shares, the pool sizes a
policy's SWA ratio gives, and what a request needs of an empty node (docs/simulator.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from swa_ext.models import ModelConfig
from swa_ext.traces import Request

POLICIES = ("full", "evict", "tail")
EVICTING = ("evict", "tail")

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


def pool_sizes(model: ModelConfig, kv_memory_bytes: float, page_size: int, swa_ratio: float) -> tuple[int, int]:
    """Token sizes (size_full, size_swa) of the two pools that fit the budget when
    the SWA pool holds ``swa_ratio`` tokens per full pool token (SGLang's
    ``swa_full_tokens_ratio``). Sizes are whole pages; one page of each pool is the
    padding page and is not counted."""
    bytes_per_full_token = model.full_bytes_per_token + swa_ratio * model.swa_bytes_per_token
    full_pages = int(kv_memory_bytes // (bytes_per_full_token * page_size))
    swa_pages = int(full_pages * swa_ratio)
    return max(full_pages - 1, 0) * page_size, max(swa_pages - 1, 0) * page_size


@dataclass(frozen=True)
class Scenario:
    """What every policy's run shares: the model, the node's KV memory and page
    size, the step and time scale, the admission reserve and the requests."""

    model: ModelConfig
    trace: str
    page_size: int
    kv_memory_gib: float
    step_ms: float
    time_scale: float
    reserved_decode_tokens: int
    eviction_interval: int
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
        requests=with_output,
        trace_requests=len(requests),
        skipped_over_context=len(requests) - len(in_context),
        skipped_no_output=len(in_context) - len(with_output),
    )


@dataclass(frozen=True)
class PolicyConfig:
    """One policy's node: its SWA ratio, the pool sizes (tokens) it gives and, when
    the node is sized from it, SGLang's ``--max-running-requests``."""

    policy: str
    swa_ratio: float
    size_full: int
    size_swa: int
    max_running: int | None = None


def policy_config(scenario: Scenario, policy: str, swa_ratio: float) -> PolicyConfig:
    """``full`` always gets ratio 1: its SWA pool holds the same tokens as its full
    pool, so any other ratio would leave memory unused."""
    if policy not in POLICIES:
        raise SimulationError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    ratio = 1.0 if policy == "full" else swa_ratio
    size_full, size_swa = pool_sizes(scenario.model, scenario.kv_memory_gib * GIB, scenario.page_size, ratio)
    if size_full > MAX_POOL_TOKENS:
        raise SimulationError(
            f"{scenario.kv_memory_gib:g} GiB of KV memory gives the {policy!r} policy a full pool of "
            f"{size_full} tokens, more than the {MAX_POOL_TOKENS} int32 slot ids of req_to_token"
        )
    return PolicyConfig(policy, ratio, size_full, size_swa)


def sglang_request_cap_config(scenario: Scenario, policy: str, max_running: int, interval: int) -> PolicyConfig:
    """The node SGLang configures for ``max_running`` requests with radix cache off
    (its request-cap pool configurator): an SWA pool of ``sglang_swa_request_cap``
    tokens per request, in whole pages, and the rest of the KV memory for the full pool."""
    ps, model = scenario.page_size, scenario.model
    size_swa = _cdiv(sglang_swa_request_cap(model.window, ps, interval) * max_running, ps) * ps
    rest = scenario.kv_memory_gib * GIB - size_swa * model.swa_bytes_per_token
    full_pages = int(rest // (model.full_bytes_per_token * ps)) - 1  # less the padding page
    if full_pages <= 0:
        raise SimulationError(
            f"{scenario.kv_memory_gib:g} GiB of KV memory cannot hold SGLang's SWA pool for {max_running} "
            f"requests at eviction interval {interval}")
    size_full = min(full_pages * ps, MAX_POOL_TOKENS // ps * ps)
    return PolicyConfig(policy, size_swa / size_full, size_full, size_swa, max_running)


def _pages_needed(policy: str, total_len: int, window: int, page_size: int, interval: int) -> tuple[int, int]:
    """Full and SWA pages a request of final length ``total_len`` may hold at
    once, plus one: enough for any (re)admission and the decode step after it."""
    full = _cdiv(total_len, page_size)
    swa = full if policy != "tail" else min(full, tail_swa_pages_bound(window, page_size, interval))
    return full + 1, swa + 1


def fits_empty_node(scenario: Scenario, config: PolicyConfig, request: Request) -> bool:
    ps = scenario.page_size
    full, swa = _pages_needed(config.policy, request.prompt_len + request.output_len, scenario.model.window, ps,
                              scenario.eviction_interval)
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
    return min(
        config.size_full // ps * decode_steps / full_page_steps,
        config.size_swa // ps * decode_steps / swa_page_steps,
    )
