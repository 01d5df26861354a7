"""The plain-Python reference (tests/reference.py) against SPEC.md and the golden traces."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from golden_replay import load_trace, replay, trace_paths  # noqa: E402
from reference import PagePoolRef, SWAAllocatorRef, TokenPoolRef, evicted_after_step, swa_tail_len  # noqa: E402

TRACES = trace_paths()


def make_ref(init: dict) -> SWAAllocatorRef:
    return SWAAllocatorRef(init["size"], init["size_swa"], init["page_size"], init["need_sort"])


def test_traces_present():
    assert len(TRACES) >= 36


# ---------------------------------------------------------------- golden traces


@pytest.mark.parametrize("path", TRACES, ids=[p.name.removesuffix(".jsonl.gz") for p in TRACES])
def test_golden_replay(path):
    replay(load_trace(path), make_ref, name=path.name)


@pytest.mark.parametrize("path", TRACES, ids=[p.name.removesuffix(".jsonl.gz") for p in TRACES])
def test_golden_meta_follows_sections_5_and_7(path):
    """The recorded preallocation tails and eviction steps follow swa_tail_len / evicted_after_step;
    the speculative decode reserves follow section 7."""
    records = load_trace(path)
    ps = records[0]["page_size"]
    for no, rec in enumerate(records):
        meta = rec.get("meta")
        if not meta:
            continue
        if rec["op"] == "alloc_extend_swa_tail":
            tail = swa_tail_len(meta["fill_len"], meta["window"], ps, radix_cache=meta["radix"])
            assert tail == rec["swa_tail_len"], (no, rec)
            assert meta["fill_len"] - tail == meta["swa_evicted_seqlen"], (no, rec)
        elif "reserve" in meta:
            # Every request up to cdiv(committed + reserve, ps) pages, from what it holds.
            want = [max(a, -(-(c + meta["reserve"]) // ps) * ps) for a, c in zip(meta["allocated"], meta["committed"])]
            if rec["op"] == "alloc":  # page size 1: one allocation for the batch
                assert rec["need_size"] == sum(w - a for w, a in zip(want, meta["allocated"])), (no, rec)
            else:
                assert rec["prefix_lens"] == meta["allocated"] and rec["seq_lens"] == want, (no, rec)
        else:
            # The plain traces' eviction runs without prefix sharing, radix or not.
            sharing = meta.get("prefix_sharing", False)
            assert evicted_after_step(meta["old"], meta["pre_len"], meta["window"], ps,
                                      prefix_sharing=sharing) == meta["new"], (no, rec)
            assert len(rec["indices"]) == meta["new"] - meta["old"], (no, rec)
            if "start_pos" in rec:
                assert rec["start_pos"] == meta["old"], (no, rec)


# ---------------------------------------------------------------- section 5 by hand


@pytest.mark.parametrize(
    "seq_len, window, ps, radix, tail",
    [
        (0, 24, 4, False, 0),
        (-5, 24, 4, True, 0),
        (10, 24, 4, False, 10),  # shorter than the window: everything
        (10, 24, 4, True, 10),
        (30, 24, 4, False, 26),  # start 6 -> page 4
        (30, 24, 4, True, 26),  # start 29-24=5 -> page 4
        (104, 40, 16, False, 40),  # start 64, already aligned
        (104, 40, 16, True, 56),  # start 103-40=63 -> 48
        (100, 4, 16, False, 4),  # start 96
        (100, 4, 16, True, 20),  # window below a page: 99-16=83 -> 80
        (30, 24, 1, False, 24),
        (30, 24, 1, True, 25),
        (200, 128, 64, False, 136),  # start 72 -> 64
        (200, 128, 64, True, 136),  # start 199-128=71 -> 64
    ],
)
def test_swa_tail_len(seq_len, window, ps, radix, tail):
    assert swa_tail_len(seq_len, window, ps, radix_cache=radix) == tail
    if seq_len > 0:
        assert (seq_len - tail) % ps == 0


@pytest.mark.parametrize(
    "evicted, pre_len, window, ps, interval, sharing, new",
    [
        (0, 24, 24, 4, 1, False, 0),  # nothing left of the window yet
        (0, 25, 24, 4, 1, False, 0),  # triggered, but rounds down to 0
        (0, 28, 24, 4, 1, False, 4),
        (4, 32, 24, 4, 1, False, 8),
        (0, 20, 4, 16, 1, False, 16),
        (64, 91, 4, 16, 1, False, 80),
        (10, 35, 24, 1, 1, False, 11),
        (0, 28, 24, 4, 5, False, 0),  # interval not reached: 4 < 0 + 5
        (0, 28, 24, 4, 4, False, 4),
        (0, 40, 4, 16, 1, False, 32),
        (0, 40, 4, 16, 1, True, 16),  # sharing keeps a whole page: 40 - 16 = 24 -> 16
        (0, 100, 40, 16, 1, True, 48),  # 100 - 48 = 52 -> 48
        (0, 110, 40, 16, 1, False, 64),  # 70 -> 64
        (0, 110, 40, 16, 1, True, 48),  # 110 - 48 = 62 -> 48
        (48, 110, 40, 16, 1, True, 48),  # already there
    ],
)
def test_evict_step(evicted, pre_len, window, ps, interval, sharing, new):
    assert evicted_after_step(evicted, pre_len, window, ps, interval=interval, prefix_sharing=sharing) == new


# ---------------------------------------------------------------- pools by hand


def test_page_pool_extend_layout():
    pool = PagePoolRef(64, 4)
    assert pool.alloc_extend([0], [6], [-1], 6) == [4, 5, 6, 7, 8, 9]
    # continue page 2 (tokens 10, 11), then start page 3
    assert pool.alloc_extend([6], [11], [9], 5) == [10, 11, 12, 13, 14]
    # a batch: request 0 fills page 3 and one whole page; request 1 fresh
    out = pool.alloc_extend([11, 0], [16, 5], [14, -1], 10)
    assert out == [15, 16, 17, 18, 19, 20, 21, 22, 23, 24]
    assert pool.available_size() == (16 - 6) * 4


def test_page_pool_decode():
    pool = PagePoolRef(64, 4)
    pool.alloc_extend([0, 0], [4, 2], [-1, -1], 6)  # pages 1, 2
    # request 0 needs a new page (seq 5), request 1 continues token 9
    assert pool.alloc_decode([5, 3], [7, 9]) == [12, 10]


def test_page_pool_free_order_nosort_prepends():
    pool = PagePoolRef(32, 4)
    pool.alloc(16)  # pages 1..4
    pool.free([13, 4, 5, 14])  # pages 3 and 1: sorted, deduped, prepended
    assert pool.free_pages[:2] == [1, 3]
    pool.free_page_ids([4, 2])  # as given
    assert pool.free_pages[:4] == [4, 2, 1, 3]


def test_page_pool_need_sort_stages_then_merges():
    pool = PagePoolRef(16, 4, need_sort=True)
    assert pool.alloc(16) == list(range(4, 20))
    pool.free_segment([12, 13, 14, 15, 4, 5], start_pos=0)  # pages 3, 1 as given
    assert pool.release_pages == [3, 1] and pool.free_pages == []
    assert pool.available_size() == 8
    assert pool.alloc(4) == [4, 5, 6, 7]  # merge sorts: page 1 first
    assert pool.free_pages == [3]


def test_token_pool_appends():
    pool = TokenPoolRef(8)
    assert pool.alloc(4) == [1, 2, 3, 4]
    pool.free([3, 1])
    assert pool.free_pages == [5, 6, 7, 8, 3, 1]


def test_pool_group_frees_union_then_pages():
    pool = PagePoolRef(32, 4)
    pool.alloc(24)  # pages 1..6; free: [7, 8]
    pool.free_group_begin()
    pool.free([20, 21])  # page 5
    pool.free_page_ids([2])
    pool.free([22, 12])  # pages 5 (again) and 3
    assert pool.available_size() == 8  # nothing released while grouped
    pool.free_group_end()
    # one sorted free over the union [3, 5] first, then page 2: both prepended
    assert pool.free_pages == [2, 3, 5, 7, 8]


def test_paged_free_dedups_within_a_call_and_a_group():
    pool = PagePoolRef(32, 4)
    pool.alloc(24)
    pool.free([4, 5, 5, 6])  # one page, named three times
    pool.free_group_begin()
    pool.free([8, 9])
    pool.free([10, 11])  # same page 2, queued by index twice: one union
    pool.free_group_end()
    assert pool.free_pages[:2] == [2, 1]


# ---------------------------------------------------------------- hybrid: page size 1 extensions


def test_page_size_1_extensions():
    a = SWAAllocatorRef(16, 8, 1)
    f = a.alloc_extend([0], [0], [3], [3], [-1], 3)
    assert f == [1, 2, 3] and a.translate_loc_from_full_to_swa(f) == [1, 2, 3]
    assert a.alloc_decode([4], [4], [3]) == [4]
    f = a.alloc_extend_swa_tail([0], [0], [5], [5], [-1], 5, 2)
    assert f == [5, 6, 7, 8, 9]
    assert a.translate_loc_from_full_to_swa(f + [-1]) == [0, 0, 0, 5, 6, -1]
    f = a.alloc_extend_swa_tail([0], [0], [2], [2], [-1], 2, 0)
    assert a.translate_loc_from_full_to_swa(f) == [0, 0]
    assert (a.full_available_size(), a.swa_available_size()) == (16 - 11, 8 - 6)
    assert a.alloc_extend_swa_tail([0], [0], [3], [3], [-1], 3, 3) is None  # SWA short
    assert (a.full_available_size(), a.swa_available_size()) == (5, 2)


def test_swa_tail_page_size_4():
    a = SWAAllocatorRef(64, 32, 4)
    f = a.alloc_extend_swa_tail([0], [0], [10], [10], [-1], 10, 6)
    assert f == list(range(4, 14))
    # full positions 4..9 get SWA; 0..3 (one whole page) do not
    assert a.translate_loc_from_full_to_swa(f) == [0, 0, 0, 0, 4, 5, 6, 7, 8, 9]
    assert a.swa_available_size() == 32 - 8


def test_sizes_and_sentinel():
    a = SWAAllocatorRef(48, 24, 4)
    assert (a.size, a.size_full, a.size_swa) == (24, 48, 24)
    assert len(a.full_to_swa_index_mapping) == 48 + 4 + 1
    assert a.full_to_swa_index_mapping[-1] == -1
    assert a.translate_loc_from_full_to_swa([-1, 0]) == [-1, 0]


def test_alloc_decode_refusal_is_atomic():
    a = SWAAllocatorRef(64, 8, 4, need_sort=True)
    f = a.alloc_extend([0, 0], [0, 0], [4, 4], [4, 4], [-1, -1], 8)  # SWA pool now empty
    assert a.swa_available_size() == 0
    before = a.snapshot()
    assert a.alloc_decode([5, 5], [5, 5], [f[3], f[7]]) is None
    assert a.snapshot() == before  # the full pool was not touched either


def test_accepts_tensors():
    torch = pytest.importorskip("torch")
    a = SWAAllocatorRef(64, 32, 4)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    f = a.alloc_extend(t([0]), t([0]), t([5]), t([5]), t([-1]), 5)
    assert f == [4, 5, 6, 7, 8]
    assert a.alloc_decode(t([6]), t([6]), t([8])) == [9]
    a.free(t(f + [9]))
    assert (a.full_available_size(), a.swa_available_size()) == (64, 32)


# ---------------------------------------------------------------- bad input: ValueError, nothing changed


def _prepared(ps=4, need_sort=False):
    """A hybrid with two requests allocated, one partly evicted, and a staged free."""
    a = SWAAllocatorRef(64, 32, ps, need_sort=need_sort)
    f1 = a.alloc_extend([0], [0], [10], [10], [-1], 10)  # pages 1..3
    f2 = a.alloc_extend([0], [0], [8], [8], [-1], 8)  # pages 4..5
    a.free_swa_segment(f1[:4], start_pos=0)  # evict the first page of request 1
    return a, f1, f2


BAD_CALLS = {
    "extend mismatched lengths": lambda a, f1, f2: a.alloc_extend([0, 0], [0, 0], [4], [4], [-1], 4),
    "extend prefix > seq": lambda a, f1, f2: a.alloc_extend([8], [8], [4], [4], [f2[-1]], -4),
    "extend negative seq": lambda a, f1, f2: a.alloc_extend([0], [0], [-4], [-4], [-1], -4),
    "extend last_loc not -1 for empty prefix": lambda a, f1, f2: a.alloc_extend([0], [0], [4], [4], [7], 4),
    "extend last_loc at wrong page offset": lambda a, f1, f2: a.alloc_extend([10], [10], [12], [12], [f1[8]], 2),
    "extend wrong extend_num_tokens": lambda a, f1, f2: a.alloc_extend([0], [0], [4], [4], [-1], 5),
    "extend cpu copy differs": lambda a, f1, f2: a.alloc_extend([0], [1], [4], [4], [-1], 4),
    "extend continues an evicted SWA page": lambda a, f1, f2: a.alloc_extend([2], [2], [4], [4], [f1[1]], 2),
    "decode seq 0": lambda a, f1, f2: a.alloc_decode([0], [0], [-1]),
    "decode wrong last_loc": lambda a, f1, f2: a.alloc_decode([11], [11], [f1[8]]),
    "free page 0": lambda a, f1, f2: a.free([1, 2]),
    "free past the last page": lambda a, f1, f2: a.free([68]),
    "free negative index": lambda a, f1, f2: a.free([-1]),
    "free_full of a free page": lambda a, f1, f2: a.free_full([40]),
    # valid SWA side (free_full leaves the mapping), full side already freed
    "free after free_full": lambda a, f1, f2: a.free(f2 + f1[4:]),
    "free_segment double page": lambda a, f1, f2: a.free_segment(f2 + f2, start_pos=0),
    "free_swa_segment unmapped": lambda a, f1, f2: a.free_swa_segment(f1[:8], start_pos=0),
    "free_swa_segment start_pos unaligned": lambda a, f1, f2: a.free_swa_segment(f1[4:8], start_pos=2),
    "free_segment unmapped representative": lambda a, f1, f2: a.free_segment(f2 + f1, start_pos=0),
    "nested group": lambda a, f1, f2: a.free_group_begin(),
    "group end without group": lambda a, f1, f2: a.free_group_end(),
    "swa_tail batch 2": lambda a, f1, f2: a.alloc_extend_swa_tail([0, 0], [0, 0], [4, 4], [4, 4], [-1, -1], 8, 4),
    "swa_tail longer than extend": lambda a, f1, f2: a.alloc_extend_swa_tail([0], [0], [4], [4], [-1], 4, 5),
    "swa_tail negative": lambda a, f1, f2: a.alloc_extend_swa_tail([0], [0], [4], [4], [-1], 4, -1),
    "hybrid alloc not a page multiple": lambda a, f1, f2: a.alloc(6),
    "translate past the mapping": lambda a, f1, f2: a.translate_loc_from_full_to_swa([1000]),
    "set mapping mismatched": lambda a, f1, f2: a.set_full_to_swa_mapping([4, 5], [4]),
}


# Valid calls that bring the allocator to where the bad call is bad.
SETUPS = {
    "free after free_full": lambda a, f1, f2: a.free_full(f2),
    "nested group": lambda a, f1, f2: a.free_group_begin(),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_input_raises_and_changes_nothing(name):
    a, f1, f2 = _prepared()
    SETUPS.get(name, lambda *_: None)(a, f1, f2)
    before = a.snapshot()
    with pytest.raises(ValueError):
        BAD_CALLS[name](a, f1, f2)
    assert a.snapshot() == before


def test_double_free_inside_a_group():
    a, f1, f2 = _prepared(need_sort=True)
    a.free_group_begin()
    a.free_segment(f2, start_pos=0)
    before = a.snapshot()
    with pytest.raises(ValueError):
        a.free_full(f2)  # queued as pages already
    with pytest.raises(ValueError):
        a.free_swa_segment(f2, start_pos=0)  # mapping already cleared
    assert a.snapshot() == before
    a.free_group_end()


def test_pool_bad_inputs():
    pool = PagePoolRef(32, 4)
    before = pool.snapshot()
    for call in (
        lambda: pool.alloc(6),  # not a multiple of the page size
        lambda: pool.free([4]),  # never handed out
        lambda: pool.free_page_ids([0]),
        lambda: pool.free_segment([4, 5, 6, 7], start_pos=1),
        lambda: pool.alloc_decode([1, 2], [-1]),
    ):
        with pytest.raises(ValueError):
            call()
        assert pool.snapshot() == before
    tok = TokenPoolRef(8)
    tok.alloc(3)
    before = tok.snapshot()
    with pytest.raises(ValueError):
        tok.free([2, 2])  # page size 1 never dedups
    assert tok.snapshot() == before


def test_snapshot_is_a_copy():
    a, f1, f2 = _prepared()
    snap = a.snapshot()
    a.free(f2)
    assert snap != a.snapshot()
    assert snap["full"]["free_pages"] == list(range(6, 17))


def test_clear():
    a, f1, f2 = _prepared(need_sort=True)
    a.free_group_begin()
    a.free(f2)
    a.clear()
    assert a.snapshot() == SWAAllocatorRef(64, 32, 4, need_sort=True).snapshot()


# ---------------------------------------------------------------- invariants over random lifecycles

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def check_invariants(a: SWAAllocatorRef) -> None:
    """Every page is in exactly one place, and the mapping points at held SWA tokens."""
    for pool in (a.full_attn_allocator, a.swa_attn_allocator):
        snap = pool.snapshot()
        state = snap["page_state"]
        free, staged = snap["free_pages"], snap["release_pages"]
        assert len(set(free)) == len(free) and len(set(staged)) == len(staged)
        assert not set(free) & set(staged)
        for p in range(1, pool.num_pages + 1):
            where = "free" if p in free else "staged" if p in staged else None
            if where:
                assert state[p] == where, (p, state[p])
            else:
                assert state[p] in ("held", "queued-tokens", "queued-page"), (p, state[p])
        assert pool.available_size() == (len(free) + len(staged)) * pool.page_size
    ps = a.page_size
    swa_state = a.swa_attn_allocator.snapshot()["page_state"]
    mapping = a.full_to_swa_index_mapping
    assert mapping[-1] == -1
    peers = [v for v in mapping[:-1] if v != 0]
    assert len(set(peers)) == len(peers), "two full tokens share an SWA token"
    for v in peers:
        assert swa_state[v // ps] == "held"


@pytest.mark.parametrize("path", TRACES[::6], ids=[p.name.removesuffix(".jsonl.gz") for p in TRACES[::6]])
def test_invariants_hold_after_golden_replay(path):
    made = []

    def make(init):
        made.append(make_ref(init))
        return made[-1]

    replay(load_trace(path), make, name=path.name)
    check_invariants(made[0])


@settings(max_examples=60, deadline=None)
@given(
    ps=st.sampled_from([1, 4]),
    need_sort=st.booleans(),
    steps=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 30), st.booleans()), min_size=1, max_size=60),
)
def test_random_lifecycle_keeps_invariants(ps, need_sort, steps):
    """Requests arrive, decode, slide their window and finish, some frees grouped."""
    window = 6
    a = SWAAllocatorRef(32 * ps, 16 * ps, ps, need_sort)
    live = []  # [row, evicted]
    for kind, n, grouped in steps:
        if kind == 0:  # a new request (fully SWA or with only a tail)
            tail = swa_tail_len(n, window, ps) if grouped else n
            row = a.alloc_extend_swa_tail([0], [0], [n], [n], [-1], n, tail)
            if row is not None:
                live.append([row, n - tail])
        elif kind in (1, 2) and live:  # a decode step for one request
            req = live[n % len(live)]
            row, evicted = req
            seq = len(row) + 1
            out = a.alloc_decode([seq], [seq], [row[-1]])
            if out is not None:
                row.extend(out)
                new = evicted_after_step(evicted, seq - 1, window, ps)
                if new > evicted:
                    a.free_swa_segment(row[evicted:new], start_pos=evicted)
                    req[1] = new
        elif kind == 3 and live:  # finish a request
            row, evicted = live.pop(n % len(live))
            if grouped:
                a.free_group_begin()
            if evicted:
                a.free_full_segment(row[:evicted], start_pos=0)
            a.free_segment(row[evicted:], start_pos=evicted)
            if grouped:
                a.free_group_end()
        check_invariants(a)
    for row, evicted in live:
        a.free_full(row[:evicted])
        a.free(row[evicted:])
    check_invariants(a)
    assert (a.full_available_size(), a.swa_available_size()) == (a.size_full, a.size_swa)


def test_page_aligned_prefix_ignores_an_evicted_swa_last_loc():
    """A prefix ending on a page boundary never reads its SWA last_loc."""
    a = SWAAllocatorRef(64, 32, 4)
    row = a.alloc_extend([0], [0], [8], [8], [-1], 8)
    a.free_swa_segment(row, start_pos=0)  # the whole prefix evicted from SWA
    assert a.alloc_extend([8], [8], [10], [10], [row[-1]], 2) == [12, 13]
    assert a.translate_loc_from_full_to_swa([12, 13]) == [4, 5]
    assert a.alloc_decode([9], [9], [row[-1]]) == [16]
