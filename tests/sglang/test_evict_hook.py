"""The hook (swa_ext.sglang.hooks) against SGLang's own maybe_evict_swa loop, on real
ScheduleBatches built with SGLang's classes (swa_ext_bench.sglang_step.Scheduler):
identical freed pages, evicted lengths, pools and mapping after every decode step; in
lockstep a difference raises LockstepDivergence naming the request; rules the native
call does not cover take SGLang's loop with one warning; and the warning when SGLang
builds its allocator where swa_ext cannot serve (--enable-unified-memory)."""
import logging
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache import kv_cache_configurator
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

import swa_ext.sglang as adapter
from swa_ext.sglang import hooks
from swa_ext.sglang import installer

try:
    from swa_ext_bench import sglang_step
except ImportError:  # the source tree without the installed package
    sys.path.append(str(Path(__file__).resolve().parents[2]))
    from bench import sglang_step

NUM_REQS = 12
STEPS = 40


@pytest.fixture
def interval(request, monkeypatch):
    monkeypatch.setenv("SGLANG_SWA_EVICTION_INTERVAL", str(request.param))
    return request.param


def protect(scheduler, page_size):
    """Some requests with a tree-owned prefix (cache_protected_len) and some with an
    eviction shield (swa_evict_floor) above their evicted length: swa_dead_lo rules there."""
    for i, req in enumerate(scheduler.reqs):
        cursor = req.kv.get_evicted_seqlen(ComponentType.SWA)
        if i % 3 == 0:
            req.kv.cache_protected_len = (cursor // page_size + 2) * page_size
        if i % 4 == 1:
            req.kv.swa_evict_floor = cursor + 5
        if i == 2:
            req.kv.cache_protected_len = (req.seqlen // page_size + 3) * page_size  # past the committed length


def _free_list(pool):
    return torch.cat([pages for pages in (pool.free_pages, pool.release_pages) if pages is not None])


def pools(scheduler):
    alloc = scheduler.alloc
    return {"evicted": [req.kv.get_evicted_seqlen(ComponentType.SWA) for req in scheduler.reqs],
            "full": alloc.full_available_size(), "swa": alloc.swa_available_size(),
            "mapping": alloc.full_to_swa_index_mapping.clone(),
            "req_to_token": scheduler.req_to_token_pool.req_to_token.clone(),
            "swa_free": _free_list(alloc.swa_attn_allocator), "full_free": _free_list(alloc.full_attn_allocator)}


def same(a, b, *, order=True):
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            if not order and key.endswith("_free"):
                x, y = x.sort().values, y.sort().values
            assert x.shape == y.shape and torch.equal(x.to(torch.int64), y.to(torch.int64)), key
        else:
            assert x == y, key


@pytest.mark.parametrize("interval", [1, 8], indirect=True)
@pytest.mark.parametrize("radix_cache", [True, False], ids=["radix", "no-radix"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_hook_leaves_the_state_of_sglangs_loop(page_size, radix_cache, interval):
    sglang_step._publish_server_args(page_size)
    setups = {s: sglang_step.Scheduler(s, NUM_REQS, page_size, interval, STEPS + 2, radix_cache)
              for s in sglang_step.SETUPS}
    for s in setups.values():
        protect(s, page_size)
    before = hooks.served()
    freed_steps = 0
    for step in range(STEPS):
        evicted_before = pools(setups["hook"])["evicted"]
        for s in setups.values():
            s.step()
        states = {name: pools(s) for name, s in setups.items()}
        same(states["hook"], states["swa_ext"])  # the same pages freed in the same order
        same(states["hook"], states["sglang"], order=False)  # SGLang's allocator keeps its lists its own way
        freed_steps += states["hook"]["evicted"] != evicted_before
    assert hooks.served()["native"] - before["native"] == STEPS and hooks.served()["sglang"] == before["sglang"]
    assert freed_steps > 0  # the window slid and pages came back
    evicted = states["hook"]["evicted"]
    assert evicted[0] >= setups["hook"].reqs[0].kv.cache_protected_len  # frees started above the tree's prefix


@pytest.mark.parametrize("interval", [1], indirect=True)
def test_lockstep_checks_the_hook_request_by_request(interval, monkeypatch):
    sglang_step._publish_server_args(16)
    s = sglang_step.Scheduler("lockstep", NUM_REQS, 16, interval, STEPS + 2, True)
    protect(s, 16)
    for _ in range(STEPS):
        s.step()
    assert s.alloc.lockstep_counts["maybe_evict_swa"] == STEPS
    assert s.alloc.lockstep_counts.get("free_swa_segment", 0) == 0  # SGLang's frees went to the shadow only

    real = hooks._eviction

    class OffByAPage:  # a native eviction whose window is a page short: it frees a page too many
        evict_batch = real.evict_batch  # a lockstep allocator is never admitted: every batch comes to evict
        def evict(self, alloc, reqs, req_to_token, window, *args, **kwargs):
            return real.evict(alloc, reqs, req_to_token, window - 16, *args, **kwargs)

    monkeypatch.setattr(hooks, "_eviction", OffByAPage())
    with pytest.raises(adapter.LockstepDivergence, match=r"maybe_evict_swa, request 'req-\d+'"):
        for _ in range(16):
            s.step()


@pytest.mark.parametrize("interval", [1], indirect=True)
def test_lockstep_names_a_request_only_sglangs_loop_found_due(interval, monkeypatch):
    sglang_step._publish_server_args(16)
    s = sglang_step.Scheduler("lockstep", NUM_REQS, 16, interval, 20, True)
    real = hooks._eviction

    class LateByAToken:  # a native eviction that waits one token longer than SGLang's trigger
        evict_batch = real.evict_batch
        def evict(self, alloc, reqs, req_to_token, window, interval, *args, **kwargs):
            return real.evict(alloc, reqs, req_to_token, window, interval + 1, *args, **kwargs)

    monkeypatch.setattr(hooks, "_eviction", LateByAToken())
    with pytest.raises(adapter.LockstepDivergence, match=r"request 'req-\d+': SGLang's loop found it due"):
        for _ in range(16):
            s.step()


def test_the_hook_reads_sglangs_settings_again_when_they_change(monkeypatch):
    """The interval and the prefix-lock release are read every step, as SGLang's loop reads
    them: the hook follows a change between two steps."""
    monkeypatch.setenv("SGLANG_SWA_EVICTION_INTERVAL", "8")
    monkeypatch.delenv("SGLANG_OPT_RELEASE_PREFILL_SWA", raising=False)
    sglang_step._publish_server_args(16)
    hook, loop = (sglang_step.Scheduler(s, NUM_REQS, 16, 8, STEPS + 2, True) for s in ("hook", "swa_ext"))
    before = hooks.served()
    for step in range(STEPS):
        if step == STEPS // 2:
            monkeypatch.setenv("SGLANG_SWA_EVICTION_INTERVAL", "1")
        if step == 3 * STEPS // 4:
            monkeypatch.setenv("SGLANG_OPT_RELEASE_PREFILL_SWA", "1")
        hook.step()
        loop.step()
        same(pools(hook), pools(loop))
    assert hooks.served()["native"] - before["native"] == 3 * STEPS // 4
    assert hooks.served()["sglang"] - before["sglang"] == STEPS - 3 * STEPS // 4


def _release_prefix_locks(monkeypatch, setups):
    monkeypatch.setenv("SGLANG_OPT_RELEASE_PREFILL_SWA", "1")


def _a_request_subclass(monkeypatch, setups):
    from sglang.srt.managers.schedule_batch import Req

    class TracedReq(Req):  # a subclass may compute seqlen its own way: the reader reads Req only
        pass

    for s in setups:
        s.reqs[3].__class__ = TracedReq


@pytest.mark.parametrize("interval", [1], indirect=True)
@pytest.mark.parametrize("cause, reason", [(_release_prefix_locks, "SGLANG_OPT_RELEASE_PREFILL_SWA"),
                                           (_a_request_subclass, "TracedReq, not SGLang's Req")],
                         ids=["rule-not-covered", "request-not-read"])
def test_what_the_native_call_does_not_cover_takes_sglangs_loop_with_one_warning(cause, reason, interval,
                                                                                  monkeypatch, caplog):
    sglang_step._publish_server_args(16)
    hook, loop = (sglang_step.Scheduler(s, NUM_REQS, 16, interval, 12, True) for s in ("hook", "swa_ext"))
    cause(monkeypatch, (hook, loop))
    before = hooks.served()
    hooks._warned.clear()
    with caplog.at_level(logging.WARNING, logger="swa_ext.sglang"):
        for _ in range(8):
            hook.step()
            loop.step()
            same(pools(hook), pools(loop))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("swa_ext:")]
    assert len(lines) == 1 and reason in lines[0], lines
    assert hooks.served()["native"] == before["native"] and hooks.served()["sglang"] - before["sglang"] == 8


def test_install_puts_the_hook_in_and_uninstall_takes_it_out():
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    try:
        adapter.install()
        assert ScheduleBatch.maybe_evict_swa is hooks.maybe_evict_swa
        adapter.install(evict_hook=False)
        assert ScheduleBatch.maybe_evict_swa is hooks.sglang_maybe_evict_swa
        adapter.install()
    finally:
        adapter.uninstall()
    assert ScheduleBatch.maybe_evict_swa is hooks.sglang_maybe_evict_swa


class _UnifiedAllocator:
    """Stands for SGLang's unified allocator (built before the names swa_ext replaces)."""


@pytest.mark.parametrize("unified", [True, False])
def test_an_allocator_built_elsewhere_gets_one_warning_naming_the_flag(unified, monkeypatch, caplog):
    built = types.SimpleNamespace(token_to_kv_pool_allocator=_UnifiedAllocator())
    monkeypatch.setattr(installer, "_sglang_init_pools", lambda self, **kw: built)
    monkeypatch.setattr(kv_cache_configurator, "get_memory",
                        lambda: types.SimpleNamespace(enable_unified_memory=unified))
    try:
        adapter.install()
        with caplog.at_level(logging.WARNING, logger="swa_ext.sglang"):
            got = kv_cache_configurator.KVCacheConfigurator._init_pools(
                object(), sizes=None, req_to_token_pool=None, token_to_kv_pool_allocator=None)
    finally:
        adapter.uninstall()
    assert got is built
    lines = [r.getMessage() for r in caplog.records if "swa_ext" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("swa_ext:") and "_UnifiedAllocator" in lines[0], lines
    assert ("--enable-unified-memory" in lines[0]) == unified


def test_the_step_benchmark_runs_and_reports_every_case(tmp_path, capsys):
    """Smoke sizes; no timing is asserted (the benchmark itself checks the setups agree)."""
    js = tmp_path / "step.json"
    assert sglang_step.main(["--requests", "4", "--page-sizes", "16", "--intervals", "1,128", "--steps", "2",
                             "--warmup", "1", "--json", str(js)]) == 0
    import json

    doc = json.loads(js.read_text())
    assert [(r["requests"], r["interval"]) for r in doc["rows"]] == [(4, 1), (4, 128)]
    for r in doc["rows"]:
        for setup in sglang_step.SETUPS:
            assert r[setup]["maybe_evict_swa_us"] > 0 and r[setup]["prepare_for_decode_us"] > 0
    assert len(doc["interval_pairs"]) == 1
    assert "| requests | page | interval | setup |" in capsys.readouterr().out
    # Two of the setups, taking turns step by step.
    assert sglang_step.main(["--requests", "4", "--page-sizes", "16", "--intervals", "1", "--steps", "3",
                             "--warmup", "1", "--setups", "sglang,hook", "--block", "1", "--json", str(js)]) == 0
    (row,) = json.loads(js.read_text())["rows"]
    assert row["block"] == 1 and "hook" in row and "swa_ext" not in row
    with pytest.raises(SystemExit):
        sglang_step.main(["--setups", "hook,sglang"])  # the reference setup comes first
