"""Lockstep mode (``SWA_EXT_SGLANG=lockstep``): SGLang's own allocator shadows every call
swa_ext serves, and the first difference raises ``LockstepDivergence``."""
from __future__ import annotations

import json
import os

import torch
from sglang.srt.mem_cache.allocator import swa as sglang_swa
from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool

from .. import _C
from .adapters import (PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator, TokenToKVPoolAllocator,
                       _AdapterMeta)

# Where lockstep mode writes its per-call counts (JSON) after every call, when set.
LOCKSTEP_REPORT_VARIABLE = "SWA_EXT_LOCKSTEP_REPORT"


class LockstepDivergence(AssertionError):
    """swa_ext and SGLang's allocator answered one call differently."""


class _ShadowKVCache(BaseSWAKVPool):
    """The KV cache as the shadow allocator sees it: SGLang's pool for everything but the
    mapping, which stays the shadow's own (the real pool holds swa_ext's)."""

    def __init__(self, kvcache):
        self._kvcache = kvcache
        self.full_to_swa_index_mapping = None

    def __getattr__(self, name):  # only for what this class does not define
        return getattr(self._kvcache, name)

    def register_mapping(self, full_to_swa_index_mapping):
        self.full_to_swa_index_mapping = full_to_swa_index_mapping

    def translate_loc_from_full_to_swa(self, kv_indices):
        return self.full_to_swa_index_mapping[kv_indices]

    def get_state_buf_infos(self):
        return self._kvcache.get_state_buf_infos()


_ShadowKVCache.__abstractmethods__ = frozenset()  # a view, not a pool: KVCache's buffer methods go to __getattr__


def _describe(value):
    if isinstance(value, torch.Tensor):
        shown = value.tolist() if value.numel() <= 64 else value[:64].tolist() + ["..."]
        return f"tensor({shown}, dtype={value.dtype}, device={value.device})"
    if isinstance(value, (list, tuple)):
        return type(value)(_describe(v) for v in value)
    return repr(value)


def _same(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and torch.equal(a.cpu().to(torch.int64), b.cpu().to(torch.int64)))
    return a == b


def _own(value):
    """A private copy of a tensor argument: neither side may see the other's view of it."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_own(v) for v in value)
    return value


class _Lockstep:
    """Runs one call on swa_ext, then the same call on the shadow; compares the answers
    and the state both allocators show after it."""

    def __init__(self):
        self.counts = {}
        self._report = os.environ.get(LOCKSTEP_REPORT_VARIABLE)

    def call(self, owner, name, serve, shadow, args, kwargs):
        shadow_args, shadow_kwargs = _own(args), {k: _own(v) for k, v in kwargs.items()}
        got = serve(*args, **kwargs)
        want = getattr(shadow, name)(*shadow_args, **shadow_kwargs)
        self.counts[name] = self.counts.get(name, 0) + 1
        if not _same(got, want):
            self._diverged(owner, name, args, kwargs, f"swa_ext returned {_describe(got)}, SGLang {_describe(want)}")
        for what, ours, theirs in owner._lockstep_state():
            if not _same(ours, theirs):
                self._diverged(owner, name, args, kwargs,
                               f"after it {what} is {_describe(ours)} in swa_ext, {_describe(theirs)} in SGLang")
        if self._report:  # replaced whole, so a reader (or a kill at shutdown) never sees half a file
            with open(self._report + ".tmp", "w") as f:
                json.dump(self.counts, f)
            os.replace(self._report + ".tmp", self._report)
        return got

    def _diverged(self, owner, name, args, kwargs, what):
        shown = [_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in kwargs.items()]
        raise LockstepDivergence(f"swa_ext lockstep: {type(owner).__name__}.{name}({', '.join(shown)}) "
                                 f"after {sum(self.counts.values())} calls: {what}")


def _mirrored(name):
    """A method that serves `name` through swa_ext and mirrors it on the shadow."""

    def method(self, *args, **kwargs):
        serve = getattr(super(type(self)._lockstep_base, self), name)
        return self._lockstep.call(self, name, serve, self._shadow, args, kwargs)

    method.__name__ = name
    method.__doc__ = f"``{name}`` on swa_ext, mirrored on SGLang's allocator and compared."
    return method


# Native methods only: SGLang's inherited composites (free_segments, ...) reach them.
_POOL_CALLS = ("alloc", "alloc_extend", "alloc_decode", "free", "free_page_ids", "free_segment",
               "free_group_begin", "free_group_end", "merge_and_sort_free", "clear", "available_size")
_HYBRID_CALLS = ("alloc", "alloc_extend", "alloc_extend_swa_tail", "alloc_decode", "translate_loc_from_full_to_swa",
                 "set_full_to_swa_mapping", "clear_full_to_swa_mapping", "free", "free_swa", "free_full",
                 "free_segment", "free_swa_segment", "free_full_segment", "free_group_begin", "free_group_end",
                 "clear", "available_size", "full_available_size", "swa_available_size", "new_pages_available")


def _lockstep_class(name, base, calls):
    cls = _AdapterMeta(name, (base,), {call: _mirrored(call) for call in calls})
    cls._lockstep_base = cls
    cls.__module__ = __name__
    cls.__doc__ = f"{name[len('Lockstep'):]} with SGLang's own allocator shadowing every call (SWA_EXT_SGLANG=lockstep)."
    return cls


class _LockstepSide:
    """What a lockstep allocator does besides mirroring calls; ``_lockstep_state`` lists
    what both allocators must agree on after every call."""

    def resize(self, config):
        super().resize(config)
        self._shadow.resize(config)


def _attach_shadow(alloc, shadow, lockstep):
    alloc._shadow = shadow
    alloc._lockstep = lockstep
    return alloc


class _LockstepPoolSide(_LockstepSide):
    def _lockstep_state(self):
        return [("available_size()", _C.PoolAllocator.available_size(self), self._shadow.available_size())]


def _lockstep_pool_class(base):
    side = _AdapterMeta(f"_LockstepSide{base.__name__}", (_LockstepPoolSide, base), {})
    return _lockstep_class(f"Lockstep{base.__name__}", side, _POOL_CALLS)


LockstepPagedTokenToKVPoolAllocator = _lockstep_pool_class(PagedTokenToKVPoolAllocator)
LockstepTokenToKVPoolAllocator = _lockstep_pool_class(TokenToKVPoolAllocator)


class _LockstepHybridSide(_LockstepSide):
    _paged_view_class = LockstepPagedTokenToKVPoolAllocator
    _token_view_class = LockstepTokenToKVPoolAllocator

    def _lockstep_state(self):
        return [("full_available_size()", _C.HybridAllocator.full_available_size(self),
                 self._shadow.full_available_size()),
                ("swa_available_size()", _C.HybridAllocator.swa_available_size(self),
                 self._shadow.swa_available_size()),
                ("full_to_swa_index_mapping", self.full_to_swa_index_mapping, self._shadow.full_to_swa_index_mapping)]


class _LockstepHybridBase(_LockstepHybridSide, SWATokenToKVPoolAllocator):
    def __init__(self, size, size_swa, page_size, dtype, device, kvcache, need_sort, req_to_token_pool=None):
        self._lockstep = _Lockstep()
        self._shadow = sglang_swa.SWATokenToKVPoolAllocator(size, size_swa, page_size, dtype, device,
                                                           _ShadowKVCache(kvcache), need_sort, req_to_token_pool)
        super().__init__(size, size_swa, page_size, dtype, device, kvcache, need_sort, req_to_token_pool)
        _attach_shadow(self.full_attn_allocator, self._shadow.full_attn_allocator, self._lockstep)
        _attach_shadow(self.swa_attn_allocator, self._shadow.swa_attn_allocator, self._lockstep)

    @property
    def lockstep_counts(self):
        """Calls mirrored so far, by method name (hybrid and sub-allocator calls together)."""
        return dict(self._lockstep.counts)


LockstepSWATokenToKVPoolAllocator = _lockstep_class("LockstepSWATokenToKVPoolAllocator", _LockstepHybridBase,
                                                    _HYBRID_CALLS)
