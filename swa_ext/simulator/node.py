"""One policy's decode node, replayed step by step on the real allocator and the
``swa_ext.decode`` lifecycle; its result (docs/simulator.md: "The node")."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from swa_ext.traces import Request

from .scenario import EVICTING, GIB, PolicyConfig, Scenario, _cdiv, capacity_bound, fits_empty_node

@dataclass
class PolicyResult:
    policy: str
    swa_ratio: float
    size_full: int
    size_swa: int
    page_size: int
    eviction_interval: int
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
    timeline_transfer_gib: list[float] = field(default_factory=list)  # transfer_gib so far
    # Final length of every completed request, by trace position.
    completed_lens: dict[int, int] = field(default_factory=dict)
    # The SWA ratios tried for this policy, when it was swept: one summary each.
    sweep: list[dict] = field(default_factory=list)
    # The trace whose sweep chose this run's SWA ratio, when it is not the run's own.
    tuned_on: str | None = None

    SUMMARY_KEYS = (
        "swa_ratio",
        "eviction_interval",
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


def default_allocator(size_full: int, size_swa: int, page_size: int, shared: bool = False, parent_k: int = 1,
                      small_side: str = "swa"):
    """swa_ext's allocator on the CPU; ``shared``: its shared mode (one free list of parent
    pages, ``parent_k`` pages of ``small_side`` or one of the other side to a parent)."""
    from swa_ext import SWATokenToKVPoolAllocator

    if shared:
        return SWATokenToKVPoolAllocator(size_full, size_swa, page_size, torch.bfloat16, "cpu", shared=True,
                                         parent_k=parent_k, small_side=small_side)
    return SWATokenToKVPoolAllocator(size_full, size_swa, page_size, torch.bfloat16, "cpu")


def sglang_prealloc_demand(window: int | None, need_full: int, swa_own: int, n_active: int, reserve: int,
                           swa_in_use: int) -> tuple[int, int]:
    """The tokens of each side SGLang 0.5.23's PD decode node asks its allocator's
    ``prealloc_fits`` for, the per-side budgets folded back into the demand
    (``disaggregation/decode.py``): on the full side the request's tokens and reserve
    (``need_full``) and the reserve of the ``n_active`` active requests; on the SWA side the
    request's own SWA tokens (``swa_own``; with the radix cache off, as on a decode node by
    default, no SWA reserve of its own) and the active requests' reserve capped by what their
    windows can still grow beyond the ``swa_in_use`` SWA tokens held
    (``_swa_tail_allocatable_token_budget``). ``window`` None: SWA KV is never freed, so
    nothing caps its growth."""
    room = reserve * n_active
    swa_room = room if window is None else min(room, max(0, n_active * window - swa_in_use))
    return need_full + room, swa_own + swa_room


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
        self.requests = [r for r in scenario.requests if fits_empty_node(scenario, config, r)]
        # No allocator for a node that rejects every request: its pools may be empty.
        self.allocator = self._make_allocator(allocator_factory) if self.requests else None
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
            config.policy, config.swa_ratio, config.size_full, config.size_swa, ps, config.eviction_interval,
            requests=len(scenario.requests), rejected=len(scenario.requests) - n, step_ms=scenario.step_ms,
            capacity_bound=capacity_bound(scenario, config, self.requests),
        )
        self.watch = _Stopwatch()  # allocator calls of the current step

    # -- the node's memory: two pools (what a one-budget node overrides) ----

    def _make_allocator(self, allocator_factory):
        return allocator_factory(self.config.size_full, self.config.size_swa, self.page_size)

    def _fits(self, full_tokens: int, swa_tokens: int) -> bool:
        """Whether the pools hold this demand (``prealloc_fits`` of two separate pools:
        each side against its own free count)."""
        alloc = self.allocator
        return full_tokens <= alloc.full_available_size() and swa_tokens <= alloc.swa_available_size()

    def _pre_alloc(self, row: int, fill: int):
        with self.watch:
            return self._decode.pre_alloc(self.allocator, self.req_to_token, row, fill, self._prealloc_window(fill))

    def _alloc_decode(self, new_lens: torch.Tensor, last_loc: torch.Tensor):
        with self.watch:
            return self.allocator.alloc_decode(new_lens, new_lens, last_loc)

    def _pages_in_use(self) -> tuple[int, int]:
        """Full and SWA pages held, as the allocator counts them (in either mode)."""
        ps, alloc = self.page_size, self.allocator
        return alloc.full_used_size() // ps, alloc.swa_used_size() // ps

    # -- the policy's rules ------------------------------------------------

    def _prealloc_window(self, fill: int) -> int:
        """The window ``pre_alloc`` gives SWA KV for: tail preallocates the window
        tail, the other policies the whole prompt."""
        return self.window if self.config.policy == "tail" else fill

    def _swa_fill(self, fill: int) -> int:
        """SWA tokens preallocated for a request of ``fill`` tokens."""
        return self._decode.swa_tail_len(fill, self._prealloc_window(fill), self.page_size)

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
        """FIFO while the head request's demand fits (``sglang_prealloc_demand``, the one
        admission rule of every column, priced by the column's ``_fits``). A lone request
        needs no room: it has the whole node, which it fits."""
        ps = self.page_size
        # Tail preallocation asks for the window tail on the SWA side; the whole-prompt
        # policies ask for the prompt and its reserve on both, as SGLang does at page size 1.
        whole_prompt = self.config.policy != "tail"
        window = self.window if self.config.policy in EVICTING else None
        new_req, new_rows, new_seq, new_ev = [], [], [], []
        while self.queue and (self.config.max_running is None
                              or len(self.batch_req) + len(new_req) < self.config.max_running):
            i, fill = self.queue[0]
            n_active = len(self.batch_req) + len(new_req)
            need_full = _cdiv(fill, ps) * ps + self.reserve
            swa_own = need_full if whole_prompt else _cdiv(self._swa_fill(fill), ps) * ps
            if n_active and not self._fits(*sglang_prealloc_demand(window, need_full, swa_own, n_active, self.reserve,
                                                                    self.allocator.swa_used_size())):
                break
            got = self.req_pool.alloc(1)
            if got is None:
                break
            placed = self._pre_alloc(got[0], fill)
            if placed is None:
                self.req_pool.free(got[0])
                break
            self.queue.popleft()
            self.waited[i] += step - self.enqueued_at[i]
            self.result.transfer_gib += self._transfer_gib(fill)
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
            out = self._alloc_decode(new_lens, last_loc)
            if out is not None:
                self.req_to_token[self.rows, self.seq_lens] = out.to(torch.int32)
                self.seq_lens = new_lens
                return
            self.retract_newest(step)

    def record(self, step: int) -> None:
        """The step's batch and pool use, right after its decode allocation."""
        res, ps = self.result, self.page_size
        bs = len(self.batch_req)
        full_used, swa_used = self._pages_in_use()
        per_req_swa = int((torch.div(self.seq_lens + ps - 1, ps, rounding_mode="floor") - self.evicted // ps).max())
        res.timeline_step.append(step)
        res.timeline_running.append(bs)
        res.timeline_full_pages.append(full_used)
        res.timeline_swa_pages.append(swa_used)
        res.timeline_transfer_gib.append(res.transfer_gib)
        res.max_running = max(res.max_running, bs)
        res.peak_full_pages = max(res.peak_full_pages, full_used)
        res.peak_swa_pages = max(res.peak_swa_pages, swa_used)
        res.max_swa_pages_per_request = max(res.max_swa_pages_per_request, per_req_swa)

    def evict(self) -> None:
        if self.config.policy in EVICTING:
            with self.watch:
                self.evicted = self._decode.evict_out_of_window(
                    self.allocator, self.req_to_token, self.rows, self.seq_lens - 1, self.evicted, self.window,
                    interval=self.config.eviction_interval)

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
