"""swa_ext as SGLang's KV page allocator (README: "Using swa_ext in SGLang").

The classes here ARE SGLang 0.5.23's allocator types: each subclasses swa_ext's native
class first (so every allocation and free runs in C++) and SGLang's class second (so
``isinstance`` checks pass and the scheduler's hooks that swa_ext has no reason to
change, such as ``create_prefill_budget`` or ``reclaim_for_prealloc``, are SGLang's own).
They take SGLang's constructor arguments.

``install()`` makes SGLang build them: it rebinds the allocator names in
``sglang.srt.mem_cache.kv_cache_configurator``, the one module that constructs
allocators. SGLang loads ``swa_ext.sglang_plugin.plugin`` (entry point group
``sglang.srt.plugins``) in every process it starts; it installs according to
``SWA_EXT_SGLANG``:

- unset, empty or ``0``: nothing (SGLang's allocators serve);
- ``1``: swa_ext serves the hybrid SWA allocator;
- ``all``: also the single-pool allocators of non-SWA models;
- ``lockstep``: as ``all``, and SGLang's own allocator shadows every call (hybrid and
  sub-allocator calls); the first difference in returned indices, available sizes or
  the mapping raises ``LockstepDivergence`` naming the call and its arguments.

Where swa_ext cannot serve a configuration (the per-request SWA ring, a device other
than cpu/cuda, a platform's own paged allocator such as the NPU's, cuda with a CPU-only
build of swa_ext), SGLang's class is built instead and a warning says why.

sglang is imported when this module is; ``import swa_ext`` does not import it.
"""
from __future__ import annotations

import abc
import inspect
import json
import logging
import os

import torch
from sglang.srt.mem_cache import kv_cache_configurator
from sglang.srt.mem_cache.allocator import paged as sglang_paged
from sglang.srt.mem_cache.allocator import swa as sglang_swa
from sglang.srt.mem_cache.allocator import token as sglang_token
from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool
from sglang.srt.platforms import current_platform
from sglang.srt.utils import get_bool_env_var, is_npu

from . import _C, allocator

logger = logging.getLogger(__name__)

# Where lockstep mode writes its per-call counts (JSON) after every call, when set.
LOCKSTEP_REPORT_VARIABLE = "SWA_EXT_LOCKSTEP_REPORT"


class _AdapterMeta(type(_C.PagePool), abc.ABCMeta):
    """pybind11's metaclass and SGLang's (ABCMeta) in one, for classes with both bases."""


# --- the allocators -----------------------------------------------------------------


class _SGLangPool:
    """SGLang's attributes of one page pool that swa_ext's native class does not hold."""

    def _init_sglang_side(self):
        self.debug_mode = get_bool_env_var("SGLANG_DEBUG_MEMORY_POOL")

    @classmethod
    def _share(cls, handle, dtype, kvcache):
        pool = super()._share(handle, dtype, kvcache)
        pool._init_sglang_side()
        return pool

    def get_all_free_pages(self):
        """The free and the staged pages (SGLang's leak checker reads them)."""
        return torch.cat((self.free_pages, self.release_pages))

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
                                                     need_sort)
        # SGLang's inherited hooks read these; swa_ext never serves the per-request ring.
        self._req_to_token_pool = req_to_token_pool
        self._swa_ring_cost = 0

    def resize(self, config):
        """SGLang's post-capture KV sizing: both pools cleared at the config's sizes, the
        same mapping tensor registered again with the KV cache."""
        super().resize(int(config.full_max_total_num_tokens), int(config.swa_max_total_num_tokens))
        self._kvcache.register_mapping(self.full_to_swa_index_mapping)


# --- lockstep: SGLang's allocator shadows every call --------------------------------


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
        return [("available_size()", _C.PagePool.available_size(self), self._shadow.available_size())]


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


# --- choosing who serves --------------------------------------------------------------


def _reason_not_served(device, page_size):
    """Why swa_ext cannot serve this allocator, or None."""
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        return f"device {device!r} (swa_ext runs on cpu and cuda)"
    if kind == "cuda" and not _C.built_with_cuda():
        return "this build of swa_ext has no CUDA kernels"
    if is_npu():
        return "the NPU has its own paged allocator"
    if page_size > 1 and current_platform.get_paged_allocator_cls() is not None:
        return f"the platform's own paged allocator ({current_platform.get_paged_allocator_cls().__name__})"
    return None


def _serve(sglang_class, build, reason, args, kwargs, pools):
    if reason is not None:
        logger.warning("swa_ext: SGLang's own %s serves: %s", sglang_class.__name__, reason)
        return sglang_class(*args, **kwargs)
    alloc = build(*args, **kwargs)
    logger.info("swa_ext: %s serves %s, page size %d, on %s", type(alloc).__name__, pools(alloc), alloc.page_size,
                alloc.device)
    return alloc


class _StandIn(abc.ABCMeta):
    """Stands for one of SGLang's allocator classes in the module that builds them:
    calling it builds swa_ext's allocator (or SGLang's, where swa_ext cannot serve);
    isinstance and issubclass answer as they would for SGLang's class."""

    def __call__(cls, *args, **kwargs):
        return cls.build(*args, **kwargs)

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls.sglang_class)

    def __subclasscheck__(cls, subclass):
        return issubclass(subclass, cls.sglang_class)


def _stand_in(sglang_class, build):
    return _StandIn(sglang_class.__name__, (), {"sglang_class": sglang_class, "build": staticmethod(build),
                                                "__doc__": _StandIn.__doc__})


def _swa_builder(lockstep):
    hybrid = LockstepSWATokenToKVPoolAllocator if lockstep else SWATokenToKVPoolAllocator

    def build(size, size_swa, page_size, dtype, device, kvcache, need_sort, req_to_token_pool=None):
        args = (size, size_swa, page_size, dtype, device, kvcache, need_sort, req_to_token_pool)
        reason = _reason_not_served(device, page_size)
        if reason is None and getattr(kvcache, "swa_req_ring_size", None) is not None:
            reason = "the per-request SWA ring (kvcache.swa_req_ring_size) is SGLang's alone"
        return _serve(sglang_swa.SWATokenToKVPoolAllocator, hybrid, reason, args, {},
                      lambda a: f"a full pool of {a.size_full} tokens and an SWA pool of {a.size_swa} tokens "
                                f"(kernels {a.kernels})")

    return build


def _pool_builder(pool_class, lockstep_class, sglang_class):
    signature = inspect.signature(sglang_class.__init__)

    def make(*args, **kwargs):
        if lockstep_class is None:
            return pool_class(*args, **kwargs)
        return _attach_shadow(lockstep_class(*args, **kwargs), sglang_class(*args, **kwargs), _Lockstep())

    def build(*args, **kwargs):
        given = signature.bind(None, *args, **kwargs).arguments
        reason = _reason_not_served(given["device"], given.get("page_size", 1))
        return _serve(sglang_class, make, reason, args, kwargs, lambda a: f"one pool of {a.size} tokens")

    return build


# --- install ---------------------------------------------------------------------------

_REPLACED = ("SWATokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator", "TokenToKVPoolAllocator")
_originals = {}


def install(*, single_pool=False, lockstep=False):
    """Makes SGLang build swa_ext's allocators in this process: the hybrid SWA allocator,
    and with ``single_pool`` also the page and token pools of non-SWA models. With
    ``lockstep``, SGLang's own allocator shadows each one (module docstring). Calling it
    again replaces the previous installation."""
    uninstall()
    stand_ins = {"SWATokenToKVPoolAllocator": _stand_in(sglang_swa.SWATokenToKVPoolAllocator,
                                                        _swa_builder(lockstep))}
    if single_pool:
        stand_ins["PagedTokenToKVPoolAllocator"] = _stand_in(sglang_paged.PagedTokenToKVPoolAllocator, _pool_builder(
            PagedTokenToKVPoolAllocator, lockstep and LockstepPagedTokenToKVPoolAllocator,
            sglang_paged.PagedTokenToKVPoolAllocator))
        stand_ins["TokenToKVPoolAllocator"] = _stand_in(sglang_token.TokenToKVPoolAllocator, _pool_builder(
            TokenToKVPoolAllocator, lockstep and LockstepTokenToKVPoolAllocator, sglang_token.TokenToKVPoolAllocator))
    for name, stand_in in stand_ins.items():
        _originals[name] = getattr(kv_cache_configurator, name)
        setattr(kv_cache_configurator, name, stand_in)


def uninstall():
    """Gives allocator construction back to SGLang's classes."""
    for name, original in _originals.items():
        setattr(kv_cache_configurator, name, original)
    _originals.clear()


def installed():
    """The SGLang allocator names swa_ext now builds, in this process."""
    return sorted(_originals)
