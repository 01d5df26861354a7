"""A real prefill/decode deployment of SGLang on the CPU, the decode node on swa_ext: two
``python -m sglang.launch_server`` nodes on 127.0.0.1 (prefill, and decode with
SWA_EXT_SGLANG=lockstep) passing the KV over Mooncake's TCP transport, SGLang's router
in front: test_faults.py's deployment in the default mode at page 16, which serves these
requests first, before its faults (fault_harness.PAIR_PROMPTS, in groups the decode pool
holds through their decoding).

The greedy outputs must be those of one non-disaggregated engine given the same
prompts: every prompt token's KV crossed the wire intact, into the pages swa_ext
preallocated. Lockstep checks every allocator call of the decode node against SGLang's
allocator (a difference stops the node). The probe plugin (tests/sglang/pd_probe)
measures the bytes the prefill node handed to the transfer engine: for the SWA layers,
only each prompt's window tail.
"""
import pytest

import fault_harness
import pd_harness
import swa_ext
from swa_ext import simulator
from swa_ext.models import ModelConfig
from swa_ext.traces import Request

from conftest import model_config

try:
    import mooncake.engine  # noqa: F401
    import sglang_router  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the venv
    pytest.skip(f"the pair needs Mooncake's transfer engine and SGLang's router ({e}): run scripts/setup-sglang.sh",
                allow_module_level=True)

import test_faults  # noqa: E402 (after the skip: it needs the same packages)

PAGE_SIZE = 16
PROMPT_LENS, PROMPTS, NEW_TOKENS = (fault_harness.PAIR_PROMPT_LENS, fault_harness.PAIR_PROMPTS,
                                    fault_harness.PAIR_NEW_TOKENS)


@pytest.fixture(scope="module")
def pair_run(request, tiny_model):
    """The pair's part of the deployment's run, with its reference and the nodes' logs."""
    run = test_faults.deployment_run(request.session, tiny_model, "default", PAGE_SIZE)
    return dict(run["pair"], reference=run["reference"]["pair"], logs=run["logs"], stopped_logs=run["stopped_logs"])


def test_pair_gives_a_single_engines_outputs(pair_run):
    assert [len(o) for o in pair_run["outputs"]] == [NEW_TOKENS] * len(PROMPTS)
    assert pair_run["outputs"] == pair_run["reference"]


def test_pair_decode_node_served_by_swa_ext_in_lockstep(pair_run):
    calls, before, lockstep = pair_run["calls"], pair_run["before"], pair_run["lockstep"]
    assert pd_harness.allocator_class(calls) == ("swa_ext", "LockstepSWATokenToKVPoolAllocator"), calls["allocator"]
    assert not any("LockstepDivergence" in log for log in pair_run["logs"].values())
    served = {call: n - before.get(call, 0) for call, n in calls.items() if isinstance(n, int)}
    assert served["alloc_extend_swa_tail"] == len(PROMPTS), served  # SGLang's decode path: one tail each
    assert served.get("alloc_extend", 0) == 0, served
    assert pd_harness.out_of_window_frees(served) > 0, served  # out-of-window SWA freed while decoding
    assert served["free_segment"] == len(PROMPTS), served  # each request released
    for call in ("alloc_extend_swa_tail", "alloc_decode", "free_swa_segment", "free_segment"):
        if call in calls:
            assert lockstep[call] == calls[call], call  # each one mirrored on SGLang's allocator
    # each batched eviction of swa_ext's hook checked against SGLang's own per-request frees
    assert lockstep.get("maybe_evict_swa", 0) >= calls.get("evict_out_of_window", 0) > 0, (calls, lockstep)
    assert calls["free_after_last_call"] == calls["pool_sizes"]  # both pools whole again


def tiny_model_shape():
    """The tiny model as the simulator sees it (bf16 KV, as the nodes hold it)."""
    config = model_config()
    layers = config["layer_types"]
    return ModelConfig(name="granite-swa-tiny", window=config["sliding_window"],
                       swa_layers=layers.count("sliding_attention"), full_layers=layers.count("full_attention"),
                       kv_heads=config["num_key_value_heads"],
                       head_dim=config["hidden_size"] // config["num_attention_heads"],
                       context_len=config["max_position_embeddings"])


def test_pair_sends_only_the_window_tail_of_the_swa_layers(pair_run):
    """The bytes the prefill node handed to Mooncake: the whole prompt for the full
    layers, each prompt's window tail for the SWA layers; and the simulator's
    transfer_gib for the same requests, up to the transfer's whole pages."""
    sent, model = pair_run["sent"], tiny_model_shape()
    assert sent.get("other", 0) == 0, sent
    window = model.window
    tails = [swa_ext._C.swa_tail_len(n, window, PAGE_SIZE) for n in PROMPT_LENS]
    assert all(t < n for t, n in zip(tails[1:], PROMPT_LENS[1:]))  # all but the shortest save SWA KV
    # Pages of KV sent per layer buffer (K and V of each layer).
    full_pages = sent["full"] // (sent["full_item_bytes"] * sent["full_buffers"])
    swa_pages = sent["swa"] // (sent["swa_item_bytes"] * sent["swa_buffers"])
    assert full_pages == sum(-(-n // PAGE_SIZE) for n in PROMPT_LENS), sent
    assert swa_pages == sum(-(-t // PAGE_SIZE) for t in tails), sent
    # Whole-prompt preallocation sends the SWA layers what the full layers got, page for page.
    whole_prompt_swa = full_pages * sent["swa_item_bytes"] * sent["swa_buffers"]
    token_bytes = sent["swa_item_bytes"] // PAGE_SIZE
    assert token_bytes * model.swa_layers * 2 == model.swa_bytes_per_token  # the simulator's bytes per token

    requests = [Request(rid=i, arrival_s=0.0, prompt_len=n, output_len=NEW_TOKENS) for i, n in enumerate(PROMPT_LENS)]
    scenario = simulator.plan_scenario(requests, model, page_size=PAGE_SIZE, kv_memory_gib=0.01)
    simulated = {policy: simulator.simulate(scenario, policy, 1.0).transfer_gib * simulator.GIB
                 for policy in ("evict", "tail")}
    measured = {"tail": sent["full"] + sent["swa"], "evict": sent["full"] + whole_prompt_swa}
    print(f"SWA-layer KV sent: {sent['swa']} bytes (window tails) vs {whole_prompt_swa} bytes for the whole prompts "
          f"({1 - sent['swa'] / whole_prompt_swa:.1%} saved); all KV: {measured['tail']} vs {measured['evict']} bytes "
          f"({1 - measured['tail'] / measured['evict']:.1%} saved); simulator transfer: tail {simulated['tail']:.0f}, "
          f"whole prompt {simulated['evict']:.0f} bytes ({1 - simulated['tail'] / simulated['evict']:.1%} saved)")
    # The simulator counts tokens, the transfer whole pages: at most one page more per request and pool.
    slack = len(PROMPT_LENS) * PAGE_SIZE * (model.full_bytes_per_token + model.swa_bytes_per_token)
    for policy in ("evict", "tail"):
        assert 0 <= measured[policy] - simulated[policy] < slack, (policy, measured, simulated)


def test_pair_stops_without_a_crash_line(pair_run):
    """Stopped, the nodes end their schedulers themselves: no watchdog line calls the
    scheduler's exit a crash (as when the whole group gets SIGTERM at once)."""
    for name, log in pair_run["stopped_logs"].items():
        assert "crashed with exit code" not in log, f"{name}: {log[-3000:]}"
