"""The plain-torch baseline (swa_ext_bench / bench/) against the golden traces.

Every record of every trace in tests/golden/ is replayed through
``BaselineSWAAllocator`` and must match exactly: returned indices (or None),
``avail`` after the call, mapping snapshots, translations and
``new_pages_available``. A few unit tests cover what the traces do not
(page-size-1 extend/decode/tail, atomic decode, backup/restore, clear) and the
per-request eviction loop.
"""

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
if str(ROOT) not in sys.path:  # last: bench/ from it, never a swa_ext that PYTHONPATH puts first
    sys.path.append(str(ROOT))

import golden_replay  # noqa: E402  (tests/golden_replay.py, shared driver)

# This checkout's bench/ (the swa_ext_bench package's source); the installed
# package only when the source tree is not importable.
try:
    from bench.baseline import BaselineSWAAllocator  # noqa: E402
    from bench.evict_baseline import evict_per_request  # noqa: E402
except ImportError:
    from swa_ext_bench.baseline import BaselineSWAAllocator  # noqa: E402
    from swa_ext_bench.evict_baseline import evict_per_request  # noqa: E402
from swa_ext.decode import evicted_after_step  # noqa: E402  (the native rule the per-request loop applies)

TRACES = sorted((TESTS / "golden").glob("*.jsonl.gz"))


def _t(x):
    return torch.tensor(x, dtype=torch.int64)


def _mapping_snapshot(alloc):
    m = alloc.full_to_swa_index_mapping
    body = m[:-1]
    nz = torch.nonzero(body, as_tuple=True)[0]
    return len(m), [[int(i), int(v)] for i, v in zip(nz.tolist(), body[nz].tolist())]


def _make(init):
    return BaselineSWAAllocator(
        init["size"],
        init["size_swa"],
        init["page_size"],
        need_sort=init["need_sort"],
    )


def test_traces_present():
    assert len(TRACES) >= 36
    assert [Path(p).name for p in golden_replay.trace_paths()] == [p.name for p in TRACES]


@pytest.mark.parametrize("path", TRACES, ids=[p.name.split(".")[0] for p in TRACES])
def test_golden_trace(path):
    """Exact replay: outputs, avail after each call, mapping, translate, new_pages_available."""
    records = golden_replay.load_trace(path)
    n = golden_replay.replay(records, _make, _t, lambda x: x.tolist(), name=path.name)
    assert n == len(records)


# --------------------------------------------------------------------------
# Eviction loop checked against the traces' eviction records.


def _eviction_records():
    for path in TRACES:
        recs = golden_replay.load_trace(path)
        ps = recs[0]["page_size"]
        for rec in recs:
            if rec["op"] == "free_swa_segment" and "pre_len" in rec.get("meta", {}):
                yield path.name, ps, rec


class _Spy:
    def __init__(self):
        self.calls = []

    def free_swa_segment(self, indices, start_pos=0):
        self.calls.append((indices.tolist(), start_pos))


def test_evict_per_request_matches_trace_meta():
    n = 0
    for name, ps, rec in _eviction_records():
        m = rec["meta"]
        old, new, pre = m["old"], m["new"], m["pre_len"]
        sharing = m.get("prefix_sharing", False)  # the speculative traces' radix runs share prefixes
        assert evicted_after_step(old, pre, m["window"], ps, prefix_sharing=sharing) == new, (name, m)
        # One request whose row holds the traced indices at [old, new).
        row = torch.zeros((1, new + 4), dtype=torch.int32)
        row[0, old:new] = torch.tensor(rec["indices"], dtype=torch.int32)
        spy = _Spy()
        out = evict_per_request(spy, row, [0], [pre], [old], m["window"], ps, prefix_sharing=sharing)
        assert out == [new]
        assert spy.calls == [(rec["indices"], rec["start_pos"])], (name, m)
        n += 1
    assert n > 100


def test_evicted_after_step_rules():
    # Not due: the window has not passed evicted + interval.
    assert evicted_after_step(0, 10, 10, 4) == 0
    assert evicted_after_step(0, 13, 10, 4, interval=4) == 0
    # Due, but the page-aligned boundary has not moved.
    assert evicted_after_step(0, 13, 10, 4) == 0
    assert evicted_after_step(0, 14, 10, 4) == 4
    assert evicted_after_step(4, 14, 10, 4) == 4
    assert evicted_after_step(4, 40, 10, 4, interval=8) == 28
    # Prefix sharing keeps cdiv(max(W, ps), ps) * ps behind pre_len.
    assert evicted_after_step(0, 40, 10, 16) == 16
    assert evicted_after_step(0, 40, 10, 16, prefix_sharing=True) == 16
    assert evicted_after_step(0, 40, 5, 16, prefix_sharing=True) == 16
    assert evicted_after_step(0, 31, 5, 16, prefix_sharing=True) == 0
    assert evicted_after_step(0, 100, 40, 16, prefix_sharing=True) == 48
    assert evicted_after_step(0, 100, 40, 16) == 48
    assert evicted_after_step(0, 50, 3, 1) == 47
    assert evicted_after_step(0, 50, 3, 1, prefix_sharing=True) == 47


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_evict_per_request_end_to_end(ps):
    """Decode a small batch with eviction; SWA usage stays bounded by the window."""
    window = 2 * ps + 3
    alloc = BaselineSWAAllocator(64 * ps, 32 * ps, ps)
    bs, max_len = 3, 12 * ps
    req_to_token = torch.zeros((bs, max_len), dtype=torch.int32)
    lens = [ps + 1, 2 * ps, 3]
    pre = _t([0] * bs)
    seq = _t(lens)
    out = alloc.alloc_extend(pre, pre, seq, seq, _t([-1] * bs), sum(lens))
    assert out is not None
    off = 0
    for j, n in enumerate(lens):
        req_to_token[j, :n] = out[off : off + n].to(torch.int32)
        off += n
    evicted = [0] * bs
    for _ in range(8 * ps):
        seq_lens = _t([n + 1 for n in lens])
        last = _t([int(req_to_token[j, lens[j] - 1]) for j in range(bs)])
        got = alloc.alloc_decode(seq_lens, seq_lens, last)
        assert got is not None
        for j in range(bs):
            req_to_token[j, lens[j]] = int(got[j])
        lens = [n + 1 for n in lens]
        evicted = evict_per_request(
            alloc, req_to_token, list(range(bs)), [n - 1 for n in lens], evicted, window, ps
        )
        for j in range(bs):
            assert evicted[j] % ps == 0
            assert evicted[j] <= max(0, lens[j] - 1 - window)
            tr = alloc.translate_loc_from_full_to_swa(req_to_token[j, : lens[j]].long())
            assert (tr[: evicted[j]] == 0).all()
            assert (tr[evicted[j] :] > 0).all()
    held = sum(lens[j] - evicted[j] for j in range(bs))
    swa_used = alloc.size_swa - alloc.swa_available_size()
    assert swa_used <= held + bs * ps
    # Finish every request: everything comes back.
    for j in range(bs):
        alloc.free_full(req_to_token[j, : evicted[j]].long())
        alloc.free(req_to_token[j, evicted[j] : lens[j]].long())
    assert alloc.full_available_size() == 64 * ps
    assert alloc.swa_available_size() == 32 * ps


# --------------------------------------------------------------------------
# Behaviour outside the traces.


def test_alloc_decode_is_atomic():
    ps = 4
    alloc = BaselineSWAAllocator(64, 16, ps)
    pre = _t([0, 0])
    seq = _t([8, 4])
    f = alloc.alloc_extend(pre, pre, seq, seq, _t([-1, -1]), 12)
    assert f is not None
    # SWA has one page left; full has plenty. Two requests need a page each.
    assert alloc.swa_available_size() == 4
    full_before = alloc.full_attn_allocator.free_pages.clone()
    swa_before = alloc.swa_attn_allocator.free_pages.clone()
    map_before = alloc.full_to_swa_index_mapping.clone()
    seq = _t([9, 5])
    assert alloc.alloc_decode(seq, seq, _t([int(f[7]), int(f[11])])) is None
    assert torch.equal(alloc.full_attn_allocator.free_pages, full_before)
    assert torch.equal(alloc.swa_attn_allocator.free_pages, swa_before)
    assert torch.equal(alloc.full_to_swa_index_mapping, map_before)
    # One request needing a page fits.
    seq1 = _t([9])
    got = alloc.alloc_decode(seq1, seq1, _t([int(f[7])]))
    assert got is not None and int(got[0]) % ps == 0
    assert alloc.swa_available_size() == 0


@pytest.mark.parametrize("need_sort", [False, True])
def test_page_size_one_extend_decode_tail(need_sort):
    alloc = BaselineSWAAllocator(32, 16, 1, need_sort=need_sort)
    pre = _t([0, 2])
    seq = _t([3, 5])
    f = alloc.alloc_extend(pre, pre, seq, seq, _t([-1, 7]), 6)
    assert f.tolist() == [1, 2, 3, 4, 5, 6]
    assert alloc.translate_loc_from_full_to_swa(f).tolist() == [1, 2, 3, 4, 5, 6]
    d = alloc.alloc_decode(_t([4, 6]), _t([4, 6]), _t([3, 6]))
    assert d.tolist() == [7, 8]
    t = alloc.alloc_extend_swa_tail(_t([0]), _t([0]), _t([5]), _t([5]), _t([-1]), 5, 2)
    assert t.tolist() == [9, 10, 11, 12, 13]
    assert alloc.translate_loc_from_full_to_swa(t).tolist() == [0, 0, 0, 9, 10]
    assert alloc.full_available_size() == 32 - 13
    assert alloc.swa_available_size() == 16 - 10
    t0 = alloc.alloc_extend_swa_tail(_t([0]), _t([0]), _t([2]), _t([2]), _t([-1]), 2, 0)
    assert t0.tolist() == [14, 15]
    assert alloc.translate_loc_from_full_to_swa(t0).tolist() == [0, 0]
    # Too long a tail for the SWA pool: nothing changes.
    assert alloc.alloc_extend_swa_tail(_t([0]), _t([0]), _t([8]), _t([8]), _t([-1]), 8, 7) is None
    assert alloc.swa_available_size() == 6
    assert alloc.alloc_decode(_t([1] * 7), _t([1] * 7), _t([-1] * 7)) is None


@pytest.mark.parametrize("ps", [1, 4])
def test_clear_and_backup_restore(ps):
    alloc = BaselineSWAAllocator(16 * ps, 8 * ps, ps, need_sort=True)
    fresh_snapshot = _mapping_snapshot(alloc)
    state = alloc.backup_state()
    pre = _t([0])
    seq = _t([3 * ps])
    f = alloc.alloc_extend(pre, pre, seq, seq, _t([-1]), 3 * ps)
    assert f is not None
    alloc.free(f[:ps])
    assert alloc.full_available_size() == 14 * ps
    alloc.restore_state(state)
    assert alloc.full_available_size() == 16 * ps
    assert alloc.swa_available_size() == 8 * ps
    assert _mapping_snapshot(alloc) == fresh_snapshot
    f2 = alloc.alloc_extend(pre, pre, seq, seq, _t([-1]), 3 * ps)
    assert torch.equal(f, f2)
    alloc.free_group_begin()
    alloc.free(f2)
    alloc.clear()
    assert alloc.full_available_size() == 16 * ps
    assert alloc.swa_available_size() == 8 * ps
    assert _mapping_snapshot(alloc) == fresh_snapshot
    assert int(alloc.full_to_swa_index_mapping[-1]) == -1
    assert alloc.is_not_in_free_group
    alloc.free(alloc.alloc_extend(pre, pre, seq, seq, _t([-1]), 3 * ps))
    assert alloc.full_available_size() == 16 * ps


def test_free_group_order_paged():
    """Grouped frees: indices (one sorted dedup) first, then page ids in call order."""
    ps = 2
    alloc = BaselineSWAAllocator(20, 20, ps)
    pre = _t([0])
    seq = _t([16])
    f = alloc.alloc_extend(pre, pre, seq, seq, _t([-1]), 16)
    assert f.tolist() == list(range(2, 18))
    alloc.free_group_begin()
    alloc.free_segment(_t([14, 15]), start_pos=0)  # page 7
    alloc.free(_t([10, 11, 2]))  # pages 5, 1
    alloc.free_segment(_t([6, 7, 8, 9]), start_pos=0)  # pages 3, 4
    alloc.free(_t([3, 12]))  # pages 1, 6
    assert alloc.full_available_size() == 4  # nothing released yet
    alloc.free_group_end()
    # Full pool: free([10,11,2,3,12]) -> [1,5,6] prepended, then [7,3,4].
    assert alloc.full_attn_allocator.free_pages.tolist() == [7, 3, 4, 1, 5, 6, 9, 10]
    # SWA side, the other way round: held page ids [7,3,4] first, then the
    # held values' pages [1,5,6] (the mapping is the identity here).
    assert alloc.swa_attn_allocator.free_pages.tolist() == [1, 5, 6, 7, 3, 4, 9, 10]


def test_int32_indices_accepted():
    """req_to_token rows are int32 in SGLang; frees must take them."""
    for ps in (1, 4):
        alloc = BaselineSWAAllocator(16 * ps, 8 * ps, ps)
        pre = _t([0])
        seq = _t([2 * ps])
        f = alloc.alloc_extend(pre, pre, seq, seq, _t([-1]), 2 * ps)
        alloc.free_swa_segment(f[:ps].to(torch.int32), start_pos=0)
        alloc.free_full_segment(f[:ps].to(torch.int32), start_pos=0)
        alloc.free(f[ps:].to(torch.int32))
        assert alloc.full_available_size() == 16 * ps
        assert alloc.swa_available_size() == 8 * ps
        assert alloc.full_attn_allocator.free_pages.dtype == torch.int64
        assert alloc.swa_attn_allocator.free_pages.dtype == torch.int64
