"""The shared mode's KV storage and sizing in SGLang (``SWA_EXT_SGLANG=shared``).

SGLang sizes a hybrid SWA model's KV as two pools: ``full`` tokens of the full layers and
``swa`` tokens of the SWA layers (``--swa-full-tokens-ratio`` of ``full``), from the
memory its profiling finds at ``--mem-fraction-static``. Where the model's full and SWA
layers are equal in number and in KV bytes per token, the same bytes hold ``full + swa``
slots of one layer pair: SWA layer i keeps its KV in full layer i's buffers, and a slot
holds a full token or an SWA token, never both (swa_ext's shared allocator hands each
slot to one kind). So the shared mode turns SGLang's two sizes into one slot count of
``full + swa`` for both sides, and ``SharedSWAKVPool`` (an ``SWAKVPool``, as SGLang's
isinstance checks need) gives its SWA layers views of its full layers' buffers.

Every configuration this cannot serve is refused at start-up with one line saying what
is served (``refusal``): swa_ext then serves nothing rather than half of it.
"""
from __future__ import annotations

import logging

from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.runtime_context import attention_backends, get_memory, get_parallel

logger = logging.getLogger(__name__)

# The attention backends whose SWA layers read KV at the slots the full-to-SWA mapping
# gives (SGLang 0.5.23's code). The others cannot serve one slot space: torch_native
# indexes every layer's buffer with the full slots of req_to_token, so an SWA layer would
# read its paired full layer's KV (in two pools it reads stale SWA rows, the same wrong
# rows with either allocator).
MAPPED_READ_BACKENDS = ("triton", "fa3", "fa4", "flashinfer", "trtllm_mha", "intel_amx")

SERVED = ("SWA_EXT_SGLANG=shared serves hybrid models whose full and SWA layers are equal in number and in KV bytes "
          "per token (gpt-oss, alternating Granite-SWA), with an unquantized MHA KV cache on cpu or cuda, "
          f"attention backend {', '.join(MAPPED_READ_BACKENDS)}, no draft model (NGRAM speculation is served) and "
          "swa_ext's own allocator")


class SharedModeRefused(ValueError):
    """A configuration the shared mode cannot serve: one line, raised at start-up."""

    def __init__(self, reason):
        super().__init__(f"swa_ext: {SERVED}; not this one: {reason}. SWA_EXT_SGLANG=1 serves it with two pools")


def _layer_mix_reason(configurator):
    """Why this model's layers cannot share storage pairwise, or None."""
    layers = configurator.layer_info
    full, swa = len(layers.full_attention_layer_ids), len(layers.swa_attention_layer_ids)
    if full != swa:
        return f"{swa} SWA layers to {full} full layers"
    if configurator.use_mla_backend or configurator.is_hybrid_swa_compress:
        return "its SWA layers store KV in another layout than its full layers (MLA or compressed SWA)"
    model, tp = configurator.model_config, get_parallel().attn_tp_size
    full_row = (model.get_num_kv_heads(tp), model.head_dim, model.v_head_dim)
    swa_row = (model.get_swa_num_kv_heads(tp), model.swa_head_dim, model.swa_v_head_dim)
    if full_row != swa_row:
        return f"KV heads and head dims (K, V) {swa_row} on the SWA layers, {full_row} on the full layers"
    return None


def _layer_kind_reason(configurator):
    """Why the model's attention layers and SGLang's KV pool disagree on which layers are
    sliding-window ones, or None. SGLang splits the pool by the architecture's layer list
    (``get_hybrid_layer_ids``) while each attention layer reads through the full-to-SWA
    mapping only if it has a window: a layer the pool keeps as an SWA layer but whose
    attention has none reads its buffer at full slots, which in one slot space are its
    paired full layer's KV (with two pools, stale SWA rows: the same wrong rows with either
    allocator)."""
    swa_layers = set(configurator.layer_info.swa_attention_layer_ids)
    misread = sorted(layer.layer_id for layer in configurator.model.modules() if isinstance(layer, RadixAttention)
                     and (layer.layer_id in swa_layers) != (layer.sliding_window_size > -1))
    if misread:
        return (f"layers {misread} are kept as SWA layers by SGLang's KV pool but attend without a window, or the "
                f"reverse (check the model config's model_type and layer_types)")
    return None


def _attention_backend_reason():
    """Why the attention backends SGLang resolved cannot read one slot space, or None."""
    unserved = sorted({backend for backend in attention_backends() if backend not in MAPPED_READ_BACKENDS})
    if unserved:
        return (f"attention backend {', '.join(unserved)} (it reads SWA layers' KV at full slots; "
                f"--attention-backend triton serves on the CPU)")
    return None


def refusal(configurator):
    """Why the shared mode cannot serve what this configurator builds, or None."""
    if configurator.spec_algorithm.is_speculative() and not configurator.spec_algorithm.is_ngram():
        return "a draft model's KV (speculative decoding other than NGRAM)"
    reason = _attention_backend_reason() or _layer_kind_reason(configurator)
    if reason is not None:
        return reason
    if configurator.post_capture_kv_active:
        return "post-capture KV backing"
    return _layer_mix_reason(configurator)


def shared_sizes(configurator, config):
    """SGLang's resolved pool config with both sides at ``full + swa`` slots (the same KV
    bytes), or the config as it is where the shared mode has nothing to size."""
    if not configurator.is_hybrid_swa or configurator.is_draft_worker or get_memory().enable_unified_memory:
        return config
    reason = refusal(configurator)
    if reason is not None:
        raise SharedModeRefused(reason)
    full, swa = config.full_max_total_num_tokens, config.swa_max_total_num_tokens
    slots = full + swa
    logger.info("swa_ext: shared mode: one budget of %d slots for full and SWA KV, in the bytes SGLang sized for "
                "%d full and %d SWA tokens", slots, full, swa)
    config.max_total_num_tokens = config.full_max_total_num_tokens = config.swa_max_total_num_tokens = slots
    return config


class _BorrowedStorageMHAPool(MHATokenToKVPool):
    """An MHA KV pool whose layer buffers are another pool's (layer i's are its layer i's):
    SGLang's pool in every other respect."""

    def __init__(self, *, storage: MHATokenToKVPool, **kwargs):
        self._storage = storage
        super().__init__(**kwargs)

    def _create_buffers_normal(self):
        self.k_buffer = list(self._storage.k_buffer)
        self.v_buffer = list(self._storage.v_buffer)


class SharedSWAKVPool(SWAKVPool):
    """SGLang's ``SWAKVPool`` with one slot index space: its SWA layers' KV lives in its
    full layers' buffers (SWA layer i in full layer i's), so each slot holds a full token
    of every full layer or an SWA token of every SWA layer. Same arguments as SGLang's."""

    def __init__(self, *args, **kwargs):
        kwargs["swa_kv_pool_class"] = self._swa_layers_view
        super().__init__(*args, **kwargs)

    def _swa_layers_view(self, *, size, layer_num, **kwargs):
        full = self.full_kv_pool
        if type(full) is not MHATokenToKVPool or full.is_quantized_kv_cache or full.post_capture_active:
            raise SharedModeRefused(f"a {type(full).__name__} KV pool (quantized or post-capture backed)")
        if size != full.size or layer_num != full.layer_num:
            raise SharedModeRefused(f"{layer_num} SWA layers of {size} slots beside {full.layer_num} full layers "
                                    f"of {full.size}")
        view = _BorrowedStorageMHAPool(storage=full, size=size, layer_num=layer_num, **kwargs)
        if [b.shape for b in view.k_buffer + view.v_buffer] != [b.shape for b in full.k_buffer + full.v_buffer] or \
                (view.head_num, view.head_dim, view.v_head_dim) != (full.head_num, full.head_dim, full.v_head_dim):
            raise SharedModeRefused("SWA layers whose KV rows differ from the full layers'")
        return view

    def get_kv_size_bytes(self):
        """The bytes of the one storage (the full pool's; the SWA layers hold none of their own)."""
        size = self.full_kv_pool.get_kv_size_bytes()
        return size if isinstance(size, tuple) else (size, 0)
