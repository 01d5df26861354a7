"""swa_ext's shared mode (SWA_EXT_SGLANG=1 SWA_EXT_SHARED=1: one budget of pages for full
and SWA KV, the SWA layers' KV in the full layers' buffers) in SGLang's own offline engine
on the CPU, SGLang's strict memory and KV-page checks on, each run its own process:

- the outputs and cached tokens of SGLang's allocator (tests/sglang/engine_run.py's two
  rounds with radix-cache hits), page sizes 16 and 1;
- a workload SGLang's fixed split mis-sizes (its 0.8 fallback SWA ratio, prompts of 15
  windows): at the same KV bytes the shared mode runs at least 1.3x the requests at
  once, read from the scheduler's own decode log (``#running-req``);
- NGRAM speculative decoding (tests/sglang/spec_engine_run.py, a pool that makes requests
  wait): SGLang's outputs and verify counts.
"""
import json
import os
import re

import pytest

import capacity_run
import pd_harness
from test_engine import DEFAULT_POOL, run_engine, run_script, swa_ext_lines
from test_spec_engine import run_spec_engine

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED_LINE = re.compile(r"swa_ext: shared mode: one budget of (\d+) slots for full and SWA KV, in the bytes SGLang "
                         r"sized for (\d+) full and (\d+) SWA tokens")
SGLANG_SIZES = re.compile(r"full_layer_tokens=(\d+), swa_layer_tokens=(\d+)")


def sizes(log):
    """(SGLang's full and SWA token counts, the shared mode's slots or None) from a run's log."""
    sglang = SGLANG_SIZES.findall(log)  # from the profiled bytes, then at --max-total-tokens: the last one holds
    shared = SHARED_LINE.findall(log)
    assert len(shared) <= 1, shared
    return tuple(map(int, sglang[-1])), (tuple(map(int, shared[0])) if shared else None)


def check_shared_served(log, page_size):
    """One line says the shared mode's allocator serves, over slots that are SGLang's two
    pools' at the same KV bytes (its sizing line, unchanged)."""
    (full, swa), shared = sizes(log)
    assert shared == (full + swa, full, swa), shared
    served = [line for line in swa_ext_lines(log) if " serves " in line]
    assert len(served) == 1 and f"SharedSWATokenToKVPoolAllocator serves one budget of {full + swa} tokens for full " \
        f"and SWA pages, shared mode" in served[0] and f"page size {page_size}" in served[0], served


@pytest.mark.parametrize("page_size", [16, 1])
def test_shared_mode_gives_sglangs_outputs(tiny_model, page_size):
    reference = run_engine(tiny_model, page_size, DEFAULT_POOL, "sglang")
    shared = run_engine(tiny_model, page_size, DEFAULT_POOL, "shared")
    assert shared["rounds"] == reference["rounds"]
    assert any(o["cached_tokens"] > 0 for o in shared["rounds"][1])  # the radix cache hit
    check_shared_served(shared["log"], page_size)
    assert sizes(shared["log"])[0] == sizes(reference["log"])[0]


def run_capacity(model, mode):
    """One engine on capacity_run.py's workload: its log, outputs and the requests running
    at each decode step, as the scheduler logged them."""
    out_dir = os.path.join(os.path.dirname(model), f"capacity-{mode}")
    os.makedirs(out_dir, exist_ok=True)
    result = os.path.join(out_dir, "result.json")
    env = pd_harness.node_env(mode, os.path.join(out_dir, "probe"))  # strict checks on, SWA freed every 16 steps
    proc, log, _, wall = run_script([os.path.join(HERE, "capacity_run.py"), model, result], env, out_dir,
                                    os.path.join(out_dir, "lockstep.json"))
    assert proc.returncode == 0 and os.path.exists(result), f"capacity run failed ({mode}):\n{log[-6000:]}"
    with open(result) as f:
        outputs = json.load(f)["outputs"]
    running = [int(n) for n in re.findall(r"Decode batch, #running-req: (\d+)", log)]
    print(f"capacity run {mode}: {wall:.0f} s, most requests running at once {max(running)}")
    return {"log": log, "outputs": outputs, "running": running}


def test_shared_mode_holds_more_requests_where_sglangs_split_mis_sizes(tiny_model):
    """Same KV bytes (SGLang's own sizing line, the same in both runs); the most requests
    the scheduler decoded at once, from its own log line of every decode step."""
    runs = {mode: run_capacity(tiny_model, mode) for mode in ("sglang", "shared")}
    check_shared_served(runs["shared"]["log"], capacity_run.ENGINE_ARGS["page_size"])
    assert sizes(runs["shared"]["log"])[0] == sizes(runs["sglang"]["log"])[0]
    most = {mode: max(run["running"]) for mode, run in runs.items()}
    print(f"most requests decoding at once: SGLang's split {most['sglang']}, shared {most['shared']} "
          f"({most['shared'] / most['sglang']:.2f}x)")
    assert most["shared"] >= 1.3 * most["sglang"], most
    assert all(len(o) == capacity_run.NEW_TOKENS for run in runs.values() for o in run["outputs"])
    assert "out of memory" not in runs["shared"]["log"].lower()


def test_ngram_speculative_decoding_in_the_shared_mode(tiny_model):
    """NGRAM (one chain of 4 draft tokens), page 16, eviction every step, SGLang's pool of
    320 tokens a side (640 slots in the shared mode; requests wait in both): the
    outputs and cached tokens of SGLang's allocator, and verifies that committed drafts.
    The verify counts themselves follow the batches (NGRAM drafts from every request's
    tokens so far), which the larger budget changes."""
    run = lambda mode: run_spec_engine(tiny_model, None, "NGRAM", 4, 16, 1, mode)  # noqa: E731
    reference, shared = run("sglang"), run("shared")
    assert reference.rows is not None, f"SGLang's own run failed:\n{reference.log[-6000:]}"
    assert shared.rows is not None, f"the shared run failed:\n{shared.log[-6000:]}"
    for key in ("output_ids", "cached_tokens"):
        assert [r[key] for r in shared.rows] == [r[key] for r in reference.rows], key
    verifies = [(r["spec_verify_ct"], len(r["output_ids"])) for r in shared.rows]
    assert all(0 < v <= n for v, n in verifies) and any(v < n - 1 for v, n in verifies), verifies
    check_shared_served(shared.log, 16)
