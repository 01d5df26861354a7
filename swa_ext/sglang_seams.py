"""The SGLang swa_ext is built against, and every place swa_ext meets it (its seams).

A seam is a symbol of SGLang that swa_ext patches, calls, subclasses, overrides or reads:
a module, an attribute path in it and, for a callable, its parameter names. ``moved()``
checks them all with ``inspect`` before anything is patched, so an SGLang whose code moved
is refused at start-up, naming what moved, rather than failing in the middle of serving.

This module imports nothing of SGLang's until it is asked to check: the check must run
before ``swa_ext.sglang`` is imported, since importing that package reads seams.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import os

SUPPORTED_VERSION = "0.5.23"
# Set to the installed SGLang's version, swa_ext tries to serve that version (its seams
# still checked); set to anything else, it is refused as naming another SGLang.
VERSION_OVERRIDE_VARIABLE = "SWA_EXT_SGLANG_VERSION_OVERRIDE"

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator"
_SWA = "sglang.srt.mem_cache.allocator.swa"
_PAGED = "sglang.srt.mem_cache.allocator.paged"
_TOKEN = "sglang.srt.mem_cache.allocator.token"
_BATCH = "sglang.srt.managers.schedule_batch"
_PREFIX_CACHE = "sglang.srt.mem_cache.base_prefix_cache"
_RUNTIME = "sglang.srt.runtime_context"

# What each pool class answers for SGLang with swa_ext's native methods or an adapter's
# override (adapters.py, lockstep.py): the same names and parameters as SGLang's.
_POOL_METHODS = (
    ("alloc", "self, need_size"), ("available_size", "self"), ("clear", "self"), ("debug_print", "self"),
    ("free", "self, free_index"), ("free_group_begin", "self"), ("free_group_end", "self"),
    ("free_page_ids", "self, page_ids"), ("free_segment", "self, free_index, start_pos"),
    ("get_all_free_pages", "self"), ("get_kvcache", "self"), ("merge_and_sort_free", "self"),
    ("resize", "self, config"), ("size_full", None),
)

# (module, attribute path, parameter names of the callable or None for an attribute).
# A path ``Class().name`` is an attribute of the class's instances: a dataclass field,
# or a name the class's __init__ sets.
SEAMS = (
    # installer.py: the names swa_ext rebinds in the module that builds allocators, and
    # the configurator's methods it wraps.
    (_CONFIGURATOR, "SWATokenToKVPoolAllocator", None),
    (_CONFIGURATOR, "PagedTokenToKVPoolAllocator", None),
    (_CONFIGURATOR, "TokenToKVPoolAllocator", None),
    (_CONFIGURATOR, "SWAKVPool", None),
    (_CONFIGURATOR, "KVCacheConfigurator._init_pools", "self, sizes, req_to_token_pool, token_to_kv_pool_allocator"),
    (_CONFIGURATOR, "KVCacheConfigurator._resolve_memory_pool_config", "self, pre_model_load_memory"),
    (_CONFIGURATOR, "get_memory", ""),
    # A scheduler that the shared mode refused exits with installer.REFUSED_EXIT_STATUS;
    # the Engine or server process that waits for it exits with the same status.
    ("sglang.srt.entrypoints.engine", "_scheduler_died_error", "rank, proc"),
    ("sglang.srt.platforms", "current_platform.get_paged_allocator_cls", ""),
    ("sglang.srt.utils", "is_npu", ""),
    ("sglang.srt.utils", "get_bool_env_var", "name, default"),
    # The allocator classes swa_ext's adapters are (adapters.py, lockstep.py, shared.py).
    (_SWA, "SWATokenToKVPoolAllocator.__init__",
     "self, size, size_swa, page_size, dtype, device, kvcache, need_sort, req_to_token_pool"),
    *((_SWA, f"SWATokenToKVPoolAllocator.{name}", params) for name, params in (
        ("alloc", "self, need_size"),
        ("alloc_decode", "self, seq_lens, seq_lens_cpu, last_loc"),
        ("alloc_extend", "self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens"),
        ("alloc_extend_swa_tail",
         "self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, swa_tail_len"),
        ("available_size", "self"), ("clear", "self"), ("clear_full_to_swa_mapping", "self, full_indices"),
        ("debug_print", "self"), ("free", "self, free_index"), ("free_full", "self, free_index"),
        ("free_full_segment", "self, free_index, start_pos"), ("free_group_begin", "self"),
        ("free_group_end", "self"), ("free_segment", "self, free_index, start_pos"), ("free_swa", "self, free_index"),
        ("free_swa_segment", "self, free_index, start_pos"), ("full_available_size", "self"),
        ("get_kvcache", "self"), ("new_pages_available", "self, num_full_pages, num_swa_pages"),
        ("resize", "self, config"), ("set_full_to_swa_mapping", "self, full_indices, swa_indices"),
        ("size", None), ("size_full", None), ("size_swa", None), ("swa_available_size", "self"),
        ("translate_loc_from_full_to_swa", "self, kv_indices"),
        # The scheduler's capacity gates the shared mode prices on one budget (shared.py).
        ("check_decode_capacity", "self, num_tokens, tree_cache, requests, spec_algorithm"),
        ("create_prefill_budget", "self, tree_cache, num_mixed_decode_tokens"),
        ("evict_to_free_tokens", "self, tree_cache, num_tokens"),
        ("max_new_tokens_for_memory",
         "self, input_tokens, max_new_tokens, token_capacity, sliding_window_size, chunk_size"),
        ("prealloc_ceiling_fits", "self, full_tokens, swa_tokens"),
        ("prealloc_fits", "self, tree_cache, full_tokens, swa_tokens, full_budget_tokens, swa_budget_tokens"),
        ("prealloc_fits_assumes_reclaim", "self"),
        ("reclaim_for_prealloc", "self, tree_cache, full_tokens, swa_tokens"),
        ("swa_capacity_and_available", "self, full_capacity, swa_capacity"),
    )),
    (_PAGED, "PagedTokenToKVPoolAllocator.__init__", "self, size, page_size, dtype, device, kvcache, need_sort"),
    (_PAGED, "PagedTokenToKVPoolAllocator.alloc_decode", "self, seq_lens, seq_lens_cpu, last_loc"),
    (_PAGED, "PagedTokenToKVPoolAllocator.alloc_extend",
     "self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, num_new_pages"),
    *((_PAGED, f"PagedTokenToKVPoolAllocator.{name}", params) for name, params in _POOL_METHODS),
    (_TOKEN, "TokenToKVPoolAllocator.__init__", "self, size, dtype, device, kvcache, need_sort"),
    (_TOKEN, "TokenToKVPoolAllocator.alloc_decode", "self, args, kwargs"),
    (_TOKEN, "TokenToKVPoolAllocator.alloc_extend", "self, args, kwargs"),
    *((_TOKEN, f"TokenToKVPoolAllocator.{name}", params) for name, params in _POOL_METHODS),
    # lockstep.py: the shadow's view of the KV pool.
    ("sglang.srt.mem_cache.base_swa_memory_pool", "BaseSWAKVPool.get_state_buf_infos", "self"),
    ("sglang.srt.mem_cache.base_swa_memory_pool", "BaseSWAKVPool.register_mapping", "self, full_to_swa_index_mapping"),
    ("sglang.srt.mem_cache.base_swa_memory_pool", "BaseSWAKVPool.translate_loc_from_full_to_swa", "self, kv_indices"),
    # shared.py, shared_pool.py: the shared mode's gates, KV pool and sizing.
    (_RUNTIME, "get_server_args", ""),
    (_RUNTIME, "attention_backends", ""),
    (_RUNTIME, "get_memory", ""),
    (_RUNTIME, "get_parallel", ""),
    (_PREFIX_CACHE, "EvictParams", "num_tokens, swa_num_tokens, mamba_num"),
    ("sglang.srt.mem_cache.prefill_budget", "SharedSWAPrefillBudget", "args, num_mixed_decode_tokens, kwargs"),
    ("sglang.srt.mem_cache.prefill_budget", "estimate_swa_kv_tokens",
     "extend_input_len, max_new_tokens, sliding_window_size, page_size, allocation_limit, host_hit_length"),
    ("sglang.srt.mem_cache.swa_memory_pool", "SWAKVPool.__init__",
     "self, size, size_swa, page_size, dtype, head_num, head_dim, swa_attention_layer_ids, full_attention_layer_ids, "
     "device, token_to_kv_pool_class, full_kv_pool_class, swa_kv_pool_class, full_kv_pool_kwargs, swa_kv_pool_kwargs, "
     "enable_memory_saver, kwargs"),
    ("sglang.srt.mem_cache.swa_memory_pool", "SWAKVPool.get_kv_size_bytes", "self"),
    ("sglang.srt.mem_cache.memory_pool", "MHATokenToKVPool._create_buffers_normal", "self"),
    # shared_pool.py: the one storage's views in SGLang's MHA pools, and what refuses them.
    *(("sglang.srt.mem_cache.memory_pool", f"MHATokenToKVPool.{name}", "self")
      for name in ("_build_kv_buffer_descs", "_init_data_ptrs_and_strides")),
    ("sglang.srt.mem_cache.memory_pool", "MHATokenToKVPool._finalize_allocation_log", "self, num_tokens"),
    *(("sglang.srt.mem_cache.memory_pool", f"MHATokenToKVPool().{name}", None) for name in (
        "use_native_move_kv_cache", "kv_cache_layout", "head_num", "head_dim", "v_head_dim")),
    *(("sglang.srt.mem_cache.memory_pool", f"KVCache().{name}", None) for name in (
        "store_dtype", "memory_saver_adapter", "custom_mem_pool", "enable_custom_mem_pool")),
    ("sglang.srt.constants", "GPU_MEMORY_TYPE_KV_CACHE", None),
    (_RUNTIME, "get_disagg", ""),
    (_CONFIGURATOR, "KVCacheConfigurator().kv_cache_dtype", None),
    # shared_pool.py: a draft model's KV in the one budget: which drafts SGLang prices per
    # full token, the draft layers it prices, the draft's shape.
    (_RUNTIME, "get_spec", ""),
    *((_CONFIGURATOR, f"KVCacheConfigurator().{name}", None) for name in ("spec_aux_config", "page_size")),
    *(("sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state",
       f"SpecAuxHiddenStateConfig.{name}", None) for name in ("eagle_draft_num_layers", "eagle_draft_swa_num_layers")),
    *(("sglang.srt.speculative.spec_info", f"SpeculativeAlgorithm.{name}", "self")
      for name in ("is_speculative", "is_ngram", "is_eagle", "is_frozen_kv_mtp", "is_standalone")),
    # shared_pool.py: each attention layer's id and window, against the pool's layer split.
    *(("sglang.srt.layers.radix_attention", f"RadixAttention().{name}", None)
      for name in ("layer_id", "sliding_window_size")),
    # hooks.py and the native eviction (csrc/sglang): the scheduler's per-step eviction,
    # the requests' and their KV states' fields it reads, the tree cache it asks.
    (_BATCH, "ScheduleBatch.maybe_evict_swa", "self"),
    (_BATCH, "ScheduleBatch._swa_eviction_trigger", "self, sliding_window_size, eviction_interval"),
    *((_BATCH, f"ScheduleBatch().{name}", None)
      for name in ("reqs", "tree_cache", "token_to_kv_pool_allocator", "forward_mode", "req_to_token_pool")),
    (_BATCH, "_is_hip", None),
    (_BATCH, "Req.seqlen", None),
    *((_BATCH, f"Req().{name}", None) for name in ("rid", "decode_batch_idx", "kv", "origin_input_ids", "output_ids")),
    (_BATCH, "ReqKvInfo.get_evicted_seqlen", "self, component_type"),
    (_BATCH, "ReqKvInfo.set_evicted_seqlen", "self, component_type, length"),
    (_BATCH, "ReqKvInfo.holds_kv", None),
    (_BATCH, "ReqKvInfo.swa_dead_lo", "self, page_size"),
    *((_BATCH, f"ReqKvInfo().{name}", None) for name in (
        "req_pool_idx", "component_evicted_seqlens", "cache_protected_len", "swa_evict_floor", "kv_allocated_len")),
    ("sglang.srt.mem_cache.unified_cache.component_type", "ComponentType.SWA", None),
    ("sglang.srt.mem_cache.common", "free_swa_out_of_window_slots",
     "req, pre_len, sliding_window_size, page_size, req_to_token_pool, token_to_kv_pool_allocator, "
     "supports_prefix_sharing, retain_floor, component_type, free_segment, eviction_interval"),
    *((_PREFIX_CACHE, f"BasePrefixCache.{name}", params) for name, params in (
        ("evict_sliding_windows", "self, req, pre_len, eviction_interval"), ("swa_retain_floor", "self, req"),
        ("supports_swa", "self"), ("supports_auxiliary_swa", "self"), ("supports_prefix_sharing", "self"),
        ("swa_retain_window", None), ("evict_for_alloc", "self, params, allocation_reclaim_satisfied"),
        ("full_evictable_size", "self"), ("swa_evictable_size", "self"))),
    *(("sglang.srt.environ", f"envs.{setting}.{field}", None)
      for setting in ("SGLANG_SWA_EVICTION_INTERVAL", "SGLANG_OPT_RELEASE_PREFILL_SWA",
                      "SGLANG_AMD_USE_FLYDSL_MEGA_MOE")
      for field in ("name", "get", "_set_to_none")),
)


def installed_version():
    """The installed SGLang's version, or None where SGLang is not installed."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def version_refusal(environ=os.environ):
    """Why swa_ext will not serve the installed SGLang's version, or None."""
    found, override = installed_version(), environ.get(VERSION_OVERRIDE_VARIABLE, "").strip()
    if found is None:
        return "SGLang is not installed in this environment (pip install 'swa_ext[sglang]')"
    if override and override != found:
        return (f"{VERSION_OVERRIDE_VARIABLE}={override} names another SGLang than the one installed ({found}): "
                f"set it to {found} to try that version, or unset it")
    if found != SUPPORTED_VERSION and not override:
        return (f"swa_ext supports SGLang {SUPPORTED_VERSION}, this is {found}: install sglang=={SUPPORTED_VERSION} "
                f"(pip install 'swa_ext[sglang]'), or set {VERSION_OVERRIDE_VARIABLE}={found} to try this version "
                f"(its seams are still checked)")
    return None


_MISSING = object()


def _instance_attributes(cls):
    if dataclasses.is_dataclass(cls):
        return {field.name for field in dataclasses.fields(cls)}
    return set(cls.__init__.__code__.co_names)  # the names __init__ reads or sets on its objects


def _why_moved(module, path, params):
    """Why one seam is not where swa_ext expects it, or None."""
    try:
        found = importlib.import_module(module)
    except Exception as e:  # an SGLang module that does not import at all: every seam in it moved
        return f"module does not import ({type(e).__name__}: {e})"
    owner_path, _, instance_attribute = path.partition("().")
    for name in owner_path.split("."):
        # getattr_static: a class answers for its property without running it.
        found = inspect.getattr_static(found, name, _MISSING) if isinstance(found, type) else \
            getattr(found, name, _MISSING)
        if found is _MISSING:
            return "missing"
    if instance_attribute:
        return None if instance_attribute in _instance_attributes(found) else "missing"
    if params is None:
        return None
    try:
        function = found.__func__ if isinstance(found, (staticmethod, classmethod)) else found
        got = ", ".join(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return "not a callable"
    return None if got == params else f"parameters ({got}), expected ({params})"


def moved():
    """Each seam that moved, with why: [("module:path", why)], empty when all are where
    swa_ext expects them."""
    found = []
    for module, path, params in SEAMS:
        why = _why_moved(module, path, params)
        if why is not None:
            found.append((f"{module}:{path}", why))
    return found
