"""swa_ext.sglang: the classes are SGLang's types with SGLang's constructors; the surface
SGLang reaches answers as SGLang's allocator does (checked in lockstep, which compares
every native call with SGLang's own allocator); install/uninstall, the plugin's modes,
the fallbacks; resize; a divergence is caught and named."""
import inspect
import logging
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache import kv_cache_configurator
from sglang.srt.mem_cache.allocator import paged as sglang_paged
from sglang.srt.mem_cache.allocator import swa as sglang_swa
from sglang.srt.mem_cache.allocator import token as sglang_token

import swa_ext
import swa_ext.sglang as adapter
from conftest import RecordingSWAKVCache, t
from swa_ext import sglang_plugin


def lockstep(size=256, size_swa=128, page_size=16, **kwargs):
    return adapter.LockstepSWATokenToKVPoolAllocator(size, size_swa, page_size, torch.float16, "cpu",
                                                     RecordingSWAKVCache(), False, **kwargs)


def test_the_classes_are_sglangs_types_with_native_methods_first():
    pairs = [(adapter.SWATokenToKVPoolAllocator, sglang_swa.SWATokenToKVPoolAllocator, swa_ext._C.HybridAllocator),
             (adapter.PagedTokenToKVPoolAllocator, sglang_paged.PagedTokenToKVPoolAllocator, swa_ext._C.PoolAllocator),
             (adapter.TokenToKVPoolAllocator, sglang_token.TokenToKVPoolAllocator, swa_ext._C.PoolAllocator)]
    for ours, theirs, native in pairs:
        assert issubclass(ours, theirs) and issubclass(ours, native)
        assert ours.__mro__.index(native) < ours.__mro__.index(theirs)
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters)
        for name in ("alloc", "free", "clear", "available_size"):
            assert getattr(ours, name) is getattr(native, name), name


def test_the_surface_sglang_reaches():
    cache = RecordingSWAKVCache()
    alloc = adapter.SWATokenToKVPoolAllocator(256, 128, 16, torch.float16, "cpu", cache, False)
    full, swa = alloc.full_attn_allocator, alloc.swa_attn_allocator
    assert isinstance(full, sglang_paged.PagedTokenToKVPoolAllocator) and full.get_kvcache() == "the full KV pool"
    assert swa.get_kvcache() == "the SWA KV pool" and full.page_size == 16 and full.debug_mode is False
    assert cache.registered == [alloc.full_to_swa_index_mapping]
    assert (alloc.size, alloc.size_full, alloc.size_swa) == (128, 256, 128)
    assert alloc.free_pages is None and alloc.get_all_free_pages() is None  # the leak checker then reads the pools
    assert full.get_all_free_pages().tolist() == list(range(1, 17))
    assert not alloc.swa_req_ring and alloc.swa_ring_cost_tokens == 0 and not sglang_swa.is_swa_req_ring(alloc)
    assert type(alloc.create_prefill_budget(None)).__name__ == "SWAPrefillBudget"
    assert alloc.check_decode_capacity(num_tokens=8, tree_cache=None)
    assert alloc.evict_to_free_tokens(None, 8) is None
    assert alloc.request_slot_reserve(has_req_pool_slot=True) == 0
    assert alloc.max_new_tokens_for_memory(20, 500, token_capacity=128, sliding_window_size=64, chunk_size=None) == 79
    assert alloc.verify_byte_accounting() == [] and alloc.mamba_full_cache_donor() is None
    assert alloc.get_extend_allocation_demand(t([0]), t([5]), conservative_num_tokens=21, shard_size=1) == 21
    assert alloc.swa_capacity_and_available(full_capacity=256, swa_capacity=128) == ((256, 256), (128, 128))
    assert alloc.prealloc_fits(None, 100, 50, full_budget_tokens=100, swa_budget_tokens=40) is False
    assert not alloc.prealloc_fits_assumes_reclaim() and alloc.prealloc_ceiling_fits(1, 1) is None
    loc = alloc.alloc_extend(t([0]), t([0]), t([20]), t([20]), t([-1]), 20)
    assert alloc.translate_kv_indices_for_transfer(loc) is loc
    assert torch.equal(alloc.translate_swa_indices_for_transfer(loc), alloc.translate_loc_from_full_to_swa(loc))
    assert alloc.get_cpu_copy(loc[:2]) == "cpu copy"
    alloc.load_cpu_copy("cpu copy", loc[:2])
    assert cache.calls == [("get_cpu_copy", loc[:2].tolist()), ("load_cpu_copy", "cpu copy", loc[:2].tolist())]
    tree = SimpleNamespace(evict_for_alloc=lambda params: None)
    assert alloc.reclaim_for_prealloc(tree, 16, 16) is None
    assert "needed=200" in alloc.reclaim_for_prealloc(tree, 16, 200)
    alloc.clear()
    assert alloc.full_available_size() == 256 and cache.registered[-1] is alloc.full_to_swa_index_mapping


def test_every_call_matches_sglangs_allocator_in_lockstep():
    """The calls SGLang's scheduler, radix cache and PD paths make, on both allocators;
    a difference raises inside the call."""
    alloc = lockstep()
    a = alloc.alloc_extend(t([0, 0]), t([0, 0]), t([20, 40]), t([20, 40]), t([-1, -1]), 60)
    b = alloc.alloc_decode(t([21, 41]), t([21, 41]), t([int(a[19]), int(a[-1])]))
    assert alloc.new_pages_available(3, 3) and not alloc.new_pages_available(100, 1)
    tail = alloc.alloc_extend_swa_tail(t([0]), t([0]), t([48]), t([48]), t([-1]), 48, 16)  # SWA for [32, 48)
    alloc.free_group_begin()
    alloc.free_swa_segment(a[:16], start_pos=0)  # out of the window
    alloc.free_full_segments([(a[:16], 0)])
    alloc.free_segments([(a[16:20], 16)])
    alloc.full_attn_allocator.free_segment(tail[:16], start_pos=0)  # the radix cache frees through the pools
    alloc.free_full_segment(tail[16:32], start_pos=16)
    alloc.free_group_end()
    alloc.free(torch.cat([a[20:], b[1:]]))  # b[0] lies in the page freed with a[16:20]
    alloc.free_segment(tail[32:], start_pos=32)
    assert alloc.full_attn_allocator.available_size() == alloc.full_available_size() == 256
    alloc.full_attn_allocator.free_group_begin()
    alloc.full_attn_allocator.free_group_end()
    counts = alloc.lockstep_counts
    assert counts["alloc_extend"] == 1 and counts["free_segment"] >= 3 and counts["free_group_end"] == 2


def test_lockstep_names_the_first_divergent_call():
    alloc = lockstep()
    first = alloc.alloc_extend(t([0]), t([0]), t([20]), t([20]), t([-1]), 20)
    # Taken from swa_ext's full pool alone, bypassing the mirror: the allocators now differ.
    swa_ext._C.PoolAllocator.alloc(alloc.full_attn_allocator, 16)
    with pytest.raises(adapter.LockstepDivergence, match=r"alloc_decode\(tensor\(\[21\].* after 2 calls: after it "
                                                         r"full_available_size\(\) is 208 in swa_ext, 224 in SGLang"):
        alloc.alloc_decode(t([21]), t([21]), t([int(first[-1])]))


def test_resize_takes_sglangs_config_and_keeps_the_registered_mapping():
    alloc = lockstep()
    mapping = alloc.full_to_swa_index_mapping
    alloc.alloc_extend(t([0]), t([0]), t([20]), t([20]), t([-1]), 20)
    alloc.resize(SimpleNamespace(full_max_total_num_tokens=128, swa_max_total_num_tokens=64))
    assert (alloc.size_full, alloc.size_swa) == (128, 64) and alloc.full_to_swa_index_mapping is mapping
    assert alloc.get_kvcache().registered[-1] is mapping
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (128, 64)  # compared with SGLang's
    pool = adapter.PagedTokenToKVPoolAllocator(256, 16, torch.float16, "cpu", None, False)
    pool.resize(SimpleNamespace(max_total_num_tokens=64))
    assert pool.size == 64 and pool.available_size() == 64


# A port of SGLang's test_swa_alloc_extend_page_estimation.py onto real allocators: whether
# an extend is refused depends on the pages it needs, not on one page per request.
@pytest.mark.parametrize("page_size,full_free,swa_free,prefixes,seqs,fits", [
    (8, 16, 16, [5, 5], [6, 6], True),  # no new page
    (8, 16, 16, [7, 7], [10, 10], True),  # two new pages, two free
    (8, 8, 64, [8] * 5, [9] * 5, False),  # the full pool is short
    (8, 64, 8, [8] * 5, [9] * 5, False),  # the SWA pool is short
    (8, 16, 16, [8, 8], [9, 9], True),  # exactly at capacity
    (8, 16, 16, [8] * 3, [9] * 3, False),  # one page over
    *[(ps, 2 * ps, 2 * ps, [ps - 2] * 4, [ps - 1] * 4, True) for ps in (16, 32, 64, 128)],
])
def test_extend_refusal_counts_new_pages(page_size, full_free, swa_free, prefixes, seqs, fits):
    prefix_pages = sum(-(-p // page_size) for p in prefixes)
    # Pools of exactly the prefixes' pages plus the free ones.
    alloc = lockstep(page_size * prefix_pages + full_free, page_size * prefix_pages + swa_free, page_size)
    last_loc = []
    for p in prefixes:
        prefix = alloc.alloc_extend(t([0]), t([0]), t([p]), t([p]), t([-1]), p)
        last_loc.append(int(prefix[-1]))
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (full_free, swa_free)
    out = alloc.alloc_extend(t(prefixes), t(prefixes), t(seqs), t(seqs), t(last_loc), sum(seqs) - sum(prefixes))
    assert (out is not None) == fits


@pytest.fixture
def clean_install():
    yield
    adapter.uninstall()


def test_install_rebinds_the_configurators_names_and_uninstall_restores_them(clean_install, caplog):
    originals = {n: getattr(kv_cache_configurator, n) for n in adapter._REPLACED}
    adapter.install()
    assert adapter.installed() == ["SWATokenToKVPoolAllocator"]
    stand_in = kv_cache_configurator.SWATokenToKVPoolAllocator
    with caplog.at_level(logging.INFO, logger="swa_ext.sglang"):
        alloc = stand_in(256, 128, page_size=16, dtype=torch.float16, device="cpu", kvcache=RecordingSWAKVCache(),
                         need_sort=False, req_to_token_pool=None)
    assert type(alloc) is adapter.SWATokenToKVPoolAllocator
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("swa_ext:")] == [
        "swa_ext: SWATokenToKVPoolAllocator serves a full pool of 256 tokens and an SWA pool of 128 tokens "
        "(kernels cpu), page size 16, on cpu (SWA_EXT_SGLANG=1, SGLang 0.5.23)"]
    # isinstance in the configurator answers as for SGLang's class, swa_ext's or not.
    sglangs = sglang_swa.SWATokenToKVPoolAllocator(256, 128, 16, torch.float16, "cpu", RecordingSWAKVCache(), False)
    assert isinstance(alloc, stand_in) and isinstance(sglangs, stand_in) and not isinstance(object(), stand_in)
    assert kv_cache_configurator.PagedTokenToKVPoolAllocator is originals["PagedTokenToKVPoolAllocator"]
    adapter.install(single_pool=True, lockstep=True)
    assert adapter.installed() == sorted(adapter._REPLACED)
    pool = kv_cache_configurator.PagedTokenToKVPoolAllocator(64, page_size=16, dtype=torch.float16, device="cpu",
                                                             kvcache=None, need_sort=True)
    token = kv_cache_configurator.TokenToKVPoolAllocator(64, dtype=torch.float16, device="cpu", kvcache=None,
                                                         need_sort=False)
    assert type(pool) is adapter.LockstepPagedTokenToKVPoolAllocator
    assert type(token) is adapter.LockstepTokenToKVPoolAllocator
    pool.free(pool.alloc(32))
    assert pool.alloc(48) is not None and token.alloc(8).tolist() == list(range(1, 9))
    adapter.uninstall()
    assert {n: getattr(kv_cache_configurator, n) for n in adapter._REPLACED} == originals


def test_fallbacks_build_sglangs_class_and_say_why(clean_install, caplog):
    adapter.install(single_pool=True)
    with caplog.at_level(logging.WARNING, logger="swa_ext.sglang"):
        ring = kv_cache_configurator.SWATokenToKVPoolAllocator(
            256, 128, page_size=16, dtype=torch.float16, device="cpu", kvcache=RecordingSWAKVCache(64),
            need_sort=False, req_to_token_pool=SimpleNamespace(available_size=lambda: 8))
        other = kv_cache_configurator.TokenToKVPoolAllocator(64, dtype=torch.float16, device="meta", kvcache=None,
                                                             need_sort=False)
    assert type(ring) is sglang_swa.SWATokenToKVPoolAllocator and ring.swa_req_ring
    assert type(other) is sglang_token.TokenToKVPoolAllocator
    warnings = [r.getMessage() for r in caplog.records]
    assert any("per-request SWA ring" in w for w in warnings) and any("device 'meta'" in w for w in warnings)


@pytest.mark.parametrize("value,expected", [("", []), ("0", []), ("1", ["SWATokenToKVPoolAllocator"]),
                                            ("all", sorted(adapter._REPLACED)),
                                            ("lockstep", sorted(adapter._REPLACED))])
def test_plugin_modes(clean_install, monkeypatch, value, expected):
    monkeypatch.setenv("SWA_EXT_SGLANG", value)
    sglang_plugin.plugin()
    assert adapter.installed() == expected
    if value == "lockstep":
        built = kv_cache_configurator.SWATokenToKVPoolAllocator(256, 128, page_size=16, dtype=torch.float16,
                                                                 device="cpu", kvcache=RecordingSWAKVCache(),
                                                                 need_sort=False)
        assert type(built) is adapter.LockstepSWATokenToKVPoolAllocator


def test_the_entry_point_is_declared():
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "swa_ext"]
    assert ep.value == "swa_ext.sglang_plugin:plugin" and ep.load() is sglang_plugin.plugin
