"""Faults on a real prefill/decode deployment of SGLang on the CPU, the decode node on
swa_ext (tests/sglang/fault_harness.py): SGLang's router, a prefill node and a decode node
on 127.0.0.1, the KV over Mooncake's TCP transport, SGLang's strict memory and KV-page
checks on, a decode pool small enough that the node retracts requests under load.

One deployment per page size and allocator mode serves, first, test_pd_pair.py's requests
(a single engine's outputs, the window-tail path, the bytes sent), then every fault in
turn: clients that
hang up (waiting for prefill, with their KV in transfer, decoding), SGLang's abort endpoint
(a running request, a waiting one, all), the prefill node SIGKILLed with requests in
transfer (then a new one joins), a request longer than the decode pool, and waves of
concurrent requests. After each, the decode node must be whole: back to the free pages it
started with in both pools (swa_ext's counters; SGLang's idle check would stop the node),
alive, its next answers those of one engine, no problem in its log but those the fault
causes; and in the default mode, run in lockstep with SGLang's allocator, no divergence.
CI runs the default mode at page size 16 (CI_RUNS); --slow runs the rest.
"""
import functools
import json
import os
import re
import sys
import time
import traceback

import pytest

import fault_harness
import pd_harness
from fault_catalog import CHECK, CHECK_NEW, FAULTS, LOAD_NEW_TOKENS, load_wave

try:
    import mooncake.engine  # noqa: F401
    import sglang_router  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the venv
    pytest.skip(f"the deployment needs Mooncake's transfer engine and SGLang's router ({e}): run "
                "scripts/setup-sglang.sh", allow_module_level=True)

PAGE_SIZES = (16, 1)
# What CI runs: the default mode (in lockstep with SGLang's allocator) at page size 16
# (SGLang's window-tail preallocation, alloc_extend_swa_tail), the deployment and the
# speculative engine. The shared mode and page size 1 (SGLang preallocates with alloc) run
# with --slow: a deployment through every fault took 6.5 to 7 minutes on a busy 2-core
# machine, a speculative run 2 to 2.5, and CI has no more minutes to give.
CI_RUNS = {("default", 16)}


def in_ci(mode, page_size):
    return () if (mode, page_size) in CI_RUNS else pytest.mark.slow


PREFILL_TOKENS = 16384
# The decode pool: a few dozen of the load's requests at once. With a reserve of 1 token a
# request for its decoding (SGLang's default: 512) the node fills its pool with
# preallocations, and a decoding request that reaches a new page finds none: it retracts.
DECODE_TOKENS = 1024
DECODE_ARGS = ("--num-reserved-decode-tokens", "1")
# The load: waves of concurrent requests of mixed prompt lengths (most within the 64-token
# window, some beyond) and output lengths. CI sends one wave of 64 (a triton-interpreted
# decode step of a few dozen requests takes about a second on 2 cores); --slow sends 64
# then 256. (SWA_EXT_FAULTS_LOAD_WAVES, sizes separated by commas, sets other waves.)
CI_LOAD_WAVES, SLOW_LOAD_WAVES = (64,), (64, 256)


def load_waves(config):
    chosen = os.environ.get("SWA_EXT_FAULTS_LOAD_WAVES")
    if chosen:
        return tuple(int(n) for n in chosen.split(","))
    return SLOW_LOAD_WAVES if config.getoption("--slow") else CI_LOAD_WAVES




# What each fault may leave in the decode node's log (fault_harness.PROBLEM finds the
# lines): the regular expressions its lines must match, beyond those every fault may show.
# SGLang's deprecation warning, printed (with its source line) when it answers an error.
EVERY_FAULT = [r"FastAPIDeprecationWarning: ORJSONResponse is deprecated", r"^\s+return _create_error_response\(e\)$"]
ABORT_POSTED = r'"POST /abort_request HTTP/1.1" 200 OK'


def aborted(tag):
    """SGLang's line for a request of the fault's own (rid tag-N) given up before it decoded."""
    return rf"Decode (transfer|handshake) failed for request .*rid='{tag}-\d+'.*Aborted by AbortReq\.$"


EXPECTED_PROBLEMS = {
    "close_waiting": [aborted("close-waiting")],
    "close_in_transfer": [aborted("close-transfer")],
    "close_decoding": [],
    "abort_running": [ABORT_POSTED],
    "abort_waiting": [ABORT_POSTED, aborted("abort-waiting")],
    "abort_all": [ABORT_POSTED, aborted("abort-all-waiting")],
    "prefill_killed": [r"Some requests fail to receive KV Cache transfer done signal after bootstrapping",
                       r"Decode transfer failed for request .*rid='killed-\d+'.*(timed out after [\d.]+s in "
                       r"KVPoll\.WaitingForInput|Lost connection with prefill instance \(bootstrap_addr: [\d.:]+\))$",
                       r'"POST /generate HTTP/1\.1" 500 Internal Server Error$',
                       r"Deferred KV release for room \d+ timed out after [\d.]+s without a full drain ack from "
                       r"prefill; releasing anyway\.$",
                       r"Attempting to reconnect to 127\.0\.0\.1:\d+\.\.\.$",
                       r"Lost connection with prefill instance \(bootstrap_addr: 127\.0\.0\.1:\d+\), \d+ requests affected$"],
    "too_long": [r"Input length \(\d+ tokens\) exceeds the maximum allowed length \(\d+ tokens\)",
                 r"Request prompt exceeds the KV memory budget: input_len=\d+\.",
                 r'"POST /generate HTTP/1\.1" 400 Bad Request$'],
    "load": [],
}


def start_reference(model, workdir, page_size, name, rounds, new_tokens):
    """Rounds of prompts on one non-disaggregated engine (SGLang's allocator), in the
    background: its process and the path of its outputs (each request's output through the
    deployment is a prefix of its output here)."""
    spec_path, result = os.path.join(workdir, f"{name}-spec.json"), os.path.join(workdir, f"{name}.json")
    with open(spec_path, "w") as f:
        json.dump({"model": model, "rounds": rounds, "new_tokens": new_tokens,
                   "engine_args": {"page_size": page_size, "max_total_tokens": PREFILL_TOKENS}}, f)
    env = pd_harness.node_env("sglang", os.path.join(workdir, f"{name}-probe"))
    process = pd_harness.Process(name, [sys.executable, pd_harness.__file__, "engine", spec_path, result],
                                 env, os.path.join(workdir, f"{name}.log"))
    return process, result


def reference_rounds(process, result, timeout=1800):
    process.proc.wait(timeout=timeout)
    assert process.proc.returncode == 0, f"{process.name} failed:\n{process.log()}"
    with open(result) as f:
        return json.load(f)["rounds"]




# Each page size's references, from one engine, shared by the modes and test_shared_pd.py.
REFERENCES = {}


def references(model, page_size, waves):
    """The outputs on one engine at this page size of the check requests, the pair's
    requests and the load's waves, a round each, started in the background the first time
    (the caller's deployment runs meanwhile): a function that waits for them and returns
    them ({"check", "pair", "load"}), or with ``stop=True`` ends the engine."""
    if page_size not in REFERENCES:
        workdir = os.path.join(os.path.dirname(model), f"references-page{page_size}")
        os.makedirs(workdir, exist_ok=True)
        rounds = [CHECK, fault_harness.PAIR_PROMPTS] + [[p for p, _ in load_wave(size)] for size in waves]
        new_tokens = [CHECK_NEW, fault_harness.PAIR_NEW_TOKENS] + [LOAD_NEW_TOKENS[1]] * len(waves)
        process, result = start_reference(model, workdir, page_size, "reference", rounds, new_tokens)
        outputs = {}

        def read(stop=False):
            try:
                if not stop and not outputs:
                    check, pair, *load = reference_rounds(process, result)
                    outputs.update(check=check, pair=pair, load=load)
            finally:
                process.stop()
                if not outputs:  # stopped or failed: the next caller starts it again
                    REFERENCES.pop(page_size, None)
            return outputs

        REFERENCES[page_size] = read
    return REFERENCES[page_size]


def seen_summary(seen):
    """What a fault saw, for the log: the load's waves without their outputs."""
    if isinstance(seen, dict) and "waves" in seen:
        seen = dict(seen, waves=[{k: v for k, v in wave.items() if k != "outputs"} for wave in seen["waves"]])
    return json.dumps(seen, default=str)[:600]


def deployment_params():
    return [pytest.param((mode, page), id=f"{mode}-page{page}", marks=in_ci(mode, page))
            for page in PAGE_SIZES for mode in fault_harness.MODES]


@pytest.fixture(scope="module", params=deployment_params())
def faults_run(request, tiny_model):
    mode, page_size = request.param
    return deployment_run(request.session, tiny_model, mode, page_size)


def pair_groups(page_size, pool_tokens):
    """The pair's prompts in order, in groups whose full pages through their decoding fit
    the decode pool: no request of the pair retracts (its checks count each call)."""
    groups, pages = [[]], 0
    for i, n in enumerate(fault_harness.PAIR_PROMPT_LENS):
        need = -(-(n + fault_harness.PAIR_NEW_TOKENS) // page_size)
        assert need <= pool_tokens // page_size, (n, pool_tokens)
        if pages + need > pool_tokens // page_size:
            groups.append([])
            pages = 0
        groups[-1].append(i)
        pages += need
    return groups


def pair_requests(dep):
    """The pair's requests, first on a fresh deployment, group after group: their outputs,
    and the decode node's allocator calls, its lockstep counts and the bytes the prefill
    node sent, before and once they are done."""
    before = dep.calls()  # the servers' warm-up requests
    outputs = [None] * len(fault_harness.PAIR_PROMPTS)
    for group in pair_groups(dep.page_size, dep.decode_tokens):
        answers = dep.generate([fault_harness.PAIR_PROMPTS[i] for i in group],
                               [fault_harness.PAIR_NEW_TOKENS] * len(group))
        for i, answer in zip(group, answers):
            outputs[i] = answer
    calls = pd_harness.settled_allocator_calls(dep.pair.decode_probe)
    return {"outputs": outputs, "before": before, "calls": calls, "sent": pd_harness.sent_bytes(dep.pair.prefill_probe),
            "lockstep": dep.lockstep_counts() if dep.lockstep else None}


_deployment_runs = {}


def deployment_run(session, model, mode, page_size):
    """One deployment through the pair's requests and then every fault (once a session:
    test_pd_pair.py reads the pair's part of the default mode's at page 16)."""
    key = (model, mode, page_size)
    if key not in _deployment_runs:
        _deployment_runs[key] = run_deployment(session, model, mode, page_size)
    return _deployment_runs[key]


def run_deployment(session, model, mode, page_size):
    workdir = os.path.join(os.path.dirname(model), f"faults-{mode}-page{page_size}")
    os.makedirs(workdir, exist_ok=True)
    walls, run = {}, {"faults": {}}
    start = time.monotonic()
    waves = load_waves(session.config)
    reference = references(model, page_size, waves)
    try:
        dep = fault_harness.Deployment(model, workdir, mode, page_size, PREFILL_TOKENS, DECODE_TOKENS,
                                       DECODE_ARGS)
        dep.load_waves = waves
        start_beside_the_deployment(session, model)
        try:
            walls["start"] = round(time.monotonic() - start, 1)
            run["baseline"] = dep.wait_idle(dep.pool_pages())
            start = time.monotonic()
            run["pair"] = pair_requests(dep)
            walls["pair"] = round(time.monotonic() - start, 1)
            dep.wait_idle(run["baseline"])
            for fault in FAULTS:
                since, start = len(dep.decode_log()), time.monotonic()
                record = {}
                try:
                    record["seen"] = fault(dep)
                except Exception:  # noqa: BLE001 - the fault's test reports it
                    record["failed"] = traceback.format_exc()
                record["pages"] = dep.wait_idle(run["baseline"])
                record["alive"] = dep.decode_alive()
                try:
                    record["check"] = dep.generate(CHECK, [CHECK_NEW] * len(CHECK)) if record["alive"] else None
                except Exception:  # noqa: BLE001
                    record["check_failed"] = traceback.format_exc()
                record["problems"] = dep.decode_problems(since)
                record["wall_s"] = walls[fault.__name__] = round(time.monotonic() - start, 1)
                run["faults"][fault.__name__] = record
                print(f"fault {fault.__name__} ({mode}, page {page_size}): {record['wall_s']} s, pages "
                      f"{record['pages']} of {run['baseline']}, seen {seen_summary(record.get('seen'))}; "
                      f"problems {record['problems'][:8]}")
            run["lockstep"] = dep.lockstep_counts() if dep.lockstep else None
            run["calls"] = dep.calls()
            run["decode_log"] = dep.decode_log()
            run["evict_steps"] = dep.evict_steps()
            run["logs"] = dep.pair.logs()
        finally:
            dep.stop()
        run["stopped_logs"] = dep.pair.logs()
    except BaseException:
        reference(stop=True)
        raise
    start = time.monotonic()
    run["reference"] = reference()
    walls["reference_wait"] = round(time.monotonic() - start, 1)
    steps = run.get("evict_steps") or [[0, 0.0]]
    largest = max(size for size, _ in steps)
    # The largest batch is reached for a step or two: the steps of at least half of it too.
    at_largest, large = (sorted(us for size, us in steps if size >= least) for least in (largest, largest / 2))
    print(f"faults walls ({mode}, page {page_size}): {walls}; decode calls {run.get('calls')}; window eviction"
          f"{' (lockstep included)' if run.get('lockstep') else ''}: median {at_largest[len(at_largest) // 2]:.0f} µs "
          f"over {len(at_largest)} steps of the largest decode batch ({largest} requests), "
          f"{large[len(large) // 2]:.0f} µs over {len(large)} steps of {largest / 2:.0f} or more")
    return run


def check_after(run, name):
    """The checks after every fault: the pages, the node, its next answers, its log."""
    record = run["faults"][name]
    assert "failed" not in record, record["failed"]
    assert record["alive"], "the decode node died:\n" + run["decode_log"][-6000:]
    assert record["pages"] == run["baseline"], (record["pages"], run["baseline"])
    assert "check_failed" not in record, record.get("check_failed")
    assert record["check"] == [r[:CHECK_NEW] for r in run["reference"]["check"]]
    allowed = [re.compile(p) for p in EXPECTED_PROBLEMS[name] + EVERY_FAULT]
    unexpected = [line for line in record["problems"] if not any(p.search(line) for p in allowed)]
    assert not unexpected, unexpected[:20]
    return record["seen"]


def test_client_hangs_up_while_waiting_for_prefill(faults_run):
    seen = check_after(faults_run, "close_waiting")
    assert seen["preallocated"] is not False and seen["abort_logged"], seen


def test_client_hangs_up_with_its_kv_in_transfer(faults_run):
    seen = check_after(faults_run, "close_in_transfer")
    assert seen["held_transfers"] >= 1 and seen["abort_logged"], seen


def test_client_hangs_up_while_decoding(faults_run):
    assert check_after(faults_run, "close_decoding")["tokens_read"] == 3


def test_abort_endpoint_running_request(faults_run):
    seen = check_after(faults_run, "abort_running")
    assert seen["finish_reason"]["type"] == "abort", seen


def test_abort_endpoint_waiting_request(faults_run):
    seen = check_after(faults_run, "abort_waiting")
    assert seen["preallocated"] is not False and seen["finish_reason"]["type"] == "abort", seen


def test_abort_endpoint_all_requests(faults_run):
    seen = check_after(faults_run, "abort_all")
    assert [r["type"] for r in seen["finish_reasons"]] == ["abort"] * 5, seen


def test_prefill_node_killed_with_requests_in_transfer(faults_run):
    """The decode node gives up on the requests after SGLang's waiting timeout and answers
    their clients with an error; a new prefill node at the same address serves the next."""
    seen = check_after(faults_run, "prefill_killed")
    assert seen["held_transfers"] >= 1, seen
    timeout = float(fault_harness.SHORT_TIMEOUTS["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"])
    for status, body in seen["answers"]:
        # SGLang's heartbeat (every 5 s, two misses) may find the node gone first.
        waited = re.search(r"timed out after ([\d.]+)s in KVPoll\.WaitingForInput", str(body))
        lost = "Lost connection with prefill instance" in str(body)
        assert status == 500 and (lost or waited and float(waited.group(1)) >= timeout), seen["answers"]


def test_request_longer_than_the_decode_pool_is_refused(faults_run):
    seen = check_after(faults_run, "too_long")
    status, body = seen["answer"]
    # SGLang's tokenizer refuses it against the pool's size (the default mode); in the shared
    # mode it passes the tokenizer's limit and SGLang's scheduler refuses it against the KV
    # memory the allocator says a request can have (max_new_tokens_for_memory).
    refusals = ("exceeds the maximum allowed length", "Request prompt exceeds the KV memory budget")
    assert status == 400 and any(r in str(body) for r in refusals), seen
    assert seen["pages_after"] == seen["pages_before"]


def test_load_waves_complete_as_one_engine_with_retractions(faults_run):
    seen = check_after(faults_run, "load")
    for wave, reference in zip(seen["waves"], faults_run["reference"]["load"]):
        lengths = [n for _, n in load_wave(wave["size"])]
        assert len(wave["outputs"]) == wave["size"]
        assert wave["outputs"] == [r[:n] for r, n in zip(reference, lengths)]
    assert seen["retraction_backups"] > 0 and seen["retracted_logged"] > 0, seen


def test_no_lockstep_divergence(faults_run):
    assert "LockstepDivergence" not in faults_run["decode_log"]
    if faults_run["lockstep"] is not None:
        calls, lockstep = faults_run["calls"], faults_run["lockstep"]
        for call in ("alloc_extend_swa_tail", "alloc_decode", "free_segment"):
            assert lockstep.get(call) == calls.get(call), (call, calls, lockstep)


@functools.lru_cache(maxsize=None)
def mid_verify_run(model, mode, page_size):
    """SGLang's single engine with NGRAM speculative decoding and window eviction every
    step (tests/sglang/fault_spec_run.py), and at page size 16 test_spec_engine's run of
    SGLang's allocator alone on the same requests (one run a session): what
    test_abort_in_mid_verify_with_ngram_and_eviction_every_step checks."""
    from test_engine import run_script
    from test_spec_engine import TIGHT_POOL, engine_env, run_spec_engine

    sglang_mode, mode_env, _ = fault_harness.MODES[mode]
    out_dir = os.path.join(os.path.dirname(model), f"fault-spec-{mode}-page{page_size}")
    os.makedirs(out_dir, exist_ok=True)
    result, report, probe = (os.path.join(out_dir, name) for name in ("result.json", "lockstep.json", "probe"))
    env = dict(engine_env(sglang_mode, 1, report), SWA_EXT_PD_PROBE_DIR=probe, **mode_env)
    env["PYTHONPATH"] = os.pathsep.join([pd_harness.PROBE, pd_harness.HERE, env["PYTHONPATH"]])
    proc, log, counts, wall = run_script([os.path.join(pd_harness.HERE, "fault_spec_run.py"), model, result,
                                          str(page_size), str(TIGHT_POOL)], env, out_dir, report)
    run = None
    if proc.returncode == 0:
        with open(result) as f:
            run = json.load(f)
    reference = run_spec_engine(model, None, "NGRAM", 4, page_size, 1, "sglang")
    return {"returncode": proc.returncode, "log": log, "counts": counts, "wall": wall, "run": run,
            "reference": reference}


_started_beside = []


def start_beside_the_deployment(session, model):
    """The first fault deployment's faults mostly wait (for disconnects, transfers, a
    restarted prefill node), leaving a core idle: the NGRAM runs of the selected mid-verify
    tests meanwhile, one after the other (pd_harness.run_beside; their test joins before
    reading them)."""
    if _started_beside:
        return
    _started_beside.append(True)
    selected = [item for item in session.items if not item.get_closest_marker("skip")]
    mid_verify = [item.callspec.params for item in selected
                  if item.originalname == "test_abort_in_mid_verify_with_ngram_and_eviction_every_step"]

    def work():
        for params in mid_verify:
            mid_verify_run(model, params["mode"], params["page_size"])

    pd_harness.run_beside(work)


@pytest.mark.parametrize("mode,page_size", [pytest.param(mode, page, marks=in_ci(mode, page))
                                            for page in PAGE_SIZES for mode in fault_harness.MODES])
def test_abort_in_mid_verify_with_ngram_and_eviction_every_step(tiny_model, mode, page_size):
    """SGLang's single engine with NGRAM speculative decoding and window eviction every
    step: a request aborted while the batch verifies drafts ends as aborted, the pools are
    whole again, the same requests then give SGLang's own outputs (its allocator alone)."""
    pd_harness.join_beside()
    result = mid_verify_run(tiny_model, mode, page_size)
    log, counts, run, reference = result["log"], result["counts"], result["run"], result["reference"]
    assert result["returncode"] == 0, log[-6000:]
    print(f"abort in mid-verify, page {page_size}: {result['wall']:.0f} s; round one {run['round1']}; "
          f"calls {run['calls']}")
    reasons = [r["finish_reason"]["type"] for r in run["round1"]]
    assert reasons == ["abort", "length", "length", "length"], run["round1"]
    assert run["round1"][0]["spec_verify_ct"] >= 1  # it verified before the abort
    assert run["calls"]["free_after_last_call"] == run["calls"]["pool_sizes"]
    assert "LockstepDivergence" not in log
    if fault_harness.MODES[mode][2]:  # lockstep
        assert counts.get("maybe_evict_swa", 0) > 0 and counts.get("free_segment", 0) >= 8, counts
    # At page size 16, test_spec_engine's own run of SGLang's allocator (one run a session).
    assert reference.rows is not None, reference.log[-6000:]
    assert run["round2"] == [r["output_ids"] for r in reference.rows]
    # From the first batch on: the start-up's lines (SGLang's warnings on a CPU, its model
    # imports, the interpreter's warm-up) are no fault's.
    assert "Prefill batch" in log, log[-6000:]
    serving = log[log.index("Prefill batch"):]
    problems = [line for line in serving.splitlines() if fault_harness.PROBLEM.search(line)]
    assert not [line for line in problems if "abort" not in line.lower()], problems[:20]
