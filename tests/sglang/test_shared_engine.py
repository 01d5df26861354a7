"""swa_ext's shared mode (SWA_EXT_SGLANG=shared: one budget of pages for full
and SWA KV, the SWA layers' KV in the full layers' buffers) in SGLang's own offline engine
on the CPU, SGLang's strict memory and KV-page checks on, each run its own process:

- the outputs and cached tokens of SGLang's allocator (tests/sglang/engine_run.py's two
  rounds with radix-cache hits), page sizes 16 and 1;
- a workload SGLang's fixed split mis-sizes (its 0.8 fallback SWA ratio, prompts of 15
  windows): at the same KV bytes the shared mode runs at least 1.3x the requests at
  once, read from the scheduler's own decode log (``#running-req``);
- NGRAM speculative decoding (tests/sglang/spec_engine_run.py, a pool that makes requests
  wait): SGLang's outputs and verify counts;
- a draft model, its KV at every slot of the one budget: EAGLE3 on the tiny gpt-oss
  (with --slow, STANDALONE on the tiny Granite-SWA): SGLang's outputs, no out of memory;
- a non-1:1 layer mix on parent pages: the tiny gpt-oss with 3 sliding layers to 1 full
  (parent pages of 3 full pages or one SWA page, the SWA layers strided views of the one
  storage): SGLang's outputs, no out of memory.
"""
import json
import os
import re

import pytest

import capacity_run
from conftest import TINY_PAIRS, model_config, write_checkpoint
import pd_harness
from test_engine import DEFAULT_POOL, run_engines, run_script, swa_ext_lines
from test_spec_engine import GPT_OSS_CONFIG, draft_model, gpt_oss_models, run_spec_engine  # noqa: F401 (fixtures)
from swa_ext.sglang import shared_pool
from swa_ext.sglang.installer import REFUSED_EXIT_STATUS

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED_LINE = re.compile(r"swa_ext: shared mode: one budget of (\d+) slots for full and SWA KV, in the bytes SGLang "
                         r"sized for (\d+) full and (\d+) SWA tokens")
SLOT_KINDS_CHECKED = "swa_ext: SWA_EXT_DEBUG=1: each scheduler step checks that no slot holds a full and an SWA token"
SGLANG_SIZES = re.compile(r"full_layer_tokens=(\d+), swa_layer_tokens=(\d+)")
DRAFT_SHARE = re.compile(r"and a draft model's KV at the (\d+) full tokens; the draft's KV covers every slot: (\d+) of "
                         r"(\d+) KV rows a slot, ([\d.]+)% of the budget")
KV_POOL_TOKENS = re.compile(r"KV Cache is allocated\. .*?#tokens: (\d+)")
PARENT_PAGES = re.compile(r"; parent pages of (\d+) full pages or one SWA page \(KV entries of (\d+) and (\d+) bytes a "
                          r"token\): (\d+) full or (\d+) SWA slots")


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
    assert len(served) == 1 and f"SharedSWATokenToKVPoolAllocator serves one budget for full and SWA pages: " \
        f"{full + swa} full or {full + swa} SWA slots, parent_k 1" in served[0] and \
        f"page size {page_size}" in served[0], served


# (pairs of layers, page size): the tiny model (two pairs; its references are test_engine's
# too); with --slow, the same with twelve pairs as gpt-oss-20b has (engine_run.py's short
# workload: a step of 24 layers in triton's interpreter takes seconds, and CI has no more
# minutes; the layer views of every pair are checked without an engine in
# test_shared_adapter.py). Triton, the one attention backend the shared mode serves that
# runs on this CPU (intel_amx needs SGLang's CPU sgl-kernel, built from source;
# torch_native is refused: test_shared_adapter.py).
CASES = [(TINY_PAIRS, 16), (TINY_PAIRS, 1)]
SLOW_CASES = [(12, 16)]
# Each comparison above shown able to fail: the same run with a planted KV fault. A layer's
# view one layer off runs in CI on the 3 : 1 mix below; --slow adds it on both pair models.
FAULTS = [("write_row_off", TINY_PAIRS, 16), ("write_row_off", TINY_PAIRS, 1)]
SLOW_FAULTS = [("view_layer_off", 12, 16), ("view_layer_off", TINY_PAIRS, 16)]
# A non-1:1 layer mix: test_spec_engine's tiny gpt-oss with 3 sliding layers to 1 full
# (equal KV rows, so k = 3: a parent is 3 full pages or one SWA page) and a 64-token window
# (engine_run.py's decodes slide past it), on SGLang's dummy weights widened to
# +-DUMMY_WEIGHTS; page 16. Its reference, the shared run, and the shared run with an SWA
# layer's strided view one layer off.
GPT_OSS_MIX = "gpt-oss 3:1"
GPT_OSS_MIX_CONFIG = dict(GPT_OSS_CONFIG, sliding_window=64,
                          layer_types=["sliding_attention"] * 3 + ["full_attention"])
MIX_RUNS = [(GPT_OSS_MIX, 16, "sglang", None), (GPT_OSS_MIX, 16, "shared", None),
            (GPT_OSS_MIX, 16, "shared", "view_layer_off")]
LAYERS = {TINY_PAIRS: 2 * TINY_PAIRS, 12: 24, GPT_OSS_MIX: 4}


@pytest.fixture(scope="module")
def gpt_oss_mix_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_3_sliding_1_full")
    (path / "config.json").write_text(json.dumps(GPT_OSS_MIX_CONFIG))
    return str(path)


@pytest.fixture(scope="module")
def engine_runs(request, tiny_model, twelve_pair_model, gpt_oss_mix_model):
    """Every run of CASES, FAULTS (SLOW_FAULTS with --slow) and MIX_RUNS and their
    references, two engines at a time (one a core)."""
    models = {TINY_PAIRS: tiny_model, 12: twelve_pair_model, GPT_OSS_MIX: gpt_oss_mix_model}
    slow = request.config.getoption("--slow")
    runs = {(pairs, page, mode, None) for pairs, page in CASES + (SLOW_CASES if slow else [])
            for mode in ("sglang", "shared")}
    faults = FAULTS + (SLOW_FAULTS if slow else [])
    runs |= {(pairs, page, "shared", fault) for fault, pairs, page in faults}
    runs |= set(MIX_RUNS)
    order = sorted(runs, key=lambda r: (r[1], -LAYERS[r[0]], str(r)))  # the longest first
    results = run_engines([(models[model], page, DEFAULT_POOL, mode, fault, "short" if model == 12 else "full",
                            DUMMY_WEIGHTS if model == GPT_OSS_MIX else None) for model, page, mode, fault in order])
    return dict(zip(order, results.values()))


def differing_tokens(run, reference):
    return sum(a != b for got, want in zip(run["rounds"], reference["rounds"]) for o, r in zip(got, want)
               for a, b in zip(o["output_ids"], r["output_ids"]))


@pytest.mark.parametrize("pairs,page_size", CASES + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[f"{p}pairs-page{q}" for p, q in CASES + SLOW_CASES])
def test_shared_mode_gives_sglangs_outputs(engine_runs, pairs, page_size):
    """Greedy outputs and cached tokens equal to SGLang's own allocator's, two rounds with
    radix hits, decodes past the window; SWA_EXT_DEBUG=1 checked each step that no slot
    held a full and an SWA token at once (a collision stops the engine)."""
    reference, shared = engine_runs[pairs, page_size, "sglang", None], engine_runs[pairs, page_size, "shared", None]
    assert shared["rounds"] == reference["rounds"]
    assert any(o["cached_tokens"] > 0 for o in shared["rounds"][1])  # the radix cache hit
    check_shared_served(shared["log"], page_size)
    assert sizes(shared["log"])[0] == sizes(reference["log"])[0]
    assert SLOT_KINDS_CHECKED in shared["log"]


@pytest.mark.parametrize("fault,pairs,page_size", FAULTS + [pytest.param(*f, marks=pytest.mark.slow) for f in SLOW_FAULTS],
                         ids=[f"{f}-{p}pairs-page{q}" for f, p, q in FAULTS + SLOW_FAULTS])
def test_a_planted_kv_fault_changes_the_outputs(engine_runs, fault, pairs, page_size):
    """The comparison above can fail: the same run with SWA-layer KV written one slot off,
    or an SWA layer's view one layer off, gives other tokens than SGLang's allocator."""
    faulty, reference = engine_runs[pairs, page_size, "shared", fault], engine_runs[pairs, page_size, "sglang", None]
    differ = differing_tokens(faulty, reference)
    print(f"{fault}, {pairs} pairs, page {page_size}: {differ} tokens differ from SGLang's allocator's")
    assert differ > 0


def test_a_3_to_1_layer_mix_on_parent_pages_gives_sglangs_outputs(engine_runs):
    """KV entries of one full layer's row and three SWA layers' rows a token: parent pages
    of 3 full pages or one SWA page, the SWA layers' buffers strided views of the one
    storage, each side's slots in the bytes SGLang sized for its two pools. Greedy outputs
    and cached tokens of SGLang's allocator, two rounds with radix hits, decodes past the
    window, no out of memory, SWA_EXT_DEBUG=1's check of each step; the same run with an
    SWA layer's view one layer off gives other tokens."""
    reference, shared, faulty = (engine_runs[run] for run in MIX_RUNS)
    assert shared["rounds"] == reference["rounds"]
    assert any(o["cached_tokens"] > 0 for o in shared["rounds"][1])  # the radix cache hit
    assert "out of memory" not in shared["log"].lower() and SLOT_KINDS_CHECKED in shared["log"]
    (full, swa), (slots, sized_full, sized_swa) = sizes(shared["log"])
    assert (full, swa) == (sized_full, sized_swa) == sizes(reference["log"])[0]
    (k, full_entry, swa_entry, full_slots, swa_slots), = [tuple(map(int, m)) for m in PARENT_PAGES.findall(shared["log"])]
    layer_types = GPT_OSS_MIX_CONFIG["layer_types"]
    assert swa_entry == full_entry * layer_types.count("sliding_attention") // layer_types.count("full_attention")
    assert (full_slots, swa_slots, k) == shared_pool.one_budget_sizes(full, swa, full_entry=full_entry,
                                                                      swa_entry=swa_entry, draft_entry=0, page_size=16)
    assert k == -(-layer_types.count("sliding_attention") // layer_types.count("full_attention")) > 1
    assert slots == full_slots
    served = [line for line in swa_ext_lines(shared["log"]) if " serves " in line]
    assert len(served) == 1 and f"serves one budget for full and SWA pages: {full_slots} full or {swa_slots} SWA " \
        f"slots, parent_k {k} (small side full)" in served[0], served
    assert "the large side's layers are strided views" in shared["log"]
    differ = differing_tokens(faulty, reference)
    print(f"view_layer_off, gpt-oss 3:1, page 16: {differ} of "
          f"{sum(len(o['output_ids']) for r in reference['rounds'] for o in r)} tokens differ from SGLang's allocator's")
    assert differ > 0


@pytest.fixture(scope="module")
def windowless_model(tmp_path_factory):
    """The tiny model's architecture (GraniteSWAForCausalLM, which SGLang builds hybrid by
    its layer_types) with model_type ``granite``: its attention layers have no window and
    no sinks, so the layers SGLang's pool keeps as SWA layers attend at full slots."""
    from safetensors.torch import load_file, save_file

    path = str(tmp_path_factory.mktemp("granite_windowless"))
    write_checkpoint(path)
    weights = os.path.join(path, "model.safetensors")
    save_file({k: v for k, v in load_file(weights).items() if not k.endswith(".sinks")}, weights)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(model_config(), model_type="granite"), f)
    return path


# What would read SWA layers' KV at full slots, and so read the paired full layer's KV in
# one slot space: (the model, the attention backend, the refusal's reason).
REFUSED = {
    "torch_native": ("tiny", "torch_native", "attention backend torch_native (it reads SWA layers' KV at full slots; "
                                             "--attention-backend triton serves on the CPU)"),
    "windowless_swa_layers": ("windowless", "triton", "layers [0, 2] are kept as SWA layers by SGLang's KV pool but "
                                                      "attend without a window"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_reads_swa_kv_at_full_slots_is_refused_at_start_up(tiny_model, windowless_model, case):
    """The engine does not start: one line says why and what serves. (With two pools both
    read stale SWA rows, the same with SGLang's allocator and swa_ext's default mode: the
    windowless model gave SGLang's outputs there and differed in 78 of 80 tokens in the
    shared mode before this refusal.)"""
    model_name, backend, reason = REFUSED[case]
    model = {"tiny": tiny_model, "windowless": windowless_model}[model_name]
    out_dir = os.path.join(os.path.dirname(model), f"shared-refused-{case}")
    os.makedirs(out_dir, exist_ok=True)
    result = os.path.join(out_dir, "result.json")
    env = pd_harness.node_env("shared", os.path.join(out_dir, "probe"))
    proc, log, _, _ = run_script([os.path.join(HERE, "engine_run.py"), model, result, "16", str(DEFAULT_POOL[0]),
                                  DEFAULT_POOL[1], backend, "short"], env, out_dir, os.path.join(out_dir, "lockstep.json"))
    # The scheduler's one line and status end the engine's process too: no traceback.
    assert proc.returncode == REFUSED_EXIT_STATUS and not os.path.exists(result), log[-6000:]
    refusals = [line for line in log.splitlines() if "swa_ext: " in line]
    assert len(refusals) == 1 and refusals[0].startswith("swa_ext: SWA_EXT_SGLANG=shared serves"), log[-6000:]
    assert f"; not this one: {reason}" in refusals[0]
    assert "Traceback" not in log and "Decode batch" not in log and "Prefill batch" not in log


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
    runs = {mode: run for (_, mode), run in
            pd_harness.two_at_a_time(run_capacity, [(tiny_model, "sglang"), (tiny_model, "shared")]).items()}
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
    runs = pd_harness.two_at_a_time(run_spec_engine, [(tiny_model, None, "NGRAM", 4, 16, 1, mode, "auto", fault)
                                           for mode, fault in (("sglang", None), ("shared", None),
                                                               ("shared", "write_row_off"))])
    reference, shared, faulty = runs.values()
    assert reference.rows is not None, f"SGLang's own run failed:\n{reference.log[-6000:]}"
    assert shared.rows is not None, f"the shared run failed:\n{shared.log[-6000:]}"
    for key in ("output_ids", "cached_tokens"):
        assert [r[key] for r in shared.rows] == [r[key] for r in reference.rows], key
    verifies = [(r["spec_verify_ct"], len(r["output_ids"])) for r in shared.rows]
    assert all(0 < v <= n for v, n in verifies) and any(v < n - 1 for v, n in verifies), verifies
    check_shared_served(shared.log, 16)
    assert SLOT_KINDS_CHECKED in shared.log
    # The comparison can fail: SWA-layer KV written one slot off gives other tokens.
    assert faulty.rows is not None, f"the run with a planted fault failed:\n{faulty.log[-6000:]}"
    assert [r["output_ids"] for r in faulty.rows] != [r["output_ids"] for r in reference.rows]


# Draft models in the one budget: (target, algorithm, draft tokens). EAGLE3 on test_spec_engine's
# tiny gpt-oss (two pairs of layers, a one-layer EAGLE3 draft), SGLang's dummy weights widened
# to +-DUMMY_WEIGHTS (at SGLang's +-1e-3 the target repeats one token whatever its KV); with
# --slow, STANDALONE on the tiny Granite-SWA with test_spec_engine's one-layer Llama draft.
DRAFT_CASES = [("gpt-oss", "EAGLE3", 3)]
SLOW_DRAFT_CASES = [("granite", "STANDALONE", 2)]
DUMMY_WEIGHTS = 0.2


@pytest.mark.parametrize("target,algorithm,draft_tokens",
                         DRAFT_CASES + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_DRAFT_CASES],
                         ids=[f"{t}-{a}" for t, a, _ in DRAFT_CASES + SLOW_DRAFT_CASES])
def test_a_draft_model_in_the_shared_mode(tiny_model, draft_model, gpt_oss_models, target, algorithm, draft_tokens):
    """A draft model's KV is indexed by the target's full slots, which in one slot space may
    be any slot: its pool covers every slot, in a slot count that keeps target and draft
    within the bytes SGLang sized (its two pools and the draft's at its full token count).
    test_spec_engine.py's pool of 320 tokens a side (requests wait), page 16, eviction every
    step: the outputs and cached tokens of SGLang's allocator, no out of memory; the same
    run with SWA-layer KV written one slot off gives other tokens. SGLang's allocator runs
    in lockstep with swa_ext's default mode (every allocator call compared), so that the
    reference is also the default mode's identity test for this draft."""
    if target == "gpt-oss":
        (model, draft), load_format, weights = gpt_oss_models, "dummy", DUMMY_WEIGHTS
    else:
        model, draft, load_format, weights = tiny_model, draft_model, "auto", None
    runs = pd_harness.two_at_a_time(run_spec_engine, [
        (model, draft, algorithm, draft_tokens, 16, 1, mode, load_format, fault, weights)
        for mode, fault in (("lockstep", None), ("shared", None), ("shared", "write_row_off"))])
    reference, shared, faulty = runs.values()
    assert reference.rows is not None, f"SGLang's run in lockstep failed:\n{reference.log[-6000:]}"
    assert "LockstepDivergence" not in reference.log, reference.log[-6000:]
    assert all(reference.counts.get(call, 0) > 0 for call in ("alloc_extend", "maybe_evict_swa", "free_segment")), \
        reference.counts  # each step's reserve (page 16), the eviction, the requests' release: compared
    assert shared.rows is not None, f"the shared run failed:\n{shared.log[-6000:]}"
    for key in ("output_ids", "cached_tokens"):
        assert [r[key] for r in shared.rows] == [r[key] for r in reference.rows], key
    assert all(0 < r["spec_verify_ct"] <= len(r["output_ids"]) for r in shared.rows), shared.rows
    assert "out of memory" not in shared.log.lower()
    assert SLOT_KINDS_CHECKED in shared.log

    # The slots: target and draft rows together within SGLang's bytes, as many as fit.
    (full, swa), (slots, _, _) = sizes(shared.log)
    pairs, draft_layers = TINY_PAIRS, 1
    (draft_full, rows_of_draft, rows_a_slot, share), = DRAFT_SHARE.findall(shared.log)
    assert (int(draft_full), int(rows_of_draft), int(rows_a_slot)) == (full, draft_layers, pairs + draft_layers)
    assert float(share) == round(100 * draft_layers / (pairs + draft_layers), 1)
    sglang_rows = full * (pairs + draft_layers) + swa * pairs
    assert slots % 16 == 0 and slots * (pairs + draft_layers) <= sglang_rows < (slots + 16) * (pairs + draft_layers)
    assert slots < full + swa  # the draft's rows at the SWA side's slots come out of the one budget
    served = [line for line in swa_ext_lines(shared.log) if " serves " in line]
    assert len(served) == 1 and f"serves one budget for full and SWA pages: {slots} full or {slots} SWA slots" \
        in served[0], served
    # Every KV pool SGLang built, the draft's included, spans the one slot space; SGLang's
    # own run builds the draft's at its full token count.
    assert set(map(int, KV_POOL_TOKENS.findall(shared.log))) == {slots}, KV_POOL_TOKENS.findall(shared.log)
    assert full in set(map(int, KV_POOL_TOKENS.findall(reference.log)))

    assert faulty.rows is not None, f"the run with a planted fault failed:\n{faulty.log[-6000:]}"
    differ = sum(a != b for f, r in zip(faulty.rows, reference.rows) for a, b in zip(f["output_ids"], r["output_ids"]))
    print(f"{algorithm}, write_row_off: {differ} of {sum(len(r['output_ids']) for r in reference.rows)} tokens "
          f"differ from SGLang's allocator's")
    assert differ > 0
