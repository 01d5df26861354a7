"""SGLang's offline Engine with speculative decoding on the CPU, swa_ext serving in lockstep
with SGLang's own allocator (SWA_EXT_SGLANG=lockstep: every allocator call repeated on SGLang's,
the first difference stops the scheduler): NGRAM (one chain of draft tokens) and STANDALONE (a
tiny random-weight Llama draft that disagrees with the target, so its drafts are rejected),
page sizes 1 and 16, window eviction every step and at SGLang's default interval, a pool small
enough that requests wait; SGLang's strict memory and KV-page checks on. Where SGLang's
allocator also runs alone, the outputs, cached tokens and verify counts are its own.

Speculative decoding needs four things SGLang lacks on a plain ``cpu`` device, given by the
test-only plugin tests/sglang/spec_bridges (its docstrings say what each answers and why the
allocator sees the same calls); test_each_bridge_is_needed_and_answers_as_sglangs_kernel shows
what SGLang does without each, and that each gives the kernel's answer. Each engine run is its
own process (tests/sglang/spec_engine_run.py).
"""
import functools
import json
import os
import subprocess
import sys
import types

import pytest

from conftest import MODEL_CONFIG, STUBS
from pd_harness import KV_CHECK, allocator_variables, two_at_a_time
from test_engine import queued, run_script

HERE = os.path.dirname(os.path.abspath(__file__))
BRIDGES_DIR = os.path.join(HERE, "spec_bridges")
sys.path.insert(0, BRIDGES_DIR)
import swa_ext_spec_bridges  # noqa: E402

BRIDGES = tuple(swa_ext_spec_bridges.BRIDGES)
# Fewer tokens than the four requests need at once (prompts of 70 to 106 tokens, 36 new
# tokens and each decode step's reserve): requests queue.
TIGHT_POOL = 320
DEFAULT_INTERVAL = None  # SGLang's own SGLANG_SWA_EVICTION_INTERVAL


def write_draft_checkpoint(path):
    """A one-layer Llama with the target's vocabulary and random weights of another seed:
    its drafts mostly disagree with the target's choices."""
    import torch
    from safetensors.torch import save_file

    h, inter, vocab = 64, 128, MODEL_CONFIG["vocab_size"]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": h,
              "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1, "max_position_embeddings": 4096, "rope_theta": 10000.0,
              "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
              "tie_word_embeddings": True, "rms_norm_eps": 1e-6}
    gen = torch.Generator().manual_seed(4321)

    def rand(*shape, std=0.3):
        return torch.randn(*shape, generator=gen) * std

    p = "model.layers.0."
    weights = {"model.embed_tokens.weight": rand(vocab, h, std=1.0), "model.norm.weight": torch.ones(h),
               p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
               p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(h // 2, h),
               p + "self_attn.v_proj.weight": rand(h // 2, h), p + "self_attn.o_proj.weight": rand(h, h),
               p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
               p + "mlp.down_proj.weight": rand(h, inter)}
    os.makedirs(path, exist_ok=True)
    save_file(weights, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


# gpt-oss shrunk: its class, attention sinks, alternating 128-token sliding and full layers, two
# experts with one active; four layers, so that EAGLE3 reads three of them. SGLang's random
# weights (load_format "dummy"): near zero, the target repeats one token and the drafts agree.
GPT_OSS_CONFIG = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 32, "num_local_experts": 2, "num_experts_per_tok": 1, "experts_per_token": 1, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 2, "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "swiglu_limit": 7.0, "hidden_act": "silu",
    "attention_bias": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "initial_context_length": 4096,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
EAGLE3_DRAFT_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "vocab_size": 512, "draft_vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 4096, "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True},
}


@pytest.fixture(scope="session")
def gpt_oss_models(tmp_path_factory):
    """(target, EAGLE3 draft) directories holding their configs only."""
    dirs = []
    for name, config in (("gpt_oss_tiny", GPT_OSS_CONFIG), ("gpt_oss_eagle3_tiny", EAGLE3_DRAFT_CONFIG)):
        path = tmp_path_factory.mktemp(name)
        (path / "config.json").write_text(json.dumps(config))
        dirs.append(str(path))
    return tuple(dirs)


@pytest.fixture(scope="session")
def draft_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama_draft_tiny"))
    write_draft_checkpoint(path)
    return path


def engine_env(mode, interval, report, fault=None, dummy_weights=None):
    env = dict(os.environ, SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY="1",
               SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE="1", SGLANG_CHECK_KV_PAGE_INVARIANTS="1",
               TRITON_INTERPRET="1", SWA_EXT_LOCKSTEP_REPORT=report,
               SWA_EXT_SPEC_BRIDGES=",".join(BRIDGES),
               PYTHONPATH=os.pathsep.join([STUBS, BRIDGES_DIR, KV_CHECK] + [
                   p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    for name in ("SWA_EXT_SGLANG", "SWA_EXT_SHARED", "SGLANG_SWA_EVICTION_INTERVAL", "SWA_EXT_DEBUG",
                 "SWA_EXT_TEST_KV_FAULT", "SWA_EXT_TEST_DUMMY_WEIGHTS"):
        env.pop(name, None)
    env.update(allocator_variables(mode))
    if mode == "shared":
        env["SWA_EXT_DEBUG"] = "1"  # each step checks that no slot holds two kinds of KV
    if fault:
        env["SWA_EXT_TEST_KV_FAULT"] = fault
    if dummy_weights is not None:
        env["SWA_EXT_TEST_DUMMY_WEIGHTS"] = str(dummy_weights)
    if interval is not None:
        env["SGLANG_SWA_EVICTION_INTERVAL"] = str(interval)
    return env


def run_spec_engine(model, draft, algorithm, draft_tokens, page_size, interval, mode, load_format="auto", fault=None,
                    dummy_weights=None):
    """One engine run with every bridge: its results (None if it failed), log, lockstep counts, wall time.
    Run once a session for each set of arguments, however a caller spells them (test_faults.py
    and test_shared_engine.py reuse this module's runs). ``fault`` plants a KV fault;
    ``dummy_weights`` widens SGLang's dummy weights to that range (tests/sglang/kv_check)."""
    return _run_spec_engine(model, draft, algorithm, draft_tokens, page_size, interval, mode, load_format, fault,
                            dummy_weights)


@functools.lru_cache(maxsize=None)
def _run_spec_engine(model, draft, algorithm, draft_tokens, page_size, interval, mode, load_format, fault,
                     dummy_weights):
    tag = f"{algorithm}-{draft_tokens}-{page_size}-{interval}-{mode}" + (f"-{fault}" if fault else "") + \
        (f"-weights{dummy_weights}" if dummy_weights is not None else "")
    out_dir = os.path.join(os.path.dirname(model), f"spec-run-{tag}")
    os.makedirs(out_dir, exist_ok=True)
    result, report = os.path.join(out_dir, "result.json"), os.path.join(out_dir, "lockstep.json")
    proc, log, counts, wall = run_script([os.path.join(HERE, "spec_engine_run.py"), model, draft or "-", result,
                                          algorithm, str(draft_tokens), str(page_size), str(TIGHT_POOL), load_format],
                                         engine_env(mode, interval, report, fault, dummy_weights), out_dir, report)
    rows = None
    if proc.returncode == 0 and os.path.exists(result):
        with open(result) as f:
            rows = json.load(f)["rows"]
    print(f"spec engine run {tag}: {wall:.0f} s, rc {proc.returncode}, lockstep calls {sum(counts.values())}")
    return types.SimpleNamespace(rows=rows, log=log, counts=counts, wall=wall)


# (model, algorithm, draft tokens, page size, eviction interval, also run SGLang's allocator
# alone). A STANDALONE draft of one step: its drafts are rejected anyway, and each step is a
# draft forward.
CONFIGS = [("granite", "NGRAM", 4, 16, 1, True), ("granite", "NGRAM", 8, 1, DEFAULT_INTERVAL, False),
           ("granite", "STANDALONE", 2, 1, 1, False), ("granite", "STANDALONE", 2, 16, DEFAULT_INTERVAL, False)]
# With --slow: EAGLE3 on the tiny gpt-oss in lockstep at SGLang's dummy weights, where the
# drafts agree and verifies commit runs of tokens. In CI, test_shared_engine.py runs EAGLE3
# on it in lockstep at widened weights (the drafts rejected) as the shared mode's reference,
# and tests/golden/spec_* replay SGLang's own EAGLE allocation, accepted drafts included.
SLOW_CONFIGS = [("gpt-oss", "EAGLE3", 3, 16, 1, False)]


def run_arguments(model, algorithm, draft_tokens, page_size, interval, tiny_model, draft_model, gpt_oss_models):
    """run_spec_engine's arguments for one of CONFIGS, but its mode."""
    if model == "gpt-oss":
        (target, draft), load_format = gpt_oss_models, "dummy"
    else:
        target, draft, load_format = tiny_model, draft_model if algorithm == "STANDALONE" else None, "auto"
    return target, draft, algorithm, draft_tokens, page_size, interval, load_format


@pytest.fixture(scope="module", autouse=True)
def engines_of_the_selected_tests(request, tiny_model, draft_model, gpt_oss_models):
    """The engine runs the selected tests of this module read, started two at a time."""
    runs = []
    for item in request.session.items:
        if item.module is request.module and item.originalname == "test_speculative_engine_in_lockstep_is_sglangs" \
                and not item.get_closest_marker("skip"):  # --slow's, unasked
            config = (item.callspec.params[name] for name in ("model", "algorithm", "draft_tokens", "page_size",
                                                               "interval"))
            *arguments, load_format = run_arguments(*config, tiny_model, draft_model, gpt_oss_models)
            modes = ("lockstep", "sglang") if item.callspec.params["alone"] else ("lockstep",)
            runs += [(*arguments, mode, load_format) for mode in modes]
    two_at_a_time(run_spec_engine, runs)


@pytest.mark.parametrize("model,algorithm,draft_tokens,page_size,interval,alone",
                         CONFIGS + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_CONFIGS],
                         ids=[f"{m}-{a}-{d}-page{p}-interval{i or 'default'}" for m, a, d, p, i, _ in
                              CONFIGS + SLOW_CONFIGS])
def test_speculative_engine_in_lockstep_is_sglangs(tiny_model, draft_model, gpt_oss_models, model, algorithm,
                                                   draft_tokens, page_size, interval, alone):
    """Lockstep compares every allocator call with SGLang's allocator (a difference stops the
    scheduler); where SGLang's allocator also runs alone, the outputs are its outputs."""
    *arguments, load_format = run_arguments(model, algorithm, draft_tokens, page_size, interval, tiny_model,
                                            draft_model, gpt_oss_models)
    run = functools.partial(run_spec_engine, *arguments, load_format=load_format)
    lockstep = run("lockstep")
    assert lockstep.rows is not None, f"the lockstep run failed:\n{lockstep.log[-6000:]}"
    assert "LockstepDivergence" not in lockstep.log
    if alone:
        reference = run("sglang")
        assert reference.rows is not None, f"SGLang's own run failed:\n{reference.log[-6000:]}"
        assert lockstep.rows == reference.rows
    assert queued(lockstep.log)  # requests waited for memory
    verifies = [(r["spec_verify_ct"], len(r["output_ids"])) for r in lockstep.rows]
    if model == "gpt-oss":  # the drafts agree: verifies commit runs of several tokens
        assert all(v < n - 1 for v, n in verifies), verifies
    else:  # drafts were rejected: accepting every one takes cdiv(n - 1, draft_tokens) verifies
        assert any(v > -(-(n - 1) // draft_tokens) for v, n in verifies), verifies
    counts = lockstep.counts
    reserve_call = "alloc_extend" if page_size > 1 else "alloc"  # each decode step's reserve
    for call in (reserve_call, "free_group_begin", "free_group_end", "maybe_evict_swa", "free_segment"):
        assert counts.get(call, 0) > 0, (call, counts)


@functools.lru_cache(maxsize=None)
def bridges_checked(tmp_dir):
    """tests/sglang/spec_bridges_check.py's report: each bridged function without and with its bridge."""
    result = os.path.join(tmp_dir, "bridges.json")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [STUBS, BRIDGES_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "spec_bridges_check.py"), result], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(result) as f:
        return json.load(f)


# What SGLang does on a plain cpu without each bridge (swa_ext_spec_bridges' docstrings say more).
WITHOUT = {
    "tree_mask_op": "ModuleNotFoundError: No module named 'sgl_kernel'",  # importing the NGRAM worker
    "tree_build": "NameError: name 'sgl_build_tree_kernel_efficient' is not defined",
    "greedy_verify": None,  # returns with its outputs unwritten
    "extend_cache_locs": None,  # returns None
}


@pytest.mark.parametrize("bridge", BRIDGES)
def test_each_bridge_is_needed_and_answers_as_sglangs_kernel(bridge, tmp_path_factory):
    report = bridges_checked(str(tmp_path_factory.getbasetemp()))[bridge]
    assert report["with"] == report["want"]  # the bridged path gives the kernel's answer
    assert report["without"] != report["want"]
    if WITHOUT[bridge] is not None:
        assert report["without"] == WITHOUT[bridge]
    elif bridge == "greedy_verify":
        assert report["without"]["accepted_drafts"] == -7  # the count was never written
    else:
        assert report["without"] is None
