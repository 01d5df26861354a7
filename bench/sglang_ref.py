"""SGLang 0.5.23's own ``SWATokenToKVPoolAllocator``, set up as a benchmark reference.

SGLang's allocator needs a KV pool object: it asserts ``isinstance(kvcache,
BaseSWAKVPool)``, hands it the full-to-SWA mapping (``register_mapping``) and
translates ``last_loc`` through it. ``MappingOnlySWAKVPool`` is the least such
pool: no KV buffers, only the mapping, translated the way SGLang's
``SWAKVPool`` does (``mapping[indices]``). The allocator and its sub-allocators
are SGLang's, unchanged.

The benchmark gives SGLang's allocator the calls it gives the others, under the
same names. At page size 1 SGLang's ``alloc_extend`` and ``alloc_decode`` assert
a paged pool (its scheduler calls ``alloc(n)`` there instead), so
``make_allocator`` wraps it to send those two to ``alloc``; SGLang has
``alloc_extend_swa_tail`` for paged pools only (``has_call``).

SGLang's allocator has no ``backup_state``/``restore_state``; ``backup_state``
and ``restore_state`` here snapshot what its calls change: each pool's free list
and staged pages (re-sliced and concatenated, never written in place, so
references suffice) and the mapping (written in place, so copied).

sglang is imported on first use, not with this module: the import takes seconds,
which ``swa-ext bench --no-sglang`` and a bad argument should not wait for.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["unavailable_reason", "version", "make_allocator", "has_call", "backup_state", "restore_state"]

_imported = None  # (SWATokenToKVPoolAllocator, MappingOnlySWAKVPool), or a str: why not


def _import():
    global _imported
    if _imported is not None:
        return _imported
    try:
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool
    except Exception as e:  # sglang missing, or present without a dependency it imports
        detail = (str(e).splitlines() or [""])[0]  # the reason is reported in one line
        _imported = f"{type(e).__name__}: {detail}" if detail else type(e).__name__
        return _imported

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

    _imported = (SWATokenToKVPoolAllocator, MappingOnlySWAKVPool)
    return _imported


def unavailable_reason() -> Optional[str]:
    """None when SGLang's allocator is importable, else why not (one line)."""
    imported = _import()
    return imported if isinstance(imported, str) else None


def version() -> Optional[str]:
    """The installed sglang's version (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        return dist_version("sglang")
    except PackageNotFoundError:
        return None


class _AtPageSize1:
    """SGLang's allocator at page size 1 under the names the benchmark calls:
    ``alloc_extend``/``alloc_decode`` become ``alloc`` of that many tokens, which
    is what SGLang's scheduler calls at page size 1."""

    def __init__(self, alloc):
        self._alloc = alloc

    def __getattr__(self, name):
        return getattr(self._alloc, name)

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens):
        return self._alloc.alloc(extend_num_tokens)

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        return self._alloc.alloc(len(seq_lens))


def make_allocator(size: int, size_swa: int, page_size: int, device, need_sort: bool = False):
    """SGLang's ``SWATokenToKVPoolAllocator`` over a ``MappingOnlySWAKVPool``; at page
    size 1 wrapped so that ``alloc_extend``/``alloc_decode`` call ``alloc``."""
    imported = _import()
    if isinstance(imported, str):
        raise RuntimeError(f"SGLang's allocator is not importable ({imported})")
    allocator_cls, pool_cls = imported
    alloc = allocator_cls(
        size,
        size_swa,
        page_size=page_size,
        dtype=torch.bfloat16,
        device=str(device),
        kvcache=pool_cls(),
        need_sort=need_sort,
    )
    return alloc if page_size > 1 else _AtPageSize1(alloc)


def has_call(op: str, page_size: int) -> bool:
    """Whether SGLang's allocator has the benchmark's call ``op`` at ``page_size``."""
    return not (op == "alloc_extend_swa_tail" and page_size == 1)


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
