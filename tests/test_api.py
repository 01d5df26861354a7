"""The SGLang-facing surface that the traces do not exercise: attributes, kvcache
registration, the pool views and their sharing of the hybrid allocator's state."""
import torch

import swa_ext


class RecordingKVCache:
    def __init__(self):
        self.registered = []

    def register_mapping(self, mapping):
        self.registered.append(mapping)


def make(page_size=4, **kwargs):
    return swa_ext.SWATokenToKVPoolAllocator(64 * page_size, 32 * page_size, page_size, torch.bfloat16, "cpu", **kwargs)


def test_mapping_is_registered_with_the_kvcache_and_stays_the_same_tensor():
    cache = RecordingKVCache()
    alloc = make(kvcache=cache)
    assert alloc.get_kvcache() is cache
    assert cache.registered == [alloc.full_to_swa_index_mapping]
    mapping = alloc.full_to_swa_index_mapping
    assert mapping.dtype == torch.int64 and mapping.numel() == 64 * 4 + 4 + 1 and int(mapping[-1]) == -1
    out = alloc.alloc_extend(torch.tensor([0]), torch.tensor([0]), torch.tensor([6]), torch.tensor([6]),
                             torch.tensor([-1]), 6)
    assert alloc.full_to_swa_index_mapping is mapping
    assert (cache.registered[0][out] > 0).all()  # the registered tensor sees the allocator's writes
    alloc.clear()
    assert alloc.full_to_swa_index_mapping is mapping and int(mapping[:-1].abs().sum()) == 0


def test_attributes_follow_sglang():
    alloc = make(page_size=16, need_sort=True)
    assert (alloc.page_size, alloc.size, alloc.size_full, alloc.size_swa) == (16, 512, 1024, 512)
    assert alloc.need_sort and alloc.dtype is torch.bfloat16 and alloc.device == torch.device("cpu")
    assert isinstance(alloc.full_attn_allocator, swa_ext.PagedTokenToKVPoolAllocator)
    assert isinstance(make(page_size=1).swa_attn_allocator, swa_ext.TokenToKVPoolAllocator)
    assert "full:" in alloc.debug_print() and "swa:" in alloc.debug_print()


def test_pool_views_share_the_hybrid_state():
    alloc = make()
    full = alloc.full_attn_allocator
    taken = full.alloc(8)  # straight from the full pool, as an engine may do
    assert alloc.full_available_size() == 64 * 4 - 8
    assert full.free_pages[:2].tolist() == [3, 4]
    full.free(taken)
    assert alloc.full_available_size() == 64 * 4
    assert alloc.backup_state() == make().backup_state()


def test_standalone_pools():
    paged = swa_ext.PagedTokenToKVPoolAllocator(64, 4, torch.bfloat16, "cpu")
    out = paged.alloc_extend(torch.tensor([0]), torch.tensor([0]), torch.tensor([5]), torch.tensor([5]),
                             torch.tensor([-1]), 5, num_new_pages=2)
    assert out.tolist() == [4, 5, 6, 7, 8]
    token = swa_ext.TokenToKVPoolAllocator(8, torch.bfloat16, "cpu", need_sort=True)
    first = token.alloc(3)
    token.free(first[:1])
    assert token.release_pages.tolist() == [1] and token.available_size() == 6
