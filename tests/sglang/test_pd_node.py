"""A decode node of SGLang's PD disaggregation (the offline engine, disaggregation_mode
"decode") on swa_ext: SGLang's own decode path preallocates each request's KV before
the transfer (the whole prompt on the full pool, the window tail on the SWA pool:
alloc_extend_swa_tail), frees the SWA KV that leaves the window while it decodes, and
backs a retracted request up to the CPU and restores it.

The fake transfer backend stands in for the prefill node: it moves no KV (the prompt's
KV stays zeros) and takes each request's first token from a hash of its rid, so the
outputs compare between allocators only; tests/sglang/test_pd_pair.py moves real KV.
Lockstep (SWA_EXT_SGLANG=lockstep) runs SGLang's allocator beside swa_ext's on every
call and stops the node at the first difference, so SGLang's own allocator runs alone
once, for the outputs of one configuration. SGLang's strict memory checks are on in
every run. Each run is its own process (the plugin and the checks are read at
start-up); the module's runs go two at a time.
"""
import functools
import json
import os
import re
import subprocess
import sys
import time

import pytest

import pd_harness

# Five prompts from shorter than the 64-token window to eight windows long, 64 new
# tokens (100 at page size 64 and in the tight pool: each request's pages leave the window
# there, and running requests outgrow the pool): the window slides during decoding (SGLang
# frees out-of-window SWA every 16 steps here, pd_harness.node_env).
PROMPT_LENS = (40, 150, 260, 390, 520)
NEW_TOKENS = 64
PROMPTS = [[(7 * i + 3 * j + j * j % 11) % 500 + 3 for j in range(n)] for i, n in enumerate(PROMPT_LENS)]

# name: (page size, max_total_tokens, new tokens, engine arguments)
CONFIGS = {
    "page16": (16, 8192, NEW_TOKENS, {}),
    "page64": (64, 8192, 100, {}),
    "page1": (1, 8192, NEW_TOKENS, {}),
    # 1024 tokens for 1360 prompt tokens and 100 new tokens each: a request's preallocation
    # waits for memory, and a running request is retracted to the CPU and resumed. A log
    # line every 4 decode steps shows the waiting.
    "page16-tight": (16, 1024, 100, {"num_reserved_decode_tokens": 16, "decode_log_interval": 4}),
}
RUNS = [("page16-tight", "lockstep"), ("page16", "sglang"), ("page16", "1"), ("page16", "lockstep"),
        ("page1", "lockstep")]
# With --slow: page size 64 takes SGLang's tail path as page size 16 does.
SLOW_RUNS = [("page64", "lockstep")]
# Who serves in each mode: (top-level package, allocator class).
ALLOCATOR_CLASSES = {"sglang": ("sglang", "SWATokenToKVPoolAllocator"), "1": ("swa_ext", "SWATokenToKVPoolAllocator"),
                     "lockstep": ("swa_ext", "LockstepSWATokenToKVPoolAllocator"),
                     "shared": ("swa_ext", "SharedSWATokenToKVPoolAllocator")}


@functools.lru_cache(maxsize=None)
def decode_node(model, config, mode, fault=None):
    """One decode node run: outputs, the probe's allocator calls, lockstep counts, log, wall
    time (once a session: test_shared_pd.py compares with SGLang's run here); ``fault``
    plants a KV fault (pd_harness.node_env)."""
    page_size, max_total_tokens, new_tokens, engine_args = CONFIGS[config]
    out_dir = os.path.join(os.path.dirname(model), f"pd-node-{config}-{mode}" + (f"-{fault}" if fault else ""))
    os.makedirs(out_dir, exist_ok=True)
    spec_path, result = os.path.join(out_dir, "spec.json"), os.path.join(out_dir, "result.json")
    report, probe = os.path.join(out_dir, "lockstep.json"), os.path.join(out_dir, "probe")
    with open(spec_path, "w") as f:
        json.dump({"model": model, "rounds": [PROMPTS], "new_tokens": new_tokens,
                   "engine_args": dict(page_size=page_size, max_total_tokens=max_total_tokens,
                                       disaggregation_mode="decode", disaggregation_transfer_backend="fake",
                                       **pd_harness.DECODE_CPU_ARGS, **engine_args)}, f)
    env = pd_harness.node_env(mode, probe, report if mode == "lockstep" else None, fault)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, pd_harness.__file__, "engine", spec_path, result], env=env,
                          capture_output=True, text=True, timeout=600, start_new_session=True)
    wall = time.monotonic() - start
    log = proc.stdout + proc.stderr
    with open(os.path.join(out_dir, "log.txt"), "w") as f:
        f.write(log)
    assert proc.returncode == 0 and os.path.exists(result), f"decode node failed ({config}, {mode}):\n{log[-6000:]}"
    with open(result) as f:
        outputs = json.load(f)["rounds"][0]
    lockstep = {}
    if mode == "lockstep":
        with open(report) as f:
            lockstep = json.load(f)
    calls = pd_harness.allocator_calls(probe)
    print(f"decode node {config} {mode}: {wall:.0f} s; allocator calls {calls}; lockstep calls {lockstep}")
    return {"outputs": outputs, "new_tokens": new_tokens, "calls": calls, "lockstep": lockstep, "log": log, "wall": wall}


@pytest.fixture(scope="module")
def node_runs(request, tiny_model):
    """Every run of this module (SLOW_RUNS with --slow), two at a time (each is mostly one
    busy process)."""
    return pd_harness.two_at_a_time(functools.partial(decode_node, tiny_model),
                                    RUNS + (SLOW_RUNS if request.config.getoption("--slow") else []))


def check_run(run, mode):
    """What every run must show: the allocator that served, no divergence, every token
    of both pools free again at the end."""
    calls = run["calls"]
    assert pd_harness.allocator_class(calls) == ALLOCATOR_CLASSES[mode], calls["allocator"]
    assert "LockstepDivergence" not in run["log"]
    assert calls["free_after_last_call"] == calls["pool_sizes"], calls
    assert all(len(o) == run["new_tokens"] for o in run["outputs"])


def check_tail_path(run):
    """SGLang's decode path on a page size > 1: one window-tail preallocation per
    request (none of the whole prompt on both pools), SWA that left the window freed
    while decoding, and each request released."""
    calls = run["calls"]
    assert calls["alloc_extend_swa_tail"] == len(PROMPTS) and "alloc_extend" not in calls, calls
    assert pd_harness.out_of_window_frees(calls) > 0, calls
    if pd_harness.allocator_class(calls)[0] == "swa_ext":  # its hook, not SGLang's loop, evicted
        assert calls.get("evict_out_of_window", 0) > 0 and "free_swa_segment" not in calls, calls
        # Without lockstep the scheduler's batches were admitted: evict_batch alone served them.
        lockstep = pd_harness.allocator_class(calls)[1].startswith("Lockstep")
        assert (calls.get("evict_batch", 0) > 0) != lockstep, calls
    assert calls["free_full_segment"] == calls["free_segment"] == len(PROMPTS), calls


# The decode lifecycle's calls on the hybrid allocator (lockstep's counts add up each
# name over the hybrid allocator and its sub-allocators; these only the hybrid gets here).
LIFECYCLE_CALLS = ("alloc", "alloc_extend_swa_tail", "alloc_decode", "free_swa_segment", "free_full_segment",
                   "free_segment")


def check_mirrored(run):
    """Each lifecycle call the probe saw, lockstep mirrored on SGLang's allocator, and each
    batched eviction of the hook it checked against SGLang's own per-request frees."""
    for call in LIFECYCLE_CALLS:
        if call in run["calls"]:
            assert run["lockstep"][call] == run["calls"][call], (call, run["calls"], run["lockstep"])
    assert run["lockstep"].get("maybe_evict_swa", 0) >= run["calls"].get("evict_out_of_window", 0), run


def test_decode_node_on_swa_ext_serves_sglangs_outputs(node_runs):
    """Page size 16: SGLang's allocator, swa_ext's and the lockstep pair give the same
    outputs, and SGLang's decode path took the window-tail path on each."""
    runs = {mode: node_runs["page16", mode] for mode in ("sglang", "1", "lockstep")}
    for mode, run in runs.items():
        check_run(run, mode)
        check_tail_path(run)
        assert run["outputs"] == runs["sglang"]["outputs"], mode
    check_mirrored(runs["lockstep"])


@pytest.mark.slow
def test_decode_node_page_size_64_in_lockstep(node_runs):
    run = node_runs["page64", "lockstep"]
    check_run(run, "lockstep")
    check_tail_path(run)
    check_mirrored(run)


def test_decode_node_page_size_1_in_lockstep(node_runs):
    """Page size 1: SGLang preallocates the whole prompt on both pools (alloc), then frees
    out-of-window SWA as at any page size."""
    run = node_runs["page1", "lockstep"]
    check_run(run, "lockstep")
    calls, lockstep = run["calls"], run["lockstep"]
    # One alloc per request's prompt, then one per decode step (a page of one token).
    assert "alloc_extend_swa_tail" not in calls and calls["alloc"] > len(PROMPTS), calls
    assert pd_harness.out_of_window_frees(calls) > 0, calls
    check_mirrored(run)


def test_tight_decode_node_waits_retracts_and_resumes_in_lockstep(node_runs):
    """Page size 16 and a 1024-token pool: a preallocation waits for memory, SGLang
    retracts a decoding request to the CPU (get_cpu_copy) and resumes it (load_cpu_copy,
    a new tail preallocation); lockstep finds no difference and both pools end whole."""
    run = node_runs["page16-tight", "lockstep"]
    check_run(run, "lockstep")
    calls = run["calls"]
    assert re.search(r"#prealloc-req: [1-9]", run["log"]), "no preallocation waited"
    assert calls.get("get_cpu_copy", 0) >= 1 and calls.get("load_cpu_copy") == calls["get_cpu_copy"], calls
    assert calls["alloc_extend_swa_tail"] == len(PROMPTS) + calls["load_cpu_copy"], calls
    assert pd_harness.out_of_window_frees(calls) > 0, calls
    check_mirrored(run)
