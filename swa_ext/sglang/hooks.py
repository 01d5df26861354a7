"""The scheduler's per-step SWA bookkeeping as one native call (docs/sglang-eviction.md).

SGLang's ``ScheduleBatch.maybe_evict_swa`` walks the running batch in Python and, for
each request due, frees the SWA pages that slid out of its window through
``free_swa_out_of_window_slots`` (one ``free_swa_segment`` call a request, in one free
group). With swa_ext's allocator serving, ``maybe_evict_swa`` below replaces the decode
branch of that loop with one native call (``_C.sglang.WindowEviction``, made once): it
reads each request's lengths from SGLang's own objects through the CPython API (no
Python frame a request), applies SGLang's due test and
``swa_dead_lo``, frees every due request's pages through the allocator's
``evict_out_of_window`` in request order inside the same free group, and writes each
moved evicted length back as ``set_evicted_seqlen`` writes it.

What no step changes (the allocator's and the tree cache's classes, page sizes and
windows) is checked once for a scheduler's tree cache and allocator, and SGLang's
settings are parsed when their variables change. When the checks leave nothing to
SGLang's loop, the native object admits that scheduler's decode batches: from then on
``maybe_evict_swa`` is one native call, ``evict_batch(batch)``, which compares the
batch's tree cache, allocator and forward mode with the admitted ones and each setting's
variable with the value it was parsed from (identities: a few dict and attribute reads,
so SGLang's settings are still read every step, as SGLang's loop reads them), and hands
back to the checks here whatever differs.

What the native call does not cover goes to SGLang's own loop, for the whole batch, with
one warning for each reason: another allocator, auxiliary windows, a tree cache with its
own ``evict_sliding_windows`` or a ``swa_retain_floor`` in use (mamba checkpoints), the
forward-interval cadence of AMD's MegaMoE, the prefix-lock release
(``SGLANG_OPT_RELEASE_PREFILL_SWA``, whose tree frees interleave with the requests'),
requests or KV states of other classes than SGLang's (or with the methods it reads in
place replaced), and lengths the native call rejects. Extend batches are SGLang's too.

In lockstep mode SGLang's own decode branch (its due test, then
``free_swa_out_of_window_slots``) runs against the shadow allocator on copies of the
requests' KV states as they were before the step; a request found due by one side only,
or any difference in a request's freed range or evicted length, raises
``LockstepDivergence`` naming the request, and the free group's end compares the pools
and the mapping.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import types

from sglang.srt.environ import envs
from sglang.srt.managers import schedule_batch
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglang.srt.mem_cache.common import free_swa_out_of_window_slots
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from .. import _C
from .lockstep import LockstepDivergence
from .shared import SharedSWATokenToKVPoolAllocator, check_slot_kinds

logger = logging.getLogger(__name__)

_SWA = ComponentType.SWA
sglang_maybe_evict_swa = schedule_batch.ScheduleBatch.maybe_evict_swa  # SGLang's own, kept to restore and to compare
_eviction = _C.sglang.WindowEviction(schedule_batch.Req, schedule_batch.ReqKvInfo, _SWA)
_warned = set()
_sglang_batches = 0  # decode batches this hook handed to SGLang's loop


def _warn_once(reason):
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("swa_ext: SGLang's own maybe_evict_swa serves: %s", reason)


class _Settings:
    """SGLang's settings a decode step reads (the eviction interval, the prefix-lock
    release, AMD's MegaMoE cadence), each as ``envs.<NAME>.get()`` reads it, parsed again
    only when one of their variables changes. ``envs`` reads them through ``os.getenv``,
    which looks them up in ``os.environ``'s own table (``_data``, keyed as
    ``os.environ.encodekey`` makes the key) and, for a variable that is not set, raises
    and catches a KeyError on the way: the table itself is read here."""

    def __init__(self):
        self.fields = (envs.SGLANG_SWA_EVICTION_INTERVAL, envs.SGLANG_OPT_RELEASE_PREFILL_SWA,
                       envs.SGLANG_AMD_USE_FLYDSL_MEGA_MOE)
        self.keys = tuple(os.environ.encodekey(name) for field in self.fields
                          for name in (field.name, getattr(field, "deprecated_name", None)) if name)
        self.seen = None
        # The interval; why SGLang's loop must serve under these settings, or None (and
        # for a tree cache that releases prefix locks).
        self.interval = self.reason = self.reason_releasing = None

    def _variables(self):
        interval, release, mega_moe = self.fields
        return (*map(os.environ._data.get, self.keys), interval._set_to_none, release._set_to_none,
                mega_moe._set_to_none)

    def current(self):
        """Itself, its values as SGLang would read them now."""
        if self._variables() != self.seen:
            interval, release, mega_moe = self.fields
            self.interval = max(1, interval.get())
            self.reason = self.reason_releasing = None
            if schedule_batch._is_hip and mega_moe.get():  # read on AMD only, as SGLang reads it
                self.reason = "SGLANG_AMD_USE_FLYDSL_MEGA_MOE evicts on a forward-interval cadence"
            if release.get():
                self.reason_releasing = ("SGLANG_OPT_RELEASE_PREFILL_SWA releases prefix locks between the "
                                         "requests' frees")
            self.seen = self._variables()  # a get() may have set a variable from its deprecated name
        return self

    def watched(self):
        """What the values were read from, as WindowEviction.admit takes them."""
        sources = [(os.environ._data, key) for key in self.keys] + [(field, "_set_to_none") for field in self.fields]
        return [(source, key, value) for (source, key), value in zip(sources, self.seen)]


_settings = _Settings()


def _retain_floor_in_use(tree_cache):
    """Whether the cache may hold a request's SWA below its window (retain_floor)."""
    if type(tree_cache).swa_retain_floor is BasePrefixCache.swa_retain_floor:
        return False
    # UnifiedRadixCache keeps the window behind its last mamba checkpoint, mamba only.
    return not (hasattr(tree_cache, "is_mamba_enabled") and not tree_cache.is_mamba_enabled)


def _reason_not_native_ever(alloc, tree_cache):
    """Why SGLang's loop must evict every decode batch of this tree cache and allocator,
    or None."""
    if not isinstance(alloc, _C.HybridAllocator):
        return f"the allocator is SGLang's {type(alloc).__name__}"
    if tree_cache.page_size != alloc.page_size:
        return f"the tree cache's page size {tree_cache.page_size} is not the allocator's {alloc.page_size}"
    if tree_cache.supports_auxiliary_swa():
        return f"{type(tree_cache).__name__} has auxiliary windows"
    if type(tree_cache).evict_sliding_windows is not BasePrefixCache.evict_sliding_windows:
        return f"{type(tree_cache).__name__} has its own evict_sliding_windows"
    if _retain_floor_in_use(tree_cache):
        return f"{type(tree_cache).__name__} keeps SWA behind a checkpoint (swa_retain_floor)"
    return None


class _Fixed:
    """What no step changes of a scheduler's tree cache and allocator (their classes,
    page sizes, windows, prefix sharing, a lockstep allocator's shadow), checked on their
    first step. It holds the two, so that another pair cannot take their identities."""

    __slots__ = ("tree_cache", "alloc", "shadow", "swa", "reason", "window", "sharing", "releases_prefix_locks")

    def __init__(self, tree_cache, alloc):
        self.tree_cache, self.alloc = tree_cache, alloc
        self.shadow = getattr(alloc, "_shadow", None)
        self.swa = tree_cache.supports_swa()
        self.reason = self.window = self.sharing = None
        if self.swa:
            self.reason = _reason_not_native_ever(alloc, tree_cache)
            self.window, self.sharing = tree_cache.swa_retain_window, tree_cache.supports_prefix_sharing()
        self.releases_prefix_locks = hasattr(tree_cache, "release_swa_prefix_lock")


_fixed = None  # the last scheduler's pair (one a process)


def maybe_evict_swa(self):
    """``ScheduleBatch.maybe_evict_swa`` with the decode branch as one native call."""
    reason = _eviction.evict_batch(self)  # a batch of the admitted scheduler, mode and settings
    if reason is None:
        return
    if reason is False:
        _evict_checking(self)
    else:
        _evict_by_sglang(self, reason)


def _evict_checking(self):
    """A batch the native call has not admitted: the checks, and the admission of this
    scheduler's decode batches when they find nothing SGLang's loop must do."""
    global _fixed
    tree_cache, alloc = self.tree_cache, self.token_to_kv_pool_allocator
    fixed = _fixed
    if fixed is None or fixed.tree_cache is not tree_cache or fixed.alloc is not alloc:
        fixed = _fixed = _Fixed(tree_cache, alloc)
    if not fixed.swa or not self.forward_mode.is_decode():
        return sglang_maybe_evict_swa(self)
    settings = _settings.current()
    reason = fixed.reason or settings.reason or (settings.reason_releasing if fixed.releases_prefix_locks else None)
    if reason is None and fixed.shadow is None:
        # The next decode batches go straight to the native call while these hold.
        _eviction.admit(tree_cache, alloc, self.forward_mode, fixed.window, settings.interval, fixed.sharing,
                        settings.watched())
        reason = _eviction.evict(alloc, self.reqs, self.req_to_token_pool.req_to_token, fixed.window,
                                 settings.interval, fixed.sharing)
    elif reason is None and self.reqs:
        reason = _evict_in_lockstep(self, alloc, fixed, settings.interval)
    if reason is not None:
        _evict_by_sglang(self, reason)


def _evict_by_sglang(self, reason):
    global _sglang_batches
    _warn_once(reason)
    _sglang_batches += 1
    sglang_maybe_evict_swa(self)


def served():
    """Decode batches evicted in this process by the native call and by SGLang's loop
    (tests, benchmark)."""
    return {"native": _eviction.counters()["batches"], "sglang": _sglang_batches}


def _evict_in_lockstep(batch, alloc, fixed, interval):
    """The native eviction on a lockstep allocator: SGLang's own loop runs on copies of
    the requests' KV states against the shadow allocator, and each due request's freed
    range and evicted length must match. None, or why the batch must take SGLang's loop."""
    reqs, window = batch.reqs, fixed.window
    before = [_kv_copy(req.kv) for req in reqs]
    alloc.free_group_begin()
    got = []
    reason = _eviction.evict(alloc, reqs, batch.req_to_token_pool.req_to_token, window, interval, fixed.sharing,
                             free_group=False, record=got)
    if reason is None:
        want = _sglang_frees(batch, fixed.tree_cache, fixed.shadow, before, window, interval)
        alloc._lockstep.counts["maybe_evict_swa"] = alloc._lockstep.counts.get("maybe_evict_swa", 0) + 1
        _compare(reqs, got, want)  # a difference raises here, naming the request, and the scheduler stops
    alloc.free_group_end()
    return reason


def _kv_copy(kv):
    return dataclasses.replace(kv, component_evicted_seqlens=dict(kv.component_evicted_seqlens))


def _sglang_frees(batch, tree_cache, shadow, kvs, window, interval):
    """The decode branch of SGLang's loop on the shadow allocator, each request on a copy
    of its KV state as it was before the step: {batch index: (first position freed or the
    evicted length set, evicted length after)} for each request it found due."""
    due = batch._swa_eviction_trigger(window, interval)
    want = {}
    for i, (req, kv) in enumerate(zip(batch.reqs, kvs)):
        view = types.SimpleNamespace(kv=kv, seqlen=req.seqlen)
        if not (req.decode_batch_idx >= 1 and kv.holds_kv and due(view)):
            continue
        seen = []
        free_swa_out_of_window_slots(
            view, req.seqlen - 1, sliding_window_size=window, page_size=tree_cache.page_size,
            req_to_token_pool=batch.req_to_token_pool, token_to_kv_pool_allocator=shadow,
            supports_prefix_sharing=tree_cache.supports_prefix_sharing(), retain_floor=tree_cache.swa_retain_floor(req),
            free_segment=lambda slots, start_pos, seen=seen: (seen.append(start_pos),
                                                               shadow.free_swa_segment(slots, start_pos=start_pos)))
        end = kv.get_evicted_seqlen(_SWA)
        want[i] = (seen[0] if seen else end, end)
    return want


def _compare(reqs, got, want):
    for i, got_start, got_end in got:
        want_start, want_end = want.pop(i, (None, None))
        if want_end is None:
            raise LockstepDivergence(
                f"swa_ext lockstep: maybe_evict_swa, request {reqs[i].rid!r}: swa_ext found it due "
                f"(freed [{got_start}, {got_end})), SGLang's loop did not")
        freed = got_end > got_start
        if (got_end != want_end) or (freed and got_start != want_start):
            raise LockstepDivergence(
                f"swa_ext lockstep: maybe_evict_swa, request {reqs[i].rid!r}: swa_ext freed positions "
                f"[{got_start}, {got_end}) and set evicted length {got_end}; SGLang freed "
                f"[{want_start}, {want_end}) and set {want_end}")
    for i, (want_start, want_end) in want.items():
        raise LockstepDivergence(
            f"swa_ext lockstep: maybe_evict_swa, request {reqs[i].rid!r}: SGLang's loop found it due "
            f"(freed [{want_start}, {want_end})), swa_ext did not")


def _maybe_evict_swa_checking_slot_kinds(self):
    """``maybe_evict_swa`` after the shared mode's slot-kind check (SWA_EXT_DEBUG=1)."""
    if isinstance(self.token_to_kv_pool_allocator, SharedSWATokenToKVPoolAllocator):
        if "slot kinds" not in _warned:
            _warned.add("slot kinds")
            logger.info("swa_ext: SWA_EXT_DEBUG=1: each scheduler step checks that no slot holds a full and an SWA "
                        "token at once")
        check_slot_kinds(self)
    maybe_evict_swa(self)


def install(*, check_slot_kinds_each_step=False):
    """The hook in SGLang's scheduler; with ``check_slot_kinds_each_step`` (the shared mode
    under SWA_EXT_DEBUG=1), each step first checks that no slot holds two kinds of KV."""
    schedule_batch.ScheduleBatch.maybe_evict_swa = \
        _maybe_evict_swa_checking_slot_kinds if check_slot_kinds_each_step else maybe_evict_swa


def uninstall():
    global _fixed
    schedule_batch.ScheduleBatch.maybe_evict_swa = sglang_maybe_evict_swa
    _fixed = None
    _eviction.withdraw()


def installed():
    return schedule_batch.ScheduleBatch.maybe_evict_swa in (maybe_evict_swa, _maybe_evict_swa_checking_slot_kinds)
