"""The decode-side KV lifecycle of a prefill/decode-disaggregated deployment (SPEC.md section 5).

A decode node receives requests whose prompt KV was computed by a prefill node.
Full-attention layers need the KV of every token, sliding-window layers only the
window. The functions here are what a serving engine calls at each stage of a
request's life on such a node:

- ``pre_alloc``: before the KV transfer, full slots for the whole prompt and SWA
  slots for its window tail only; the request records the page-aligned
  ``swa_evicted_seqlen`` below which it has no SWA KV;
- ``evict_out_of_window``: every decode step, for the whole running batch in one
  native call, free the SWA pages that slid out of the window;
- ``release``: when the request finishes (or is retracted), free what it holds.

There is no hidden state: the allocator, the ``req_to_token`` table and each
request's lengths are the caller's. The rules themselves (tail length, eviction
point) live once, in the native core (csrc/core/rules.h).
"""
from __future__ import annotations

import operator

import torch

from . import _C

__all__ = ["ReqToTokenPool", "evict_out_of_window", "evicted_after_step", "pre_alloc", "release", "swa_tail_len"]

_INDEX_DTYPES = (torch.int32, torch.int64)


def _int(value, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None


def swa_tail_len(seq_len: int, window: int, page_size: int, radix_cache: bool = False) -> int:
    """How many trailing tokens of a ``seq_len``-token prompt need SWA KV on the decode node.

    The tail starts on a page boundary, so ``seq_len - tail`` (the evicted length) is
    page-aligned; with the decode radix cache on it keeps a whole window behind the
    page-aligned insert boundary. 0 for ``seq_len <= 0``. ``window`` and ``page_size``
    must be >= 1 (``ValueError``).
    """
    # Types here (a bool or a float is no length); values in the native call.
    return _C.swa_tail_len(_int(seq_len, "seq_len"), _int(window, "window"), _int(page_size, "page_size"),
                           bool(radix_cache))


def evicted_after_step(evicted: int, pre_len: int, window: int, page_size: int, interval: int = 1,
                       prefix_sharing: bool = False) -> int:
    """The window rule for one request: its new evicted length at committed length ``pre_len``.

    Equal to ``evicted`` when nothing is due; otherwise page-aligned and larger, and
    ``row[evicted:new]`` is what ``evict_out_of_window`` frees for it. ``window``,
    ``page_size`` and ``interval`` must be >= 1, and ``evicted`` page-aligned within
    ``[0, pre_len]`` (``ValueError``).
    """
    return _C.evicted_after_step(_int(evicted, "evicted"), _int(pre_len, "pre_len"), _int(window, "window"),
                                 _int(page_size, "page_size"), _int(interval, "interval"), bool(prefix_sharing))


class ReqToTokenPool:
    """The per-request row table: row ``r`` of ``req_to_token`` holds request r's KV slots.

    As SGLang's ``ReqToTokenPool``: ``req_to_token`` is a ``[max_reqs, max_context_len]``
    tensor (int32 unless ``dtype`` says int64) on ``device``, all 0 at first; rows are
    handed out from the head of ``free_slots`` (``alloc``) and returned to its tail
    (``free``). Entry ``req_to_token[r, i]`` is the full-pool slot of token ``i`` of the
    request in row r; 0 (the padding slot, never handed out) means none: ``pre_alloc``
    takes only a row that is all 0, and ``release`` sets it back to 0.
    """

    def __init__(self, max_reqs: int, max_context_len: int, device="cpu", dtype: torch.dtype = torch.int32):
        max_reqs = _int(max_reqs, "max_reqs")
        max_context_len = _int(max_context_len, "max_context_len")
        if max_reqs < 1:
            raise ValueError(f"max_reqs: must be >= 1, got {max_reqs}")
        if max_context_len < 1:
            raise ValueError(f"max_context_len: must be >= 1, got {max_context_len}")
        if dtype not in _INDEX_DTYPES:
            raise TypeError(f"dtype: expected torch.int32 or torch.int64, got {dtype}")
        self.size = max_reqs
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((max_reqs, max_context_len), dtype=dtype, device=self.device)
        self.free_slots = list(range(max_reqs))
        self._held = [False] * max_reqs

    def available_size(self) -> int:
        """How many rows are free."""
        return len(self.free_slots)

    def alloc(self, need_size: int = 1):
        """``need_size`` row ids, or None (nothing taken) when fewer are free."""
        need_size = _int(need_size, "need_size")
        if need_size < 0:
            raise ValueError(f"need_size: must be >= 0, got {need_size}")
        if need_size > len(self.free_slots):
            return None
        rows = self.free_slots[:need_size]
        del self.free_slots[:need_size]
        for row in rows:
            self._held[row] = True
        return rows

    def free(self, row) -> None:
        """Return one row id, or a list of them; all are checked before any is returned."""
        rows = [row] if not isinstance(row, (list, tuple)) else list(row)
        rows = [_int(r, "row") for r in rows]
        for r in rows:
            if not 0 <= r < self.size:
                raise ValueError(f"row: {r} is outside [0, {self.size})")
            if not self._held[r]:
                raise ValueError(f"row: {r} is not allocated")
        if len(set(rows)) != len(rows):
            raise ValueError("row: a row id is given twice")
        for r in rows:
            self._held[r] = False
        self.free_slots.extend(rows)

    def clear(self) -> None:
        """Every row free and empty (all 0), as after construction: for a cleared allocator."""
        self.req_to_token.zero_()
        self.free_slots = list(range(self.size))
        self._held = [False] * self.size


def _check_table(allocator, req_to_token) -> None:
    if not isinstance(req_to_token, torch.Tensor):
        raise TypeError(f"req_to_token: expected a torch.Tensor, got {type(req_to_token).__name__}")
    if req_to_token.dtype not in _INDEX_DTYPES:
        raise TypeError(f"req_to_token: expected an int32 or int64 tensor, got {req_to_token.dtype}")
    if req_to_token.dim() != 2:
        raise ValueError(f"req_to_token: expected a 2-D tensor, got {req_to_token.dim()}-D")
    if req_to_token.device != allocator.device:
        raise TypeError(f"req_to_token: expected a tensor on {allocator.device}, got one on {req_to_token.device}")


def _row(req_to_token, row) -> int:
    row = _int(row, "row")
    if not 0 <= row < req_to_token.shape[0]:
        raise ValueError(f"row: {row} is outside [0, {req_to_token.shape[0]})")
    return row


def pre_alloc(allocator, req_to_token, row, fill_len, window, *, prefix_indices=None, radix_cache=False):
    """Preallocate the KV of one prefilled request of ``fill_len`` tokens (SGLang's decode ``_pre_alloc``).

    Full slots for ``[prefix_len, fill_len)`` and SWA slots only for the window tail
    (``swa_tail_len``), via ``alloc_extend_swa_tail``; the slots (the prefix's, then
    the new ones) are written into ``req_to_token[row, :fill_len]``.

    ``prefix_indices``, when given, are the full slots of a prefix the request already
    holds (a radix-cache hit): page-aligned length, ending at or before the tail.

    ``req_to_token[row]`` must be all 0: a row still holding a request's slots (one not
    yet ``release``d) is refused with ValueError, since allocating over it would lose
    those slots and free the new ones a second time at that request's release. On a
    CUDA table this check reads one value back from the GPU.

    Returns ``(kv_indices, swa_evicted_seqlen)``: the newly allocated full slots and
    ``fill_len - tail``; or None, with nothing changed, when the pools cannot hold it.
    """
    _check_table(allocator, req_to_token)
    row = _row(req_to_token, row)
    fill_len = _int(fill_len, "fill_len")
    if not 1 <= fill_len <= req_to_token.shape[1]:
        raise ValueError(f"fill_len: {fill_len} is outside [1, {req_to_token.shape[1]}] (the row length)")
    page_size = allocator.page_size
    tail = _C.swa_tail_len(fill_len, _int(window, "window"), page_size, bool(radix_cache))
    device = allocator.device

    if prefix_indices is None:
        prefix_len = 0
    else:
        if not isinstance(prefix_indices, torch.Tensor):
            raise TypeError(f"prefix_indices: expected a torch.Tensor, got {type(prefix_indices).__name__}")
        if prefix_indices.dtype not in _INDEX_DTYPES:
            raise TypeError(f"prefix_indices: expected an int32 or int64 tensor, got {prefix_indices.dtype}")
        if prefix_indices.device != device:
            raise TypeError(f"prefix_indices: expected a tensor on {device}, got one on {prefix_indices.device}")
        if prefix_indices.dim() != 1:
            raise ValueError(f"prefix_indices: expected a 1-D tensor, got {prefix_indices.dim()}-D")
        prefix_len = prefix_indices.shape[0]
        if prefix_len % page_size:
            raise ValueError(f"prefix_indices: length {prefix_len} is not a multiple of the page size {page_size}")
        if prefix_len > fill_len - tail:
            raise ValueError(f"prefix_indices: length {prefix_len} reaches into the SWA tail "
                             f"[{fill_len - tail}, {fill_len}) of a {fill_len}-token request")
    slots = req_to_token[row]
    if bool(slots.any()):
        raise ValueError(f"row: req_to_token[{row}] still holds slots (not all 0): release its request first, "
                         f"or zero the row if its slots were freed another way")

    # The lengths as 1-element int64 tensors: on the device, with CPU copies (the same
    # tensors when the allocator is on the CPU).
    prefix_lens_cpu = torch.full((1,), prefix_len, dtype=torch.int64)
    seq_lens_cpu = torch.full((1,), fill_len, dtype=torch.int64)
    if device.type == "cpu":
        prefix_lens, seq_lens = prefix_lens_cpu, seq_lens_cpu
    else:
        prefix_lens = prefix_lens_cpu.to(device, non_blocking=True)
        seq_lens = seq_lens_cpu.to(device, non_blocking=True)
    if prefix_len:
        last_loc = prefix_indices[-1:]
    else:
        last_loc = torch.full((1,), -1, dtype=torch.int64, device=device)

    kv_indices = allocator.alloc_extend_swa_tail(
        prefix_lens=prefix_lens, prefix_lens_cpu=prefix_lens_cpu, seq_lens=seq_lens, seq_lens_cpu=seq_lens_cpu,
        last_loc=last_loc, extend_num_tokens=fill_len - prefix_len, swa_tail_len=tail)
    if kv_indices is None:
        return None
    if prefix_len:
        slots[:prefix_len] = prefix_indices
    slots[prefix_len:fill_len] = kv_indices
    return kv_indices, fill_len - tail


# Every decode step calls it, so it is the native function itself (docstring: help()); it
# takes lists as well as CPU tensors and checks every argument.
evict_out_of_window = _C.evict_out_of_window


def release(allocator, req_to_token, row, seq_len, swa_evicted_seqlen, prefix_len=0) -> None:
    """Free the KV of a finished (or retracted) request holding ``seq_len`` slots in ``row``.

    ``[prefix_len, swa_evicted_seqlen)`` has no SWA KV left and is freed on the full
    side only; ``[swa_evicted_seqlen, seq_len)`` on both sides. The first
    ``prefix_len`` slots (a shared prefix) are the caller's to keep. Then
    ``req_to_token[row, :seq_len]`` is set to 0, the prefix's entries too (read the row
    before, to insert it into a prefix cache say), so that ``pre_alloc`` can take the row
    again. The row itself goes back to its ``ReqToTokenPool`` separately.

    A row that holds no slots there (all 0: released already) is refused with ValueError
    naming the row, and nothing is freed. A CUDA allocator without ``SWA_EXT_DEBUG=1``
    finds that on the device: it raises DeferredError later, naming the padding slot.
    """
    _check_table(allocator, req_to_token)
    row = _row(req_to_token, row)
    seq_len = _int(seq_len, "seq_len")
    evicted = _int(swa_evicted_seqlen, "swa_evicted_seqlen")
    prefix_len = _int(prefix_len, "prefix_len")
    page_size = allocator.page_size
    if not 0 <= seq_len <= req_to_token.shape[1]:
        raise ValueError(f"seq_len: {seq_len} is outside [0, {req_to_token.shape[1]}] (the row length)")
    if prefix_len < 0 or prefix_len % page_size:
        raise ValueError(f"prefix_len: must be a non-negative multiple of the page size {page_size}, got {prefix_len}")
    if not prefix_len <= evicted <= seq_len or evicted % page_size:
        raise ValueError(f"swa_evicted_seqlen: must be page-aligned and within [prefix_len = {prefix_len}, "
                         f"seq_len = {seq_len}], got {evicted}")
    slots = req_to_token[row]
    try:
        # Both-sided part first: a stale evicted length (SWA pages already gone) is refused
        # there before anything is freed.
        if seq_len > evicted:
            allocator.free_segment(slots[evicted:seq_len], start_pos=evicted)
        if evicted > prefix_len:
            allocator.free_full_segment(slots[prefix_len:evicted], start_pos=prefix_len)
    except ValueError:
        # The native call names only the padding slot 0 it was handed; a row of 0s is a
        # request released already (the row is read only here, so a release costs no read).
        if not bool(slots[prefix_len:seq_len].any()):
            raise ValueError(f"row: req_to_token[{row}] holds no slots in [{prefix_len}, {seq_len}) (all 0): "
                             f"its request was released already, or the row never held one") from None
        raise
    slots[:seq_len] = 0
