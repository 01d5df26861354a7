"""swa_ext's shared mode as SGLang's hybrid allocator, without an engine: the scheduler's
capacity gates price full and SWA pages together against the one free count (what they
admit allocates; what they refuse would not), the sizing at SGLang's KV bytes, the KV
pool whose SWA layers use the full layers' storage, the one-line refusals, the switch."""
import itertools
import types

import pytest
import torch
from sglang.srt.mem_cache import kv_cache_configurator
from sglang.srt.mem_cache.allocator import swa as sglang_swa
from sglang.srt.mem_cache.prefill_budget import SharedSWAPrefillBudget
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

import swa_ext
import swa_ext.sglang as adapter
from conftest import RecordingSWAKVCache, t
from swa_ext import sglang_plugin
from swa_ext.sglang import shared_pool
from swa_ext.sglang.shared import SharedSWATokenToKVPoolAllocator

PAGE = 16
WINDOW = 64


def shared(size=512, page_size=PAGE):
    return SharedSWATokenToKVPoolAllocator(size, size, page_size, torch.float16, "cpu", RecordingSWAKVCache(), False)


class Tree:
    """Stands for SGLang's radix cache: requests' KV it holds (evictable), evicted whole,
    oldest first, through the allocator's free, as SGLang's tree frees a full leaf."""

    def __init__(self, alloc):
        self.alloc, self.cached, self.asked = alloc, [], []

    def supports_prefix_sharing(self):
        return True

    def full_evictable_size(self):
        return sum(-(-len(full) // PAGE) * PAGE for full, _ in self.cached)

    def swa_evictable_size(self):
        return sum(swa for _, swa in self.cached)

    def evict_for_alloc(self, params, allocation_reclaim_satisfied=None):
        self.asked.append((params.num_tokens, params.swa_num_tokens))
        target = self.alloc.available_size() + params.num_tokens
        while self.cached and self.alloc.available_size() < target:
            self.alloc.free(self.cached.pop(0)[0])


def prompt(alloc, length, tail):
    """A decode node's preallocation: ``length`` full tokens, the last ``tail`` on the SWA side too."""
    return alloc.alloc_extend_swa_tail(t([0]), t([0]), t([length]), t([length]), t([-1]), length, tail)


def test_the_shared_class_is_sglangs_type_on_one_slot_space():
    alloc = shared()
    assert isinstance(alloc, sglang_swa.SWATokenToKVPoolAllocator) and isinstance(alloc, swa_ext._C.HybridAllocator)
    assert alloc.shared and alloc.size == alloc.size_full == alloc.size_swa == 512
    assert alloc.full_available_size() == alloc.swa_available_size() == alloc.available_size() == 512
    assert not adapter.SWATokenToKVPoolAllocator(512, 256, PAGE, torch.float16, "cpu", RecordingSWAKVCache(),
                                                 False).shared


def test_a_demand_takes_its_full_and_swa_pages_from_the_one_budget():
    alloc = shared()  # 32 pages
    assert alloc.can_reserve(256, 256) and not alloc.can_reserve(256, 257) and not alloc.can_reserve(-1, 0)
    assert alloc.can_reserve(256, 257 + PAGE, full_evictable_tokens=PAGE, swa_evictable_tokens=PAGE)
    assert alloc.can_reserve(256, 256, empty_pool=True)
    assert not alloc.can_reserve(256, 256, empty_pool=True, require_token_slack=True)  # SGLang's token to spare
    # The prefill budget's estimates are floats (scaled by its new-token ratio): a part of a
    # token takes a slot.
    assert alloc.can_reserve(255.5, 256.0) and not alloc.can_reserve(256.25, 256.0)
    assert not alloc.can_reserve(255.5, 256.0, empty_pool=True, require_token_slack=True)
    # What the gate admits allocates, and one page more it refuses does not.
    loc = prompt(alloc, 300, 80)  # 19 full pages and 5 SWA pages
    assert loc is not None and alloc.available_size() == 512 - 24 * PAGE
    for full, swa in ((64, 64), (96, 48), (128, 0), (112, 16), (128, 16), (80, 80)):
        admitted = alloc.can_reserve(full, swa)
        assert admitted == alloc.new_pages_available(-(-full // PAGE), -(-swa // PAGE)), (full, swa)
        got = prompt(alloc, full, swa)
        assert (got is not None) == admitted, (full, swa)
        if got is not None:
            alloc.free(got)
    assert alloc.available_size() == 512 - 24 * PAGE
    assert isinstance(alloc.create_prefill_budget(Tree(alloc)), SharedSWAPrefillBudget)


def test_decode_capacity_counts_a_page_of_each_side_and_evicts_for_them():
    alloc = shared(256)  # 16 pages
    tree = Tree(alloc)
    running = prompt(alloc, 160, 64)  # 10 + 4 pages
    assert running is not None and alloc.available_size() == 2 * PAGE
    assert alloc.check_decode_capacity(num_tokens=PAGE, tree_cache=tree)  # one request crosses: 2 pages
    assert not alloc.check_decode_capacity(num_tokens=2 * PAGE, tree_cache=tree)  # two would need 4
    assert tree.asked == [(2 * PAGE, 2 * PAGE)]  # it asked the tree for both sides' pages
    alloc.free(running)
    cached = prompt(alloc, 160, 64)
    tree.cached.append((cached, 64))  # now the tree could give it back
    assert alloc.check_decode_capacity(num_tokens=2 * PAGE, tree_cache=tree)
    assert not tree.cached and alloc.available_size() == 256


def test_a_decode_nodes_preallocation_prices_its_reserves_on_the_one_budget():
    alloc = shared()  # 32 pages
    tree = Tree(alloc)

    def budgets():  # SGLang's: each side's free and evictable tokens less what it keeps for running requests
        free = alloc.available_size()
        return dict(full_budget_tokens=free + tree.full_evictable_size() - 64,
                    swa_budget_tokens=free + tree.swa_evictable_size() - 32)

    assert alloc.prealloc_fits_assumes_reclaim()
    assert alloc.prealloc_fits(tree, 256, 160, **budgets())  # 16+4 + 10+2 pages = 32
    assert not alloc.prealloc_fits(tree, 256, 161, **budgets())
    assert alloc.prealloc_ceiling_fits(256, 256) and not alloc.prealloc_ceiling_fits(256, 272)
    held = prompt(alloc, 256, 64)
    tree.cached.append((held, 64))
    assert alloc.prealloc_fits(tree, 256, 160, **budgets())  # what the tree holds counts: it is reclaimed first
    assert not alloc.prealloc_fits(tree, 256, 161, **budgets())
    assert alloc.reclaim_for_prealloc(tree, 320, 64) is None and alloc.available_size() == 512
    assert "needed 528 tokens" in alloc.reclaim_for_prealloc(tree, 448, 80)


def test_each_side_reads_its_pages_and_the_free_ones_for_sglangs_checks():
    alloc = shared()
    loc = prompt(alloc, 300, 80)  # 19 full pages, 5 SWA pages
    (full_capacity, full_free), (swa_capacity, swa_free) = alloc.swa_capacity_and_available(
        full_capacity=512, swa_capacity=512)
    free = 512 - 24 * PAGE
    assert (full_free, swa_free) == (free, free)
    assert (full_capacity - full_free, swa_capacity - swa_free) == (19 * PAGE, 5 * PAGE)
    alloc.free(loc)
    assert alloc.swa_capacity_and_available(full_capacity=512, swa_capacity=512) == ((512, 512), (512, 512))


def test_new_tokens_are_clipped_to_what_the_empty_budget_holds():
    alloc = shared()

    def fits(n, prompt_len):  # the whole prompt's full KV, and its SWA peak as SGLang's admission estimates it
        swa = max(prompt_len - WINDOW, 0) + min(prompt_len + n, WINDOW) + PAGE
        full = prompt_len + n + PAGE
        return -(-full // PAGE) + -(-swa // PAGE) <= 512 // PAGE and full + swa < 512

    for prompt_len in (40, 200, 220):
        n = alloc.max_new_tokens_for_memory(prompt_len, 1000, token_capacity=512, sliding_window_size=WINDOW,
                                            chunk_size=None)
        assert fits(n, prompt_len) and not fits(n + 1, prompt_len), (prompt_len, n)
    assert alloc.max_new_tokens_for_memory(20, 8, token_capacity=512, sliding_window_size=WINDOW,
                                           chunk_size=None) == 8
    assert alloc.max_new_tokens_for_memory(480, 8, token_capacity=512, sliding_window_size=WINDOW,
                                           chunk_size=None) is None



def test_a_decode_nodes_clip_charges_the_swa_side_for_the_window_tail_only(monkeypatch):
    """A PD decode node preallocates SWA KV for the window tail (alloc_extend_swa_tail),
    so a prompt whose full KV fits the budget is served there though its whole-prompt SWA
    estimate (a prefill's) would not fit beside it; at page size 1 the node takes SWA KV
    for the whole prompt, as the estimate says."""
    from swa_ext.sglang import shared as shared_module

    def clip(alloc, prompt_len):
        return alloc.max_new_tokens_for_memory(prompt_len, 1000, token_capacity=512, sliding_window_size=WINDOW,
                                               chunk_size=None)

    assert clip(shared(), 400) is None  # 26 full + 26 SWA pages of 32: no engine process's node is a decode node
    node = types.SimpleNamespace(disaggregation_mode="decode")
    monkeypatch.setattr(shared_module.runtime_context, "get_server_args", lambda: node)
    n = clip(shared(), 400)

    def fits(n):  # the prompt's full KV and new tokens, the window tail and a page on the SWA side
        full, swa = 400 + n + PAGE, min(400 + n, WINDOW) + PAGE
        return -(-full // PAGE) + -(-swa // PAGE) <= 512 // PAGE and full + swa < 512

    assert n is not None and fits(n) and not fits(n + 1), n
    assert clip(shared(page_size=1), 400) is None
    node.disaggregation_mode = "prefill"
    assert clip(shared(), 400) is None


# --- sizing, storage, refusals, the switch ----------------------------------------------


def attention_layer(layer_id, sliding_window_size):
    """A model's attention layer as the shared mode reads it: its id and window (-1: none)."""
    layer = RadixAttention.__new__(RadixAttention)
    torch.nn.Module.__init__(layer)
    layer.layer_id, layer.sliding_window_size = layer_id, sliding_window_size
    return layer


def configurator(full_layers=1, swa_layers=1, swa_heads=1, algorithm="NONE", hybrid=True, windowless=(),
                 draft_layers=None, draft_swa_layers=None, mla=False):
    """SGLang's KV cache configurator as the shared mode reads it: full layers first, then
    SWA layers, whose attention has a window of 63 tokens unless its id is in ``windowless``;
    a draft model of ``draft_layers`` (``draft_swa_layers`` of them sliding-window ones),
    as SGLang's spec_aux_config counts them for the target."""
    spec = SpeculativeAlgorithm.from_string(algorithm)
    aux = types.SimpleNamespace(eagle_draft_num_layers=draft_layers, eagle_draft_swa_num_layers=draft_swa_layers)
    config = types.SimpleNamespace(get_num_kv_heads=lambda tp: 1, get_swa_num_kv_heads=lambda tp: swa_heads,
                                   head_dim=32, v_head_dim=32, swa_head_dim=32, swa_v_head_dim=32)  # 128-byte rows
    layers = types.SimpleNamespace(full_attention_layer_ids=list(range(full_layers)),
                                   swa_attention_layer_ids=list(range(full_layers, full_layers + swa_layers)))
    model = torch.nn.ModuleList([attention_layer(i, -1 if i < full_layers or i in windowless else 63)
                                 for i in range(full_layers + swa_layers)])
    return types.SimpleNamespace(is_hybrid_swa=hybrid, layer_info=layers, model_config=config,
                                 model=model, spec_algorithm=spec, spec_aux_config=aux, page_size=PAGE,
                                 post_capture_kv_active=False, use_mla_backend=mla, kv_cache_dtype=torch.float16)


def pool_config(full=4096, swa=3264):
    return types.SimpleNamespace(max_total_num_tokens=full, full_max_total_num_tokens=full,
                                 swa_max_total_num_tokens=swa)


@pytest.fixture
def runtime(monkeypatch):
    monkeypatch.setattr(shared_pool, "get_memory", lambda: types.SimpleNamespace(enable_unified_memory=False,
                                                                                  enable_hierarchical_cache=False))
    monkeypatch.setattr(shared_pool, "get_parallel", lambda: types.SimpleNamespace(attn_tp_size=1))
    monkeypatch.setattr(shared_pool, "attention_backends", lambda: ("triton", "triton"))
    monkeypatch.setattr(shared_pool, "get_spec", lambda: types.SimpleNamespace(speculative_eagle_topk=1))
    monkeypatch.setattr(shared_pool, "get_disagg", lambda: types.SimpleNamespace(disaggregation_mode="null"))


def test_one_slot_count_in_the_bytes_of_sglangs_two_pools(runtime):
    config = shared_pool.shared_sizes(configurator(), pool_config())
    assert (config.max_total_num_tokens, config.full_max_total_num_tokens, config.swa_max_total_num_tokens) == \
        (7360, 7360, 7360)
    assert shared_pool.shared_sizes(configurator(hybrid=False), pool_config()).swa_max_total_num_tokens == 3264
    assert shared_pool.shared_sizes(configurator(algorithm="NGRAM"), pool_config()).max_total_num_tokens == 7360


@pytest.mark.parametrize("full,swa", [(4096, 3264), (8192, 6544), (320, 320), (65536, 0), (16, 1 << 20)])
@pytest.mark.parametrize("full_entry,swa_entry,draft_entry", [
    (2048, 2048, 0), (24576, 24576, 2048), (18 << 10, 18 << 10, 3 << 10),  # equal entries: gpt-oss, with drafts
    (2048, 6144, 0),  # 1 full : 3 SWA layers of one row (k = 3)
    (48 << 10, 144 << 10, 0),  # Llama 4 Scout's 12 full : 36 chunked layers
    (20 << 10, 200 << 10, 0),  # MiMo-V2-Flash: 8 full layers of 4 KV heads, 40 SWA of 8, head dims 192 / 128
    (6144, 2048, 0), (1000, 2999, 0),  # the SWA side the smaller; entries no multiple of each other
])
def test_the_one_budget_fits_sglangs_bytes_to_a_parent(full, swa, full_entry, swa_entry, draft_entry):
    """The parents are as many as fit the bytes SGLang sized for its two pools (and a
    draft's at the full tokens): one parent more would not fit. The side with the smaller
    entry has k times the other's slots, k from the native rule. Without a draft at k = 1,
    full + swa slots a side."""
    full_slots, swa_slots, k = shared_pool.one_budget_sizes(full, swa, full_entry=full_entry, swa_entry=swa_entry,
                                                            draft_entry=draft_entry, page_size=PAGE)
    assert k == swa_ext._C.parent_k(max(full_entry, swa_entry), min(full_entry, swa_entry))
    small, large = max(full_slots, swa_slots), min(full_slots, swa_slots)
    assert small == k * large and large % PAGE == 0
    assert (full_slots == small) == (full_entry <= swa_entry)
    parents = large // PAGE
    parent_bytes = PAGE * (k * min(full_entry, swa_entry) + (k if full_entry <= swa_entry else 1) * draft_entry)
    sglang_bytes = full * (full_entry + draft_entry) + swa * swa_entry
    assert parents * parent_bytes <= sglang_bytes < (parents + 1) * parent_bytes
    if draft_entry == 0 and k == 1:
        assert full_slots == swa_slots == full + swa
    if k == 1:  # (whole parents of k > 1 may round off up to k - 1 pages)
        assert full_slots >= full  # never fewer full slots than SGLang's full pool: every request it admits fits


def test_unequal_entries_size_parent_pages_and_say_so(runtime, caplog):
    """A 1 full : 3 SWA mix of equal rows: k = 3 full pages to a parent, the start-up line
    gives both sides' slots."""
    caplog.set_level("INFO", logger=shared_pool.logger.name)
    config = shared_pool.shared_sizes(configurator(full_layers=1, swa_layers=3), pool_config())
    full_slots, swa_slots, k = shared_pool.one_budget_sizes(4096, 3264, full_entry=128, swa_entry=384, draft_entry=0,
                                                            page_size=PAGE)
    assert k == 3 and (config.full_max_total_num_tokens, config.swa_max_total_num_tokens) == (full_slots, swa_slots)
    assert config.max_total_num_tokens == full_slots
    line, = [r.getMessage() for r in caplog.records if "one budget" in r.getMessage()]
    assert line.endswith(f"one budget of {full_slots} slots for full and SWA KV, in the bytes SGLang sized for 4096 "
                         f"full and 3264 SWA tokens; parent pages of 3 full pages or one SWA page (KV entries of 128 "
                         f"and 384 bytes a token): {full_slots} full or {swa_slots} SWA slots")


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE"])
def test_a_draft_models_pool_spans_the_slots_that_fit_sglangs_bytes(runtime, caplog, algorithm):
    """The config a draft worker builds its pool from (its target's) holds the one budget's
    slots at both sides and as the token count, and the start-up line gives the draft's share."""
    caplog.set_level("INFO", logger=shared_pool.logger.name)
    config = shared_pool.shared_sizes(configurator(full_layers=12, swa_layers=12, algorithm=algorithm,
                                                   draft_layers=1), pool_config())
    slots, _, _ = shared_pool.one_budget_sizes(4096, 3264, full_entry=12 * 128, swa_entry=12 * 128, draft_entry=128,
                                               page_size=PAGE)
    assert slots < 4096 + 3264
    assert (config.max_total_num_tokens, config.full_max_total_num_tokens, config.swa_max_total_num_tokens) == \
        (slots, slots, slots)
    line, = [r.getMessage() for r in caplog.records if "one budget" in r.getMessage()]
    assert line.endswith(f"one budget of {slots} slots for full and SWA KV, in the bytes SGLang sized for 4096 full "
                         f"and 3264 SWA tokens and a draft model's KV at the 4096 full tokens; the draft's KV covers "
                         f"every slot: 1 of 13 KV rows a slot, {100 / 13:.1f}% of the budget")


@pytest.mark.parametrize("kwargs,why", [
    (dict(full_layers=0, swa_layers=4), "0 full and 4 SWA layers (one budget pairs a full side with an SWA side)"),
    (dict(mla=True), "an MLA KV cache"),
    (dict(full_layers=1, swa_layers=3, algorithm="EAGLE3", draft_layers=1),
     "a draft model beside full and SWA KV entries of 128 and 384 bytes a token"),
    (dict(algorithm="DFLASH", draft_layers=1), "speculative decoding DFLASH (its draft KV is sized apart"),
    (dict(algorithm="FROZEN_KV_MTP", draft_layers=1), "speculative decoding FROZEN_KV_MTP"),
    (dict(algorithm="EAGLE", draft_layers=2, draft_swa_layers=1), "a draft model with sliding-window layers"),
    (dict(algorithm="STANDALONE", draft_layers=2, draft_swa_layers=0), "a draft model with sliding-window layers"),
    (dict(algorithm="EAGLE3"), "a draft model whose KV SGLang prices at no layers"),
    # An architecture SGLang builds hybrid (GraniteSWAForCausalLM) with a config whose
    # attention has no window (model_type granite): its SWA layers would read full slots.
    (dict(full_layers=2, swa_layers=2, windowless=(2, 3)), "layers [2, 3] are kept as SWA layers by SGLang's KV "
                                                           "pool but attend without a window"),
])
def test_what_the_shared_mode_cannot_serve_is_one_line_naming_what_it_serves(runtime, kwargs, why):
    check_refused_in_one_line(kwargs, why)


def test_tree_drafts_are_refused_and_one_chain_served(runtime, monkeypatch):
    """Tree verify (topk > 1) moves accepted tokens' KV inside the target's pool: no engine
    here runs tree-mask attention, so it is refused in one slot space, naming what serves."""
    monkeypatch.setattr(shared_pool, "get_spec", lambda: types.SimpleNamespace(speculative_eagle_topk=4))
    check_refused_in_one_line(dict(algorithm="EAGLE3", draft_layers=1),
                              "tree drafts (--speculative-eagle-topk 4; --speculative-eagle-topk 1 serves)")
    for topk in (1, None):
        monkeypatch.setattr(shared_pool, "get_spec", lambda: types.SimpleNamespace(speculative_eagle_topk=topk))
        assert shared_pool.refusal(configurator(algorithm="EAGLE3", draft_layers=1)) is None


@pytest.mark.parametrize("backends", [("torch_native", "torch_native"), ("triton", "torch_native"),
                                      ("flex_attention", "triton")])
def test_a_backend_that_reads_swa_layers_at_full_slots_is_refused(runtime, monkeypatch, backends):
    """SGLang's torch_native reads every layer's buffer at req_to_token's full slots: in one
    slot space an SWA layer would read its paired full layer's KV. Refused, naming it and
    what serves; the backends that read SWA layers through the mapping are served."""
    monkeypatch.setattr(shared_pool, "attention_backends", lambda: backends)
    unserved = sorted(set(backends) - {"triton"})
    check_refused_in_one_line({}, f"attention backend {', '.join(unserved)} (it reads SWA layers' KV at full slots")
    for served in shared_pool.MAPPED_READ_BACKENDS:
        monkeypatch.setattr(shared_pool, "attention_backends", lambda: (served, served))
        assert shared_pool.shared_sizes(configurator(), pool_config()).max_total_num_tokens == 7360


def check_refused_in_one_line(kwargs, why):
    with pytest.raises(shared_pool.SharedModeRefused) as refused:
        shared_pool.shared_sizes(configurator(**kwargs), pool_config())
    message = str(refused.value)
    assert "\n" not in message and why in message and message.startswith("swa_ext: SWA_EXT_SGLANG=shared serves hybrid")
    assert "any mix of layers, KV heads and head dims" in message and "SWA_EXT_SGLANG=1 serves it with two pools" in message


# --- the one storage ------------------------------------------------------------------------

# Mixes of layers and rows (fp16), as SharedSWAKVPool's arguments: full layers, SWA layers,
# and SGLang's pool kwargs for their heads and dims.
MIXES = {
    "pairs": (2, 2, dict(head_num=2, head_dim=16)),  # k = 1: gpt-oss, Granite-SWA
    "gpt-oss 3:1": (2, 6, dict(head_num=2, head_dim=16)),  # k = 3
    # MiMo-V2-Flash's rows (full 4 KV heads, SWA 8, K 192 / V 128) at 2 full : 10 SWA: k = 10
    "mimo": (2, 10, dict(head_num=4, head_dim=192, v_head_dim=128, swa_head_num=8, swa_head_dim=192,
                         swa_v_head_dim=128)),
    # An SWA K row wider than k full rows: the rows do not pack into planes; whole entries (k = 2)
    "unpacked": (1, 1, dict(head_num=1, head_dim=32, swa_head_num=1, swa_head_dim=80, swa_v_head_dim=48)),
}
PARENTS = 3


def build_pool(mix, parents=PARENTS):
    """SharedSWAKVPool at the sizes shared_sizes gives a mix: ``parents`` parent pages."""
    full_layers, swa_layers, heads = MIXES[mix]
    entry = {side: layers * heads.get(f"{prefix}head_num", heads["head_num"]) * 2 * (
        heads.get(f"{prefix}head_dim", heads["head_dim"]) +
        heads.get(f"{prefix}v_head_dim", heads.get("v_head_dim", heads["head_dim"])))
        for side, layers, prefix in (("full", full_layers, ""), ("swa", swa_layers, "swa_"))}
    k = swa_ext._C.parent_k(max(entry.values()), min(entry.values()))
    small_is_full = entry["full"] <= entry["swa"]
    size, size_swa = (parents * PAGE * k, parents * PAGE) if small_is_full else (parents * PAGE, parents * PAGE * k)
    layer_ids = list(range(full_layers + swa_layers))
    return shared_pool.SharedSWAKVPool(size=size, size_swa=size_swa, page_size=PAGE, dtype=torch.float16,
                                       swa_attention_layer_ids=layer_ids[full_layers:],
                                       full_attention_layer_ids=layer_ids[:full_layers], device="cpu",
                                       enable_memory_saver=False, **heads)


def sides(pool):
    """(small side's sub-pool, large side's) of a KV pool or an allocator."""
    full, swa = (pool.full_kv_pool, pool.swa_kv_pool) if isinstance(pool, SWAKVPool) else \
        (pool.full_attn_allocator, pool.swa_attn_allocator)
    return (full, swa) if pool.small_side == "full" else (swa, full)


def row_spans(pool, sub_pool):
    """Each (slot, buffer) row's bytes in the storage, read off the views themselves:
    {(slot, buffer index): (start, end)}, buffers K0..Kn then V0..Vn."""
    base, item = pool.storage.data_ptr(), sub_pool.store_dtype.itemsize
    spans = {}
    for b, buffer in enumerate(sub_pool.k_buffer + sub_pool.v_buffer):
        width = buffer.shape[1] * buffer.shape[2] * item
        assert buffer.stride()[1:] == (buffer.shape[2], 1)  # a row's heads and dims are one run
        for slot in range(buffer.shape[0]):
            start = buffer[slot].data_ptr() - base
            spans[slot, b] = (start, start + width)
    return spans


def check_rows_cover_disjoint_bytes(pool):
    """Every row of every side lies inside the storage; within a side no two (slot, layer,
    K/V) rows share a byte; across sides a large-side slot j shares bytes only with
    small-side slots j*k .. j*k+k-1 (its parent's: the allocator gives a parent to one side)."""
    small, large = sides(pool)
    nbytes = pool.storage.numel()
    owners = []
    for sub_pool in (small, large):
        owner = torch.full((nbytes,), -1, dtype=torch.int64)
        for (slot, _), (start, end) in row_spans(pool, sub_pool).items():
            assert 0 <= start < end <= nbytes, (slot, start, end, nbytes)
            assert bool((owner[start:end] == -1).all()), f"two rows share bytes at {start}"
            owner[start:end] = slot
        owners.append(owner)
    small_owner, large_owner = owners
    both = (small_owner >= 0) & (large_owner >= 0)
    assert bool((small_owner[both] // pool.parent_k == large_owner[both]).all()), "rows of two parents share bytes"


@pytest.mark.parametrize("mix", list(MIXES))
def test_every_layer_is_a_view_of_one_storage_of_parent_pages(runtime, mix):
    pool = build_pool(mix)
    small, large = sides(pool)
    k = pool.parent_k
    assert isinstance(pool, SWAKVPool) and k == {"pairs": 1, "gpt-oss 3:1": 3, "mimo": 10, "unpacked": 2}[mix]
    for sub_pool in (small, large):
        for buffer in sub_pool.k_buffer + sub_pool.v_buffer:
            assert buffer.untyped_storage().data_ptr() == pool.storage.untyped_storage().data_ptr()
    # Parent 0 is padding: the small side's rows run to the end of the last parent.
    assert small.k_buffer[0].shape[0] == (PARENTS + 1) * k * PAGE == k * large.k_buffer[0].shape[0]
    check_rows_cover_disjoint_bytes(pool)
    # The small side's buffers stay contiguous where the large rows pack into its planes.
    assert all(b.is_contiguous() for b in small.k_buffer + small.v_buffer) == (mix != "unpacked")
    assert pool.get_kv_size_bytes() == (sum(b.numel() * 2 for b in small.k_buffer),
                                        sum(b.numel() * 2 for b in small.v_buffer))
    assert sum(pool.get_kv_size_bytes()) == pool.storage.numel()


@pytest.mark.parametrize("mix", list(MIXES))
def test_the_storage_holds_the_bytes_sglang_sized_to_a_parent(runtime, mix):
    """The storage is the parents that fit SGLang's two pools' bytes plus parent 0, the
    padding SGLang's page 0 is: its pools' bytes and the storage differ by less than a
    parent and SGLang's padding pages."""
    full_layers, swa_layers, _ = MIXES[mix]
    probe = build_pool(mix, parents=1)
    entry = {"full": sum(shared_pool._rows(probe.full_kv_pool)), "swa": sum(shared_pool._rows(probe.swa_kv_pool))}
    full, swa = 4096, 3264
    full_slots, swa_slots, k = shared_pool.one_budget_sizes(full, swa, full_entry=entry["full"],
                                                            swa_entry=entry["swa"], draft_entry=0, page_size=PAGE)
    pool = build_pool(mix, parents=min(full_slots, swa_slots) // PAGE)
    parent = k * PAGE * min(entry.values())
    sglang_bytes = (full + PAGE) * entry["full"] + (swa + PAGE) * entry["swa"]
    assert pool.storage.numel() == (min(full_slots, swa_slots) // PAGE + 1) * parent
    assert pool.storage.numel() <= sglang_bytes < pool.storage.numel() + parent + PAGE * sum(entry.values())


class Layer:
    """Stands for an attention layer as SGLang's set_kv_buffer reads it: its id."""

    def __init__(self, layer_id):
        self.layer_id = layer_id


def write_slot(pool, side, slot, seed):
    """Writes every layer of ``side`` at ``slot`` through SGLang's own SWAKVPool.set_kv_buffer
    (an SWA write at the slot the mapping gives), distinct values a layer; returns them."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    sub_pool = pool.full_kv_pool if side == "full" else pool.swa_kv_pool
    layer_ids = [layer for layer, (_, is_swa) in sorted(pool.layers_mapping.items()) if is_swa == (side == "swa")]
    written = []
    loc = torch.tensor([slot])
    for n, layer_id in enumerate(layer_ids):
        generator = torch.Generator().manual_seed(seed * 1000 + n)
        k = torch.rand((1, sub_pool.head_num, sub_pool.head_dim), generator=generator).half() + 1
        v = torch.rand((1, sub_pool.head_num, sub_pool.v_head_dim), generator=generator).half() + 1
        where = KVWriteLoc(loc, swa_loc=loc) if side == "swa" else KVWriteLoc(loc)
        pool.set_kv_buffer(Layer(layer_id), where, k, v)
        written.append((k, v))
    return written


def check_writes_land_in_their_rows(pool, side, slot, written, before):
    """The storage changed exactly in ``side``'s rows at ``slot`` (the views' spans), each
    holding its layer's K or V, and SGLang's buffers read them back."""
    sub_pool = pool.full_kv_pool if side == "full" else pool.swa_kv_pool
    spans = row_spans(pool, sub_pool)
    layers = len(written)
    expected = before.clone()
    for b in range(2 * layers):
        start, end = spans[slot, b]
        k, v = written[b % layers]
        expected[start:end] = (k if b < layers else v).flatten().view(torch.uint8)
    changed = (pool.storage != before).nonzero().flatten().tolist()
    assert bool(torch.equal(pool.storage, expected)), f"bytes written outside the rows: {changed[:8]}"
    for n, (k, v) in enumerate(written):
        assert torch.equal(sub_pool.k_buffer[n][slot], k[0]) and torch.equal(sub_pool.v_buffer[n][slot], v[0])


@pytest.mark.parametrize("mix", list(MIXES))
def test_sglangs_writes_land_in_their_slots_rows_and_no_other(runtime, mix):
    """A full slot and an SWA slot of two parents, and then the same parent's small-side
    slots once the large side has left it: each write changes its own rows and nothing
    else, whatever the others hold."""
    pool = build_pool(mix)
    k = pool.parent_k
    small_side = pool.small_side
    large_side = "swa" if small_side == "full" else "full"
    pool.storage.copy_(torch.randint(0, 256, pool.storage.shape, dtype=torch.uint8))
    for n, (side, slot) in enumerate([(large_side, 2 * PAGE + 5), (small_side, 3 * k * PAGE + 1),
                                      (small_side, 2 * k * PAGE + 5 * k), (small_side, (PARENTS + 1) * k * PAGE - 1),
                                      (large_side, (PARENTS + 1) * PAGE - 1)]):
        before = pool.storage.clone()
        written = write_slot(pool, side, slot, seed=n)
        check_writes_land_in_their_rows(pool, side, slot, written, before)


@pytest.mark.parametrize("mix", ["gpt-oss 3:1", "mimo"])
def test_sglangs_kv_move_and_cpu_backup_read_the_views(runtime, mix):
    """What SGLang moves (a verify's accepted tokens) and backs up for a retraction goes
    through the views: the rows arrive at their new slots, nothing else changes."""
    pool = build_pool(mix)
    k = pool.parent_k
    mapping = torch.zeros((PARENTS + 1) * PAGE * max(k, 1) + 1, dtype=torch.int64)
    src, dst = k * PAGE + 3, 2 * k * PAGE + 7  # full slots of parents 1 and 2
    mapping[src], mapping[dst] = 3 * PAGE + 1, 3 * PAGE + 2  # their SWA slots, in a parent of their own
    pool.register_mapping(mapping)
    full_written = write_slot(pool, "full", src, seed=1)
    swa_written = write_slot(pool, "swa", 3 * PAGE + 1, seed=2)
    backup = pool.get_cpu_copy(torch.tensor([src]))
    pool.move_kv_cache(torch.tensor([dst]), torch.tensor([src]))
    for n, (key, value) in enumerate(full_written):
        assert torch.equal(pool.full_kv_pool.k_buffer[n][dst], key[0])
        assert torch.equal(pool.full_kv_pool.v_buffer[n][dst], value[0])
    for n, (key, value) in enumerate(swa_written):
        assert torch.equal(pool.swa_kv_pool.k_buffer[n][3 * PAGE + 2], key[0])
    pool.storage.zero_()
    pool.load_cpu_copy(backup, torch.tensor([dst]))
    for n, (key, _) in enumerate(full_written):
        assert torch.equal(pool.full_kv_pool.k_buffer[n][dst], key[0])
    for n, (key, _) in enumerate(swa_written):
        assert torch.equal(pool.swa_kv_pool.k_buffer[n][3 * PAGE + 2], key[0])


@pytest.mark.parametrize("mix", ["pairs", "gpt-oss 3:1", "mimo"])
def test_the_allocator_hands_out_the_parent_pages_of_its_kv_pool(runtime, mix):
    """SGLang builds the hybrid allocator on its KV pool: the shared mode's takes the pool's
    parent_k and small side, so every full and SWA token it hands out has rows of its own
    in the one storage. Requests until the budget refuses, every other one freed, then
    requests again (the small side fills its partly used parents): each token's rows,
    written through SGLang's set_kv_buffer as it is handed out, still hold what was
    written once the budget is spent."""
    pool = build_pool(mix, parents=24)
    alloc = SharedSWATokenToKVPoolAllocator(pool.size, pool.size_swa, PAGE, torch.float16, "cpu", pool, False)
    assert (alloc.parent_k, alloc.small_side) == (pool.parent_k, pool.small_side)
    k, small, large = alloc.parent_k, *sides(alloc)
    # Each side's free pages in its own page ids (SGLang's KV page checks compare them with
    # the pages requests hold): the child pages of every parent on the small side.
    assert small.get_all_free_pages().sort().values.tolist() == list(range(k, 25 * k))
    assert large.get_all_free_pages().sort().values.tolist() == list(range(1, 25))
    held, seed = [], 0
    for round_ in range(2):
        for length, tail in itertools.cycle(((40, 20), (23, 23), (70, 5))):
            full = prompt(alloc, length, tail)
            if full is None:
                break
            swa = alloc.translate_loc_from_full_to_swa(full[-tail:])
            rows = [(side, int(slot), write_slot(pool, side, int(slot), seed := seed + 1))
                    for side, slots in (("full", full), ("swa", swa)) for slot in slots]
            held.append((full, rows))
        if round_ == 0:
            for full, _ in held[::2]:
                alloc.free(full)
            held = held[1::2]
    assert len(held) > 3
    for side, sub_alloc in (("full", alloc.full_attn_allocator), ("swa", alloc.swa_attn_allocator)):
        in_use = torch.tensor([slot // PAGE for _, rows in held for kind, slot, _ in rows if kind == side])
        assert not bool(torch.isin(in_use, sub_alloc.get_all_free_pages()).any()), side
    assert large.get_all_free_pages().numel() * PAGE == large.available_size()
    for _, rows in held:
        for side, slot, written in rows:
            sub_pool = pool.full_kv_pool if side == "full" else pool.swa_kv_pool
            for n, (key, value) in enumerate(written):
                assert torch.equal(sub_pool.k_buffer[n][slot], key[0]), (side, slot, n)
                assert torch.equal(sub_pool.v_buffer[n][slot], value[0]), (side, slot, n)


@pytest.mark.parametrize("fault", ["next slot's row", "another layer's row"])
def test_a_view_planted_at_a_wrong_offset_is_caught(runtime, monkeypatch, fault):
    """The checks above can fail: a layout whose one SWA-side row lies on the next slot's
    row, or on another layer's row of the same slot, shares bytes; a write through SGLang
    then clobbers the other layer's row."""
    lay_out = shared_pool.lay_out

    def faulty(*args, **kwargs):
        small, large, nbytes = lay_out(*args, **kwargs)
        wrong = large[1]  # the first SWA layer's V rows
        offset = wrong.offset + wrong.stride if fault == "next slot's row" else large[2].offset
        large[1] = shared_pool.RowPlace(offset, wrong.stride, wrong.width)
        return small, large, nbytes

    monkeypatch.setattr(shared_pool, "lay_out", faulty)
    pool = build_pool("gpt-oss 3:1")
    with pytest.raises(AssertionError, match="two rows share bytes"):
        check_rows_cover_disjoint_bytes(pool)
    if fault == "another layer's row":
        before = pool.storage.clone()
        written = write_slot(pool, "swa", PAGE + 3, seed=1)
        with pytest.raises(AssertionError):
            check_writes_land_in_their_rows(pool, "swa", PAGE + 3, written, before)


@pytest.mark.parametrize("backends,disagg,hicache,why", [
    (("flashinfer", "flashinfer"), "null", False, "attention backend flashinfer on layer buffers strided in one storage"),
    (("triton", "triton"), "decode", False, "PD disaggregation on layer buffers strided in one storage"),
    (("triton", "triton"), "null", True, "the hierarchical cache on layer buffers strided in one storage"),
])
def test_what_cannot_read_strided_views_is_refused_where_they_are(runtime, monkeypatch, backends, disagg, hicache,
                                                                  why):
    """Where the large side's rows are strided (k > 1), the paths that need a layer's rows
    as one run are refused in one line; at k = 1 every buffer is contiguous and they serve."""
    monkeypatch.setattr(shared_pool, "attention_backends", lambda: backends)
    monkeypatch.setattr(shared_pool, "get_disagg", lambda: types.SimpleNamespace(disaggregation_mode=disagg))
    monkeypatch.setattr(shared_pool, "get_memory", lambda: types.SimpleNamespace(enable_unified_memory=False,
                                                                                  enable_hierarchical_cache=hicache))
    with pytest.raises(shared_pool.SharedModeRefused) as refused:
        build_pool("gpt-oss 3:1")
    assert "\n" not in str(refused.value) and why in str(refused.value)
    pool = build_pool("pairs")
    assert all(b.is_contiguous() for side in sides(pool) for b in side.k_buffer + side.v_buffer)


def test_a_pool_sglang_builds_otherwise_is_refused(runtime):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolMXFP8

    with pytest.raises(shared_pool.SharedModeRefused, match="a MHATokenToKVPoolMXFP8 KV pool"):
        shared_pool.SharedSWAKVPool(size=3 * PAGE, size_swa=3 * PAGE, page_size=PAGE, dtype=torch.float16, head_num=1,
                                    head_dim=8, swa_attention_layer_ids=[1], full_attention_layer_ids=[0],
                                    device="cpu", enable_memory_saver=False,
                                    token_to_kv_pool_class=MHATokenToKVPoolMXFP8)
    # Sized for equal entries, built with unequal ones: SGLang's pool and its sizing disagree.
    with pytest.raises(shared_pool.SharedModeRefused, match="not the ones its sizing priced"):
        shared_pool.SharedSWAKVPool(size=3 * PAGE, size_swa=3 * PAGE, page_size=PAGE, dtype=torch.float16, head_num=1,
                                    head_dim=8, swa_attention_layer_ids=[1, 2], full_attention_layer_ids=[0],
                                    device="cpu", enable_memory_saver=False)


@pytest.mark.parametrize("variables,why", [
    ({"SWA_EXT_SGLANG": "yes"}, "swa_ext: SWA_EXT_SGLANG='yes' is not a mode: set it to one of 1, all, lockstep, shared"),
    ({"SWA_EXT_SGLANG": "Shared"}, "swa_ext: SWA_EXT_SGLANG='Shared' is not a mode"),
    ({"SWA_EXT_SGLANG": "1", "SWA_EXT_SHARED": "1"}, "swa_ext: SWA_EXT_SHARED is gone: the shared mode is "
                                                     "SWA_EXT_SGLANG=shared (unset SWA_EXT_SHARED; SWA_EXT_SGLANG is 1 now)"),
    ({"SWA_EXT_SHARED": "1"}, "SWA_EXT_SGLANG is unset now"),
])
def test_a_switch_swa_ext_cannot_serve_ends_the_process_in_one_line(monkeypatch, variables, why):
    """SGLang's plugin loader only logs an Exception: SystemExit is not one."""
    for name in ("SWA_EXT_SGLANG", "SWA_EXT_SHARED"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stopped:
        sglang_plugin.plugin()
    assert not isinstance(stopped.value, Exception)
    message = str(stopped.value)
    assert "\n" not in message and message.startswith("swa_ext: ") and why in message, message
    assert adapter.installed() == []


def test_the_switch(monkeypatch):
    monkeypatch.delenv("SWA_EXT_SHARED", raising=False)
    original_pool = kv_cache_configurator.SWAKVPool
    monkeypatch.setenv("SWA_EXT_SGLANG", "shared")
    try:
        sglang_plugin.plugin()
        assert kv_cache_configurator.SWAKVPool is shared_pool.SharedSWAKVPool
        built = kv_cache_configurator.SWATokenToKVPoolAllocator(256, 256, PAGE, torch.float16, "cpu",
                                                                RecordingSWAKVCache(), False)
        assert type(built) is SharedSWATokenToKVPoolAllocator
        assert adapter.installed() == ["SWAKVPool", "SWATokenToKVPoolAllocator"]  # not the single-pool ones
    finally:
        adapter.uninstall()
    assert kv_cache_configurator.SWAKVPool is original_pool
    with pytest.raises(ValueError, match="the shared mode has no lockstep"):
        adapter.install(lockstep=True, shared=True)


# --- the slot-kind check (SWA_EXT_DEBUG=1, each scheduler step) ---------------------------


def batch_of(alloc, rows):
    """Stands for SGLang's ScheduleBatch: requests whose req_to_token rows are ``rows``."""
    req_to_token = torch.zeros((len(rows), 256), dtype=torch.int64)
    reqs = []
    for i, row in enumerate(rows):
        req_to_token[i, :len(row)] = row
        reqs.append(types.SimpleNamespace(kv=types.SimpleNamespace(req_pool_idx=i, kv_allocated_len=len(row))))
    reqs.append(types.SimpleNamespace(kv=types.SimpleNamespace(req_pool_idx=None, kv_allocated_len=0)))  # no KV yet
    return types.SimpleNamespace(token_to_kv_pool_allocator=alloc, reqs=reqs,
                                 req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token))


def test_the_slot_kind_check_finds_a_slot_in_use_as_full_and_as_swa():
    from swa_ext.sglang.shared import SlotKindCollision, check_slot_kinds

    alloc = shared()
    first, second = prompt(alloc, 40, 20), prompt(alloc, 70, 30)
    batch = batch_of(alloc, [first, second])
    check_slot_kinds(batch)  # what the allocator hands out holds one kind
    swa_of_second = int(alloc.translate_loc_from_full_to_swa(second[-1:]))
    mapping = alloc.full_to_swa_index_mapping
    saved = mapping.clone()
    mapping[first[-1]] = second[0]  # a running request's full slot also an SWA slot
    with pytest.raises(SlotKindCollision, match=rf"SWA slots in use as full slots \[{int(second[0])}\] \(1 in all\)"):
        check_slot_kinds(batch)
    mapping.copy_(saved)
    mapping[first[-1]] = swa_of_second  # one SWA slot for two full tokens
    with pytest.raises(SlotKindCollision, match=rf"mapped from two full slots \[{swa_of_second}\]"):
        check_slot_kinds(batch)
    mapping.copy_(saved)
    check_slot_kinds(batch)


def test_at_parent_k_3_a_slot_is_in_use_where_its_bytes_are():
    """Full and SWA slots number the small and the large side's rows: the same number on
    both sides is two places in the storage, and an SWA slot collides with the full slots
    whose bytes it shares (small-side slots j*k .. j*k+k-1 for large-side slot j)."""
    from swa_ext.sglang.shared import SlotKindCollision, check_slot_kinds

    alloc = SharedSWATokenToKVPoolAllocator(3 * 256, 256, PAGE, torch.float16, "cpu", RecordingSWAKVCache(parent_k=3),
                                            False)
    full = prompt(alloc, 40, 20)
    swa = alloc.translate_loc_from_full_to_swa(full[-20:])
    assert bool(torch.isin(swa, full).any())  # numbers both sides use, in other bytes
    batch = batch_of(alloc, [full])
    check_slot_kinds(batch)
    mapping = alloc.full_to_swa_index_mapping
    mapping[full[0]] = int(full[-1]) // 3  # an SWA slot on the last full token's bytes
    with pytest.raises(SlotKindCollision, match=rf"SWA slots in use as full slots \[{int(full[-1]) // 3}\]"):
        check_slot_kinds(batch)
