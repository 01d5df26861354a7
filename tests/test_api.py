"""The SGLang-facing surface that the traces do not exercise: attributes, kvcache
registration, the pool views and their sharing of the hybrid allocator's state."""
import re

import pytest
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


def run_calls(alloc):
    """A few allocations and frees; their results, for comparing two allocators."""
    out = [alloc.alloc_extend(torch.tensor([0, 0]), torch.tensor([0, 0]), torch.tensor([6, 9]), torch.tensor([6, 9]),
                              torch.tensor([-1, -1]), 15)]
    out.append(alloc.alloc(2 * alloc.page_size))
    alloc.free(out[0][:6])
    out.append(alloc.alloc(4 * alloc.page_size))
    return [t.tolist() for t in out] + [alloc.full_available_size(), alloc.swa_available_size(),
                                        alloc.translate_loc_from_full_to_swa(out[-1]).tolist()]


@pytest.mark.parametrize("kernels", ["auto", "emulated"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_resize_clears_at_the_new_sizes_and_keeps_the_mapping_tensor(page_size, kernels):
    cache = RecordingKVCache()
    alloc = make(page_size, kvcache=cache, kernels=kernels)
    mapping = alloc.full_to_swa_index_mapping
    run_calls(alloc)
    alloc.resize(24 * page_size, 20 * page_size)
    assert (alloc.size_full, alloc.size_swa) == (24 * page_size, 20 * page_size)
    assert alloc.full_to_swa_index_mapping is mapping and mapping.numel() == 64 * page_size + page_size + 1
    assert int(mapping[:-1].abs().sum()) == 0 and int(mapping[-1]) == -1
    fresh = swa_ext.SWATokenToKVPoolAllocator(24 * page_size, 20 * page_size, page_size, torch.bfloat16, "cpu",
                                              kernels=kernels)
    assert run_calls(alloc) == run_calls(fresh)
    assert alloc.alloc(16 * page_size) is None  # fewer than 16 pages of the 20-page SWA pool are left
    alloc.check_invariants()


@pytest.mark.parametrize("kernels", ["auto", "emulated"])
def test_resize_refuses_growth_and_empty_pools_changing_nothing(kernels):
    alloc = make(4, kernels=kernels)
    run_calls(alloc)
    before = alloc.backup_state()
    for args, name in [((65 * 4, 32 * 4), "size"), ((64 * 4, 33 * 4), "size_swa"), ((3, 32 * 4), "size"),
                       ((64 * 4, 0), "size_swa")]:
        with pytest.raises(ValueError, match=f"^{name}: "):
            alloc.resize(*args)
        assert alloc.backup_state() == before
    alloc.resize(32 * 4, 32 * 4)
    alloc.resize(64 * 4, 32 * 4)  # back up to the size it was built with
    assert alloc.available_size() == 32 * 4


@pytest.mark.parametrize("kernels", ["auto", "emulated"])
def test_standalone_pool_resize(kernels):
    pool = swa_ext.PagedTokenToKVPoolAllocator(64, 4, torch.bfloat16, "cpu", kernels=kernels)
    pool.alloc(12)
    pool.resize(32)
    assert (pool.size, pool.num_pages, pool.available_size()) == (32, 8, 32)
    assert pool.alloc(8).tolist() == list(range(4, 12))
    with pytest.raises(ValueError, match="^size: "):
        pool.resize(68)
    assert pool.available_size() == 24


@pytest.mark.parametrize("kernels", ["auto", "cpu", "emulated"])
def test_kernels_argument_takes_the_values_the_property_reports(kernels):
    alloc = swa_ext.SWATokenToKVPoolAllocator(64, 64, 4, torch.bfloat16, "cpu", kernels=kernels)
    assert alloc.kernels == ("cpu" if kernels == "auto" else kernels)
    again = swa_ext.SWATokenToKVPoolAllocator(64, 64, 4, torch.bfloat16, "cpu", kernels=alloc.kernels)
    assert again.kernels == alloc.kernels


@pytest.mark.parametrize("kernels, message", [
    ("cuda", "kernels: 'cuda' runs on device='cuda' only"),
    ("gpu", "kernels: expected 'auto', 'cpu', 'cuda' or 'emulated', got 'gpu'"),
])
def test_kernels_argument_that_the_device_cannot_run_is_named(kernels, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        swa_ext.SWATokenToKVPoolAllocator(64, 64, 4, torch.bfloat16, "cpu", kernels=kernels)
