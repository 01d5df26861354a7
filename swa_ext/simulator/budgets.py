"""The two nodes with one budget for full and SWA KV, no ratio to choose
(docs/simulator.md: "One budget"): SGLang 0.5.23's ``--enable-unified-memory`` byte
arena, priced as its code prices it, and swa_ext's shared mode on the real allocator."""

from __future__ import annotations

from .node import DecodeNode
from .scenario import ARENA, SHARED, _cdiv, arena_geometry

FULL, SWA = 0, 1


class Arena:
    """The page accounting of SGLang 0.5.23's ``UnifiedSWATokenToKVPoolAllocator`` with
    lazy compaction (its default): one byte band shared by the full side (from the top)
    and the SWA side (from the bottom). Each side spans ``extent`` pages from its end, of
    which ``holes`` were freed and not yet compacted: a side reuses its own holes first,
    and only compaction (``_flush``: survivors moved into the holes) returns them to the
    shared gap. ``fits`` is ``_fits_page_demand``; ``ensure`` is ``ensure_capacity``."""

    def __init__(self, gap_bytes: int, full_page_bytes: int, swa_page_bytes: int, full_pages: int, swa_pages: int):
        self.empty_gap = gap_bytes
        self.page_bytes = (full_page_bytes, swa_page_bytes)
        self.capacity = (full_pages, swa_pages)  # pages each side can address (index and virtual ids)
        self.extent = [0, 0]
        self.holes = [0, 0]
        self.compactions = 0

    def live(self, side: int) -> int:
        return self.extent[side] - self.holes[side]

    def gap(self) -> int:
        return self.empty_gap - sum(e * b for e, b in zip(self.extent, self.page_bytes))

    def fits(self, full_pages: int, swa_pages: int, *, compacted: bool) -> bool:
        """Whether ``full_pages`` and ``swa_pages`` more fit: each side's new pages take its
        holes first, the rest extend it into the gap, whose bytes must hold them all. With
        ``compacted`` priced as after compaction (no holes, every live page packed)."""
        need = (full_pages, swa_pages)
        if min(need) < 0:
            return False
        extensions = 0
        for side in (FULL, SWA):
            live = self.live(side)
            if live + need[side] > self.capacity[side]:
                return False
            holes = 0 if compacted else self.holes[side]
            extent = live if compacted else self.extent[side]
            if need[side] > holes + self.capacity[side] - extent:
                return False
            extensions += max(0, need[side] - holes) * self.page_bytes[side]
        gap = self.empty_gap - sum(self.live(s) * self.page_bytes[s] for s in (FULL, SWA)) if compacted else self.gap()
        return extensions <= max(0, gap)

    def ensure(self, full_pages: int, swa_pages: int, *, moves_allowed: bool) -> bool:
        """Whether an allocation of these pages goes ahead: as it stands, or after a
        compaction, which runs only when ``moves_allowed`` (no transfer in flight)."""
        if full_pages == swa_pages == 0 or self.fits(full_pages, swa_pages, compacted=False):
            return True
        if not moves_allowed or not self.fits(full_pages, swa_pages, compacted=True):
            return False
        self.compact()
        return True

    def compact(self) -> None:
        for side in (FULL, SWA):
            self.extent[side] = self.live(side)
            self.holes[side] = 0
        self.compactions += 1

    def take(self, full_pages: int, swa_pages: int) -> None:
        """Allocate pages that ``fits``: from each side's holes first, then its extent."""
        for side, n in ((FULL, full_pages), (SWA, swa_pages)):
            from_holes = min(n, self.holes[side])
            self.holes[side] -= from_holes
            self.extent[side] += n - from_holes
        if self.gap() < 0:
            raise AssertionError(f"arena overdrawn by {-self.gap()} bytes")

    def free(self, full_pages: int, swa_pages: int) -> None:
        """Freed pages become holes of their side (lazy compaction)."""
        self.holes[FULL] += full_pages
        self.holes[SWA] += swa_pages


class UnifiedDecodeNode(DecodeNode):
    """SGLang 0.5.23's decode node with ``--enable-unified-memory``. swa_ext's allocator,
    with a pool per side as large as that side's reach, hands out the slots; the ``Arena``
    decides what fits, as SGLang's ``ensure_capacity`` gates every allocation. Compaction
    is blocked while a transfer is in flight (``unified_memory_disagg_move_gate``): here,
    from a step's first preallocation (its destinations published) to the end of the
    step, decode included; the simulator's transfers take no longer than the step."""

    def _make_allocator(self, allocator_factory):
        g = arena_geometry(self.scenario)
        self.arena = Arena(g.gap_bytes, g.full_page_bytes, g.swa_page_bytes, g.full_pages, g.swa_pages)
        self.in_flight = 0
        return super()._make_allocator(allocator_factory)

    def _free_pages(self) -> tuple[int, int]:
        ps, alloc = self.page_size, self.allocator
        return alloc.full_available_size() // ps, alloc.swa_available_size() // ps

    def _moves_allowed(self) -> bool:
        return self.in_flight == 0

    def _fits(self, full_tokens: int, swa_tokens: int) -> bool:
        """SGLang's ``prealloc_fits``: the demand in whole pages against the arena, as
        after compaction when moves are allowed (``can_reserve``)."""
        ps = self.page_size
        return self.arena.fits(_cdiv(full_tokens, ps), _cdiv(swa_tokens, ps), compacted=self._moves_allowed())

    def _allocated(self, before: tuple[int, int], full_pages: int, swa_pages: int) -> None:
        after = self._free_pages()
        taken = (before[FULL] - after[FULL], before[SWA] - after[SWA])
        if taken != (full_pages, swa_pages):
            raise AssertionError(f"the allocator took {taken} pages, SGLang's pricing {(full_pages, swa_pages)}")
        self.arena.take(full_pages, swa_pages)

    def _freed(self, before: tuple[int, int]) -> None:
        after = self._free_pages()
        self.arena.free(after[FULL] - before[FULL], after[SWA] - before[SWA])

    def admit(self, step: int) -> None:
        self.in_flight = 0  # the previous step's transfers have landed
        super().admit(step)

    def _pre_alloc(self, row, fill):
        ps = self.page_size
        tail = self._swa_fill(fill)
        full_pages = _cdiv(fill, ps)
        swa_pages = full_pages - (fill - tail) // ps if tail else 0
        if not self.arena.ensure(full_pages, swa_pages, moves_allowed=self._moves_allowed()):
            return None
        before = self._free_pages()
        placed = super()._pre_alloc(row, fill)
        if placed is not None:
            self._allocated(before, full_pages, swa_pages)
            self.in_flight += 1
        return placed

    def _alloc_decode(self, new_lens, last_loc):
        new_pages = int(((new_lens - 1) % self.page_size == 0).sum())
        if not self.arena.ensure(new_pages, new_pages, moves_allowed=self._moves_allowed()):
            return None
        before = self._free_pages()
        out = super()._alloc_decode(new_lens, last_loc)
        if out is not None:
            self._allocated(before, new_pages, new_pages)
        return out

    def _release(self, k: int) -> int:
        before = self._free_pages()
        seq_len = super()._release(k)
        self._freed(before)
        return seq_len

    def evict(self) -> None:
        before = self._free_pages()
        super().evict()
        self._freed(before)

    def _pages_in_use(self) -> tuple[int, int]:
        return self.arena.live(FULL), self.arena.live(SWA)


class SharedDecodeNode(DecodeNode):
    """swa_ext's shared mode: one free list of parent pages for full and SWA pages
    (``shared=True``, ``parent_k`` pages of the small side or one of the other to a
    parent), so the allocator itself decides the padding and the stranding in partly used
    parents. The allocator prices the decode node's demand (``reservation_fits``: the
    parents both sides bind against the one free count), as ``swa_ext/sglang/shared.py`` does."""

    def _make_allocator(self, allocator_factory):
        c = self.config
        return allocator_factory(c.size_full, c.size_swa, self.page_size, shared=True, parent_k=c.parent_k,
                                 small_side=c.small_side)

    def _fits(self, full_tokens: int, swa_tokens: int) -> bool:
        return self.allocator.reservation_fits(full_tokens, swa_tokens)


def node_class(budget: str) -> type[DecodeNode]:
    """The node of a column whose memory is cut as ``budget`` (``PolicyConfig.budget``)."""
    return {ARENA: UnifiedDecodeNode, SHARED: SharedDecodeNode}.get(budget, DecodeNode)
