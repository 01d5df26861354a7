"""``swa-ext simulate``: a PD decode node replayed over a request trace under the
``full``, ``evict`` and ``tail`` SWA policies, SGLang 0.5.23 as it ships (``sglang``),
swa_ext in SGLang (``swa_ext``), and with one budget for full and SWA KV: SGLang's
``--enable-unified-memory`` (``sglang_unified``) and swa_ext's shared mode
(``swa_ext_shared``) (docs/simulator.md).

Five modules, each importing only those before it: ``scenario`` (settings and pool
sizing), ``node`` (one policy's decode node), ``budgets`` (the one-budget nodes),
``runs`` (the comparison and its conclusion), ``report`` (JSON, table, plot). Needs the
``sim`` extra (tqdm, matplotlib).
"""

import importlib.util

# The sim extra of setup.py: what the simulator needs beyond torch.
EXTRA_MODULES = ("numpy", "tqdm", "matplotlib")
_missing = [name for name in EXTRA_MODULES if importlib.util.find_spec(name) is None]
if _missing:
    raise ImportError(f"the simulator needs {', '.join(_missing)}: pip install 'swa_ext[sim]'")

from .budgets import Arena, SharedDecodeNode, UnifiedDecodeNode, node_class
from .node import DecodeNode, PolicyResult, default_allocator, sglang_prealloc_demand
from .report import ROW_DESCRIPTIONS, format_conclusion, format_table, notes, plot, report
from .runs import PlannedRun, conclusion, default_columns, left_out_columns, plan_runs, run, simulate, simulate_config
from .scenario import (ARENA, COLUMNS, DEFAULT_RESERVED_DECODE_TOKENS, EVICTING, GIB, IN_SGLANG, MAX_POOL_TOKENS,
                       POLICIES, SGLANG, SGLANG_DEFAULT_EVICTION_INTERVAL, SGLANG_DEFAULT_SWA_RATIO, SGLANG_UNIFIED,
                       SHARED, SPLIT, SWA_EXT, SWA_EXT_EVICTION_INTERVAL, SWA_EXT_SHARED, SWA_RATIO_SWEEP,
                       TUNED_ELSEWHERE, ArenaGeometry, PolicyConfig, Scenario, SimulationError, arena_geometry,
                       capacity_bound, entry_bytes, fits_empty_node, parent_padding, parent_page_k, plan_scenario,
                       policy_config, pool_sizes, request_cap_pool_sizes, sglang_config, sglang_decode_extra_slots,
                       sglang_swa_pool_tokens, sglang_swa_request_cap, shared_config, shared_refusal, small_side,
                       tail_swa_pages_bound, unified_config, unified_refusal)

__all__ = [
    "ARENA", "COLUMNS", "DEFAULT_RESERVED_DECODE_TOKENS", "EVICTING", "GIB", "IN_SGLANG", "MAX_POOL_TOKENS", "POLICIES",
    "ROW_DESCRIPTIONS", "SGLANG", "SGLANG_DEFAULT_EVICTION_INTERVAL", "SGLANG_DEFAULT_SWA_RATIO", "SGLANG_UNIFIED",
    "SHARED", "SPLIT", "SWA_EXT", "SWA_EXT_EVICTION_INTERVAL", "SWA_EXT_SHARED", "SWA_RATIO_SWEEP",
    "TUNED_ELSEWHERE", "Arena", "ArenaGeometry", "DecodeNode", "PlannedRun", "PolicyConfig", "PolicyResult",
    "Scenario", "SharedDecodeNode", "SimulationError", "UnifiedDecodeNode", "arena_geometry", "capacity_bound",
    "conclusion", "default_allocator", "default_columns", "entry_bytes", "fits_empty_node", "format_conclusion",
    "format_table", "left_out_columns", "node_class", "notes", "parent_padding", "parent_page_k", "plan_runs",
    "plan_scenario", "plot", "policy_config", "pool_sizes", "report", "request_cap_pool_sizes", "run",
    "shared_config", "shared_refusal", "simulate", "simulate_config", "sglang_config", "sglang_decode_extra_slots",
    "sglang_prealloc_demand", "sglang_swa_pool_tokens", "sglang_swa_request_cap", "small_side", "tail_swa_pages_bound", "unified_config",
    "unified_refusal",
]
