"""A caller's misuse with the debug checks off, as production runs: repeated frees.

The host store (``kernels="cpu"``) refuses a free of a page that is not held before it
changes anything. A device store (``"emulated"``: its kernels run on the CPU; ``"cuda"``)
finds such a free in its ops and raises DeferredError when the host next waits for the
device; until then it must go on keeping the contract: never hand out a slot another
allocation holds, never read or write outside its buffers (the sanitizer run,
scripts/run-sanitized.sh, makes such an access fail loudly here).

The walks run every allocator class (the hybrid one, the page and token pools, and a
hybrid allocator's pool views) with the device store and the host store side by side on
the same calls: good ones (allocations, decode steps, frees of every kind, window
eviction, free groups, merges) and repeats of earlier frees whose pages nobody holds
again (``free``, ``free_segment``, ``free_swa_segment``, ``free_full_segment``,
``free_page_ids``, and ``swa_ext.decode.evict_out_of_window`` of released rows). The host
store decides which calls are bad. Every slot handed out is checked against the slots
live requests hold, and after each burst of calls both stores' states must agree, pass
``check_invariants()`` and match the live requests' page counts; a DeferredError there
(expected exactly when the device store took a call the host store refused) restores the
last good state of both.

Budget: ``WALK_BURSTS`` bursts per walk by default (CI), ``SLOW_WALK_BURSTS`` with ``--slow``.
"""

from __future__ import annotations

import copy
import random
import re

import pytest
import torch

import swa_ext
from swa_ext import decode
from cuda_support import cuda_skip_reason
from swa_ext_bench.deferred_error_latency import calls_to_raise

WALK_BURSTS = 40
SLOW_WALK_BURSTS = 600
WINDOW_PAGES = 2  # the sliding window, in pages


def T(values, device="cpu"):
    return torch.tensor(list(values), dtype=torch.int64, device=device)


def _device_for(kernels):
    return "cuda" if kernels == "cuda" else "cpu"


def _skip_without_gpu(kernels):
    if kernels == "cuda" and cuda_skip_reason():
        pytest.skip(cuda_skip_reason())


@pytest.fixture(autouse=True)
def debug_off(monkeypatch):
    monkeypatch.delenv("SWA_EXT_DEBUG", raising=False)


# ---------------------------------------------------------------- the cases


POOL_KINDS = [(kind, ps, need_sort) for kind in ("paged", "hybrid") for ps in (1, 4, 16) for need_sort in (False, True)]
# Emulated, every launch has run when the host goes on: the call after a bad one raises.
# On a GPU the bound is how far the host runs ahead of the device (docs/cuda.md); this
# test allows that many calls, and the device check measures them.
CALLS_TO_RAISE = {"emulated": 2, "cuda": 8}


@pytest.mark.parametrize("kernels", ["emulated", "cuda"])
@pytest.mark.parametrize("kind,page_size,need_sort", POOL_KINDS,
                         ids=[f"{k}-ps{p}-{'sort' if s else 'nosort'}" for k, p, s in POOL_KINDS])
def test_a_double_free_raises_within_two_calls_with_at_most_one_padding_slot(kind, page_size, need_sort, kernels):
    """Four live allocations, alloc(2 * ps), free it, free it again, then up to 200 calls
    alternating alloc(ps) and a free of a live allocation: DeferredError, naming the bad
    free, within two calls, and no allocation before it hands out the padding slot more
    than once (at page size 1 nothing waits for the device, so only the error record's
    watch can tell)."""
    _skip_without_gpu(kernels)
    calls, message, padding, _ = calls_to_raise(kind, page_size, kernels, need_sort=need_sort)
    assert calls is not None, f"no DeferredError in 200 calls after a double free ({padding} padding slots handed out)"
    assert "[in free]" in message, message
    assert calls <= CALLS_TO_RAISE[kernels], f"DeferredError only at call {calls} after the double free"
    assert padding <= 1, f"{padding} padding slots handed out before the DeferredError"


@pytest.mark.parametrize("kernels", ["emulated", "cuda"])
def test_several_bad_entries_of_one_free_name_the_cpu_stores_entry(kernels):
    """The lowest bad entry is the one reported, whatever order the device ran them in."""
    _skip_without_gpu(kernels)
    messages = []
    for k in ("cpu", kernels):
        pool = swa_ext.TokenToKVPoolAllocator(16, torch.bfloat16, _device_for(k), kernels=k)
        held = pool.alloc(8).tolist()
        pool.free(T(held[2:4], _device_for(k)))  # two slots free again
        bad = T([held[0], held[2], 999, held[3], 1000], _device_for(k))
        try:
            pool.free(bad)
            pool.alloc(1)
            pytest.fail(f"{k}: a free of free slots raised nothing")
        except (ValueError, swa_ext.DeferredError) as e:
            messages.append(str(e))
    cpu_message, device_message = messages
    assert device_message.startswith(cpu_message), (cpu_message, device_message)


def _until_deferred(calls, match):
    """Runs calls (after a bad one) until one raises DeferredError matching `match`; returns
    what those before it returned. It must come within CALLS_TO_RAISE calls."""
    results = []
    for n, call in enumerate(calls, start=1):
        try:
            results.append(call())
        except swa_ext.DeferredError as e:
            assert re.search(match, str(e)), str(e)
            return n, results
    pytest.fail(f"no DeferredError in {len(calls)} calls after the bad one")


@pytest.mark.parametrize("kernels", ["emulated", "cuda"])
def test_a_token_pool_freed_twice_hands_out_no_held_slot(kernels):
    _skip_without_gpu(kernels)
    dev = _device_for(kernels)
    pool = swa_ext.PagedTokenToKVPoolAllocator(8, 1, torch.bfloat16, dev, kernels=kernels)
    x = pool.alloc(2)
    pool.free(x)
    pool.free(x)  # the host store raises here; the device store finds it in its ops
    n, outs = _until_deferred([lambda: pool.alloc(8), lambda: pool.alloc(2), pool.check_invariants], "already free")
    assert n <= CALLS_TO_RAISE[kernels]
    # Until then (a GPU behind the host) no slot is handed out twice but the padding slot.
    handed = [s for out in outs if out is not None for s in out.tolist() if s != 0]
    assert len(set(handed)) == len(handed), f"slots handed out twice: {sorted(handed)}"


@pytest.mark.parametrize("kernels", ["emulated", "cuda"])
def test_a_page_freed_four_times_is_reported_and_handed_out_once(kernels):
    _skip_without_gpu(kernels)
    dev = _device_for(kernels)
    ps = 4
    pool = swa_ext.PagedTokenToKVPoolAllocator(4 * ps, ps, torch.bfloat16, dev, kernels=kernels)
    page = pool.alloc(ps)
    pool.free_segment(page, start_pos=0)
    pool.free_segment(page, start_pos=0)  # the bad call
    calls = [lambda: pool.free_segment(page, start_pos=0)] * 2 + [lambda: pool.alloc(ps)] * 8 + [pool.backup_state]
    n, outs = _until_deferred(calls, "already free")
    assert n <= CALLS_TO_RAISE[kernels]
    handed = [s for out in outs if isinstance(out, torch.Tensor) for s in out.tolist() if s != 0]
    assert len(set(handed)) == len(handed), f"slots handed out twice: {sorted(handed)}"


@pytest.mark.parametrize("kind", ["hybrid", "pool"])
@pytest.mark.parametrize("launches_before", [0, 1, 2])
def test_a_last_loc_on_a_page_the_same_launch_hands_out_is_refused(kind, launches_before):
    # Request 0 takes a fresh page, the head of the free list; request 1 claims to
    # continue a prefix ending in that page, which nobody holds before the call. The
    # host store refuses the batch; the device store must report it whatever order
    # its elements run in (the emulated executor changes order from launch to launch,
    # so the launches before shift which order the allocation's launch gets), and must
    # never hand out one slot twice.
    ps = 4
    args = dict(prefix_lens=T([0, 2]), prefix_lens_cpu=T([0, 2]), seq_lens=T([ps, 3]), seq_lens_cpu=T([ps, 3]),
                last_loc=T([-1, ps + 1]), extend_num_tokens=ps + 1)
    stores = {}
    for kernels in ("cpu", "emulated"):
        if kind == "hybrid":
            stores[kernels] = swa_ext.SWATokenToKVPoolAllocator(16 * ps, 16 * ps, ps, torch.bfloat16, "cpu",
                                                                kernels=kernels)
        else:
            stores[kernels] = swa_ext.PagedTokenToKVPoolAllocator(16 * ps, ps, torch.bfloat16, "cpu",
                                                                  kernels=kernels)
    with pytest.raises(ValueError, match="last_loc"):
        stores["cpu"].alloc_extend(**args)
    device = stores["emulated"]
    if kind == "hybrid":
        for _ in range(launches_before):  # one launch each, changing nothing
            device.translate_loc_from_full_to_swa(T([-1]))
    elif launches_before:
        # 4 or 5 launches (an allocation each, a claim and a release), the free list as before.
        pages = [device.alloc(ps) for _ in range(launches_before + 1)]
        device.free_page_ids(T([int(p[0]) // ps for p in pages]))
    out = device.alloc_extend(**args).tolist()
    nonzero = [s for s in out if s != 0]
    assert len(set(nonzero)) == len(nonzero), f"slots handed out twice in one call: {out}"
    with pytest.raises(swa_ext.DeferredError, match="last_loc"):
        device.check_invariants()


@pytest.mark.parametrize("kernels", ["emulated", "cuda"])
def test_a_pool_view_outlives_its_hybrid_allocator(kernels):
    # The view shares the device store's error record and count read-back with the other
    # pool, which goes with the hybrid allocator.
    _skip_without_gpu(kernels)
    dev = _device_for(kernels)
    ps = 16
    view = swa_ext.SWATokenToKVPoolAllocator(8 * ps, 4 * ps, ps, torch.bfloat16, dev, kernels=kernels).swa_attn_allocator
    slots = view.alloc(2 * ps)
    view.free(slots)  # its page count is read back from the device by the next call
    assert view.available_size() == 4 * ps
    view.check_invariants()


# ---------------------------------------------------------------- the walks


class Req:
    """A live request: its full slots by position from `base` (positions below it were
    freed), and `ev`, below which its positions have no SWA slot (hybrid only)."""

    def __init__(self, rid, slots, row, base=0, ev=0):
        self.rid, self.slots, self.row, self.base, self.ev = rid, list(slots), row, base, ev

    def live(self):
        return self.slots[self.base:]


class Model:
    """What the host store's answers say is held: the live requests, and the frees they
    made, which the walk repeats once nobody holds the pages again."""

    def __init__(self):
        self.reqs: dict[int, Req] = {}
        self.next_rid = 0
        self.frees = []  # (call, full slots it names, (rid, below) whose eviction it repeats or None)
        self.group_open = False

    def held_slots(self):
        return {s for q in self.reqs.values() for s in q.live()}


class Walk:
    """One allocator class on the host store and (unless kernels is "cpu") a device store."""

    def __init__(self, kind, page_size, need_sort, kernels, seed):
        self.kind, self.ps, self.need_sort = kind, page_size, need_sort
        self.rng = random.Random(seed)
        self.hybrid = kind in ("hybrid", "shared", "parents")
        # The shared mode (SPEC.md section 8): one list of 24 parents; "parents": parent pages
        # (section 8.1), 3 full pages (the small side, as in every served model) to a parent.
        self.shared = kind in ("shared", "parents")
        self.parent_k = 3 if kind == "parents" else 1
        self.num_pages = 24 if kind != "swa_view" else 12
        self.row_len = 8 * page_size
        self.subjects = [self._make("cpu")]
        self.device = _device_for(kernels)
        if kernels != "cpu":
            self.subjects.append(self._make(kernels))
        self.model = Model()
        self.pending_bad = False  # the device store took a call the host store refused
        self.device_held = None  # then: the slots the device store holds (see _call)
        self.calls_since_bad = 0  # then: calls made since, and padding slots they handed out
        self.padding_since_bad = 0
        self.calls_bound = CALLS_TO_RAISE.get(kernels)
        self.outcomes = {"good": 0, "refused": 0, "deferred": 0, "bad_taken": 0}
        self.checkpoint = self._save()

    # ------------------------------------------------------------ setup

    def _make(self, kernels):
        ps, dev = self.ps, _device_for(kernels)
        if self.kind in ("hybrid", "shared", "parents", "full_view", "swa_view"):
            hybrid = swa_ext.SWATokenToKVPoolAllocator(24 * ps * self.parent_k, (24 if self.shared else 12) * ps, ps,
                                                       torch.bfloat16, dev, need_sort=self.need_sort, kernels=kernels,
                                                       shared=self.shared, parent_k=self.parent_k, small_side="full")
            if self.kind == "full_view":
                return hybrid.full_attn_allocator
            if self.kind == "swa_view":
                return hybrid.swa_attn_allocator
            return hybrid
        if self.kind == "token":
            return swa_ext.TokenToKVPoolAllocator(24, torch.bfloat16, dev, need_sort=self.need_sort, kernels=kernels)
        return swa_ext.PagedTokenToKVPoolAllocator(24 * ps, ps, torch.bfloat16, dev, need_sort=self.need_sort,
                                                   kernels=kernels)

    def _save(self):
        return [s.backup_state() for s in self.subjects], copy.deepcopy(self.model)

    def _restore(self):
        states, model = self.checkpoint
        for s, state in zip(self.subjects, states):
            s.restore_state(state)
        self.model = copy.deepcopy(model)
        self.pending_bad = False

    # ------------------------------------------------------------ calling both stores

    def _call(self, fn, hands_out=False):
        """fn(store, device) on every store. Returns the host store's result, or raises
        _Refused (the host store refused) or _Deferred (the device store raised
        DeferredError; the last good state is back). hands_out: fn returns slots."""
        results = []
        if self.pending_bad:
            self.calls_since_bad += 1
        for i, s in enumerate(self.subjects):
            try:
                results.append(("ok", fn(s, "cpu" if i == 0 else self.device)))
            except (ValueError, TypeError) as e:
                results.append(("refused", e))
            except swa_ext.DeferredError as e:
                assert i > 0, "the host store raised DeferredError"
                # A call of several native calls (a free_segment, then a free_full_segment)
                # can raise in its second what its first did.
                bad_now = results[0][0] == "refused"
                assert self.pending_bad or bad_now, f"DeferredError though every call was good: {e}"
                if bad_now and not self.pending_bad:
                    self.outcomes["bad_taken"] += 1
                else:
                    self._check_reported_in_time()
                self.outcomes["deferred"] += 1
                self._restore()
                raise _Deferred() from None
        host, host_value = results[0]
        if len(results) > 1:
            dev, dev_value = results[1]
            if host == "refused" and dev == "ok":
                if not self.pending_bad:
                    # From here on the device store moves no page back (its error record
                    # holds the refusal): what it holds now stays held, with what it hands out.
                    self.device_held = self.model.held_slots()
                    self.calls_since_bad = self.padding_since_bad = 0
                self.pending_bad = True
                self.outcomes["bad_taken"] += 1
            else:
                assert dev == "ok", f"the device store refused a call the host store took: {dev_value!r}"
                if isinstance(dev_value, torch.Tensor):
                    dev_value = dev_value.cpu()
                if not self.pending_bad:
                    assert _same(host_value, dev_value), f"host store {host_value}, device store {dev_value}"
                elif hands_out and dev_value is not None:
                    self._check_handed_out(dev_value.tolist(), self.device_held, allow_padding=True)
                    self.padding_since_bad += dev_value.tolist().count(0)
        if host == "refused":
            self.outcomes["refused"] += 1
            raise _Refused()
        self.outcomes["good"] += 1
        return host_value

    def _check_reported_in_time(self):
        """A bad call surfaces within CALLS_TO_RAISE calls, handing out the padding slot at most once."""
        assert self.calls_since_bad <= self.calls_bound, f"DeferredError {self.calls_since_bad} calls after the bad call"
        assert self.padding_since_bad <= 1, f"{self.padding_since_bad} padding slots handed out before the DeferredError"

    def _check_handed_out(self, slots, held=None, allow_padding=False):
        """held: the slots the store holds (the live requests' when None), which it
        holds from now on with `slots`."""
        if held is None:
            held = self.model.held_slots()
        real = [s for s in slots if not (allow_padding and s == 0)]
        assert len(set(real)) == len(real), f"a slot handed out twice in one call: {slots}"
        taken = set(real) & held
        assert not taken, f"slots {sorted(taken)} handed out while live requests hold them"
        held |= set(real)

    # ------------------------------------------------------------ good calls

    def _new_request(self):
        ps, m = self.ps, self.model
        n = self.rng.randint(1, 3 * ps)
        rid = m.next_rid
        row = self._free_row()
        shape = self.rng.random()
        if shape < 0.3 and n % ps == 0:
            out = self._call(lambda a, d: a.alloc(n), hands_out=True)
            ev = 0
        elif self.hybrid and shape < 0.5:
            tail = decode.swa_tail_len(n, WINDOW_PAGES * ps, ps)
            out = self._call(lambda a, d: a.alloc_extend_swa_tail(T([0], d), T([0]), T([n], d), T([n]), T([-1], d), n,
                                                                   tail), hands_out=True)
            ev = n - tail
        else:
            out = self._call(lambda a, d: a.alloc_extend(T([0], d), T([0]), T([n], d), T([n]), T([-1], d), n),
                             hands_out=True)
            ev = 0
        if out is None:
            return
        slots = out.tolist()
        self._check_handed_out(slots)
        m.reqs[rid] = Req(rid, slots, row, 0, ev)
        m.next_rid += 1

    def _grow(self, decode_step):
        live = [q for q in self.model.reqs.values() if len(q.slots) < self.row_len - 2 * self.ps]
        if not live:
            return self._new_request()
        batch = self.rng.sample(live, min(len(live), self.rng.randint(1, 3)))
        grow = [1 if decode_step else self.rng.randint(1, 2 * self.ps) for _ in batch]
        pre = [len(q.slots) for q in batch]
        seq = [p + g for p, g in zip(pre, grow)]
        last = [q.slots[-1] for q in batch]
        if decode_step:
            out = self._call(lambda a, d: a.alloc_decode(T(seq, d), T(seq), T(last, d)), hands_out=True)
        else:
            out = self._call(lambda a, d: a.alloc_extend(T(pre, d), T(pre), T(seq, d), T(seq), T(last, d), sum(grow)),
                             hands_out=True)
        if out is None:
            return
        slots = out.tolist()
        self._check_handed_out(slots)
        at = 0
        for q, g in zip(batch, grow):
            q.slots += slots[at:at + g]
            at += g

    def _record(self, call, slots, eviction=None):
        self.model.frees.append((call, list(slots), eviction))
        del self.model.frees[:-40]

    def _free_whole(self):
        m, ps = self.model, self.ps
        if not m.reqs:
            return
        q = self.rng.choice(list(m.reqs.values()))
        live = q.live()
        options = ["segment"]
        if not (self.hybrid and ps == 1 and q.ev > q.base):  # at page size 1 free() frees the SWA side by slot
            options.append("free")
        if not self.hybrid:
            options.append("page_ids")
        how = self.rng.choice(options)
        if self.hybrid and how == "segment":
            # As swa_ext.decode.release: both sides from the evicted length, the full side below it.
            ev = max(q.ev, q.base)

            def call(a, d, q=q, ev=ev, slots=list(q.slots)):
                if len(slots) > ev:
                    a.free_segment(T(slots[ev:], d), start_pos=ev)
                if ev > q.base:
                    a.free_full_segment(T(slots[q.base:ev], d), start_pos=q.base)
        elif how == "segment":
            def call(a, d, base=q.base, live=live):
                a.free_segment(T(live, d), start_pos=base)
        elif how == "page_ids":
            pages = sorted({s // ps for s in live})

            def call(a, d, pages=pages):
                a.free_page_ids(T(pages, d))
        else:
            def call(a, d, live=live):
                a.free(T(live, d))
        self._call(call)
        del m.reqs[q.rid]
        self._record(call, live)

    def _free_head_pages(self):
        # The first whole pages of a request: a lone pool's chunk, or a hybrid's SWA window.
        m, ps = self.model, self.ps
        if not m.reqs:
            return
        q = self.rng.choice(list(m.reqs.values()))
        start = max(q.ev, q.base) if self.hybrid else q.base
        whole = (len(q.slots) - 1) // ps * ps - start  # keep the last, maybe partial, page
        if whole < ps:
            return
        k = self.rng.randint(1, whole // ps) * ps
        slots = q.slots[start:start + k]
        if self.hybrid and self.rng.random() < 0.5:
            self._evict(q, start + k)
            return
        if self.hybrid:
            def call(a, d, slots=slots, start=start):
                a.free_swa_segment(T(slots, d), start_pos=start)
        elif self.rng.random() < 0.5:
            pages = [s // ps for s in slots[::ps]]

            def call(a, d, pages=pages):
                a.free_page_ids(T(pages, d))
        else:
            def call(a, d, slots=slots, start=start):
                a.free_segment(T(slots, d), start_pos=start)
        self._call(call)
        if self.hybrid:
            q.ev = start + k
            self._record(call, slots, (q.rid, q.ev))
        else:
            q.base = start + k
            self._record(call, slots)

    def _table(self):
        table = torch.zeros((64, self.row_len), dtype=torch.int32)
        for q in self.model.reqs.values():
            table[q.row, :len(q.slots)] = torch.tensor(q.slots, dtype=torch.int32)
        return table

    def _evict(self, q, below):
        # The window moved past `below`: a decode step's batched eviction of this request.
        ps = self.ps
        window = WINDOW_PAGES * ps
        pre_len = below + window
        evicted = max(q.ev, q.base)
        if pre_len > self.row_len or decode.evicted_after_step(evicted, pre_len, window, ps) != below:
            return
        table = self._table()

        def call(a, d, table=table, row=q.row, pre_len=pre_len, evicted=evicted):
            return decode.evict_out_of_window(a, table.to(d), [row], [pre_len], [evicted], window)
        self._call(call)
        q.ev = below
        self._record(call, q.slots[evicted:below], (q.rid, below))

    # ------------------------------------------------------------ bad calls

    def _repeat_a_free(self):
        """An earlier free again, of pages nobody holds now (a page held again is the
        caller's to free: no store can tell that call from a good one)."""
        m, ps = self.model, self.ps
        held_pages = {s // ps for s in m.held_slots()}
        candidates = []
        for call, slots, eviction in m.frees:
            if eviction is not None:
                rid, below = eviction
                q = m.reqs.get(rid)
                if q is not None and q.ev >= below:  # still evicted there: its mapping is cleared
                    candidates.append(call)
                    continue
            if not {s // ps for s in slots} & held_pages:
                candidates.append(call)
        if not candidates:
            return False
        self._call(self.rng.choice(candidates))
        return True

    def _free_swa_slot_as_full(self):
        """The shared mode: a live SWA slot handed to a full free (a page's state says
        which kind holds it)."""
        m = self.model
        live = [q for q in m.reqs.values() if len(q.slots) > max(q.ev, q.base)]
        if not self.shared or not live:
            return False
        q = self.rng.choice(live)
        full_slot = q.slots[max(q.ev, q.base)]
        how = self.rng.choice(["free", "free_full", "full_view"])

        def call(a, d):
            swa_slot = a.translate_loc_from_full_to_swa(T([full_slot], d))
            # A full slot of the parent that holds it: of its first child page (the SWA slot itself at k 1).
            ps, k = self.ps, self.parent_k
            swa_slot = swa_slot // ps * k * ps + swa_slot % ps
            return a.full_attn_allocator.free(swa_slot) if how == "full_view" else getattr(a, how)(swa_slot)

        self._call(call)
        return True

    def _free_row(self):
        used = {q.row for q in self.model.reqs.values()}
        return next(r for r in range(64) if r not in used)

    def _evict_released_row(self):
        # A released request's row, zeroed as swa_ext.decode.release leaves it, evicted again.
        if not self.hybrid:
            return False
        row = self._free_row()
        ps = self.ps
        self._call(lambda a, d: decode.evict_out_of_window(a, self._table().to(d), [row], [4 * ps], [0], ps))
        return True

    # ------------------------------------------------------------ the walk

    def step(self):
        r = self.rng.random()
        if r < 0.2:
            if not self._repeat_a_free():
                self._new_request()
        elif r < 0.23:
            if not self._free_swa_slot_as_full():
                self._evict_released_row()
        elif r < 0.38:
            self._new_request()
        elif r < 0.5:
            self._grow(decode_step=False)
        elif r < 0.65:
            self._grow(decode_step=True)
        elif r < 0.77:
            self._free_whole()
        elif r < 0.88:
            self._free_head_pages()
        elif r < 0.94:
            self._group()
        elif not self.hybrid and self.need_sort:
            self._call(lambda a, d: a.merge_and_sort_free())
        else:
            self._new_request()

    def _group(self):
        m = self.model
        if m.group_open:
            self._call(lambda a, d: a.free_group_end())
        else:
            self._call(lambda a, d: a.free_group_begin())
        m.group_open = not m.group_open

    def burst(self):
        for _ in range(self.rng.randint(1, 5)):
            try:
                self.step()
            except _Refused:
                pass
            except _Deferred:
                return
        self.sync()

    def sync(self):
        """Waits for the device: its error, or both stores equal and matching the requests."""
        for i, s in enumerate(self.subjects):
            try:
                s.check_invariants()
            except swa_ext.DeferredError as e:
                assert i > 0 and self.pending_bad, f"DeferredError though every call was good: {e}"
                self.calls_since_bad += 1  # check_invariants() is a call too
                self._check_reported_in_time()
                self.outcomes["deferred"] += 1
                self._restore()
                return
        assert not self.pending_bad, "the device store took a call the host store refused, and raised nothing"
        states = [s.backup_state() for s in self.subjects]
        assert all(state == states[0] for state in states[1:]), "the device store's state differs from the host store's"
        if not self.model.group_open:
            self._check_counts()
        self.checkpoint = (states, copy.deepcopy(self.model))

    def _check_counts(self):
        host, ps, m = self.subjects[0], self.ps, self.model
        full_pages = {s // ps for s in m.held_slots()}
        if not self.hybrid:
            assert host.available_size() == (self.num_pages - len(full_pages)) * ps
            return
        mapping = host.full_to_swa_index_mapping
        swa_pages = set()
        for q in m.reqs.values():
            for pos in range(q.base, len(q.slots)):
                swa = int(mapping[q.slots[pos]])
                assert (swa != 0) == (pos >= q.ev), f"request {q.rid} position {pos} maps to {swa} (evicted {q.ev})"
                if swa:
                    swa_pages.add(swa // ps)
        if self.shared:  # one list of 24 parents: both counts read what neither side binds
            k = self.parent_k
            full_parents = {p // k for p in full_pages}  # a full page is a child page, k to a parent
            assert not full_parents & swa_pages, f"parents bound to both sides: {full_parents & swa_pages}"
            unbound = 24 - len(full_parents | swa_pages)
            assert host.swa_available_size() == unbound * ps
            # The full side also takes the free child pages of its partly used parents.
            assert host.full_available_size() == (unbound * k + len(full_parents) * k - len(full_pages)) * ps
            return
        assert host.full_available_size() == (24 - len(full_pages)) * ps
        assert host.swa_available_size() == (12 - len(swa_pages)) * ps


class _Refused(Exception):
    pass


class _Deferred(Exception):
    pass


def _same(a, b):
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.tolist() == b.tolist()
    return (a is None) == (b is None) and (a is None or isinstance(a, torch.Tensor) or a == b)


KINDS = [("hybrid", 1), ("hybrid", 16), ("hybrid", 64), ("paged", 1), ("paged", 16), ("paged", 64), ("token", 1),
         ("full_view", 1), ("swa_view", 16)]
WALKS = [(kind, ps, kernels) for kernels in ("cpu", "emulated", "cuda")
         for kind, ps in KINDS + [("shared", 1), ("shared", 4), ("shared", 16)]]
WALKS += [("parents", ps, "cpu") for ps in (1, 4, 16)]  # parent_k > 1: the CPU store


@pytest.mark.parametrize("need_sort", [False, True], ids=["unsorted", "need_sort"])
@pytest.mark.parametrize("kind,page_size,kernels", WALKS, ids=[f"{k}-ps{p}-{kern}" for k, p, kern in WALKS])
def test_misuse_walk(kind, page_size, need_sort, kernels, request):
    _skip_without_gpu(kernels)
    bursts = SLOW_WALK_BURSTS if request.config.getoption("--slow") else WALK_BURSTS
    walk = Walk(kind, page_size, need_sort, kernels, seed=f"{kind}/{page_size}/{need_sort}/{kernels}")
    for _ in range(bursts):
        walk.burst()
    if walk.model.group_open:
        try:
            walk._group()
        except (_Refused, _Deferred):
            pass
    walk.sync()
    o = walk.outcomes
    assert o["good"] > bursts and o["refused"] > bursts // 8, o
    if kernels != "cpu":
        assert o["bad_taken"] > 0 and o["deferred"] > 0, o


@pytest.mark.parametrize("kind,page_size", [("hybrid", 1), ("hybrid", 16), ("paged", 16), ("token", 1)])
def test_the_threaded_emulation_walks_as_the_sequential_one(kind, page_size, monkeypatch):
    """One walk with each launch's elements on 3 to 12 threads at once and with one element
    after another: the same outcomes, calls raising at the same points, the same end state."""
    ends = []
    for threads in ("0", "12"):
        monkeypatch.setenv("SWA_EXT_EMULATED_THREADS", threads)
        walk = Walk(kind, page_size, False, "emulated", seed=f"threads/{kind}/{page_size}")
        for _ in range(WALK_BURSTS):
            walk.burst()
        walk.sync()
        ends.append((dict(walk.outcomes), walk.subjects[1].backup_state()))
    assert ends[0][0] == ends[1][0]
    assert ends[0][1] == ends[1][1], "the threaded emulation's state differs from the sequential one's"
    assert ends[0][0]["deferred"] > 0, ends[0][0]
