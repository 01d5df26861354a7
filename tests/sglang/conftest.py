"""Tests of swa_ext inside SGLang 0.5.23. They need sglang importable (scripts/setup-sglang.sh
installs it into .venv-cuda; scripts/run-tests.sh then runs them there) and skip, saying
so, without it. The test-only stub of vllm._custom_ops (tests/sglang/stubs) gives
SGLang's CPU path the one vLLM function it imports."""
import json
import os
import sys

import pytest

STUBS = os.path.join(os.path.dirname(__file__), "stubs")
sys.path.insert(0, STUBS)
os.environ.setdefault("TRITON_INTERPRET", "1")  # SGLang's triton kernels, interpreted on the CPU

try:
    import sglang.srt.mem_cache.allocator.swa  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the venv
    pytest.skip(f"sglang is not importable ({e}): run scripts/setup-sglang.sh, then scripts/run-tests.sh",
                allow_module_level=True)

# The tiny hybrid model: Granite's SWA variant, alternating sliding and full layers.
MODEL_CONFIG = {
    "architectures": ["GraniteSWAForCausalLM"], "model_type": "granite_swa", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "max_position_embeddings": 4096, "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": True,
}


# The tiny model of the engine, PD and speculative tests has two pairs of layers: with one,
# a fault that hands an SWA layer another layer's buffer has no other SWA layer to collide
# with (the shared mode's SWA layer i lives in full layer i's buffers).
TINY_PAIRS = 2


def model_config(pairs=TINY_PAIRS):
    """The tiny model with ``pairs`` (sliding, full) pairs of layers (gpt-oss-20b has 12)."""
    return dict(MODEL_CONFIG, num_hidden_layers=2 * pairs, layer_types=["sliding_attention", "full_attention"] * pairs)


def write_checkpoint(path, pairs=TINY_PAIRS):
    """Random weights large enough that the next token depends on the whole context
    (SGLang's dummy weights, near zero, give outputs that ignore the KV cache)."""
    import torch
    from safetensors.torch import save_file

    c = model_config(pairs)
    h, heads, kv_heads = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim, inter = h // heads, c["intermediate_size"]
    gen = torch.Generator().manual_seed(1234)

    def rand(*shape, std=0.3):
        return torch.randn(*shape, generator=gen) * std

    weights = {"model.embed_tokens.weight": rand(c["vocab_size"], h, std=1.0), "model.norm.weight": torch.ones(h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, h), p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, h),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, h), p + "self_attn.o_proj.weight": rand(h, heads * head_dim),
            p + "self_attn.sinks": torch.zeros(heads),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        })
    os.makedirs(path, exist_ok=True)
    save_file(weights, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("granite_swa_tiny"))
    write_checkpoint(path)
    return path


@pytest.fixture(scope="session")
def twelve_pair_model(tmp_path_factory):
    """The tiny model with gpt-oss-20b's 12 pairs of layers."""
    path = str(tmp_path_factory.mktemp("granite_swa_12_pairs"))
    write_checkpoint(path, 12)
    return path


class RecordingSWAKVCache:
    """Stands for SGLang's SWAKVPool in allocator tests: the mapping registration and
    translation, the two sub-pools, a record of the CPU-copy calls it is handed, and the
    parent pages the shared mode's pool lays out (``parent_k`` pages of ``small_side`` or
    one of the other side: shared_pool.SharedSWAKVPool's)."""

    def __new__(cls, swa_req_ring_size=None, parent_k=1, small_side="full"):
        from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool

        class Recording(BaseSWAKVPool):
            full_kv_pool, swa_kv_pool = "the full KV pool", "the SWA KV pool"

            def register_mapping(self, mapping):
                self.full_to_swa_index_mapping = mapping
                self.registered.append(mapping)

            def translate_loc_from_full_to_swa(self, kv_indices):
                return self.full_to_swa_index_mapping[kv_indices]

            def get_state_buf_infos(self):
                return [], [], []

            def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
                self.calls.append(("get_cpu_copy", indices.tolist()))
                return "cpu copy"

            def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None):
                self.calls.append(("load_cpu_copy", kv_cache_cpu, indices.tolist()))

        Recording.__abstractmethods__ = frozenset()  # the KV buffers are not needed here
        cache = object.__new__(Recording)
        cache.registered, cache.calls, cache.swa_req_ring_size = [], [], swa_req_ring_size
        cache.parent_k, cache.small_side = parent_k, small_side
        return cache


def t(values):
    import torch

    return torch.tensor(values, dtype=torch.int64)
