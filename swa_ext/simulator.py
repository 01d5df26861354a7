"""A decode node of a prefill/decode-disaggregated deployment, simulated step by
step over a request trace with the real ``swa_ext`` allocator and the
``swa_ext.decode`` lifecycle.

Each step the node (``DecodeNode``):
- admits queued requests in FIFO order, as SGLang's PD decode node does
  (``DecodePreallocQueue``): a request is preallocated only while the pools hold
  its KV plus ``reserved_decode_tokens`` of decode room for it and for every
  running request; a retracted request waits at the head of the queue, so new
  requests pass it only once it has resumed;
- decodes one token per running request (one ``alloc_decode``); when that is
  refused, the newest running request is retracted (its KV released, to be
  transferred or recomputed again when it resumes) and the allocation retried;
- frees the SWA KV that fell out of the window, every ``eviction_interval``
  tokens a request has slid past it (SGLang's ``SGLANG_SWA_EVICTION_INTERVAL``);
- releases finished requests.

Three policies replay the same requests with the same KV memory:
- ``full``: SWA layers keep every token (an engine without SWA support): the SWA
  pool is as large as the full pool and nothing is evicted;
- ``evict``: the whole prompt is allocated on both pools, then out-of-window SWA
  KV is freed while decoding;
- ``tail``: only the window tail of the prompt gets SWA KV at preallocation,
  then eviction as in ``evict``.

A request that cannot run on a policy's empty node is ``rejected`` by that policy
alone. ``evict`` and ``tail`` are each run at their best SWA ratio of a coarse
sweep and at SGLang's default ``swa_full_tokens_ratio``, unless a ratio is pinned.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

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


@dataclass
class PolicyResult:
    policy: str
    swa_ratio: float
    size_full: int
    size_swa: int
    page_size: int
    requests: int
    rejected: int = 0
    completed: int = 0
    retractions: int = 0
    retracted_tokens: int = 0  # tokens held by retracted requests, transferred or recomputed again
    retracted_gib: float = 0.0  # their KV bytes
    transfer_gib: float = 0.0  # KV bytes preallocated for transfer, resumed requests included
    steps: int = 0
    max_running: int = 0
    mean_running: float = 0.0
    capacity_bound: float = 0.0
    peak_full_pages: int = 0
    peak_swa_pages: int = 0
    max_swa_pages_per_request: int = 0
    queue_wait_p50_steps: float = 0.0
    queue_wait_p99_steps: float = 0.0
    step_ms: float = 0.0  # simulated time of a step, for the waits in seconds
    alloc_us_per_step_median: float = 0.0
    # One entry per simulated step with a batch: the step, the batch size at
    # decode, and the pages in use on each pool right after the decode allocation
    # (before eviction and releases, so the step's peak).
    timeline_step: list[int] = field(default_factory=list)
    timeline_running: list[int] = field(default_factory=list)
    timeline_full_pages: list[int] = field(default_factory=list)
    timeline_swa_pages: list[int] = field(default_factory=list)
    # Final length of every completed request, by trace position.
    completed_lens: dict[int, int] = field(default_factory=dict)
    # The SWA ratios tried for this policy, when it was swept: one summary each.
    sweep: list[dict] = field(default_factory=list)

    SUMMARY_KEYS = (
        "swa_ratio",
        "pool_full_pages",
        "pool_swa_pages",
        "rejected",
        "completed",
        "retractions",
        "retracted_tokens",
        "retracted_gib",
        "transfer_gib",
        "max_running",
        "mean_running",
        "capacity_bound",
        "bound_reached",
        "peak_full_pages",
        "peak_swa_pages",
        "max_swa_pages_per_request",
        "queue_wait_p50_steps",
        "queue_wait_p50_s",
        "queue_wait_p99_steps",
        "queue_wait_p99_s",
        "steps",
        "alloc_us_per_step_median",
    )
    SWEEP_KEYS = ("swa_ratio", "rejected", "retractions", "mean_running", "capacity_bound")

    @property
    def queue_wait_p50_s(self) -> float:
        return self.queue_wait_p50_steps * self.step_ms / 1000.0

    @property
    def queue_wait_p99_s(self) -> float:
        return self.queue_wait_p99_steps * self.step_ms / 1000.0

    @property
    def bound_reached(self) -> float:
        return self.mean_running / self.capacity_bound if self.capacity_bound else 0.0

    @property
    def pool_full_pages(self) -> int:
        return self.size_full // self.page_size

    @property
    def pool_swa_pages(self) -> int:
        return self.size_swa // self.page_size

    def summary(self) -> dict:
        out = {k: getattr(self, k) for k in self.SUMMARY_KEYS}
        if self.sweep:
            out["swa_ratio_sweep"] = self.sweep
        return out

    def sweep_point(self) -> dict:
        return {k: getattr(self, k) for k in self.SWEEP_KEYS}


def _percentile(values: list[int], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[rank - 1])


class _Stopwatch:
    """Adds up the wall time spent inside its ``with`` blocks."""

    def __init__(self) -> None:
        self.total = 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.total += time.perf_counter() - self._start


def default_allocator(size_full: int, size_swa: int, page_size: int):
    from swa_ext import SWATokenToKVPoolAllocator

    return SWATokenToKVPoolAllocator(size_full, size_swa, page_size, torch.bfloat16, "cpu")


def _max_resident(requests: list[Request], full_pages: int, page_size: int) -> int:
    """The most requests that can be resident at once: each holds at least its
    prompt's full pages. Sizes the req_to_token table."""
    resident = used = 0
    for pages in sorted(_cdiv(r.prompt_len, page_size) for r in requests):
        used += pages
        if used > full_pages:
            break
        resident += 1
    return max(resident, 1)


class DecodeNode:
    """One policy's decode node replaying a scenario's requests: ``run`` calls
    ``arrive``, ``admit``, ``decode``, ``evict`` and ``finish`` once per step."""

    def __init__(self, scenario: Scenario, config: PolicyConfig, *, allocator_factory=default_allocator):
        from swa_ext import decode

        self._decode = decode
        self.scenario = scenario
        self.config = config
        self.page_size = ps = scenario.page_size
        self.window = scenario.model.window
        self.reserve = scenario.reserved_decode_tokens
        # The most SWA tokens a request holds under eviction (page granular).
        self.swa_span = tail_swa_pages_bound(self.window, ps, scenario.eviction_interval) * ps
        self.requests = [r for r in scenario.requests if fits_empty_node(scenario, config, r)]
        # No allocator for a node that rejects every request: its pools may be empty.
        self.allocator = allocator_factory(config.size_full, config.size_swa, ps) if self.requests else None
        self.targets = [r.prompt_len + r.output_len for r in self.requests]
        n = len(self.requests)
        rows = _max_resident(self.requests, config.size_full // ps, ps) if n else 1
        self.req_pool = decode.ReqToTokenPool(rows, max(self.targets, default=1), "cpu", dtype=torch.int32)
        self.req_to_token = self.req_pool.req_to_token

        steps_per_s = 1000.0 / scenario.step_ms
        self.arrival_step = [int(r.arrival_s * scenario.time_scale * steps_per_s) for r in self.requests]
        self.waited = [0] * n  # steps in the queue, over all of a request's admissions
        self.enqueued_at = [0] * n
        self.completed_waits: list[int] = []
        self.queue: deque[tuple[int, int]] = deque()  # (request, tokens to preallocate)
        self.next_arrival = 0

        # The running batch in admission order (so the newest is last).
        self.batch_req: list[int] = []
        self.rows = torch.empty(0, dtype=torch.int64)
        self.seq_lens = torch.empty(0, dtype=torch.int64)  # committed lengths
        self.evicted = torch.empty(0, dtype=torch.int64)
        self.target_lens = torch.empty(0, dtype=torch.int64)

        self.result = PolicyResult(
            config.policy, config.swa_ratio, config.size_full, config.size_swa, ps,
            requests=len(scenario.requests), rejected=len(scenario.requests) - n, step_ms=scenario.step_ms,
            capacity_bound=capacity_bound(scenario, config, self.requests),
        )
        self.watch = _Stopwatch()  # allocator calls of the current step

    # -- the policy's rules ------------------------------------------------

    def _prealloc_window(self, fill: int) -> int:
        """The window ``pre_alloc`` gives SWA KV for: tail preallocates the window
        tail, the other policies the whole prompt."""
        return self.window if self.config.policy == "tail" else fill

    def _swa_fill(self, fill: int) -> int:
        """SWA tokens preallocated for a request of ``fill`` tokens."""
        return self._decode.swa_tail_len(fill, self._prealloc_window(fill), self.page_size)

    def _swa_room(self, held: torch.Tensor) -> torch.Tensor:
        """SWA decode room kept for requests holding ``held`` SWA tokens: the reserve,
        but under eviction no more than they can still grow (at least one page, the
        decode step allocates before it evicts)."""
        if self.config.policy == "full":
            return torch.full_like(held, self.reserve)
        return (self.swa_span - held).clamp(min=self.page_size).clamp(max=self.reserve)

    def _transfer_gib(self, fill: int) -> float:
        """KV a request of ``fill`` tokens receives at preallocation."""
        m = self.scenario.model
        return (fill * m.full_bytes_per_token + self._swa_fill(fill) * m.swa_bytes_per_token) / GIB

    # -- one step ------------------------------------------------------------

    def arrive(self, step: int) -> None:
        n = len(self.requests)
        while self.next_arrival < n and self.arrival_step[self.next_arrival] <= step:
            i = self.next_arrival
            self.queue.append((i, self.requests[i].prompt_len))
            self.enqueued_at[i] = self.arrival_step[i]
            self.next_arrival += 1

    def admit(self, step: int) -> None:
        """FIFO while the pools hold the head request's KV and decode room for it and
        for every running request (SGLang's ``num_reserved_decode_tokens``). A lone
        request needs no room: it has the whole node, which it fits."""
        ps, alloc = self.page_size, self.allocator
        held_swa = torch.div(self.seq_lens + ps - 1, ps, rounding_mode="floor") * ps - self.evicted
        room_full = self.reserve * len(self.batch_req)
        room_swa = int(self._swa_room(held_swa).sum())
        new_req, new_rows, new_seq, new_ev = [], [], [], []
        while self.queue and (self.config.max_running is None
                              or len(self.batch_req) + len(new_req) < self.config.max_running):
            i, fill = self.queue[0]
            swa_fill = _cdiv(self._swa_fill(fill), ps) * ps
            new_room_swa = int(self._swa_room(torch.tensor([swa_fill]))[0])
            if self.batch_req or new_req:
                need_full = _cdiv(fill, ps) * ps + self.reserve
                if (need_full > alloc.full_available_size() - room_full
                        or swa_fill + new_room_swa > alloc.swa_available_size() - room_swa):
                    break
            got = self.req_pool.alloc(1)
            if got is None:
                break
            with self.watch:
                placed = self._decode.pre_alloc(alloc, self.req_to_token, got[0], fill, self._prealloc_window(fill))
            if placed is None:
                self.req_pool.free(got[0])
                break
            self.queue.popleft()
            self.waited[i] += step - self.enqueued_at[i]
            self.result.transfer_gib += self._transfer_gib(fill)
            room_full += self.reserve
            room_swa += new_room_swa
            new_req.append(i)
            new_rows.append(got[0])
            new_seq.append(fill)
            new_ev.append(placed[1])
        if new_req:
            self.batch_req.extend(new_req)
            self.rows = torch.cat([self.rows, torch.tensor(new_rows, dtype=torch.int64)])
            self.seq_lens = torch.cat([self.seq_lens, torch.tensor(new_seq, dtype=torch.int64)])
            self.evicted = torch.cat([self.evicted, torch.tensor(new_ev, dtype=torch.int64)])
            self.target_lens = torch.cat(
                [self.target_lens, torch.tensor([self.targets[i] for i in new_req], dtype=torch.int64)])

    def _keep(self, keep: torch.Tensor) -> None:
        self.batch_req = [r for r, k in zip(self.batch_req, keep.tolist()) if k]
        self.rows, self.seq_lens = self.rows[keep], self.seq_lens[keep]
        self.evicted, self.target_lens = self.evicted[keep], self.target_lens[keep]

    def _release(self, k: int) -> int:
        """Free the KV and the row of batch entry ``k``; its committed length."""
        row, seq_len = int(self.rows[k]), int(self.seq_lens[k])
        with self.watch:
            self._decode.release(self.allocator, self.req_to_token, row, seq_len, int(self.evicted[k]))
        self.req_pool.free(row)
        return seq_len

    def retract_newest(self, step: int) -> None:
        """Release the newest request and queue it first, with the tokens it has."""
        i = self.batch_req[-1]
        seq_len = self._release(len(self.batch_req) - 1)
        keep = torch.ones(len(self.batch_req), dtype=torch.bool)
        keep[-1] = False
        self._keep(keep)
        self.queue.appendleft((i, seq_len))
        self.enqueued_at[i] = step
        self.result.retractions += 1
        self.result.retracted_tokens += seq_len
        self.result.retracted_gib += self._transfer_gib(seq_len)

    def decode(self, step: int) -> None:
        """One token per running request; retract the newest while that is refused."""
        while self.batch_req:
            new_lens = self.seq_lens + 1
            last_loc = self.req_to_token[self.rows, self.seq_lens - 1].to(torch.int64)
            with self.watch:
                out = self.allocator.alloc_decode(new_lens, new_lens, last_loc)
            if out is not None:
                self.req_to_token[self.rows, self.seq_lens] = out.to(torch.int32)
                self.seq_lens = new_lens
                return
            self.retract_newest(step)

    def record(self, step: int) -> None:
        """The step's batch and pool use, right after its decode allocation."""
        res, ps = self.result, self.page_size
        bs = len(self.batch_req)
        full_used = self.config.size_full // ps - self.allocator.full_available_size() // ps
        swa_used = self.config.size_swa // ps - self.allocator.swa_available_size() // ps
        per_req_swa = int((torch.div(self.seq_lens + ps - 1, ps, rounding_mode="floor") - self.evicted // ps).max())
        res.timeline_step.append(step)
        res.timeline_running.append(bs)
        res.timeline_full_pages.append(full_used)
        res.timeline_swa_pages.append(swa_used)
        res.max_running = max(res.max_running, bs)
        res.peak_full_pages = max(res.peak_full_pages, full_used)
        res.peak_swa_pages = max(res.peak_swa_pages, swa_used)
        res.max_swa_pages_per_request = max(res.max_swa_pages_per_request, per_req_swa)

    def evict(self) -> None:
        if self.config.policy in EVICTING:
            with self.watch:
                self.evicted = self._decode.evict_out_of_window(
                    self.allocator, self.req_to_token, self.rows, self.seq_lens - 1, self.evicted, self.window,
                    interval=self.scenario.eviction_interval)

    def finish(self) -> int:
        """Release the requests that reached their length; how many did."""
        done = self.seq_lens >= self.target_lens
        if not bool(done.any()):
            return 0
        for k in done.nonzero().flatten().tolist():
            i = self.batch_req[k]
            self.result.completed_lens[self.requests[i].rid] = self._release(k)
            self.completed_waits.append(self.waited[i])
        self._keep(~done)
        finished = int(done.sum())
        self.result.completed += finished
        return finished

    def run(self, *, progress: bool = False, desc: str = "") -> PolicyResult:
        res, n = self.result, len(self.requests)
        if not n:
            return res
        alloc_us: list[float] = []
        decode_tokens = 0  # one per running request per step: also the running-request steps
        step = first_step = last_step = self.arrival_step[0]
        bar = tqdm(total=n, desc=desc, unit="req", disable=None if progress else True, leave=False)
        with bar:
            while res.completed < n:
                self.arrive(step)
                if not self.batch_req and not self.queue:
                    step = self.arrival_step[self.next_arrival]
                    continue
                self.watch = _Stopwatch()
                self.admit(step)
                self.decode(step)
                if self.batch_req:
                    self.record(step)
                    decode_tokens += len(self.batch_req)
                    self.evict()
                    finished = self.finish()
                    if finished:
                        bar.update(finished)
                        last_step = step
                alloc_us.append(self.watch.total * 1e6)
                step += 1
        res.steps = last_step - first_step + 1
        res.mean_running = decode_tokens / res.steps
        res.queue_wait_p50_steps = _percentile(self.completed_waits, 50)
        res.queue_wait_p99_steps = _percentile(self.completed_waits, 99)
        res.alloc_us_per_step_median = statistics.median(alloc_us)
        return res


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
