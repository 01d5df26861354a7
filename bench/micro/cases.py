"""The measured cases: every op's call, from one allocator state, for each
implementation (native, the torch baseline, SGLang's allocator, the floor)."""

from __future__ import annotations

from functools import partial
from typing import Callable, Dict, List, Optional

import torch

import swa_ext
from swa_ext import _C, decode

from .. import sglang_ref
from ..baseline import BaselineSWAAllocator
from ..evict_baseline import evict_per_request

OPS = (
    "alloc_decode",
    "alloc_extend",
    "alloc_extend_swa_tail",
    "free_segment",
    "free",
    "evict_out_of_window",
)
DEFAULT_BATCH_SIZES = (1, 16, 256, 2048)
DEFAULT_PAGE_SIZES = (1, 16, 64)
# "shared": native in the shared mode (SPEC.md section 8), one list for both kinds; its
# full slots are native's, its SWA slots its own, so it is timed, not checked, against native.
# "parents": the shared mode on parent pages (section 8.1), PARENT_K full pages to a parent
# (the full side small, as in every served model: Llama-4-Scout, gpt-oss 3 SWA : 1 full), on
# the CPU store; its full slots are child pages, so it runs the case on its own req_to_token.
IMPLS = ("native", "shared", "parents", "baseline", "sglang", "floor")
PARENT_K = 3
REFERENCES = ("baseline", "sglang")  # checked against native before timing

WINDOW = 128  # tokens (gpt-oss's sliding window)
POOL_TOKENS_PER_REQUEST = 640
ROW_LEN = 1024  # req_to_token columns
SMOKE_MAX_BATCH = 8
SMOKE_ITERS = 3
DEFAULT_SECONDS_PER_CASE = 0.8  # adaptive iteration count: time spent per case
MIN_ITERS, MAX_ITERS = 5, 400


NOTES = {
    "alloc_decode": "1 call; B//ps requests cross a page (all at ps=1)",
    "alloc_extend": "1 call; B chunks of 1..128 tokens on unaligned prefixes",
    "alloc_extend_swa_tail": "B calls (batch-1 op), one per new request",
    "free_segment": "1 call; B page-aligned in-window runs",
    "free": "1 call; B requests' in-window tokens",
    "evict_out_of_window": "1 batched call vs per-request loop; B//ps evict a page",
}


FLOOR_IMPL = "swa_ext_bench._floor.floor"
EVICT_IMPL = "swa_ext.decode.evict_out_of_window"
SGLANG_IMPL = "sglang.srt.mem_cache.allocator.swa.SWATokenToKVPoolAllocator"


def default_devices() -> List[str]:
    devices = ["cpu"]
    if torch.cuda.is_available() and swa_ext.built_with_cuda():
        devices.append("cuda")
    return devices


def _i64(values, device="cpu"):
    return torch.tensor(values, dtype=torch.int64, device=device)


def comparable(r):
    """A call's result as plain values (tensors as lists), for comparing implementations."""
    if isinstance(r, torch.Tensor):
        return r.cpu().tolist()
    if isinstance(r, (list, tuple)):
        return [comparable(x) for x in r]
    return r


class _Case:
    """The allocators of a case in the same state, and every op's inputs.

    ``allocs``: native's, the baseline's and, with ``with_sglang``, SGLang's, by
    implementation name; ``restore[name]()`` puts that one back in the case's state.
    """

    def __init__(self, batch: int, page_size: int, device: str, with_sglang: bool = False):
        ps, B = page_size, batch
        self.batch, self.page_size, self.device = B, ps, device
        dev = torch.device(device)
        size = -(-B * POOL_TOKENS_PER_REQUEST // ps) * ps
        self.native = swa_ext.SWATokenToKVPoolAllocator(size, size, ps, torch.bfloat16, dev)
        self.allocs = {"native": self.native, "baseline": BaselineSWAAllocator(size, size, ps, torch.bfloat16, dev)}
        self.allocs["shared"] = swa_ext.SWATokenToKVPoolAllocator(size, size, ps, torch.bfloat16, dev, shared=True)
        if device == "cpu":  # parent_k > 1 runs on the CPU store
            self.allocs["parents"] = swa_ext.SWATokenToKVPoolAllocator(PARENT_K * size, size, ps, torch.bfloat16, dev,
                                                                       shared=True, parent_k=PARENT_K,
                                                                       small_side="full")
        if with_sglang:
            self.allocs["sglang"] = sglang_ref.make_allocator(size, size, ps, device)

        pre = [128 + 64 * (j % 3) + (j + 1) % ps for j in range(B)]
        self.pre = pre
        zeros = _i64([0] * B)
        pre_cpu = _i64(pre)
        last = _i64([-1] * B, dev)
        n = sum(pre)
        args = (zeros.to(dev), zeros, pre_cpu.to(dev), pre_cpu, last, n)
        outs = {name: alloc.alloc_extend(*args) for name, alloc in self.allocs.items()}
        flat = outs["native"]
        for name, out in outs.items():
            if out is None or (name != "parents" and not torch.equal(out.cpu(), flat.cpu())):
                raise RuntimeError(f"state setup: {name}'s alloc_extend diverged from native's (B={B}, ps={ps})")

        def rows_of(slots):
            r2t = torch.zeros(B, ROW_LEN, dtype=torch.int32)
            off = 0
            for j, L in enumerate(pre):
                r2t[j, :L] = slots[off : off + L].to(torch.int32)
                off += L
            return r2t.to(dev)

        self.req_to_token = rows_of(flat.cpu())
        # The req_to_token of an allocator whose full slots are its own (native's for the rest).
        self.own_rows = {"parents": rows_of(outs["parents"])} if "parents" in outs else {}
        rows = list(range(B))
        # Window eviction as of the previous decode step (pre_len - 1).
        evicted = {name: evict_per_request(alloc, self.own_rows.get(name, self.req_to_token), rows,
                                           [p - 1 for p in pre], [0] * B, WINDOW, ps)
                   for name, alloc in self.allocs.items()}
        self.evicted = evicted["native"]
        for name in self.references():
            differs = "evicted lengths" if evicted[name] != self.evicted else self.mismatch(name)
            if differs:
                raise RuntimeError(f"state setup: {name} differs from native (B={B}, ps={ps}): {differs}")
        self.restore = {
            name: partial(sglang_ref.restore_state, alloc, sglang_ref.backup_state(alloc)) if name == "sglang"
            else partial(alloc.restore_state, alloc.backup_state())
            for name, alloc in self.allocs.items()
        }

    def references(self) -> List[str]:
        """The implementations in the case that are checked against native."""
        return [name for name in REFERENCES if name in self.allocs]

    def mismatch(self, name: str, r_native=None, r_other=None) -> Optional[str]:
        """What differs between native and implementation ``name`` after the same call
        returned ``r_native`` and ``r_other``: the result, the available sizes or the
        full-to-SWA mapping (None: nothing)."""
        other = self.allocs[name]
        if comparable(r_native) != comparable(r_other):
            return "returned indices"
        a = (self.native.full_available_size(), self.native.swa_available_size())
        b = (other.full_available_size(), other.swa_available_size())
        if a != b:
            return f"available sizes (full, swa): native {a}, {name} {b}"
        if not torch.equal(self.native.full_to_swa_index_mapping.cpu(), other.full_to_swa_index_mapping.cpu()):
            return "full-to-SWA mapping"
        return None

    def op(self, name: str, floor: Callable) -> Dict[str, Callable[[], object]]:
        """The zero-argument call of case ``name`` of every implementation of the case
        (SGLang's only where it has that call), by name in ``IMPLS`` order."""
        make = getattr(self, "_op_" + name)
        on, floor_call = make(floor, self.req_to_token)
        calls = {impl: (make(floor, self.own_rows[impl])[0] if impl in self.own_rows else on)(alloc)
                 for impl, alloc in self.allocs.items()
                 if impl != "sglang" or sglang_ref.has_call(name, self.page_size)}
        calls["floor"] = floor_call
        return calls

    # Each returns (on, floor_call) for the requests' slots in rows (a req_to_token):
    # on(allocator) is that allocator's zero-argument call of the case, with its method
    # looked up now rather than in the timed call.
    def _op_alloc_decode(self, floor, rows):
        B, dev = self.batch, self.device
        seq_cpu = _i64([p + 1 for p in self.pre])
        seq = seq_cpu.to(dev)
        last = rows[torch.arange(B, device=dev), _i64(self.pre, dev) - 1].to(torch.int64)
        out = torch.empty(B, dtype=torch.int64, device=dev)
        return (lambda a: partial(a.alloc_decode, seq, seq_cpu, last),
                partial(floor, seq, seq_cpu, last, out))

    def _op_alloc_extend(self, floor, rows):
        B, dev = self.batch, self.device
        ext = [1 + (37 * j) % 128 for j in range(B)]
        pre_cpu = _i64(self.pre)
        seq_cpu = _i64([p + e for p, e in zip(self.pre, ext)])
        pre, seq = pre_cpu.to(dev), seq_cpu.to(dev)
        last = rows[torch.arange(B, device=dev), pre - 1].to(torch.int64)
        n = sum(ext)
        out = torch.empty(n, dtype=torch.int64, device=dev)
        return (lambda a: partial(a.alloc_extend, pre, pre_cpu, seq, seq_cpu, last, n),
                partial(floor, pre, pre_cpu, seq, seq_cpu, last, out))

    def _op_alloc_extend_swa_tail(self, floor, rows):
        B, ps, dev = self.batch, self.page_size, self.device
        calls, floor_calls = [], []
        for j in range(B):
            L = 128 + (37 * j) % 128
            tail = _C.swa_tail_len(L, WINDOW, ps)
            z_cpu, l_cpu = _i64([0]), _i64([L])
            z, l, last = z_cpu.to(dev), l_cpu.to(dev), _i64([-1], dev)
            calls.append((z, z_cpu, l, l_cpu, last, L, tail))
            floor_calls.append((z, z_cpu, l, l_cpu, last, torch.empty(L, dtype=torch.int64, device=dev)))

        def on(alloc):
            f = alloc.alloc_extend_swa_tail
            return lambda: [f(*c) for c in calls]

        return on, lambda: [floor(*c) for c in floor_calls]

    def _segments(self, rows, aligned: bool):
        ps = self.page_size
        parts = []
        for j, (p, e) in enumerate(zip(self.pre, self.evicted)):
            end = (p // ps) * ps if aligned else p
            if end > e:
                parts.append(rows[j, e:end])
        if not parts:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(parts).to(torch.int64)

    def _op_free_segment(self, floor, rows):
        idx = self._segments(rows, aligned=True)
        out = torch.empty(0, dtype=torch.int64, device=self.device)
        return lambda a: partial(a.free_segment, idx, start_pos=0), partial(floor, idx, out)

    def _op_free(self, floor, rows):
        idx = self._segments(rows, aligned=False)
        out = torch.empty(0, dtype=torch.int64, device=self.device)
        return lambda a: partial(a.free, idx), partial(floor, idx, out)

    def _op_evict_out_of_window(self, floor, r2t):
        rows = torch.arange(self.batch, dtype=torch.int64)
        pre = _i64(self.pre)
        evicted = _i64(self.evicted)
        out = torch.empty(self.batch, dtype=torch.int64)

        def on(alloc):
            if any(alloc is self.allocs.get(impl) for impl in ("native", "shared", "parents")):  # the batched native call
                return partial(decode.evict_out_of_window, alloc, r2t, rows, pre, evicted, WINDOW)
            # The references: SGLang's scheduler loop, one free_swa_segment per due request.
            return partial(evict_per_request, alloc, r2t, rows, pre, evicted, WINDOW, self.page_size)

        return on, partial(floor, r2t, rows, pre, evicted, out)
