"""How many calls after a caller's double free the allocator raises DeferredError.

With the debug checks off a device store finds a bad free in its ops; each later call
reads the copies of the error record that have landed, without waiting. Emulated, the
next call raises. On a GPU the answer is how far the host runs ahead of the device:
measured here with the device idle, and busy (a kernel of about `--busy-ms` queued on the
allocator's stream before the bad free, as a model's forward pass would be). Each pool
kind: four live allocations, alloc(2 * ps), free it twice, then alternating alloc(ps) and
a free of a live allocation until DeferredError (at most --max-calls). Prints one line per
case and a last line with the largest count; exits 1 if a case never raised.

    python bench/deferred_error_latency.py --kernels cuda
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import swa_ext


def calls_to_raise(kind, page_size, kernels, busy_ms=0.0, max_calls=200, need_sort=False):
    """(calls after the bad free until DeferredError or None, its message, padding slots handed
    out, seconds). tests/test_misuse.py holds the emulated device to its bound with it."""
    dev = "cuda" if kernels == "cuda" else "cpu"
    if kind == "paged":
        alloc = swa_ext.PagedTokenToKVPoolAllocator(64 * page_size, page_size, torch.bfloat16, dev,
                                                    need_sort=need_sort, kernels=kernels)
    else:
        alloc = swa_ext.SWATokenToKVPoolAllocator(64 * page_size, 32 * page_size, page_size, torch.bfloat16, dev,
                                                  need_sort=need_sort, kernels=kernels)
    live = [alloc.alloc(page_size) for _ in range(4)]
    twice = alloc.alloc(2 * page_size)
    alloc.free(twice)
    if dev == "cuda":
        torch.cuda.synchronize()
        if busy_ms > 0:  # about busy_ms of GPU time (at about 1.8 GHz) queued before the bad free
            torch.cuda._sleep(int(busy_ms * 1_800_000))
    start = time.perf_counter()
    alloc.free(twice)  # the bad call
    handed = []  # read after the loop: reading a device tensor would wait for the device
    raised_at, message = None, None
    for call in range(1, max_calls + 1):
        try:
            if call % 2:
                out = alloc.alloc(page_size)
                if out is not None:
                    handed.append(out)
                    live.append(out)
            elif live:
                alloc.free(live.pop(0))
        except swa_ext.DeferredError as e:
            raised_at, message = call, str(e)
            break
    seconds = time.perf_counter() - start
    padding = sum(out.cpu().tolist().count(0) for out in handed)
    return raised_at, message, padding, seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", choices=["emulated", "cuda"], default="cuda")
    parser.add_argument("--busy-ms", type=float, default=20.0, help="the busy case's queued kernel (cuda only)")
    parser.add_argument("--max-calls", type=int, default=2000)
    args = parser.parse_args(argv)
    worst, never = 0, []
    loads = [("idle", 0.0)] + ([("busy", args.busy_ms)] if args.kernels == "cuda" else [])
    for load, busy_ms in loads:
        for kind in ("paged", "hybrid"):
            for ps in (1, 16):
                calls, _, padding, seconds = calls_to_raise(kind, ps, args.kernels, busy_ms, args.max_calls)
                label = f"{args.kernels} {load} {kind} ps={ps}"
                if calls is None:
                    never.append(label)
                    print(f"deferred-error latency: {label}: NO DeferredError in {args.max_calls} calls")
                    continue
                worst = max(worst, calls)
                print(f"deferred-error latency: {label}: raised at call {calls} after the double free "
                      f"({seconds * 1e3:.2f} ms, {padding} padding slots handed out)")
    print(f"deferred-error latency: largest {worst} calls{'; never raised: ' + ', '.join(never) if never else ''}")
    return 1 if never else 0


if __name__ == "__main__":
    sys.exit(main())
