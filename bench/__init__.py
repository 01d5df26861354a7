"""Benchmark helpers for swa_ext (installed as ``swa_ext_bench``).

``BaselineSWAAllocator`` is a plain-torch implementation of the allocator
contract in SPEC.md, written the way SGLang 0.5.23 writes it (free lists as
int64 tensors that are re-sliced and concatenated on every call). It is the
speed baseline the native allocator is measured against, and it replays the
golden traces exactly.

``evict_per_request`` is the per-request sliding-window eviction loop of
SPEC.md section 5, the reference for the batched native eviction.

``micro`` is ``swa-ext bench``; ``sglang_ref`` sets SGLang's own allocator up as
a further reference there, whenever sglang is importable.
"""

from .baseline import BaselineSWAAllocator
from .baseline_pools import BaselinePagedAllocator, BaselineTokenAllocator, get_num_new_pages
from .evict_baseline import evict_per_request

__all__ = [
    "BaselinePagedAllocator",
    "BaselineSWAAllocator",
    "BaselineTokenAllocator",
    "evict_per_request",
    "get_num_new_pages",
]
