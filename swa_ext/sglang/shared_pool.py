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

A draft model (EAGLE, EAGLE3, STANDALONE) shares the target's allocator and keeps its KV
in a pool of its own indexed by the target's full slots, sized by SGLang at the target's
token count and priced per full token. In one slot space a full token may sit at any
slot, so the draft's KV covers every slot, and the slot count is solved so that target
and draft together fit the bytes SGLang sized (``one_budget_slots``).

Every configuration this cannot serve is refused at start-up with one line saying what
is served (``refusal``): swa_ext then serves nothing rather than half of it.
"""
from __future__ import annotations

import logging

from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.runtime_context import attention_backends, get_memory, get_parallel, get_spec

logger = logging.getLogger(__name__)

# The attention backends whose SWA layers read KV at the slots the full-to-SWA mapping
# gives (SGLang 0.5.23's code). The others cannot serve one slot space: torch_native
# indexes every layer's buffer with the full slots of req_to_token, so an SWA layer would
# read its paired full layer's KV (in two pools it reads stale SWA rows, the same wrong
# rows with either allocator).
MAPPED_READ_BACKENDS = ("triton", "fa3", "fa4", "flashinfer", "trtllm_mha", "intel_amx")

SERVED = ("SWA_EXT_SGLANG=shared serves hybrid models whose full and SWA layers are equal in number and in KV bytes "
          "per token (gpt-oss, alternating Granite-SWA), with an unquantized MHA KV cache on cpu or cuda, "
          f"attention backend {', '.join(MAPPED_READ_BACKENDS)}, speculative decoding NGRAM or a draft model without "
          "sliding-window layers drafting one chain (EAGLE, EAGLE3, STANDALONE at --speculative-eagle-topk 1) and "
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


def _has_draft_model(algorithm):
    """Whether the speculative algorithm runs a draft model whose KV SGLang prices per full
    token and builds in a pool of its own (FROZEN_KV_MTP, which SGLang counts as EAGLE,
    sizes its draft pool its own way)."""
    return (algorithm.is_eagle() and not algorithm.is_frozen_kv_mtp()) or algorithm.is_standalone()


def _draft_reason(configurator):
    """Why the shared mode cannot serve this configuration's speculative decoding, or None."""
    algorithm = configurator.spec_algorithm
    if not algorithm.is_speculative() or algorithm.is_ngram():
        return None
    if not _has_draft_model(algorithm):
        return f"speculative decoding {algorithm.name} (its draft KV is sized apart from the target's tokens)"
    aux = configurator.spec_aux_config
    if aux.eagle_draft_swa_num_layers is not None:
        # Its own SWA pool and mapping: SGLang registers the allocator's mapping on the
        # target's pool alone, and in one slot space a draft SWA layer's KV would share
        # its full layer's rows.
        return "a draft model with sliding-window layers (SGLang builds its KV hybrid)"
    if not aux.eagle_draft_num_layers:
        return "a draft model whose KV SGLang prices at no layers"
    topk = get_spec().speculative_eagle_topk
    if topk is not None and topk > 1:
        # Tree verify moves accepted tokens' KV inside the target's pool; no engine here
        # runs tree-mask attention, so one slot space is untried there (SGLang's unified
        # memory refuses it too).
        return f"tree drafts (--speculative-eagle-topk {topk}; --speculative-eagle-topk 1 serves)"
    return None


def refusal(configurator):
    """Why the shared mode cannot serve what this configurator builds, or None."""
    reason = _draft_reason(configurator) or _attention_backend_reason() or _layer_kind_reason(configurator)
    if reason is not None:
        return reason
    if configurator.post_capture_kv_active:
        return "post-capture KV backing"
    return _layer_mix_reason(configurator)


def one_budget_slots(full, swa, *, layer_pairs, draft_layers, page_size):
    """The slots of one budget, page-aligned down, in the KV bytes SGLang sized: ``full``
    tokens of the full layers and ``swa`` of the SWA layers (``layer_pairs`` of each, one KV
    row a token each), and ``draft_layers`` of a draft model at ``full`` tokens, each priced
    at the target's row (SGLang's pool_configurator: "the draft shares the target's
    per-layer KV size"). Every slot holds a layer pair's row and, since the draft's pool is
    indexed by full slots and a full token may take any slot, the draft's rows too: without
    a draft, ``full + swa``."""
    rows = full * (layer_pairs + draft_layers) + swa * layer_pairs
    return rows // (layer_pairs + draft_layers) // page_size * page_size


def shared_sizes(configurator, config):
    """SGLang's resolved pool config with both sides, and a draft model's pool, at the one
    budget's slots (``one_budget_slots``: the same KV bytes), or the config as it is where
    the shared mode has nothing to size. A draft worker never resolves a config of its own:
    SGLang hands it its target's (``KVCacheConfigurator.configure``), so its pool is built
    at these slots."""
    if not configurator.is_hybrid_swa or get_memory().enable_unified_memory:
        return config
    reason = refusal(configurator)
    if reason is not None:
        raise SharedModeRefused(reason)
    full, swa = config.full_max_total_num_tokens, config.swa_max_total_num_tokens
    pairs = len(configurator.layer_info.full_attention_layer_ids)
    draft = configurator.spec_aux_config.eagle_draft_num_layers if _has_draft_model(configurator.spec_algorithm) else 0
    slots = one_budget_slots(full, swa, layer_pairs=pairs, draft_layers=draft, page_size=configurator.page_size)
    draft_share = (f" and a draft model's KV at the {full} full tokens; the draft's KV covers every slot: {draft} of "
                   f"{pairs + draft} KV rows a slot, {100 * draft / (pairs + draft):.1f}% of the budget") if draft else ""
    logger.info("swa_ext: shared mode: one budget of %d slots for full and SWA KV, in the bytes SGLang sized for %d full "
                "and %d SWA tokens%s", slots, full, swa, draft_share)
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
