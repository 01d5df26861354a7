"""Plain-torch baseline of the swa_ext allocator contract (SPEC.md sections 1-4): the
single pools (token and paged) and the layout helpers; ``baseline`` builds the hybrid on them.

This is written the way SGLang 0.5.23's allocators are written, so that timing
it measures what the native extension replaces:

* free lists are int64 tensors on ``device``; handing out pages re-slices them
  (``free_pages = free_pages[n:]``), releasing pages builds a new tensor with
  ``torch.cat`` (prepend for the page pool, append for the token pool);
* ``free`` dedups with ``torch.unique``; ``need_sort`` stages released pages and
  merges them with ``torch.sort`` when the free list runs short;
* the alloc_extend / alloc_decode layouts are vectorised tensor expressions
  (no per-token Python loop, no per-request loop);
* page counts are computed from the CPU copies of the lengths.

The only deliberate departure from SGLang is the one SPEC.md makes: the hybrid
``alloc_decode`` checks both pools before touching either, so a failure changes
nothing. There is no input validation beyond what SGLang does.
"""

from __future__ import annotations

import torch

__all__ = ["BaselinePagedAllocator", "BaselineTokenAllocator", "get_num_new_pages"]

_I64 = torch.int64


def get_num_new_pages(seq_lens, page_size, prefix_lens=None, decode=False) -> int:
    """Pages a batch needs, from the CPU lengths (SGLang's helper of that name).

    ``decode=True``: one token per request; a request needs a page iff its new
    length ``seq % page_size == 1``. Otherwise the extend count
    ``sum(cdiv(seq, ps) - cdiv(pre, ps))``.
    """
    if not isinstance(seq_lens, torch.Tensor):
        seq_lens = torch.as_tensor(seq_lens, dtype=_I64)
    if decode:
        return int((seq_lens % page_size == 1).sum().item())
    if not isinstance(prefix_lens, torch.Tensor):
        prefix_lens = torch.as_tensor(prefix_lens, dtype=_I64)
    after = (seq_lens + page_size - 1) // page_size
    before = (prefix_lens + page_size - 1) // page_size
    return int((after - before).sum().item())


def _as_i64(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=_I64)  # no copy when already there
    return torch.as_tensor(x, dtype=_I64, device=device)


def _extend_layout(prefix_lens, seq_lens, last_loc, new_pages, page_size, n_tokens):
    """Token indices of an extend batch (SPEC.md section 1, alloc_extend).

    Each request gets, in order: the rest of its partial last page
    (``last_loc + 1 ...``), whole new pages, then the head of its last new
    page. ``new_pages`` holds every request's new pages, request after request.
    Vectorised over tokens: each output token finds its request, its position
    in the sequence, and from that either its offset after ``last_loc`` or its
    page (``new_pages[page_start + pos // ps - cdiv(pre, ps)]``).
    """
    device = seq_lens.device
    ps = page_size
    bs = seq_lens.numel()
    ext = seq_lens - prefix_lens
    req = torch.repeat_interleave(
        torch.arange(bs, device=device), ext, output_size=n_tokens
    )
    out_start = torch.cumsum(ext, 0) - ext
    pre_r = prefix_lens[req]
    pos = pre_r + (torch.arange(n_tokens, device=device) - out_start[req])
    pre_pages = (prefix_lens + ps - 1) // ps
    n_new = (seq_lens + ps - 1) // ps - pre_pages
    page_start = torch.cumsum(n_new, 0) - n_new
    # k < 0: the token continues the request's partial last page.
    k = pos // ps - pre_pages[req]
    out = last_loc[req] + 1 + (pos - pre_r)
    n_pages = new_pages.numel()
    if n_pages > 0:
        slot = (page_start[req] + k).clamp_(0, n_pages - 1)
        out = torch.where(k >= 0, new_pages[slot] * ps + pos % ps, out)
    return out


class _BaselinePool:
    """What SGLang's two pool classes share: tensor free lists, staging, free groups."""

    def clear(self):
        self.free_pages = torch.arange(1, self.size // self.page_size + 1, dtype=_I64, device=self.device)
        self.release_pages = torch.empty((0,), dtype=_I64, device=self.device)
        self.is_not_in_free_group = True
        self.free_group = []
        self.free_group_pages = []

    def available_size(self):
        return (len(self.free_pages) + len(self.release_pages)) * self.page_size

    def merge_and_sort_free(self):
        if len(self.release_pages) > 0:
            self.free_pages = torch.cat((self.free_pages, self.release_pages))
            self.free_pages, _ = torch.sort(self.free_pages)
            self.release_pages = torch.empty((0,), dtype=_I64, device=self.device)

    def free_group_begin(self):
        self.is_not_in_free_group = False
        self.free_group = []
        self.free_group_pages = []

    def free_group_end(self):
        self.is_not_in_free_group = True
        if self.free_group:
            self.free(torch.cat(self.free_group))
        if self.free_group_pages:
            self.free_page_ids(torch.cat(self.free_group_pages))
        self.free_group = []
        self.free_group_pages = []

    def backup_state(self):
        # The tensors are never written in place, so references suffice.
        return (self.free_pages, self.release_pages)

    def restore_state(self, state):
        self.free_pages, self.release_pages = state


class BaselineTokenAllocator(_BaselinePool):
    """Token pool, ``page_size == 1`` (SGLang's ``TokenToKVPoolAllocator``).

    Frees are appended to the end of the free list (or staged in
    ``release_pages`` with ``need_sort``).
    """

    def __init__(self, size, dtype=_I64, device="cpu", need_sort=False):
        self.size = size
        self.page_size = 1
        self.dtype = dtype
        self.device = device
        self.need_sort = need_sort
        self.clear()

    def alloc(self, need_size):
        if self.need_sort and need_size > len(self.free_pages):
            self.merge_and_sort_free()
        if need_size > len(self.free_pages):
            return None
        select_index = self.free_pages[:need_size]
        self.free_pages = self.free_pages[need_size:]
        return select_index

    def free(self, free_index):
        if free_index.numel() == 0:
            return
        if self.is_not_in_free_group:
            if self.need_sort:
                self.release_pages = torch.cat((self.release_pages, free_index))
            else:
                self.free_pages = torch.cat((self.free_pages, free_index))
        else:
            self.free_group.append(free_index)

    # With one token per page, page ids are token indices.
    def free_page_ids(self, page_ids):
        self.free(page_ids)

    def free_segment(self, free_index, start_pos=0):
        self.free(free_index)


class BaselinePagedAllocator(_BaselinePool):
    """Page pool, ``page_size > 1`` (SGLang's ``PagedTokenToKVPoolAllocator``).

    Released pages are prepended to the free list (or staged in
    ``release_pages`` with ``need_sort``).
    """

    def __init__(self, size, page_size, dtype=_I64, device="cpu", need_sort=False):
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.dtype = dtype
        self.device = device
        self.need_sort = need_sort
        self._pos_in_page = torch.arange(page_size, dtype=_I64, device=device)
        self.clear()

    def _release(self, pages):
        if self.need_sort:
            self.release_pages = torch.cat((self.release_pages, pages))
        else:
            self.free_pages = torch.cat((pages, self.free_pages))

    def alloc(self, need_size):
        num_pages = need_size // self.page_size
        if self.need_sort and num_pages > len(self.free_pages):
            self.merge_and_sort_free()
        if num_pages > len(self.free_pages):
            return None
        out_pages = self.free_pages[:num_pages]
        self.free_pages = self.free_pages[num_pages:]
        return (out_pages[:, None] * self.page_size + self._pos_in_page).reshape(-1)

    def alloc_extend(
        self,
        prefix_lens,
        prefix_lens_cpu,
        seq_lens,
        seq_lens_cpu,
        last_loc,
        extend_num_tokens,
    ):
        bs = len(prefix_lens)
        if (
            self.need_sort
            and extend_num_tokens // self.page_size + bs + 1 > len(self.free_pages)
        ):
            self.merge_and_sort_free()
        num_new_pages = get_num_new_pages(
            seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu
        )
        if num_new_pages > len(self.free_pages):
            return None
        out_indices = _extend_layout(
            _as_i64(prefix_lens, self.device),
            _as_i64(seq_lens, self.device),
            _as_i64(last_loc, self.device),
            self.free_pages[:num_new_pages],
            self.page_size,
            extend_num_tokens,
        )
        self.free_pages = self.free_pages[num_new_pages:]
        return out_indices

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        bs = len(seq_lens)
        if self.need_sort and bs > len(self.free_pages):
            self.merge_and_sort_free()
        num_new_pages = get_num_new_pages(
            seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True
        )
        if num_new_pages > len(self.free_pages):
            return None
        out_indices = _as_i64(last_loc, self.device) + 1
        if num_new_pages > 0:
            need_page = _as_i64(seq_lens, self.device) % self.page_size == 1
            slot = (torch.cumsum(need_page, 0) - 1).clamp_(min=0)
            out_indices = torch.where(
                need_page, self.free_pages[slot] * self.page_size, out_indices
            )
        self.free_pages = self.free_pages[num_new_pages:]
        return out_indices

    def free(self, free_index):
        if free_index.numel() == 0:
            return
        if self.is_not_in_free_group:
            self._release(torch.unique(free_index // self.page_size))
        else:
            self.free_group.append(free_index)

    def free_page_ids(self, page_ids):
        if page_ids.numel() == 0:
            return
        if self.is_not_in_free_group:
            self._release(page_ids)
        else:
            self.free_group_pages.append(page_ids)

    def free_segment(self, free_index, start_pos=0):
        # start_pos is page-aligned: every page_size-th index starts a page.
        self.free_page_ids(free_index[:: self.page_size] // self.page_size)
