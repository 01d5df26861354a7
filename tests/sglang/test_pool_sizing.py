"""The simulator's sglang column against SGLang 0.5.23's own pool sizing
(model_executor/pool_configurator.py): the fallback SWA ratio, the two pools it splits a
KV memory into at a ratio, and, with --max-running-requests on a decode node (radix cache
off), the SWA pool it sizes from the request cap and the full pool it leaves."""

import typing
from types import SimpleNamespace

import pytest
import torch

import sglang.srt.model_executor.pool_configurator as configurator
from sglang.srt.arg_groups.fields.schedule import Schedule

from swa_ext import simulator
from swa_ext.models import get_model
from swa_ext.traces import Request

GIB = 1 << 30
MODELS = ("gpt-oss-20b", "gemma-3-27b", "gemma-2-27b", "mimo-v2-flash", "llama-4-scout")
ONE_REQUEST = [Request(0, 0.0, 100, 10)]


def _configurator(cls, model, ratio, page_size):
    """SGLang's configurator for a model with these layer counts and bytes a token, as
    its constructor leaves it without draft model, fused entries or unified memory."""
    c = object.__new__(cls)
    c._full_layers_num, c._swa_layers_num = model.full_layers, model.swa_layers
    # K and V of one layer of each side, bfloat16.
    c._full_per_token = model.kv_heads * (model.head_dim + model.v_head_dim) * 2
    c._swa_per_token = model.swa_kv_heads * (model.swa_head_dim + model.swa_v_head_dim) * 2
    c._swa_full_tokens_ratio = ratio
    c._sliding_window_size, c._page_size, c._enable_unified_memory = model.window, page_size, False
    c._draft_full_layers_num = c._draft_swa_layers_num = c._draft_swa_full_layers_num = c._draft_cell_size = 0
    c._fused_full_entry = c._fused_swa_entry = None
    c._recompute_cell_size()
    return c


def test_fallback_ratio_is_sglangs():
    field = typing.get_type_hints(Schedule, include_extras=True)["swa_full_tokens_ratio"]
    fallback = next(m.fallback for m in field.__metadata__ if hasattr(m, "fallback"))
    assert simulator.SGLANG_DEFAULT_SWA_RATIO == fallback == 0.8


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("kv_memory_gib, page_size", [(40.0, 64), (7.3, 16), (80.0, 1)])
def test_ratio_sizing_is_sglangs(name, kv_memory_gib, page_size):
    model = get_model(name)
    for ratio in (*simulator.SWA_RATIO_SWEEP, simulator.SGLANG_DEFAULT_SWA_RATIO):
        ours = simulator.pool_sizes(model, kv_memory_gib * GIB, page_size, ratio)
        sizer = _configurator(configurator.HybridSWAPoolConfigurator, model, ratio, page_size)
        try:
            theirs = sizer.calculate_pool_sizes(int(kv_memory_gib * GIB), page_size)
        except ValueError:  # SGLang refuses an SWA pool that cannot hold one window and a page
            assert ours[1] <= model.window + page_size, ratio
            continue
        assert ours == (theirs.full_max_total_num_tokens, theirs.swa_max_total_num_tokens), ratio
    scenario = simulator.plan_scenario(ONE_REQUEST, model, page_size=page_size, kv_memory_gib=kv_memory_gib)
    config = simulator.sglang_config(scenario)
    assert (config.size_full, config.size_swa) == simulator.pool_sizes(model, kv_memory_gib * GIB, page_size, 0.8)


@pytest.fixture
def decode_node(monkeypatch):
    """SGLang's view of a PD decode node without speculative decoding; sets its
    max_running_requests and eviction interval."""
    def configure(max_running, interval):
        monkeypatch.setenv("SGLANG_SWA_EVICTION_INTERVAL", str(interval))
        extra = 2 * max_running if max_running <= 32 else 0  # pd_disaggregation_hook's default
        monkeypatch.setattr(configurator, "get_spec", lambda: SimpleNamespace(
            speculative_num_draft_tokens=None, speculative_algorithm=None))
        monkeypatch.setattr(configurator, "get_schedule", lambda: SimpleNamespace(
            max_running_requests=max_running, disable_overlap_schedule=False, chunked_prefill_size=8192))
        monkeypatch.setattr(configurator, "get_disagg", lambda: SimpleNamespace(
            disaggregation_mode="decode", disaggregation_decode_extra_slots=extra))
        assert simulator.sglang_decode_extra_slots(max_running) == extra
    return configure


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("max_running, interval, page_size", [(256, 128, 64), (899, 1, 64), (16, 128, 16),
                                                                (32, 1, 1), (33, 64, 64)])
def test_request_cap_sizing_is_sglangs(decode_node, name, max_running, interval, page_size):
    model = get_model(name)
    decode_node(max_running, interval)
    cap = configurator.compute_swa_request_cap(page_size=page_size, window=model.window, attn_dp_size=1)
    assert simulator.sglang_swa_pool_tokens(model.window, page_size, interval, max_running) == -(-cap // page_size) * page_size
    sizer = _configurator(configurator.SWARequestCapPoolConfigurator, model, 0.8, page_size)
    sizer._swa_cap = cap
    scenario = simulator.plan_scenario(ONE_REQUEST, model, page_size=page_size, kv_memory_gib=40.0,
                                       eviction_interval=interval, max_running_requests=max_running)
    try:
        theirs = sizer.calculate_pool_sizes(40 * GIB, page_size)
    except RuntimeError:  # the SWA pool of the cap leaves no full pool: refused alike
        with pytest.raises(simulator.SimulationError, match="no full pool"):
            simulator.sglang_config(scenario)
        return
    config = simulator.sglang_config(scenario)
    assert (config.size_full, config.size_swa) == (theirs.full_max_total_num_tokens, theirs.swa_max_total_num_tokens)
    assert config.max_running == max_running and config.eviction_interval == interval


# The published configs' layer layouts, as SGLang 0.5.23 reads them (architecture, the
# config fields get_hybrid_layer_ids takes): gpt-oss's layer_types alternate from a sliding
# layer; Llama 4 needs only its layer count; MiMo-V2-Flash's hybrid_layer_pattern is 5 SWA
# to 1 full (1 = SWA); Step-3.5-Flash's layer_types, a full then 3 sliding layers, cover its
# 45 layers and 3 MTP layers.
PUBLISHED = {
    "gpt-oss-20b": (["GptOssForCausalLM"], dict(num_hidden_layers=24,
                                                  layer_types=["sliding_attention", "full_attention"] * 12)),
    "gpt-oss-120b": (["GptOssForCausalLM"], dict(num_hidden_layers=36,
                                                   layer_types=["sliding_attention", "full_attention"] * 18)),
    "llama-4-scout": (["Llama4ForConditionalGeneration"], dict(num_hidden_layers=48)),
    "mimo-v2-flash": (["MiMoV2FlashForCausalLM"], dict(num_hidden_layers=48,
                                                         hybrid_layer_pattern=[0, 1, 1, 1, 1, 1] * 8)),
    "step-3.5-flash": (["Step3p5ForCausalLM"], dict(num_hidden_layers=45, layer_types=(
        ["full_attention"] + ["sliding_attention"] * 3) * 12)),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_hybrid_model_facts_are_sglangs(name):
    """Each model SGLang 0.5.23 serves hybrid: SGLang takes it as hybrid, splits its layers
    as the simulator counts them, and lays out each side's entry (every layer's K and V
    rows, bf16) in the bytes the simulator prices."""
    from sglang.srt.configs.model_config import get_hybrid_layer_ids, is_hybrid_swa_model
    from sglang.srt.mem_cache.unified_memory_pool import MHASubPoolSpec

    model = get_model(name)
    archs, fields = PUBLISHED[name]
    assert is_hybrid_swa_model(archs) and model.sglang_hybrid
    swa_ids, full_ids = get_hybrid_layer_ids(archs, SimpleNamespace(**fields))
    assert (len(full_ids), len(swa_ids)) == (model.full_layers, model.swa_layers)
    specs = [MHASubPoolSpec(name=side, layer_num=layers, grow_direction=grow, head_num=heads, head_dim=k, v_head_dim=v,
                            store_dtype=torch.bfloat16)
             for side, layers, grow, heads, k, v in (
                 ("full", model.full_layers, "down", model.kv_heads, model.head_dim, model.v_head_dim),
                 ("swa", model.swa_layers, "up", model.swa_kv_heads, model.swa_head_dim, model.swa_v_head_dim))]
    assert simulator.entry_bytes(model) == (specs[0].entry_bytes(), specs[1].entry_bytes())
    assert (model.full_bytes_per_token, model.swa_bytes_per_token) == simulator.entry_bytes(model)


@pytest.mark.parametrize("name", ["gpt-oss-20b", "mimo-v2-flash", "llama-4-scout", "step-3.5-flash"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_unified_arena_geometry_is_sglangs(name, page_size):
    """sglang_unified's arena against the one SGLang 0.5.23 builds (init_unified_swa_pools on
    the CPU) from the bytes of the pools its configurator sizes: each side's page bytes, the
    free band between the empty sides, and the pages each side can address."""
    from sglang.srt.mem_cache.unified_memory_pool import init_unified_swa_pools

    model = get_model(name)
    scenario = simulator.plan_scenario(ONE_REQUEST, model, page_size=page_size, kv_memory_gib=0.1)
    sized = simulator.sglang_config(scenario)
    layers = model.full_layers + model.swa_layers
    bundle = init_unified_swa_pools(
        device="cpu", kv_cache_dtype=torch.bfloat16, head_num=model.kv_heads, head_dim=model.head_dim,
        v_head_dim=model.v_head_dim, swa_head_num=model.swa_kv_heads, swa_head_dim=model.swa_head_dim,
        swa_v_head_dim=model.swa_v_head_dim, page_size=page_size, start_layer=0, end_layer=layers,
        swa_attention_layer_ids=list(range(model.swa_layers)),
        full_attention_layer_ids=list(range(model.swa_layers, layers)),
        total_bytes=sized.size_full * model.full_bytes_per_token + sized.size_swa * model.swa_bytes_per_token,
        enable_memory_saver=False, need_sort=False)
    allocator = bundle.token_to_kv_pool_allocator
    full, swa = allocator.full_attn_allocator, allocator.swa_attn_allocator
    virtual_pages = full.num_virtual_ids - full.min_page_index
    theirs = simulator.ArenaGeometry(full.entry_bytes_per_page, swa.entry_bytes_per_page,
                                     allocator._empty_shared_gap_bytes,
                                     min(virtual_pages, full.num_pages - full.min_page_index),
                                     min(virtual_pages, swa.num_pages - swa.min_page_index))
    assert simulator.arena_geometry(scenario) == theirs
