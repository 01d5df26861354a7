"""swa_ext's shared mode as SGLang's hybrid allocator: one budget of pages for full and
SWA KV (``SWA_EXT_SGLANG=shared``; docs/sglang.md).

SGLang's scheduler asks its allocator whether work fits through a few capacity gates
(``mem_cache/allocator/base.py``): the prefill adder's budget, the PD decode node's
preallocation (``prealloc_fits`` and its reclaim), the decode step's
``check_decode_capacity`` (which ``retract_decode`` converges on), the eviction before
an allocation and the clip of a request's new tokens. Its two-pool allocator answers
each side against its own pool. Here both sides draw on one free list, so every gate
prices the full pages and the SWA pages of a demand together against the one free count
(what the tree cache could give back included), in one native call
(``reservation_fits``, SPEC.md section 8), as SGLang's unified allocator does for
its byte envelope: what SGLang admits then allocates, and what does not fit waits or is
retracted the way SGLang does it.
"""
from __future__ import annotations

import math

import torch
from sglang.srt import runtime_context
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.prefill_budget import SharedSWAPrefillBudget, estimate_swa_kv_tokens

from .adapters import SWATokenToKVPoolAllocator


def _on_a_pd_decode_node():
    """Whether this process's engine is a PD decode node, by the server arguments SGLang
    published (none outside an engine: not one)."""
    try:
        return runtime_context.get_server_args().disaggregation_mode == "decode"
    except ValueError:  # "Global server args is not set yet!"
        return False


class SharedSWATokenToKVPoolAllocator(SWATokenToKVPoolAllocator):
    """swa_ext's hybrid allocator in its shared mode (one free list of parent pages, laid out
    as its KV pool's storage: SPEC.md 8.1; at ``parent_k`` 1 ``size == size_swa``, one slot
    index space), as SGLang's ``SWATokenToKVPoolAllocator``, with the scheduler's capacity
    gates priced against the one budget by the native ``reservation_fits``: a demand of
    ``f`` full and ``s`` SWA tokens takes the parents of ceil(f / page) full and
    ceil(s / page) SWA pages."""

    @staticmethod
    def _page_layout(kvcache):
        """One list of parent pages, as the KV pool lays out its one storage
        (shared_pool.SharedSWAKVPool): ``parent_k`` pages of its ``small_side`` or one page
        of the other side to a parent."""
        return {"shared": True, "parent_k": kvcache.parent_k, "small_side": kvcache.small_side}

    def _reclaim(self, tree_cache, full_tokens, swa_tokens):
        """Evicts from the tree cache until ``full_tokens`` and ``swa_tokens`` fit or nothing
        evictable is left: full leaves first (each one's SWA goes with it), then SWA alone,
        as SGLang's tree evicts; both return pages to the one list. The tree counts in
        tokens: it is asked for what the one list lacks (SGLang asks in whole pages)."""
        if self.reservation_fits(full_tokens, swa_tokens):
            return
        if tree_cache is not None and tree_cache.supports_prefix_sharing():
            shortfall = max(full_tokens + swa_tokens - self.available_size(), self.page_size)
            tree_cache.evict_for_alloc(EvictParams(num_tokens=shortfall, swa_num_tokens=shortfall))

    # -- the scheduler's capacity gates --

    def can_reserve(self, full_tokens, swa_tokens, *, full_evictable_tokens=0, swa_evictable_tokens=0,
                    empty_pool=False, require_token_slack=False):
        """Whether ``full_tokens`` full and ``swa_tokens`` SWA tokens fit the one budget
        (``reservation_fits``, which prices it): the free pages and what the tree could
        give back, or (``empty_pool``) the whole budget; ``require_token_slack`` keeps
        SGLang's one token to spare. A negative demand does not fit, as in SGLang. The
        scheduler's prefill budget passes estimates scaled by its new-token ratio: a part
        of a token takes a whole slot (math.ceil, as SGLang's unified allocator prices it)."""
        if full_tokens < 0 or swa_tokens < 0:
            return False
        full_tokens, swa_tokens = math.ceil(full_tokens), math.ceil(swa_tokens)
        return self.reservation_fits(full_tokens, swa_tokens, full_evictable_tokens=full_evictable_tokens,
                                     swa_evictable_tokens=swa_evictable_tokens, empty_pool=empty_pool,
                                     require_token_slack=require_token_slack)

    def create_prefill_budget(self, tree_cache, *, num_mixed_decode_tokens=0):
        """SGLang's budget for one pool shared by both sides: it prices each admission's
        full and SWA reservations together through ``can_reserve``."""
        return SharedSWAPrefillBudget(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def evict_to_free_tokens(self, tree_cache, num_tokens):
        """Before an allocation of ``num_tokens`` on each side: room for both, from one list."""
        self._reclaim(tree_cache, num_tokens, num_tokens)

    def check_decode_capacity(self, *, num_tokens, tree_cache, requests=None, spec_algorithm=None):
        """The next decode step takes ``num_tokens`` on each side (a page of each for every
        request that crosses a page): both from the one list, after evicting for them."""
        self.evict_to_free_tokens(tree_cache, num_tokens)
        return self.reservation_fits(num_tokens, num_tokens)

    def max_new_tokens_for_memory(self, input_tokens, max_new_tokens, *, token_capacity, sliding_window_size,
                                  chunk_size):
        """SGLang's clip on the one budget: the most new tokens whose full KV and SWA peak
        (estimated as SGLang's admission estimates it) fit the empty pool; None if the
        prompt alone does not."""
        # What of the prompt the SWA side takes at once: a prefill's chunk; a PD decode
        # node's preallocation (alloc_extend_swa_tail, pages > 1) the window tail only.
        swa_prompt_limit = 0 if self.page_size > 1 and _on_a_pd_decode_node() else chunk_size

        def fits(new_tokens):
            swa = estimate_swa_kv_tokens(input_tokens, new_tokens, sliding_window_size=sliding_window_size,
                                         page_size=self.page_size, allocation_limit=swa_prompt_limit)
            return self.can_reserve(input_tokens + new_tokens + self.page_size, swa, empty_pool=True,
                                    require_token_slack=True)

        cap = super().max_new_tokens_for_memory(input_tokens, max_new_tokens, token_capacity=token_capacity,
                                                sliding_window_size=sliding_window_size, chunk_size=chunk_size)
        if not fits(0):
            return None
        low, high = 0, cap  # fits(low); the answer is in [low, high]
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits(middle) else (low, middle - 1)
        return low

    # -- the PD decode node's preallocation --

    def prealloc_fits_assumes_reclaim(self):
        """``prealloc_fits`` counts what the tree could give back: the node reclaims it
        (``reclaim_for_prealloc``) before it preallocates."""
        return True

    def prealloc_ceiling_fits(self, full_tokens, swa_tokens):
        return self.can_reserve(full_tokens, swa_tokens, empty_pool=True)

    def prealloc_fits(self, tree_cache, full_tokens, swa_tokens, *, full_budget_tokens, swa_budget_tokens=None):
        """The node's per-side budgets are the free count (and what the tree could give
        back) less what each side keeps for running requests (reserved decode tokens,
        retracted requests, one request's headroom): those reserves join the demand, and
        the whole prices against the one budget."""
        full_evictable, swa_evictable = tree_cache.full_evictable_size(), tree_cache.swa_evictable_size()
        full_tokens += self.full_available_size() + full_evictable - full_budget_tokens
        if swa_budget_tokens is not None:
            swa_tokens += self.swa_available_size() + swa_evictable - swa_budget_tokens
        return self.can_reserve(full_tokens, swa_tokens, full_evictable_tokens=full_evictable,
                                swa_evictable_tokens=swa_evictable)

    def reclaim_for_prealloc(self, tree_cache, full_tokens, swa_tokens):
        """Frees room for a preallocation of ``full_tokens`` and ``swa_tokens``: None when
        it is there, else what is missing (the node attaches it to the request)."""
        self._reclaim(tree_cache, full_tokens, swa_tokens)
        if not self.reservation_fits(full_tokens, swa_tokens):
            return (f"swa_ext shared budget: needed {full_tokens + swa_tokens} tokens ({full_tokens} full, "
                    f"{swa_tokens} SWA), available {self.available_size()}")
        return None

    # -- what the scheduler reads of each side --

    def swa_capacity_and_available(self, *, full_capacity, swa_capacity):
        """Each side's capacity is what it holds plus the free pages both may take, so
        SGLang's conservation check (free + cached + held == capacity) holds on each side.
        What each side holds is the allocator's count (an open free group's pages
        included), kept as pages are taken and released: no scan of the mapping."""
        full_free, swa_free = self.full_available_size(), self.swa_available_size()
        return (self.full_used_size() + full_free, full_free), (self.swa_used_size() + swa_free, swa_free)


class SlotKindCollision(RuntimeError):
    """A slot in use as a full slot and as an SWA slot at once (found under SWA_EXT_DEBUG=1)."""


def check_slot_kinds(batch):
    """Whether every slot of the shared mode's one storage holds one kind of KV, as the
    engine sees it before a step allocates: the SWA slots in use (the mapping's entries)
    are distinct and none is in use as a full slot (one the mapping maps from, or one of a
    batch request's rows in req_to_token). At ``parent_k`` k > 1 a large-side slot ``j``
    shares its bytes with small-side slots ``j * k .. j * k + k - 1`` (shared_pool's
    layout), so a slot is in use as a full slot where its bytes are. Raises
    ``SlotKindCollision`` naming the SWA slots. O(slots): a debugging check
    (SWA_EXT_DEBUG=1), run by the scheduler hook each step."""
    alloc = batch.token_to_kv_pool_allocator
    mapping = alloc.full_to_swa_index_mapping.cpu()
    held = mapping > 0
    swa_slots = mapping[held]
    rows = [batch.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :req.kv.kv_allocated_len].cpu()
            for req in batch.reqs if req.kv.req_pool_idx is not None]
    full_slots = torch.cat([held.nonzero().flatten()] + rows)
    unique, counts = swa_slots.unique(return_counts=True)
    twice = unique[counts > 1]
    # Each side's slots as the large side's slots whose bytes they take.
    k = alloc.parent_k
    full_bytes, swa_bytes = (full_slots // k, swa_slots) if alloc.small_side == "full" else (full_slots, swa_slots // k)
    both = swa_slots[torch.isin(swa_bytes, full_bytes)].unique()
    if twice.numel() or both.numel():
        raise SlotKindCollision(
            f"swa_ext: slots hold two kinds of KV at once (SWA_EXT_DEBUG=1): SWA slots in use as full slots "
            f"{both[:16].tolist()} ({both.numel()} in all), SWA slots mapped from two full slots "
            f"{twice[:16].tolist()} ({twice.numel()} in all)")
