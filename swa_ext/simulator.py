"""A decode node of a prefill/decode-disaggregated deployment, simulated step by
step over a request trace with the real ``swa_ext`` allocator and the
``swa_ext.decode`` lifecycle.

Each step: requests that have arrived are preallocated in FIFO order while the
pools can hold them and still leave the pages this step's decode takes; the
batch decodes one token per request (one ``alloc_decode``); SWA KV that fell out
of the window is freed; finished requests are released. When the decode allocation is refused,
the newest running request is retracted (released and put back at the head of
the queue, keeping the tokens it has produced) and the allocation retried.

Three policies share the trace and the KV memory budget:
- ``full``: SWA layers keep every token (no SWA support): the SWA pool is as
  large as the full pool and nothing is evicted;
- ``evict``: the whole prompt is allocated on both pools, then out-of-window SWA
  KV is freed while decoding;
- ``tail``: only the window tail of the prompt gets SWA KV at preallocation,
  then eviction as in ``evict``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from swa_ext.models import ModelConfig
from swa_ext.traces import Request

POLICIES = ("full", "evict", "tail")

GIB = 1 << 30


class SimulationError(ValueError):
    """The simulation cannot run with these settings; the message says why."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tail_swa_pages_bound(window: int, page_size: int) -> int:
    """The most SWA pages one request holds under window eviction: the tokens
    from the page-aligned eviction point up to the one just allocated span at
    most window + page_size + 1 tokens, starting on a page boundary."""
    return _cdiv(window + 1, page_size) + 1


def default_swa_ratio(model: ModelConfig, requests: list[Request], page_size: int) -> float:
    """SWA pool tokens per full pool token for `evict` and `tail`: the SWA tokens
    the requests hold under window eviction at their final length, over their full
    tokens. With every request resident, both pools would then fill together."""
    span = tail_swa_pages_bound(model.window, page_size) * page_size
    total = sum(r.prompt_len + r.output_len for r in requests)
    if total == 0:
        return 1.0
    swa = sum(min(r.prompt_len + r.output_len, span) for r in requests)
    return min(1.0, swa / total)


def pool_sizes(model: ModelConfig, kv_memory_bytes: float, page_size: int, swa_ratio: float) -> tuple[int, int]:
    """Token sizes (size_full, size_swa) of the two pools that fit the budget when
    the SWA pool holds ``swa_ratio`` tokens per full pool token. Sizes are whole
    pages; one page of each pool is the padding page and is not counted."""
    bytes_per_full_token = model.full_bytes_per_token + swa_ratio * model.swa_bytes_per_token
    full_pages = int(kv_memory_bytes // (bytes_per_full_token * page_size))
    swa_pages = int(full_pages * swa_ratio)
    return max(full_pages - 1, 0) * page_size, max(swa_pages - 1, 0) * page_size


@dataclass(frozen=True)
class Node:
    """What every policy of one run shares: the model, the step and time scale,
    the requests replayed, and each policy's pool sizes (same total bytes)."""

    model: ModelConfig
    page_size: int
    kv_memory_gib: float
    swa_ratio: float
    step_ms: float
    time_scale: float
    requests: list[Request]
    skipped_over_context: int
    skipped_over_memory: int
    skipped_no_output: int
    pools: dict[str, tuple[int, int]]

    @property
    def skipped(self) -> int:
        return self.skipped_over_context + self.skipped_over_memory + self.skipped_no_output


def _pages_needed(policy: str, total_len: int, window: int, page_size: int) -> tuple[int, int]:
    """Full and SWA pages a request of final length ``total_len`` may hold at
    once, plus one: enough for any (re)admission and the decode step after it."""
    full = _cdiv(total_len, page_size)
    swa = full if policy != "tail" else min(full, tail_swa_pages_bound(window, page_size))
    return full + 1, swa + 1


def plan_node(
    requests: list[Request],
    model: ModelConfig,
    *,
    page_size: int = 64,
    kv_memory_gib: float = 40.0,
    swa_ratio: float | None = None,
    step_ms: float = 20.0,
    time_scale: float = 1.0,
) -> Node:
    """Size the pools and choose the requests to replay. A request is skipped,
    under every policy alike, when its prompt plus output exceeds the model's
    context, when it has no output to decode, or when it would not fit an empty
    node under one of the policies."""
    if page_size < 1:
        raise SimulationError(f"page size must be positive, got {page_size}")
    if swa_ratio is not None and not 0 < swa_ratio <= 1:
        raise SimulationError(f"SWA ratio must be in (0, 1], got {swa_ratio}")
    if kv_memory_gib <= 0 or step_ms <= 0 or time_scale <= 0:
        raise SimulationError("KV memory, step time and time scale must be positive")
    in_context = [r for r in requests if r.prompt_len + r.output_len <= model.context_len]
    with_output = [r for r in in_context if r.output_len > 0]
    ratio = swa_ratio if swa_ratio is not None else default_swa_ratio(model, with_output, page_size)
    budget = kv_memory_gib * GIB
    pools = {
        policy: pool_sizes(model, budget, page_size, 1.0 if policy == "full" else ratio)
        for policy in POLICIES
    }

    def fits(r: Request) -> bool:
        for policy, (size_full, size_swa) in pools.items():
            full, swa = _pages_needed(policy, r.prompt_len + r.output_len, model.window, page_size)
            if full > size_full // page_size or swa > size_swa // page_size:
                return False
        return True

    replayed = [r for r in with_output if fits(r)]
    if with_output and not replayed:
        shortest = min(with_output, key=lambda r: r.prompt_len + r.output_len)
        full_tokens = pools["full"][0]
        raise SimulationError(
            f"{kv_memory_gib:g} GiB of KV memory is too small for one request: the "
            f"'full' policy's pools hold {full_tokens} tokens each, the shortest "
            f"request needs {shortest.prompt_len + shortest.output_len} plus a page"
        )
    if not replayed:
        raise SimulationError("no request of the trace fits the model's context and has output")
    return Node(
        model=model,
        page_size=page_size,
        kv_memory_gib=kv_memory_gib,
        swa_ratio=ratio,
        step_ms=step_ms,
        time_scale=time_scale,
        requests=replayed,
        skipped_over_context=len(requests) - len(in_context),
        skipped_no_output=len(in_context) - len(with_output),
        skipped_over_memory=len(with_output) - len(replayed),
        pools=pools,
    )


@dataclass
class PolicyResult:
    policy: str
    size_full: int
    size_swa: int
    page_size: int
    requests: int
    skipped: int
    completed: int = 0
    retractions: int = 0
    retracted_tokens: int = 0  # tokens held by retracted requests, prefilled again later
    steps: int = 0
    max_running: int = 0
    mean_running: float = 0.0
    peak_full_pages: int = 0
    peak_swa_pages: int = 0
    max_swa_pages_per_request: int = 0
    queue_wait_p50_steps: float = 0.0
    queue_wait_p99_steps: float = 0.0
    decode_tokens_per_step: float = 0.0
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

    SUMMARY_KEYS = (
        "completed",
        "retractions",
        "max_running",
        "mean_running",
        "peak_full_pages",
        "peak_swa_pages",
        "max_swa_pages_per_request",
        "queue_wait_p50_steps",
        "queue_wait_p99_steps",
        "decode_tokens_per_step",
        "alloc_us_per_step_median",
        "retracted_tokens",
        "steps",
        "skipped",
    )

    def summary(self) -> dict:
        out = {k: getattr(self, k) for k in self.SUMMARY_KEYS}
        out["pool_full_pages"] = self.size_full // self.page_size
        out["pool_swa_pages"] = self.size_swa // self.page_size
        return out


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


def simulate(node: Node, policy: str, *, allocator_factory=default_allocator, progress: bool = False) -> PolicyResult:
    """Replay ``node.requests`` under one policy; ``allocator_factory(size_full,
    size_swa, page_size)`` builds the allocator."""
    from swa_ext import decode

    if policy not in POLICIES:
        raise SimulationError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    requests = node.requests
    ps = node.page_size
    window = node.model.window
    evicts = policy != "full"
    size_full, size_swa = node.pools[policy]
    allocator = allocator_factory(size_full, size_swa, ps)
    full_pages_total = size_full // ps
    swa_pages_total = size_swa // ps

    n = len(requests)
    targets = [r.prompt_len + r.output_len for r in requests]
    max_len = max(targets)
    # Every running request holds at least one full page.
    req_pool = decode.ReqToTokenPool(min(n, full_pages_total), max_len, "cpu", dtype=torch.int64)
    req_to_token = req_pool.req_to_token

    steps_per_s = 1000.0 / node.step_ms
    arrival_step = [int(r.arrival_s * node.time_scale * steps_per_s) for r in requests]
    waited = [0] * n  # steps in the queue, over all of a request's admissions
    completed_waits: list[int] = []
    enqueued_at = [0] * n
    queue: deque[tuple[int, int]] = deque()  # (request, tokens to preallocate)

    # The running batch in admission order (so the newest is last).
    batch_req: list[int] = []
    rows = torch.empty(0, dtype=torch.int64)
    seq_lens = torch.empty(0, dtype=torch.int64)  # committed lengths
    evicted = torch.empty(0, dtype=torch.int64)
    target_lens = torch.empty(0, dtype=torch.int64)

    res = PolicyResult(policy, size_full, size_swa, ps, requests=n, skipped=node.skipped)
    alloc_us: list[float] = []
    # One token per running request per step: the decode tokens are also the
    # running-request steps.
    decode_tokens = 0
    next_arrival = 0
    step = arrival_step[0]
    first_step = step
    last_step = step

    def retract_newest() -> None:
        nonlocal rows, seq_lens, evicted, target_lens
        i = batch_req.pop()
        row, seq_len, ev = int(rows[-1]), int(seq_lens[-1]), int(evicted[-1])
        with watch:
            decode.release(allocator, req_to_token, row, seq_len, ev)
        req_pool.free(row)
        rows, seq_lens, evicted, target_lens = rows[:-1], seq_lens[:-1], evicted[:-1], target_lens[:-1]
        queue.appendleft((i, seq_len))
        enqueued_at[i] = step
        res.retractions += 1
        res.retracted_tokens += seq_len

    bar = tqdm(total=n, desc=f"{node.model.name} {policy}", unit="req", disable=None if progress else True, leave=False)
    with bar:
        while res.completed < n:
            while next_arrival < n and arrival_step[next_arrival] <= step:
                queue.append((next_arrival, requests[next_arrival].prompt_len))
                enqueued_at[next_arrival] = arrival_step[next_arrival]
                next_arrival += 1
            if not batch_req and not queue:
                step = arrival_step[next_arrival]
                continue
            watch = _Stopwatch()  # allocator calls of this step

            # Admission, FIFO, while the pools hold the request and leave the
            # pages the coming decode step takes (a request whose committed length
            # is a page multiple starts a new page).
            free_full = allocator.full_available_size() // ps
            free_swa = allocator.swa_available_size() // ps
            step_pages = int((seq_lens % ps == 0).sum())
            new_req, new_rows, new_seq, new_ev = [], [], [], []
            while queue:
                i, fill = queue[0]
                admit_window = window if policy == "tail" else fill
                tail = decode.swa_tail_len(fill, admit_window, ps)
                first_page = int(fill % ps == 0)
                need_full = _cdiv(fill, ps) + first_page
                need_swa = _cdiv(tail, ps) + first_page
                if need_full + step_pages > free_full or need_swa + step_pages > free_swa:
                    break
                got = req_pool.alloc(1)
                if got is None:
                    break
                with watch:
                    placed = decode.pre_alloc(allocator, req_to_token, got[0], fill, admit_window)
                if placed is None:
                    req_pool.free(got[0])
                    break
                queue.popleft()
                waited[i] += step - enqueued_at[i]
                free_full -= need_full - first_page
                free_swa -= need_swa - first_page
                step_pages += first_page
                new_req.append(i)
                new_rows.append(got[0])
                new_seq.append(fill)
                new_ev.append(placed[1])
            if new_req:
                batch_req.extend(new_req)
                rows = torch.cat([rows, torch.tensor(new_rows, dtype=torch.int64)])
                seq_lens = torch.cat([seq_lens, torch.tensor(new_seq, dtype=torch.int64)])
                evicted = torch.cat([evicted, torch.tensor(new_ev, dtype=torch.int64)])
                target_lens = torch.cat([target_lens, torch.tensor([targets[i] for i in new_req], dtype=torch.int64)])

            # One decode token per running request.
            while batch_req:
                new_lens = seq_lens + 1
                last_loc = req_to_token[rows, seq_lens - 1]
                with watch:
                    out = allocator.alloc_decode(new_lens, new_lens, last_loc)
                if out is not None:
                    req_to_token[rows, seq_lens] = out
                    seq_lens = new_lens
                    break
                retract_newest()
            bs = len(batch_req)
            if bs:
                full_used = full_pages_total - allocator.full_available_size() // ps
                swa_used = swa_pages_total - allocator.swa_available_size() // ps
                per_req_swa = int((torch.div(seq_lens + ps - 1, ps, rounding_mode="floor") - evicted // ps).max())
                res.timeline_step.append(step)
                res.timeline_running.append(bs)
                res.timeline_full_pages.append(full_used)
                res.timeline_swa_pages.append(swa_used)
                res.max_running = max(res.max_running, bs)
                res.peak_full_pages = max(res.peak_full_pages, full_used)
                res.peak_swa_pages = max(res.peak_swa_pages, swa_used)
                res.max_swa_pages_per_request = max(res.max_swa_pages_per_request, per_req_swa)
                decode_tokens += bs

                if evicts:
                    pre_lens = seq_lens - 1
                    with watch:
                        evicted = decode.evict_out_of_window(allocator, req_to_token, rows, pre_lens, evicted, window)

                done = seq_lens >= target_lens
                if bool(done.any()):
                    for k in done.nonzero().flatten().tolist():
                        row, seq_len, i = int(rows[k]), int(seq_lens[k]), batch_req[k]
                        with watch:
                            decode.release(allocator, req_to_token, row, seq_len, int(evicted[k]))
                        req_pool.free(row)
                        res.completed_lens[requests[i].rid] = seq_len
                        completed_waits.append(waited[i])
                    keep = ~done
                    batch_req = [r for r, d in zip(batch_req, done.tolist()) if not d]
                    rows, seq_lens, evicted, target_lens = rows[keep], seq_lens[keep], evicted[keep], target_lens[keep]
                    finished = int(done.sum())
                    res.completed += finished
                    bar.update(finished)
                    last_step = step
            alloc_us.append(watch.total * 1e6)
            step += 1

    res.steps = last_step - first_step + 1
    res.mean_running = decode_tokens / res.steps
    res.decode_tokens_per_step = decode_tokens / res.steps
    res.queue_wait_p50_steps = _percentile(completed_waits, 50)
    res.queue_wait_p99_steps = _percentile(completed_waits, 99)
    res.alloc_us_per_step_median = statistics.median(alloc_us) if alloc_us else 0.0
    return res


def run(node: Node, policies=POLICIES, *, allocator_factory=default_allocator, progress: bool = False) -> dict[str, PolicyResult]:
    return {p: simulate(node, p, allocator_factory=allocator_factory, progress=progress) for p in policies}


def report(results: dict[str, PolicyResult]) -> dict:
    """The JSON report: one object of metrics per policy."""
    return {policy: r.summary() for policy, r in results.items()}


def format_table(node: Node, results: dict[str, PolicyResult]) -> str:
    m = node.model
    lines = [
        f"model {m.name}: window {m.window}, {m.swa_layers} SWA + {m.full_layers} full layers, "
        f"{m.kv_heads} KV heads x {m.head_dim}; page {node.page_size}; "
        f"KV memory {node.kv_memory_gib:g} GiB; SWA ratio {node.swa_ratio:.3f} (evict, tail)",
        f"requests {len(node.requests)} replayed, {node.skipped} skipped "
        f"({node.skipped_over_context} over context, {node.skipped_over_memory} over memory, "
        f"{node.skipped_no_output} without output); step {node.step_ms:g} ms, time scale {node.time_scale:g}",
    ]
    policies = list(results)
    keys = ["pool_full_pages", "pool_swa_pages"] + [k for k in PolicyResult.SUMMARY_KEYS if k != "skipped"]
    summaries = {p: results[p].summary() for p in policies}
    name_w = max(len(k) for k in keys)
    col_w = 12
    lines.append("")
    lines.append(f"{'':<{name_w}}" + "".join(f"{p:>{col_w}}" for p in policies))
    for key in keys:
        cells = []
        for p in policies:
            v = summaries[p][key]
            cells.append(f"{v:>{col_w}.1f}" if isinstance(v, float) else f"{v:>{col_w}d}")
        lines.append(f"{key:<{name_w}}" + "".join(cells))
    return "\n".join(lines)


def plot(node: Node, results: dict[str, PolicyResult], path: str) -> None:
    """Running requests and KV memory in use on each pool over simulated time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = node.page_size
    page_gib = {
        "full": node.model.full_bytes_per_token * ps / GIB,
        "swa": node.model.swa_bytes_per_token * ps / GIB,
    }
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for policy, r in results.items():
        t = [s * node.step_ms / 1000.0 for s in r.timeline_step]
        # evict and tail often coincide; dashes keep both visible.
        style = {"lw": 0.9, "ls": "--" if policy == "evict" else "-"}
        line = axes[0].plot(t, r.timeline_running, label=policy, **style)[0]
        color = line.get_color()
        axes[1].plot(t, [p * page_gib["full"] for p in r.timeline_full_pages], color=color, **style)
        axes[1].axhline(r.size_full // ps * page_gib["full"], color=color, ls=":", lw=0.8)
        axes[2].plot(t, [p * page_gib["swa"] for p in r.timeline_swa_pages], color=color, **style)
        axes[2].axhline(r.size_swa // ps * page_gib["swa"], color=color, ls=":", lw=0.8)
    axes[0].set_ylabel("running requests")
    axes[1].set_ylabel("full pool in use (GiB)")
    axes[2].set_ylabel("SWA pool in use (GiB)")
    axes[2].set_xlabel("simulated time (s); dotted: pool size")
    axes[0].legend()
    axes[0].set_title(
        f"{node.model.name}, {len(node.requests)} requests, {node.kv_memory_gib:g} GiB KV, "
        f"page {ps}, time scale {node.time_scale:g}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
