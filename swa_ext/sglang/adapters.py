"""swa_ext's allocators as SGLang 0.5.23's allocator types.

Each class subclasses swa_ext's native class first (so every allocation and free runs
in C++) and SGLang's class second (so ``isinstance`` checks pass and the scheduler's
hooks that swa_ext has no reason to change, such as ``create_prefill_budget`` or
``reclaim_for_prealloc``, are SGLang's own). They take SGLang's constructor arguments.
"""
from __future__ import annotations

import abc

import torch
from sglang.srt.mem_cache.allocator import paged as sglang_paged
from sglang.srt.mem_cache.allocator import swa as sglang_swa
from sglang.srt.mem_cache.allocator import token as sglang_token
from sglang.srt.utils import get_bool_env_var

from .. import _C, allocator


class _AdapterMeta(type(_C.PoolAllocator), abc.ABCMeta):
    """pybind11's metaclass and SGLang's (ABCMeta) in one, for classes with both bases."""


class _SGLangPool:
    """SGLang's attributes of one page pool that swa_ext's native class does not hold."""

    # The side's pages a free page of the native list holds: parent_k on the shared mode's
    # small side at parent_k > 1, whose list holds parents (SWATokenToKVPoolAllocator sets it).
    _pages_a_parent = 1

    def _init_sglang_side(self):
        self.debug_mode = get_bool_env_var("SGLANG_DEBUG_MEMORY_POOL")

    @classmethod
    def _share(cls, handle, dtype, kvcache):
        pool = super()._share(handle, dtype, kvcache)
        pool._init_sglang_side()
        return pool

    def get_all_free_pages(self):
        """The free and the staged pages, in this side's page ids (SGLang's leak checker and
        KV page checks read them): on the shared mode's small side at parent_k > 1 the child
        pages of the free and staged parents. Its partly used parents' free child pages, which
        the native store does not list, are not among them: SGLang looks for pages in use
        that are also free, which fewer free pages never report wrongly."""
        parents = torch.cat((self.free_pages, self.release_pages))
        k = self._pages_a_parent
        return (parents[:, None] * k + torch.arange(k, device=parents.device)).flatten()

    def resize(self, config):
        """SGLang's post-capture KV sizing: the pool cleared at ``config.max_total_num_tokens``."""
        super().resize(int(config.max_total_num_tokens))


class PagedTokenToKVPoolAllocator(_SGLangPool, allocator.PagedTokenToKVPoolAllocator,
                                  sglang_paged.PagedTokenToKVPoolAllocator, metaclass=_AdapterMeta):
    """swa_ext's page pool as SGLang's ``PagedTokenToKVPoolAllocator`` (same arguments)."""

    def __init__(self, size, page_size, dtype, device, kvcache=None, need_sort=False):
        allocator.PagedTokenToKVPoolAllocator.__init__(self, size, page_size, dtype, device, kvcache, need_sort)
        self._init_sglang_side()


class TokenToKVPoolAllocator(_SGLangPool, allocator.TokenToKVPoolAllocator,
                             sglang_token.TokenToKVPoolAllocator, metaclass=_AdapterMeta):
    """swa_ext's token pool (page size 1) as SGLang's ``TokenToKVPoolAllocator``."""

    def __init__(self, size, dtype, device, kvcache=None, need_sort=False):
        allocator.TokenToKVPoolAllocator.__init__(self, size, dtype, device, kvcache, need_sort)
        self._init_sglang_side()


class SWATokenToKVPoolAllocator(allocator.SWATokenToKVPoolAllocator, sglang_swa.SWATokenToKVPoolAllocator,
                                metaclass=_AdapterMeta):
    """swa_ext's hybrid allocator as SGLang's ``SWATokenToKVPoolAllocator`` (same arguments).

    ``full_attn_allocator`` and ``swa_attn_allocator`` are this module's pool classes,
    views that share the native free lists (SGLang's radix cache frees through them).
    """

    _paged_view_class = PagedTokenToKVPoolAllocator
    _token_view_class = TokenToKVPoolAllocator
    # SGLang's leak checker reads the sub-allocators when the hybrid has no free list.
    free_pages = None
    release_pages = None

    def __init__(self, size, size_swa, page_size, dtype, device, kvcache, need_sort, req_to_token_pool=None):
        allocator.SWATokenToKVPoolAllocator.__init__(self, size, size_swa, page_size, dtype, device, kvcache,
                                                     need_sort, **self._page_layout(kvcache))
        small_pool = self.full_attn_allocator if self.small_side == "full" else self.swa_attn_allocator
        small_pool._pages_a_parent = self.parent_k
        # SGLang's inherited hooks read these; swa_ext never serves the per-request ring.
        self._req_to_token_pool = req_to_token_pool
        self._swa_ring_cost = 0

    @staticmethod
    def _page_layout(kvcache):
        """The native store's pages for SGLang's KV pool ``kvcache``: two pools, the default
        mode (swa_ext.sglang.shared lays them out as its KV pool's parent pages)."""
        return {}

    def resize(self, config):
        """SGLang's post-capture KV sizing: both pools cleared at the config's sizes, the
        same mapping tensor registered again with the KV cache."""
        super().resize(int(config.full_max_total_num_tokens), int(config.swa_max_total_num_tokens))
        self._kvcache.register_mapping(self.full_to_swa_index_mapping)
