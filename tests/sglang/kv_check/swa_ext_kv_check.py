"""A test-only SGLang plugin (pd_harness.node_env, test_engine.run_engine and
test_spec_engine.engine_env put this directory, with its dist-info, on an engine's
PYTHONPATH; SGLang loads it in each of its processes).

``SWA_EXT_TEST_DUMMY_WEIGHTS=r`` draws SGLang's dummy weights (``--load-format dummy``, a
model and its draft from their configs alone) uniform in [-r, r] rather than SGLang's
[-1e-3, 1e-3], under which a tiny model's greedy output ignores its KV cache (the tiny
gpt-oss repeats one token): at 0.2 the outputs depend on the KV, as those of the engine
tests' checkpoints do (tests/sglang/conftest.py).

``SWA_EXT_TEST_KV_FAULT`` plants a fault in the shared mode's KV storage, so that a test
shows its comparison of outputs can fail:
  ``write_row_off``: every SWA-layer KV write lands one slot further on (the last row's
  one slot back);
  ``view_layer_off``: SWA layer i's views are SWA layer i + 1's in the one storage (the last
  the last's), so two SWA layers write one buffer.
"""
import os

FAULT_VARIABLE = "SWA_EXT_TEST_KV_FAULT"
FAULTS = ("write_row_off", "view_layer_off")
DUMMY_WEIGHTS_VARIABLE = "SWA_EXT_TEST_DUMMY_WEIGHTS"


def _widen_dummy_weights(bound):
    import functools

    from sglang.srt.model_loader import loader, weight_utils

    loader.initialize_dummy_weights = functools.partial(weight_utils.initialize_dummy_weights, low=-bound,
                                                        high=bound)


def _plant(fault):
    import dataclasses

    import torch
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    from swa_ext.sglang import shared_pool

    if fault == "view_layer_off":
        lay_out_storage = shared_pool.SharedSWAKVPool._lay_out_storage

        def shifted_views(self):
            lay_out_storage(self)
            swa = self._sides["swa"]
            last = len(swa.k_buffer) - 1
            if last < 1:
                raise RuntimeError(f"{FAULT_VARIABLE}=view_layer_off needs two SWA layers or more")
            # A rotation of whole layers would still give each SWA layer a buffer of its own
            # (harmless); one layer off, the last two SWA layers share the last buffer.
            swa.adopt([swa.k_buffer[min(i + 1, last)] for i in range(last + 1)],
                      [swa.v_buffer[min(i + 1, last)] for i in range(last + 1)])

        shared_pool.SharedSWAKVPool._lay_out_storage = shifted_views
    else:
        def set_one_row_off(self, layer, loc_info, cache_k, cache_v, *args, **kwargs):
            if self.layers_mapping[layer.layer_id][1]:
                rows = self.swa_kv_pool.size + self.swa_kv_pool.page_size
                loc = loc_info.swa_loc
                loc_info = dataclasses.replace(loc_info, swa_loc=torch.where(loc + 1 < rows, loc + 1, loc - 1))
            return SWAKVPool.set_kv_buffer(self, layer, loc_info, cache_k, cache_v, *args, **kwargs)

        shared_pool.SharedSWAKVPool.set_kv_buffer = set_one_row_off


def plugin():
    bound = os.environ.get(DUMMY_WEIGHTS_VARIABLE)
    if bound:
        _widen_dummy_weights(float(bound))
    fault = os.environ.get(FAULT_VARIABLE)
    if fault:
        if fault not in FAULTS:
            raise SystemExit(f"{FAULT_VARIABLE}: one of {FAULTS}, got {fault!r}")
        _plant(fault)
