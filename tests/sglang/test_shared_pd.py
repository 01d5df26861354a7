"""A PD decode node, and a prefill node + decode node pair over Mooncake, with the decode
node on swa_ext's shared mode (SWA_EXT_SGLANG=shared): SGLang's decode path
preallocates each request's prompt on the full side and its window tail on the SWA side
from the one budget, and the prefill node's SWA layers send their window tails into
slots whose storage the decode node's full layers share.

The node runs with SGLang's fake transfer (test_pd_node.py's prompts and settings): the
outputs of SGLang's allocator, the window-tail path, every page free at the end; in a pool
too small for every request at once (the node's reserved decode tokens priced on the one
budget), preallocations wait and none fails. The pair (test_pd_pair.py's prompts): the
outputs of one non-disaggregated engine, so every prompt's KV crossed into the right slots.
"""
import functools
import os
import re
import time

import pytest

import fault_harness
import pd_harness
import test_pd_node
from test_shared_engine import SLOT_KINDS_CHECKED, check_shared_served

try:
    import mooncake.engine  # noqa: F401
    import sglang_router  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the venv
    pytest.skip(f"the pair needs Mooncake's transfer engine and SGLang's router ({e}): run scripts/setup-sglang.sh",
                allow_module_level=True)

# (config, mode[, planted KV fault]): SGLang's run is test_pd_node.py's, once a session.
NODE_RUNS = [("page16", "sglang"), ("page16", "shared"), ("page16-tight", "shared"), ("page16", "shared", "write_row_off")]


@pytest.fixture(scope="module")
def node_runs(tiny_model):
    return pd_harness.two_at_a_time(functools.partial(test_pd_node.decode_node, tiny_model), NODE_RUNS)


def test_shared_decode_node_serves_sglangs_outputs_on_the_tail_path(node_runs):
    """Page 16: SGLang's outputs. The tight pool: a preallocation waits, none fails, every
    page comes back. (Its outputs are not compared: the fake transfer writes no KV, so a
    request that waits decodes over what its recycled slots last held.)"""
    for config in ("page16", "page16-tight"):
        run = node_runs[config, "shared"]
        test_pd_node.check_run(run, "shared")  # the shared allocator served; every page free at the end
        test_pd_node.check_tail_path(run)
        check_shared_served(run["log"], 16)
        assert "out of memory" not in run["log"].lower()
    assert node_runs["page16", "shared"]["outputs"] == node_runs["page16", "sglang"]["outputs"]
    assert re.search(r"#prealloc-req: [1-9]", node_runs["page16-tight", "shared"]["log"]), "no preallocation waited"
    assert SLOT_KINDS_CHECKED in node_runs["page16", "shared"]["log"]
    # The comparison can fail: SWA-layer KV written one slot off gives other tokens.
    assert node_runs["page16", "shared", "write_row_off"]["outputs"] != node_runs["page16", "sglang"]["outputs"]


# The faulty pair's requests: the first two prompts (72 and 150 tokens, past the window)
# show the fault as all five do, in less time.
FAULTY_PROMPTS = 2


# The pair's pools: every request at once.
PAIR_TOKENS = 8192


@pytest.fixture(scope="module")
def shared_pair_run(request, tiny_model):
    """The pair with the decode node in the shared mode, then again with a KV fault planted
    in the decode node (its SWA-layer writes one slot off) on FAULTY_PROMPTS, beside one
    engine's reference (test_faults.py's at page 16, once a session)."""
    import test_faults

    prompts, new_tokens = fault_harness.PAIR_PROMPTS, fault_harness.PAIR_NEW_TOKENS
    workdir = os.path.join(os.path.dirname(tiny_model), "pd-pair-shared")
    os.makedirs(workdir, exist_ok=True)
    start = time.monotonic()
    read_reference = test_faults.references(tiny_model, 16, test_faults.load_waves(request.config))
    try:
        with pd_harness.Pair(tiny_model, workdir, "shared", 16, PAIR_TOKENS) as pair:
            before = pd_harness.allocator_calls(pair.decode_probe)  # the servers' warm-up requests
            outputs = pair.generate(prompts, new_tokens)
            calls = pd_harness.settled_allocator_calls(pair.decode_probe)
            logs = pair.logs()
        faulty_dir = os.path.join(workdir, "write_row_off")
        os.makedirs(faulty_dir, exist_ok=True)
        with pd_harness.Pair(tiny_model, faulty_dir, "shared", 16, PAIR_TOKENS,
                             decode_env={"SWA_EXT_TEST_KV_FAULT": "write_row_off"}) as pair:
            faulty = pair.generate(prompts[:FAULTY_PROMPTS], new_tokens)
    except BaseException:
        read_reference(stop=True)
        raise
    reference = read_reference()["pair"]
    print(f"shared pair: {time.monotonic() - start:.0f} s; decode allocator calls {calls} (before {before})")
    return {"reference": reference, "outputs": outputs, "faulty": faulty, "before": before, "calls": calls,
            "logs": logs, "prompts": len(prompts)}


def test_shared_decode_node_in_a_pair_gives_a_single_engines_outputs(shared_pair_run):
    run = shared_pair_run
    assert run["outputs"] == run["reference"]
    # The comparison can fail: a planted KV fault changes the outputs.
    assert run["faulty"] != run["reference"][:FAULTY_PROMPTS]
    assert SLOT_KINDS_CHECKED in run["logs"]["decode"]
    calls, before = run["calls"], run["before"]
    assert pd_harness.allocator_class(calls) == ("swa_ext", "SharedSWATokenToKVPoolAllocator"), calls["allocator"]
    check_shared_served(run["logs"]["decode"], 16)
    served = {call: n - before.get(call, 0) for call, n in calls.items() if isinstance(n, int)}
    assert served["alloc_extend_swa_tail"] == run["prompts"] and served.get("alloc_extend", 0) == 0, served
    assert pd_harness.out_of_window_frees(served) > 0, served
    assert calls["free_after_last_call"] == calls["pool_sizes"], calls  # the one budget whole again
