"""The scheduler's per-step SWA bookkeeping as one native call (docs/sglang-eviction.md).

SGLang's ``ScheduleBatch.maybe_evict_swa`` walks the running batch in Python and, for
each request due, frees the SWA pages that slid out of its window through
``free_swa_out_of_window_slots`` (one ``free_swa_segment`` call a request, in one free
group). With swa_ext's allocator serving, ``maybe_evict_swa`` below replaces the decode
branch of that loop: the requests' lengths are read in one pass, the due test and the
request's lowest freeable position (``swa_dead_lo``) are computed for the whole batch at
once, and the allocator's ``evict_out_of_window`` frees every due request's pages in
request order inside the same free group. Each request's evicted length is then set
through its KV state, as SGLang's loop sets it.

What the native call does not cover goes to SGLang's own loop, for the whole batch, with
one warning for each reason: another allocator, auxiliary windows, a tree cache with its
own ``evict_sliding_windows`` or a ``swa_retain_floor`` in use (mamba checkpoints), the
forward-interval cadence of AMD's MegaMoE, the prefix-lock release
(``SGLANG_OPT_RELEASE_PREFILL_SWA``, whose tree frees interleave with the requests'),
and lengths the native call rejects. Extend batches are SGLang's too.

In lockstep mode SGLang's own ``free_swa_out_of_window_slots`` runs for every due
request against the shadow allocator, on a copy of the request's KV state; any
difference in a request's freed range or evicted length raises ``LockstepDivergence``
naming the request, and the free group's end compares the pools and the mapping.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
import types

import numpy
import torch
from sglang.srt.environ import envs
from sglang.srt.managers import schedule_batch
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglang.srt.mem_cache.common import free_swa_out_of_window_slots
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from .. import _C
from .lockstep import LockstepDivergence

logger = logging.getLogger(__name__)

_SWA = ComponentType.SWA
_kv = operator.attrgetter("kv")
_decode_batch_idx = operator.attrgetter("decode_batch_idx")
_seqlen = operator.attrgetter("seqlen")
_kv_lengths = operator.attrgetter("req_pool_idx", "cache_protected_len", "swa_evict_floor")
_cursors = operator.attrgetter("component_evicted_seqlens")
_swa_cursor = operator.methodcaller("get", _SWA, 0)

_sglang_maybe_evict_swa = schedule_batch.ScheduleBatch.maybe_evict_swa
_warned = set()
# Batches evicted by the native call and by SGLang's loop, in this process (tests, benchmark).
counts = {"native": 0, "sglang": 0}


def _warn_once(reason):
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("swa_ext: SGLang's own maybe_evict_swa serves: %s", reason)


def _retain_floor_in_use(tree_cache):
    """Whether the cache may hold a request's SWA below its window (retain_floor)."""
    if type(tree_cache).swa_retain_floor is BasePrefixCache.swa_retain_floor:
        return False
    # UnifiedRadixCache keeps the window behind its last mamba checkpoint, mamba only.
    return not (hasattr(tree_cache, "is_mamba_enabled") and not tree_cache.is_mamba_enabled)


def _reason_not_native(batch, alloc, tree_cache):
    """Why SGLang's loop must evict this decode batch, or None."""
    if not isinstance(alloc, _C.HybridAllocator):
        return f"the allocator is SGLang's {type(alloc).__name__}"
    if tree_cache.supports_auxiliary_swa():
        return f"{type(tree_cache).__name__} has auxiliary windows"
    if type(tree_cache).evict_sliding_windows is not BasePrefixCache.evict_sliding_windows:
        return f"{type(tree_cache).__name__} has its own evict_sliding_windows"
    if _retain_floor_in_use(tree_cache):
        return f"{type(tree_cache).__name__} keeps SWA behind a checkpoint (swa_retain_floor)"
    if schedule_batch._is_hip and envs.SGLANG_AMD_USE_FLYDSL_MEGA_MOE.get():
        return "SGLANG_AMD_USE_FLYDSL_MEGA_MOE evicts on a forward-interval cadence"
    if envs.SGLANG_OPT_RELEASE_PREFILL_SWA.get() and hasattr(tree_cache, "release_swa_prefix_lock"):
        return "SGLANG_OPT_RELEASE_PREFILL_SWA releases prefix locks between the requests' frees"
    return None


def maybe_evict_swa(self):
    """``ScheduleBatch.maybe_evict_swa`` with the decode branch as one native call."""
    tree_cache = self.tree_cache
    if not tree_cache.supports_swa() or not self.forward_mode.is_decode():
        return _sglang_maybe_evict_swa(self)
    alloc = self.token_to_kv_pool_allocator
    reason = _reason_not_native(self, alloc, tree_cache)
    if reason is None:
        reason = evict_decode_batch(self, alloc, tree_cache)
        if reason is None:
            counts["native"] += 1
            return
    _warn_once(reason)
    counts["sglang"] += 1
    _sglang_maybe_evict_swa(self)


def _batch_lengths(reqs):
    """What the due test reads, a column each, without a Python frame a request (these
    reads are most of the hook's cost)."""
    n = len(reqs)
    kvs = list(map(_kv, reqs))
    return kvs, (numpy.fromiter(map(_decode_batch_idx, reqs), numpy.int64, n),
                 numpy.fromiter(map(_seqlen, reqs), numpy.int64, n),
                 numpy.fromiter(map(_swa_cursor, map(_cursors, kvs)), numpy.int64, n))


def _due_lengths(kvs, due_at):
    """Row, protected length and eviction shield of the due requests (row -1: no KV)."""
    lengths = list(map(_kv_lengths, map(kvs.__getitem__, due_at.tolist())))
    try:
        return numpy.array(lengths, numpy.int64).reshape(-1, 3).T
    except TypeError:  # a request that holds no KV (req_pool_idx None) is never evicted
        return numpy.array([(-1 if row is None else row, *rest) for row, *rest in lengths], numpy.int64).T


def evict_decode_batch(batch, alloc, tree_cache):
    """The decode branch of SGLang's ``maybe_evict_swa`` for the whole batch in one native
    call; returns None, or why the batch must take SGLang's loop (nothing changed then)."""
    reqs = batch.reqs
    if not reqs:
        return None
    window = tree_cache.swa_retain_window
    page_size = tree_cache.page_size
    interval = max(1, envs.SGLANG_SWA_EVICTION_INTERVAL.get())
    kvs, (decode_idx, seqlen, cursor) = _batch_lengths(reqs)
    pre_len = seqlen - 1
    # SGLang's due test (_swa_eviction_trigger), on the cursor as the request holds it.
    due_at = numpy.flatnonzero((decode_idx >= 1) & (pre_len - window >= cursor + interval))
    if due_at.size == 0:
        return None
    rows, protected, evict_floor = _due_lengths(kvs, due_at)
    holds_kv = numpy.flatnonzero(rows >= 0)
    if holds_kv.size < due_at.size:
        due_at, rows, protected, evict_floor = (a[holds_kv] for a in (due_at, rows, protected, evict_floor))
    # ReqKvInfo.swa_dead_lo: above the tree-owned prefix and the eviction shield, the
    # shield rounded up to a page; the request's frees start there.
    dead_lo = numpy.maximum(protected, evict_floor)
    if page_size > 1:
        dead_lo = numpy.where(dead_lo > protected, -(-dead_lo // page_size) * page_size, dead_lo)
    was = cursor[due_at]
    start = numpy.maximum(was, dead_lo)
    due_pre = pre_len[due_at]
    # A start past the committed length frees nothing and only moves the cursor.
    frees = numpy.flatnonzero(start <= due_pre)
    end = start.copy()
    alloc.free_group_begin()
    if frees.size:
        try:
            end[frees] = _C.evict_out_of_window(
                alloc, batch.req_to_token_pool.req_to_token, torch.from_numpy(rows[frees]),
                torch.from_numpy(due_pre[frees]), torch.from_numpy(start[frees]), window, interval=1,
                prefix_sharing=tree_cache.supports_prefix_sharing()).numpy()
        except ValueError as e:  # rejected before any change
            alloc.free_group_end()
            return f"the native call refused this batch ({e})"
    shadow = getattr(alloc, "_shadow", None)
    if shadow is not None:  # lockstep: a difference raises here, naming the request, and the scheduler stops
        want = _sglang_frees(batch, tree_cache, shadow, due_at.tolist())
        alloc._lockstep.counts["maybe_evict_swa"] = alloc._lockstep.counts.get("maybe_evict_swa", 0) + 1
        _compare(reqs, due_at.tolist(), start.tolist(), end.tolist(), want)
    alloc.free_group_end()
    moved = numpy.flatnonzero(end != was)
    for i, length in zip(due_at[moved].tolist(), end[moved].tolist()):
        kvs[i].set_evicted_seqlen(_SWA, length)
    return None


def _sglang_frees(batch, tree_cache, shadow, due_at):
    """SGLang's own per-request frees on the shadow allocator, each on a copy of the
    request's KV state: (evicted length it set first, evicted length after) a request."""
    want = []
    for i in due_at:
        req = batch.reqs[i]
        kv = dataclasses.replace(req.kv, component_evicted_seqlens=dict(req.kv.component_evicted_seqlens))
        seen = []
        free_swa_out_of_window_slots(
            types.SimpleNamespace(kv=kv), req.seqlen - 1, sliding_window_size=tree_cache.swa_retain_window,
            page_size=tree_cache.page_size, req_to_token_pool=batch.req_to_token_pool,
            token_to_kv_pool_allocator=shadow, supports_prefix_sharing=tree_cache.supports_prefix_sharing(),
            retain_floor=tree_cache.swa_retain_floor(req),
            free_segment=lambda slots, start_pos, seen=seen: (seen.append(start_pos),
                                                               shadow.free_swa_segment(slots, start_pos=start_pos)))
        end = kv.get_evicted_seqlen(_SWA)
        want.append((seen[0] if seen else end, end))
    return want


def _compare(reqs, due_at, start, end, want):
    for i, got_start, got_end, (want_start, want_end) in zip(due_at, start, end, want):
        freed = got_end > got_start
        if (got_end != want_end) or (freed and got_start != want_start):
            raise LockstepDivergence(
                f"swa_ext lockstep: maybe_evict_swa, request {reqs[i].rid!r}: swa_ext freed positions "
                f"[{got_start}, {got_end}) and set evicted length {got_end}; SGLang freed "
                f"[{want_start}, {want_end}) and set {want_end}")


def install():
    schedule_batch.ScheduleBatch.maybe_evict_swa = maybe_evict_swa


def uninstall():
    schedule_batch.ScheduleBatch.maybe_evict_swa = _sglang_maybe_evict_swa


def installed():
    return schedule_batch.ScheduleBatch.maybe_evict_swa is maybe_evict_swa
