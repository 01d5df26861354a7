"""Which allocator SGLang builds, and ``install()``: swa_ext's classes stand in for
SGLang's allocator names in ``sglang.srt.mem_cache.kv_cache_configurator``, the one
module that constructs allocators."""
from __future__ import annotations

import abc
import contextlib
import inspect
import logging
import os
import sys

import torch
from sglang.srt.entrypoints import engine as sglang_engine
from sglang.srt.mem_cache import kv_cache_configurator
from sglang.srt.mem_cache.allocator import paged as sglang_paged
from sglang.srt.mem_cache.allocator import swa as sglang_swa
from sglang.srt.mem_cache.allocator import token as sglang_token
from sglang.srt.platforms import current_platform
from sglang.srt.utils import is_npu

from .. import _C, sglang_seams
from . import hooks
from .adapters import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator, TokenToKVPoolAllocator
from .lockstep import (LockstepPagedTokenToKVPoolAllocator, LockstepSWATokenToKVPoolAllocator,
                       LockstepTokenToKVPoolAllocator, _attach_shadow, _Lockstep)
from .shared import SharedSWATokenToKVPoolAllocator
from .shared_pool import SharedModeRefused, SharedSWAKVPool, shared_sizes

logger = logging.getLogger(__name__)


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


def _serve(sglang_class, build, reason, args, kwargs, pools, mode):
    if reason is not None:
        logger.warning("swa_ext: SGLang's own %s serves: %s", sglang_class.__name__, reason)
        return sglang_class(*args, **kwargs)
    alloc = build(*args, **kwargs)
    logger.info("swa_ext: %s serves %s, page size %d, on %s (SWA_EXT_SGLANG=%s, SGLang %s)", type(alloc).__name__,
                pools(alloc), alloc.page_size, alloc.device, mode, sglang_seams.installed_version())
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


def _swa_builder(lockstep, shared, mode):
    hybrid = LockstepSWATokenToKVPoolAllocator if lockstep else SWATokenToKVPoolAllocator
    if shared:
        hybrid = SharedSWATokenToKVPoolAllocator

    def build(size, size_swa, page_size, dtype, device, kvcache, need_sort, req_to_token_pool=None):
        args = (size, size_swa, page_size, dtype, device, kvcache, need_sort, req_to_token_pool)
        reason = _reason_not_served(device, page_size)
        if reason is None and getattr(kvcache, "swa_req_ring_size", None) is not None:
            reason = "the per-request SWA ring (kvcache.swa_req_ring_size) is SGLang's alone"
        if shared and reason is not None:  # the KV pool's layers already share storage: SGLang's allocator cannot
            raise SharedModeRefused(reason)
        if shared:
            return _serve(sglang_swa.SWATokenToKVPoolAllocator, hybrid, None, args, {},
                          lambda a: f"one budget for full and SWA pages: {a.size_full} full or {a.size_swa} SWA "
                                    f"slots, parent_k {a.parent_k} (small side {a.small_side}), shared mode "
                                    f"(kernels {a.kernels})", mode)
        return _serve(sglang_swa.SWATokenToKVPoolAllocator, hybrid, reason, args, {},
                      lambda a: f"a full pool of {a.size_full} tokens and an SWA pool of {a.size_swa} tokens "
                                f"(kernels {a.kernels})", mode)

    return build


def _pool_builder(pool_class, lockstep_class, sglang_class, mode):
    signature = inspect.signature(sglang_class.__init__)

    def make(*args, **kwargs):
        if lockstep_class is None:
            return pool_class(*args, **kwargs)
        return _attach_shadow(lockstep_class(*args, **kwargs), sglang_class(*args, **kwargs), _Lockstep())

    def build(*args, **kwargs):
        given = signature.bind(None, *args, **kwargs).arguments
        reason = _reason_not_served(given["device"], given.get("page_size", 1))
        return _serve(sglang_class, make, reason, args, kwargs, lambda a: f"one pool of {a.size} tokens", mode)

    return build


# --- install ---------------------------------------------------------------------------

_REPLACED = ("SWATokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator", "TokenToKVPoolAllocator")
_originals = {}


def _warn_if_built_elsewhere(configurator, allocator_given, pools):
    """One warning when SGLang built an allocator that none of the names swa_ext replaces
    stands for: swa_ext serves nothing in that process."""
    built = pools.token_to_kv_pool_allocator
    if allocator_given is not None or built is None or type(built) in _STOOD_IN or \
            isinstance(built, (_C.HybridAllocator, _C.PoolAllocator)):
        return
    if kv_cache_configurator.get_memory().enable_unified_memory:
        logger.warning("swa_ext: --enable-unified-memory: SGLang's own %s serves this process's KV, not swa_ext "
                       "(for swa_ext's one budget of full and SWA pages, drop the flag and set SWA_EXT_SGLANG="
                       "shared)", type(built).__name__)
        return
    logger.warning("swa_ext: swa_ext does not serve this process; SGLang's own %s serves (SGLang built it on a path "
                   "that does not go through the allocator names swa_ext replaces)", type(built).__name__)


# The exit status of an SGLang scheduler process whose start-up the shared mode refused
# (sysexits.h's EX_CONFIG). SGLang's scheduler logs any Exception as a crash, with its
# traceback, and kills its process group; so the refusal leaves the scheduler as one line
# and this status, and its parent, seeing the status, exits with it (_scheduler_died_error).
REFUSED_EXIT_STATUS = 78


@contextlib.contextmanager
def _refusal_ends_the_scheduler():
    try:
        yield
    except SharedModeRefused as refused:
        print(refused, file=sys.stderr, flush=True)
        raise SystemExit(REFUSED_EXIT_STATUS) from refused


def _init_pools(self, *, sizes, req_to_token_pool, token_to_kv_pool_allocator):
    with _refusal_ends_the_scheduler():
        pools = _sglang_init_pools(self, sizes=sizes, req_to_token_pool=req_to_token_pool,
                                   token_to_kv_pool_allocator=token_to_kv_pool_allocator)
    _warn_if_built_elsewhere(self, token_to_kv_pool_allocator, pools)
    return pools


def _resolve_memory_pool_config(self, pre_model_load_memory):
    with _refusal_ends_the_scheduler():
        return shared_sizes(self, _sglang_resolve_memory_pool_config(self, pre_model_load_memory))


def _scheduler_died_error(rank, proc):
    """SGLang's error for a scheduler that died starting, or, where the shared mode refused
    its configuration (the scheduler printed why), SystemExit with the same status: no
    traceback after the one line."""
    error = _sglang_scheduler_died_error(rank, proc)  # joins the process
    return SystemExit(REFUSED_EXIT_STATUS) if proc.exitcode == REFUSED_EXIT_STATUS else error


_sglang_init_pools = kv_cache_configurator.KVCacheConfigurator._init_pools
_sglang_scheduler_died_error = sglang_engine._scheduler_died_error
_sglang_resolve_memory_pool_config = kv_cache_configurator.KVCacheConfigurator._resolve_memory_pool_config
_STOOD_IN = (sglang_swa.SWATokenToKVPoolAllocator, sglang_paged.PagedTokenToKVPoolAllocator,
             sglang_token.TokenToKVPoolAllocator)


def _mode(single_pool, lockstep, shared):
    """The SWA_EXT_SGLANG value that asks for this installation."""
    return "shared" if shared else "lockstep" if lockstep else "all" if single_pool else "1"


def install(*, single_pool=False, lockstep=False, evict_hook=True, shared=False):
    """Makes SGLang build swa_ext's allocators in this process: the hybrid SWA allocator,
    and with ``single_pool`` also the page and token pools of non-SWA models. With
    ``lockstep``, SGLang's own allocator shadows each one (package docstring). With
    ``evict_hook``, the decode step's window eviction is one native call (hooks.py).
    With ``shared``, the hybrid allocator is swa_ext's shared mode (one budget for full
    and SWA pages: shared.py), in a KV pool whose SWA layers share the full layers'
    storage, sized from SGLang's two pools at the same bytes (shared_pool.py); SGLang's
    allocator cannot shadow it, so not with ``lockstep``. Calling it again replaces the
    previous installation. All or nothing: where a step fails, what was patched before it
    is restored and the error raised."""
    if shared and lockstep:
        raise ValueError("swa_ext: the shared mode has no lockstep (SGLang's allocator keeps two pools)")
    uninstall()
    try:
        _patch(single_pool, lockstep, evict_hook, shared)
    except BaseException:
        uninstall()
        raise


def _patch(single_pool, lockstep, evict_hook, shared):
    mode = _mode(single_pool, lockstep, shared)
    kv_cache_configurator.KVCacheConfigurator._init_pools = _init_pools
    if evict_hook:
        hooks.install(check_slot_kinds_each_step=shared and os.environ.get("SWA_EXT_DEBUG", "") == "1")
    stand_ins = {"SWATokenToKVPoolAllocator": _stand_in(sglang_swa.SWATokenToKVPoolAllocator,
                                                        _swa_builder(lockstep, shared, mode))}
    if shared:
        kv_cache_configurator.KVCacheConfigurator._resolve_memory_pool_config = _resolve_memory_pool_config
        sglang_engine._scheduler_died_error = _scheduler_died_error
        stand_ins["SWAKVPool"] = SharedSWAKVPool
    if single_pool:
        stand_ins["PagedTokenToKVPoolAllocator"] = _stand_in(sglang_paged.PagedTokenToKVPoolAllocator, _pool_builder(
            PagedTokenToKVPoolAllocator, LockstepPagedTokenToKVPoolAllocator if lockstep else None,
            sglang_paged.PagedTokenToKVPoolAllocator, mode))
        stand_ins["TokenToKVPoolAllocator"] = _stand_in(sglang_token.TokenToKVPoolAllocator, _pool_builder(
            TokenToKVPoolAllocator, LockstepTokenToKVPoolAllocator if lockstep else None,
            sglang_token.TokenToKVPoolAllocator, mode))
    for name, stand_in in stand_ins.items():
        _originals[name] = getattr(kv_cache_configurator, name)
        setattr(kv_cache_configurator, name, stand_in)


def uninstall():
    """Gives allocator construction and the scheduler's eviction back to SGLang."""
    kv_cache_configurator.KVCacheConfigurator._init_pools = _sglang_init_pools
    kv_cache_configurator.KVCacheConfigurator._resolve_memory_pool_config = _sglang_resolve_memory_pool_config
    sglang_engine._scheduler_died_error = _sglang_scheduler_died_error
    hooks.uninstall()
    for name, original in _originals.items():
        setattr(kv_cache_configurator, name, original)
    _originals.clear()


def installed():
    """The SGLang allocator names swa_ext now builds, in this process."""
    return sorted(_originals)
