"""Bad input: every public method against every class of bad argument.

Each call must raise the documented exception (TypeError for a wrong type, dtype
or device; ValueError, naming the argument, for a bad value) and leave the
allocator exactly as it was: ``backup_state()`` after equals the snapshot taken
before, and so do the mapping tensor and both pools' free lists. Where the
reference (tests/reference.py) defines the same call, it must raise ValueError
too and keep its snapshot.

The fixture state is not trivial: two live requests (one with a partial last page,
one whose SWA window was partly evicted) and some freed pages, in both page-size
regimes (1 and 4), with need_sort on and off, and in the shared mode (SPEC.md section 8), at
parent_k 1 and on parent pages (section 8.1: parent_k 3, either side small).
"""

from __future__ import annotations

import collections
import random

import pytest
import torch

import swa_ext
from cuda_support import cuda_skip_reason
from swa_ext import decode
from reference import SWAAllocatorRef

SIZE, SIZE_SWA = 64, 48


def T(values, dtype=torch.int64):
    return torch.tensor(list(values), dtype=dtype)


class World:
    """A native allocator and the reference, driven to the same non-trivial state."""

    def __init__(self, page_size, need_sort, shared=False, parent_k=1, small_side="swa"):
        self.ps = ps = page_size
        size, size_swa = SIZE, SIZE_SWA
        if shared:  # the small side parent_k times the other's
            size, size_swa = (SIZE, SIZE * parent_k) if small_side == "swa" else (SIZE * parent_k, SIZE)
        self.native = swa_ext.SWATokenToKVPoolAllocator(size, size_swa, ps, torch.bfloat16, "cpu", need_sort=need_sort,
                                                        shared=shared, parent_k=parent_k, small_side=small_side)
        self.ref = SWAAllocatorRef(size, size_swa, ps, need_sort, shared=shared, parent_k=parent_k,
                                   small_side=small_side)
        # a: 2 pages + 1 token (partial last page), fully mapped.
        self.a = self.both("alloc_extend", T([0, 0]), T([0, 0]), T([2 * ps + 1, 2 * ps]), T([2 * ps + 1, 2 * ps]),
                           T([-1, -1]), 4 * ps + 1)
        self.a, freed = self.a[: 2 * ps + 1], self.a[2 * ps + 1:]
        self.both("free", T(freed))  # the second request of the batch is gone: free pages exist
        # b: 3 pages, its first page's SWA slots evicted (evicted length = ps).
        self.b = self.both("alloc_extend", T([0]), T([0]), T([3 * ps]), T([3 * ps]), T([-1]), 3 * ps)
        self.both("free_swa_segment", T(self.b[:ps]), start_pos=0)
        self.b_evicted = ps

    def both(self, name, *args, **kwargs):
        out = getattr(self.native, name)(*args, **kwargs)
        out_ref = getattr(self.ref, name)(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            out = out.tolist()
        assert out == out_ref
        return out

    def state(self):
        n = self.native
        return (
            n.backup_state(),
            n.full_to_swa_index_mapping.tolist(),
            n.full_attn_allocator.free_pages.tolist(),
            n.swa_attn_allocator.free_pages.tolist(),
            n.full_attn_allocator.release_pages.tolist(),
            n.swa_attn_allocator.release_pages.tolist(),
            n.full_available_size(),
            n.swa_available_size(),
        )

    def free_token(self):
        """A full token index whose page is free (a child page: free in a parent, bound or not)."""
        pool = self.ref.full_attn_allocator
        page = next(p for p in range(1, pool.num_pages + 1) if pool._state[p] == "free")
        return page * self.ps

    def past_end(self, pool="full_attn_allocator"):
        """One past the last slot of a side's pages."""
        return (getattr(self.ref, pool).num_pages + 1) * self.ps


def expect(world, exc, name, *args, ref=True, target=None, **kwargs):
    """`name(*args)` raises `exc` on the native side (and ValueError in the reference
    when exc is ValueError and ref is set); neither side changes."""
    native = target(world.native) if target else world.native
    before = world.state()
    before_ref = world.ref.snapshot()
    with pytest.raises(exc) as info:
        getattr(native, name)(*args, **kwargs)
    assert world.state() == before, f"{name} raised {info.value!r} but changed the state"
    world.native.check_invariants()
    if ref and exc is ValueError:
        ref_obj = target(world.ref) if target else world.ref
        with pytest.raises(ValueError):
            getattr(ref_obj, name)(*args, **kwargs)
        assert world.ref.snapshot() == before_ref
    return info.value


@pytest.fixture(params=[(1, False), (4, False), (4, True), (1, True), (1, False, True), (4, True, True),
                        (1, False, True, 3, "full"), (4, True, True, 3, "full"), (4, False, True, 3, "swa")],
                ids=["ps1", "ps4", "ps4-sorted", "ps1-sorted", "ps1-shared", "ps4-sorted-shared",
                     "ps1-k3-full", "ps4-sorted-k3-full", "ps4-k3-swa"])
def world(request):
    return World(*request.param)


@pytest.fixture(params=[(4, False), (4, True), (4, False, True), (4, False, True, 3, "full")],
                ids=["ps4", "ps4-sorted", "ps4-shared", "ps4-k3-full"])
def paged(request):
    return World(*request.param)


# ------------------------------------------------------------------ the calls
# Each entry: name -> function(world, index_tensor) making a call whose only
# tensor argument under test is `index_tensor` (so every type class applies).

def _index_calls(w):
    ps = w.ps
    a_last = w.a[-1]
    return {
        "free": lambda x: w.native.free(x),
        "free_swa": lambda x: w.native.free_swa(x),
        "free_full": lambda x: w.native.free_full(x),
        "free_segment": lambda x: w.native.free_segment(x, start_pos=0),
        "free_swa_segment": lambda x: w.native.free_swa_segment(x, start_pos=0),
        "free_full_segment": lambda x: w.native.free_full_segment(x, start_pos=0),
        "translate_loc_from_full_to_swa": lambda x: w.native.translate_loc_from_full_to_swa(x),
        "set_full_to_swa_mapping": lambda x: w.native.set_full_to_swa_mapping(x, T([0])),
        "clear_full_to_swa_mapping": lambda x: w.native.clear_full_to_swa_mapping(x),
        "alloc_extend.last_loc": lambda x: w.native.alloc_extend(T([0]), T([0]), T([1]), T([1]), x, 1),
        "alloc_extend.seq_lens": lambda x: w.native.alloc_extend(T([0]), T([0]), x, T([1]), T([-1]), 1),
        "alloc_extend.prefix_lens_cpu": lambda x: w.native.alloc_extend(T([0]), x, T([1]), T([1]), T([-1]), 1),
        "alloc_extend_swa_tail.last_loc": lambda x: w.native.alloc_extend_swa_tail(T([0]), T([0]), T([1]), T([1]), x, 1, 1),
        "alloc_decode.seq_lens": lambda x: w.native.alloc_decode(x, T([len(w.a) + 1]), T([a_last])),
        "alloc_decode.last_loc": lambda x: w.native.alloc_decode(T([len(w.a) + 1]), T([len(w.a) + 1]), x),
        "evict_out_of_window.rows": lambda x: w.native.evict_out_of_window(
            torch.zeros((1, 4), dtype=torch.int64), x, T([0]), T([0]), 1),
        "pool.free": lambda x: w.native.full_attn_allocator.free(x),
        "pool.free_page_ids": lambda x: w.native.swa_attn_allocator.free_page_ids(x),
        "pool.free_segment": lambda x: w.native.full_attn_allocator.free_segment(x, start_pos=0),
        "pool.alloc_extend.last_loc": lambda x: w.native.full_attn_allocator.alloc_extend(
            T([0]), T([0]), T([ps]), T([ps]), x, ps),
        "pool.alloc_decode.last_loc": lambda x: w.native.swa_attn_allocator.alloc_decode(T([2]), T([2]), x),
    }


INDEX_CALLS = sorted(_index_calls(type("W", (), {"ps": 1, "a": [1], "native": None})()).keys())

BAD_TYPES = {
    "list": (lambda: [4], TypeError),
    "tuple": (lambda: (4,), TypeError),
    "int": (lambda: 4, TypeError),
    "none": (lambda: None, TypeError),
    "float32": (lambda: T([4], torch.float32), TypeError),
    "int16": (lambda: T([4], torch.int16), TypeError),
    "bool": (lambda: torch.tensor([True]), TypeError),
    "uint8": (lambda: T([4], torch.uint8), TypeError),
    "meta_device": (lambda: torch.empty(1, dtype=torch.int64, device="meta"), TypeError),
    "two_d": (lambda: T([4]).reshape(1, 1), ValueError),
}


@pytest.mark.parametrize("bad", sorted(BAD_TYPES))
@pytest.mark.parametrize("call", INDEX_CALLS)
def test_bad_index_argument_type(world, call, bad):
    make, exc = BAD_TYPES[bad]
    if call == "evict_out_of_window.rows" and bad in ("list", "tuple"):
        exc = ValueError  # rows may be a list of ints: row 4 is then outside the 1-row table
    fn = _index_calls(world)[call]
    before = world.state()
    with pytest.raises(exc) as info:
        fn(make())
    assert not isinstance(info.value, swa_ext.ConcurrentUseError)
    assert world.state() == before
    # the allocator is still usable (the concurrency guard was released)
    world.native.free_group_begin()
    world.native.free_group_end()
    assert world.state() == before


def test_error_messages_name_the_argument(paged):
    w = paged
    with pytest.raises(TypeError, match="free_index"):
        w.native.free([4])
    with pytest.raises(TypeError, match="last_loc"):
        w.native.alloc_extend(T([0]), T([0]), T([1]), T([1]), T([-1], torch.float64), 1)
    with pytest.raises(ValueError, match="start_pos"):
        w.native.free_segment(T(w.b[w.ps:]), start_pos=1)
    with pytest.raises(ValueError, match="extend_num_tokens"):
        w.native.alloc_extend(T([0]), T([0]), T([2]), T([2]), T([-1]), 3)


def test_int32_indices_are_accepted(world):
    """The same call with int32 tensors behaves as with int64 (not a bad input)."""
    w = world
    out = w.native.alloc_extend(T([0], torch.int32), T([0], torch.int32), T([3], torch.int32),
                                T([3], torch.int32), T([-1], torch.int32), 3)
    ref = w.ref.alloc_extend([0], [0], [3], [3], [-1], 3)
    assert out.dtype == torch.int64 and out.tolist() == ref
    w.native.free(out.to(torch.int32))
    w.ref.free(ref)
    assert w.native.full_to_swa_index_mapping.tolist() == w.ref.full_to_swa_index_mapping


# ------------------------------------------------------------------ issue 2's value classes


def test_mismatched_batch_lengths(world):
    w = world
    ps = w.ps
    expect(w, ValueError, "alloc_extend", T([0, 0]), T([0, 0]), T([1, 1]), T([1, 1]), T([-1]), 2)
    expect(w, ValueError, "alloc_extend", T([0]), T([0]), T([1, 1]), T([1, 1]), T([-1, -1]), 2)
    expect(w, ValueError, "alloc_decode", T([len(w.a) + 1, 2]), T([len(w.a) + 1, 2]), T([w.a[-1]]))
    expect(w, ValueError, "set_full_to_swa_mapping", T(w.a[:2]), T([0]))
    expect(w, ValueError, "evict_out_of_window", torch.zeros((2, 4 * ps), dtype=torch.int64), T([0, 1]), T([0]), T([0, 0]), 1,
           ref=False)
    expect(w, ValueError, "evict_out_of_window", torch.zeros((2, 4 * ps), dtype=torch.int64), T([0]), T([0]), T([0, 0]), 1,
           ref=False)


def test_lengths_that_disagree(world):
    w = world
    # extend_num_tokens != sum(seq - prefix)
    expect(w, ValueError, "alloc_extend", T([0]), T([0]), T([3]), T([3]), T([-1]), 2)
    expect(w, ValueError, "alloc_extend_swa_tail", T([0]), T([0]), T([3]), T([3]), T([-1]), 4, 1)
    # device copy and CPU copy differ
    expect(w, ValueError, "alloc_extend", T([0]), T([1]), T([3]), T([3]), T([-1]), 3)
    expect(w, ValueError, "alloc_extend", T([0]), T([0]), T([3]), T([2]), T([-1]), 3)
    expect(w, ValueError, "alloc_decode", T([len(w.a) + 1]), T([len(w.a) + 2]), T([w.a[-1]]))


def test_negative_lengths_and_prefix_past_seq(world):
    w = world
    a_len, a_last = len(w.a), w.a[-1]
    expect(w, ValueError, "alloc_extend", T([0]), T([0]), T([-1]), T([-1]), T([-1]), -1)
    expect(w, ValueError, "alloc_extend", T([-1]), T([-1]), T([1]), T([1]), T([-1]), 2)
    expect(w, ValueError, "alloc_extend", T([a_len]), T([a_len]), T([a_len - 1]), T([a_len - 1]), T([a_last]), -1)
    expect(w, ValueError, "alloc_decode", T([0]), T([0]), T([-1]))
    expect(w, ValueError, "alloc_decode", T([-3]), T([-3]), T([-1]))
    expect(w, ValueError, "alloc", -1 * w.ps)


def test_lengths_whose_sums_overflow_int64(world):
    # Two lengths near 2**63 sum to 1 modulo 2**64: the wrapped sum passed the
    # extend_num_tokens check and sized the output for one slot, and the write ran past
    # it (a segfault). Lengths beyond 2**62 (no pool holds them) and sums past int64 are
    # refused by name; the reference, in Python ints, has no such limit.
    w = world
    big = 2**63 - 1
    for seq, n in (([big, big, 3], 1), ([2**62, 2**62], 0), ([2**62 + 1], 2**62 + 1)):
        k = len(seq)
        err = expect(w, ValueError, "alloc_extend", T([0] * k), T([0] * k), T(seq), T(seq), T([-1] * k), n, ref=False)
        assert str(err).startswith("seq_lens: "), err
    err = expect(w, ValueError, "alloc_decode", T([big]), T([big]), T([w.a[-1]]), ref=False)
    assert str(err).startswith("seq_lens: "), err


@pytest.mark.parametrize("arg", ["full_tokens", "swa_tokens", "full_evictable_tokens", "swa_evictable_tokens"])
def test_reservation_counts_out_of_range(world, arg):
    # reservation_fits prices counts of tokens: a negative one, or one past the longest
    # length a pool holds (2**62, so that no sum of them overflows), is refused by name.
    counts = dict(full_tokens=0, swa_tokens=0, full_evictable_tokens=0, swa_evictable_tokens=0)
    for bad in (-1, -2**63, 2**62 + 1, 2**63 - 1):
        for empty_pool in (False, True):  # checked before the empty pool sets the evictable ones aside
            err = expect(world, ValueError, "reservation_fits", **{**counts, arg: bad}, empty_pool=empty_pool,
                         ref=False)
            assert str(err).startswith(f"{arg}: "), err
    for bad in (1.5, "1", None, 2**64):
        err = expect(world, TypeError, "reservation_fits", **{**counts, arg: bad}, ref=False)
        assert str(err).startswith(f"{arg}: "), err


def test_last_loc_must_match_the_prefix(world):
    w = world
    ps = w.ps
    a_len, a_last = len(w.a), w.a[-1]
    # not -1 for an empty prefix
    expect(w, ValueError, "alloc_extend", T([0]), T([0]), T([2]), T([2]), T([a_last]), 2)
    expect(w, ValueError, "alloc_extend_swa_tail", T([0]), T([0]), T([2]), T([2]), T([a_last]), 2, 2)
    # -1 for a non-empty prefix
    expect(w, ValueError, "alloc_extend", T([a_len]), T([a_len]), T([a_len + 1]), T([a_len + 1]), T([-1]), 1)
    if ps > 1:
        # not where the prefix ends in its page (one slot off)
        expect(w, ValueError, "alloc_extend", T([a_len]), T([a_len]), T([a_len + 1]), T([a_len + 1]), T([a_last + 1]), 1)
        expect(w, ValueError, "alloc_decode", T([a_len + 1]), T([a_len + 1]), T([a_last + 1]))
        # right offset but in a page that is free
        free_at_offset = w.free_token() + a_last % ps
        expect(w, ValueError, "alloc_decode", T([a_len + 1]), T([a_len + 1]), T([free_at_offset]))
        # last_loc continues a partial page whose SWA slot was evicted
        w.both("free_swa", T(w.a))
        expect(w, ValueError, "alloc_decode", T([a_len + 1]), T([a_len + 1]), T([a_last]))


@pytest.mark.parametrize("method", ["free", "free_swa", "free_full", "free_segment", "free_swa_segment",
                                    "free_full_segment", "set_full_to_swa_mapping", "clear_full_to_swa_mapping"])
@pytest.mark.parametrize("where", ["page0", "past_end", "negative"])
def test_indices_outside_the_pool(world, method, where):
    w = world
    index = {"page0": 0, "past_end": w.past_end(), "negative": -5}[where]
    args = (T([index]),) if method != "set_full_to_swa_mapping" else (T([index]), T([0]))
    kwargs = {"start_pos": 0} if method.endswith("segment") else {}
    expect(w, ValueError, method, *args, **kwargs)
    if w.ps > 1 and method.endswith("segment") is False and where != "negative":
        # every slot of page 0 is the padding page
        args = (T([w.ps - 1]),) if method != "set_full_to_swa_mapping" else (T([w.ps - 1]), T([0]))
        expect(w, ValueError, method, *args, **kwargs)


def test_translate_outside_the_mapping(world):
    w = world
    expect(w, ValueError, "translate_loc_from_full_to_swa", T([len(w.native.full_to_swa_index_mapping)]))
    expect(w, ValueError, "translate_loc_from_full_to_swa", T([-2]))


def test_swa_slot_outside_the_swa_pool(world):
    w = world
    expect(w, ValueError, "set_full_to_swa_mapping", T([w.a[0]]), T([w.past_end("swa_attn_allocator")]))
    expect(w, ValueError, "set_full_to_swa_mapping", T([w.a[0]]), T([-3]))


@pytest.mark.parametrize("method", ["free", "free_full", "free_segment", "free_full_segment"])
def test_freeing_a_free_page(world, method):
    w = world
    kwargs = {"start_pos": 0} if method.endswith("segment") else {}
    expect(w, ValueError, method, T(range(w.free_token(), w.free_token() + w.ps)), **kwargs)


def test_freeing_a_request_twice(world):
    w = world
    w.both("free", T(w.a))
    for method in ["free", "free_full", "free_segment", "free_full_segment"]:
        kwargs = {"start_pos": 0} if method.endswith("segment") else {}
        expect(w, ValueError, method, T(w.a), **kwargs)


def test_freeing_twice_in_one_call(world):
    w = world
    ps = w.ps
    twice = w.b[ps:2 * ps] * 2
    expect(w, ValueError, "free_full_segment", T(twice), start_pos=0)
    expect(w, ValueError, "free_segment", T(twice), start_pos=0)
    expect(w, ValueError, "free_swa_segment", T(twice), start_pos=0)
    expect(w, ValueError, "free_page_ids", T([w.b[ps] // ps] * 2), target=lambda x: x.full_attn_allocator, ref=False)
    if ps == 1:
        expect(w, ValueError, "free", T([w.b[1], w.b[1]]))


@pytest.mark.parametrize("method", ["free_segment", "free_full_segment", "free_swa_segment"])
def test_freeing_a_page_twice_within_one_group(world, method):
    w = world
    ps = w.ps
    page = w.b[ps:2 * ps]
    w.both("free_group_begin")
    w.both(method, T(page), start_pos=ps)
    expect(w, ValueError, method, T(page), start_pos=ps)
    # and by token index after a page-id free of the same page
    if method != "free_swa_segment":
        expect(w, ValueError, "free_full", T(page))
    w.both("free_group_end")
    w.native.check_invariants()
    assert w.native.full_to_swa_index_mapping.tolist() == w.ref.full_to_swa_index_mapping


def test_token_pool_free_twice_within_one_group_raises():
    """At page size 1 nothing is deduplicated: a token freed twice in a group is a double free."""
    w = World(1, False)
    w.both("free_group_begin")
    w.both("free", T(w.a[:1]))
    expect(w, ValueError, "free", T(w.a[:1]))
    expect(w, ValueError, "free_full", T(w.a[:1]))
    w.both("free_group_end")


def test_paged_free_twice_within_one_group_is_one_free(paged):
    """SPEC section 3: a group's free(indices) calls are one sorted dedup over all of
    them, so naming a page again in the same group is not a double free."""
    w = paged
    w.both("free_group_begin")
    w.both("free", T(w.a))
    w.both("free", T(w.a[:1]))
    w.both("free_group_end")
    assert w.native.full_attn_allocator.free_pages.tolist() == w.ref.full_attn_allocator.free_pages
    assert w.native.swa_attn_allocator.free_pages.tolist() == w.ref.swa_attn_allocator.free_pages
    expect(w, ValueError, "free", T(w.a))  # after the group it is gone


def test_free_swa_segment_on_an_unmapped_representative(world):
    w = world
    ps = w.ps
    expect(w, ValueError, "free_swa_segment", T(w.b[:ps]), start_pos=0)  # evicted already
    expect(w, ValueError, "free_segment", T(w.b), start_pos=0)  # first page has no SWA slot
    expect(w, ValueError, "free_swa_segment", T(range(w.free_token(), w.free_token() + ps)), start_pos=0)


def test_evict_out_of_window_bad_rows(world):
    w = world
    ps = w.ps
    rtt = torch.zeros((2, 3 * ps), dtype=torch.int64)
    rtt[1] = T(w.b)
    expect(w, ValueError, "evict_out_of_window", rtt, T([1]), T([3 * ps]), T([1]) if ps > 1 else T([-1]), 1, ref=False)
    expect(w, ValueError, "evict_out_of_window", rtt, T([1]), T([3 * ps + 1]), T([0]), 1, ref=False)  # pre_len > row
    expect(w, ValueError, "evict_out_of_window", rtt, T([2]), T([0]), T([0]), 1, ref=False)  # row out of range
    expect(w, ValueError, "evict_out_of_window", rtt, T([1]), T([3 * ps]), T([ps]), 0, ref=False)  # window 0
    expect(w, ValueError, "evict_out_of_window", rtt, T([1]), T([3 * ps]), T([ps]), 1, 0, ref=False)  # interval 0
    # evicting from 0 reaches the page whose SWA slots are already gone
    expect(w, ValueError, "evict_out_of_window", rtt, T([1]), T([3 * ps]), T([0]), 1, ref=False)
    expect(w, TypeError, "evict_out_of_window", rtt.float(), T([1]), T([3 * ps]), T([ps]), 1, ref=False)
    expect(w, ValueError, "evict_out_of_window", rtt[1], T([1]), T([3 * ps]), T([ps]), 1, ref=False)  # 1-D


@pytest.mark.parametrize("method", ["free_segment", "free_swa_segment", "free_full_segment"])
def test_start_pos_not_page_aligned(paged, method):
    w = paged
    ps = w.ps
    for start in (1, ps - 1, ps + 1, -ps):
        expect(w, ValueError, method, T(w.b[ps:]), start_pos=start)
    expect(w, ValueError, "free_segment", T(w.b[2 * ps:]), start_pos=1, target=lambda x: x.full_attn_allocator,
           ref=False)


def test_nested_group_begin_and_end_without_group(world):
    w = world
    expect(w, ValueError, "free_group_end")
    w.both("free_group_begin")
    expect(w, ValueError, "free_group_begin")
    w.both("free_group_end")
    expect(w, ValueError, "free_group_end")
    # the same on a pool view
    expect(w, ValueError, "free_group_end", target=lambda x: x.swa_attn_allocator)
    w.native.full_attn_allocator.free_group_begin()
    w.ref.full_attn_allocator.free_group_begin()
    expect(w, ValueError, "free_group_begin", target=lambda x: x.full_attn_allocator)


def test_swa_tail_bad_batch_or_tail(world):
    w = world
    expect(w, ValueError, "alloc_extend_swa_tail", T([0, 0]), T([0, 0]), T([1, 1]), T([1, 1]), T([-1, -1]), 2, 1)
    expect(w, ValueError, "alloc_extend_swa_tail", T([]), T([]), T([]), T([]), T([]), 0, 0)
    expect(w, ValueError, "alloc_extend_swa_tail", T([0]), T([0]), T([3]), T([3]), T([-1]), 3, 4)
    expect(w, ValueError, "alloc_extend_swa_tail", T([0]), T([0]), T([3]), T([3]), T([-1]), 3, -1)


def test_paged_alloc_not_a_page_multiple(paged):
    w = paged
    for n in (1, w.ps - 1, w.ps + 1):
        expect(w, ValueError, "alloc", n, target=lambda x: x.full_attn_allocator)
        expect(w, ValueError, "alloc", n, target=lambda x: x.swa_attn_allocator)
        expect(w, ValueError, "alloc", n)


def test_hybrid_alloc_of_whole_pages_agrees_with_reference(paged):
    """alloc() of a page multiple works at page size > 1 too, as in SGLang."""
    w = paged
    got = w.native.alloc(2 * w.ps)
    want = w.ref.alloc(2 * w.ps)
    assert got is not None and got.tolist() == want
    assert w.native.translate_loc_from_full_to_swa(got).tolist() == w.ref.translate_loc_from_full_to_swa(want)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="page_size"):
        swa_ext.SWATokenToKVPoolAllocator(64, 32, 0, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="size"):
        swa_ext.SWATokenToKVPoolAllocator(64, 2, 4, torch.bfloat16, "cpu")
    with pytest.raises(TypeError, match="device"):
        swa_ext.SWATokenToKVPoolAllocator(64, 32, 4, torch.bfloat16, "meta")
    with pytest.raises(TypeError):
        swa_ext.PagedTokenToKVPoolAllocator(64, 4, torch.bfloat16, "meta")
    with pytest.raises(ValueError):
        swa_ext.TokenToKVPoolAllocator(-1, torch.bfloat16, "cpu")
    # Past 2**62 tokens the mapping's size (size + page_size + 1) would overflow int64.
    for size, size_swa, bad in ((2**63 - 1, 64, "size"), (64, 2**63 - 1, "size_swa"), (2**62 + 1, 64, "size")):
        with pytest.raises(ValueError, match=f"^{bad}: is above 4611686018427387904 tokens"):
            swa_ext.SWATokenToKVPoolAllocator(size, size_swa, 16, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="^size: is above"):
        swa_ext.PagedTokenToKVPoolAllocator(2**63 - 16, 16, torch.bfloat16, "cpu")
    # The shared mode's one list has size slots: a different size_swa is refused by name.
    with pytest.raises(ValueError, match="^size_swa: must equal size"):
        swa_ext.SWATokenToKVPoolAllocator(64, 32, 4, torch.bfloat16, "cpu", shared=True)


def test_bad_parent_page_arguments():
    """parent_k and small_side (SPEC.md section 8.1): refused by name, the sizes checked against them."""
    def build(size=64, size_swa=64 * 3, **kwargs):
        kwargs = {"shared": True, "parent_k": 3, **kwargs}
        return swa_ext.SWATokenToKVPoolAllocator(size, size_swa, 4, torch.bfloat16, "cpu", **kwargs)

    for bad in (0, -1, 65, 2**63 - 1):
        with pytest.raises(ValueError, match=r"^parent_k: must be in \[1, 64\]"):
            build(parent_k=bad)
    with pytest.raises(ValueError, match="^parent_k: above 1 needs the shared mode"):
        build(shared=False)
    for bad in (True, 3.0, "3", None):
        with pytest.raises(TypeError, match="^parent_k:"):
            build(parent_k=bad)
    with pytest.raises(ValueError, match="^small_side: must be 'full' or 'swa'"):
        build(small_side="both")
    with pytest.raises(TypeError, match="^small_side:"):
        build(small_side=None)
    with pytest.raises(ValueError, match=r"^size_swa: must be parent_k \(3\) times size \(64\)"):
        build(size_swa=64 * 2)
    with pytest.raises(ValueError, match=r"^size: must be parent_k \(3\) times size_swa \(64\)"):
        build(size=64, size_swa=64, small_side="full")
    with pytest.raises(ValueError, match="^parent_k: above 1 is served by the CPU store only"):
        build(kernels="emulated")
    assert build(size=64 * 3, size_swa=64, small_side="full").parent_k == 3


def test_parent_k_of_entry_sizes():
    pk = swa_ext._C.parent_k
    # Llama-4-Scout (144 vs 48 KiB a token), MiMo-V2-Flash (200 vs 20), equal entries, a padded one.
    assert (pk(144, 48), pk(200, 20), pk(48, 48), pk(49, 48)) == (3, 10, 1, 2)
    assert pk(2**63 - 1, 2) == 2**62 and pk(2**63 - 1, 1) == 2**63 - 1  # no overflow on the way
    with pytest.raises(ValueError, match="^smaller_entry_bytes: must be >= 1"):
        pk(48, 0)
    with pytest.raises(ValueError, match="^larger_entry_bytes: must be at least smaller_entry_bytes"):
        pk(47, 48)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("device,kernels", [("cpu", "emulated"), ("cuda", "cuda")])
def test_shared_mode_on_a_device_store_matches_the_cpu_store(device, kernels, page_size, monkeypatch):
    # The device store serves the shared mode (SPEC.md section 8): the same slots, sizes,
    # mapping and refusals as the CPU store, and a full free of an SWA page refused by name
    # (at once in debug mode; else in the next call, tests/test_misuse.py).
    if device == "cuda" and cuda_skip_reason():
        pytest.skip(cuda_skip_reason())
    monkeypatch.setenv("SWA_EXT_DEBUG", "1")
    ps = page_size
    stores = [swa_ext.SWATokenToKVPoolAllocator(16 * ps, 16 * ps, ps, torch.bfloat16, dev, kernels=k, shared=True)
              for dev, k in (("cpu", "cpu"), (device, kernels))]
    seen = []
    for a in stores:
        on = a.full_to_swa_index_mapping.device
        tail = a.alloc_extend_swa_tail(T([0]).to(on), T([0]).to(on), T([6 * ps]).to(on), T([6 * ps]).to(on),
                                       T([-1]).to(on), 6 * ps, 2 * ps)
        swa = a.translate_loc_from_full_to_swa(tail)
        first = a.alloc(5 * ps)  # 5 full and 5 SWA pages: more than the 8 pages left
        second = a.alloc(3 * ps)
        a.free_swa(tail[-ps:])
        with pytest.raises(ValueError, match="^indices: page .* holds SWA KV, not full KV"):
            a.free(swa[-ps - 1:-ps])  # the tail's first SWA page, still held
        steps = (tail, swa, second, a.full_to_swa_index_mapping)
        seen.append(([t.tolist() for t in steps], first, a.available_size(), a.full_available_size(),
                     a.swa_available_size(), a.new_pages_available(1, 1)))
        a.check_invariants()
    assert seen[0] == seen[1]
    assert seen[0][1] is None and seen[0][2] == 3 * ps


@pytest.mark.parametrize("kernels", ["cpu", "emulated"])
def test_a_side_of_the_shared_mode_is_not_cleared_resized_or_restored_alone(kernels):
    # One free list serves both sides: a side's clear() would free the other side's pages.
    # Each of the three is refused by name, the allocator left as it was; the hybrid
    # allocator's own calls serve both sides.
    ps = 4
    a = swa_ext.SWATokenToKVPoolAllocator(16 * ps, 16 * ps, ps, torch.bfloat16, "cpu", kernels=kernels, shared=True)
    tail = a.alloc_extend_swa_tail(T([0]), T([0]), T([6 * ps]), T([6 * ps]), T([-1]), 6 * ps, 2 * ps)

    def seen():
        return (a.available_size(), a.full_used_size(), a.swa_used_size(), a.full_to_swa_index_mapping.tolist())

    before = seen()
    assert before[:3] == (8 * ps, 6 * ps, 2 * ps)
    for side in (a.full_attn_allocator, a.swa_attn_allocator):
        for name, args in (("clear", ()), ("resize", (8 * ps,)), ("restore_state", (side.backup_state(),))):
            with pytest.raises(ValueError, match=f"^{name}: a side of the shared mode has no pool of its own"):
                getattr(side, name)(*args)
    assert seen() == before
    a.check_invariants()
    a.free(tail)
    a.clear()
    assert seen()[:3] == (16 * ps, 0, 0)


def test_restore_state_from_another_shape(world):
    w = world
    other = swa_ext.SWATokenToKVPoolAllocator(SIZE * 2, SIZE_SWA, w.ps, torch.bfloat16, "cpu")
    expect(w, ValueError, "restore_state", other.backup_state(), ref=False)
    # A state of the other mode, of the same sizes: the shared mode's one list is not two.
    other_mode = swa_ext.SWATokenToKVPoolAllocator(SIZE, SIZE, w.ps, torch.bfloat16, "cpu", shared=not w.native.shared)
    if w.native.size_swa == SIZE:
        expect(w, ValueError, "restore_state", other_mode.backup_state(), ref=False)
    expect(w, TypeError, "restore_state", object(), ref=False)
    expect(w, TypeError, "restore_state", w.native.full_attn_allocator.backup_state(), ref=False)


# ------------------------------------------------------------------ hostile values

_EXTREMES = (0, 1, -1, 2, 3, 4, 15, 16, 17, 63, 64, 65, 128, 255, 256, 1000, 2**31, -2**31, 2**32,
             2**62, 2**62 + 1, 2**63 - 1, -2**63)


def _hostile_calls(rng, alloc, dev):
    """Seeded calls of the allocator's methods mixing the traffic that builds state (fresh
    requests) with values from _EXTREMES in every integer argument, as int64 or int32
    tensors (on dev where the allocator takes device tensors): (name, call)."""
    def value():
        return rng.choice(_EXTREMES)

    def wrapped(x):
        return (x + 2**63) % 2**64 - 2**63

    def ints(n=None):
        n = rng.choice([0, 1, 2, 3]) if n is None else n
        if rng.random() < 0.3:
            return torch.tensor([max(min(value(), 2**31 - 1), -2**31) for _ in range(n)], dtype=torch.int32)
        return torch.tensor([value() for _ in range(n)], dtype=torch.int64)

    def fresh_requests(n):  # so that the frees find pages
        s = [rng.choice([1, 2, 5, 16, 33]) for _ in range(n)]
        zeros = torch.zeros(n, dtype=torch.int64)
        return lambda: alloc.alloc_extend(zeros.to(dev), zeros, T(s).to(dev), T(s), T([-1] * n).to(dev), sum(s))

    def hostile_extend(n):
        fresh = rng.random() < 0.5  # no prefix: only the lengths are hostile
        p = torch.zeros(n, dtype=torch.int64) if fresh else ints(n)
        s, last = ints(n), T([-1] * n) if fresh else ints(n)
        # Half the time extend_num_tokens is the lengths' sum as int64 arithmetic wraps it.
        total = wrapped(sum(s.tolist()) - sum(p.tolist())) if rng.random() < 0.5 else value()
        return lambda: alloc.alloc_extend(p.to(dev), p, s.to(dev), s, last.to(dev), total)

    def decode_step(n):
        s, last = ints(n), ints(n)
        return lambda: alloc.alloc_decode(s.to(dev), s, last.to(dev))

    def swa_tail(n):
        p, s, last, total, tail = ints(1), ints(1), ints(1), value(), value()
        return lambda: alloc.alloc_extend_swa_tail(p.to(dev), p, s.to(dev), s, last.to(dev), total, tail)

    def evict(n):
        table = torch.randint(-3, 300, (rng.choice([1, 2, 4]), rng.choice([1, 8, 64])),
                              dtype=rng.choice([torch.int32, torch.int64])).to(dev)
        rows, pre, evicted, window = ints(n), ints(n), ints(n), value()
        interval, sharing = rng.choice([1, 2, 2**63 - 1]), rng.random() < 0.5
        return lambda: decode.evict_out_of_window(alloc, table, rows, pre, evicted, window, interval=interval,
                                                  prefix_sharing=sharing)

    def dev_ints():
        return ints().to(dev)

    def method(name, *make_args, **make_kwargs):
        def make(n):
            args = [a() for a in make_args]
            kwargs = {k: a() for k, a in make_kwargs.items()}
            return lambda: getattr(alloc, name)(*args, **kwargs)
        return name, make

    calls = [("alloc_extend", fresh_requests)] * 3 + [
        ("alloc_extend", hostile_extend), ("alloc_decode", decode_step), ("alloc_extend_swa_tail", swa_tail),
        ("evict_out_of_window", evict), method("alloc", value), method("free", dev_ints),
        method("free_swa", dev_ints), method("free_segment", dev_ints, start_pos=value),
        method("free_swa_segment", dev_ints, start_pos=value), method("free_full_segment", dev_ints, start_pos=value),
        method("free_page_ids", dev_ints), method("translate_loc_from_full_to_swa", dev_ints),
        method("free_group_begin"), method("free_group_end"),
        method("merge_and_sort_free"),
        method("reservation_fits", value, value, full_evictable_tokens=value, swa_evictable_tokens=value,
               empty_pool=lambda: rng.random() < 0.5, require_token_slack=lambda: rng.random() < 0.5)]
    hybrid = hasattr(alloc, "translate_loc_from_full_to_swa")
    calls.append(method("resize", value, value) if hybrid else method("resize", value))  # (size, size_swa)
    calls = [(name, make) for name, make in calls if hasattr(alloc, name)]
    while True:
        name, make = rng.choice(calls)
        yield name, make(rng.choice([1, 2, 3]))


def _allocator(kind, page_size, kernels, dev):
    if kind == "hybrid":
        return swa_ext.SWATokenToKVPoolAllocator(256, 128, page_size, torch.bfloat16, dev, kernels=kernels)
    if kind == "shared":
        return swa_ext.SWATokenToKVPoolAllocator(256, 256, page_size, torch.bfloat16, dev, kernels=kernels, shared=True)
    if kind == "parents":  # parent pages, the full side small (every served model's)
        return swa_ext.SWATokenToKVPoolAllocator(3 * 256, 256, page_size, torch.bfloat16, dev, kernels=kernels,
                                                 shared=True, parent_k=3, small_side="full")
    if page_size == 1:
        return swa_ext.TokenToKVPoolAllocator(256, torch.bfloat16, dev, kernels=kernels)
    return swa_ext.PagedTokenToKVPoolAllocator(256, page_size, torch.bfloat16, dev, kernels=kernels)


KINDS_AND_KERNELS = [(kind, kernels) for kernels in ("cpu", "emulated", "cuda") for kind in ("hybrid", "shared", "pool")]
KINDS_AND_KERNELS += [("parents", "cpu")]  # parent_k > 1: the CPU store


@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
@pytest.mark.parametrize("kind,kernels", KINDS_AND_KERNELS)
def test_hostile_values_are_refused_by_name_and_change_nothing(kind, page_size, kernels, monkeypatch):
    # Every call either works or raises ValueError/TypeError, leaving the state exactly
    # as it was, and the invariants hold after each. Before the lengths were bounded, a
    # sum of lengths that wrapped passed the extend_num_tokens check here and sized the
    # output from it: a torch RuntimeError, or a write past the output (a segfault,
    # test_lengths_whose_sums_overflow_int64).
    if kernels == "cuda" and cuda_skip_reason():
        pytest.skip(cuda_skip_reason())
    dev = "cuda" if kernels == "cuda" else "cpu"
    monkeypatch.setenv("SWA_EXT_DEBUG", "1")  # a device store checks before it changes anything
    alloc = _allocator(kind, page_size, kernels, dev)
    rng = random.Random(f"{kind}/{page_size}/{kernels}")
    calls = _hostile_calls(rng, alloc, dev)
    worked, refused = collections.Counter(), collections.Counter()
    for _ in range(800):
        name, call = next(calls)
        before = alloc.backup_state()
        try:
            call()
            worked[name] += 1
        except (ValueError, TypeError) as e:
            refused[name] += 1
            assert alloc.backup_state() == before, f"{name} raised {e!r} but changed the state"
        alloc.check_invariants()
    assert sum(worked.values()) > 100 and sum(refused.values()) > 100, (worked, refused)


@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
@pytest.mark.parametrize("kernels", ["emulated", "cuda"])
@pytest.mark.parametrize("kind", ["hybrid", "shared", "pool"])
def test_hostile_values_on_a_device_store_checking_in_its_ops(kind, page_size, kernels, monkeypatch):
    # Without SWA_EXT_DEBUG a device store finds a bad index value in its ops (the CUDA
    # kernels' own code, emulated here) and raises DeferredError at the next call. Those
    # ops must stay inside their arrays whatever the values (the sanitizer run checks the
    # emulated ones), and restore_state must bring back the last good state.
    if kernels == "cuda" and cuda_skip_reason():
        pytest.skip(cuda_skip_reason())
    dev = "cuda" if kernels == "cuda" else "cpu"
    monkeypatch.delenv("SWA_EXT_DEBUG", raising=False)
    alloc = _allocator(kind, page_size, kernels, dev)
    calls = _hostile_calls(random.Random(f"deferred/{kind}/{page_size}/{kernels}"), alloc, dev)
    good = alloc.backup_state()
    outcomes = collections.Counter()
    for _ in range(800):
        name, call = next(calls)
        try:
            call()
            alloc.check_invariants()  # waits for the ops, and raises what they found
            good = alloc.backup_state()
            outcomes["worked"] += 1
        except (ValueError, TypeError):  # found on the host, before anything changed
            assert alloc.backup_state() == good
            outcomes["refused"] += 1
        except swa_ext.DeferredError:
            alloc.restore_state(good)
            assert alloc.backup_state() == good
            alloc.check_invariants()
            outcomes["deferred"] += 1
    assert min(outcomes["worked"], outcomes["refused"], outcomes["deferred"]) > 20, outcomes
