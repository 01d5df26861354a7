"""SGLang 0.5.23's own ``SWATokenToKVPoolAllocator``, set up as a benchmark reference.

SGLang's allocator needs a KV pool object: it asserts ``isinstance(kvcache,
BaseSWAKVPool)``, hands it the full-to-SWA mapping (``register_mapping``) and
translates ``last_loc`` through it. ``MappingOnlySWAKVPool`` is the least such
pool: no KV buffers, only the mapping, translated the way SGLang's
``SWAKVPool`` does (``mapping[indices]``). The allocator and its sub-allocators
are SGLang's, unchanged.

SGLang's allocator has no ``backup_state``/``restore_state``; ``backup_state``
and ``restore_state`` here snapshot what its calls change: each pool's free list
and staged pages (re-sliced and concatenated, never written in place, so
references suffice) and the mapping (written in place, so copied).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["unavailable_reason", "make_allocator", "backup_state", "restore_state"]

_import_error: Optional[str] = None
try:
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool
except Exception as e:  # sglang missing, or present without a dependency it imports
    _import_error = f"{type(e).__name__}: {e}"
    SWATokenToKVPoolAllocator = None
    BaseSWAKVPool = None


def unavailable_reason() -> Optional[str]:
    """None when SGLang's allocator is importable, else why not (one line)."""
    return _import_error


if BaseSWAKVPool is not None:

    class MappingOnlySWAKVPool(BaseSWAKVPool):
        """A ``BaseSWAKVPool`` with no KV buffers: only the full-to-SWA mapping."""

        full_kv_pool = None
        swa_kv_pool = None
        swa_req_ring_size = None  # paged SWA pool, not per-request rings

        def __init__(self):
            self.full_to_swa_index_mapping = None

        def register_mapping(self, full_to_swa_index_mapping):
            self.full_to_swa_index_mapping = full_to_swa_index_mapping

        def translate_loc_from_full_to_swa(self, kv_indices):
            return self.full_to_swa_index_mapping[kv_indices]

        def _no_buffers(self, *args, **kwargs):
            raise NotImplementedError("MappingOnlySWAKVPool holds no KV buffers")

        get_state_buf_infos = _no_buffers
        get_key_buffer = _no_buffers
        get_value_buffer = _no_buffers
        get_kv_buffer = _no_buffers
        set_kv_buffer = _no_buffers


def make_allocator(size: int, size_swa: int, page_size: int, device, need_sort: bool = False):
    """SGLang's ``SWATokenToKVPoolAllocator`` over a ``MappingOnlySWAKVPool``."""
    if SWATokenToKVPoolAllocator is None:
        raise RuntimeError(f"SGLang's allocator is not importable ({_import_error})")
    return SWATokenToKVPoolAllocator(
        size,
        size_swa,
        page_size=page_size,
        dtype=torch.bfloat16,
        device=str(device),
        kvcache=MappingOnlySWAKVPool(),
        need_sort=need_sort,
    )


def _pool_state(pool) -> Tuple:
    # TokenToKVPoolAllocator stages frees in release_pages; the paged one in
    # staged_pages (a list) with a count.
    return (
        pool.free_pages,
        pool.release_pages,
        list(getattr(pool, "staged_pages", ())),
        getattr(pool, "num_staged_pages", 0),
    )


def _restore_pool(pool, state) -> None:
    pool.free_pages, pool.release_pages, staged, n_staged = state
    if hasattr(pool, "staged_pages"):
        pool.staged_pages = list(staged)
        pool.num_staged_pages = n_staged


def backup_state(alloc) -> Tuple:
    """Snapshot of both pools and the mapping of SGLang's allocator."""
    return (
        _pool_state(alloc.full_attn_allocator),
        _pool_state(alloc.swa_attn_allocator),
        alloc.full_to_swa_index_mapping.clone(),
    )


def restore_state(alloc, state) -> None:
    """Back to ``state``; the mapping keeps its identity (the KV pool holds it)."""
    full, swa, mapping = state
    _restore_pool(alloc.full_attn_allocator, full)
    _restore_pool(alloc.swa_attn_allocator, swa)
    alloc.full_to_swa_index_mapping.copy_(mapping)
