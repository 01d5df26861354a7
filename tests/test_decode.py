"""swa_ext.decode: the decode-side lifecycle (SPEC.md section 5).

- ``swa_tail_len`` against the independent Python statement of the rule;
- ``pre_alloc`` and ``evict_out_of_window`` against the golden traces, standing in
  for the SGLang calls that the traces' ``meta`` records explain;
- batched eviction against the per-request loop on random batches;
- a whole-lifecycle property test, and the benchmark's smoke run.
"""
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import golden_replay
import reference
import swa_ext
from swa_ext import _C, decode
from swa_ext_bench import bench_evict
from swa_ext_bench.evict_baseline import evict_per_request


def cdiv(a, b):
    return -(-a // b)


def make_allocator(size, size_swa, page_size, need_sort=False):
    return swa_ext.SWATokenToKVPoolAllocator(size, size_swa, page_size, torch.bfloat16, "cpu", need_sort=need_sort)


def whole(allocator):
    return (allocator.full_available_size(), allocator.swa_available_size()) == (allocator.size_full,
                                                                                 allocator.size_swa)


# --------------------------------------------------------------------------- swa_tail_len


def _grid_lengths(window, page_size):
    near = {0, 1, 2, window - 1, window, window + 1, page_size - 1, page_size, page_size + 1,
            window + page_size - 1, window + page_size, window + page_size + 1, 2 * window + 3 * page_size + 1}
    return sorted(v for v in near if v >= 0) + [-1]


@pytest.mark.parametrize("page_size", [1, 2, 4, 12, 16, 64])
def test_swa_tail_len_matches_the_rule(page_size):
    windows = sorted({1, 2, 3, page_size - 1, page_size, page_size + 1, 40, 128} - {0})
    checked = 0
    for window in windows:
        for seq_len in _grid_lengths(window, page_size):
            for radix in (False, True):
                want = reference.swa_tail_len(seq_len, window, page_size, radix)
                got = decode.swa_tail_len(seq_len, window, page_size, radix)
                assert got == want, (seq_len, window, page_size, radix)
                if seq_len > 0:
                    assert 1 <= got <= seq_len and (seq_len - got) % page_size == 0
                checked += 1
    assert checked > 50


@pytest.mark.parametrize("page_size", [1, 4, 12, 16, 64])
def test_evicted_after_step_matches_the_rule(page_size):
    for window in (1, 3, page_size, 40, 128):
        for evicted in range(0, 3 * page_size + 1, page_size):
            for pre_len in range(evicted, evicted + window + 3 * page_size + 2):
                for interval in (1, 2, page_size + 1):
                    for sharing in (False, True):
                        got = decode.evicted_after_step(evicted, pre_len, window, page_size, interval, sharing)
                        want = reference.evicted_after_step(evicted, pre_len, window, page_size, interval, sharing)
                        assert got == want, (evicted, pre_len, window, page_size, interval, sharing)


def test_swa_tail_len_rejects_bad_arguments():
    with pytest.raises(ValueError, match="page_size"):
        decode.swa_tail_len(10, 4, 0)
    with pytest.raises(ValueError, match="window"):
        decode.swa_tail_len(10, 0, 4)
    with pytest.raises(TypeError, match="seq_len"):
        decode.swa_tail_len(10.0, 4, 4)


@pytest.mark.parametrize("call, args, bad", [
    (_C.swa_tail_len, (10, 4, 0), "page_size"),
    (_C.swa_tail_len, (10, 0, 4), "window"),
    (_C.evicted_after_step, (0, 100, 4, 0), "page_size"),
    (_C.evicted_after_step, (0, 100, 4, -16), "page_size"),
    (_C.evicted_after_step, (0, 100, 0, 4), "window"),
    (_C.evicted_after_step, (0, 100, 4, 4, 0), "interval"),
    (_C.evicted_after_step, (8, 4, 4, 4), "evicted"),
    (_C.evicted_after_step, (-4, 100, 4, 4), "evicted"),
    (_C.evicted_after_step, (2, 100, 4, 4), "evicted"),
    (_C.evicted_after_step, (0, -1, 4, 4), "pre_len"),
])
def test_the_native_window_rules_check_their_arguments(call, args, bad):
    # The native functions check the values themselves (decode's wrappers convert types
    # only): a page size of 0 once divided by zero there and killed the process.
    with pytest.raises(ValueError, match=f"^{bad}: "):
        call(*args)


def test_evicted_after_step_takes_extreme_windows_and_intervals():
    # pre_len - window < evicted + interval, evaluated without an int64 overflow: an
    # interval or window past any length never evicts.
    big = 2**63 - 1
    assert decode.evicted_after_step(64, 4096, 128, 64, interval=big) == 64
    assert decode.evicted_after_step(64, 4096, big, 64) == 64
    assert decode.evicted_after_step(0, big, 1, 64, interval=big) == 0
    assert decode.evicted_after_step(64, 4096, 128, 64, interval=4096 - 64 - 128) == 3968
    assert decode.evicted_after_step(64, 4096, 128, 64, interval=4096 - 64 - 128 + 1) == 64


# --------------------------------------------------------------------------- ReqToTokenPool


def test_req_to_token_pool_rows():
    pool = decode.ReqToTokenPool(3, 8, "cpu")
    assert pool.req_to_token.shape == (3, 8) and pool.req_to_token.dtype == torch.int32
    assert pool.alloc(2) == [0, 1]
    assert pool.alloc(2) is None and pool.available_size() == 1
    pool.free(0)
    assert pool.alloc(2) == [2, 0]
    with pytest.raises(ValueError, match="row"):
        pool.free([1, 1])
    pool.free([1, 2])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(1)
    with pytest.raises(ValueError, match="outside"):
        pool.free(3)
    assert pool.available_size() == 2
    assert decode.ReqToTokenPool(1, 4, "cpu", dtype=torch.int64).req_to_token.dtype == torch.int64
    with pytest.raises(TypeError, match="dtype"):
        decode.ReqToTokenPool(1, 4, "cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="max_reqs"):
        decode.ReqToTokenPool(0, 4, "cpu")


# --------------------------------------------------------------------------- golden traces


def _as_list(result):
    return None if result is None else result.tolist()


def _to_tensor(values):
    return torch.tensor(values, dtype=torch.int64)


@pytest.mark.parametrize("path", golden_replay.trace_paths(), ids=lambda p: p.name.split(".")[0])
def test_golden_traces_with_pre_alloc_and_batched_eviction(path):
    """Replay a trace where each preallocation and each eviction that ``meta`` explains is
    made by swa_ext.decode instead: same returned slots, lengths and available sizes."""
    records = golden_replay.load_trace(path)
    init = records[0]
    ps = init["page_size"]
    alloc = make_allocator(init["size"], init["size_swa"], ps, init["need_sort"])
    dtype = torch.int32 if init["need_sort"] else torch.int64
    tails = [r for r in records if r["op"] == "alloc_extend_swa_tail" and "meta" in r]
    pool = decode.ReqToTokenPool(max(len(tails), 1), max([r["meta"]["fill_len"] for r in tails] + [1]),
                                 "cpu", dtype=dtype)
    table = pool.req_to_token
    pre_allocs = evictions = 0
    for no, rec in enumerate(records[1:], start=1):
        op, meta = rec["op"], rec.get("meta")
        where = f"{path.name} record {no} ({op})"
        if op == "alloc_extend_swa_tail" and meta is not None:
            fill, prefix_len = meta["fill_len"], rec["prefix_lens"][0]
            prefix = None
            if prefix_len:
                # Only the prefix's last slot reaches the allocator (as last_loc).
                last = rec["last_loc"][0]
                prefix = torch.arange(last - prefix_len + 1, last + 1, dtype=torch.int64)
            row = pool.alloc(1)[0]
            placed = decode.pre_alloc(alloc, table, row, fill, meta["window"], prefix_indices=prefix,
                                      radix_cache=meta["radix"])
            if rec["out"] is None:
                assert placed is None, where
                assert not table[row].any(), where
            else:
                kv, evicted = placed
                assert kv.tolist() == rec["out"], where
                assert evicted == meta["swa_evicted_seqlen"], where
                assert fill - evicted == rec["swa_tail_len"], where
                if prefix is not None:
                    assert table[row, :prefix_len].tolist() == prefix.tolist(), where
                assert table[row, prefix_len:fill].tolist() == rec["out"], where
            pre_allocs += 1
        elif op == "free_swa_segment" and meta is not None:
            old, new, pre_len = meta["old"], meta["new"], meta["pre_len"]
            assert rec["start_pos"] == old
            # A one-row table holding the request's slots at [old, new).
            scratch = torch.zeros((1, pre_len), dtype=dtype)
            scratch[0, old:new] = torch.tensor(rec["indices"], dtype=dtype)
            got = decode.evict_out_of_window(alloc, scratch, [0], [pre_len], [old], meta["window"],
                                             prefix_sharing=meta.get("prefix_sharing", False))
            assert got.tolist() == [new], where
            evictions += 1
        else:
            got = golden_replay._run_op(alloc, rec, _to_tensor, _to_tensor, _as_list)
            if op in ("alloc", "alloc_extend", "alloc_extend_swa_tail", "alloc_decode", "translate",
                      "new_pages_available"):
                assert got == rec["out"], where
        if "avail" in rec:
            assert [alloc.full_available_size(), alloc.swa_available_size()] == rec["avail"], where
    assert whole(alloc)
    alloc.check_invariants()
    assert pre_allocs + evictions > 0


# --------------------------------------------------------------------------- pre_alloc and release


def test_pre_alloc_refuses_what_the_pools_cannot_hold():
    ps = 4
    alloc = make_allocator(8 * ps, 2 * ps, ps)
    pool = decode.ReqToTokenPool(2, 64, "cpu")
    before = alloc.backup_state()
    # 30 tokens fit the full pool, but a window-20 tail needs more than 2 SWA pages.
    assert decode.pre_alloc(alloc, pool.req_to_token, 0, 30, 20) is None
    assert alloc.backup_state() == before
    assert not pool.req_to_token.any()
    kv, evicted = decode.pre_alloc(alloc, pool.req_to_token, 0, 30, 6)
    assert evicted == 24 and kv.shape == (30,)
    assert alloc.swa_available_size() == 0
    swa = alloc.translate_loc_from_full_to_swa(kv)
    assert (swa[:24] == 0).all() and (swa[24:] > 0).all()


def test_pre_alloc_with_a_prefix_and_release_keeps_the_prefix():
    ps = 4
    alloc = make_allocator(32 * ps, 16 * ps, ps)
    pool = decode.ReqToTokenPool(2, 64, "cpu", dtype=torch.int64)
    table = pool.req_to_token
    prefix = alloc.alloc(8) if ps == 1 else alloc.alloc_extend_swa_tail(
        _to_tensor([0]), _to_tensor([0]), _to_tensor([8]), _to_tensor([8]), _to_tensor([-1]), 8, 0)
    kv, evicted = decode.pre_alloc(alloc, table, 1, 30, 8, prefix_indices=prefix)
    assert evicted == 30 - decode.swa_tail_len(30, 8, ps)
    assert table[1, :8].tolist() == prefix.tolist() and table[1, 8:30].tolist() == kv.tolist()
    # The new slots continue after the prefix's last page.
    assert kv.shape == (22,) and int(kv[0]) // ps not in {int(p) // ps for p in prefix}
    decode.release(alloc, table, 1, 30, evicted, prefix_len=8)
    alloc.free_full(prefix)
    assert whole(alloc)
    alloc.check_invariants()

    with pytest.raises(ValueError, match="page size"):
        decode.pre_alloc(alloc, table, 0, 30, 8, prefix_indices=torch.arange(1, 7))
    with pytest.raises(ValueError, match="reaches into the SWA tail"):
        decode.pre_alloc(alloc, table, 0, 30, 8, prefix_indices=torch.arange(4, 28))
    with pytest.raises(TypeError, match="prefix_indices"):
        decode.pre_alloc(alloc, table, 0, 30, 8, prefix_indices=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="fill_len"):
        decode.pre_alloc(alloc, table, 0, 65, 8)
    with pytest.raises(ValueError, match="row"):
        decode.pre_alloc(alloc, table, 2, 30, 8)
    with pytest.raises(TypeError, match="req_to_token"):
        decode.pre_alloc(alloc, table.float(), 0, 30, 8)
    assert whole(alloc)


def test_release_refuses_a_stale_evicted_length():
    ps = 4
    alloc = make_allocator(32 * ps, 16 * ps, ps)
    pool = decode.ReqToTokenPool(1, 64, "cpu")
    table = pool.req_to_token
    _, evicted = decode.pre_alloc(alloc, table, 0, 30, 8)
    before = alloc.backup_state()
    # Below the evicted length the SWA pages are gone: freeing them again is refused.
    with pytest.raises(ValueError):
        decode.release(alloc, table, 0, 30, evicted - ps)
    with pytest.raises(ValueError, match="swa_evicted_seqlen"):
        decode.release(alloc, table, 0, 30, evicted + 1)
    with pytest.raises(ValueError, match="seq_len"):
        decode.release(alloc, table, 0, 65, evicted)
    assert alloc.backup_state() == before
    decode.release(alloc, table, 0, 30, evicted)
    assert whole(alloc)


# --------------------------------------------------------------------------- batched eviction


def _random_batch(rng, ps, window, num_requests, need_sort, dtype, decode_steps):
    """Two allocators and tables in the same state: requests preallocated, nothing evicted."""
    max_len = 2 * window + 2 * ps + decode_steps
    pages = num_requests * cdiv(max_len, ps) + 2
    allocators = [make_allocator(pages * ps, pages * ps, ps, need_sort) for _ in range(2)]
    tables = [torch.zeros((num_requests + 3, max_len), dtype=dtype) for _ in range(2)]
    rows = rng.sample(range(num_requests + 3), num_requests)
    evicted, seq_lens = [], []
    for row in rows:
        fill = rng.randint(1, 2 * window + 2 * ps)
        radix = rng.random() < 0.5
        placed = [decode.pre_alloc(a, t, row, fill, window, radix_cache=radix) for a, t in zip(allocators, tables)]
        assert placed[0][0].tolist() == placed[1][0].tolist()
        evicted.append(placed[0][1])
        seq_lens.append(fill)
    return allocators, tables, rows, seq_lens, evicted, max_len


def _decode_some(rng, allocators, tables, rows, seq_lens, max_len):
    """One decode token for a random subset of the requests, on both allocators alike."""
    picked = [j for j in range(len(rows)) if seq_lens[j] < max_len and rng.random() < 0.7]
    if not picked:
        return
    row_ids = torch.tensor([rows[j] for j in picked])
    lens = torch.tensor([seq_lens[j] for j in picked])
    for a, t in zip(allocators, tables):
        last_loc = t[row_ids, lens - 1].to(torch.int64)
        out = a.alloc_decode(lens + 1, lens + 1, last_loc)
        t[row_ids, lens] = out.to(t.dtype)
    for j in picked:
        seq_lens[j] += 1


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("prefix_sharing", [False, True])
@pytest.mark.parametrize("interval", [1, 3, 70])
def test_batched_eviction_equals_the_per_request_loop(page_size, prefix_sharing, interval):
    rng = random.Random(page_size * 1000 + interval * 10 + prefix_sharing)
    for trial in range(3):
        window = rng.choice([1, page_size, 2 * page_size + 3, 40])
        dtype = (torch.int32, torch.int64)[trial % 2]
        steps = 3 * window + 4 * page_size + 2 * interval
        allocators, tables, rows, seq_lens, evicted, max_len = _random_batch(
            rng, page_size, window, rng.randint(1, 12), need_sort=trial == 2, dtype=dtype, decode_steps=steps)
        batched, looped = allocators
        rounds_with_frees = 0
        for step in range(steps):
            _decode_some(rng, allocators, tables, rows, seq_lens, max_len)
            # Committed length: the last token, or the one before it when it is still in flight.
            pre_lens = [max(s - rng.randint(0, 1), 0) for s in seq_lens]
            grouped = rng.random() < 0.3
            if grouped:
                batched.free_group_begin()
                looped.free_group_begin()
            got = decode.evict_out_of_window(batched, tables[0], torch.tensor(rows), torch.tensor(pre_lens),
                                             torch.tensor(evicted), window, interval=interval,
                                             prefix_sharing=prefix_sharing)
            want = evict_per_request(looped, tables[1], rows, pre_lens, evicted, window, page_size,
                                     interval=interval, prefix_sharing=prefix_sharing)
            if grouped:
                batched.free_group_end()
                looped.free_group_end()
            assert got.dtype == torch.int64 and got.device.type == "cpu"
            assert got.tolist() == want, (trial, step)
            assert torch.equal(batched.swa_attn_allocator.free_pages, looped.swa_attn_allocator.free_pages)
            assert torch.equal(batched.full_to_swa_index_mapping, looped.full_to_swa_index_mapping)
            assert batched.backup_state() == looped.backup_state()
            rounds_with_frees += want != evicted
            evicted = want
        batched.check_invariants()
        assert rounds_with_frees > 0


def test_eviction_accepts_lists_and_leaves_its_inputs_alone():
    ps, window = 4, 8
    alloc = make_allocator(64 * ps, 64 * ps, ps)
    pool = decode.ReqToTokenPool(2, 64, "cpu")
    _, evicted = decode.pre_alloc(alloc, pool.req_to_token, 1, 30, window)
    evicted_t = torch.tensor([evicted])
    got = decode.evict_out_of_window(alloc, pool.req_to_token, [1], [29 + 2 * ps], evicted_t, window)
    assert got.tolist() == [reference.evicted_after_step(evicted, 29 + 2 * ps, window, ps)]
    assert got.tolist() != [evicted] and evicted_t.tolist() == [evicted]
    assert decode.evict_out_of_window(alloc, pool.req_to_token, [], [], [], window).tolist() == []


def test_eviction_takes_the_same_arguments_as_tensors_lists_and_tuples():
    ps, window = 4, 8
    results = []
    for kind in (torch.tensor, list, tuple, "method"):
        alloc = make_allocator(64 * ps, 64 * ps, ps)
        pool = decode.ReqToTokenPool(2, 64, "cpu")
        ev = [decode.pre_alloc(alloc, pool.req_to_token, row, 30, window)[1] for row in (0, 1)]
        args = ([0, 1], [29 + 2 * ps, 29 + 3 * ps], ev)
        if kind == "method":  # the allocator's own method is the same native call
            got = alloc.evict_out_of_window(pool.req_to_token, *map(torch.tensor, args), window, 1, False)
        else:
            got = decode.evict_out_of_window(alloc, pool.req_to_token, *map(kind, args), window, interval=1,
                                             prefix_sharing=False)
        alloc.check_invariants()
        results.append((got.tolist(), alloc.swa_available_size(), alloc.full_to_swa_index_mapping.tolist()))
    assert results[0][0] == [reference.evicted_after_step(e, p, window, ps) for e, p in zip(ev, args[1])]
    assert all(r == results[0] for r in results[1:])


def test_eviction_refuses_a_bool_where_an_int_belongs():
    ps, window = 4, 8
    alloc = make_allocator(64 * ps, 64 * ps, ps)
    pool = decode.ReqToTokenPool(1, 64, "cpu")
    _, ev = decode.pre_alloc(alloc, pool.req_to_token, 0, 30, window)
    before = alloc.backup_state()
    good = (pool.req_to_token, [0], [29 + 2 * ps], [ev])
    for args, kwargs, name in (
        ((*good, True), {}, "window"),
        ((*good, window), {"interval": True}, "interval"),
        ((pool.req_to_token, [True], [29 + 2 * ps], [ev], window), {}, "rows"),
        ((*good, 8.0), {}, "window"),
        ((pool.req_to_token.tolist(), [0], [29 + 2 * ps], [ev], window), {}, "req_to_token"),
    ):
        with pytest.raises(TypeError, match=name):
            decode.evict_out_of_window(alloc, *args, **kwargs)
    with pytest.raises(TypeError):  # interval and prefix_sharing are keyword-only in the function
        decode.evict_out_of_window(alloc, *good, window, 1)
    assert alloc.backup_state() == before


def test_a_bad_batch_changes_nothing():
    ps, window = 4, 8
    alloc = make_allocator(64 * ps, 64 * ps, ps)
    pool = decode.ReqToTokenPool(4, 64, "cpu")
    table = pool.req_to_token
    ev = [decode.pre_alloc(alloc, table, row, 40, window)[1] for row in (0, 1)]
    # Request 0 is due; each bad batch puts its fault after it.
    good = ([0], [50], [ev[0]])
    bad = {
        "unmapped row": ([2], [50], [0]),
        "row id": ([4], [50], [ev[1]]),
        "negative row id": ([-1], [50], [ev[1]]),
        "misaligned evicted": ([1], [50], [ev[1] + 1]),
        "evicted past pre_len": ([1], [20], [ev[1] + ps * 4]),
        "pre_len past the row": ([1], [65], [ev[1]]),
        "already evicted": ([1], [50], [ev[1] - ps]),
    }
    for name, (rows, pre_lens, evicted) in bad.items():
        before = alloc.backup_state()
        with pytest.raises(ValueError):
            decode.evict_out_of_window(alloc, table, good[0] + rows, good[1] + pre_lens, good[2] + evicted, window)
        assert alloc.backup_state() == before, name
    before = alloc.backup_state()
    with pytest.raises(ValueError, match="pre_lens"):
        decode.evict_out_of_window(alloc, table, [0, 1], [50], ev, window)
    with pytest.raises(ValueError, match="window"):
        decode.evict_out_of_window(alloc, table, [0], [50], [ev[0]], 0)
    with pytest.raises(ValueError, match="interval"):
        decode.evict_out_of_window(alloc, table, [0], [50], [ev[0]], window, interval=0)
    with pytest.raises(TypeError, match="rows"):
        decode.evict_out_of_window(alloc, table, [0.5], [50], [ev[0]], window)
    with pytest.raises(TypeError, match="pre_lens"):
        decode.evict_out_of_window(alloc, table, [0], torch.tensor([50.0]), [ev[0]], window)
    with pytest.raises(TypeError, match="evicted_seqlens"):
        decode.evict_out_of_window(alloc, table, [0], [50], 8, window)
    assert alloc.backup_state() == before
    alloc.check_invariants()


# --------------------------------------------------------------------------- lifecycle


@st.composite
def lifecycles(draw):
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    window = draw(st.integers(1, 3 * page_size + 5))
    requests = draw(st.lists(st.tuples(st.integers(1, 3 * window + 2 * page_size),  # prompt length
                                       st.integers(1, 2 * window + 2 * page_size),  # decode steps
                                       st.integers(0, 6),  # arrival step
                                       st.booleans()),  # uses the shared prefix
                             min_size=1, max_size=8))
    return dict(page_size=page_size, window=window, requests=requests,
                interval=draw(st.integers(1, 2 * page_size)), prefix_sharing=draw(st.booleans()),
                radix_cache=draw(st.booleans()), need_sort=draw(st.booleans()),
                dtype=draw(st.sampled_from([torch.int32, torch.int64])),
                prefix_pages=draw(st.integers(0, 3)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lifecycles())
def test_lifecycle_keeps_swa_within_the_window_and_frees_everything(case):
    ps, window, interval = case["page_size"], case["window"], case["interval"]
    requests = case["requests"]
    max_len = max(p + d for p, d, _, _ in requests) + ps
    pages = sum(cdiv(p + d, ps) + 1 for p, d, _, _ in requests) + case["prefix_pages"] + 1
    alloc = make_allocator(pages * ps, pages * ps, ps, case["need_sort"])
    pool = decode.ReqToTokenPool(len(requests), max_len, "cpu", dtype=case["dtype"])
    table = pool.req_to_token
    bound = cdiv(window, ps) + 2

    # A shared prefix (held by a radix cache, say) with full KV only.
    prefix_len = case["prefix_pages"] * ps
    prefix = None
    if prefix_len:
        zero = torch.zeros(1, dtype=torch.int64)
        length = torch.tensor([prefix_len])
        prefix = alloc.alloc_extend_swa_tail(zero, zero, length, length, torch.tensor([-1]), prefix_len, 0)

    running = []  # dicts: row, seq_len, evicted, prefix_len, remaining
    waiting = sorted(range(len(requests)), key=lambda i: requests[i][2])
    step = 0
    while waiting or running:
        for i in [i for i in waiting if requests[i][2] <= step]:
            fill, steps, _, shared = requests[i]
            tail = decode.swa_tail_len(fill, window, ps, case["radix_cache"])
            use_prefix = shared and prefix is not None and prefix_len <= fill - tail
            row = pool.alloc(1)[0]
            placed = decode.pre_alloc(alloc, table, row, fill, window, radix_cache=case["radix_cache"],
                                      prefix_indices=prefix if use_prefix else None)
            assert placed is not None
            running.append(dict(row=row, seq_len=fill, evicted=placed[1], remaining=steps,
                                prefix_len=prefix_len if use_prefix else 0))
            waiting.remove(i)
        if running:
            rows = torch.tensor([r["row"] for r in running])
            lens = torch.tensor([r["seq_len"] for r in running])
            out = alloc.alloc_decode(lens + 1, lens + 1, table[rows, lens - 1].to(torch.int64))
            assert out is not None
            table[rows, lens] = out.to(table.dtype)
            for r in running:
                r["seq_len"] += 1
                r["remaining"] -= 1
            new = decode.evict_out_of_window(alloc, table, rows, lens, [r["evicted"] for r in running], window,
                                             interval=interval, prefix_sharing=case["prefix_sharing"])
            swa_held = 0
            for r, ev in zip(running, new.tolist()):
                assert ev >= r["evicted"] and ev % ps == 0
                r["evicted"] = ev
                swa = alloc.translate_loc_from_full_to_swa(table[r["row"], :r["seq_len"]].to(torch.int64))
                # SWA KV exactly on [evicted, seq_len), whole pages of it.
                assert not swa[r["prefix_len"]:ev].any() and bool((swa[ev:] > 0).all())
                held = cdiv(r["seq_len"], ps) - ev // ps
                swa_held += held
                if r["seq_len"] - 1 > window:
                    assert held <= bound, (r, held, bound)
            assert alloc.size_swa - alloc.swa_available_size() == swa_held * ps
            for r in [r for r in running if r["remaining"] == 0]:
                decode.release(alloc, table, r["row"], r["seq_len"], r["evicted"], prefix_len=r["prefix_len"])
                pool.free(r["row"])
                running.remove(r)
            alloc.check_invariants()
        step += 1

    if prefix is not None:
        alloc.free_full(prefix)
    assert whole(alloc)
    mapping = alloc.full_to_swa_index_mapping
    assert not mapping[:-1].any() and int(mapping[-1]) == -1
    assert pool.available_size() == len(requests)
    alloc.check_invariants()


# --------------------------------------------------------------------------- benchmark


def test_benchmark_smoke(capsys):
    rows = bench_evict.run(sizes=(1, 3), windows=(8,), page_size=4, devices=["cpu"], smoke=True)
    assert [(r["device"], r["window"], r["requests"]) for r in rows] == [("cpu", 8, 1), ("cpu", 8, 3)]
    for r in rows:
        assert r["freed_pages"] == r["requests"]
        assert r["native_us"] > 0 and r["per_request_us"] > 0
        assert r["ratio"] == pytest.approx(r["per_request_us"] / r["native_us"])
    assert bench_evict.main(["--smoke", "--sizes", "2", "--windows", "3", "--page-size", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "native us" in out and "per-request us" in out and len(out.strip().splitlines()) == 2


# --------------------------------------------------------------------------- reusing a row


def test_pre_alloc_refuses_a_row_that_still_holds_slots():
    ps, window = 4, 8
    alloc = make_allocator(32 * ps, 16 * ps, ps)
    pool = decode.ReqToTokenPool(2, 64, "cpu")
    table = pool.req_to_token
    kv, evicted = decode.pre_alloc(alloc, table, 0, 30, window)
    held_row = table[0].clone()
    before = alloc.backup_state()
    # A second request put into row 0 before the first was released.
    with pytest.raises(ValueError, match=r"^row: req_to_token\[0\] still holds slots"):
        decode.pre_alloc(alloc, table, 0, 10, window)
    assert alloc.backup_state() == before and torch.equal(table[0], held_row)
    # A row holding a single slot anywhere counts too.
    table[1, 40] = int(kv[0])
    with pytest.raises(ValueError, match="row"):
        decode.pre_alloc(alloc, table, 1, 10, window)
    assert alloc.backup_state() == before
    table[1].zero_()

    decode.release(alloc, table, 0, 30, evicted)
    assert not table[0].any() and whole(alloc)
    # Released, the row takes the next request.
    kv2, evicted2 = decode.pre_alloc(alloc, table, 0, 10, window)
    assert table[0, :10].tolist() == kv2.tolist() and not table[0, 10:].any()
    decode.release(alloc, table, 0, 10, evicted2)
    assert whole(alloc)
    alloc.check_invariants()


def test_release_clears_the_row_prefix_included_and_a_second_release_is_refused():
    ps, window = 4, 8
    alloc = make_allocator(32 * ps, 16 * ps, ps)
    pool = decode.ReqToTokenPool(1, 64, "cpu", dtype=torch.int64)
    table = pool.req_to_token
    prefix = alloc.alloc_extend_swa_tail(_to_tensor([0]), _to_tensor([0]), _to_tensor([8]), _to_tensor([8]),
                                         _to_tensor([-1]), 8, 0)
    _, evicted = decode.pre_alloc(alloc, table, 0, 30, window, prefix_indices=prefix)
    decode.release(alloc, table, 0, 30, evicted, prefix_len=8)
    assert not table[0].any()
    # The prefix is still the caller's; the request's own slots are back.
    assert alloc.full_available_size() == alloc.size_full - 8 and alloc.swa_available_size() == alloc.size_swa
    before = alloc.backup_state()
    with pytest.raises(ValueError, match=r"^row: req_to_token\[0\] holds no slots in \[8, 30\) \(all 0\): "
                                         r"its request was released already"):
        decode.release(alloc, table, 0, 30, evicted, prefix_len=8)
    assert alloc.backup_state() == before
    alloc.free_full(prefix)
    assert whole(alloc)


@pytest.mark.parametrize("window, evict_to", [(8, None), (8, 28), (80, None)],
                         ids=["evicted to the tail", "evicted to the last page", "nothing evicted"])
def test_a_second_release_names_the_row_whatever_was_evicted(window, evict_to):
    ps = 4
    alloc = make_allocator(32 * ps, 16 * ps, ps)
    table = decode.ReqToTokenPool(3, 64, "cpu").req_to_token
    _, evicted = decode.pre_alloc(alloc, table, 2, 30, window)
    if evict_to is not None:
        alloc.free_swa_segment(table[2, evicted:evict_to], start_pos=evicted)
        evicted = evict_to
    decode.release(alloc, table, 2, 30, evicted)
    before = alloc.backup_state()
    with pytest.raises(ValueError, match=r"^row: req_to_token\[2\] holds no slots in \[0, 30\)"):
        decode.release(alloc, table, 2, 30, evicted)
    assert alloc.backup_state() == before and whole(alloc)


def test_req_to_token_pool_clear_empties_the_rows():
    alloc = make_allocator(64, 64, 4)
    pool = decode.ReqToTokenPool(2, 16, "cpu")
    rows = pool.alloc(2)
    for row in rows:
        assert decode.pre_alloc(alloc, pool.req_to_token, row, 9, 4) is not None
    alloc.clear()
    pool.clear()
    assert pool.available_size() == 2 and not pool.req_to_token.any()
    assert decode.pre_alloc(alloc, pool.req_to_token, pool.alloc(1)[0], 9, 4) is not None
