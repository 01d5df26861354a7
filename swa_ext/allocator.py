"""SGLang-compatible allocator classes over the native core.

The classes subclass the native handles directly, so a call such as
``allocator.alloc_decode(...)`` goes straight to C++ with no Python frame in between.
Argument names, defaults, return values (int64 tensors on the allocator's device, or
None when refused) follow SGLang 0.5.23; SPEC.md is the contract. The native methods'
docstrings (``help()``) live in csrc/torch/docstrings.h.
"""
from __future__ import annotations

import torch

from . import _C


def _checked_device(device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):  # torch's text lists every device type it knows
        raise TypeError(f"device: expected 'cpu' or 'cuda' (or a torch.device), got {device!r}") from None


def _check_dtype(dtype) -> None:
    # Recorded, not used for allocating: checked so that a typo surfaces here, not in the KV cache.
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype (torch.bfloat16, say), got {type(dtype).__name__} {dtype!r}")


class PagedTokenToKVPoolAllocator(_C.PoolAllocator):
    """One paged KV pool (page size > 1): SGLang's ``PagedTokenToKVPoolAllocator``.

    ``size`` slots (tokens) in pages of ``page_size`` slots, on ``device`` ("cpu" or
    "cuda"). ``dtype`` (a ``torch.dtype``) and ``kvcache`` are recorded for the caller
    (SGLang's attributes); the allocator itself only hands out slot indices. ``need_sort``
    stages freed pages and merges them sorted when an allocation needs them;
    ``kernels="emulated"`` (CPU only) runs the GPU algorithm element by element, for tests.
    A ``size`` whose tables do not fit in memory raises MemoryError naming it.
    """

    def __init__(self, size, page_size, dtype, device, kvcache=None, need_sort=False, kernels="auto"):
        """A pool of ``size`` slots (tokens) in pages of ``page_size``; ``dtype`` a
        ``torch.dtype``, ``device`` "cpu" or "cuda", the rest as the class says. Raises
        ValueError or TypeError naming a bad argument, MemoryError naming ``size``."""
        _check_dtype(dtype)
        super().__init__(size, page_size, _checked_device(device), need_sort, kernels)
        self._dtype = dtype
        self._kvcache = kvcache

    @classmethod
    def _share(cls, handle, dtype, kvcache):
        """A view of a pool owned by a hybrid allocator (same free list, same guard)."""
        pool = cls.__new__(cls)
        _C.PoolAllocator.__init__(pool, handle)
        pool._dtype = dtype
        pool._kvcache = kvcache
        return pool

    @property
    def dtype(self):
        """The KV cache's torch dtype, as given to the constructor (not used for allocating)."""
        return self._dtype

    def get_kvcache(self):
        """The KV cache object given to the constructor (None if none was)."""
        return self._kvcache


class TokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """The token pool (page size 1): SGLang's ``TokenToKVPoolAllocator``.

    ``size``, ``dtype``, ``device``, ``kvcache``, ``need_sort`` and ``kernels`` as for
    ``PagedTokenToKVPoolAllocator``.
    """

    def __init__(self, size, dtype, device, kvcache=None, need_sort=False, kernels="auto"):
        """A pool of ``size`` slots (tokens), page size 1; the rest as for
        ``PagedTokenToKVPoolAllocator``."""
        super().__init__(size, 1, dtype, device, kvcache, need_sort, kernels)


class SWATokenToKVPoolAllocator(_C.HybridAllocator):
    """Full-attention and SWA page pools with the full-to-SWA slot mapping.

    Drop-in for SGLang's ``SWATokenToKVPoolAllocator``: ``size`` full-attention slots and
    ``size_swa`` SWA slots (tokens), in pages of ``page_size`` slots; page size 1 also
    supports ``alloc_extend``, ``alloc_decode`` and ``alloc_extend_swa_tail`` (SPEC.md
    section 4). The allocation methods return full-pool slots;
    ``translate_loc_from_full_to_swa`` gives their SWA slots. ``dtype`` (a ``torch.dtype``)
    and ``kvcache`` are recorded for the caller; a ``kvcache`` with ``register_mapping`` is handed
    ``full_to_swa_index_mapping``; the pool views get its ``full_kv_pool`` and
    ``swa_kv_pool`` (None where it has none), as SGLang's do. ``need_sort`` stages freed
    pages and merges them sorted when an allocation needs them. ``full_used_size()`` and
    ``swa_used_size()`` count the tokens in the pages each kind holds. A ``size`` or ``size_swa``
    whose tables do not fit in memory raises MemoryError naming it; nothing is built.

    With ``device="cuda"`` the free lists, the mapping and every returned tensor live on
    the GPU (docs/cuda.md). ``kernels="emulated"`` with ``device="cpu"`` runs the GPU
    algorithm's kernels element by element on the CPU, for testing it without a GPU.
    """

    # The classes of the two pool views at page size > 1 and 1 (swa_ext.sglang has its own).
    _paged_view_class = PagedTokenToKVPoolAllocator
    _token_view_class = TokenToKVPoolAllocator

    def __init__(self, size, size_swa, page_size, dtype, device, kvcache=None, need_sort=False, kernels="auto",
                 shared=False, parent_k=1, small_side="swa"):
        """Two pools: ``size`` full-attention slots and ``size_swa`` SWA slots (tokens), in
        pages of ``page_size`` slots; ``dtype`` a ``torch.dtype``, recorded for the caller;
        ``device`` "cpu" or "cuda"; ``kvcache``, ``need_sort`` and ``kernels`` as the class
        says. As in SGLang, the ``size`` property then reads the smaller pool,
        min(size_full, size_swa): ``size_full`` and ``size_swa`` read each. Raises
        ValueError or TypeError naming a bad argument, MemoryError naming ``size`` or
        ``size_swa`` (with the bytes its tables need). ``shared=True``: the shared mode
        (SPEC.md section 8), one free list of parent pages for full and SWA pages alike: a
        parent holds one page of the side with the larger KV entry or ``parent_k`` pages of
        ``small_side`` ("full" or "swa", the side with the smaller entry;
        ``swa_ext.parent_k(larger_entry_bytes, smaller_entry_bytes)`` gives k), whose size
        must be ``parent_k`` times the other side's (``size_swa`` equal to ``size`` at
        ``parent_k=1``). ``parent_k > 1`` runs on the CPU store (``kernels`` "auto" or "cpu")."""
        _check_dtype(dtype)
        if isinstance(parent_k, bool) or not isinstance(parent_k, int):
            raise TypeError(f"parent_k: expected an int, got {type(parent_k).__name__} {parent_k!r}")
        if not isinstance(small_side, str):
            raise TypeError(f"small_side: expected 'full' or 'swa', got {type(small_side).__name__} {small_side!r}")
        super().__init__(size, size_swa, page_size, _checked_device(device), need_sort, kernels, shared, parent_k,
                         small_side)
        self._dtype = dtype
        self._kvcache = kvcache
        view_class = self._token_view_class if page_size == 1 else self._paged_view_class
        self._full_attn_allocator = view_class._share(self._full_pool(), dtype, getattr(kvcache, "full_kv_pool", None))
        self._swa_attn_allocator = view_class._share(self._swa_pool(), dtype, getattr(kvcache, "swa_kv_pool", None))
        if kvcache is not None and hasattr(kvcache, "register_mapping"):
            kvcache.register_mapping(self.full_to_swa_index_mapping)

    @property
    def dtype(self):
        """The KV cache's torch dtype, as given to the constructor (not used for allocating)."""
        return self._dtype

    @property
    def full_attn_allocator(self):
        """The full-attention pool, as a ``PagedTokenToKVPoolAllocator`` (``TokenToKVPoolAllocator``
        at page size 1): a view of this allocator's pool, not a copy. Freeing through it
        bypasses the mapping; it is there for SGLang code that reads its sizes and free pages."""
        return self._full_attn_allocator

    @property
    def swa_attn_allocator(self):
        """The SWA pool, as a ``PagedTokenToKVPoolAllocator`` (``TokenToKVPoolAllocator`` at
        page size 1): a view of this allocator's pool, not a copy (see ``full_attn_allocator``)."""
        return self._swa_attn_allocator

    def get_kvcache(self):
        """The KV cache object given to the constructor (None if none was)."""
        return self._kvcache
