"""The plain-torch hybrid full + SWA allocator (SGLang's ``SWATokenToKVPoolAllocator``),
on the single pools of ``baseline_pools``; how the baseline is written: its docstring."""

from __future__ import annotations

from typing import List

import torch

from .baseline_pools import BaselinePagedAllocator, BaselineTokenAllocator, _I64, get_num_new_pages

__all__ = ["BaselineSWAAllocator"]


class BaselineSWAAllocator:
    """Hybrid full + sliding-window allocator (SGLang's ``SWATokenToKVPoolAllocator``).

    ``full_attn_allocator`` (``size`` tokens) and ``swa_attn_allocator``
    (``size_swa`` tokens) are pools of the same kind and page size;
    ``full_to_swa_index_mapping[i]`` is the SWA index paired with full index
    ``i`` (0: none); its last element is a ``-1`` sentinel so that a
    ``last_loc`` of ``-1`` translates to ``-1``.

    ``dtype`` is kept as an attribute for signature compatibility (SGLang passes
    the KV dtype here); every index tensor is int64.
    """

    def __init__(
        self,
        size,
        size_swa,
        page_size,
        dtype=_I64,
        device="cpu",
        need_sort=False,
    ):
        self._size_full = size
        self._size_swa = size_swa
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        self.need_sort = need_sort
        if page_size == 1:
            self.full_attn_allocator = BaselineTokenAllocator(size, dtype, device, need_sort)
            self.swa_attn_allocator = BaselineTokenAllocator(size_swa, dtype, device, need_sort)
        else:
            self.full_attn_allocator = BaselinePagedAllocator(
                size, page_size, dtype, device, need_sort
            )
            self.swa_attn_allocator = BaselinePagedAllocator(
                size_swa, page_size, dtype, device, need_sort
            )
        self.full_to_swa_index_mapping = torch.zeros(
            size + page_size + 1, dtype=_I64, device=device
        )
        self.full_to_swa_index_mapping[-1] = -1
        self._pos_in_page = torch.arange(page_size, dtype=_I64, device=device)
        self.is_not_in_free_group = True
        self.swa_free_group_pages: List[torch.Tensor] = []
        self.swa_free_group_values: List[torch.Tensor] = []

    # ---------------------------------------------------------------- sizes
    @property
    def size(self):
        return min(self._size_full, self._size_swa)

    @property
    def size_full(self):
        return self._size_full

    @property
    def size_swa(self):
        return self._size_swa

    def available_size(self):
        return min(
            self.full_attn_allocator.available_size(),
            self.swa_attn_allocator.available_size(),
        )

    def full_available_size(self):
        return self.full_attn_allocator.available_size()

    def swa_available_size(self):
        return self.swa_attn_allocator.available_size()

    def new_pages_available(self, num_full_pages, num_swa_pages):
        ps = self.page_size
        return (
            num_full_pages <= self.full_attn_allocator.available_size() // ps
            and num_swa_pages <= self.swa_attn_allocator.available_size() // ps
        )

    # -------------------------------------------------------------- mapping
    def translate_loc_from_full_to_swa(self, kv_indices):
        return self.full_to_swa_index_mapping[kv_indices]

    def set_full_to_swa_mapping(self, full_indices, swa_indices):
        self.full_to_swa_index_mapping[full_indices] = swa_indices

    def clear_full_to_swa_mapping(self, full_indices):
        self.full_to_swa_index_mapping[full_indices] = 0

    def _page_tokens(self, indices):
        """Every token index of the pages the given token indices lie in."""
        ps = self.page_size
        return ((indices // ps * ps)[:, None] + self._pos_in_page).reshape(-1)

    # ---------------------------------------------------------------- alloc
    def alloc(self, need_size):
        if need_size > self.full_attn_allocator.available_size():
            return None
        if need_size > self.swa_attn_allocator.available_size():
            return None
        alloc_full_indices = self.full_attn_allocator.alloc(need_size)
        alloc_swa_indices = self.swa_attn_allocator.alloc(need_size)
        self.full_to_swa_index_mapping[alloc_full_indices] = alloc_swa_indices
        return alloc_full_indices

    def alloc_extend(
        self,
        prefix_lens,
        prefix_lens_cpu,
        seq_lens,
        seq_lens_cpu,
        last_loc,
        extend_num_tokens,
    ):
        if self.page_size == 1:
            return self.alloc(extend_num_tokens)
        num_new_pages = get_num_new_pages(
            seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu
        )
        if not self.new_pages_available(num_new_pages, num_new_pages):
            return None
        swa_last_loc = self.translate_loc_from_full_to_swa(last_loc)
        alloc_full_indices = self.full_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens
        )
        alloc_swa_indices = self.swa_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, swa_last_loc, extend_num_tokens
        )
        self.full_to_swa_index_mapping[alloc_full_indices] = alloc_swa_indices
        return alloc_full_indices

    def alloc_extend_swa_tail(
        self,
        prefix_lens,
        prefix_lens_cpu,
        seq_lens,
        seq_lens_cpu,
        last_loc,
        extend_num_tokens,
        swa_tail_len,
    ):
        """Full KV for the whole extend, SWA KV for its last ``swa_tail_len`` tokens."""
        ps = self.page_size
        mapping = self.full_to_swa_index_mapping
        if ps == 1:
            if extend_num_tokens > self.full_attn_allocator.available_size():
                return None
            if swa_tail_len > self.swa_attn_allocator.available_size():
                return None
            alloc_full_indices = self.full_attn_allocator.alloc(extend_num_tokens)
            alloc_swa_indices = self.swa_attn_allocator.alloc(swa_tail_len)
            n_head = extend_num_tokens - swa_tail_len
            mapping[alloc_full_indices[n_head:]] = alloc_swa_indices
            mapping[alloc_full_indices[:n_head]] = 0
            return alloc_full_indices

        num_full_pages = get_num_new_pages(
            seq_lens=seq_lens_cpu, page_size=ps, prefix_lens=prefix_lens_cpu
        )
        num_swa_pages = (swa_tail_len + ps - 1) // ps
        if not self.new_pages_available(num_full_pages, num_swa_pages):
            return None
        alloc_full_indices = self.full_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens
        )
        if swa_tail_len == 0:
            return alloc_full_indices
        zero = torch.zeros((1,), dtype=_I64)
        tail = torch.full((1,), swa_tail_len, dtype=_I64)
        alloc_swa_indices = self.swa_attn_allocator.alloc_extend(
            zero.to(self.device),
            zero,
            tail.to(self.device),
            tail,
            torch.full((1,), -1, dtype=_I64, device=self.device),
            swa_tail_len,
        )
        n_head = alloc_full_indices.numel() - swa_tail_len
        mapping[alloc_full_indices[n_head:]] = alloc_swa_indices
        mapping[alloc_full_indices[:n_head]] = 0
        return alloc_full_indices

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        ps = self.page_size
        if ps == 1:
            return self.alloc(len(seq_lens))
        # Atomic (SPEC.md section 4): check both pools before touching either.
        need = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=ps, decode=True)
        if not self.new_pages_available(need, need):
            return None
        swa_last_loc = self.translate_loc_from_full_to_swa(last_loc)
        alloc_full_indices = self.full_attn_allocator.alloc_decode(
            seq_lens, seq_lens_cpu, last_loc
        )
        alloc_swa_indices = self.swa_attn_allocator.alloc_decode(
            seq_lens, seq_lens_cpu, swa_last_loc
        )
        self.full_to_swa_index_mapping[alloc_full_indices] = alloc_swa_indices
        return alloc_full_indices

    # ----------------------------------------------------------------- free
    def free(self, free_index):
        if free_index.numel() == 0:
            return
        self.free_swa(free_index)
        self.free_full(free_index)

    def free_full(self, free_index):
        self.full_attn_allocator.free(free_index)

    def free_swa(self, free_index):
        if self.page_size == 1:
            self.free_swa_segment(free_index, 0)
            return
        if free_index.numel() == 0:
            return
        pages = torch.unique(free_index // self.page_size)
        tokens = (pages[:, None] * self.page_size + self._pos_in_page).reshape(-1)
        swa_indices = self.full_to_swa_index_mapping[tokens]
        self.full_to_swa_index_mapping[tokens] = 0
        swa_indices = swa_indices[swa_indices > 0]
        if self.is_not_in_free_group:
            self.swa_attn_allocator.free(swa_indices)
        else:
            self.swa_free_group_values.append(swa_indices)

    def free_segment(self, free_index, start_pos=0):
        self.free_swa_segment(free_index, start_pos)
        self.full_attn_allocator.free_segment(free_index, start_pos)

    def free_full_segment(self, free_index, start_pos=0):
        self.full_attn_allocator.free_segment(free_index, start_pos)

    def free_swa_segment(self, free_index, start_pos=0):
        """Free the SWA pages of a page-aligned run of full indices.

        The representatives ``free_index[::page_size]`` must all be mapped.
        """
        ps = self.page_size
        if free_index.numel() == 0:
            return
        mapping = self.full_to_swa_index_mapping
        if ps == 1:
            swa_pages = mapping[free_index]
            mapping[free_index] = 0
        else:
            reps = free_index[::ps]
            swa_pages = mapping[reps] // ps
            mapping[self._page_tokens(reps)] = 0
        if self.is_not_in_free_group:
            self.swa_attn_allocator.free_page_ids(swa_pages)
        else:
            self.swa_free_group_pages.append(swa_pages)

    def free_group_begin(self):
        self.is_not_in_free_group = False
        self.swa_free_group_pages = []
        self.swa_free_group_values = []
        self.full_attn_allocator.free_group_begin()

    def free_group_end(self):
        self.is_not_in_free_group = True
        if self.swa_free_group_pages:
            self.swa_attn_allocator.free_page_ids(torch.cat(self.swa_free_group_pages))
        if self.swa_free_group_values:
            values = torch.cat(self.swa_free_group_values)
            self.swa_attn_allocator.free(values[values > 0])
        self.swa_free_group_pages = []
        self.swa_free_group_values = []
        self.full_attn_allocator.free_group_end()

    # ---------------------------------------------------------------- state
    def clear(self):
        self.full_attn_allocator.clear()
        self.swa_attn_allocator.clear()
        self.full_to_swa_index_mapping.fill_(0)
        self.full_to_swa_index_mapping[-1] = -1
        self.is_not_in_free_group = True
        self.swa_free_group_pages = []
        self.swa_free_group_values = []

    def backup_state(self):
        """Snapshot of both pools and the mapping (the mapping is copied)."""
        return (
            self.full_attn_allocator.backup_state(),
            self.swa_attn_allocator.backup_state(),
            self.full_to_swa_index_mapping.clone(),
        )

    def restore_state(self, state):
        full_state, swa_state, mapping = state
        self.full_attn_allocator.restore_state(full_state)
        self.swa_attn_allocator.restore_state(swa_state)
        self.full_to_swa_index_mapping.copy_(mapping)
