"""SGLang's own PD-decode functions on swa_ext through the adapter, in lockstep with
SGLang's allocator: the window-tail preallocation (alloc_for_decode_prealloc), the
out-of-window SWA frees of each decode step inside a free group
(free_swa_out_of_window_slots) and the release at the end (free_kv_row_segments)."""
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.disaggregation.decode import alloc_for_decode_prealloc
from sglang.srt.managers.schedule_batch import ReqKvInfo
from sglang.srt.mem_cache.common import free_kv_row_segments, free_swa_out_of_window_slots
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

import swa_ext
import swa_ext.sglang as adapter
from conftest import RecordingSWAKVCache, t

WINDOW = 64


@pytest.mark.parametrize("page_size", [16, 64])
def test_decode_node_lifecycle_in_lockstep(page_size):
    alloc = adapter.LockstepSWATokenToKVPoolAllocator(4096, 1024, page_size, torch.float16, "cpu",
                                                      RecordingSWAKVCache(), True)  # need_sort: a PD node's
    req_to_token = torch.zeros((4, 1024), dtype=torch.int32)
    pool = SimpleNamespace(req_to_token=req_to_token)
    prompts = [300, 129, 64, 520]
    reqs = []
    for row, prompt in enumerate(prompts):
        req = SimpleNamespace(kv=ReqKvInfo(req_pool_idx=row))
        uses_tail = row != 2  # one request preallocates the whole prompt on both pools
        tail = swa_ext._C.swa_tail_len(prompt, WINDOW, page_size) if uses_tail else prompt
        loc = alloc_for_decode_prealloc(alloc, req=req, fill_len=prompt, delta_len=prompt, prefix_len=0,
                                        total_prefix_len=0, prefix_indices=None, uses_swa_tail=uses_tail,
                                        swa_tail_len=tail)
        assert loc is not None and loc.numel() == prompt
        req_to_token[row, :prompt] = loc.to(torch.int32)
        assert req.kv.get_evicted_seqlen(ComponentType.SWA) == (prompt - tail if uses_tail else 0)
        reqs.append(req)
    lens = list(prompts)
    for step in range(150):
        last = t([int(req_to_token[r, n - 1]) for r, n in enumerate(lens)])
        seq = t([n + 1 for n in lens])
        out = alloc.alloc_decode(seq, seq, last)
        assert out is not None
        alloc.free_group_begin()
        for r, req in enumerate(reqs):
            req_to_token[r, lens[r]] = int(out[r])
            free_swa_out_of_window_slots(req, lens[r], sliding_window_size=WINDOW, page_size=page_size,
                                         req_to_token_pool=pool, token_to_kv_pool_allocator=alloc,
                                         supports_prefix_sharing=False)
            lens[r] += 1
        alloc.free_group_end()
    swa_held = 0
    for r, req in enumerate(reqs):
        evicted = req.kv.get_evicted_seqlen(ComponentType.SWA)
        assert evicted >= lens[r] - WINDOW - 2 * page_size  # the window moved with decoding
        swa_held += -(-(lens[r] - evicted) // page_size) * page_size
    assert alloc.size_swa - alloc.swa_available_size() == swa_held
    for r, req in enumerate(reqs):
        row = req_to_token[r, :lens[r]].to(torch.int64)
        free_kv_row_segments(alloc, [(row, 0)], swa_evicted_seqlen=req.kv.get_evicted_seqlen(ComponentType.SWA),
                             swa_dead_lo=req.kv.swa_dead_lo(page_size))
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (4096, 1024)
    counts = alloc.lockstep_counts
    assert counts["alloc_extend_swa_tail"] == 3 and counts["alloc_extend"] == 1 and counts["alloc_decode"] == 150
    assert counts["free_swa_segment"] > 0 and counts["free_full_segment"] == 4 and counts["free_segment"] == 4
