"""A test-only SGLang plugin (pd_harness.node_env, test_engine.run_engine and
test_spec_engine.engine_env put this directory, with its dist-info, on an engine's
PYTHONPATH; SGLang loads it in each of its processes).

``SWA_EXT_TEST_KV_FAULT`` plants a fault in the shared mode's KV storage, so that a test
shows its comparison of outputs can fail (the engine tests' weights make the outputs
depend on the KV: tests/sglang/conftest.py):
  ``write_row_off``: every SWA-layer KV write lands one slot further on (the last row's
  one slot back);
  ``view_layer_off``: SWA layer i's view is over full layer i + 1's buffers (the last
  over the last), so two SWA layers write one buffer.
"""
import os

FAULT_VARIABLE = "SWA_EXT_TEST_KV_FAULT"
FAULTS = ("write_row_off", "view_layer_off")


def _plant(fault):
    import dataclasses

    import torch
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    from swa_ext.sglang import shared_pool

    if fault == "view_layer_off":
        build_view = shared_pool.SharedSWAKVPool._swa_layers_view

        def shifted_view(self, **kwargs):
            view = build_view(self, **kwargs)
            last = len(view.k_buffer) - 1
            if last < 1:
                raise RuntimeError(f"{FAULT_VARIABLE}=view_layer_off needs two SWA layers or more")
            # A rotation of whole layers would still give each SWA layer a buffer of its own
            # (harmless); one layer off, the last two SWA layers share the last buffer.
            view.k_buffer = [view.k_buffer[min(i + 1, last)] for i in range(last + 1)]
            view.v_buffer = [view.v_buffer[min(i + 1, last)] for i in range(last + 1)]
            return view

        shared_pool.SharedSWAKVPool._swa_layers_view = shifted_view
    else:
        def set_one_row_off(self, layer, loc_info, cache_k, cache_v, *args, **kwargs):
            if self.layers_mapping[layer.layer_id][1]:
                rows = self.swa_kv_pool.size + self.swa_kv_pool.page_size
                loc = loc_info.swa_loc
                loc_info = dataclasses.replace(loc_info, swa_loc=torch.where(loc + 1 < rows, loc + 1, loc - 1))
            return SWAKVPool.set_kv_buffer(self, layer, loc_info, cache_k, cache_v, *args, **kwargs)

        shared_pool.SharedSWAKVPool.set_kv_buffer = set_one_row_off


def plugin():
    fault = os.environ.get(FAULT_VARIABLE)
    if fault:
        if fault not in FAULTS:
            raise SystemExit(f"{FAULT_VARIABLE}: one of {FAULTS}, got {fault!r}")
        _plant(fault)
