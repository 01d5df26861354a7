"""Per-request sliding-window eviction during decode (SPEC.md section 5).

This is the loop a scheduler runs once per decode step without a batched
eviction kernel: for every request in the batch, in batch order, decide whether
the window has moved far enough past the request's evicted boundary and, if so,
free the SWA KV of the newly evicted page-aligned run with one
``free_swa_segment`` call. It only uses SGLang's method names, so it drives the
plain-torch baseline and the native ``swa_ext.SWATokenToKVPoolAllocator``
alike, and it is the reference the batched native eviction is compared with.
"""

from __future__ import annotations

from typing import List

import torch

from swa_ext._C import evicted_after_step  # the window rule of csrc/core/rules.h, not restated here

__all__ = ["evict_per_request"]


def _to_list(x) -> List[int]:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return [int(v) for v in x]


def evict_per_request(
    allocator,
    req_to_token: torch.Tensor,
    rows,
    pre_lens,
    evicted,
    window: int,
    page_size: int,
    interval: int = 1,
    prefix_sharing: bool = False,
) -> List[int]:
    """Evict the out-of-window SWA KV of each request of a decode batch.

    ``rows[j]`` is request ``j``'s row in ``req_to_token``, ``pre_lens[j]`` its
    committed length (``seq_len - 1`` in a decode step) and ``evicted[j]`` its
    current ``swa_evicted_seqlen`` (page-aligned). For each request that is due
    (``swa_ext.decode.evicted_after_step``, the native rule), in batch order, calls
    ``allocator.free_swa_segment(req_to_token[row, evicted:new], start_pos=evicted)``.
    Returns the new evicted boundaries, one per request; the inputs are not
    modified.
    """
    rows = _to_list(rows)
    pre_lens = _to_list(pre_lens)
    out = _to_list(evicted)
    for j, row in enumerate(rows):
        old = out[j]
        new = evicted_after_step(old, pre_lens[j], window, page_size, interval, prefix_sharing)
        if new > old:
            allocator.free_swa_segment(req_to_token[row, old:new], start_pos=old)
            out[j] = new
    return out
