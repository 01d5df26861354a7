"""The shared mode's KV storage and sizing in SGLang (``SWA_EXT_SGLANG=shared``).

SGLang sizes a hybrid SWA model's KV as two pools: ``full`` tokens of the full layers and
``swa`` tokens of the SWA layers (``--swa-full-tokens-ratio`` of ``full``), from the
memory its profiling finds at ``--mem-fraction-static``. The shared mode puts the same
bytes in one storage of parent pages (SPEC.md 8.1): a token's KV entry is ``E_full`` bytes
on the full side (every full layer's K and V row) and ``E_swa`` on the SWA side; the side
with the smaller entry takes ``parent_k`` pages of a parent, the other one page, the larger
entry padded to ``parent_k`` smaller ones. Slots stay physical: large-side slot ``j``
shares its bytes with small-side slots ``j * k .. j * k + k - 1`` and with nothing else, and
swa_ext's allocator hands a parent to one side at a time, so no two tokens' KV ever share
bytes. ``k = 1`` (equal entries: gpt-oss, alternating Granite-SWA) is a slot of either
kind.

``SharedSWAKVPool`` (an ``SWAKVPool``, as SGLang's isinstance checks need) lays each layer's
K and V buffer out as a view of that one storage (``lay_out``): each of the small side's
rows is a plane of its own, so its layers' buffers stay contiguous as SGLang's are, and the
large side's rows are packed into the planes' runs of ``k`` rows (strided by ``k`` rows
where ``k > 1``); where they do not pack, one plane holds whole entries. ``one_budget_sizes``
turns SGLang's two sizes into each side's slots at the same bytes.

A draft model (EAGLE, EAGLE3, STANDALONE) shares the target's allocator and keeps its KV
in a pool of its own indexed by the target's full slots, sized by SGLang at the target's
token count and priced per full token. In one slot space a full token may sit at any
slot, so the draft's KV covers every full slot, and the slot count is solved so that
target and draft together fit the bytes SGLang sized.

Every configuration this cannot serve is refused at start-up with one line saying what
is served (``refusal``, and the pool's own checks): swa_ext then serves nothing rather
than half of it.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.runtime_context import attention_backends, get_disagg, get_memory, get_parallel, get_spec

from .. import _C
from ..one_budget import one_budget_slots

logger = logging.getLogger(__name__)

# The attention backends whose SWA layers read KV at the slots the full-to-SWA mapping
# gives (SGLang 0.5.23's code). The others cannot serve one slot space: torch_native
# indexes every layer's buffer with the full slots of req_to_token, so an SWA layer would
# read KV of the full side's tokens (in two pools it reads stale SWA rows, the same wrong
# rows with either allocator).
MAPPED_READ_BACKENDS = ("triton", "fa3", "fa4", "flashinfer", "trtllm_mha", "intel_amx")
# Of those, the ones served where layer buffers are strided views of the one storage (full
# and SWA KV entries of unequal bytes): SGLang 0.5.23's triton kernels take each buffer's
# strides, and the CPU tests run them; the others stay refused there until a device runs them.
STRIDED_READ_BACKENDS = ("triton",)

SERVED = ("SWA_EXT_SGLANG=shared serves hybrid models SGLang builds with full and sliding-window layers in an "
          "unquantized MHA KV cache, any mix of layers, KV heads and head dims (gpt-oss, Llama 4, MiMo-V2-Flash, ...), "
          f"on cpu or cuda, attention backend {', '.join(MAPPED_READ_BACKENDS)} ({', '.join(STRIDED_READ_BACKENDS)} "
          "where full and SWA KV entries differ), speculative decoding NGRAM or, where they are equal, a draft model "
          "without sliding-window layers drafting one chain (EAGLE, EAGLE3, STANDALONE at --speculative-eagle-topk 1) "
          "and swa_ext's own allocator")


class SharedModeRefused(ValueError):
    """A configuration the shared mode cannot serve: one line, raised at start-up."""

    def __init__(self, reason):
        super().__init__(f"swa_ext: {SERVED}; not this one: {reason}. SWA_EXT_SGLANG=1 serves it with two pools")


def _layer_mix_reason(configurator):
    """Why this model's layers cannot share one storage, or None."""
    layers = configurator.layer_info
    if not layers.full_attention_layer_ids or not layers.swa_attention_layer_ids:
        return (f"{len(layers.full_attention_layer_ids)} full and {len(layers.swa_attention_layer_ids)} SWA layers "
                f"(one budget pairs a full side with an SWA side)")
    if configurator.use_mla_backend:
        return "an MLA KV cache (its SWA layers store KV in another layout than MHA rows)"
    return None


def _layer_kind_reason(configurator):
    """Why the model's attention layers and SGLang's KV pool disagree on which layers are
    sliding-window ones, or None. SGLang splits the pool by the architecture's layer list
    (``get_hybrid_layer_ids``) while each attention layer reads through the full-to-SWA
    mapping only if it has a window: a layer the pool keeps as an SWA layer but whose
    attention has none reads its buffer at full slots, which in one slot space hold the
    full side's KV (with two pools, stale SWA rows: the same wrong rows with either
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
    full_entry, swa_entry, _ = kv_entries(configurator)
    if full_entry != swa_entry:
        # SGLang builds the draft's pool at the full side's slot count, and parent pages
        # number the small side's slots past it (parent 0's child pages are padding).
        return (f"a draft model beside full and SWA KV entries of {full_entry} and {swa_entry} bytes a token (its "
                f"pool, indexed by full slots, is sized apart from parent pages)")
    return None


def refusal(configurator):
    """Why the shared mode cannot serve what this configurator builds, or None."""
    reason = (_layer_mix_reason(configurator) or _draft_reason(configurator) or _attention_backend_reason()
              or _layer_kind_reason(configurator))
    if reason is not None:
        return reason
    if configurator.post_capture_kv_active:
        return "post-capture KV backing"
    return None


# --- sizing ------------------------------------------------------------------------------


def kv_entries(configurator):
    """Bytes a token takes on the full side (every full layer's K and V row), on the SWA
    side, and in a draft model's pool, as SGLang's profiling prices them
    (``pool_configurator.HybridSWAPoolConfigurator``: each draft layer at the full
    layers' row)."""
    model, tp = configurator.model_config, get_parallel().attn_tp_size
    item = torch.empty((), dtype=configurator.kv_cache_dtype).element_size()
    full_row = model.get_num_kv_heads(tp) * (model.head_dim + model.v_head_dim) * item
    swa_row = model.get_swa_num_kv_heads(tp) * (model.swa_head_dim + model.swa_v_head_dim) * item
    layers = configurator.layer_info
    draft = configurator.spec_aux_config.eagle_draft_num_layers if _has_draft_model(configurator.spec_algorithm) else 0
    return len(layers.full_attention_layer_ids) * full_row, len(layers.swa_attention_layer_ids) * swa_row, \
        (draft or 0) * full_row


def one_budget_sizes(full, swa, *, full_entry, swa_entry, draft_entry, page_size):
    """Each side's slots and ``parent_k`` in the KV bytes SGLang sized: ``full`` tokens of
    ``full_entry`` bytes (and a draft model's ``draft_entry`` at each), ``swa`` of
    ``swa_entry``, as parents (``one_budget.one_budget_slots``). Without a draft at
    ``k = 1``, ``full + swa`` slots a side. Returns (full slots, SWA slots, parent_k)."""
    return one_budget_slots(full * (full_entry + draft_entry) + swa * swa_entry, full_entry=full_entry,
                            swa_entry=swa_entry, page_size=page_size, draft_entry=draft_entry)


def shared_sizes(configurator, config):
    """SGLang's resolved pool config with each side, and a draft model's pool, at the one
    budget's slots (``one_budget_sizes``: the same KV bytes), or the config as it is where
    the shared mode has nothing to size. A draft worker never resolves a config of its own:
    SGLang hands it its target's (``KVCacheConfigurator.configure``), so its pool is built
    at these slots."""
    if not configurator.is_hybrid_swa or get_memory().enable_unified_memory:
        return config
    reason = refusal(configurator)
    if reason is not None:
        raise SharedModeRefused(reason)
    full, swa = config.full_max_total_num_tokens, config.swa_max_total_num_tokens
    full_entry, swa_entry, draft_entry = kv_entries(configurator)
    full_slots, swa_slots, k = one_budget_sizes(full, swa, full_entry=full_entry, swa_entry=swa_entry,
                                                draft_entry=draft_entry, page_size=configurator.page_size)
    pairs = len(configurator.layer_info.full_attention_layer_ids)
    draft = configurator.spec_aux_config.eagle_draft_num_layers if draft_entry else 0
    draft_share = (f" and a draft model's KV at the {full} full tokens; the draft's KV covers every slot: {draft} of "
                   f"{pairs + draft} KV rows a slot, {100 * draft / (pairs + draft):.1f}% of the budget") if draft else ""
    parents = (f"; parent pages of {k} {'full' if full_slots > swa_slots else 'SWA'} pages or one "
               f"{'SWA' if full_slots > swa_slots else 'full'} page (KV entries of {full_entry} and {swa_entry} bytes "
               f"a token): {full_slots} full or {swa_slots} SWA slots") if k > 1 else ""
    logger.info("swa_ext: shared mode: one budget of %d slots for full and SWA KV, in the bytes SGLang sized for %d full "
                "and %d SWA tokens%s%s", max(full_slots, swa_slots), full, swa, draft_share, parents)
    config.max_total_num_tokens = config.full_max_total_num_tokens = full_slots
    config.swa_max_total_num_tokens = swa_slots
    return config


# --- the one storage -----------------------------------------------------------------------


@dataclass(frozen=True)
class RowPlace:
    """Where one layer's K (or V) rows lie in the one storage: slot ``s``'s row at byte
    ``offset + s * stride``, ``width`` bytes."""

    offset: int
    stride: int
    width: int


def _first_fit(widths, rooms):
    """Each width's (bin, byte offset in it), widest first, into the first bin with room
    left that rows of its width tile (MiMo-V2-Flash's SWA K rows into the full K rows'
    planes, its V rows into the V rows'), else the first with room; None where one does
    not fit."""
    free, placed = list(rooms), [None] * len(widths)
    for i in sorted(range(len(widths)), key=lambda i: -widths[i]):
        fits = [b for b, left in enumerate(free) if left >= widths[i]]
        if not fits:
            return None
        room = next((b for b in fits if rooms[b] % widths[i] == 0), fits[0])
        placed[i] = (room, rooms[room] - free[room])
        free[room] -= widths[i]
    return placed


def lay_out(small_widths, large_widths, *, k, small_slots):
    """The one storage's layout: where each row of the small side (``small_widths``, bytes,
    one per layer's K and one per its V) and of the large side lies, and the storage's
    bytes. Each small row is a plane of ``small_slots`` rows of its own (its buffer
    contiguous, as SGLang's are), and large-side slot ``j`` takes rows ``j * k .. j * k + k
    - 1`` of every plane, the large rows packed into them; where they do not pack, one
    plane holds whole entries (small slot ``s`` at byte ``s * E_small``), which
    ``k * E_small >= E_large`` always fits. Returns (small places, large places, bytes)."""
    planes = [[i] for i in range(len(small_widths))]
    placed = _first_fit(large_widths, [k * small_widths[i] for i in range(len(small_widths))])
    if placed is None:
        planes = [list(range(len(small_widths)))]
        placed = _first_fit(large_widths, [k * sum(small_widths)])
    plane_widths = [sum(small_widths[i] for i in plane) for plane in planes]
    bases = [small_slots * sum(plane_widths[:p]) for p in range(len(planes))]
    small = [None] * len(small_widths)
    for p, plane in enumerate(planes):
        for i in plane:
            offset = bases[p] + sum(small_widths[j] for j in plane[:plane.index(i)])
            small[i] = RowPlace(offset, plane_widths[p], small_widths[i])
    large = [RowPlace(bases[p] + at, k * plane_widths[p], width) for (p, at), width in zip(placed, large_widths)]
    return small, large, small_slots * sum(plane_widths)


def _rows(pool):
    """One side's row widths in bytes: each layer's K row, then its V row."""
    item = pool.store_dtype.itemsize
    return [width for _ in range(pool.layer_num)
            for width in (pool.head_num * pool.head_dim * item, pool.head_num * pool.v_head_dim * item)]


def _views(storage, pool, places, slots):
    """The side's K and V buffers, (slots, heads, dim) views of the storage at ``places``."""
    elements = storage.view(pool.store_dtype)
    item = pool.store_dtype.itemsize
    views = [elements.as_strided((slots, pool.head_num, dim), (place.stride // item, dim, 1), place.offset // item)
             for place, dim in zip(places, [pool.head_dim, pool.v_head_dim] * pool.layer_num)]
    return views[0::2], views[1::2]


class _KVViewPool(MHATokenToKVPool):
    """SGLang's MHA pool of one side's layers, whose K and V buffers are views of the
    shared mode's one storage: ``SharedSWAKVPool`` lays it out once both sides' rows are
    known, and hands each side its views (``adopt``)."""

    def __init__(self, **kwargs):
        # SGLang's tiled KV copy takes a buffer's row stride as its copy width: views move
        # rows by indexing (SGLang's native move), at every stride.
        super().__init__(**dict(kwargs, enable_kv_cache_copy=False))
        self.use_native_move_kv_cache = True

    def _create_buffers_normal(self):
        self.k_buffer, self.v_buffer = [], []

    def _finalize_allocation_log(self, num_tokens):
        """Nothing: the bytes are the one storage's, which ``SharedSWAKVPool`` logs once."""

    def adopt(self, k_views, v_views):
        self.k_buffer, self.v_buffer = k_views, v_views
        self._kv_buffer_descs = self._build_kv_buffer_descs()
        self._init_data_ptrs_and_strides()


class SharedSWAKVPool(SWAKVPool):
    """SGLang's ``SWAKVPool`` over one storage of parent pages: every layer's K and V
    buffer is a view of it (``lay_out``), the side of ``size`` or ``size_swa`` slots with
    more slots holding ``k`` times the other's (``k`` the two sizes' ratio, set by
    ``shared_sizes``). Same arguments as SGLang's."""

    def __init__(self, *, size, size_swa, page_size, token_to_kv_pool_class=MHATokenToKVPool, **kwargs):
        if token_to_kv_pool_class is not MHATokenToKVPool:
            raise SharedModeRefused(f"a {token_to_kv_pool_class.__name__} KV pool (one storage holds plain MHA rows)")
        self.small_side = "full" if size >= size_swa else "swa"
        large, small = sorted((size, size_swa))
        self.parent_k = small // large
        if small % large or large % page_size:
            raise ValueError(f"swa_ext: one storage of parent pages needs one side's slots a multiple of the other's, "
                             f"in pages of {page_size}: got {size} full and {size_swa} SWA slots")
        # Parent 0 is padding (SGLang's page 0), so the small side's slots run to the end
        # of parent N: its pool covers them all, past the allocator's size.
        self._small_slots = (large // page_size + 1) * self.parent_k * page_size
        self._sides = {}
        super().__init__(size=size, size_swa=size_swa, page_size=page_size,
                         token_to_kv_pool_class=token_to_kv_pool_class, full_kv_pool_class=self._side_pool("full"),
                         swa_kv_pool_class=self._side_pool("swa"), **kwargs)

    def _side_pool(self, side):
        def build(*, size, page_size, **kwargs):
            if kwargs.get("post_capture_active") or kwargs.get("quant_method") is not None:
                raise SharedModeRefused("a quantized or post-capture backed KV pool")
            slots = self._small_slots if side == self.small_side else self._small_slots // self.parent_k
            pool = _KVViewPool(size=slots - page_size, page_size=page_size, **kwargs)
            if pool.kv_cache_layout != "nhd":
                raise SharedModeRefused(f"the {pool.kv_cache_layout} KV layout (one storage holds NHD rows)")
            self._sides[side] = pool
            if len(self._sides) == 2:
                self._lay_out_storage()
            return pool

        return build

    def _lay_out_storage(self):
        small = self._sides[self.small_side]
        large = self._sides["swa" if self.small_side == "full" else "full"]
        small_rows, large_rows = _rows(small), _rows(large)
        entries = {"full": sum(_rows(self._sides["full"])), "swa": sum(_rows(self._sides["swa"]))}
        if sum(small_rows) > sum(large_rows) or _C.parent_k(sum(large_rows), sum(small_rows)) != self.parent_k:
            raise SharedModeRefused(f"SGLang's KV pool builds KV entries of {entries['full']} and {entries['swa']} bytes "
                                    f"a token (full, SWA), not the ones its sizing priced ({self.size} full and "
                                    f"{self.size_swa} SWA slots)")
        small_places, large_places, nbytes = lay_out(small_rows, large_rows, k=self.parent_k,
                                                     small_slots=self._small_slots)
        strided = any(place.stride != place.width for place in small_places + large_places)
        if strided:
            reason = _strided_views_reason(entries)
            if reason is not None:
                raise SharedModeRefused(reason)
        with small.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE), \
                (torch.cuda.use_mem_pool(small.custom_mem_pool) if small.enable_custom_mem_pool
                 else contextlib.nullcontext()):
            self.storage = torch.zeros(nbytes, dtype=torch.uint8, device=small.device)
        small.adopt(*_views(self.storage, small, small_places, self._small_slots))
        large.adopt(*_views(self.storage, large, large_places, self._small_slots // self.parent_k))
        logger.info("swa_ext: shared mode: one KV storage of %.2f GiB, parent pages of %d %s pages or one %s page "
                    "(KV entries of %d full and %d SWA bytes a token)%s", nbytes / (1 << 30), self.parent_k,
                    self.small_side, "swa" if self.small_side == "full" else "full", entries["full"], entries["swa"],
                    "; the large side's layers are strided views" if strided else "")

    def get_kv_size_bytes(self):
        """The bytes of the one storage: the small side's views tile it."""
        return self._sides[self.small_side].get_kv_size_bytes()


def _strided_views_reason(entries):
    """Why SGLang cannot run on layer buffers that are strided views of the one storage
    (full and SWA KV entries of ``entries`` bytes a token), or None."""
    unserved = sorted({backend for backend in attention_backends() if backend not in STRIDED_READ_BACKENDS})
    where = f"layer buffers strided in one storage (KV entries of {entries['full']} full and {entries['swa']} SWA bytes)"
    if unserved:
        return f"attention backend {', '.join(unserved)} on {where}; --attention-backend triton serves"
    if get_disagg().disaggregation_mode != "null":
        return (f"PD disaggregation on {where}: its KV transfer moves a layer's page as one run of bytes; "
                f"equal full and SWA KV entries serve it")
    if get_memory().enable_hierarchical_cache:
        return f"the hierarchical cache on {where}: its host copies move a layer's rows as one run of bytes"
    return None
