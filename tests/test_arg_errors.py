"""Errors in how a native call is made are one line naming what is wrong.

- Every native function and method (the allocator classes', their states', the
  constructors and swa_ext.decode's native function), called with a missing, an
  unexpected, a misspelt keyword or too many positional arguments: a one-line TypeError
  in Python's own words, naming the argument, and the allocators exactly as they were.
  The table is made from pybind11's signature line of each function, so a method added
  later is in it.
- A value of the wrong type for a typed argument: one line naming the argument.
- The constructors: a pool that cannot be allocated names size / size_swa and the
  bytes; a dtype that is not a torch.dtype is refused.
- Batch arguments of different lengths: every one is named with its length.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import pytest
import torch

import swa_ext
import test_sglang_reader
from swa_ext import _C, decode

PS = 4


def T(*values):
    return torch.tensor(values, dtype=torch.int64)


@dataclass(frozen=True)
class Native:
    """One native callable and what its signature line says of it."""

    owner: str  # how the test reaches it
    name: str  # the name its errors use
    positional: tuple[str, ...]  # may be passed by position (self left out)
    keyword_only: tuple[str, ...]
    required: tuple[str, ...]
    star_args: bool

    @property
    def keywords(self):
        return [p for p in self.positional + self.keyword_only if not re.fullmatch(r"arg\d+", p)]


def parse_signature(owner: str, func) -> Native:
    """pybind11's first signature line, ``name(self: T, a: int, *, b: str = 'x') -> R``
    (for an overloaded function, its first overload's)."""
    lines = func.__doc__.splitlines()
    line = next(l[3:] for l in lines if l.startswith("1. ")) if "Overloaded function." in lines else lines[0]
    name, params = re.fullmatch(r"(\w+)\((.*)\) -> .*", line).groups()
    positional, keyword_only, required, star_args, kw_only = [], [], [], False, False
    for param in params.split(", ") if params else []:
        if param == "*":
            kw_only = True
            continue
        if param.startswith("*"):
            star_args = True
            continue
        pname = param.split(":")[0]
        if pname == "self":
            continue
        (keyword_only if kw_only else positional).append(pname)
        if " = " not in param:
            required.append(pname)
    return Native(owner, name, tuple(positional), tuple(keyword_only), tuple(required), star_args)


def natives():
    """Every function pybind11 defines in swa_ext._C, with the owner a test calls it through."""
    found = []
    owners = {"HybridAllocator": "hybrid", "PoolAllocator": "pool", "AllocatorState": "hybrid_state",
              "PagePool": "pool_state", "sglang.WindowEviction": "sglang_eviction"}
    for cls_path, owner in owners.items():
        for name, attr in vars(native_attribute(cls_path)).items():
            if type(attr).__name__ != "instancemethod" or name.startswith("_pybind11"):
                continue
            if name == "__init__":  # a constructor's errors use its class's name
                sig = parse_signature(f"new:{cls_path}", attr)
                found.append(Native(sig.owner, cls_path.rpartition(".")[2], sig.positional, sig.keyword_only,
                                    sig.required, sig.star_args))
            else:
                found.append(parse_signature(f"{owner}.{name}", attr))
    for prefix, module in (("module", _C), ("sglang", _C.sglang)):
        for name, attr in vars(module).items():
            if type(attr).__name__ == "builtin_function_or_method":
                found.append(parse_signature(f"{prefix}.{name}", attr))
    return found


def native_attribute(path):
    """_C's attribute at a dotted path ("sglang.WindowEviction")."""
    found = _C
    for name in path.split("."):
        found = getattr(found, name)
    return found


NATIVES = natives()


class World:
    """A hybrid allocator and a page pool holding some slots, and their states."""

    def __init__(self):
        self.hybrid = swa_ext.SWATokenToKVPoolAllocator(64, 32, PS, torch.bfloat16, "cpu")
        self.pool = swa_ext.PagedTokenToKVPoolAllocator(64, PS, torch.bfloat16, "cpu")
        self.held = self.hybrid.alloc(2 * PS)
        self.pool.alloc(PS)

    def callable_of(self, native: Native):
        owner, _, name = native.owner.partition(".")
        if owner.startswith("new:"):
            return native_attribute(native.owner[4:])
        if owner == "module":
            return getattr(_C, name)
        if owner == "sglang":
            return getattr(_C.sglang, name)
        objects = {"hybrid": self.hybrid, "pool": self.pool, "hybrid_state": self.hybrid.backup_state(),
                   "pool_state": self.pool.backup_state(),
                   "sglang_eviction": _C.sglang.WindowEviction(test_sglang_reader.Request, test_sglang_reader.KvState,
                                                               test_sglang_reader.SWA)}
        return getattr(objects[owner], name)

    def state(self):
        return (self.hybrid.backup_state(), self.pool.backup_state(), self.hybrid.full_to_swa_index_mapping.tolist())


def one_line_type_error(call):
    with pytest.raises(TypeError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and "incompatible" not in message, message
    return message


def test_the_table_holds_every_kind_of_native():
    names = {n.owner for n in NATIVES}
    assert {"hybrid.alloc_decode", "hybrid.free_segment", "hybrid.evict_out_of_window", "pool.alloc_extend",
            "pool.free_page_ids", "new:HybridAllocator", "new:PoolAllocator", "module.evict_out_of_window",
            "module.swa_tail_len", "hybrid_state.__eq__", "new:sglang.WindowEviction",
            "sglang_eviction.evict"} <= names
    assert len(NATIVES) >= 50


def ids(cases):
    return [c.owner for c in cases]


WITH_REQUIRED = [n for n in NATIVES if n.required]


@pytest.mark.parametrize("native", WITH_REQUIRED, ids=ids(WITH_REQUIRED))
def test_missing_arguments_are_named(native):
    w = World()
    before = w.state()
    message = one_line_type_error(lambda: w.callable_of(native)())
    kind = "keyword argument" if all(p in native.keyword_only for p in native.required) else "argument"
    assert message.startswith(f"{native.name}() missing required {kind}"), message
    for param in native.required:
        assert f"'{param}'" in message, message
    assert w.state() == before


def _required_call(native: Native, **extra):
    """The required arguments (all None), by keyword where they can be, plus extra."""
    args = [None for p in native.positional if p in native.required and p not in native.keywords]
    kwargs = {p: None for p in native.required if p in native.keywords}
    return args, {**kwargs, **extra}


@pytest.mark.parametrize("native", NATIVES, ids=ids(NATIVES))
def test_an_unexpected_keyword_is_named(native):
    w = World()
    before = w.state()
    args, kwargs = _required_call(native, bogus=1)
    message = one_line_type_error(lambda: w.callable_of(native)(*args, **kwargs))
    assert message.startswith(f"{native.name}() got an unexpected keyword argument 'bogus'"), message
    assert w.state() == before


WITH_KEYWORDS = [n for n in NATIVES if n.keywords]


@pytest.mark.parametrize("native", WITH_KEYWORDS, ids=ids(WITH_KEYWORDS))
def test_a_misspelt_keyword_is_named_with_the_one_meant(native):
    w = World()
    before = w.state()
    meant = native.keywords[-1]
    misspelt = meant[:-1]
    args, kwargs = _required_call(native)
    kwargs.pop(meant, None)
    kwargs[misspelt] = None
    message = one_line_type_error(lambda: w.callable_of(native)(*args, **kwargs))
    assert message == (f"{native.name}() got an unexpected keyword argument '{misspelt}' "
                       f"(did you mean '{meant}'?)"), message
    assert w.state() == before


FIXED_POSITIONAL = [n for n in NATIVES if not n.star_args]


@pytest.mark.parametrize("native", FIXED_POSITIONAL, ids=ids(FIXED_POSITIONAL))
def test_too_many_positional_arguments_are_counted(native):
    w = World()
    before = w.state()
    n = len(native.positional)
    message = one_line_type_error(lambda: w.callable_of(native)(*([None] * (n + 1))))
    assert re.fullmatch(rf"{native.name}\(\) takes (from \d+ to )?{n} positional arguments? but {n + 1} "
                        rf"(was|were) given", message), message
    assert w.state() == before


def test_the_examples_read_as_python_would_say_them():
    w = World()
    idx = w.held[:PS]
    assert one_line_type_error(lambda: w.hybrid.free_segment(idx)) == \
        "free_segment() missing required keyword argument 'start_pos'"
    assert one_line_type_error(lambda: w.hybrid.free_segment(idx, 0)) == \
        "free_segment() takes 1 positional argument but 2 were given"
    assert one_line_type_error(lambda: w.hybrid.alloc(3, need_size=3)) == \
        "alloc() got multiple values for argument 'need_size'"
    assert one_line_type_error(lambda: w.hybrid.alloc_decode(T(5), T(5))) == \
        "alloc_decode() missing required argument 'last_loc'"
    assert one_line_type_error(lambda: _C.PoolAllocator(64, PS)) == "PoolAllocator() missing required argument 'device'"
    table = torch.zeros(2, 16, dtype=torch.int32)
    assert one_line_type_error(lambda: decode.evict_out_of_window(w.hybrid, table, [0], [4], [0], 8, 1)) == \
        "evict_out_of_window() takes 6 positional arguments but 7 were given"


TYPE_FAULTS = [
    ("hybrid.alloc", ("x",), {}, "need_size: expected an int, got str"),
    ("hybrid.alloc", (2.0,), {}, "need_size: expected an int, got float"),
    ("hybrid.alloc", (2**70,), {}, "need_size: outside the int64 range"),
    ("hybrid.free_segment", ("held",), {"start_pos": None}, "start_pos: expected an int, got NoneType"),
    ("hybrid.resize", (), {"size": "64", "size_swa": 32}, "size: expected an int, got str"),
    ("hybrid.restore_state", (3,), {}, "state: expected an AllocatorState, got int"),
    ("hybrid.restore_state", ("pool_state",), {}, "state: expected an AllocatorState, got PagePool"),
    ("hybrid.free", ("x",), {}, "free_index: expected a torch.Tensor, got str"),
    ("pool.alloc_extend", (T(0), T(0), T(4), T(4), T(-1), 4), {"num_new_pages": "1"},
     "num_new_pages: expected an int or None, got str"),
    ("new:HybridAllocator", (64, 32, PS, "cpu", "yes"), {}, "need_sort: expected a bool, got str"),
    ("new:PoolAllocator", (64, PS, "cpu"), {"kernels": 3}, "kernels: expected a str, got int"),
    ("module.swa_tail_len", (10, 4.5, PS), {}, "window: expected an int, got float"),
    ("sglang_eviction.evict", ("hybrid", [], torch.zeros(2, 16, dtype=torch.int32), "8", 1, True), {},
     "window: expected an int, got str"),
    ("sglang_eviction.evict", ("pool", [], torch.zeros(2, 16, dtype=torch.int32), 8, 1, True), {},
     "allocator: expected a HybridAllocator, got PagedTokenToKVPoolAllocator"),
]


@pytest.mark.parametrize("owner, args, kwargs, expected", TYPE_FAULTS, ids=[f"{c[0]}-{c[3]}" for c in TYPE_FAULTS])
def test_a_value_of_the_wrong_type_is_named(owner, args, kwargs, expected):
    w = World()
    before = w.state()
    native = next(n for n in NATIVES if n.owner == owner)
    stand_ins = {"held": w.held[:PS], "pool_state": w.pool.backup_state(), "hybrid": w.hybrid, "pool": w.pool}
    args = [stand_ins.get(a, a) if isinstance(a, str) else a for a in args]
    assert one_line_type_error(lambda: w.callable_of(native)(*args, **kwargs)) == expected
    assert w.state() == before


def test_calls_that_bind_run_native_with_their_conversions_and_docstrings():
    w = World()
    # Still pybind11's own function, no Python frame in between.
    assert type(w.hybrid.alloc_decode.__func__).__name__ == "builtin_function_or_method"
    assert w.hybrid.free_segment.__doc__.startswith(
        "free_segment(self: swa_ext._C.HybridAllocator, indices: object, *, start_pos: ")
    # Conversions pybind11 makes are still made: an int for a bool, a 0-d tensor for an int.
    assert swa_ext.SWATokenToKVPoolAllocator(64, 32, PS, torch.bfloat16, "cpu", need_sort=1).need_sort
    assert w.hybrid.alloc(torch.tensor(PS)).numel() == PS
    # An error raised inside the call keeps its own text.
    with pytest.raises(ValueError, match="^need_size: "):
        w.hybrid.alloc(-1)


# ------------------------------------------------------------------ constructors

HUGE = 2**60  # the tables of 2**60 slots pass every address space: refused at once, whatever the overcommit


CONSTRUCTORS = {
    "hybrid size": (lambda k: swa_ext.SWATokenToKVPoolAllocator(HUGE, 64, 16, torch.bfloat16, "cpu", kernels=k),
                    "size"),
    "hybrid size_swa": (lambda k: swa_ext.SWATokenToKVPoolAllocator(64, HUGE, 16, torch.bfloat16, "cpu", kernels=k),
                        "size_swa"),
    "paged": (lambda k: swa_ext.PagedTokenToKVPoolAllocator(HUGE, 16, torch.bfloat16, "cpu", kernels=k), "size"),
    "token": (lambda k: swa_ext.TokenToKVPoolAllocator(HUGE, torch.bfloat16, "cpu", kernels=k), "size"),
}


# AddressSanitizer aborts the process on a request past its largest allocation (1 TiB)
# instead of failing it, so under scripts/run-sanitized.sh this runs in the regular pass only.
@pytest.mark.skipif("asan" in os.environ.get("LD_PRELOAD", ""),
                    reason="AddressSanitizer aborts an allocation past its maximum instead of failing it")
@pytest.mark.parametrize("kernels", ["cpu", "emulated"])
@pytest.mark.parametrize("case", CONSTRUCTORS, ids=list(CONSTRUCTORS))
def test_a_pool_that_cannot_be_allocated_names_its_size_and_bytes(case, kernels):
    build, arg = CONSTRUCTORS[case]
    with pytest.raises(MemoryError) as info:
        build(kernels)
    message = str(info.value)
    match = re.fullmatch(rf"{arg}: {HUGE} slots need at least (\d+) bytes \([\d.]+ [KMGTPE]iB\) of cpu memory "
                         r"for the allocator's tables, more than can be allocated", message)
    assert match, message
    assert int(match.group(1)) >= 8 * HUGE // 16  # an int64 a page at least
    # Nothing half-built stays behind: the next allocator is whole.
    alloc = swa_ext.SWATokenToKVPoolAllocator(64, 32, PS, torch.bfloat16, "cpu", kernels=kernels)
    assert alloc.available_size() == 32


@pytest.mark.parametrize("make", [
    lambda d: swa_ext.SWATokenToKVPoolAllocator(64, 32, PS, d, "cpu"),
    lambda d: swa_ext.PagedTokenToKVPoolAllocator(64, PS, d, "cpu"),
    lambda d: swa_ext.TokenToKVPoolAllocator(64, d, "cpu"),
], ids=["hybrid", "paged", "token"])
def test_a_dtype_that_is_not_a_torch_dtype_is_refused(make):
    assert one_line_type_error(lambda: make("bf16")) == \
        "dtype: expected a torch.dtype (torch.bfloat16, say), got str 'bf16'"
    assert "dtype: expected a torch.dtype" in one_line_type_error(lambda: make(None))
    assert make(torch.float8_e4m3fn).dtype is torch.float8_e4m3fn


def test_a_device_torch_cannot_read_is_named():
    assert one_line_type_error(lambda: swa_ext.SWATokenToKVPoolAllocator(64, 32, PS, torch.bfloat16, "gpu")) == \
        "device: expected 'cpu' or 'cuda' (or a torch.device), got 'gpu'"


def test_python_constructors_name_their_arguments_in_one_line():
    message = one_line_type_error(lambda: swa_ext.SWATokenToKVPoolAllocator(64, 32, PS, torch.bfloat16))
    assert "'device'" in message
    message = one_line_type_error(
        lambda: swa_ext.SWATokenToKVPoolAllocator(64, 32, PS, torch.bfloat16, "cpu", kernel="cpu"))
    assert "'kernel'" in message
    assert one_line_type_error(lambda: swa_ext.SWATokenToKVPoolAllocator("64", 32, PS, torch.bfloat16, "cpu")) == \
        "size: expected an int, got str"


# ------------------------------------------------------------------ batch lengths

BATCHES = [
    ("alloc_extend", lambda a: a.alloc_extend(T(0, 0), T(0, 0), T(4, 4, 4), T(4, 4, 4), T(-1, -1, -1), 12),
     "prefix_lens, seq_lens, last_loc", ["prefix_lens 2", "seq_lens 3", "last_loc 3"]),
    ("alloc_extend last_loc", lambda a: a.alloc_extend(T(0, 0, 0), T(0, 0, 0), T(4, 4, 4), T(4, 4, 4), T(-1, -1), 12),
     "prefix_lens, seq_lens, last_loc", ["prefix_lens 3", "seq_lens 3", "last_loc 2"]),
    ("alloc_extend_swa_tail", lambda a: a.alloc_extend_swa_tail(T(0), T(0), T(4), T(4), T(-1, -1), 4, 4),
     "prefix_lens, seq_lens, last_loc", ["prefix_lens 1", "seq_lens 1", "last_loc 2"]),
    ("alloc_decode", lambda a: a.alloc_decode(T(5, 5), T(5, 5), T(3)),
     "seq_lens, last_loc", ["seq_lens 2", "last_loc 1"]),
    ("cpu copy", lambda a: a.alloc_extend(T(0, 0), T(0, 0, 0), T(4, 4, 4), T(4, 4, 4), T(-1, -1, -1), 12),
     "prefix_lens, prefix_lens_cpu", ["prefix_lens 2", "prefix_lens_cpu 3"]),
    ("evict_out_of_window", lambda a: decode.evict_out_of_window(a, torch.zeros(4, 16, dtype=torch.int32), [0, 1],
                                                                 [4], [0, 0, 0], 8),
     "rows, pre_lens, evicted_seqlens", ["rows 2", "pre_lens 1", "evicted_seqlens 3"]),
    ("pool alloc_extend", lambda a: a.full_attn_allocator.alloc_extend(T(0), T(0), T(4, 4), T(4, 4), T(-1, -1), 8),
     "prefix_lens, seq_lens, last_loc", ["prefix_lens 1", "seq_lens 2", "last_loc 2"]),
]


@pytest.mark.parametrize("name, call, names, lengths", BATCHES, ids=[b[0] for b in BATCHES])
def test_batch_arguments_of_different_lengths_are_all_named(name, call, names, lengths):
    w = World()
    before = w.state()
    with pytest.raises(ValueError) as info:
        call(w.hybrid)
    message = str(info.value)
    assert message.startswith(f"{names}: differ in length ("), message
    for length in lengths:
        assert length in message, message
    assert w.state() == before
