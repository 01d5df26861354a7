"""A test-only SGLang plugin (tests/sglang/pd_harness.py and scripts/run-pd-demo.sh put
this directory, with its dist-info, on the nodes' PYTHONPATH; SGLang loads it in each of
its processes).

With ``SWA_EXT_PD_PROBE_DIR`` set it records, in JSON files under that directory that
each process replaces whole as it goes (a server may be killed at any time):

- ``alloc-<pid>.json``: the calls a scheduler made on its hybrid SWA KV allocator, by
  method (whichever class serves: SGLang's, swa_ext's or the lockstep pair), its CPU
  copies among them (a decode retraction's backup and restore), the pools' sizes and
  their free tokens after the last call;
- ``sent-<pid>.json``: the bytes a prefill node handed to Mooncake's transfer engine
  in transfers that succeeded, by the buffer they were read from (``full``: the
  full-attention layers' KV, ``swa``: the sliding-window layers', ``aux``: per-request
  metadata), with the bytes per item (a KV page) and the number of buffers of each.

While a file ``hold-transfers`` exists in that directory, a prefill node's transfers wait
before they start (the test's way to catch requests with their KV in transfer); each
transfer that waited is counted in ``held-<pid>.json``.

Without CUDA it also makes the one CPU-only setting a Mooncake prefill node needs
(why: beside it), here and not in swa_ext; scripts/run-pd-demo.sh loads it for that.
"""
import functools
import json
import os
import threading
import time

REPORT_DIR_VARIABLE = "SWA_EXT_PD_PROBE_DIR"
# The allocator and KV-pool methods counted (those a decode node's lifecycle reaches).
# free_group_end applies the frees a group deferred; clear empties the pools (a flushed cache).
ALLOCATOR_CALLS = ("alloc", "alloc_extend", "alloc_extend_swa_tail", "alloc_decode", "free", "free_swa",
                   "free_full", "free_segment", "free_swa_segment", "free_full_segment", "free_group_end",
                   "get_cpu_copy", "load_cpu_copy", "clear")

# The longest a transfer waits for the hold to end (a test that failed leaves it).
HOLD_LIMIT_S = 300

_lock = threading.Lock()


def _writer(kind):
    os.makedirs(os.environ[REPORT_DIR_VARIABLE], exist_ok=True)
    path = os.path.join(os.environ[REPORT_DIR_VARIABLE], f"{kind}-{os.getpid()}.json")
    record = {}

    def write():
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)

    return record, write


def _count_allocator_calls():
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    counts, write = _writer("alloc")
    build = KVCacheConfigurator._init_pools

    def counted(alloc, name):
        method = getattr(alloc, name)

        @functools.wraps(method)
        def call(*args, **kwargs):
            result = method(*args, **kwargs)
            with _lock:
                counts[name] = counts.get(name, 0) + 1
                counts["free_after_last_call"] = [alloc.full_available_size(), alloc.swa_available_size()]
                write()
            return result

        return call

    @functools.wraps(build)
    def init_pools(self, *args, **kwargs):
        pools = build(self, *args, **kwargs)
        alloc = pools.token_to_kv_pool_allocator
        counts["allocator"] = f"{type(alloc).__module__}.{type(alloc).__name__}"
        counts["pool_sizes"] = [alloc.size_full, alloc.size_swa]
        for name in ALLOCATOR_CALLS:
            if hasattr(alloc, name):
                setattr(alloc, name, counted(alloc, name))  # on the instance: every caller goes through it
        write()
        return pools

    KVCacheConfigurator._init_pools = init_pools
    _count_hook_evictions(counts, write)


def _count_hook_evictions(counts, write):
    """swa_ext's scheduler hook frees out-of-window SWA KV for the whole decode batch in
    one native call (not through the allocator's methods): count the batches that freed
    pages, the requests they freed from and the batches evicted on the admitted path, as
    the native call counts them, after each decode step's maybe_evict_swa."""
    try:
        from swa_ext.sglang import hooks
    except ImportError:  # SGLang's allocator alone: its own loop frees through free_swa_segment
        return
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    start = hooks._eviction.counters()

    def counted(evict):
        @functools.wraps(evict)
        def maybe_evict_swa(batch):
            result = evict(batch)
            now = hooks._eviction.counters()
            freeing = now["freeing_batches"] - start["freeing_batches"]
            if freeing != counts.get("evict_out_of_window", 0):
                with _lock:
                    counts["evict_out_of_window"] = freeing
                    counts["evict_out_of_window_rows"] = now["freed_requests"] - start["freed_requests"]
                    # Of the batches, those the admitted path took, without the hook's Python checks.
                    counts["evict_batch"] = now["admitted_batches"] - start["admitted_batches"]
                    # No size read here: in lockstep the shadow makes SGLang's frees only after
                    # this call returns, and a read now would compare the two halfway. The free
                    # group's end, counted above, records the sizes.
                    write()
            return result

        maybe_evict_swa.counted = True
        return maybe_evict_swa

    prepare_for_decode = ScheduleBatch.prepare_for_decode

    def counting_prepare_for_decode(self):
        # swa_ext's plugin installs the hook in an order this one does not know: it is
        # wrapped at the first decode step (only the hook counts here).
        # (The hook itself, or its slot-kind-checking form under SWA_EXT_DEBUG=1.)
        if hooks.installed() and not getattr(ScheduleBatch.maybe_evict_swa, "counted", False):
            ScheduleBatch.maybe_evict_swa = counted(ScheduleBatch.maybe_evict_swa)
        return prepare_for_decode(self)

    ScheduleBatch.prepare_for_decode = counting_prepare_for_decode


def _measure_sent_bytes():
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    sent, write = _writer("sent")
    transfer = MooncakeKVManager._transfer_data

    def regions(kv_args):
        """(start, end, region name, bytes per item) of each buffer the node sends from:
        KV pages of the full-attention layers, of each state (``swa``: the sliding-window
        layers) and the per-request aux data (first token and the like)."""
        found = [("full", kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens),
                 ("aux", kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens)]
        found += [(str(getattr(state_type, "value", state_type)), ptrs, lens, items) for state_type, ptrs, lens, items
                  in zip(kv_args.state_types, kv_args.state_data_ptrs, kv_args.state_data_lens,
                         kv_args.state_item_lens)]
        return [(int(p), int(p) + int(n), name, int(item)) for name, ptrs, lens, items in found
                for p, n, item in zip(ptrs, lens, items)]

    hold = os.path.join(os.environ[REPORT_DIR_VARIABLE], "hold-transfers")
    held, write_held = _writer("held")

    @functools.wraps(transfer)
    def transfer_data(self, mooncake_session_id, transfer_blocks):
        if os.path.exists(hold):
            with _lock:
                held["transfers"] = held.get("transfers", 0) + 1
                write_held()
            deadline = time.monotonic() + HOLD_LIMIT_S
            while os.path.exists(hold) and time.monotonic() < deadline:
                time.sleep(0.05)
        ret = transfer(self, mooncake_session_id, transfer_blocks)
        if ret == 0 and transfer_blocks:
            bounds = regions(self.kv_args)
            with _lock:
                for src, _dst, length in transfer_blocks:
                    name, item = next(((name, item) for start, end, name, item in bounds
                                       if start <= src and src + length <= end), ("other", 0))
                    sent[name] = sent.get(name, 0) + int(length)
                    sent[f"{name}_item_bytes"] = item
                    sent[f"{name}_buffers"] = sum(1 for r in bounds if r[2] == name)
                sent["transfers"] = sent.get("transfers", 0) + 1
                write()
        return ret

    MooncakeKVManager._transfer_data = transfer_data


def _cpu_only_settings(mooncake):
    import torch

    if torch.cuda.is_available() or not mooncake:
        return
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    # Mooncake's sender hands the transfer thread host tensors of page indices and
    # records a CUDA event for them; without CUDA it takes the index-list path, which
    # moves the same KV.
    MooncakeKVSender.supports_host_tensor_indices = False


def plugin():
    try:
        import mooncake.engine  # noqa: F401
        mooncake = True
    except ImportError:  # a node without Mooncake sends nothing over it
        mooncake = False
    _cpu_only_settings(mooncake)
    if not os.environ.get(REPORT_DIR_VARIABLE):
        return
    _count_allocator_calls()
    if mooncake:
        _measure_sent_bytes()
