// The docstrings of the native module, the texts help() shows for swa_ext's allocator
// classes. Kept apart from bindings.cpp so that the binding code stays short; each
// constant is named after the class and the method it documents.
//
// Units, everywhere: a slot (or index) is one token's place in a pool; sizes and lengths
// count tokens unless they say pages; a page is page_size consecutive slots and page 0
// (slots 0 .. page_size - 1) is the padding page, never handed out.
#pragma once

namespace swa_docs {

// Paragraphs shared by several methods (string literals concatenate).
#define SWA_DOC_INDEX_ARGS                                                                            \
  "Index tensors are 1-D int64 (or int32) torch tensors on the allocator's device.\n"
#define SWA_DOC_LENGTH_ARGS                                                                            \
  "Each length comes twice: on the allocator's device (prefix_lens, seq_lens) and on the\n"          \
  "CPU (prefix_lens_cpu, seq_lens_cpu), 1-D int64 tensors, one entry per request. The\n"             \
  "allocator decides from the CPU copy; on a CPU allocator both copies must be equal (or\n"          \
  "the same tensor).\n"
#define SWA_DOC_LAST_LOC                                                                               \
  "last_loc[j] is the full-pool slot of request j's last token that already has KV, i.e.\n"          \
  "req_to_token[row, prefix_len - 1], or -1 when the request has no token yet\n"                      \
  "(prefix_len 0). New tokens first fill the rest of that slot's page. It must lie in a\n"           \
  "held page at offset (prefix_len - 1) % page_size; otherwise ValueError.\n"
#define SWA_DOC_REFUSAL                                                                                \
  "Returns an int64 tensor of new full-pool slots on the allocator's device; or None, with\n"       \
  "nothing changed, when the pools cannot hold the request(s).\n"
#define SWA_DOC_RAISES                                                                                 \
  "Raises ValueError (a bad value; the message starts with the argument's name) or\n"               \
  "TypeError (a bad type, dtype or device), leaving the allocator as it was;\n"                     \
  "swa_ext.ConcurrentUseError when another call on this allocator is still running.\n"
// What both allocators' constructors say of device, need_sort and kernels, and what they raise.
#define SWA_DOC_INIT_DEVICE_ARGS                                                                       \
  "device: 'cpu' or 'cuda'; need_sort: freed pages wait in a staging list (release_pages)\n"         \
  "and are merged into the sorted free list when an allocation needs them; kernels: 'auto'\n"        \
  "(what the device implies), 'cpu' or 'cuda' (the same, stated; the values of the kernels\n"       \
  "property), or 'emulated' (device='cpu' only) to run the GPU algorithm on the CPU.\n"
#define SWA_DOC_INIT_RAISES(sizes)                                                                     \
  "Raises ValueError or TypeError naming the bad argument, and MemoryError naming " sizes "\n"       \
  "(with the bytes its tables need) when they cannot be allocated."
#define SWA_DOC_DEFERRED                                                                               \
  "On a CUDA allocator, checks that need index values run on the GPU: a failure surfaces\n"         \
  "later as swa_ext.DeferredError (at once with SWA_EXT_DEBUG=1); see docs/cuda.md.\n"

// ---------------------------------------------------------------------------- module

inline constexpr char module_doc[] = "swa_ext native core: the SWA hybrid KV page allocator.";

inline constexpr char built_with_cuda[] =
    "Whether this build holds the CUDA kernels (device='cuda' allocators), GPU present or not.";

inline constexpr char swa_tail_len[] =
    "How many trailing tokens of a seq_len-token prompt need SWA KV on a decode node.\n\n"
    "The tail starts on a page boundary, so seq_len - tail (the evicted length) is a\n"
    "multiple of page_size. With radix_cache it keeps a whole window behind the\n"
    "page-aligned insert boundary. 0 for seq_len <= 0. All arguments in tokens.";

inline constexpr char evicted_after_step[] =
    "The window rule for one request: its evicted length after a decode step.\n\n"
    "evicted: tokens at the start of the request with no SWA KV (page-aligned);\n"
    "pre_len: its committed length (tokens with KV); window, page_size in tokens; interval:\n"
    "evict only once at least interval more tokens are out of the window; prefix_sharing:\n"
    "keep a whole page-rounded window (a radix cache may still match the tokens).\n"
    "Returns evicted when nothing is due, else a larger page-aligned length.";

// ---------------------------------------------------------------------------- one page pool

inline constexpr char pool_class[] =
    "One KV page pool (SGLang's PagedTokenToKVPoolAllocator, or TokenToKVPoolAllocator at\n"
    "page size 1). A SWATokenToKVPoolAllocator's full_attn_allocator and swa_attn_allocator\n"
    "are views of its two pools: same free lists, same concurrency guard.";

inline constexpr char pool_init[] =
    "size: slots (tokens), at least one page; page_size: slots per page;\n" SWA_DOC_INIT_DEVICE_ARGS
    SWA_DOC_INIT_RAISES("size");

inline constexpr char pool_init_shared[] = "A second handle on the pool `shared` (how a hybrid allocator's pool views are made).";

inline constexpr char pool_page_size[] = "How many slots (tokens) one page holds; sizes are multiples of it.";
inline constexpr char pool_size[] = "The pool's capacity in slots (tokens), without the padding page.";
inline constexpr char pool_size_full[] = "Same as size (SGLang's name).";
inline constexpr char pool_num_pages[] = "The pool's capacity in pages: size // page_size.";
inline constexpr char pool_need_sort[] = "Whether freed pages are staged and merged sorted (see release_pages).";
inline constexpr char pool_device[] = "The torch.device the pool's returned index tensors live on.";
inline constexpr char pool_free_pages[] =
    "The free page ids (not slots), in the order they are handed out: a CPU int64 tensor (a copy).";
inline constexpr char pool_release_pages[] =
    "The freed page ids staged for the next merge (need_sort only), a CPU int64 tensor (a copy).";
inline constexpr char pool_is_not_in_free_group[] = "False while a free group is open (between free_group_begin() and free_group_end()).";

inline constexpr char pool_available_size[] =
    "Free slots (tokens), staged pages included: (free pages + staged pages) * page_size.";

inline constexpr char pool_alloc[] =
    "need_size slots (tokens; a multiple of page_size) on whole fresh pages, from the head of\n"
    "the free list. Returns an int64 tensor of need_size slots on the pool's device, or None\n"
    "(nothing changed) when fewer are free.\n" SWA_DOC_RAISES;

inline constexpr char pool_alloc_extend[] =
    "Slots for a prefill batch: request j extends from prefix_lens[j] to seq_lens[j] tokens.\n"
    "extend_num_tokens must be the sum of seq_lens - prefix_lens; num_new_pages, when given,\n"
    "the number of fresh pages that takes (it is checked). The result holds\n"
    "extend_num_tokens slots, request after request.\n" SWA_DOC_LENGTH_ARGS SWA_DOC_LAST_LOC
    SWA_DOC_REFUSAL SWA_DOC_RAISES;

inline constexpr char pool_alloc_decode[] =
    "One slot per request for a decode step. seq_lens[j] is request j's length including\n"
    "the new token (>= 1), seq_lens_cpu the same on the CPU; last_loc[j] the slot of its token seq_lens[j] - 2, the last one\n"
    "with KV (-1 when seq_lens[j] is 1). A request with seq_len % page_size == 1 (every\n"
    "request at page size 1) gets a fresh page, the others last_loc + 1. Returns one slot per request, or None (nothing\n"
    "changed) when the fresh pages are not free.\n" SWA_DOC_RAISES;

inline constexpr char pool_free[] =
    "Frees every page that the slots in free_index touch, each page once, in page order.\n"
    SWA_DOC_INDEX_ARGS
    "Raises ValueError for a slot in the padding page or past the pool, or a page that is not\n"
    "held (a double free, also within one free group); nothing is freed then.\n";

inline constexpr char pool_free_page_ids[] =
    "Frees the pages page_ids (page ids, not slots), in the given order, no dedup.\n" SWA_DOC_INDEX_ARGS
    "Raises ValueError for a page id outside [1, num_pages] or a page not held.\n";

inline constexpr char pool_free_segment[] =
    "Frees one request's run of slots row[start_pos:start_pos + len(indices)]: start_pos\n"
    "must be page-aligned, and every page_size-th index stands for its page.\n"
    SWA_DOC_INDEX_ARGS "Raises ValueError as free() does, or for an unaligned start_pos.\n";

inline constexpr char pool_free_group_begin[] =
    "Holds every free until free_group_end(), which releases them as one batch (SPEC.md\n"
    "section 3). Groups do not nest: ValueError when one is open.";

inline constexpr char pool_free_group_end[] =
    "Releases the frees held since free_group_begin(). ValueError when no group is open.";

inline constexpr char pool_merge_and_sort_free[] =
    "Merges the staged pages (need_sort) into the free list and sorts it, as an allocation\n"
    "that needs them would.";

inline constexpr char pool_clear[] = "Every page free again, no free group open.";

inline constexpr char pool_resize[] =
    "The pool cleared at a new size of `size` slots (tokens), at least one page and at most\n"
    "the size it was built with. Raises ValueError naming `size`, changing nothing, otherwise.";

inline constexpr char pool_debug_print[] = "A readable dump of the free and staged pages.";

inline constexpr char pool_check_invariants[] =
    "Raises RuntimeError unless every page is in exactly one place (free, staged or held).";

inline constexpr char pool_backup_state[] = "A copy of the pool's state, for restore_state.";

inline constexpr char pool_restore_state[] =
    "Puts back a state from backup_state(). ValueError for a state of a pool of another shape.";

// ---------------------------------------------------------------------------- the hybrid allocator

inline constexpr char hybrid_class[] =
    "The native core of SWATokenToKVPoolAllocator: a full-attention page pool, a SWA page\n"
    "pool of the same page size, and full_to_swa_index_mapping, which pairs each full slot\n"
    "with its SWA slot (0: none). Allocations return full slots; translate_loc_from_full_to_swa\n"
    "gives their SWA peers.";

inline constexpr char hybrid_init[] =
    "size, size_swa: the full and SWA pools' slots (tokens), at least one page each;\n"
    "page_size: slots per page, the same in both pools;\n" SWA_DOC_INIT_DEVICE_ARGS
    "shared: the shared mode (SPEC.md section 8): one list of size slots serves full and SWA\n"
    "pages, size_swa must equal size;\n"
    SWA_DOC_INIT_RAISES("size or size_swa");

inline constexpr char hybrid_page_size[] = "Slots (tokens) per page, the same in both pools.";
inline constexpr char hybrid_size[] = "min(size_full, size_swa), in slots (tokens).";
inline constexpr char hybrid_size_full[] = "The full-attention pool's capacity in slots (tokens).";
inline constexpr char hybrid_size_swa[] = "The SWA pool's capacity in slots (tokens).";
inline constexpr char hybrid_need_sort[] = "Whether freed pages are staged and merged sorted.";
inline constexpr char hybrid_shared[] =
    "Whether the allocator runs in the shared mode: one free list of pages serves full and SWA pages.";
inline constexpr char hybrid_device[] = "The torch.device of the pools, the mapping and every returned index tensor.";
inline constexpr char hybrid_kernels[] =
    "Which implementation runs the calls: 'cpu' (the CPU core), 'cuda' (GPU kernels) or\n"
    "'emulated' (the GPU algorithm on the CPU, for tests).";
inline constexpr char hybrid_full_to_swa_index_mapping[] =
    "The int64 tensor (on device) of length size + page_size + 1 mapping a full slot to its\n"
    "SWA slot, 0 when it has none; the last entry is -1 so that last_loc -1 translates to -1.\n"
    "The same tensor for the allocator's life (engines register it with their KV cache).";
inline constexpr char hybrid_device_waits[] =
    "How many times a CUDA allocator has waited for the GPU (count read-backs, snapshots, an upload whose staging\n"
    "slot was still being copied from, 16 uploads ahead of the GPU); 0 on the CPU.";

inline constexpr char hybrid_available_size[] =
    "min(full_available_size(), swa_available_size()), in slots (tokens).";
inline constexpr char hybrid_full_available_size[] =
    "Free slots (tokens) of the full-attention pool, staged pages included.";
inline constexpr char hybrid_swa_available_size[] =
    "Free slots (tokens) of the SWA pool, staged pages included.";
inline constexpr char hybrid_full_used_size[] =
    "Slots (tokens) in the pages full KV holds: neither free nor staged, pages an open free group\n"
    "holds included (SPEC.md section 8). Kept as pages are taken and released: no scan.";
inline constexpr char hybrid_swa_used_size[] =
    "Slots (tokens) in the pages SWA KV holds: neither free nor staged, pages an open free group\n"
    "holds included (SPEC.md section 8). Kept as pages are taken and released: no scan.";

inline constexpr char hybrid_new_pages_available[] =
    "Whether the full pool can hand out num_full_pages fresh pages and the SWA pool\n"
    "num_swa_pages (pages, not tokens).";

inline constexpr char hybrid_reservation_fits[] =
    "Whether KV for full_tokens full and swa_tokens SWA tokens fits (SGLang's can_reserve):\n"
    "each side in whole pages, as an allocation takes them, within its pool's available pages\n"
    "plus the whole pages of its evictable tokens (full_evictable_tokens, swa_evictable_tokens:\n"
    "what the radix tree could give back); in the shared mode their sum within the one list's\n"
    "available pages plus both sides' evictable pages. empty_pool: against every page of the\n"
    "pools instead, nothing evictable counted. require_token_slack: a token to spare,\n"
    "full_tokens < size_full and swa_tokens < size_swa (shared: their sum < size).\n"
    "Only reads. Raises ValueError naming a count that is negative or above 2**62.";

inline constexpr char hybrid_alloc[] =
    "need_size slots (tokens; a multiple of page_size) on fresh pages of both pools, each\n"
    "full slot mapped to its SWA slot. Returns the full slots, or None (nothing changed)\n"
    "unless both pools hold need_size.\n" SWA_DOC_RAISES;

inline constexpr char hybrid_alloc_extend[] =
    "Full and SWA slots for a prefill batch: request j extends from prefix_lens[j] to\n"
    "seq_lens[j] tokens; extend_num_tokens must be the sum of seq_lens - prefix_lens. The\n"
    "result holds extend_num_tokens full slots, request after request, each mapped to a SWA\n"
    "slot that continues the SWA peer of last_loc.\n" SWA_DOC_LENGTH_ARGS SWA_DOC_LAST_LOC
    SWA_DOC_REFUSAL SWA_DOC_RAISES SWA_DOC_DEFERRED;

inline constexpr char hybrid_alloc_extend_swa_tail[] =
    "One request (batch size 1): full slots for all extend_num_tokens tokens, SWA slots\n"
    "(fresh pages) only for the last swa_tail_len of them, 0 <= swa_tail_len <=\n"
    "extend_num_tokens; the others map to 0. The decode side's preallocation\n"
    "(swa_ext.decode.pre_alloc computes swa_tail_len).\n" SWA_DOC_LENGTH_ARGS SWA_DOC_LAST_LOC
    SWA_DOC_REFUSAL SWA_DOC_RAISES SWA_DOC_DEFERRED;

inline constexpr char hybrid_alloc_decode[] =
    "One full slot (and its SWA slot) per request for a decode step.\n"
    "seq_lens[j]: request j's length including the new token (its committed length + 1);\n"
    "seq_lens_cpu: the same on the CPU. last_loc[j]: the full slot of its last token with KV,\n"
    "req_to_token[row, seq_lens[j] - 2] (-1 when seq_lens[j] is 1). A request with\n"
    "seq_len % page_size == 1 (all at page size 1) gets a fresh page in both pools, the\n"
    "others continue their page. Returns one full slot per request, for the caller to\n"
    "write into req_to_token[row, seq_lens[j] - 1]; or None, with nothing changed, unless\n"
    "both pools hold the fresh pages (SGLang would consume full pages first).\n" SWA_DOC_RAISES SWA_DOC_DEFERRED;

inline constexpr char hybrid_translate_loc_from_full_to_swa[] =
    "The SWA slot of each full slot in kv_indices (0 when it has none; -1 stays -1), a new\n"
    "int64 tensor on the device. " SWA_DOC_INDEX_ARGS
    "Raises ValueError for an index outside [-1, size + page_size).\n";

inline constexpr char hybrid_set_full_to_swa_mapping[] =
    "mapping[full_indices] = swa_indices (equal lengths). " SWA_DOC_INDEX_ARGS SWA_DOC_RAISES;

inline constexpr char hybrid_clear_full_to_swa_mapping[] =
    "mapping[full_indices] = 0. " SWA_DOC_INDEX_ARGS SWA_DOC_RAISES;

inline constexpr char hybrid_free[] =
    "Frees the pages of the full slots free_index and, through the mapping, their SWA pages\n"
    "(free_swa, then free_full). " SWA_DOC_INDEX_ARGS
    "Raises ValueError, freeing nothing, for a slot in the padding page or past the pool, or\n"
    "a page that is not held (a double free, also within one free group).\n" SWA_DOC_DEFERRED;

inline constexpr char hybrid_free_swa[] =
    "Frees only the SWA side of the pages of the full slots free_index: the mapped SWA pages of every token of\n"
    "those full pages, whose mapping entries become 0. " SWA_DOC_INDEX_ARGS
    "Raises ValueError as free() does.\n" SWA_DOC_DEFERRED;

inline constexpr char hybrid_free_full[] =
    "Frees only the full-pool pages of the slots free_index (their SWA peers already freed).\n"
    SWA_DOC_INDEX_ARGS "Raises ValueError as free() does.\n" SWA_DOC_DEFERRED;

inline constexpr char hybrid_free_segment[] =
    "Frees both sides of one request's run of full slots row[start_pos:start_pos +\n"
    "len(indices)]: start_pos must be page-aligned, every page_size-th index stands for its\n"
    "page, and each must be mapped. " SWA_DOC_INDEX_ARGS
    "Raises ValueError (nothing freed) for an unaligned start_pos, an unmapped slot, a page\n"
    "not held.\n" SWA_DOC_DEFERRED;

inline constexpr char hybrid_free_swa_segment[] =
    "Frees the SWA side of the run indices = row[start_pos:...] (what window eviction\n"
    "does): the mapped SWA pages, whose full pages' mapping entries become 0. start_pos\n"
    "must be page-aligned and every page_size-th index mapped.\n"
    SWA_DOC_INDEX_ARGS "Raises ValueError as free_segment() does.\n" SWA_DOC_DEFERRED;

inline constexpr char hybrid_free_full_segment[] =
    "Frees the full side of the run indices = row[start_pos:...] (its SWA side already\n"
    "freed); start_pos page-aligned.\n" SWA_DOC_INDEX_ARGS
    "Raises ValueError as free_segment() does.\n" SWA_DOC_DEFERRED;

inline constexpr char hybrid_free_group_begin[] =
    "Holds the frees of both pools until free_group_end() (SPEC.md section 4); the mapping\n"
    "is cleared at once. Groups do not nest: ValueError when one is open.";

inline constexpr char hybrid_free_group_end[] =
    "Releases the frees held since free_group_begin(). ValueError when no group is open.";

// The window eviction, as the allocator's method and as swa_ext.decode's function.
#define SWA_DOC_EVICT                                                                                  \
  "Frees the SWA KV that slid out of the window, for a whole decode batch in one native call.\n"      \
  "Request j lives in row rows[j] of req_to_token (the [max_reqs, max_context_len] int32 or\n"       \
  "int64 slot table, on the allocator's device), has committed length pre_lens[j] (seq_len - 1\n"    \
  "in a decode step) and evicted length evicted_seqlens[j] (page-aligned); rows, pre_lens and\n"     \
  "evicted_seqlens are CPU integer tensors or lists of ints, window is in tokens. Returns the\n"      \
  "new evicted lengths as a CPU int64 tensor; the inputs are not modified. The result and the\n"     \
  "allocator's state are those of free_swa_segment(row[evicted:new], start_pos=evicted) per\n"       \
  "due request in batch order. interval: evict only once at least interval more tokens are\n"       \
  "out of the window; prefix_sharing: keep a whole page-rounded window (a radix cache may still\n"   \
  "match the tokens). The batch is checked first: ValueError (a bad value) or TypeError (a bad\n"    \
  "type; a bool is not an int), naming the argument, changes nothing.\n"

inline constexpr char hybrid_evict_out_of_window[] =
    SWA_DOC_EVICT "swa_ext.decode.evict_out_of_window is the same call with the allocator first.";

inline constexpr char evict_out_of_window[] =
    SWA_DOC_EVICT "It is the allocator's evict_out_of_window method as a function of the allocator, so that\n"
    "a decode step pays no Python frame for it.";

inline constexpr char hybrid_clear[] =
    "Both pools free again, the mapping zeroed (but its -1 sentinel), no free group open.";

inline constexpr char hybrid_resize[] =
    "Both pools cleared at new sizes: `size` full-attention and `size_swa` SWA slots (tokens),\n"
    "each at least one page and at most the size it was built with (SGLang's post-capture KV\n"
    "sizing only shrinks). The mapping is the same tensor, of the same length, zeroed. Raises\n"
    "ValueError naming the argument, changing nothing, for a size out of range.";

inline constexpr char hybrid_check_device_errors[] =
    "On a CUDA allocator: waits for the GPU and raises swa_ext.DeferredError for a failed\n"
    "check of an earlier call (the allocator then refuses calls until clear() or\n"
    "restore_state()). Nothing to do on the CPU, whose calls raise at once.";

inline constexpr char hybrid_debug_print[] = "A readable dump of both pools' free and staged pages.";

inline constexpr char hybrid_check_invariants[] =
    "Raises RuntimeError unless every page of both pools is in exactly one place and the\n"
    "mapping points only into held SWA pages.";

inline constexpr char hybrid_backup_state[] =
    "A copy of both pools and the mapping, for restore_state.";

inline constexpr char hybrid_restore_state[] =
    "Puts back a state from backup_state(). ValueError for a state of an allocator of another shape.";

#undef SWA_DOC_INDEX_ARGS
#undef SWA_DOC_LENGTH_ARGS
#undef SWA_DOC_LAST_LOC
#undef SWA_DOC_REFUSAL
#undef SWA_DOC_RAISES
#undef SWA_DOC_DEFERRED
#undef SWA_DOC_EVICT

}  // namespace swa_docs
