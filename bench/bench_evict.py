"""Batched window eviction against the per-request loop (not a timed test).

For each device, batch size and window, a decode batch is built the way a decode
node builds it: every request preallocated with ``swa_ext.decode.pre_alloc``
(window tail only on the SWA side), then decoded ``page_size + 1`` steps without
eviction, so that at the measured step every request has exactly one SWA page
out of the window: the step the issue's 90 us a request is about. The same step
is then timed, alternating, with

- ``native``: ``swa_ext.decode.evict_out_of_window``, one native call for the batch;
- ``per_request``: ``evict_per_request`` (bench/evict_baseline.py), one
  ``free_swa_segment`` call per due request, as SGLang's scheduler does;

with the allocator restored (``restore_state``) before every timed call. Before
timing, both are run once from the same state and must leave identical allocator
states and evicted lengths.

Run as ``python -m swa_ext_bench.bench_evict`` or ``python bench/bench_evict.py``.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import swa_ext
from swa_ext import decode
from swa_ext_bench.evict_baseline import evict_per_request

SIZES = (1, 64, 512, 2048)
WINDOWS = (128, 4096)
PAGE_SIZE = 64


def default_devices() -> list[str]:
    devices = ["cpu"]
    if torch.cuda.is_available() and swa_ext.built_with_cuda():
        devices.append("cuda")
    return devices


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def build_batch(num_requests: int, window: int, page_size: int, device: str, seed: int):
    """A decode batch one step before every request evicts one SWA page.

    Prompt lengths are ``window + page_size + r`` with ``r`` in ``[0, page_size - 1)``
    (0 when the page size is 1), so preallocation leaves the evicted length at
    ``page_size`` and ``page_size + 1`` decode steps later the window has passed
    exactly one more page. Returns ``(allocator, req_to_token, rows, pre_lens,
    evicted)``; the lengths are CPU int64 tensors.
    """
    rng = random.Random(seed)
    fills = [window + page_size + rng.randrange(max(page_size - 1, 1)) for _ in range(num_requests)]
    max_len = window + 3 * page_size
    pages_per_request = -(-max_len // page_size)
    allocator = swa_ext.SWATokenToKVPoolAllocator(
        num_requests * pages_per_request * page_size, num_requests * pages_per_request * page_size,
        page_size, torch.bfloat16, device)
    pool = decode.ReqToTokenPool(num_requests, max_len, device)
    req_to_token = pool.req_to_token
    rows = pool.alloc(num_requests)
    evicted = []
    for row, fill in zip(rows, fills):
        placed = decode.pre_alloc(allocator, req_to_token, row, fill, window)
        if placed is None:
            raise RuntimeError("the benchmark's pools are too small for its batch")
        evicted.append(placed[1])
    rows_cpu = torch.tensor(rows, dtype=torch.int64)
    rows_dev = rows_cpu.to(device)
    seq_lens = torch.tensor(fills, dtype=torch.int64)
    for _ in range(page_size + 1):
        positions = seq_lens.to(device)
        new_lens = seq_lens + 1
        last_loc = req_to_token[rows_dev, positions - 1].to(torch.int64)
        out = allocator.alloc_decode(new_lens.to(device), new_lens, last_loc)
        if out is None:
            raise RuntimeError("the benchmark's pools are too small for its decode steps")
        req_to_token[rows_dev, positions] = out.to(req_to_token.dtype)
        seq_lens = new_lens
    return allocator, req_to_token, rows_cpu, seq_lens - 1, torch.tensor(evicted, dtype=torch.int64)


def _timed(device: str, fn) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def measure(num_requests: int, window: int, page_size: int, device: str, iters: int, seed: int) -> dict:
    allocator, req_to_token, rows, pre_lens, evicted = build_batch(num_requests, window, page_size, device, seed)
    start_state = allocator.backup_state()

    def native():
        return decode.evict_out_of_window(allocator, req_to_token, rows, pre_lens, evicted, window)

    def per_request():
        return evict_per_request(allocator, req_to_token, rows, pre_lens, evicted, window, page_size)

    # Same step both ways, from the same state: same evicted lengths, same allocator state.
    native_result = native().tolist()
    native_state = allocator.backup_state()
    allocator.restore_state(start_state)
    per_request_result = per_request()
    if native_result != per_request_result or not allocator.backup_state() == native_state:
        raise AssertionError(f"batched and per-request eviction differ ({device}, {num_requests} requests, "
                             f"window {window})")
    freed_pages = sum(new - old for new, old in zip(native_result, evicted.tolist())) // page_size

    native_s, per_request_s = [], []
    for it in range(iters):
        # Alternate which goes first so neither always runs on a warmer cache.
        order = ((native, native_s), (per_request, per_request_s))
        for fn, samples in order if it % 2 == 0 else order[::-1]:
            allocator.restore_state(start_state)
            samples.append(_timed(device, fn))
    allocator.restore_state(start_state)
    native_us = statistics.median(native_s) * 1e6
    per_request_us = statistics.median(per_request_s) * 1e6
    return {
        "device": device,
        "requests": num_requests,
        "window": window,
        "page_size": page_size,
        "freed_pages": freed_pages,
        "iters": iters,
        "native_us": native_us,
        "per_request_us": per_request_us,
        "ratio": per_request_us / native_us,
    }


def run(sizes=SIZES, windows=WINDOWS, page_size: int = PAGE_SIZE, devices=None, iters: int = 30,
        seed: int = 0, smoke: bool = False) -> list[dict]:
    """One row per (device, window, batch size): median microseconds of both ways and their ratio.

    ``smoke`` runs each case twice only (a check that the benchmark works, not a measurement).
    """
    if iters < 1:
        raise ValueError(f"iters: must be >= 1, got {iters}")
    if smoke:
        iters = 2
    rows = []
    for device in devices or default_devices():
        for window in windows:
            for n in sizes:
                rows.append(measure(n, window, page_size, device, iters, seed))
    return rows


def format_table(rows: list[dict]) -> str:
    header = (f"{'device':>6} {'window':>6} {'requests':>8} {'freed pages':>11} "
              f"{'native us':>10} {'per-request us':>14} {'ratio':>8}")
    lines = [header]
    for r in rows:
        lines.append(f"{r['device']:>6} {r['window']:>6} {r['requests']:>8} {r['freed_pages']:>11} "
                     f"{r['native_us']:>10.1f} {r['per_request_us']:>14.1f} {r['ratio']:>7.1f}x")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=_int_list, default=list(SIZES), help="batch sizes, comma separated")
    parser.add_argument("--windows", type=_int_list, default=list(WINDOWS), help="windows, comma separated")
    parser.add_argument("--page-size", type=int, default=PAGE_SIZE)
    parser.add_argument("--device", choices=("cpu", "cuda", "all"), default="all",
                        help="all: the CPU, and CUDA when there is a GPU and the extension has CUDA kernels")
    parser.add_argument("--iters", type=int, default=30, help="timed calls of each way per case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="two iterations per case: check that it runs")
    args = parser.parse_args(argv)
    devices = default_devices() if args.device == "all" else [args.device]
    rows = run(args.sizes, args.windows, args.page_size, devices, args.iters, args.seed, args.smoke)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
