"""The SWA bookkeeping of one SGLang decode step, measured in SGLang's own scheduler code.

``python -m swa_ext_bench.sglang_step`` (where sglang 0.5.23 is importable) builds real
``ScheduleBatch``es with SGLang's classes: ``Req``s and their KV state, SGLang's
``ReqToTokenPool``, its SWA-capable radix cache (``UnifiedRadixCache`` with the full and
SWA components, as its scheduler builds it; ``--no-radix`` disables it as
``--disable-radix-cache`` does) and the allocator. Each request is set up as a PD decode
node sets it up (``alloc_for_decode_prealloc``: full KV for the prompt, SWA KV for the
window tail, the evicted length recorded), its last eviction a different number of
tokens ago for each request, so every step of the measured run is a typical one. Then it
runs ``ScheduleBatch.prepare_for_decode`` step after step, a token appended to each
request after each (what the forward pass would do), for three setups side by side:

- ``sglang``: SGLang's allocator and SGLang's ``maybe_evict_swa`` loop;
- ``swa_ext``: swa_ext's allocator under SGLang's loop (``SWA_EXT_SGLANG`` without the hook);
- ``hook``: swa_ext's allocator and the hook (swa_ext.sglang.hooks), the default under
  ``SWA_EXT_SGLANG``.

(``Scheduler`` also builds a ``lockstep`` setup, the hook on a lockstep allocator, for
tests/sglang/test_evict_hook.py.)

The three take turns on identical batches in the same process, ``--block`` steps a turn
(8 by default; the order reverses every round), so that drift in the machine's speed
falls on all three alike. A turn of several steps measures each setup as a running
scheduler sees it: a scheduler touches its own requests every step, while step-by-step
turns (``--block 1``) start every step with another setup's requests in the CPU caches,
which costs the hook (whose time is reading the requests) most. The table gives medians
over the steps of ``maybe_evict_swa``, of the rest of the allocation (``alloc_for_decode``
without it) and of the rest of ``prepare_for_decode``, and the ratios. It also checks,
after every round, that the three leave the same evicted lengths, available sizes and
``req_to_token`` rows.
"""
from __future__ import annotations

import argparse
import array
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import types

SETUPS = ("sglang", "swa_ext", "hook")
WINDOW = 128  # gpt-oss's sliding window
# A config SGLang's ServerArgs can read: the benchmark runs no model, so any hybrid SWA
# architecture does.
_MODEL_CONFIG = {
    "architectures": ["GraniteSWAForCausalLM"], "model_type": "granite_swa", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "max_position_embeddings": 65536, "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": True,
}


def _publish_server_args(page_size):
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    model_dir = tempfile.mkdtemp(prefix="swa_ext_bench_model_")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(_MODEL_CONFIG, f)
    publish(ServerArgs(model_path=model_dir, device="cpu", page_size=page_size, skip_tokenizer_init=True),
            role="scheduler")


def _mapping_only_kvcache():
    from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool

    class MappingOnlyKVCache(BaseSWAKVPool):
        """SGLang's SWA KV pool without KV buffers: the full-to-SWA mapping only."""

        full_kv_pool = swa_kv_pool = swa_req_ring_size = None

        def __init__(self):
            self.full_to_swa_index_mapping = None

        def register_mapping(self, mapping):
            self.full_to_swa_index_mapping = mapping

        def translate_loc_from_full_to_swa(self, kv_indices):
            return self.full_to_swa_index_mapping[kv_indices]

        def get_state_buf_infos(self):
            return [], [], []

    MappingOnlyKVCache.__abstractmethods__ = frozenset()
    return MappingOnlyKVCache()


class Scheduler:
    """One setup: SGLang's pools, radix cache and a decode batch of ``num_reqs`` requests."""

    def __init__(self, setup, num_reqs, page_size, interval, steps, radix_cache):
        import torch
        from sglang.srt.disaggregation.decode import alloc_for_decode_prealloc
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator as SGLangSWA
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        import swa_ext.sglang as adapter
        from swa_ext.sglang import hooks

        self.setup = setup
        prompts = [256 + (i * 37) % 256 for i in range(num_reqs)]
        context = max(prompts) + steps + 2 * page_size + 8
        per_req_full = -(-context // page_size) * page_size
        per_req_swa = -(-(WINDOW + interval + 3 * page_size) // page_size) * page_size + page_size
        if page_size == 1:  # no tail preallocation there: the prompt's SWA KV until the first eviction
            per_req_swa += max(prompts)
        self.req_to_token_pool = ReqToTokenPool(num_reqs, context, "cpu", False)
        alloc_class = {"sglang": SGLangSWA, "lockstep": adapter.LockstepSWATokenToKVPoolAllocator}.get(
            setup, adapter.SWATokenToKVPoolAllocator)
        self.alloc = alloc_class(num_reqs * per_req_full, num_reqs * per_req_swa, page_size, torch.float16, "cpu",
                                 _mapping_only_kvcache(), False, self.req_to_token_pool)
        self.tree_cache = UnifiedRadixCache(CacheInitParams(
            disable=not radix_cache, req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.alloc,
            page_size=page_size, sliding_window_size=WINDOW, tree_components=(ComponentType.FULL, ComponentType.SWA)))
        self.reqs = [Req(f"req-{i}", "", array.array("i", [3] * n), SamplingParams(max_new_tokens=steps + 8))
                     for i, n in enumerate(prompts)]
        self.req_to_token_pool.alloc(self.reqs)
        req_to_token = self.req_to_token_pool.req_to_token
        for i, (req, prompt) in enumerate(zip(self.reqs, prompts)):
            # A request that has decoded for a while: its last eviction `phase` tokens ago.
            phase = (i * 53) % interval
            evicted = max(0, (prompt - WINDOW - phase) // page_size * page_size)
            tail_prealloc = page_size > 1  # SGLang's decode node preallocates a tail on paged pools only
            loc = alloc_for_decode_prealloc(self.alloc, req=req, fill_len=prompt, delta_len=prompt, prefix_len=0,
                                            total_prefix_len=0, prefix_indices=None, uses_swa_tail=tail_prealloc,
                                            swa_tail_len=prompt - evicted if tail_prealloc else prompt)
            req_to_token[req.kv.req_pool_idx, :prompt] = loc.to(torch.int32)
            req.kv.kv_committed_len = prompt
            req.output_ids = [5]  # the prefill's token: seqlen is one past the committed KV
            req.decode_batch_idx = 1
        model_config = types.SimpleNamespace(is_encoder_decoder=False, vocab_size=512, hf_config=None)
        self.batch = batch = ScheduleBatch.init_new(self.reqs, self.req_to_token_pool, self.alloc, self.tree_cache,
                                                    model_config, False, SpeculativeAlgorithm.NONE)
        rows = [req.kv.req_pool_idx for req in self.reqs]
        batch.req_pool_indices = torch.tensor(rows, dtype=torch.int64)
        batch.req_pool_indices_cpu = batch.req_pool_indices.clone()
        batch.seq_lens = torch.tensor(prompts, dtype=torch.int64)
        batch.seq_lens_cpu = batch.seq_lens.clone()
        batch.orig_seq_lens = batch.seq_lens.to(torch.int32)
        batch.forward_mode = ForwardMode.DECODE
        batch.sampling_info = types.SimpleNamespace(penalizer_orchestrator=types.SimpleNamespace(is_required=False))
        evict = hooks.maybe_evict_swa if setup in ("hook", "lockstep") else hooks.sglang_maybe_evict_swa
        self.evict_us = []
        self._evict = evict.__get__(batch)
        batch.maybe_evict_swa = self._timed_evict  # the instance's, so the three setups share one process

    def _timed_evict(self):
        start = time.perf_counter_ns()
        self._evict()
        self.evict_us.append((time.perf_counter_ns() - start) / 1e3)

    def step(self):
        """One decode step; returns prepare_for_decode's µs."""
        start = time.perf_counter_ns()
        self.batch.prepare_for_decode()
        total = (time.perf_counter_ns() - start) / 1e3
        for req in self.reqs:  # the forward pass's token
            req.output_ids.append(5)
        return total

    def state(self):
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        return ([req.kv.get_evicted_seqlen(ComponentType.SWA) for req in self.reqs],
                self.alloc.full_available_size(), self.alloc.swa_available_size())


def _timed_alloc_for_decode():
    """Times SGLang's alloc_for_decode as prepare_for_decode calls it."""
    from sglang.srt.managers import schedule_batch

    original = schedule_batch.alloc_for_decode
    times = []

    def alloc_for_decode(batch, token_per_req):
        start = time.perf_counter_ns()
        out = original(batch, token_per_req=token_per_req)
        times.append((time.perf_counter_ns() - start) / 1e3)
        return out

    schedule_batch.alloc_for_decode = alloc_for_decode
    return original, times


def _turns(count, block):
    """(round, steps in the round) for ``count`` steps a setup taken ``block`` at a time."""
    return [(r, min(block, count - r * block)) for r in range(-(-count // block))]


def run_case(num_reqs, page_size, interval, steps, warmup, radix_cache, block=8, setups=SETUPS):
    """The setups taking turns, ``block`` steps at a time; medians in µs."""
    from sglang.srt.managers import schedule_batch

    os.environ["SGLANG_SWA_EVICTION_INTERVAL"] = str(interval)
    schedulers = [Scheduler(s, num_reqs, page_size, interval, steps + warmup, radix_cache) for s in setups]
    original, alloc_times = _timed_alloc_for_decode()
    totals = {s.setup: [] for s in schedulers}
    allocs = {s.setup: [] for s in schedulers}
    # The cyclic collector off while timing (as timeit does): a full collection over the
    # setups' requests would land on whichever step happens to allocate then.
    gc.collect()
    gc.disable()
    try:
        done = 0
        for turn, count in _turns(steps + warmup, block):
            for s in (schedulers if turn % 2 == 0 else schedulers[::-1]):
                for k in range(count):
                    del alloc_times[:]
                    total = s.step()
                    if done + k >= warmup:
                        totals[s.setup].append(total)
                        allocs[s.setup].append(alloc_times[0])
            done += count
            states = [s.state() for s in schedulers]
            if states[1:] != states[:-1]:
                raise AssertionError(f"the setups differ after step {done}: {states}")
            rows = [s.req_to_token_pool.req_to_token for s in schedulers]
            if not all(rows[0].equal(r) for r in rows[1:]):
                # The allocators hand out the same slots (the drop-in contract).
                raise AssertionError(f"req_to_token differs after step {done}")
    finally:
        gc.enable()
        schedule_batch.alloc_for_decode = original
    row = {"requests": num_reqs, "page_size": page_size, "interval": interval, "radix_cache": radix_cache,
           "steps": steps, "block": block}
    for s in schedulers:
        evict = s.evict_us[warmup:]
        med = statistics.median
        row[s.setup] = {"maybe_evict_swa_us": med(evict),
                        "alloc_rest_us": med(a - e for a, e in zip(allocs[s.setup], evict)),
                        "prepare_rest_us": med(t - a for t, a in zip(totals[s.setup], allocs[s.setup])),
                        "prepare_for_decode_us": med(totals[s.setup])}
    return row


def run_interval_pair(num_reqs, page_size, steps, warmup, radix_cache, fast=1, slow=128, block=8):
    """The hook at interval ``fast`` against SGLang's loop and allocator at ``slow``,
    taking turns ``block`` steps at a time in one process: what evicting every step costs
    next to what SGLang pays for its default."""
    from sglang.srt.managers import schedule_batch

    pair = [(fast, Scheduler("hook", num_reqs, page_size, fast, steps + warmup, radix_cache)),
            (slow, Scheduler("sglang", num_reqs, page_size, slow, steps + warmup, radix_cache))]
    original, alloc_times = _timed_alloc_for_decode()
    gc.collect()
    gc.disable()
    try:
        for turn, count in _turns(steps + warmup, block):
            for interval, s in (pair if turn % 2 == 0 else pair[::-1]):
                os.environ["SGLANG_SWA_EVICTION_INTERVAL"] = str(interval)
                for _ in range(count):
                    s.step()
    finally:
        gc.enable()
        schedule_batch.alloc_for_decode = original
    hook, sglang = (statistics.median(s.evict_us[warmup:]) for _, s in pair)
    return {"requests": num_reqs, "page_size": page_size, "hook_interval": fast, "sglang_interval": slow,
            "block": block, "hook_us": hook, "sglang_us": sglang}


def to_markdown(rows):
    lines = ["| requests | page | interval | setup | maybe_evict_swa µs | µs a request | rest of alloc µs "
             "| rest of prepare µs | prepare_for_decode µs | evict vs sglang | prepare vs sglang |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ref = r["sglang"]
        for s in (setup for setup in SETUPS if setup in r):
            m = r[s]
            lines.append(
                f"| {r['requests']} | {r['page_size']} | {r['interval']} | {s} | {m['maybe_evict_swa_us']:.1f} "
                f"| {m['maybe_evict_swa_us'] / r['requests']:.3f} | {m['alloc_rest_us']:.1f} "
                f"| {m['prepare_rest_us']:.1f} | {m['prepare_for_decode_us']:.1f} "
                f"| {ref['maybe_evict_swa_us'] / m['maybe_evict_swa_us']:.1f}x "
                f"| {ref['prepare_for_decode_us'] / m['prepare_for_decode_us']:.2f}x |")
    return "\n".join(lines)


def _setups(text):
    setups = text.split(",")
    if setups[0] != "sglang" or not set(setups) <= set(SETUPS) or len(set(setups)) != len(setups):
        raise argparse.ArgumentTypeError(f"expected sglang first, then any of {', '.join(SETUPS[1:])}")
    return setups


def _ints(text):
    return [int(v) for v in text.split(",")]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m swa_ext_bench.sglang_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=_ints, default=[16, 256, 2048])
    parser.add_argument("--page-sizes", type=_ints, default=[1, 16, 64])
    parser.add_argument("--intervals", type=_ints, default=[1, 128])
    parser.add_argument("--steps", type=int, default=64, help="measured steps a case (default 64)")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--setups", type=_setups, default=list(SETUPS),
                        help="which setups take turns, sglang first (default sglang,swa_ext,hook)")
    parser.add_argument("--block", type=int, default=8,
                        help="steps a setup runs before the next takes its turn (default 8; 1: step by step)")
    parser.add_argument("--no-radix", action="store_true", help="the radix cache disabled (--disable-radix-cache)")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args(argv)
    started = time.monotonic()
    rows = []
    for page_size in args.page_sizes:
        _publish_server_args(page_size)
        for num_reqs in args.requests:
            for interval in args.intervals:
                row = run_case(num_reqs, page_size, interval, args.steps, args.warmup, not args.no_radix, args.block,
                               args.setups)
                rows.append(row)
                print(f"[{num_reqs} requests, page {page_size}, interval {interval}] maybe_evict_swa µs: "
                      + ", ".join(f"{s} {row[s]['maybe_evict_swa_us']:.1f}" for s in args.setups), file=sys.stderr)
    pairs = []
    if 1 in args.intervals and 128 in args.intervals:
        for page_size in args.page_sizes:
            _publish_server_args(page_size)
            for num_reqs in args.requests:
                pairs.append(run_interval_pair(num_reqs, page_size, args.steps, args.warmup, not args.no_radix,
                                               block=args.block))
    md = to_markdown(rows)
    if pairs:
        md += ("\n\n| requests | page | hook µs, interval 1 | SGLang's loop µs, interval 128 | ratio |\n"
               "|---:|---:|---:|---:|---:|\n")
        md += "\n".join(f"| {p['requests']} | {p['page_size']} | {p['hook_us']:.1f} | {p['sglang_us']:.1f} "
                         f"| {p['sglang_us'] / p['hook_us']:.2f}x |" for p in pairs)
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "interval_pairs": pairs}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md + "\n")
    print(f"wall time {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
