"""Capacity edges: zero-new-page extends, exactly at capacity, one page over, and a
short full or SWA pool, for alloc_extend / alloc_extend_swa_tail / alloc_decode.

Every call is made on the native allocator and on the reference; they must agree,
and a refusal (None) must leave the native ``backup_state()`` unchanged.
"""

from __future__ import annotations

import pytest
import torch

import swa_ext
from reference import SWAAllocatorRef


def T(values):
    return torch.tensor(list(values), dtype=torch.int64)


class Pair:
    def __init__(self, full_pages, swa_pages, ps, need_sort=False):
        self.ps = ps
        self.native = swa_ext.SWATokenToKVPoolAllocator(full_pages * ps, swa_pages * ps, ps, torch.bfloat16, "cpu",
                                                        need_sort=need_sort)
        self.ref = SWAAllocatorRef(full_pages * ps, swa_pages * ps, ps, need_sort)

    def call(self, name, *args):
        before = self.native.backup_state()
        out = getattr(self.native, name)(*args)
        out_ref = getattr(self.ref, name)(*args)
        if name.startswith("free"):
            assert out is None and out_ref is None
        elif out is None:
            assert out_ref is None, f"{name}: native refused, reference gave {out_ref}"
            assert self.native.backup_state() == before, f"{name} refused but changed the state"
        else:
            assert out.tolist() == out_ref
        self.native.check_invariants()
        assert self.native.full_available_size() == self.ref.full_available_size()
        assert self.native.swa_available_size() == self.ref.swa_available_size()
        assert self.native.full_to_swa_index_mapping.tolist() == self.ref.full_to_swa_index_mapping
        return out

    def extend(self, pre, seq, last):
        return self.call("alloc_extend", T(pre), T(pre), T(seq), T(seq), T(last), sum(seq) - sum(pre))

    def tail(self, pre, seq, last, tail):
        return self.call("alloc_extend_swa_tail", T([pre]), T([pre]), T([seq]), T([seq]), T([last]), seq - pre, tail)

    def decode(self, seq, last):
        return self.call("alloc_decode", T(seq), T(seq), T(last))

    def pages_free(self):
        return self.native.full_available_size() // self.ps, self.native.swa_available_size() // self.ps


@pytest.mark.parametrize("ps", [16, 32, 64, 128])
@pytest.mark.parametrize("need_sort", [False, True])
def test_extend_inside_partial_pages_needs_no_new_page(ps, need_sort):
    """Requests with partial last pages grow inside them with the pools empty."""
    p = Pair(full_pages=4, swa_pages=4, ps=ps, need_sort=need_sort)
    lens = [5, ps + 3, 1]
    rows = p.extend([0, 0, 0], lens, [-1, -1, -1])  # 1 + 2 + 1 = 4 pages: both pools now empty
    assert rows is not None and p.pages_free() == (0, 0)
    starts = [0, lens[0], lens[0] + lens[1]]
    last = [int(rows[s + n - 1]) for s, n in zip(starts, lens)]
    grown = [ps, 2 * ps, ps - 1]  # each stays inside its last page
    out = p.extend(lens, grown, last)
    assert out is not None, "an extend needing zero new pages was refused"
    assert len(out) == sum(g - n for g, n in zip(grown, lens))
    assert p.pages_free() == (0, 0)
    # ... and so does a decode that does not start a page, while one that does is refused
    # the third row (ps - 1 tokens) decodes into the last slot of its page: no new page
    d = p.decode([ps], [int(out[-1])])
    assert d is not None and int(d) == int(out[-1]) + 1
    # now every row is page-full: one more token needs a page and is refused
    before = p.native.backup_state()
    assert p.decode([ps + 1], [int(d)]) is None
    assert p.native.backup_state() == before


@pytest.mark.parametrize("ps", [2, 16])
def test_exactly_at_capacity_then_one_page_over(ps):
    p = Pair(full_pages=6, swa_pages=6, ps=ps)
    # one page over: 7 pages for a batch of two
    assert p.extend([0, 0], [3 * ps, 4 * ps], [-1, -1]) is None
    assert p.extend([0, 0], [3 * ps + 1, 3 * ps - 1], [-1, -1]) is None  # 4 + 3 pages
    # exactly at capacity: 6 pages
    out = p.extend([0, 0], [3 * ps, 2 * ps + 1], [-1, -1])
    assert out is not None and p.pages_free() == (0, 0)
    p.native.free(out)
    p.ref.free(out.tolist())
    assert p.pages_free() == (6, 6)
    # the same with the SWA tail preallocation: tail uses 2 of 6 SWA pages
    assert p.tail(0, 7 * ps, -1, 2 * ps) is None  # full one page over
    out = p.tail(0, 6 * ps, -1, 2 * ps)
    assert out is not None and p.pages_free() == (0, 4)


@pytest.mark.parametrize("ps", [4, 16])
@pytest.mark.parametrize("need_sort", [False, True])
def test_short_full_pool_refuses_and_touches_nothing(ps, need_sort):
    p = Pair(full_pages=3, swa_pages=10, ps=ps, need_sort=need_sort)
    held = p.extend([0], [ps + 1], [-1])  # 2 pages of each pool
    assert p.pages_free() == (1, 8)
    before = p.native.backup_state()
    assert p.extend([0], [2 * ps], [-1]) is None
    assert p.tail(0, 2 * ps, -1, ps) is None
    assert p.native.backup_state() == before
    # decode: two requests each needing a page, one page left
    q = Pair(full_pages=3, swa_pages=10, ps=ps, need_sort=need_sort)
    rows = q.extend([0, 0], [ps, ps], [-1, -1])
    assert q.pages_free() == (1, 8)
    before = q.native.backup_state()
    assert q.decode([ps + 1, ps + 1], [int(rows[ps - 1]), int(rows[-1])]) is None
    assert q.native.backup_state() == before
    assert q.decode([ps + 1], [int(rows[ps - 1])]) is not None


@pytest.mark.parametrize("ps", [4, 16])
@pytest.mark.parametrize("need_sort", [False, True])
def test_short_swa_pool_refuses_and_touches_nothing(ps, need_sort):
    p = Pair(full_pages=10, swa_pages=3, ps=ps, need_sort=need_sort)
    rows = p.extend([0, 0], [ps, ps], [-1, -1])
    assert p.pages_free() == (8, 1)
    before = p.native.backup_state()
    assert p.extend([0], [2 * ps], [-1]) is None
    assert p.tail(0, 4 * ps, -1, 2 * ps) is None  # full fits, the SWA tail does not
    # SGLang consumes full pages before finding the SWA pool short; swa_ext does not.
    assert p.decode([ps + 1, ps + 1], [int(rows[ps - 1]), int(rows[-1])]) is None
    assert p.native.backup_state() == before
    # with the tail inside the one free SWA page it fits
    assert p.tail(0, 4 * ps, -1, ps) is not None
    assert p.pages_free() == (4, 0)


@pytest.mark.parametrize("need_sort", [False, True])
def test_refusal_after_frees_counts_staged_pages(need_sort):
    """Pages freed (staged with need_sort) count towards capacity: the extend merges first."""
    ps = 4
    p = Pair(full_pages=4, swa_pages=4, ps=ps, need_sort=need_sort)
    out = p.extend([0], [4 * ps], [-1])
    p.call("free", out[: 2 * ps])
    assert p.pages_free() == (2, 2)
    assert p.extend([0], [2 * ps + 1], [-1]) is None
    assert p.extend([0], [2 * ps], [-1]) is not None
    assert p.pages_free() == (0, 0)

