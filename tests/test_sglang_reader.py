"""The native reader of SGLang's decode batch (``_C.sglang.WindowEviction``), without SGLang.

SGLang's scheduler hook (swa_ext.sglang.hooks) hands it the running batch's requests; it
reads their lengths through the CPython API and evicts every due request in one native
call. Here it reads stand-ins shaped as SGLang 0.5.23's ``Req`` and ``ReqKvInfo`` are
(instance attributes, a ``seqlen`` property, a slotted KV state whose evicted lengths are
a dict keyed by a component), against a reference written from SGLang's
``maybe_evict_swa`` / ``free_swa_out_of_window_slots``: the same due requests, the same
pages freed in the same order, the same evicted lengths. What it does not read (another
class, a replaced method, a length out of range, an attribute that raises) comes back as a
reason with nothing changed. tests/sglang/test_evict_hook.py runs it on SGLang's own
classes. This file runs in the CPU suite, so also under the sanitizers.
"""
from __future__ import annotations

import copy
import enum
import inspect

import numpy
import pytest
import torch

import swa_ext
from cuda_support import cuda_skip_reason
from swa_ext import _C


class Component(int, enum.Enum):  # SGLang's ComponentType: an int Enum, hashed in Python
    FULL = 0
    SWA = 1


SWA = Component.SWA


class KvState:
    """ReqKvInfo's fields and the methods the reader reads in place."""

    __slots__ = ("req_pool_idx", "cache_protected_len", "swa_evict_floor", "component_evicted_seqlens")

    def __init__(self, row, protected=0, floor=0, evicted=0):
        self.req_pool_idx = row
        self.cache_protected_len = protected
        self.swa_evict_floor = floor
        self.component_evicted_seqlens = {SWA: evicted} if evicted else {}

    def get_evicted_seqlen(self, component):
        return self.component_evicted_seqlens.get(component, 0)

    def set_evicted_seqlen(self, component, length):
        self.component_evicted_seqlens[component] = length

    @property
    def holds_kv(self):
        return self.req_pool_idx is not None

    def swa_dead_lo(self, page_size):
        lo = max(self.cache_protected_len, self.swa_evict_floor)
        if page_size > 1 and lo > self.cache_protected_len:
            lo = -(-lo // page_size) * page_size
        return lo


# The same KV state keeping its fields in an instance dict: the reader reads those
# through the attribute lookup instead of the slots.
DictKvState = type("DictKvState", (), {k: v for k, v in vars(KvState).items()
                                       if k not in ("__slots__", *KvState.__slots__)})


class Request:
    def __init__(self, prompt, outputs, kv, decode_batch_idx=1):
        self.origin_input_ids = list(range(prompt))
        self.output_ids = list(range(outputs))
        self.kv = kv
        self.decode_batch_idx = decode_batch_idx

    @property
    def seqlen(self):
        return len(self.origin_input_ids) + len(self.output_ids)


WINDOW, PS = 8, 4


def reference(alloc, reqs, req_to_token, window, interval, sharing):
    """SGLang's decode branch of maybe_evict_swa, one free_swa_segment a request."""
    page = alloc.page_size
    alloc.free_group_begin()
    for req in reqs:
        kv = req.kv
        if not (req.decode_batch_idx >= 1 and kv.holds_kv):
            continue
        pre_len = req.seqlen - 1
        evicted = kv.get_evicted_seqlen(SWA)
        if pre_len - window < evicted + interval:
            continue
        evicted = max(evicted, kv.swa_dead_lo(page))
        kv.set_evicted_seqlen(SWA, evicted)
        keep = -(-max(window, page) // page) * page if sharing else window
        new = max(evicted, pre_len - keep) // page * page
        if new > evicted:
            alloc.free_swa_segment(req_to_token[kv.req_pool_idx, evicted:new], start_pos=evicted)
            kv.set_evicted_seqlen(SWA, new)
    alloc.free_group_end()


class Batch:
    """A batch of requests on an allocator, each holding full and SWA KV for its tokens."""

    GROWTH = 32  # tokens each request may decode: their slots are in its row from the start

    def __init__(self, lengths, page=PS, kernels="auto", kv_class=KvState, **kv_fields):
        device = "cuda" if kernels == "cuda" else "cpu"
        self.alloc = swa_ext.SWATokenToKVPoolAllocator(2048, 2048, page, torch.float16, device, kernels=kernels)
        self.req_to_token = torch.zeros(len(lengths) + 1, 256, dtype=torch.int32, device=device)
        self.reqs = []
        for row, (prompt, outputs) in enumerate(lengths):
            held = prompt + outputs + self.GROWTH
            self.req_to_token[row, :held] = self.alloc.alloc(-(-held // page) * page)[:held].to(torch.int32)
            self.reqs.append(Request(prompt, outputs, kv_class(row, **kv_fields)))

    def state(self):
        return ([copy.copy(r.kv.component_evicted_seqlens) for r in self.reqs], self.alloc.backup_state(),
                self.alloc.full_to_swa_index_mapping.cpu())


def reader(kv_class=KvState):
    return _C.sglang.WindowEviction(Request, kv_class, SWA)


LENGTHS = [(30, 5), (9, 1), (60, 12), (17, 3), (100, 1), (12, 40), (8, 1)]


def assert_same(a, b):
    assert a[0] == b[0]
    assert a[1] == b[1]
    assert torch.equal(a[2], b[2])


@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("interval", [1, 3, 16])
@pytest.mark.parametrize("sharing", [True, False])
@pytest.mark.parametrize("kernels, kv_class", [("cpu", KvState), ("cpu", DictKvState), ("emulated", KvState),
                                              ("cuda", KvState)], ids=["cpu", "cpu-dict", "emulated", "cuda"])
def test_the_reader_evicts_as_sglangs_loop(kernels, kv_class, page, interval, sharing):
    if kernels == "cuda" and cuda_skip_reason():
        pytest.skip(cuda_skip_reason())
    ours, theirs = Batch(LENGTHS, page, kernels, kv_class), Batch(LENGTHS, page, "cpu", kv_class)
    for batch in (ours, theirs):  # protected prefixes, shields, a request without KV, one not yet decoding
        batch.reqs[0].kv.cache_protected_len = 2 * page
        batch.reqs[2].kv.swa_evict_floor = 13
        batch.reqs[3].kv.req_pool_idx = None
        batch.reqs[5].decode_batch_idx = 0
    evict = reader(kv_class)
    moved = 0
    for step in range(Batch.GROWTH):
        got = []
        assert evict.evict(ours.alloc, ours.reqs, ours.req_to_token, WINDOW, interval, sharing, record=got) is None
        reference(theirs.alloc, theirs.reqs, theirs.req_to_token, WINDOW, interval, sharing)
        assert_same(ours.state(), theirs.state())
        moved += sum(start != end for _, start, end in got)
        for batch in (ours, theirs):  # the next token (its KV slot is already in the row)
            for req in batch.reqs:
                req.output_ids.append(0)
    assert moved > 0
    ours.alloc.check_invariants()


def test_the_record_names_each_due_request_with_its_range():
    batch = Batch([(40, 1), (9, 1), (33, 1)])
    got = []
    assert reader().evict(batch.alloc, batch.reqs, batch.req_to_token, WINDOW, 1, False, record=got) is None
    # pre_len 40, 9 and 33 (seqlen - 1), all due (a token out of the window); the window's
    # start rounded down to a page: 32, 0 (nothing to free) and 24.
    assert got == [(0, 0, 32), (1, 0, 0), (2, 0, 24)]
    # As SGLang sets them: the request with nothing to free gets its length 0 written too.
    assert [r.kv.component_evicted_seqlens for r in batch.reqs] == [{SWA: 32}, {SWA: 0}, {SWA: 24}]
    got = []
    batch.reqs[1].output_ids.clear()  # pre_len 8: no token out of the window, not due
    batch.reqs[1].kv.component_evicted_seqlens.clear()
    assert reader().evict(batch.alloc, batch.reqs, batch.req_to_token, WINDOW, 1, False, record=got) is None
    assert [i for i, _, _ in got] == [2] and batch.reqs[1].kv.component_evicted_seqlens == {}  # 0: 32 + 1 > 40 - 8


def test_frees_go_to_the_callers_open_group_when_it_holds_one():
    batch = Batch([(40, 1)])
    before = batch.alloc.swa_available_size()
    batch.alloc.free_group_begin()
    assert reader().evict(batch.alloc, batch.reqs, batch.req_to_token, WINDOW, 1, False, free_group=False) is None
    assert batch.alloc.swa_available_size() == before  # queued in the group
    batch.alloc.free_group_end()
    assert batch.alloc.swa_available_size() == before + 32


def test_a_numpy_integer_is_read_as_an_int():
    ours, theirs = Batch(LENGTHS), Batch(LENGTHS)
    for batch in (ours, theirs):
        batch.reqs[1].decode_batch_idx = numpy.int64(3)
        batch.reqs[2].kv.req_pool_idx = numpy.int32(2)
        batch.reqs[4].kv.component_evicted_seqlens[SWA] = numpy.int64(8)
    assert reader().evict(ours.alloc, ours.reqs, ours.req_to_token, WINDOW, 1, True) is None
    reference(theirs.alloc, theirs.reqs, theirs.req_to_token, WINDOW, 1, True)
    assert_same(ours.state(), theirs.state())


class OtherRequest(Request):
    pass


class OtherKvState(KvState):
    __slots__ = ()


class RaisingLength(list):
    def __len__(self):
        raise RuntimeError("no length today")


def _plant(what, batch, monkeypatch):
    req = batch.reqs[2]
    if what == "request class":
        req.__class__ = OtherRequest
    elif what == "kv class":
        req.kv.__class__ = OtherKvState
    elif what == "replaced method":
        monkeypatch.setattr(KvState, "get_evicted_seqlen", lambda self, c: self.component_evicted_seqlens.get(c, 0))
    elif what == "class attribute":
        monkeypatch.setattr(Request, "decode_batch_idx", 5, raising=False)
    elif what == "missing attribute":
        del req.output_ids
    elif what == "negative length":
        req.kv.cache_protected_len = -4
    elif what == "huge length":
        req.kv.swa_evict_floor = 2**70
    elif what == "not an int":
        req.kv.component_evicted_seqlens[SWA] = 8.0
    elif what == "evicted lengths not a dict":
        req.kv.component_evicted_seqlens = list()
    elif what == "length raises":
        req.output_ids = RaisingLength([0])
    elif what == "unset slot":
        del req.kv.swa_evict_floor
    elif what == "replaced slot":
        monkeypatch.setattr(KvState, "req_pool_idx", property(lambda self: 2))
    elif what == "unaligned start":  # the allocator refuses: start must be page-aligned
        req.kv.cache_protected_len = 3


PLANTS = {"request class": "OtherRequest, not SGLang's Req", "kv class": "OtherKvState, not SGLang's ReqKvInfo",
          "replaced method": "get_evicted_seqlen changed", "class attribute": "decode_batch_idx changed",
          "missing attribute": "request 2 has no output_ids", "negative length": "kv.cache_protected_len is outside",
          "huge length": "kv.swa_evict_floor is outside", "not an int": "SWA evicted length raised TypeError",
          "evicted lengths not a dict": "not a dict", "length raises": "output_ids raised RuntimeError: no length today",
          "unset slot": "request 2 has no kv.swa_evict_floor", "replaced slot": "KvState.req_pool_idx changed",
          "unaligned start": "the native call refused this batch (evicted_seqlens: entry"}


@pytest.mark.parametrize("what", PLANTS)
def test_what_it_does_not_read_comes_back_as_a_reason_with_nothing_changed(what, monkeypatch):
    batch = Batch(LENGTHS)
    evict = reader()  # made when the hook installs, before anything changes
    earlier = Batch(LENGTHS)  # a step before: the classes then pass unchanged on their version tags
    assert evict.evict(earlier.alloc, earlier.reqs, earlier.req_to_token, WINDOW, 1, True) is None
    _plant(what, batch, monkeypatch)
    before = batch.state()
    got = []
    reason = evict.evict(batch.alloc, batch.reqs, batch.req_to_token, WINDOW, 1, True, record=got)
    assert isinstance(reason, str) and PLANTS[what] in reason, reason
    assert_same(batch.state(), before)
    assert got == []
    batch.alloc.free_group_begin()  # no free group was left open
    batch.alloc.free_group_end()


def test_the_reader_refuses_classes_it_cannot_read():
    with pytest.raises(TypeError, match="req_type: expected a class"):
        _C.sglang.WindowEviction(Request(1, 1, None), KvState, SWA)
    with pytest.raises(TypeError, match="has no seqlen: not SGLang's class"):
        _C.sglang.WindowEviction(KvState, KvState, SWA)

    class Shadowing(Request):
        kv = property(lambda self: None)

    with pytest.raises(TypeError, match="kv is defined by the class"):
        _C.sglang.WindowEviction(Shadowing, KvState, SWA)


def test_bad_arguments_are_named_and_change_nothing():
    batch = Batch(LENGTHS)
    before = batch.state()
    evict = reader()
    with pytest.raises(ValueError, match="window: must be >= 1"):
        evict.evict(batch.alloc, batch.reqs, batch.req_to_token, 0, 1, True)
    with pytest.raises(ValueError, match="interval: must be >= 1"):
        evict.evict(batch.alloc, batch.reqs, batch.req_to_token, WINDOW, 0, True)
    with pytest.raises(ValueError, match=r"window: must be below 2\*\*62"):  # the due test could overflow
        evict.evict(batch.alloc, batch.reqs, batch.req_to_token, 2**63 - 1, 1, True)
    with pytest.raises(ValueError, match=r"interval: must be below 2\*\*62"):
        evict.evict(batch.alloc, batch.reqs, batch.req_to_token, WINDOW, 2**62, True)
    with pytest.raises(TypeError, match="record: expected a list or None"):
        evict.evict(batch.alloc, batch.reqs, batch.req_to_token, WINDOW, 1, True, record=())
    with pytest.raises(TypeError, match="reqs: expected a sequence"):
        evict.evict(batch.alloc, 5, batch.req_to_token, WINDOW, 1, True)
    with pytest.raises(TypeError, match="req_to_token: expected a torch.Tensor"):
        evict.evict(batch.alloc, batch.reqs, [[0]], WINDOW, 1, True)
    assert_same(batch.state(), before)


def test_the_reader_keeps_no_request_alive():
    import sys
    import weakref

    batch = Batch(LENGTHS)
    lengths = [r.kv.component_evicted_seqlens for r in batch.reqs]
    counts = [sys.getrefcount(d) for d in lengths]
    requests = [weakref.ref(r) for r in batch.reqs]
    evict = reader()
    evict.evict(batch.alloc, batch.reqs, batch.req_to_token, WINDOW, 1, True)
    assert [sys.getrefcount(d) for d in lengths] == counts
    batch.reqs.clear()
    assert all(r() is None for r in requests)



# ------------------------------------------------------------------ admitted batches

class Mode(enum.IntEnum):  # SGLang's ForwardMode: an IntEnum whose members the batch holds
    EXTEND = 1
    DECODE = 2


class Scheduler:
    """What evict_batch reads of a ScheduleBatch, on a Batch of requests."""

    def __init__(self, batch, mode=Mode.DECODE):
        self.tree_cache = object()
        self.token_to_kv_pool_allocator = batch.alloc
        self.forward_mode = mode
        self.reqs = batch.reqs
        self.req_to_token_pool = type("ReqToTokenPool", (), {})()
        self.req_to_token_pool.req_to_token = batch.req_to_token


class Field:  # an SGLang EnvField's flag, read as an attribute
    def __init__(self):
        self._set_to_none = False


def admit(evict, sched, environ, field, interval=1, sharing=True):
    evict.admit(sched.tree_cache, sched.token_to_kv_pool_allocator, Mode.DECODE, WINDOW, interval, sharing,
                [(environ, b"INTERVAL", environ.get(b"INTERVAL")), (environ, b"UNSET", None),
                 (field, "_set_to_none", field._set_to_none)])


@pytest.mark.parametrize("interval", [1, 3])
@pytest.mark.parametrize("sharing", [True, False])
def test_an_admitted_batch_is_evicted_as_sglangs_loop_from_the_batch_itself(interval, sharing):
    ours, theirs = Batch(LENGTHS), Batch(LENGTHS)
    for batch in (ours, theirs):
        batch.reqs[0].kv.cache_protected_len = 2 * PS
        batch.reqs[3].kv.req_pool_idx = None
    evict, sched, environ, field = reader(), Scheduler(ours), {b"INTERVAL": b"1"}, Field()
    admit(evict, sched, environ, field, interval, sharing)
    before = evict.counters()
    for step in range(Batch.GROWTH):
        assert evict.evict_batch(sched) is None
        reference(theirs.alloc, theirs.reqs, theirs.req_to_token, WINDOW, interval, sharing)
        assert_same(ours.state(), theirs.state())
        for batch in (ours, theirs):
            for req in batch.reqs:
                req.output_ids.append(0)
    after = evict.counters()
    assert after["batches"] - before["batches"] == after["admitted_batches"] - before["admitted_batches"] == Batch.GROWTH
    evict.evict(ours.alloc, ours.reqs, ours.req_to_token, WINDOW, interval, sharing)  # a batch evict alone counts
    assert evict.counters()["batches"] == after["batches"] + 1
    assert evict.counters()["admitted_batches"] == after["admitted_batches"]
    assert 0 < after["freeing_batches"] - before["freeing_batches"] <= after["freed_requests"] - before["freed_requests"]
    ours.alloc.check_invariants()


def _differs(what, sched, environ, field, evict):
    if what == "no admission":
        evict.withdraw()
    elif what == "another tree cache":
        sched.tree_cache = object()
    elif what == "another allocator":
        sched.token_to_kv_pool_allocator = swa_ext.SWATokenToKVPoolAllocator(64, 64, PS, torch.float16, "cpu")
    elif what == "extend":
        sched.forward_mode = Mode.EXTEND
    elif what == "a setting's value":
        environ[b"INTERVAL"] = "16".encode()  # the same text, another object: read again
    elif what == "a setting now set":
        environ[b"UNSET"] = b"0"
    elif what == "a setting now unset":
        del environ[b"INTERVAL"]
    elif what == "an attribute setting":
        field._set_to_none = True


@pytest.mark.parametrize("what", ["no admission", "another tree cache", "another allocator", "extend",
                                  "a setting's value", "a setting now set", "a setting now unset",
                                  "an attribute setting"])
def test_what_the_admission_does_not_cover_comes_back_false_with_nothing_changed(what):
    batch = Batch(LENGTHS)
    evict, sched, environ, field = reader(), Scheduler(batch), {b"INTERVAL": "16".encode()}, Field()
    admit(evict, sched, environ, field)
    _differs(what, sched, environ, field, evict)
    before, counted = batch.state(), evict.counters()
    assert evict.evict_batch(sched) is False
    assert_same(batch.state(), before)
    assert evict.counters() == counted
    if what != "no admission":  # admitted again as it now is, the batch is evicted
        evict.admit(sched.tree_cache, sched.token_to_kv_pool_allocator, sched.forward_mode, WINDOW, 1, True,
                    [(environ, b"INTERVAL", environ.get(b"INTERVAL")), (environ, b"UNSET", environ.get(b"UNSET")),
                     (field, "_set_to_none", field._set_to_none)])
        # The other allocator never held these requests' slots: it refuses to free them.
        expected = "the native call refused" if what == "another allocator" else None
        assert evict.evict_batch(sched) == expected if expected is None else expected in evict.evict_batch(sched)


def test_an_admitted_batch_the_reader_refuses_comes_back_as_a_reason_with_nothing_changed():
    batch = Batch(LENGTHS)
    evict, sched, environ, field = reader(), Scheduler(batch), {}, Field()
    admit(evict, sched, environ, field)
    batch.reqs[2].__class__ = OtherRequest
    before, counted = batch.state(), evict.counters()
    assert "OtherRequest, not SGLang's Req" in evict.evict_batch(sched)
    assert_same(batch.state(), before)
    assert evict.counters() == counted


def test_admit_and_evict_batch_name_what_is_wrong_and_change_nothing():
    batch = Batch(LENGTHS)
    evict, sched = reader(), Scheduler(batch)
    before = batch.state()
    with pytest.raises(TypeError, match="allocator: expected a HybridAllocator, got str"):
        evict.admit(sched.tree_cache, "alloc", Mode.DECODE, WINDOW, 1, True, [])
    with pytest.raises(ValueError, match="window: must be >= 1"):
        evict.admit(sched.tree_cache, batch.alloc, Mode.DECODE, 0, 1, True, [])
    with pytest.raises(ValueError, match=r"interval: must be below 2\*\*62"):
        evict.admit(sched.tree_cache, batch.alloc, Mode.DECODE, WINDOW, 2**62, True, [])
    for settings in [(), [(1, 2)], [5]]:
        with pytest.raises(TypeError, match=r"settings: expected a list of \(source, key, value\)"):
            evict.admit(sched.tree_cache, batch.alloc, Mode.DECODE, WINDOW, 1, True, settings)
    with pytest.raises(TypeError, match="settings: an attribute's key must be a str"):
        evict.admit(sched.tree_cache, batch.alloc, Mode.DECODE, WINDOW, 1, True, [(Field(), 3, False)])
    assert evict.evict_batch(sched) is False  # none of those was admitted
    with pytest.raises(TypeError, match=r"evict_batch\(\) takes exactly one argument \(0 given\)"):
        evict.evict_batch()
    evict.admit(sched.tree_cache, batch.alloc, Mode.DECODE, WINDOW, 1, True, [])
    with pytest.raises(AttributeError, match="tree_cache"):  # as SGLang's own method would raise
        evict.evict_batch(object())
    unmade = _C.sglang.WindowEviction.__new__(_C.sglang.WindowEviction)
    with pytest.raises(TypeError, match="evict_batch: WindowEviction.__init__ was not called"):
        unmade.evict_batch(sched)
    assert_same(batch.state(), before)
    assert inspect.signature(_C.sglang.WindowEviction.evict_batch) == \
        inspect.signature(lambda self, batch, /: None)


def test_the_admission_keeps_what_it_compares_alive_and_withdraw_lets_it_go():
    import gc
    import weakref

    batch = Batch(LENGTHS)
    evict, sched, field = reader(), Scheduler(batch), Field()
    tree_cache = type("TreeCache", (), {})()
    sched.tree_cache = tree_cache
    evict.admit(tree_cache, batch.alloc, Mode.DECODE, WINDOW, 1, True, [(field, "_set_to_none", False)])
    seen = weakref.ref(tree_cache)
    del tree_cache, sched
    gc.collect()
    assert seen() is not None  # an object freed and another made at its address would pass the identity test
    evict.withdraw()
    gc.collect()
    assert seen() is None
