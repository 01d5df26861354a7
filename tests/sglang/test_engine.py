"""SGLang's own offline Engine on the CPU serving requests on swa_ext's allocator
(SWA_EXT_SGLANG=1) and in lockstep with SGLang's (SWA_EXT_SGLANG=lockstep): the output
ids and cached-token counts must be those of SGLang's allocator, with SGLang's strict
memory and KV-page checks on. Each run is its own process (tests/sglang/engine_run.py),
since the plugin and the checks are read at start-up."""
import functools
import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import STUBS
from pd_harness import KV_CHECK, allocator_variables, two_at_a_time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_POOL = (8192, "default")  # (max_total_tokens, swa_full_tokens_ratio)
# Fewer tokens than the four requests need at once: requests queue, retract, and the
# radix cache evicts. Ratio 1.0: SGLang's CPU attention paths read the SWA layers with
# untranslated indices on a smaller SWA pool, with its own allocator too.
TIGHT_POOL = (400, "1.0")


def run_engine(model, page_size, pool, mode, fault=None, workload="full", dummy_weights=None):
    """One engine run: its results, log, lockstep counts and wall time. ``fault`` plants a
    KV fault (tests/sglang/kv_check: ``SWA_EXT_TEST_KV_FAULT``) so that a test shows its
    comparison can fail. The shared mode runs with SWA_EXT_DEBUG=1: each step checks that
    no slot holds two kinds of KV. ``workload``: engine_run.py's. ``dummy_weights``: the
    model from its config alone, SGLang's dummy weights widened to that range
    (tests/sglang/kv_check). Run once a session for each set of arguments, however a
    caller spells them."""
    return _run_engine(model, page_size, pool, mode, fault, workload, dummy_weights)


@functools.lru_cache(maxsize=None)
def _run_engine(model, page_size, pool, mode, fault, workload, dummy_weights):
    out_dir = os.path.join(os.path.dirname(model), f"run-{page_size}-{pool[0]}-{mode}-{workload}" +
                           (f"-{fault}" if fault else ""))
    os.makedirs(out_dir, exist_ok=True)
    result, report = os.path.join(out_dir, "result.json"), os.path.join(out_dir, "lockstep.json")
    env = dict(os.environ, SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY="1",
               SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE="1", SGLANG_CHECK_KV_PAGE_INVARIANTS="1",
               TRITON_INTERPRET="1", SWA_EXT_LOCKSTEP_REPORT=report,
               # Out-of-window frees every 8 tokens, not SGLang's 128: with 100 new tokens the
               # scheduler's eviction (swa_ext's hook under SWA_EXT_SGLANG) runs many times.
               SGLANG_SWA_EVICTION_INTERVAL="8",
               PYTHONPATH=os.pathsep.join([STUBS, KV_CHECK] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                               if p]))
    for name in ("SWA_EXT_SGLANG", "SWA_EXT_SHARED", "SWA_EXT_DEBUG", "SWA_EXT_TEST_KV_FAULT",
                 "SWA_EXT_TEST_DUMMY_WEIGHTS"):
        env.pop(name, None)
    env.update(allocator_variables(mode))
    if mode == "shared":
        env["SWA_EXT_DEBUG"] = "1"
    if fault:
        env["SWA_EXT_TEST_KV_FAULT"] = fault
    if dummy_weights is not None:
        env["SWA_EXT_TEST_DUMMY_WEIGHTS"] = str(dummy_weights)
    proc, log, counts, wall = run_script([os.path.join(HERE, "engine_run.py"), model, result, str(page_size),
                                          str(pool[0]), pool[1], "triton", workload,
                                          "auto" if dummy_weights is None else "dummy"], env, out_dir, report)
    assert proc.returncode == 0 and os.path.exists(result), f"engine run failed ({mode}):\n{log[-6000:]}"
    with open(result) as f:
        rounds = json.load(f)["rounds"]
    print(f"engine run page {page_size} pool {pool} {mode}: {wall:.0f} s, lockstep calls {sum(counts.values())}")
    return {"rounds": rounds, "log": log, "counts": counts, "wall": wall}


def run_script(args, env, out_dir, report):
    """Runs one engine script in its own process: (the process, its log, also written to
    out_dir/log.txt, the lockstep call counts it reported, the wall time)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable] + args, env=env, capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - start
    log = proc.stdout + proc.stderr
    with open(os.path.join(out_dir, "log.txt"), "w") as f:
        f.write(log)
    counts = {}
    if os.path.exists(report):
        with open(report) as f:
            counts = json.load(f)
    return proc, log, counts, wall


def run_engines(runs):
    """``run_engine`` on each argument tuple of ``runs``, two at a time."""
    return two_at_a_time(run_engine, runs)


@pytest.fixture(scope="module", autouse=True)
def engines_of_the_selected_tests(request, tiny_model):
    """The engine runs the selected tests of this module read, started two at a time."""
    runs = set()
    for item in request.session.items:
        if item.module is not request.module or item.get_closest_marker("skip"):  # --slow's, unasked
            continue
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if "page_size" in params:
            modes = ("sglang", "lockstep") if item.originalname.startswith("test_lockstep") else ("sglang", "1")
            runs |= {(tiny_model, params["page_size"], params["pool"], mode) for mode in modes}
    run_engines(sorted(runs, key=lambda run: run[1]))  # page 1, the longest, first


def swa_ext_lines(log):
    return [line for line in log.splitlines() if "swa_ext:" in line]


def slow_unless(in_ci, configs):
    """pytest params of (page size, pool) configs, those not in ``in_ci`` marked slow: CI
    has minutes for each page size once on the default pool with swa_ext serving alone and
    once on the tight pool in lockstep (which compares every call and the outputs too);
    --slow runs the rest."""
    return [pytest.param(*c, id=f"page{c[0]}-pool{c[1][0]}", marks=() if c in in_ci else pytest.mark.slow)
            for c in configs]


CONFIGS = [(16, DEFAULT_POOL), (1, DEFAULT_POOL), (16, TIGHT_POOL), (1, TIGHT_POOL)]


@pytest.mark.parametrize("page_size,pool", slow_unless({(16, DEFAULT_POOL), (1, DEFAULT_POOL)}, CONFIGS))
def test_swa_ext_serves_sglangs_engine_with_sglangs_outputs(tiny_model, page_size, pool):
    reference = run_engine(tiny_model, page_size, pool, "sglang")
    served = run_engine(tiny_model, page_size, pool, "1")
    assert served["rounds"] == reference["rounds"]
    assert not swa_ext_lines(reference["log"])
    lines = swa_ext_lines(served["log"])
    assert len(lines) == 1 and "SWATokenToKVPoolAllocator serves a full pool of" in lines[0], lines
    assert f"page size {page_size}" in lines[0]
    assert all(o["cached_tokens"] == 0 for o in reference["rounds"][0])  # nothing to hit yet
    if pool == DEFAULT_POOL:
        assert any(o["cached_tokens"] > 0 for o in reference["rounds"][1])  # the radix cache hits
    else:
        assert queued(reference["log"]) and queued(served["log"])  # requests waited for memory


def queued(log):
    """Whether the scheduler ever logged a waiting request (``#queue-req: N``, N > 0)."""
    return re.search(r"#queue-req: [1-9]", log) is not None


LOCKSTEP_CONFIGS = [(16, DEFAULT_POOL), (16, TIGHT_POOL), (1, TIGHT_POOL)]


@pytest.mark.parametrize("page_size,pool", slow_unless({(16, TIGHT_POOL), (1, TIGHT_POOL)}, LOCKSTEP_CONFIGS))
def test_lockstep_engine_run_has_no_divergence(tiny_model, page_size, pool):
    reference = run_engine(tiny_model, page_size, pool, "sglang")
    lockstep = run_engine(tiny_model, page_size, pool, "lockstep")  # a divergence raises in the scheduler
    assert lockstep["rounds"] == reference["rounds"]
    assert pool == DEFAULT_POOL or queued(lockstep["log"])
    assert "LockstepDivergence" not in lockstep["log"]
    counts = lockstep["counts"]
    decode_call = "alloc_decode" if page_size > 1 else "alloc"
    for call in (decode_call, "available_size", "free_group_begin", "free_group_end", "maybe_evict_swa"):
        assert counts.get(call, 0) > 0, (call, counts)
    assert sum(n for call, n in counts.items() if call.startswith("free") and "group" not in call) > 0, counts


def test_outputs_depend_on_the_context(tiny_model):
    """Each round-2 prompt ends on its round-1 prompt's last token after another context:
    with weights that read the KV cache, the continuations differ."""
    rounds = run_engine(tiny_model, 16, DEFAULT_POOL, "sglang")["rounds"]
    for i in range(4):
        assert rounds[1][i]["output_ids"][:8] != rounds[0][i]["output_ids"][:8]
