"""reservation_fits, the one native call that prices a demand of full and SWA tokens
(SPEC.md section 8), against a brute-force reference: what allocating it would do.

The reference copies the allocator (restore_state), frees the pages the radix tree could
give back (the cached pages of each side; the tree reports them in tokens, with a partial
page of junk that frees nothing), then takes pages through each side's pool view one
page at a time until the tokens are covered: the demand fits exactly when every page
comes. The empty pool is a fresh allocator of the same shape; SGLang's token slack is a
token of the pool to spare (the one list's in the shared mode, each pool's otherwise).
Both modes, page sizes 1 and 16, pool sizes of whole pages and not, both host-side
stores (the CPU store and the device algorithm emulated on the CPU), demands around the
exact fit.
"""
from __future__ import annotations

import random

import pytest
import torch

import swa_ext

FULL_PAGES, SWA_PAGES = 12, 9


def allocator(shared, ps, extra_slots, kernels):
    size = FULL_PAGES * ps + extra_slots
    size_swa = size if shared else SWA_PAGES * ps + extra_slots
    return swa_ext.SWATokenToKVPoolAllocator(size, size_swa, ps, torch.bfloat16, "cpu", kernels=kernels,
                                             shared=shared)


def copy_of(alloc):
    other = allocator(alloc.shared, alloc.page_size, alloc.size_full % alloc.page_size, alloc.kernels)
    other.restore_state(alloc.backup_state())
    return other


def views(alloc):
    return alloc.full_attn_allocator, alloc.swa_attn_allocator


def pages_taken(view, page_size, tokens):
    """Takes pages from a pool view, one at a time, until they cover `tokens`: whether all came."""
    covered = 0
    while covered < tokens:
        if view.alloc(page_size) is None:
            return False
        covered += page_size
    return True


def allocates(alloc, full_tokens, swa_tokens):
    full_view, swa_view = views(alloc)
    ps = alloc.page_size
    return pages_taken(full_view, ps, full_tokens) and pages_taken(swa_view, ps, swa_tokens)


def pages_left(alloc, side):
    """How many pages a side's view still hands out, counted by taking them (on a copy)."""
    view, n = views(copy_of(alloc))[side], 0
    while view.alloc(alloc.page_size) is not None:
        n += 1
    return n


class World:
    """An allocator whose sides hold pages, some of them cached by the radix tree."""

    def __init__(self, rng, shared, ps, extra_slots, kernels):
        self.alloc = allocator(shared, ps, extra_slots, kernels)
        held = ([], [])
        for _ in range(rng.randint(0, 14)):
            side = rng.randrange(2)
            got = views(self.alloc)[side].alloc(ps)
            if got is not None:
                held[side].append(got)
        for side in (0, 1):  # some frees, so that the free list is not in page order
            for k in sorted(rng.sample(range(len(held[side])), len(held[side]) // 2), reverse=True):
                views(self.alloc)[side].free(held[side].pop(k))
        self.cached = tuple(rng.sample(pages, rng.randint(0, len(pages))) for pages in held)
        # The tree reports tokens: its cached pages and a partial page, which frees no page.
        self.evictable = tuple(len(pages) * ps + rng.randrange(ps) for pages in self.cached)

    def fits_after_eviction(self, full_tokens, swa_tokens):
        other = copy_of(self.alloc)
        for view, pages in zip(views(other), self.cached):
            for slots in pages:
                view.free(slots)
        return allocates(other, full_tokens, swa_tokens)

    def fits_empty(self, full_tokens, swa_tokens, slack):
        a = self.alloc
        if slack and (full_tokens + swa_tokens >= a.size if a.shared
                      else full_tokens >= a.size_full or swa_tokens >= a.size_swa):
            return False
        return allocates(allocator(a.shared, a.page_size, a.size_full % a.page_size, a.kernels), full_tokens,
                         swa_tokens)

    def demands(self, rng, empty_pool):
        """Pairs of token counts around where the demand stops fitting, and some at random."""
        a, ps = self.alloc, self.alloc.page_size
        if empty_pool:
            room = (a.size_full // ps, a.size_swa // ps)
        else:
            after = copy_of(a)
            for view, pages in zip(views(after), self.cached):
                for slots in pages:
                    view.free(slots)
            room = (pages_left(after, 0), pages_left(after, 1))
        near = []
        if a.shared:  # the one list's pages split between the sides
            for full_pages in range(room[0] + 1):
                near.append((full_pages * ps, (room[0] - full_pages) * ps))
        else:
            near.append((room[0] * ps, room[1] * ps))
        edges = []
        for full, swa in near:  # exactly, a token over on either side, a token short
            edges += [(full, swa), (full + 1, swa), (full, swa + 1), (max(full - 1, 0), swa),
                      (full, max(swa - 1, 0)), (max(full - ps, 0), swa + ps)]
            if empty_pool:  # the slack bites at the whole pool's slots
                edges += [(a.size - swa, swa), (a.size - swa - 1, swa)] if a.shared and a.size >= swa + 1 else []
        top = (FULL_PAGES + 2) * ps
        edges += [(rng.randrange(top), rng.randrange(top)) for _ in range(8)]
        return edges


@pytest.mark.parametrize("kernels", ["cpu", "emulated"])
@pytest.mark.parametrize("ps, extra_slots", [(1, 0), (16, 0), (16, 3)],
                         ids=["ps1", "ps16-whole-pages", "ps16-three-more-slots"])  # (at page size 1 all are whole)
@pytest.mark.parametrize("shared", [False, True], ids=["two-pools", "shared"])
def test_reservation_fits_as_allocating_it_would(shared, ps, extra_slots, kernels):
    rng = random.Random(f"{shared}/{ps}/{extra_slots}/{kernels}")
    outcomes = {True: 0, False: 0}
    for _ in range(6):
        w = World(rng, shared, ps, extra_slots, kernels)
        before = w.alloc.backup_state()
        for empty_pool in (False, True):
            for slack in (False, True) if empty_pool else (False,):
                for full, swa in w.demands(rng, empty_pool):
                    got = w.alloc.reservation_fits(full, swa, full_evictable_tokens=w.evictable[0],
                                                   swa_evictable_tokens=w.evictable[1], empty_pool=empty_pool,
                                                   require_token_slack=slack)
                    want = w.fits_empty(full, swa, slack) if empty_pool else w.fits_after_eviction(full, swa)
                    assert got == want, (full, swa, w.evictable, empty_pool, slack)
                    outcomes[got] += 1
        assert w.alloc.backup_state() == before  # it only reads
    assert min(outcomes.values()) > 20, outcomes
