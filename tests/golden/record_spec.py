"""Records the speculative-decoding golden traces (tests/golden/spec_*.jsonl.gz) from SGLang 0.5.23.

Run where sglang is importable (``.venv-cuda``): ``python tests/golden/record_spec.py [OUT_DIR]``
(default: this directory). tests/sglang/test_spec_golden.py records them again and checks
the stored files are what SGLang writes.

No engine runs: a small overlap scheduler drives SGLang's own bookkeeping on SGLang's
classes (``Req``, ``ScheduleBatch``, ``ReqToTokenPool``, ``UnifiedRadixCache`` with the
full and SWA components, and SGLang's ``SWATokenToKVPoolAllocator``, whose calls are
written down). What SGLang's code decides here:

- prefill: ``alloc_for_extend``;
- each decode step: EAGLE v2's ``eagle_prepare_for_decode`` (window eviction through
  ``maybe_evict_swa``, then the reserve of ``get_alloc_reserve_per_decode`` rounded by
  ``page_aligned_decode_alloc_lens``, allocated by ``alloc_for_spec_decode``);
- memory pressure: ``check_decode_mem`` and ``retract_decode`` (``release_req``);
- a finished request: ``update_finish_state`` and ``release_kv_cache``, which frees the
  slots allocated past the committed length (``_release_overallocated_kv_indices``);
- radix traces: the finished request's prefix kept by the tree, evicted under pressure
  and at the end.

What the scheduler here decides, as the overlap scheduler orders it: a verify's result
(how many of the draft tokens are accepted, drawn from a seeded generator) is committed
one step late, after the next step's ``eagle_prepare_for_decode`` has allocated on the
lagging committed length; the verify bookkeeping itself is the result processor's
(``kv_committed_len`` and the output grow by the accepted run). A tree draft's accepted
path is moved to the front of its slots (a KV copy, no allocator call), so chains and
trees differ to the allocator in the reserve only.
"""
from __future__ import annotations

import array
import contextlib
import functools
import gzip
import inspect
import json
import os
import random
import sys
import tempfile
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
# SGLang's row writes (assign_req_to_token_pool) are Triton kernels: interpreted on the CPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

# (page size, window, draft shape, radix cache, need_sort, eviction interval, seed).
# Chain: EAGLE with topk 1, 3 steps, 4 draft tokens. Tree: topk 4, 3 steps, 8 draft
# tokens (at page size > 1 its reserve covers every branch's pages).
SHAPES = {"chain": dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4),
          "tree": dict(speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8)}
TRACES = [
    (1, 24, "chain", False, False, 1, 20100),
    (1, 24, "tree", True, True, 1, 20101),
    (16, 40, "chain", False, True, 1, 21100),
    (16, 40, "chain", True, False, 8, 21101),
    (16, 40, "tree", False, False, 1, 22100),
    (16, 40, "tree", True, True, 1, 22101),
    (64, 128, "chain", False, False, 1, 23100),
    (64, 128, "tree", True, True, 8, 23101),
]
NUM_REQS = 10
MAX_RUNNING = 6
MAPPING_EVERY = 4  # decode steps


def trace_name(page_size, window, shape, radix, need_sort, interval, seed):
    return (f"spec_ps{page_size}_w{window}_{shape}_{'sort' if need_sort else 'nosort'}_"
            f"{'radix' if radix else 'plain'}_i{interval}_s{seed}")


def _as_list(value):
    import torch

    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    return value


def recording_allocator(records):
    """SGLang's SWATokenToKVPoolAllocator, each outermost call written to ``records`` as SPEC.md
    section 6 words it (calls it makes on itself are part of that call). A call the trace format
    has no record for raises, so a trace never silently misses a change to the pools."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    recorded = ("alloc", "alloc_extend", "alloc_extend_swa_tail", "alloc_decode", "free", "free_swa", "free_full",
                "free_segment", "free_swa_segment", "free_full_segment", "free_group_begin", "free_group_end",
                "new_pages_available")
    unrecordable = ("set_full_to_swa_mapping", "clear_full_to_swa_mapping", "resize", "load_cpu_copy")
    returns_indices = ("alloc", "alloc_extend", "alloc_extend_swa_tail", "alloc_decode")
    # A sub-allocator called from outside (the radix cache frees its full component on the full
    # pool): the hybrid call that is that call (SPEC.md section 4); any other raises.
    sub_calls = {("full", "free"): "free_full", ("full", "free_segment"): "free_full_segment"}
    sub_mutating = ("alloc", "alloc_extend", "alloc_decode", "free", "free_segment", "free_page_ids",
                    "free_group_begin", "free_group_end", "clear")

    def run_and_record(alloc, op, method, args, kwargs):
        outermost = alloc._depth == 0
        alloc._depth += 1
        try:
            out = method(*args, **kwargs)
        finally:
            alloc._depth -= 1
        if not outermost:
            return out
        bound = inspect.signature(getattr(SWATokenToKVPoolAllocator, op)).bind(alloc, *args, **kwargs)
        rec = {"op": op}
        for key, value in bound.arguments.items():
            if key == "self" or key.endswith("_cpu"):
                continue  # the CPU copies are the lengths again (SPEC.md section 6)
            rec[{"free_index": "indices"}.get(key, key)] = _as_list(value)
        if op in returns_indices:
            rec["out"] = None if out is None else _as_list(out)
        elif op == "new_pages_available":
            rec["out"] = bool(out)
        rec["avail"] = [int(alloc.full_available_size()), int(alloc.swa_available_size())]
        if op in alloc.meta:
            rec["meta"] = alloc.meta.pop(op)
        records.append(rec)
        return out

    def wrap(name):
        method = getattr(SWATokenToKVPoolAllocator, name)

        def call(self, *args, **kwargs):
            if name in unrecordable and self._depth == 0:
                raise AssertionError(f"SGLang called {name}, which the trace format cannot hold")
            return run_and_record(self, name, functools.partial(method, self), args, kwargs)

        call.__name__ = name
        return call

    def wrap_sub(alloc, side, name, method):
        def call(*args, **kwargs):
            if alloc._depth:
                return method(*args, **kwargs)  # part of a hybrid call
            if (side, name) not in sub_calls:
                raise AssertionError(f"SGLang called {side}_attn_allocator.{name}, which the trace format cannot hold")
            return run_and_record(alloc, sub_calls[side, name], method, args, kwargs)

        return call

    namespace = {name: wrap(name) for name in recorded + unrecordable}
    namespace["_depth"] = 0
    cls = type("RecordingSWAAllocator", (SWATokenToKVPoolAllocator,), namespace)

    def init(self, *args, **kwargs):
        self.meta = {}  # by op: what explains the next such call (SPEC.md section 6's meta)
        SWATokenToKVPoolAllocator.__init__(self, *args, **kwargs)
        for side, pool in (("full", self.full_attn_allocator), ("swa", self.swa_attn_allocator)):
            for name in sub_mutating:
                if hasattr(pool, name):
                    setattr(pool, name, wrap_sub(self, side, name, getattr(pool, name)))

    cls.__init__ = init
    return cls


def _mapping_only_kvcache():
    """SGLang's SWA KV pool without KV buffers (the benchmark's: the mapping is all the allocator needs)."""
    try:
        from swa_ext_bench import sglang_step
    except ImportError:  # the source tree without the installed package
        sys.path.append(str(HERE.parents[1]))
        from bench import sglang_step
    return sglang_step._mapping_only_kvcache()


def _publish(page_size, window, model_dir):
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    config = {
        "architectures": ["GraniteSWAForCausalLM"], "model_type": "granite_swa", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 4096, "sliding_window": window,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": True,
    }
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    publish(ServerArgs(model_path=model_dir, device="cpu", page_size=page_size, skip_tokenizer_init=True),
            role="scheduler")


class OverlapScheduler:
    """The scheduler's order of calls under the overlap scheduler, with SGLang's functions."""

    def __init__(self, page_size, window, shape, radix, need_sort, seed, records):
        import torch
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.mem_cache.allocation_sizing import (get_alloc_reserve_per_decode,
                                                            get_req_to_token_extra_context_len)

        self.rng = random.Random(seed)
        self.page_size, self.window, self.shape = page_size, window, SHAPES[shape]
        self.records = records
        # Prompts of one to four windows, outputs long enough for the window to slide under
        # the over-allocated tail.
        self.todo = [(self.rng.randint(window // 2, 4 * window), self.rng.randint(window, 3 * window))
                     for _ in range(NUM_REQS)]
        self.reserve = get_alloc_reserve_per_decode()
        # The row is SGLang's (the context and get_req_to_token_extra_context_len) with room for a
        # reserve past the longest request: a tree at page size 1 reserves more than that headroom.
        context = (max(p + n for p, n in self.todo) + get_req_to_token_extra_context_len() + 2 * self.reserve
                   + page_size)
        # A pool that holds about two requests at their longest: admissions wait and
        # decoding requests are retracted.
        longest = max(p + n for p, n in self.todo)
        per_req = -(-(longest + self.reserve + page_size) // page_size) * page_size
        size = 2 * per_req
        size_swa = -(-(3 * (2 * window + self.reserve) + 4 * window) // page_size) * page_size + 2 * page_size
        size_swa = max(size_swa, -(-(4 * window + self.reserve) // page_size) * page_size)
        self.req_to_token_pool = ReqToTokenPool(NUM_REQS, context, "cpu", False)
        self.alloc = recording_allocator(records)(size, size_swa, page_size, torch.float16, "cpu",
                                                  _mapping_only_kvcache(), need_sort, self.req_to_token_pool)
        self.tree_cache = UnifiedRadixCache(CacheInitParams(
            disable=not radix, req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.alloc,
            page_size=page_size, sliding_window_size=window, tree_components=(ComponentType.FULL, ComponentType.SWA),
            tree_core_backend="python"))
        self.tree_cache.evict_sliding_windows = self.explained_eviction(self.tree_cache.evict_sliding_windows)
        self.init = {"op": "init", "size": size, "size_swa": size_swa, "page_size": page_size,
                     "need_sort": need_sort, "window": window, "radix": radix}
        self.waiting, self.running, self.pending, self.steps = [], [], None, 0
        self.counts = {"retracted": 0, "released_past_committed": 0}  # what the trace went through
        self.next_token = 3

    def explained_eviction(self, evict):
        """SGLang's evict_sliding_windows, its free explained in the record's meta as section 5
        words it (the request's evicted length before and after, its committed length)."""
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        def explained(req, pre_len, **kwargs):
            meta = {"old": req.kv.get_evicted_seqlen(ComponentType.SWA), "pre_len": pre_len, "window": self.window,
                    "prefix_sharing": self.tree_cache.supports_prefix_sharing(), "allocated": req.kv.kv_allocated_len}
            self.alloc.meta["free_swa_segment"] = meta
            evict(req, pre_len, **kwargs)
            meta["new"] = req.kv.get_evicted_seqlen(ComponentType.SWA)
            self.alloc.meta.pop("free_swa_segment", None)  # nothing was due

        return explained

    def tokens(self, n):
        out = [(self.next_token + k) % 500 + 3 for k in range(n)]
        self.next_token += n
        return out

    def batch(self, reqs, mode):
        import torch
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        model_config = types.SimpleNamespace(is_encoder_decoder=False, vocab_size=512, hf_config=None)
        batch = ScheduleBatch.init_new(reqs, self.req_to_token_pool, self.alloc, self.tree_cache, model_config,
                                       True, SpeculativeAlgorithm.EAGLE)
        batch.forward_mode = mode
        # No sampling here: retract_decode's filter_batch finds nothing to filter.
        batch.sampling_info = types.SimpleNamespace(penalizer_orchestrator=types.SimpleNamespace(is_required=False),
                                                    filter_batch=lambda *indices: None)
        if mode == ForwardMode.DECODE:
            rows = [req.kv.req_pool_idx for req in reqs]
            batch.req_pool_indices = torch.tensor(rows, dtype=torch.int64)
            batch.req_pool_indices_cpu = batch.req_pool_indices.clone()
            batch.seq_lens = torch.tensor([req.kv.kv_committed_len for req in reqs], dtype=torch.int64)
            batch.seq_lens_cpu = batch.seq_lens.clone()
            batch.orig_seq_lens = batch.seq_lens.to(torch.int32)
        return batch

    def admit(self):
        """Prefill the waiting requests that fit (SGLang's alloc_for_extend); False if none fits."""
        import torch
        from sglang.srt.mem_cache.allocation import alloc_for_extend
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        # Optimistic, as SGLang's admission is with its new-token ratio: room for the prompt and
        # one reserve, so the running requests outgrow the pool and retract.
        tree = self.tree_cache
        room = min(self.alloc.full_available_size() + tree.full_evictable_size(),
                   self.alloc.swa_available_size() + tree.swa_evictable_size())
        chosen = []
        for req in self.waiting:
            need = len(req.origin_input_ids) + len(req.output_ids) + self.reserve + self.page_size
            if len(self.running) + len(chosen) >= MAX_RUNNING or need > room:
                break
            chosen.append(req)
            room -= need
        if not chosen:
            return False
        self.waiting = self.waiting[len(chosen):]
        batch = self.batch(chosen, ForwardMode.EXTEND)
        lens = [len(req.origin_input_ids) + len(req.output_ids) for req in chosen]
        for req in chosen:
            req.fill_ids = list(req.origin_input_ids) + list(req.output_ids)
            req.prefix_len = 0
        batch.prefix_lens = [0] * len(chosen)
        batch.extend_lens = lens
        batch.extend_num_tokens = sum(lens)
        batch.seq_lens = torch.tensor(lens, dtype=torch.int64)
        batch.seq_lens_cpu = batch.seq_lens.clone()
        alloc_for_extend(batch)
        self.settle()  # the decode step before the prefill returns while the prefill runs
        for req in chosen:
            if not req.output_ids:
                req.output_ids.append(self.tokens(1)[0])  # the prefill's sampled token
            req.decode_batch_idx = 0
        self.running += chosen
        return True

    def decode(self):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.speculative.eagle_utils import eagle_prepare_for_decode

        batch = self.batch(list(self.running), ForwardMode.DECODE)
        if not batch.check_decode_mem():
            retracted, _, aborted = batch.retract_decode()
            assert not aborted
            self.counts["retracted"] += len(retracted)
            for req in retracted:
                self.running.remove(req)
                self.waiting.insert(0, req)
            batch = self.batch(list(self.running), ForwardMode.DECODE)
        # The decode reserve's allocation (alloc_extend, or alloc at page size 1), explained.
        reserve = {"committed": [r.kv.kv_committed_len for r in batch.reqs],
                   "allocated": [r.kv.kv_allocated_len for r in batch.reqs], "reserve": self.reserve}
        self.alloc.meta["alloc" if self.page_size == 1 else "alloc_extend"] = reserve
        eagle_prepare_for_decode(batch)
        self.alloc.meta.clear()  # nothing needed allocating
        self.settle()  # the previous verify's result, one step late
        steps = self.shape["speculative_num_steps"]
        self.pending = [(req, self.rng.randint(1, steps + 1)) for req in batch.reqs if not req.finished()]
        self.snapshot()

    def settle(self):
        """The result processor on the last verify: commit the accepted run, finish, release."""
        from sglang.srt.mem_cache.common import release_kv_cache

        for req, accepted in self.pending or ():
            if req.finished() or not req.kv.holds_kv:
                continue  # finished or retracted since
            req.kv.kv_committed_len += accepted
            req.output_ids.extend(self.tokens(accepted))
            req.update_finish_state(new_accepted_len=accepted)
            if req.finished():
                page = self.page_size
                self.counts["released_past_committed"] += req.kv.kv_allocated_len > -(-req.kv.kv_committed_len // page) * page
                release_kv_cache(req, self.tree_cache, checkpoint=True)
                self.running.remove(req)
        self.pending = None

    def snapshot(self):
        """The whole mapping every few steps, a translation of the first request's first slots every step."""
        import torch

        self.steps += 1
        if self.steps % MAPPING_EVERY == 0:
            mapping = self.alloc.full_to_swa_index_mapping
            self.records.append({"op": "mapping", "len": int(mapping.numel()),
                                 "nonzero": [[i, int(v)] for i, v in enumerate(mapping[:-1].tolist()) if v != 0]})
        held = [req.kv.req_pool_idx for req in self.running]
        if held:
            rows = self.req_to_token_pool.req_to_token[held[0], :8].to(torch.int64).tolist()
            indices = [-1] + [i for i in rows if i > 0]
            self.records.append({"op": "translate", "indices": indices,
                                 "out": _as_list(self.alloc.translate_loc_from_full_to_swa(torch.tensor(indices)))})

    def run(self):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        for i, (prompt, new_tokens) in enumerate(self.todo):
            params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
            params.normalize(None)
            self.waiting.append(Req(f"req-{i}", "", array.array("q", self.tokens(prompt)), params))
        while self.waiting or self.running:
            if not (self.waiting and self.admit()):
                assert self.running, "nothing runs and nothing fits"
                self.decode()
        self.settle()
        self.tree_cache.evict(_evict_everything())
        self.records.append({"op": "end", "avail": [int(self.alloc.full_available_size()),
                                                    int(self.alloc.swa_available_size())]})


def _evict_everything():
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    return EvictParams(num_tokens=1 << 40)


@contextlib.contextmanager
def _tree_nodes_in_creation_order():
    """Leaves last touched in the same step tie in the radix cache's LRU order, and which of them
    is evicted first changes from run to run: the Rust tree core (SGLang's default) keeps them in
    its own hash tables, the Python one (the same tree, which the recorder runs) in a set of nodes
    hashed by address. Hashed by their creation number (counted from 0 for each trace) they go in
    the same order every run, and a trace records again identically."""
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeNode

    counter, hash_ = UnifiedTreeNode.counter, UnifiedTreeNode.__hash__
    UnifiedTreeNode.counter = 0
    UnifiedTreeNode.__hash__ = lambda node: node.id
    try:
        yield
    finally:
        UnifiedTreeNode.counter, UnifiedTreeNode.__hash__ = max(counter, UnifiedTreeNode.counter), hash_


def record(page_size, window, shape, radix, need_sort, interval, seed):
    """One trace's records, recorded from SGLang."""
    from sglang.srt.runtime_context import get_spec

    os.environ["SGLANG_SWA_EVICTION_INTERVAL"] = str(interval)
    with tempfile.TemporaryDirectory(prefix="swa_ext_spec_golden_") as model_dir, _tree_nodes_in_creation_order():
        _publish(page_size, window, model_dir)
        records = []
        with get_spec().override(speculative_algorithm="EAGLE", **SHAPES[shape]):
            scheduler = OverlapScheduler(page_size, window, shape, radix, need_sort, seed, records)
            scheduler.run()
        init = dict(scheduler.init, spec={"algorithm": "EAGLE", "shape": shape, **SHAPES[shape],
                                          "reserve_per_decode": scheduler.reserve, "overlap": True,
                                          "eviction_interval": interval, **scheduler.counts})
    return [init] + records


def write(path, records):
    with gzip.GzipFile(path, "wb", mtime=0) as f:
        f.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode())


def main(out_dir=HERE):
    for params in TRACES:
        path = Path(out_dir) / (trace_name(*params) + ".jsonl.gz")
        records = record(*params)
        write(path, records)
        print(f"wrote {path} ({len(records)} records)")


if __name__ == "__main__":
    main(*sys.argv[1:])
