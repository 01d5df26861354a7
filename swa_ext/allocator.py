"""SGLang-compatible allocator classes over the native core.

The classes subclass the native handles directly, so a call such as
``allocator.alloc_decode(...)`` goes straight to C++ with no Python frame in between.
Argument names, defaults, return values (int64 tensors on the allocator's device, or
None when refused) follow SGLang 0.5.23; SPEC.md is the contract.
"""
from __future__ import annotations

import torch

from . import _C


class PagedTokenToKVPoolAllocator(_C.PagePool):
    """One paged KV pool (page size > 1): SGLang's ``PagedTokenToKVPoolAllocator``."""

    def __init__(self, size, page_size, dtype, device, kvcache=None, need_sort=False, kernels="auto"):
        super().__init__(size, page_size, torch.device(device), need_sort, kernels)
        self.dtype = dtype
        self._kvcache = kvcache

    @classmethod
    def _share(cls, handle, dtype, kvcache):
        """A view of a pool owned by a hybrid allocator (same free list, same guard)."""
        pool = cls.__new__(cls)
        _C.PagePool.__init__(pool, handle)
        pool.dtype = dtype
        pool._kvcache = kvcache
        return pool

    def get_kvcache(self):
        return self._kvcache


class TokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """The token pool (page size 1): SGLang's ``TokenToKVPoolAllocator``."""

    def __init__(self, size, dtype, device, kvcache=None, need_sort=False, kernels="auto"):
        super().__init__(size, 1, dtype, device, kvcache, need_sort, kernels)


def _pool_class(page_size):
    return TokenToKVPoolAllocator if page_size == 1 else PagedTokenToKVPoolAllocator


class SWATokenToKVPoolAllocator(_C.HybridAllocator):
    """Full-attention and SWA page pools with the full-to-SWA slot mapping.

    Drop-in for SGLang's ``SWATokenToKVPoolAllocator``; page size 1 also supports
    ``alloc_extend``, ``alloc_decode`` and ``alloc_extend_swa_tail`` (SPEC.md section 4).

    With ``device="cuda"`` the free lists, the mapping and every returned tensor live on
    the GPU (README: "CUDA"). ``kernels="emulated"`` with ``device="cpu"`` runs the GPU
    algorithm's kernels element by element on the CPU, for testing it without a GPU.
    """

    def __init__(self, size, size_swa, page_size, dtype, device, kvcache=None, need_sort=False, kernels="auto"):
        super().__init__(size, size_swa, page_size, torch.device(device), need_sort, kernels)
        self.dtype = dtype
        self._kvcache = kvcache
        pool_class = _pool_class(page_size)
        self.full_attn_allocator = pool_class._share(self._full_pool(), dtype, kvcache)
        self.swa_attn_allocator = pool_class._share(self._swa_pool(), dtype, kvcache)
        if kvcache is not None and hasattr(kvcache, "register_mapping"):
            kvcache.register_mapping(self.full_to_swa_index_mapping)

    def get_kvcache(self):
        return self._kvcache
