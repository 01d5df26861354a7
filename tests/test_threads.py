"""Thread safety, stated and enforced.

The contract: an allocator (and the pool views ``full_attn_allocator`` /
``swa_attn_allocator`` of a hybrid one, which share its guard) is NOT safe for
overlapping calls. Each call holds the GIL for its whole duration, so ordinary
Python threads that share an allocator are serialised call by call and the state
stays consistent (what the threads do between calls is theirs to coordinate). A
call that would overlap another call on the same allocator (a free-threaded
interpreter, native code that dropped the GIL, or a re-entrant call made while a
call is still running) raises ``swa_ext.ConcurrentUseError`` (a RuntimeError) and
changes nothing, rather than corrupting the free lists. Read-only calls
(available sizes, ``translate_loc_from_full_to_swa``, ``backup_state``, the
``free_pages`` views, ``check_invariants``) do not take the guard: they rely on
the GIL alone.

Overlap is provoked deterministically by re-entrance: an index argument of a
type whose metaclass computes ``__name__`` in Python runs Python code while the
native call holds the allocator's guard (the TypeError message reads the type's
name), and that code calls the same allocator.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import swa_ext


def T(values):
    return torch.tensor(values, dtype=torch.int64)


def make(page_size=4, need_sort=False, shared=False, kernels="cpu"):
    """shared: the shared mode (SPEC.md section 8), one list of 256 pages."""
    return swa_ext.SWATokenToKVPoolAllocator(256 * page_size, (256 if shared else 128) * page_size, page_size,
                                             torch.bfloat16, "cpu", need_sort=need_sort, shared=shared, kernels=kernels)


def reentrant_argument(inner_call):
    """An object whose type name, when the native layer reads it, runs inner_call."""
    seen = {}

    class Meta(type):
        @property
        def __name__(cls):
            try:
                seen["result"] = inner_call()
            except BaseException as e:  # noqa: BLE001 - recorded for the test to inspect
                seen["error"] = e
            return "Reentrant"

    class Reentrant(metaclass=Meta):
        pass

    return Reentrant(), seen


def test_concurrent_use_error_is_a_runtime_error():
    assert issubclass(swa_ext.ConcurrentUseError, RuntimeError)


INNER_CALLS = {
    "alloc_extend": lambda a: a.alloc_extend(T([0]), T([0]), T([4]), T([4]), T([-1]), 4),
    "alloc_decode": lambda a: a.alloc_decode(T([5]), T([5]), T([7])),
    "free": lambda a: a.free(T([4])),
    "free_swa_segment": lambda a: a.free_swa_segment(T([4, 5, 6, 7]), start_pos=0),
    "free_group_begin": lambda a: a.free_group_begin(),
    "set_full_to_swa_mapping": lambda a: a.set_full_to_swa_mapping(T([4]), T([4])),
    "clear": lambda a: a.clear(),
    "full_pool.alloc": lambda a: a.full_attn_allocator.alloc(4),
    "swa_pool.free_page_ids": lambda a: a.swa_attn_allocator.free_page_ids(T([1])),
    "evict_out_of_window": lambda a: a.evict_out_of_window(torch.zeros((1, 8), dtype=torch.int64), T([0]), T([8]),
                                                           T([0]), 1),
}

OUTER_CALLS = {
    "free": lambda a, x: a.free(x),
    "free_segment": lambda a, x: a.free_segment(x, start_pos=0),
    "alloc_extend": lambda a, x: a.alloc_extend(T([0]), T([0]), T([4]), T([4]), x, 4),
    "swa_pool.free": lambda a, x: a.swa_attn_allocator.free(x),
}


@pytest.mark.parametrize("shared", [False, True], ids=["default", "shared"])
@pytest.mark.parametrize("outer", sorted(OUTER_CALLS))
@pytest.mark.parametrize("inner", sorted(INNER_CALLS))
def test_overlapping_call_raises_and_changes_nothing(outer, inner, shared):
    a = make(shared=shared)
    row = a.alloc_extend(T([0]), T([0]), T([5]), T([5]), T([-1]), 5)  # slots 4..8, SWA mapped
    assert row.tolist() == [4, 5, 6, 7, 8]
    before = a.backup_state()
    arg, seen = reentrant_argument(lambda: INNER_CALLS[inner](a))
    with pytest.raises(TypeError, match="Reentrant"):
        OUTER_CALLS[outer](a, arg)
    assert isinstance(seen.get("error"), swa_ext.ConcurrentUseError), seen
    assert "result" not in seen
    assert a.backup_state() == before
    a.check_invariants()
    # The guard is released: the allocator works normally afterwards.
    a.free(row)
    assert a.full_available_size() == a.size_full


def test_separate_allocators_do_not_share_a_guard():
    a, b = make(), make()
    arg, seen = reentrant_argument(lambda: b.alloc_extend(T([0]), T([0]), T([4]), T([4]), T([-1]), 4))
    with pytest.raises(TypeError):
        a.free(arg)
    assert "error" not in seen
    assert seen["result"].tolist() == [4, 5, 6, 7]
    b.check_invariants()


@pytest.mark.parametrize("shared,kernels", [(False, "cpu"), (True, "cpu"), (True, "emulated")],
                         ids=["default", "shared", "shared-emulated"])
@pytest.mark.parametrize("page_size,need_sort", [(1, False), (4, True), (16, False)])
def test_python_threads_sharing_an_allocator_stay_consistent(page_size, need_sort, shared, kernels):
    """Threads serialised by the GIL: many small lifecycles at once never see a
    ConcurrentUseError, never get a slot twice, and leave the pools whole. In the shared
    mode a slot is one index space for both kinds: no SWA slot is a live full slot either."""
    a = make(page_size, need_sort, shared, kernels)
    ps = page_size
    threads_n, rounds = 8, 300
    errors = []
    handed_out: set[int] = set()
    lock = threading.Lock()  # guards handed_out only: the allocator calls are not locked
    start = threading.Barrier(threads_n)
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible

    def worker(seed):
        import random

        rng = random.Random(seed)
        try:
            start.wait()
            for _ in range(rounds):
                n = rng.randint(1, 3 * ps)
                prompt = T([n])
                out = a.alloc_extend_swa_tail(T([0]), T([0]), prompt, prompt, T([-1]), n, rng.randint(0, n)
                                              if ps == 1 else n)
                if out is None:
                    continue
                slots = out.tolist()
                swa_slots = [s for s in a.translate_loc_from_full_to_swa(out).tolist() if s > 0] if shared else []
                with lock:
                    assert not handed_out.intersection(slots + swa_slots), "a slot was handed out twice"
                    handed_out.update(slots + swa_slots)
                seq = T([n + 1])
                d = a.alloc_decode(seq, seq, out[-1:])
                if d is not None:
                    slots.append(int(d))
                    new = [int(d)] + ([int(a.translate_loc_from_full_to_swa(d))] if shared else [])
                    new_swa = [s for s in new[1:] if s > 0 and s not in swa_slots]
                    with lock:
                        assert int(d) not in handed_out and not handed_out.intersection(new_swa)
                        handed_out.update([int(d)] + new_swa)
                        swa_slots += new_swa
                with lock:
                    handed_out.difference_update(slots + swa_slots)
                slots_t = T(slots)
                if ps == 1:
                    # the head of a short tail has no SWA slot: free the SWA side of the rest
                    a.free_swa(slots_t[a.translate_loc_from_full_to_swa(slots_t) > 0])
                    a.free_full(slots_t)
                else:
                    a.free(slots_t)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    try:
        workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads_n)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert not errors, errors[:3]
    a.check_invariants()
    assert a.full_available_size() == a.size_full // ps * ps
    assert a.swa_available_size() == a.size_swa // ps * ps
    assert not bool(a.full_to_swa_index_mapping[:-1].any())
