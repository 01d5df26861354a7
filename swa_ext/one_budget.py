"""The shared mode's one budget in bytes (SPEC.md 8.1): which side's pages are the small
ones, and how many parent pages, and so slots a side, some KV bytes hold. SGLang's shared
KV pool (swa_ext/sglang/shared_pool.py) and the simulator size from here."""
from . import _C


def small_side(full_entry: int, swa_entry: int) -> str:
    """"full" or "swa": the side whose token holds fewer KV bytes (full where equal), of
    which a parent holds ``parent_k`` pages."""
    return "full" if full_entry <= swa_entry else "swa"


def one_budget_slots(kv_bytes: int, *, full_entry: int, swa_entry: int, page_size: int,
                     draft_entry: int = 0) -> tuple[int, int, int]:
    """(full slots, SWA slots, parent_k) of the parents that fit ``kv_bytes``, rounded
    down. A parent is ``parent_k`` pages of the small side or one page of the other
    (``_C.parent_k``); a draft model's ``draft_entry`` bytes sit at each full slot, so a
    parent also prices the draft's rows at the full pages it can hold."""
    small_is_full = small_side(full_entry, swa_entry) == "full"
    small, large = (full_entry, swa_entry) if small_is_full else (swa_entry, full_entry)
    k = _C.parent_k(large, small)
    full_pages_a_parent = k if small_is_full else 1
    parents = kv_bytes // (page_size * (k * small + full_pages_a_parent * draft_entry))
    small_slots, large_slots = parents * k * page_size, parents * page_size
    return (small_slots, large_slots, k) if small_is_full else (large_slots, small_slots, k)
