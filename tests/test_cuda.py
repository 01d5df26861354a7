"""The CUDA backend (device="cuda") on a GPU.

- the hot-path calls enqueue work and return without waiting for the GPU
  (``torch.cuda.set_sync_debug_mode("error")`` and ``device_waits``), and a
  ``free()`` of a page pool costs exactly one wait, on the next call that needs a count;
- one kernel per ``alloc_decode`` / ``alloc_extend`` (torch.profiler), plus at most
  one copy: the upload of the host-side lengths;
- a seeded random call sequence gives the same results and states as the CPU core;
- bad index values: ValueError at once with SWA_EXT_DEBUG=1 (state unchanged), else
  DeferredError later, until clear().

The golden-trace replays on CUDA are in test_golden.py (backend "cuda"). Every test
runs twice: on the GPU (skipped without one, or with a build without the CUDA
kernels) and with the device algorithm emulated on the CPU, which checks everything
but the sync debug mode and the profiler's kernel counts.
"""
from __future__ import annotations

import contextlib
import random
import sys

import pytest
import torch

import swa_ext
from cuda_support import cuda_skip_reason
from reference import evicted_after_step


# Where the allocator under test runs, set per test by the `backend` fixture: "cuda"
# (the kernels on a GPU; skipped without one), or "emulated" (the same device
# algorithm on the CPU, so that everything here but the GPU-only checks also runs
# on machines without a GPU).
DEVICE = "cuda"
KERNELS = "auto"


@pytest.fixture(autouse=True, params=["emulated", "cuda"])
def backend(request, monkeypatch):
    if request.param == "cuda":
        reason = cuda_skip_reason()
        if reason:
            pytest.skip(reason)
        monkeypatch.setattr(sys.modules[__name__], "DEVICE", "cuda")
        monkeypatch.setattr(sys.modules[__name__], "KERNELS", "auto")
    else:
        monkeypatch.setattr(sys.modules[__name__], "DEVICE", "cpu")
        monkeypatch.setattr(sys.modules[__name__], "KERNELS", "emulated")
    return request.param


def gpu_only(backend):
    if backend != "cuda":
        pytest.skip("a GPU-only check (the sync debug mode, the profiler's kernel counts)")


@contextlib.contextmanager
def sync_debug_error():
    """torch.cuda.set_sync_debug_mode("error") on a GPU; nothing to check on the CPU."""
    if DEVICE != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def T(values):
    """Host int64 tensor."""
    return torch.tensor(list(values), dtype=torch.int64)


def make_alloc(size, size_swa, page_size, device=None, kernels=None, need_sort=False):
    device = DEVICE if device is None else device
    kernels = (KERNELS if device == DEVICE else "auto") if kernels is None else kernels
    return swa_ext.SWATokenToKVPoolAllocator(size, size_swa, page_size, torch.bfloat16, device,
                                             need_sort=need_sort, kernels=kernels)


def synchronize():
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.synchronize()


def host_values(x):
    """Recorded results, tensors turned into lists (this reads the GPU: after the checks only)."""
    if isinstance(x, torch.Tensor):
        return x.cpu().tolist()
    if isinstance(x, (list, tuple)):
        return type(x)(host_values(v) for v in x)
    return x


# --------------------------------------------------------------------------- 1. sync-free calls


class ServingScript:
    """A scripted serving sequence whose every input tensor is built up front.

    Building a device tensor from a Python list copies synchronously, so the
    constructor makes them all; ``run`` then takes slots from ``req_to_token`` (on the
    allocator's device) as SGLang does: ``last_loc`` is gathered from it, and the
    returned slots are written back into it, all without reading the GPU. The host
    knows every length, so eviction results are planned with the reference rule.

    Rows 1..8: a prefill batch; then decode steps, a chunked-prefill continuation, a
    decode-side preallocation with an unmapped head (``alloc_extend_swa_tail``, row 9),
    translations, window evictions (int64 and int32 ``req_to_token``), segment frees
    (some inside a free group), counts and ``new_pages_available``.
    """

    def __init__(self, page_size, device):
        ps = self.ps = page_size
        self.device = torch.device(device)
        self.size = max(4096, 128 * ps)
        self.size_swa = self.size // 2
        self.steps = []  # functions (alloc, req_to_token) -> recorded value
        self.lens = {}  # row -> length
        self.evicted = {}  # row -> SWA-evicted length (page-aligned)
        self.max_len = 0
        self.neg = self.dev([-1])
        lens0 = [3 * ps + 5, 2 * ps, ps + 1, 7, 5 * ps, max(1, 4 * ps - 3), 2 * ps + 17, 1]
        rows = list(range(1, 9))
        self.extend(rows, lens0)
        for _ in range(6):
            self.decode(rows)
        self.counts(3, 2)
        self.extend([1, 4], [ps + 3, 2 * ps])  # chunked prefill continues two requests
        for _ in range(4):
            self.decode(rows)
        self.swa_tail(9, 3 * ps + 9, ps)  # head [0, ps) unmapped, SWA tail from ps on
        rows.append(9)
        self.translate(1)
        self.translate(9)
        self.counts(40, 1_000_000)
        self.evict(rows, window=2 * ps + 3, interval=1, prefix_sharing=False, int32=False)
        self.group_begin()
        self.finish(3, "segment")
        self.finish(5, "swa_then_full")
        self.group_end()
        self.finish(8, "segment")
        rows = [1, 2, 4, 6, 7, 9]
        for _ in range(3):
            self.decode(rows)
        self.evict(rows, window=3, interval=2, prefix_sharing=True, int32=True)
        self.translate(4)
        self.counts(1, 1)
        self.group_begin()
        self.finish(1, "swa_then_full")
        self.finish(2, "segment")
        self.group_end()
        for r in (4, 6, 7, 9):
            self.finish(r, "segment" if r % 2 else "swa_then_full")
        self.counts(0, 0)
        self.width = max(self.max_len, 1)

    def dev(self, values):
        return torch.tensor(list(values), dtype=torch.int64, device=self.device)

    def new_req_to_token(self):
        return torch.zeros((11, self.width), dtype=torch.int64, device=self.device)

    def _grow(self, row, new_len):
        self.lens[row] = new_len
        self.max_len = max(self.max_len, new_len)

    def _last_loc(self, rtt, rows, pre):
        return torch.cat([rtt[r, p - 1:p] if p > 0 else self.neg for r, p in zip(rows, pre)])

    def extend(self, rows, new_tokens):
        pre = [self.lens.get(r, 0) for r in rows]
        seq = [p + n for p, n in zip(pre, new_tokens)]
        pre_h, seq_h, pre_d, seq_d = T(pre), T(seq), self.dev(pre), self.dev(seq)
        ext = sum(new_tokens)

        def step(alloc, rtt):
            out = alloc.alloc_extend(pre_d, pre_h, seq_d, seq_h, self._last_loc(rtt, rows, pre), ext)
            assert out is not None, "alloc_extend refused"
            offset = 0
            for r, p, s in zip(rows, pre, seq):
                rtt[r, p:s].copy_(out[offset:offset + s - p])
                offset += s - p
            return out

        self.steps.append(step)
        for r, s in zip(rows, seq):
            self._grow(r, s)
            self.evicted.setdefault(r, 0)

    def decode(self, rows):
        lens = [self.lens[r] for r in rows]
        seq_h, seq_d = T(n + 1 for n in lens), self.dev(n + 1 for n in lens)

        def step(alloc, rtt):
            out = alloc.alloc_decode(seq_d, seq_h, self._last_loc(rtt, rows, lens))
            assert out is not None, "alloc_decode refused"
            for j, (r, n) in enumerate(zip(rows, lens)):
                rtt[r, n:n + 1].copy_(out[j:j + 1])
            return out

        self.steps.append(step)
        for r, n in zip(rows, lens):
            self._grow(r, n + 1)

    def swa_tail(self, row, ext, head):
        zero_h, ext_h, zero_d, ext_d = T([0]), T([ext]), self.dev([0]), self.dev([ext])

        def step(alloc, rtt):
            out = alloc.alloc_extend_swa_tail(zero_d, zero_h, ext_d, ext_h, self.neg, ext, ext - head)
            assert out is not None, "alloc_extend_swa_tail refused"
            rtt[row, :ext].copy_(out)
            return out

        self.steps.append(step)
        self._grow(row, ext)
        self.evicted[row] = head

    def translate(self, row):
        n = self.lens[row]
        self.steps.append(lambda alloc, rtt: alloc.translate_loc_from_full_to_swa(rtt[row, :n]))

    def counts(self, full_pages, swa_pages):
        self.steps.append(lambda alloc, rtt: (
            alloc.available_size(), alloc.full_available_size(), alloc.swa_available_size(),
            alloc.new_pages_available(full_pages, swa_pages)))

    def evict(self, rows, window, interval, prefix_sharing, int32):
        pre = [self.lens[r] for r in rows]
        old = [self.evicted[r] for r in rows]
        new = [evicted_after_step(e, p, window, self.ps, interval, prefix_sharing) for e, p in zip(old, pre)]
        assert new != old, "the script should evict something here"
        rows_h, pre_h, old_h = T(rows), T(pre), T(old)

        def step(alloc, rtt):
            table = rtt.to(torch.int32) if int32 else rtt
            got = alloc.evict_out_of_window(table, rows_h, pre_h, old_h, window, interval, prefix_sharing)
            assert got.device.type == "cpu"
            assert got.tolist() == new, f"evict_out_of_window: {got.tolist()} != planned {new}"
            return got

        self.steps.append(step)
        for r, e in zip(rows, new):
            self.evicted[r] = e

    def finish(self, row, variant):
        n, ev = self.lens.pop(row), self.evicted.pop(row)

        def step(alloc, rtt):
            if variant == "segment":
                if ev > 0:
                    alloc.free_full_segment(rtt[row, :ev], start_pos=0)
                alloc.free_segment(rtt[row, ev:n], start_pos=ev)
            else:
                alloc.free_swa_segment(rtt[row, ev:n], start_pos=ev)
                alloc.free_full_segment(rtt[row, :n], start_pos=0)

        self.steps.append(step)

    def group_begin(self):
        self.steps.append(lambda alloc, rtt: alloc.free_group_begin())

    def group_end(self):
        self.steps.append(lambda alloc, rtt: alloc.free_group_end())

    def make_alloc(self, device=None, kernels=None):
        return make_alloc(self.size, self.size_swa, self.ps, device, kernels)

    def run(self, alloc, req_to_token):
        return [step(alloc, req_to_token) for step in self.steps]


@pytest.mark.parametrize("page_size", [1, 64])
def test_sync_free_calls(page_size, monkeypatch):
    monkeypatch.delenv("SWA_EXT_DEBUG", raising=False)
    script = ServingScript(page_size, DEVICE)  # every input tensor, before the checked block
    alloc = script.make_alloc()
    rtt = script.new_req_to_token()
    alloc.available_size()  # no count read-back pending
    synchronize()
    waits = alloc.device_waits
    with sync_debug_error():
        got = script.run(alloc, rtt)
    assert alloc.device_waits == waits, f"the hot-path calls waited {alloc.device_waits - waits} times for the GPU"
    alloc.check_device_errors()

    # The same script on the CPU core: same results, same state.
    cpu_script = ServingScript(page_size, "cpu")
    cpu = cpu_script.make_alloc("cpu", "auto")
    cpu_rtt = cpu_script.new_req_to_token()
    want = cpu_script.run(cpu, cpu_rtt)
    assert host_values(got) == host_values(want)
    assert rtt.cpu().tolist() == cpu_rtt.tolist()
    assert alloc.backup_state() == cpu.backup_state()
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (alloc.size_full, alloc.size_swa)
    alloc.check_invariants()


def test_free_waits_once_on_next_count(monkeypatch):
    """free() of a page pool: its page count is read back once, by the next call needing it."""
    monkeypatch.delenv("SWA_EXT_DEBUG", raising=False)
    ps = 64
    alloc = make_alloc(64 * ps, 32 * ps, ps)
    seq = [3 * ps + 5, ps - 1]
    seq_h, zero_h = T(seq), T([0, 0])
    seq_d, zero_d = seq_h.to(DEVICE), zero_h.to(DEVICE)
    last = T([-1, -1]).to(DEVICE)
    rows = alloc.alloc_extend(zero_d, zero_h, seq_d, seq_h, last, sum(seq))
    assert rows is not None
    first = rows[: seq[0]]
    assert alloc.available_size() == min(64 - 5, 32 - 5) * ps
    synchronize()
    waits = alloc.device_waits

    alloc.free(first)
    assert alloc.device_waits == waits, "free() itself waited"
    assert alloc.available_size() == min(64 - 1, 32 - 1) * ps
    assert alloc.device_waits == waits + 1, "the count after free() was not read back exactly once"
    assert alloc.available_size() == min(64 - 1, 32 - 1) * ps
    assert alloc.full_available_size() == 63 * ps
    assert alloc.swa_available_size() == 31 * ps
    assert alloc.new_pages_available(63, 31) and not alloc.new_pages_available(64, 31)
    assert alloc.device_waits == waits + 1, "a count was read back again"
    alloc.check_invariants()


# --------------------------------------------------------------------------- 2. kernels per call


def _device_activity(events):
    """(kernel names, memcpy/memset names) among the profiler's device events."""
    kernels, copies = [], []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        name = e.name or e.key
        if name.lower().startswith(("memcpy", "memset")):
            copies.append(name)
        else:
            kernels.append(name)
    return kernels, copies


def _profile(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    kernels, copies = _device_activity(prof.events())
    return result, kernels, copies


@pytest.mark.parametrize("page_size", [1, 64])
def test_kernel_counts_with_profiler(page_size, backend, monkeypatch):
    gpu_only(backend)
    monkeypatch.delenv("SWA_EXT_DEBUG", raising=False)
    ps = page_size
    _, sanity, _ = _profile(lambda: torch.ones(8, device="cuda") * 2)
    if not sanity:
        pytest.skip("torch.profiler records no CUDA kernels on this machine (CUPTI unavailable?)")

    alloc = make_alloc(max(4096, 128 * ps), max(2048, 64 * ps), ps, need_sort=False)
    dev = torch.device("cuda")
    seq = [2 * ps + 3, ps + 1, 5]

    def extend_args(pre, seq, last):
        ph, sh = T(pre), T(seq)
        return ph.to(dev), ph, sh.to(dev), sh, T(last).to(dev), sum(s - p for p, s in zip(pre, seq))

    # Warm up: the caching allocators (device and pinned host) and the kernels' first launch.
    warm = alloc.alloc_extend(*extend_args([0, 0, 0], seq, [-1, -1, -1]))
    assert warm is not None
    ends = [sum(seq[: j + 1]) - 1 for j in range(len(seq))]
    last = torch.cat([warm[e:e + 1] for e in ends])
    dec = alloc.alloc_decode(T(s + 1 for s in seq).to(dev), T(s + 1 for s in seq), last)
    assert dec is not None
    alloc.available_size()

    # The profiled calls: every input ready beforehand.
    seq2 = [s + 1 for s in seq]
    dec_args = (T(s + 1 for s in seq2).to(dev), T(s + 1 for s in seq2), dec.clone())
    new_seq = [3 * ps + 7, 1]
    ext_args = extend_args([0, 0], new_seq, [-1, -1])
    synchronize()
    waits = alloc.device_waits

    out, dec_kernels, dec_copies = _profile(lambda: alloc.alloc_decode(*dec_args))
    assert out is not None and out.numel() == len(seq)
    out, ext_kernels, ext_copies = _profile(lambda: alloc.alloc_extend(*ext_args))
    assert out is not None and out.numel() == sum(new_seq)
    print(f"\npage_size {ps}: alloc_decode {len(dec_kernels)} kernel(s) {dec_kernels}, "
          f"{len(dec_copies)} copy(ies) {dec_copies}")
    print(f"page_size {ps}: alloc_extend {len(ext_kernels)} kernel(s) {ext_kernels}, "
          f"{len(ext_copies)} copy(ies) {ext_copies}")
    assert len(dec_kernels) == 1, f"alloc_decode launched {dec_kernels}"
    assert len(ext_kernels) == 1, f"alloc_extend launched {ext_kernels}"
    assert len(dec_copies) <= 1, f"alloc_decode copies: {dec_copies}"
    assert len(ext_copies) <= 1, f"alloc_extend copies: {ext_copies}"
    assert alloc.device_waits == waits
    alloc.check_invariants()


# --------------------------------------------------------------------------- 3. CUDA against the CPU core


class Req:
    """A live request: its full slots by position; positions below ``evicted`` have no SWA slot."""

    def __init__(self, row, evicted=0):
        self.row = list(row)
        self.evicted = evicted


class Differential:
    """The same seeded random calls on the CPU core and on the allocator under test.

    Keeps a model of live requests (their full slots, their page-aligned SWA-evicted
    length) so that every call is valid; a refusal (None) must happen on both sides.
    """

    OPS = ["prefill", "decode", "swa_tail", "alloc", "finish", "group", "evict", "swa_evict", "translate",
           "new_pages"]

    def __init__(self, page_size, need_sort, seed, device=None, kernels=None):
        ps = self.ps = page_size
        size = 48 * ps + (3 if ps > 1 else 0)  # sizes need not be page multiples
        size_swa = 32 * ps
        self.cpu = make_alloc(size, size_swa, ps, "cpu", "auto", need_sort)
        self.dut = make_alloc(size, size_swa, ps, device, kernels, need_sort)
        self.dev = self.dut.device
        self.rng = random.Random(seed)
        self.reqs: dict[int, Req] = {}
        self.next_id = 0
        self.history: list[str] = []

    # ---------------------------------------------------------------- plumbing

    def fail(self, message):
        raise AssertionError(f"{message}\nlast calls:\n  " + "\n  ".join(self.history[-12:]))

    def both(self, name, cpu_args, dut_args, **kwargs):
        shown = tuple(a.tolist() if isinstance(a, torch.Tensor) else a for a in cpu_args)
        self.history.append(f"{name}{shown} {kwargs}")
        results = []
        for alloc, args in ((self.cpu, cpu_args), (self.dut, dut_args)):
            try:
                out = getattr(alloc, name)(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - report which side and which call
                self.fail(f"{name} raised on {alloc.kernels}: {type(e).__name__}: {e}")
            if isinstance(out, torch.Tensor):
                if out.dtype != torch.int64:
                    self.fail(f"{name} on {alloc.kernels} returned {out.dtype}")
                out = out.cpu().tolist()
            results.append(out)
        if results[0] != results[1]:
            self.fail(f"{name}: cpu {results[0]} != {self.dut.kernels} {results[1]}")
        return results[0]

    def idx(self, values):
        """An index argument for both: (cpu tensor, tensor on the device under test)."""
        t = T(values)
        return t, t.to(self.dev)

    def call_indices(self, name, values, **kwargs):
        c, d = self.idx(values)
        return self.both(name, (c,), (d,), **kwargs)

    def extend(self, name, pre, seq, last, ext, *extra):
        pre_c, seq_c, last_c = T(pre), T(seq), T(last)
        cpu_args = (pre_c, pre_c, seq_c, seq_c, last_c, ext, *extra)
        dut_args = (pre_c.to(self.dev), pre_c, seq_c.to(self.dev), seq_c, last_c.to(self.dev), ext, *extra)
        return self.both(name, cpu_args, dut_args)

    def live(self):
        return sorted(self.reqs)

    def new_req(self, row, evicted=0):
        self.reqs[self.next_id] = Req(row, evicted)
        self.next_id += 1

    # ---------------------------------------------------------------- ops

    def op_prefill(self):
        rng, ps = self.rng, self.ps
        entries, used = [], set()
        for _ in range(rng.randint(1, 4)):
            choices = [r for r in self.live() if r not in used]
            rid = rng.choice(choices) if choices and rng.random() < 0.5 else None
            used.add(rid)
            entries.append((rid, rng.randint(0, 2 * ps + 1) if rid is not None else rng.randint(0, 3 * ps + 2)))
        rows = [self.reqs[r].row if r is not None else [] for r, _ in entries]
        pre = [len(row) for row in rows]
        seq = [p + n for p, (_, n) in zip(pre, entries)]
        last = [row[-1] if row else -1 for row in rows]
        out = self.extend("alloc_extend", pre, seq, last, sum(n for _, n in entries))
        if out is None:
            return
        offset = 0
        for rid, n in entries:
            if rid is None:
                self.new_req(out[offset:offset + n])
            else:
                self.reqs[rid].row.extend(out[offset:offset + n])
            offset += n

    def op_decode(self):
        live = [r for r in self.live() if self.reqs[r].row]
        if not live:
            return
        rids = self.rng.sample(live, self.rng.randint(1, min(6, len(live))))
        seq = [len(self.reqs[r].row) + 1 for r in rids]
        seq_c, (last_c, last_d) = T(seq), self.idx(self.reqs[r].row[-1] for r in rids)
        out = self.both("alloc_decode", (seq_c, seq_c, last_c), (seq_c.to(self.dev), seq_c, last_d))
        if out is not None:
            for r, slot in zip(rids, out):
                self.reqs[r].row.append(slot)

    def op_swa_tail(self):
        """Decode-side preallocation of a new request: full KV for all, SWA KV for a tail
        starting on a page boundary (the head before it has no SWA slots)."""
        ps = self.ps
        ext = self.rng.randint(1, 4 * ps + 3)
        head = ps * self.rng.randint(0, ext // ps)
        out = self.extend("alloc_extend_swa_tail", [0], [ext], [-1], ext, ext - head)
        if out is not None:
            self.new_req(out, evicted=head)

    def op_alloc(self):
        n = self.rng.randint(0, 4) * self.ps
        out = self.both("alloc", (n,), (n,))
        if out is not None:
            self.new_req(out)

    def finish(self, rid):
        """Frees a live request with one of the free variants."""
        q = self.reqs.pop(rid)
        row, ev = q.row, q.evicted
        variants = ["split", "split_segment", "swa_then_full_segment"]
        if not (self.ps == 1 and ev > 0):  # page size 1: free() frees each slot's SWA slot, which must exist
            variants += ["free", "free_swa_then_full"]
        variant = self.rng.choice(variants)
        if variant == "free":
            self.call_indices("free", row)
        elif variant == "split":
            self.call_indices("free_full", row[:ev])
            self.call_indices("free", row[ev:])
        elif variant == "split_segment":
            self.call_indices("free_full_segment", row[:ev], start_pos=0)
            self.call_indices("free_segment", row[ev:], start_pos=ev)
        elif variant == "swa_then_full_segment":
            self.call_indices("free_swa_segment", row[ev:], start_pos=ev)
            self.call_indices("free_full_segment", row, start_pos=0)
        else:
            self.call_indices("free_swa", row)
            self.call_indices("free_full", row)

    def op_finish(self):
        if self.reqs:
            self.finish(self.rng.choice(self.live()))

    def op_group(self):
        """A free group around several frees (and sometimes a decode in the middle)."""
        self.both("free_group_begin", (), ())
        for _ in range(self.rng.randint(1, 3)):
            if self.reqs:
                self.finish(self.rng.choice(self.live()))
            if self.rng.random() < 0.3:
                self.op_decode()
        self.both("free_group_end", (), ())

    def op_evict(self):
        live = self.live()
        if not live:
            return
        rng, ps = self.rng, self.ps
        rids = rng.sample(live, rng.randint(1, min(4, len(live))))
        window, interval, prefix_sharing = rng.randint(1, 2 * ps + 4), rng.randint(1, 4), rng.random() < 0.5
        width = max(1, max(len(self.reqs[r].row) for r in rids))
        table = torch.zeros((len(rids) + 1, width), dtype=rng.choice([torch.int32, torch.int64]))
        pre, old = [], []
        for j, r in enumerate(rids):
            q = self.reqs[r]
            table[j + 1, : len(q.row)] = T(q.row)
            pre.append(max(q.evicted, len(q.row) - rng.randint(0, 1)))
            old.append(q.evicted)
        rows_c, pre_c, old_c = T(range(1, len(rids) + 1)), T(pre), T(old)
        new = self.both("evict_out_of_window", (table, rows_c, pre_c, old_c, window, interval, prefix_sharing),
                        (table.to(self.dev), rows_c, pre_c, old_c, window, interval, prefix_sharing))
        want = [evicted_after_step(e, p, window, ps, interval, prefix_sharing) for e, p in zip(old, pre)]
        if new != want:
            self.fail(f"evict_out_of_window returned {new}, the rule says {want}")
        for r, e in zip(rids, new):
            self.reqs[r].evicted = e

    def op_swa_evict(self):
        """free_swa_segment of a request's oldest mapped whole pages."""
        ps = self.ps
        cands = [r for r in self.live() if len(self.reqs[r].row) // ps * ps > self.reqs[r].evicted]
        if not cands:
            return
        q = self.reqs[self.rng.choice(cands)]
        new = ps * self.rng.randint(q.evicted // ps + 1, len(q.row) // ps)
        self.call_indices("free_swa_segment", q.row[q.evicted:new], start_pos=q.evicted)
        q.evicted = new

    def op_translate(self):
        tokens = [t for q in self.reqs.values() for t in q.row]
        picks = [self.rng.choice(tokens) if tokens and self.rng.random() < 0.9 else -1
                 for _ in range(self.rng.randint(0, 8))]
        self.call_indices("translate_loc_from_full_to_swa", picks)

    def op_new_pages(self):
        full, swa = self.rng.randint(-1, 50), self.rng.randint(-1, 34)
        self.both("new_pages_available", (full, swa), (full, swa))

    # ---------------------------------------------------------------- driver

    def check_sizes(self, step):
        sizes = [(a.available_size(), a.full_available_size(), a.swa_available_size()) for a in (self.cpu, self.dut)]
        if sizes[0] != sizes[1]:
            self.fail(f"step {step}: sizes (available, full, swa): cpu {sizes[0]} != {self.dut.kernels} {sizes[1]}")

    def check_states(self, step):
        if self.cpu.backup_state() != self.dut.backup_state():
            self.fail(f"step {step}: backup_state() differs")
        if self.cpu.full_to_swa_index_mapping.tolist() != self.dut.full_to_swa_index_mapping.cpu().tolist():
            self.fail(f"step {step}: full_to_swa_index_mapping differs")

    def run(self, steps):
        weights = {op: 1 for op in self.OPS}
        weights.update(prefill=3, decode=4, finish=3, evict=2)
        counts = dict.fromkeys(self.OPS, 0)
        for step in range(1, steps + 1):
            w = dict(weights, finish=6 if len(self.reqs) > 10 else 3)
            op = self.rng.choices(list(w), weights=list(w.values()))[0]
            counts[op] += 1
            getattr(self, "op_" + op)()
            self.check_sizes(step)
            if step % 25 == 0:
                self.check_states(step)
        self.check_states(steps)
        self.cpu.check_invariants()
        self.dut.check_invariants()
        self.dut.check_device_errors()
        return counts


@pytest.mark.parametrize("need_sort", [False, True], ids=["unsorted", "need_sort"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_cuda_matches_cpu_differential(page_size, need_sort, monkeypatch):
    monkeypatch.delenv("SWA_EXT_DEBUG", raising=False)
    seed = 1000 * page_size + need_sort
    counts = Differential(page_size, need_sort, seed, DEVICE, KERNELS).run(300)
    assert all(counts[op] > 0 for op in ("prefill", "decode", "finish", "group", "evict")), counts


# --------------------------------------------------------------------------- 4./5. bad input


def _request(alloc, n):
    """A new request of n tokens (alloc_extend); its full slots on the device."""
    seq_h, zero_h = T([n]), T([0])
    dev = alloc.device
    out = alloc.alloc_extend(zero_h.to(dev), zero_h, seq_h.to(dev), seq_h, T([-1]).to(dev), n)
    assert out is not None
    return out


@pytest.mark.parametrize("page_size", [1, 64])
def test_bad_input_on_cuda_debug(page_size, monkeypatch):
    """SWA_EXT_DEBUG=1: a bad index value raises ValueError at once and changes nothing."""
    monkeypatch.setenv("SWA_EXT_DEBUG", "1")
    ps = page_size
    alloc = make_alloc(32 * ps, 16 * ps, ps)
    dev = alloc.device
    keep = _request(alloc, 3 * ps + 1)
    evicted = _request(alloc, 2 * ps + 3)
    alloc.free_swa_segment(evicted[:ps], start_pos=0)  # its first page has no SWA slots now
    gone = _request(alloc, 2 * ps)
    alloc.free(gone)  # freed; nothing allocates after it, so its pages stay free

    def expect_value_error(call, match):
        before = alloc.backup_state()
        with pytest.raises(ValueError, match=match):
            call()
        assert alloc.backup_state() == before, "the bad call changed the state"
        alloc.check_device_errors()  # nothing deferred: the allocator stays usable
        alloc.check_invariants()

    expect_value_error(lambda: alloc.free(T([0]).to(dev)), "indices")  # a slot of padding page 0
    expect_value_error(lambda: alloc.free(torch.arange(ps, dtype=torch.int64, device=dev)), "indices")
    expect_value_error(lambda: alloc.free(gone), "double free|already free")
    expect_value_error(lambda: alloc.free_segment(gone, start_pos=0), "double free|already free")
    expect_value_error(lambda: alloc.free_swa_segment(evicted[:ps], start_pos=0), "no SWA slot")

    # Still serving: the live requests free cleanly and everything is back.
    alloc.free(keep)
    alloc.free_full_segment(evicted[:ps], start_pos=0)
    alloc.free_segment(evicted[ps:], start_pos=ps)
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (alloc.size_full, alloc.size_swa)
    alloc.check_invariants()


@pytest.mark.parametrize("page_size", [1, 64])
def test_deferred_error_on_cuda(page_size, monkeypatch):
    """Without SWA_EXT_DEBUG a bad index value is found later: DeferredError until clear()."""
    monkeypatch.delenv("SWA_EXT_DEBUG", raising=False)
    ps = page_size
    alloc = make_alloc(32 * ps, 16 * ps, ps)
    row = _request(alloc, 2 * ps + 1)
    alloc.free_segment(row, start_pos=0)
    alloc.free_segment(row, start_pos=0)  # double free: enqueued, found on the device
    with pytest.raises(swa_ext.DeferredError, match="already free"):
        alloc.check_device_errors()
    with pytest.raises(swa_ext.DeferredError):
        alloc.alloc(ps)
    with pytest.raises(swa_ext.DeferredError):
        alloc.check_device_errors()
    alloc.clear()
    alloc.check_device_errors()
    out = alloc.alloc(ps)
    assert isinstance(out, torch.Tensor) and out.numel() == ps and out.device == alloc.device
    assert out.cpu().tolist() == list(range(ps, 2 * ps))
    alloc.check_invariants()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("bad", ["double free", "out of the pool"])
def test_a_lone_pool_raises_its_deferred_error_before_handing_out_its_state(page_size, bad, monkeypatch):
    """The pool allocators' backup_state(), check_invariants() and free_pages read the
    device state after a refused free: they raise DeferredError, as the hybrid's do,
    instead of handing out (or letting a caller save) what the refused call left."""
    monkeypatch.delenv("SWA_EXT_DEBUG", raising=False)
    ps = page_size
    if ps == 1:
        alloc = swa_ext.TokenToKVPoolAllocator(64, torch.bfloat16, DEVICE, kernels=KERNELS)
    else:
        alloc = swa_ext.PagedTokenToKVPoolAllocator(64, ps, torch.bfloat16, DEVICE, kernels=KERNELS)
    held = alloc.alloc(2 * ps)
    before = alloc.backup_state()
    slot = int(held[0]) if bad == "double free" else 10**6
    if bad == "double free":
        alloc.free_segment(held[:ps], start_pos=0)
        before = alloc.backup_state()
    alloc.free_segment(torch.tensor([slot], device=DEVICE).repeat(ps), start_pos=0)
    for read in (alloc.backup_state, alloc.check_invariants, lambda: alloc.free_pages):
        with pytest.raises(swa_ext.DeferredError):
            read()
    alloc.restore_state(before)
    assert alloc.backup_state() == before
    alloc.check_invariants()


def test_host_side_refusal_launches_nothing(monkeypatch):
    """A host-side check that fails after another passed: nothing was launched, nothing changed."""
    monkeypatch.delenv("SWA_EXT_DEBUG", raising=False)
    alloc = make_alloc(64, 8, 1)  # page size 1: the SWA pool holds 8 pages
    row = _request(alloc, 8)
    before = alloc.backup_state()
    # 9 slots: fine for the full pool's count check, too many pages for the SWA pool's.
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free(torch.cat([row, row[:1]]))
    assert alloc.backup_state() == before
    alloc.free(row)
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (64, 8)


def test_pool_restore_keeps_the_other_pools_pending_count(monkeypatch):
    """free() leaves a count read-back pending for both pools; restoring one pool must not lose the other's."""
    monkeypatch.delenv("SWA_EXT_DEBUG", raising=False)
    ps = 16
    alloc = make_alloc(32 * ps, 16 * ps, ps)
    row = _request(alloc, 3 * ps + 2)
    alloc.free(row)  # page pool: the freed page count is known on the device only
    swa_pool = alloc.swa_attn_allocator
    swa_pool.restore_state(swa_pool.backup_state())
    assert alloc.full_available_size() == 32 * ps
    assert alloc.swa_available_size() == 16 * ps
    alloc.check_invariants()


@pytest.mark.parametrize("page_size", [1, 16])
def test_device_errors_read_as_the_cpu_errors(page_size, monkeypatch):
    """SWA_EXT_DEBUG=1: a bad call's message is the CPU core's, followed by the call's name."""
    monkeypatch.setenv("SWA_EXT_DEBUG", "1")
    ps = page_size
    cpu = make_alloc(32 * ps, 16 * ps, ps, "cpu", "auto")
    dev = make_alloc(32 * ps, 16 * ps, ps)
    rows = [_request(a, 2 * ps + 1) for a in (cpu, dev)]
    for a, row in zip((cpu, dev), rows):
        a.free_swa_segment(row[:ps], start_pos=0)
        a.free_segment(row[ps:2 * ps], start_pos=ps)
    row_h = rows[0].tolist()
    seq_h = T([2 * ps + 2])
    bad_calls = {
        "alloc_decode": lambda a: a.alloc_decode(seq_h.to(a.device), seq_h, T([row_h[-1] + (2 if ps > 1 else 0) + ps]).to(a.device)),
        "alloc_extend": lambda a: a.alloc_extend(T([0]).to(a.device), T([0]), T([1]).to(a.device), T([1]), T([ps]).to(a.device), 1),
        "free_segment": lambda a: a.free_segment(T(row_h[ps:2 * ps]).to(a.device), start_pos=ps),
        "free_swa_segment": lambda a: a.free_swa_segment(T(row_h[:ps]).to(a.device), start_pos=0),
        "translate_loc_from_full_to_swa": lambda a: a.translate_loc_from_full_to_swa(T([10 ** 6]).to(a.device)),
    }
    for name, call in bad_calls.items():
        with pytest.raises(ValueError) as cpu_error:
            call(cpu)
        with pytest.raises(ValueError) as dev_error:
            call(dev)
        assert str(dev_error.value) == f"{cpu_error.value} [in {name}]", name
