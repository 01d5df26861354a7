"""Plain-Python reference of the swa_ext allocator contract (SPEC.md sections 1-5, 8).

Lists and ints only, written to be read: this file is the executable form of
SPEC.md. It is slow on purpose and is the oracle the native allocator is tested
against (golden traces, property tests). It lives with the tests: neither the
shipped package nor the benchmarks import it, and its window rules
(``swa_tail_len``, ``evicted_after_step``) are the one independent restatement
of csrc/core/rules.h's.

Every public method first checks its arguments and the state they touch and
raises ValueError before changing anything; only then does it run the
semantics, which follow SPEC.md line by line. Refusals for lack of space are
not errors: they return None and change nothing (except that a pool may merge
its staged pages into its free list first, as SPEC says).

Each pool tracks the state of every page so that a double free is an error
rather than a corrupt free list:
  free    - in ``free_pages``
  staged  - in ``release_pages`` (need_sort only), free but not yet merged
  held    - handed out
  queued  - freed inside a free group (by token index or by page id); released
            when the group ends
"""

from __future__ import annotations

import copy
import operator

__all__ = [
    "TokenPoolRef",
    "PagePoolRef",
    "SWAAllocatorRef",
    "swa_tail_len",
    "evicted_after_step",
    "cdiv",
]

FREE = "free"
STAGED = "staged"
HELD = "held"
QUEUED_TOKENS = "queued-tokens"  # queued by free(indices): later calls may name it again
QUEUED_PAGE = "queued-page"  # queued by page id: released exactly once
# The shared mode (section 8): the SWA side's pages, in the one list both sides share.
HELD_SWA = "held-swa"
QUEUED_TOKENS_SWA = "queued-tokens-swa"


class _PageList:
    """A pool's free list, staging list and page states: its own, or in the shared
    mode (section 8) the one list of parent pages both sides share (a parent is a page
    of the larger-entry side, or parent_k pages of the smaller-entry side)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages  # parents 1..num_pages; 0 is the padding parent
        self.free_pages = []
        self.release_pages = []
        self.state = []

    def clear(self) -> None:
        self.free_pages = list(range(1, self.num_pages + 1))
        self.release_pages = []
        self.state = [None] + [FREE] * self.num_pages  # page 0 is padding


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------
# input conversion and checks


# A value of the wrong type raises TypeError and a bad value ValueError, as in
# swa_ext.decode and the native classes.
def _ints(values, what: str) -> list[int]:
    """A list of ints from a list, any iterable of ints, or a tensor (.tolist())."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    if isinstance(values, bool):
        raise TypeError(f"{what}: expected integers, got a bool")
    if isinstance(values, int):  # a 0-d tensor or a bare int
        return [values]
    try:
        items = list(values)
    except TypeError:
        raise TypeError(f"{what}: expected a sequence of integers") from None
    out = []
    for v in items:
        if isinstance(v, bool):
            raise TypeError(f"{what}: expected integers, got a bool")
        try:
            out.append(operator.index(v))
        except TypeError:
            raise TypeError(f"{what}: {v!r} is not an integer") from None
    return out


def _int(value, what: str) -> int:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        raise TypeError(f"{what}: expected an integer, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what}: {value!r} is not an integer") from None


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _check_same_length(**lists) -> None:
    lengths = {name: len(v) for name, v in lists.items()}
    _require(len(set(lengths.values())) <= 1, f"mismatched lengths: {lengths}")


# --------------------------------------------------------------------------
# page-layout rules (SPEC section 1), shared by the pools and the hybrid allocator


def _continues_page(prefix_len: int, seq_len: int, page_size: int) -> bool:
    """Whether a request's new tokens start inside its prefix's partial last page."""
    return min(seq_len, cdiv(prefix_len, page_size) * page_size) > prefix_len


def _new_pages_extend(prefix_lens: list[int], seq_lens: list[int], page_size: int) -> int:
    """The pages alloc_extend takes from the free list for a batch."""
    return sum(cdiv(s, page_size) - cdiv(p, page_size) for p, s in zip(prefix_lens, seq_lens))


# --------------------------------------------------------------------------
# one pool


class _PoolRef:
    """What the token pool and the page pool share: page bookkeeping and checks.

    Each change X that can be refused as an error (alloc_extend, alloc_decode,
    free, free_page_ids, free_segment) has a check-only twin check_X: it raises
    what X would raise and changes nothing, so that the hybrid allocator can
    check both of its pools before it changes either. Their `what` names the
    caller's call in the message.
    """

    def __init__(self, size: int, page_size: int, need_sort: bool = False, page_list=None,
                 held: str = HELD, parent_k: int | None = None):
        """page_list: the shared mode's one list of parents (section 8), which this pool
        shares with the other side, holding its pages as `held` (HELD or HELD_SWA).
        parent_k: this side is the smaller-entry side, parent_k child pages to a parent
        (its pages are child pages, with states of their own; None: its pages are parents)."""
        size = _int(size, "size")
        page_size = _int(page_size, "page_size")
        _require(size >= 0, f"size must be >= 0, got {size}")
        _require(page_size >= 1, f"page_size must be >= 1, got {page_size}")
        self.size = size
        self.page_size = page_size
        self.need_sort = bool(need_sort)
        self._list = page_list if page_list is not None else _PageList(size // page_size)
        self._children = parent_k
        # Child page ids run to the last child of the last parent; parent 0's are padding.
        self.num_pages = self._list.num_pages if parent_k is None else (self._list.num_pages + 1) * parent_k - 1
        self._held = held
        self._queued_tokens = QUEUED_TOKENS_SWA if held == HELD_SWA else QUEUED_TOKENS
        self.clear()

    # The lists, in self._list so that the shared mode's two sides see one.
    free_pages = property(lambda self: self._list.free_pages, lambda self, v: setattr(self._list, "free_pages", v))
    release_pages = property(lambda self: self._list.release_pages,
                             lambda self, v: setattr(self._list, "release_pages", v))

    @property
    def _state(self) -> list:
        """This side's page states: the list's (parents) or, on the smaller-entry side, its child pages'."""
        return self._list.state if self._children is None else self._child_state

    # ---- state

    def clear(self) -> None:
        """Back to the initial state: every page free, in order, no group open."""
        self._list.clear()
        if self._children is not None:
            k = self._children
            self._child_state = [None] * k + [FREE] * (self.num_pages + 1 - k)  # parent 0's children are padding
            self._partial = []  # bound parents with a free child, the one taken from first in front
        self._in_group = False
        self._group_tokens = []  # free(indices) calls queued in the group
        self._group_pages = []  # free_page_ids / free_segment pages queued

    def snapshot(self) -> dict:
        return copy.deepcopy(
            {
                "free_pages": self.free_pages,
                "release_pages": self.release_pages,
                "page_state": self._state,
                "partial": self._partial if self._children is not None else None,
                "in_group": self._in_group,
                "group_tokens": self._group_tokens,
                "group_pages": self._group_pages,
            }
        )

    @property
    def is_not_in_free_group(self) -> bool:
        return not self._in_group

    def _pages_of_parents(self, parents: int) -> int:
        """This side's pages in `parents` parents and in its partly used parents."""
        if self._children is None:
            return parents
        return parents * self._children + sum(self._free_children(q) for q in self._partial)

    def parents_for(self, pages: int) -> int:
        """The parents this side binds to take `pages` pages: its partly used parents' free
        children first."""
        if self._children is None or pages < 0:  # a negative count (SGLang takes any) counts as itself
            return pages
        return cdiv(max(0, pages - self._pages_of_parents(0)), self._children)

    def _free_room(self) -> int:
        """The pages this side can take without a merge."""
        return self._pages_of_parents(len(self.free_pages))

    def available_size(self) -> int:
        return self._pages_of_parents(len(self.free_pages) + len(self.release_pages)) * self.page_size

    def used_size(self) -> int:
        """Tokens in the pages this pool holds: neither free nor staged; pages its open free
        group queues count until the group ends (SPEC.md section 8)."""
        own = (self._held, self._queued_tokens)
        return (sum(s in own for s in self._state[1:]) + len(self._group_pages)) * self.page_size

    def merge_and_sort_free(self) -> None:
        if self.release_pages:
            for page in self.release_pages:
                self._list.state[page] = FREE
            self.free_pages = sorted(self.free_pages + self.release_pages)
            self.release_pages = []

    # ---- checks (raise ValueError, change nothing)

    def _page_of(self, index: int, what: str) -> int:
        page = index // self.page_size
        _require(
            index >= 0 and 1 <= page <= self.num_pages,
            f"{what}: index {index} is in page {page}, outside pages 1..{self.num_pages}",
        )
        return page

    def check_tokens_in_range(self, indices, what: str = "indices") -> None:
        """Every index is a token of pages 1..num_pages (page 0 is the padding page)."""
        for i in _ints(indices, what):
            self._page_of(i, what)

    def _check_pages_in_range(self, pages: list[int], what: str) -> None:
        for p in pages:
            _require(1 <= p <= self.num_pages, f"{what}: page {p} outside 1..{self.num_pages}")

    def _check_alloc_rows(self, prefix_lens, seq_lens, last_loc, what: str) -> None:
        """Per request: 0 <= prefix <= seq, and last_loc is the prefix's last token.

        last_loc is -1 for an empty prefix; otherwise it sits at the prefix's
        offset inside its page, in a held page when the request continues it.
        """
        _check_same_length(prefix_lens=prefix_lens, seq_lens=seq_lens, last_loc=last_loc)
        ps = self.page_size
        for pre, seq, last in zip(prefix_lens, seq_lens, last_loc):
            _require(pre >= 0 and seq >= 0, f"{what}: negative length (prefix {pre}, seq {seq})")
            _require(pre <= seq, f"{what}: prefix {pre} > seq {seq}")
            if pre == 0:
                _require(last == -1, f"{what}: last_loc {last} must be -1 for an empty prefix")
                continue
            page = self._page_of(last, f"{what}: last_loc")
            _require(
                last % ps == (pre - 1) % ps,
                f"{what}: last_loc {last} is at page offset {last % ps}, prefix {pre} ends at offset {(pre - 1) % ps}",
            )
            if _continues_page(pre, seq, ps):
                _require(self._state[page] == self._held,
                         f"{what}: last_loc {last} is in page {page}, which is {self._state[page]}")

    def check_alloc_extend(self, prefix_lens, seq_lens, last_loc, extend_num_tokens,
                           what: str = "alloc_extend") -> None:
        prefix_lens = _ints(prefix_lens, f"{what}: prefix_lens")
        seq_lens = _ints(seq_lens, f"{what}: seq_lens")
        last_loc = _ints(last_loc, f"{what}: last_loc")
        ext = _int(extend_num_tokens, f"{what}: extend_num_tokens")
        self._check_alloc_rows(prefix_lens, seq_lens, last_loc, what)
        _require(ext == sum(s - p for p, s in zip(prefix_lens, seq_lens)),
                 f"{what}: extend_num_tokens {ext} != sum(seq - prefix)")

    def check_alloc_decode(self, seq_lens, last_loc, what: str = "alloc_decode") -> None:
        seq_lens = _ints(seq_lens, f"{what}: seq_lens")
        last_loc = _ints(last_loc, f"{what}: last_loc")
        _check_same_length(seq_lens=seq_lens, last_loc=last_loc)
        _require(all(s >= 1 for s in seq_lens), f"{what}: seq_lens must be >= 1")
        # A decode step is an extend by one token over a prefix of seq - 1.
        self._check_alloc_rows([s - 1 for s in seq_lens], seq_lens, last_loc, what)

    def check_free(self, indices, what: str = "free") -> None:
        """free(indices) names each page it touches; the page must be held.

        In an open group a paged pool's page may already be queued by an earlier
        free(indices), since the group's end frees the union.
        """
        indices = _ints(indices, f"{what}: indices")
        self.check_tokens_in_range(indices, what)
        self._check_token_pages_freeable(indices, queued_ok=self._in_group, what=what)

    # ---- group (section 3)

    def free_group_begin(self) -> None:
        _require(not self._in_group, "free_group_begin: a free group is already open")
        self._in_group = True
        self._group_tokens = []
        self._group_pages = []

    def free_group_end(self, page_ids_first: bool = False) -> None:
        """One free over all queued index lists, then the queued pages in call order
        (section 3); page_ids_first swaps the two, as the hybrid allocator ends its
        SWA pool's group (section 4)."""
        _require(self._in_group, "free_group_end: no free group is open")
        tokens, pages = self._group_tokens, self._group_pages
        self._in_group = False
        self._group_tokens = []
        self._group_pages = []
        if page_ids_first:
            self._release(pages)
            self._free_tokens_now(tokens)
        else:
            self._free_tokens_now(tokens)
            self._release(pages)

    # ---- primitives (no checks: callers check first)

    def _children_of(self, parent: int) -> range:
        k = self._children
        return range(parent * k, parent * k + k)

    def _free_children(self, parent: int) -> int:
        return sum(self._child_state[c] == FREE for c in self._children_of(parent))

    def _take(self, n: int) -> list[int]:
        """The next n pages: on the smaller-entry side the free children of its partly used
        parents (front first, each parent's in order), then the children of parents bound
        from the head of the list; a parent left partly used goes to the front."""
        pages = []
        if self._children is not None:
            while len(pages) < n and self._partial:
                parent = self._partial[0]
                for c in self._children_of(parent):
                    if len(pages) < n and self._child_state[c] == FREE:
                        pages.append(c)
                        self._child_state[c] = self._held
                if self._free_children(parent) == 0:
                    self._partial.pop(0)
        parents_needed = self.parents_for(n - len(pages)) if self._children is not None else n
        parents, self.free_pages = self.free_pages[:parents_needed], self.free_pages[parents_needed:]
        for q in parents:
            self._list.state[q] = self._held  # bound to this side
            if self._children is None:
                pages.append(q)
                continue
            for c in self._children_of(q):
                if len(pages) < n:
                    pages.append(c)
                    self._child_state[c] = self._held
            if self._free_children(q):
                self._partial.insert(0, q)
        return pages

    def _release(self, pages: list[int]) -> None:
        """Pages back: a child page to its parent, the parent released (section 1's or 2's
        place) once its last child is back; a parent whose first child comes back goes to
        the front of the partly used ones."""
        if self._children is None:
            self._release_parents(pages)
            return
        whole = []
        for c in pages:
            self._child_state[c] = FREE
            parent = c // self._children
            if self._free_children(parent) == self._children:
                if parent in self._partial:
                    self._partial.remove(parent)
                whole.append(parent)
            elif parent not in self._partial:
                self._partial.insert(0, parent)
        self._release_parents(whole)

    def _release_parents(self, parents: list[int]) -> None:
        raise NotImplementedError

    def _free_tokens_now(self, indices: list[int]) -> None:
        raise NotImplementedError

    def _check_token_pages_freeable(self, indices, queued_ok, what) -> None:
        raise NotImplementedError

    # ---- frees

    def free(self, indices) -> None:
        indices = _ints(indices, "free: indices")
        self.check_free(indices)
        if self._in_group:
            for i in indices:
                self._state[i // self.page_size] = self._queued_tokens
            self._group_tokens.extend(indices)
        else:
            self._free_tokens_now(indices)


class TokenPoolRef(_PoolRef):
    """SPEC section 2: the pool at page size 1 (a page is a token)."""

    def __init__(self, size: int, need_sort: bool = False, **side):
        super().__init__(size, 1, need_sort, **side)

    def _check_token_pages_freeable(self, indices, queued_ok, what) -> None:
        # No dedup anywhere at page size 1: every token is freed exactly once.
        seen = set()
        for i in indices:
            _require(i not in seen, f"{what}: token {i} named twice (double free)")
            seen.add(i)
            _require(self._state[i] == self._held, f"{what}: token {i} is {self._state[i]}, not held (double free)")

    def _release_parents(self, tokens: list[int]) -> None:
        # Appended (the page pool prepends), or staged until the next merge.
        for t in tokens:
            self._list.state[t] = STAGED if self.need_sort else FREE
        if self.need_sort:
            self.release_pages.extend(tokens)
        else:
            self.free_pages.extend(tokens)

    def _free_tokens_now(self, indices: list[int]) -> None:
        self._release(indices)

    def check_free_page_ids(self, pages, what: str = "free_page_ids") -> None:
        self.check_free(pages, what)

    def free_page_ids(self, pages) -> None:
        self.free(pages)

    def check_free_segment(self, indices, start_pos=0, what: str = "free_segment") -> None:
        _int(start_pos, f"{what}: start_pos")
        self.check_free(indices, what)

    def free_segment(self, indices, start_pos=0) -> None:
        _int(start_pos, "free_segment: start_pos")
        self.free(indices)

    def alloc(self, need_size) -> list[int] | None:
        n = _int(need_size, "alloc: need_size")
        _require(n >= 0, f"alloc: need_size {n} < 0")
        if self.need_sort and n > self._free_room():
            self.merge_and_sort_free()
        if n > self._free_room():
            return None
        return self._take(n)

    def alloc_extend(self, prefix_lens, seq_lens, last_loc, extend_num_tokens) -> list[int] | None:
        prefix_lens = _ints(prefix_lens, "alloc_extend: prefix_lens")
        seq_lens = _ints(seq_lens, "alloc_extend: seq_lens")
        last_loc = _ints(last_loc, "alloc_extend: last_loc")
        ext = _int(extend_num_tokens, "alloc_extend: extend_num_tokens")
        self.check_alloc_extend(prefix_lens, seq_lens, last_loc, ext)
        # Page size 1: the paged layout degenerates to fresh tokens from the head.
        return self.alloc(ext)

    def alloc_decode(self, seq_lens, last_loc) -> list[int] | None:
        seq_lens = _ints(seq_lens, "alloc_decode: seq_lens")
        last_loc = _ints(last_loc, "alloc_decode: last_loc")
        self.check_alloc_decode(seq_lens, last_loc)
        return self.alloc(len(seq_lens))


class PagePoolRef(_PoolRef):
    """SPEC section 1: the pool at page size > 1."""

    def __init__(self, size: int, page_size: int, need_sort: bool = False, **side):
        _require(_int(page_size, "page_size") >= 2, "PagePoolRef needs page_size >= 2 (use TokenPoolRef)")
        super().__init__(size, page_size, need_sort, **side)

    def _tokens_of(self, pages: list[int]) -> list[int]:
        ps = self.page_size
        return [page * ps + k for page in pages for k in range(ps)]

    def _check_token_pages_freeable(self, indices, queued_ok, what) -> None:
        # free() dedups the tokens of one call (and of one group) into pages.
        for page in sorted({i // self.page_size for i in indices}):
            state = self._state[page]
            ok = state == self._held or (queued_ok and state == self._queued_tokens)
            _require(ok, f"{what}: page {page} is {state}, not held (double free)")

    def _release_parents(self, pages: list[int]) -> None:
        # need_sort: staged until the next merge; else prepended, so the pages
        # freed last are handed out first.
        for p in pages:
            self._list.state[p] = STAGED if self.need_sort else FREE
        if self.need_sort:
            self.release_pages.extend(pages)
        else:
            self.free_pages = list(pages) + self.free_pages

    def _free_tokens_now(self, indices: list[int]) -> None:
        self._release(sorted({i // self.page_size for i in indices}))

    def _segment_pages(self, indices: list[int], start_pos: int, what: str) -> list[int]:
        _require(start_pos >= 0 and start_pos % self.page_size == 0,
                 f"{what}: start_pos {start_pos} is not page-aligned (page size {self.page_size})")
        self.check_tokens_in_range(indices, what)
        # Every ps-th index represents one page.
        return [i // self.page_size for i in indices[:: self.page_size]]

    def check_free_page_ids(self, pages, what: str = "free_page_ids") -> None:
        """free_page_ids(pages) releases each page as given: each once, each held."""
        pages = _ints(pages, f"{what}: pages")
        self._check_pages_in_range(pages, what)
        seen = set()
        for p in pages:
            _require(p not in seen, f"{what}: page {p} named twice (double free)")
            seen.add(p)
            _require(self._state[p] == self._held, f"{what}: page {p} is {self._state[p]}, not held (double free)")

    def free_page_ids(self, pages) -> None:
        pages = _ints(pages, "free_page_ids: pages")
        self.check_free_page_ids(pages)
        if self._in_group:
            for p in pages:
                self._state[p] = QUEUED_PAGE
            self._group_pages.extend(pages)
        else:
            self._release(pages)

    def check_free_segment(self, indices, start_pos=0, what: str = "free_segment") -> None:
        indices = _ints(indices, f"{what}: indices")
        start_pos = _int(start_pos, f"{what}: start_pos")
        self.check_free_page_ids(self._segment_pages(indices, start_pos, what), what)

    def free_segment(self, indices, start_pos=0) -> None:
        indices = _ints(indices, "free_segment: indices")
        start_pos = _int(start_pos, "free_segment: start_pos")
        self.free_page_ids(self._segment_pages(indices, start_pos, "free_segment"))

    def alloc(self, need_size) -> list[int] | None:
        need_size = _int(need_size, "alloc: need_size")
        _require(need_size >= 0 and need_size % self.page_size == 0,
                 f"alloc: need_size {need_size} is not a multiple of the page size {self.page_size}")
        n = need_size // self.page_size
        if n > self._free_room():
            self.merge_and_sort_free()
        if n > self._free_room():
            return None
        return self._tokens_of(self._take(n))

    def alloc_extend(self, prefix_lens, seq_lens, last_loc, extend_num_tokens) -> list[int] | None:
        prefix_lens = _ints(prefix_lens, "alloc_extend: prefix_lens")
        seq_lens = _ints(seq_lens, "alloc_extend: seq_lens")
        last_loc = _ints(last_loc, "alloc_extend: last_loc")
        ext = _int(extend_num_tokens, "alloc_extend: extend_num_tokens")
        self.check_alloc_extend(prefix_lens, seq_lens, last_loc, ext)
        ps = self.page_size
        bs = len(seq_lens)
        need = _new_pages_extend(prefix_lens, seq_lens, ps)
        # Merge on a cheap upper bound of the pages needed, not on `need` itself.
        if ext // ps + bs + 1 > self._free_room():
            self.merge_and_sort_free()
        if need > self._free_room():
            return None
        pages = self._take(need)
        out = []
        offset = 0
        for pre, seq, last in zip(prefix_lens, seq_lens, last_loc):
            n_new = cdiv(seq, ps) - cdiv(pre, ps)
            mine = pages[offset : offset + n_new]
            offset += n_new
            aligned_pre = cdiv(pre, ps) * ps
            # 1. continue the partial last page of the prefix
            n1 = min(seq, aligned_pre) - pre
            out.extend(range(last + 1, last + 1 + n1))
            if seq <= aligned_pre:
                continue
            # 2. whole new pages
            n_whole = seq // ps - aligned_pre // ps
            out.extend(self._tokens_of(mine[:n_whole]))
            # 3. start of the last new page
            n3 = seq - (seq // ps) * ps
            if n3:
                out.extend(range(mine[-1] * ps, mine[-1] * ps + n3))
        return out

    def alloc_decode(self, seq_lens, last_loc) -> list[int] | None:
        seq_lens = _ints(seq_lens, "alloc_decode: seq_lens")
        last_loc = _ints(last_loc, "alloc_decode: last_loc")
        self.check_alloc_decode(seq_lens, last_loc)
        ps = self.page_size
        # Merge on the batch size (every request might need a page).
        if len(seq_lens) > self._free_room():
            self.merge_and_sort_free()
        needs_page = [s % ps == 1 for s in seq_lens]
        need = sum(needs_page)
        if need > self._free_room():
            return None
        pages = iter(self._take(need))
        return [next(pages) * ps if new else last + 1 for new, last in zip(needs_page, last_loc)]


# --------------------------------------------------------------------------
# the hybrid allocator (section 4)


class SWAAllocatorRef:
    """Full pool + SWA pool + the full-to-SWA token mapping (SPEC section 4).

    It uses its pools through their public methods only. A call that changes
    both pools (or the mapping and a pool) first runs the pools' check_X twins
    of every change it will make, so that a refused call changes nothing.
    """

    def __init__(self, size: int, size_swa: int, page_size: int, need_sort: bool = False, shared: bool = False,
                 parent_k: int = 1, small_side: str = "swa"):
        """shared: the shared mode (section 8), one list of parents for both sides: a
        parent holds one page of the larger-entry side or parent_k pages of small_side
        ("full" or "swa"), whose size must be parent_k times the other side's."""
        size = _int(size, "size")
        size_swa = _int(size_swa, "size_swa")
        page_size = _int(page_size, "page_size")
        parent_k = _int(parent_k, "parent_k")
        _require(page_size >= 1, f"page_size must be >= 1, got {page_size}")
        _require(parent_k >= 1, f"parent_k must be >= 1, got {parent_k}")
        _require(small_side in ("full", "swa"), f"small_side must be 'full' or 'swa', got {small_side!r}")
        _require(shared or parent_k == 1, "parent_k > 1 needs the shared mode")
        small_is_swa = small_side == "swa"
        large_size = size if small_is_swa else size_swa
        _require(not shared or (size_swa if small_is_swa else size) == large_size * parent_k,
                 f"{'size_swa' if small_is_swa else 'size'} must be parent_k ({parent_k}) times the other side's size")
        self.page_size = page_size
        self.need_sort = bool(need_sort)
        self.shared = bool(shared)
        self.parent_k = parent_k
        self.small_side = small_side
        page_list = _PageList(large_size // page_size) if shared else None

        def pool(slots, held, small):
            side = dict(page_list=page_list, held=held, parent_k=parent_k if shared and small else None)
            if page_size == 1:
                return TokenPoolRef(slots, need_sort, **side)
            return PagePoolRef(slots, page_size, need_sort, **side)

        self.full_attn_allocator = pool(size, HELD, not small_is_swa)
        self.swa_attn_allocator = pool(size_swa, HELD_SWA if shared else HELD, small_is_swa)
        self._size_full = size
        self._size_swa = size_swa
        self.clear()

    # ---- state

    def clear(self) -> None:
        self.full_attn_allocator.clear()
        self.swa_attn_allocator.clear()
        # The last entry is a sentinel: mapping[-1] == -1, so last_loc -1 translates to -1.
        # Its slots: SGLang's size + page_size, or every slot of the full side's pages where
        # they are child pages (their parent 0's included), if more.
        slots = max(self._size_full + self.page_size, (self.full_attn_allocator.num_pages + 1) * self.page_size)
        self.full_to_swa_index_mapping = [0] * slots + [-1]

    def snapshot(self) -> dict:
        return {
            "full": self.full_attn_allocator.snapshot(),
            "swa": self.swa_attn_allocator.snapshot(),
            "mapping": list(self.full_to_swa_index_mapping),
        }

    @property
    def size(self) -> int:
        return min(self._size_full, self._size_swa)

    @property
    def size_full(self) -> int:
        return self._size_full

    @property
    def size_swa(self) -> int:
        return self._size_swa

    def available_size(self) -> int:
        return min(self.full_available_size(), self.swa_available_size())

    def full_available_size(self) -> int:
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        return self.swa_attn_allocator.available_size()

    def full_used_size(self) -> int:
        return self.full_attn_allocator.used_size()

    def swa_used_size(self) -> int:
        return self.swa_attn_allocator.used_size()

    def new_pages_available(self, num_full_pages, num_swa_pages) -> bool:
        ps = self.page_size
        num_full_pages = _int(num_full_pages, "num_full_pages")
        num_swa_pages = _int(num_swa_pages, "num_swa_pages")
        if self.shared:  # one list: the parents both sides bind must fit
            full, swa = self.full_attn_allocator, self.swa_attn_allocator
            parents = len(full.free_pages) + len(full.release_pages)
            return full.parents_for(num_full_pages) + swa.parents_for(num_swa_pages) <= parents
        return num_full_pages <= self.full_available_size() // ps and num_swa_pages <= self.swa_available_size() // ps

    def _merge_shared(self, full_mark: int, swa_mark: int | None, full_pages: int, swa_pages: int) -> None:
        """need_sort in the shared mode: the one list merges before either side takes
        pages when a side's mark (the low mark its pool would merge on) is above the free
        pages left once the other side's pages are set aside. The pools' own merges then
        never fire: the one list holds what both take. swa_mark None: no SWA pages."""
        full, swa = self.full_attn_allocator, self.swa_attn_allocator
        if not self.shared:
            return
        free = len(full.free_pages)
        swa_due = swa_mark is not None and swa_mark > swa._pages_of_parents(free - full.parents_for(full_pages))
        if full_mark > full._pages_of_parents(free - swa.parents_for(swa_pages)) or swa_due:
            self.full_attn_allocator.merge_and_sort_free()

    # ---- mapping

    def translate_loc_from_full_to_swa(self, indices) -> list[int]:
        indices = _ints(indices, "translate: indices")
        last = len(self.full_to_swa_index_mapping) - 1
        for i in indices:
            _require(i == -1 or 0 <= i <= last, f"translate: index {i} outside the mapping")
        return [self.full_to_swa_index_mapping[i] for i in indices]

    def set_full_to_swa_mapping(self, full, swa) -> None:
        full = _ints(full, "set_full_to_swa_mapping: full")
        swa = _ints(swa, "set_full_to_swa_mapping: swa")
        _check_same_length(full=full, swa=swa)
        self.full_attn_allocator.check_tokens_in_range(full, "set_full_to_swa_mapping: full")
        self.swa_attn_allocator.check_tokens_in_range([v for v in swa if v != 0], "set_full_to_swa_mapping: swa")
        for f, s in zip(full, swa):
            self.full_to_swa_index_mapping[f] = s

    def clear_full_to_swa_mapping(self, full) -> None:
        full = _ints(full, "clear_full_to_swa_mapping: full")
        self.full_attn_allocator.check_tokens_in_range(full, "clear_full_to_swa_mapping: full")
        for f in full:
            self.full_to_swa_index_mapping[f] = 0

    def _map(self, full: list[int], swa: list[int]) -> None:
        for f, s in zip(full, swa):
            self.full_to_swa_index_mapping[f] = s

    def _swa_rows(self, prefix_lens, seq_lens, swa_last_loc) -> tuple[list[int], list[int], list[int]]:
        """The batch as the SWA pool is asked for it: (prefix_lens, seq_lens, last_loc).

        A request that continues its prefix's partial page continues it in the
        SWA pool too, from its SWA last_loc, which must be live there. Any other
        request never reads its last_loc (0 once its SWA peer is evicted); to the
        pool it is a fresh request for its seq - prefix new tokens, which takes
        the same new pages and lays them out the same way.
        """
        ps = self.page_size
        continues = [_continues_page(p, s, ps) for p, s in zip(prefix_lens, seq_lens)]
        return (
            [p if c else 0 for p, c in zip(prefix_lens, continues)],
            [s if c else s - p for p, s, c in zip(prefix_lens, seq_lens, continues)],
            [last if c else -1 for last, c in zip(swa_last_loc, continues)],
        )

    # ---- allocation

    def alloc(self, need_size) -> list[int] | None:
        # SGLang's hybrid alloc() takes any page multiple; the traces use it at page size 1.
        n = _int(need_size, "alloc: need_size")
        _require(n >= 0 and n % self.page_size == 0,
                 f"alloc: need_size {n} is not a multiple of the page size {self.page_size}")
        pages = n // self.page_size
        if not self.new_pages_available(pages, pages):
            return None
        self._merge_shared(pages, pages, pages, pages)
        full = self.full_attn_allocator.alloc(n)
        swa = self.swa_attn_allocator.alloc(n)
        self._map(full, swa)
        return full

    def _lengths(self, what, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, ext):
        """Converted inputs, checked for the full pool; the device and CPU copies must agree."""
        pre = _ints(prefix_lens, f"{what}: prefix_lens")
        pre_cpu = _ints(prefix_lens_cpu, f"{what}: prefix_lens_cpu")
        seq = _ints(seq_lens, f"{what}: seq_lens")
        seq_cpu = _ints(seq_lens_cpu, f"{what}: seq_lens_cpu")
        last = _ints(last_loc, f"{what}: last_loc")
        ext = _int(ext, f"{what}: extend_num_tokens")
        _require(pre == pre_cpu, f"{what}: prefix_lens and prefix_lens_cpu differ")
        _require(seq == seq_cpu, f"{what}: seq_lens and seq_lens_cpu differ")
        self.full_attn_allocator.check_alloc_extend(pre, seq, last, ext, what)
        return pre, seq, last, ext

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                     last_loc, extend_num_tokens) -> list[int] | None:
        what = "alloc_extend"
        pre, seq, last, ext = self._lengths(what, prefix_lens, prefix_lens_cpu,
                                            seq_lens, seq_lens_cpu, last_loc, extend_num_tokens)
        if self.page_size == 1:
            return self.alloc(ext)
        full_pool, swa_pool = self.full_attn_allocator, self.swa_attn_allocator
        swa_pre, swa_seq, swa_last = self._swa_rows(pre, seq, self.translate_loc_from_full_to_swa(last))
        swa_pool.check_alloc_extend(swa_pre, swa_seq, swa_last, ext, f"{what} (SWA side)")

        n = _new_pages_extend(pre, seq, self.page_size)
        if not self.new_pages_available(n, n):
            return None
        mark = ext // self.page_size + len(seq) + 1
        self._merge_shared(mark, mark, n, n)
        full = full_pool.alloc_extend(pre, seq, last, ext)
        swa = swa_pool.alloc_extend(swa_pre, swa_seq, swa_last, ext)
        self._map(full, swa)
        return full

    def alloc_extend_swa_tail(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                              last_loc, extend_num_tokens, swa_tail_len) -> list[int] | None:
        what = "alloc_extend_swa_tail"
        pre, seq, last, ext = self._lengths(what, prefix_lens, prefix_lens_cpu,
                                            seq_lens, seq_lens_cpu, last_loc, extend_num_tokens)
        tail = _int(swa_tail_len, f"{what}: swa_tail_len")
        _require(len(seq) == 1, f"{what}: batch size must be 1, got {len(seq)}")
        _require(0 <= tail <= ext, f"{what}: swa_tail_len {tail} outside [0, {ext}]")
        full_pool, swa_pool = self.full_attn_allocator, self.swa_attn_allocator

        if self.page_size == 1:
            if not self.new_pages_available(ext, tail):
                return None
            self._merge_shared(ext, tail if tail else None, ext, tail)
            full = full_pool.alloc(ext)
            swa = swa_pool.alloc(tail)
        else:
            nf = _new_pages_extend(pre, seq, self.page_size)
            ns = cdiv(tail, self.page_size)
            if not self.new_pages_available(nf, ns):
                return None
            self._merge_shared(ext // self.page_size + 2, tail // self.page_size + 2 if tail else None, nf, ns)
            full = full_pool.alloc_extend(pre, seq, last, ext)
            if tail == 0:
                return full
            swa = swa_pool.alloc_extend([0], [tail], [-1], tail)
        # Only the last `tail` tokens get SWA KV; the head has none.
        head = len(full) - tail
        self._map(full[head:], swa)
        self._map(full[:head], [0] * head)
        return full

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc) -> list[int] | None:
        what = "alloc_decode"
        seq = _ints(seq_lens, f"{what}: seq_lens")
        seq_cpu = _ints(seq_lens_cpu, f"{what}: seq_lens_cpu")
        last = _ints(last_loc, f"{what}: last_loc")
        _require(seq == seq_cpu, f"{what}: seq_lens and seq_lens_cpu differ")
        full_pool, swa_pool = self.full_attn_allocator, self.swa_attn_allocator
        full_pool.check_alloc_decode(seq, last, what)
        if self.page_size == 1:
            return self.alloc(len(seq))
        # A decode step extends each request by one token over a prefix of seq - 1.
        _, swa_seq, swa_last = self._swa_rows([s - 1 for s in seq], seq, self.translate_loc_from_full_to_swa(last))
        swa_pool.check_alloc_decode(swa_seq, swa_last, f"{what} (SWA side)")

        # Atomic: both pools are checked before either is touched.
        need = sum(1 for s in seq if s % self.page_size == 1)
        if not self.new_pages_available(need, need):
            return None
        self._merge_shared(len(seq), len(seq), need, need)
        full = full_pool.alloc_decode(seq, last)
        swa = swa_pool.alloc_decode(swa_seq, swa_last)
        self._map(full, swa)
        return full

    # ---- frees
    # Each free checks every pool it frees from (and the mapping) first, then
    # changes them. While a group is open the SWA pool's own group holds the
    # SWA-side frees (SPEC section 4's two lists: its page ids and its free()
    # indices); the mapping is cleared at call time.

    def _swa_values_of(self, indices: list[int]) -> tuple[list[int], list[int]]:
        """free_swa's view: every full token of the indices' pages, and their SWA peers."""
        ps = self.page_size
        tokens = [(i // ps) * ps + k for i in indices for k in range(ps)]
        values = [self.full_to_swa_index_mapping[t] for t in tokens]
        return tokens, [v for v in values if v > 0]

    def _check_free_swa(self, indices: list[int], what: str) -> None:
        self.full_attn_allocator.check_tokens_in_range(indices, what)
        _, values = self._swa_values_of(indices)
        self.swa_attn_allocator.check_free(values, f"{what} (SWA side)")

    def _apply_free_swa(self, indices: list[int]) -> None:
        tokens, values = self._swa_values_of(indices)
        for t in tokens:
            self.full_to_swa_index_mapping[t] = 0
        self.swa_attn_allocator.free(values)

    def _swa_segment_pages(self, indices: list[int], start_pos: int, what: str) -> tuple[list[int], list[int]]:
        """(full tokens whose mapping is cleared, SWA pages to release); checks everything."""
        ps = self.page_size
        _require(start_pos >= 0 and start_pos % ps == 0,
                 f"{what}: start_pos {start_pos} is not page-aligned (page size {ps})")
        self.full_attn_allocator.check_tokens_in_range(indices, what)
        reps = indices[::ps]
        values = [self.full_to_swa_index_mapping[r] for r in reps]
        for r, v in zip(reps, values):
            _require(v > 0, f"{what}: full index {r} has no SWA peer (already freed or evicted)")
        pages = [v // ps for v in values]
        self.swa_attn_allocator.check_free_page_ids(pages, f"{what} (SWA side)")
        tokens = [(r // ps) * ps + k for r in reps for k in range(ps)]
        return tokens, pages

    def _apply_free_swa_segment(self, tokens: list[int], pages: list[int]) -> None:
        for t in tokens:
            self.full_to_swa_index_mapping[t] = 0
        self.swa_attn_allocator.free_page_ids(pages)

    def free_swa(self, indices) -> None:
        indices = _ints(indices, "free_swa: indices")
        if self.page_size == 1:
            self.free_swa_segment(indices, 0)
            return
        self._check_free_swa(indices, "free_swa")
        self._apply_free_swa(indices)

    def free_swa_segment(self, indices, start_pos=0) -> None:
        indices = _ints(indices, "free_swa_segment: indices")
        start_pos = _int(start_pos, "free_swa_segment: start_pos")
        tokens, pages = self._swa_segment_pages(indices, start_pos, "free_swa_segment")
        self._apply_free_swa_segment(tokens, pages)

    def free_full(self, indices) -> None:
        self.full_attn_allocator.free(indices)

    def free_full_segment(self, indices, start_pos=0) -> None:
        self.full_attn_allocator.free_segment(indices, start_pos)

    def free(self, indices) -> None:
        indices = _ints(indices, "free: indices")
        full_pool = self.full_attn_allocator
        if self.page_size == 1:
            tokens, pages = self._swa_segment_pages(indices, 0, "free")
        else:
            self._check_free_swa(indices, "free")
        full_pool.check_free(indices, "free (full side)")
        if self.page_size == 1:
            self._apply_free_swa_segment(tokens, pages)
        else:
            self._apply_free_swa(indices)
        full_pool.free(indices)

    def free_segment(self, indices, start_pos=0) -> None:
        indices = _ints(indices, "free_segment: indices")
        start_pos = _int(start_pos, "free_segment: start_pos")
        full_pool = self.full_attn_allocator
        tokens, swa_pages = self._swa_segment_pages(indices, start_pos, "free_segment")
        full_pool.check_free_segment(indices, start_pos, "free_segment (full side)")
        self._apply_free_swa_segment(tokens, swa_pages)
        full_pool.free_segment(indices, start_pos)

    # ---- groups

    def free_group_begin(self) -> None:
        pools = (self.full_attn_allocator, self.swa_attn_allocator)
        _require(all(pool.is_not_in_free_group for pool in pools), "free_group_begin: a free group is already open")
        for pool in pools:
            pool.free_group_begin()

    def free_group_end(self) -> None:
        full_pool, swa_pool = self.full_attn_allocator, self.swa_attn_allocator
        _require(not (full_pool.is_not_in_free_group or swa_pool.is_not_in_free_group),
                 "free_group_end: no free group is open")
        # The SWA side first, its page ids before free_swa's indices; then the full pool's group.
        swa_pool.free_group_end(page_ids_first=True)
        full_pool.free_group_end()


# --------------------------------------------------------------------------
# decode-side preallocation and window eviction (section 5)


def swa_tail_len(seq_len: int, window: int, page_size: int, radix_cache: bool = False) -> int:
    """How many trailing tokens of a prefilled request of length seq_len need SWA KV.

    The tail starts on a page boundary, so seq_len - tail (the evicted length)
    is page-aligned. With the decode radix cache on it keeps a whole window
    behind the page-aligned insert boundary.
    """
    if seq_len <= 0:
        return 0
    if radix_cache:
        start = max(0, seq_len - 1 - max(window, page_size))
    else:
        start = max(0, seq_len - window)
    start = (start // page_size) * page_size
    return seq_len - start


def evicted_after_step(evicted: int, pre_len: int, window: int, page_size: int,
                       interval: int = 1, prefix_sharing: bool = False) -> int:
    """The new SWA-evicted length of a request at committed length pre_len.

    Returns `evicted` unchanged when nothing is to be freed; otherwise a larger,
    page-aligned length, and the caller frees row[evicted:new] with
    free_swa_segment(..., start_pos=evicted).
    """
    if pre_len - window < evicted + interval:
        return evicted
    if prefix_sharing:
        # Keep whole pages of a window that a shared prefix may still match.
        keep_from = pre_len - cdiv(max(window, page_size), page_size) * page_size
    else:
        keep_from = pre_len - window
    new = (max(evicted, keep_from) // page_size) * page_size
    return new if new > evicted else evicted
