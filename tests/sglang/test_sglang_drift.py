"""swa_ext fails closed in SGLang: whatever keeps it from serving what SWA_EXT_SGLANG asks
(a bad value, an unknown SWA_EXT_ variable, another SGLang version, a seam that moved, an
install that fails midway) ends start-up with one ``swa_ext:`` line and nothing patched;
and the seam list (swa_ext.sglang_seams) holds every SGLang symbol swa_ext reaches."""
import ast
import importlib.util
import inspect
import logging
import os
import re
import subprocess
import sys

import pytest
import torch
from sglang.srt.managers import schedule_batch
from sglang.srt.mem_cache import kv_cache_configurator

import swa_ext
import swa_ext.sglang as adapter
from conftest import STUBS, RecordingSWAKVCache
from swa_ext import cli, sglang_plugin, sglang_seams
from swa_ext.sglang import hooks, installer, lockstep, shared, shared_pool

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PACKAGE = os.path.join(ROOT, "swa_ext", "sglang")


@pytest.fixture
def environment(monkeypatch):
    """No SWA_EXT_ variable but those a test sets; nothing installed after it."""
    for name in list(os.environ):
        if name.startswith("SWA_EXT_"):
            monkeypatch.delenv(name)
    yield monkeypatch
    adapter.uninstall()


def patched_state():
    """Every attribute of SGLang's that install() may patch, as it is now."""
    configurator = kv_cache_configurator.KVCacheConfigurator
    return {"names": {name: getattr(kv_cache_configurator, name, None) for name in (*installer._REPLACED, "SWAKVPool")},
            "_init_pools": configurator.__dict__["_init_pools"],
            "_resolve_memory_pool_config": configurator.__dict__["_resolve_memory_pool_config"],
            "maybe_evict_swa": schedule_batch.ScheduleBatch.__dict__["maybe_evict_swa"]}


def refused():
    """The one line plugin() stops with (SystemExit, not an Exception SGLang would log)."""
    with pytest.raises(SystemExit) as stopped:
        sglang_plugin.plugin()
    assert not isinstance(stopped.value, Exception)
    message = str(stopped.value)
    assert "\n" not in message and message.startswith("swa_ext: "), message
    assert adapter.installed() == [] and not hooks.installed()
    return message


# --- the switch and the SWA_EXT_ variables ---------------------------------------------

@pytest.mark.parametrize("value", ["2", "true", "SHARED", "all,shared"])
def test_a_bad_value_is_refused(environment, value):
    environment.setenv("SWA_EXT_SGLANG", value)
    assert f"SWA_EXT_SGLANG={value!r} is not a mode" in refused()


@pytest.mark.parametrize("switch", [None, "1", "shared"])
def test_an_unknown_swa_ext_variable_is_refused(environment, switch):
    """A misspelt setting, and a misspelt switch (the switch itself then unset)."""
    environment.setenv("SWA_EXT_DEBGU", "1")
    environment.setenv("SWA_EXT_SGLAN", "1")
    if switch:
        environment.setenv("SWA_EXT_SGLANG", switch)
    message = refused()
    assert "SWA_EXT_DEBGU, SWA_EXT_SGLAN: no such swa_ext setting" in message
    assert "SWA_EXT_DEBUG" in message and "SWA_EXT_SGLANG" in message  # the settings there are


def test_known_variables_pass(environment):
    for name in sglang_plugin.VARIABLES.keys() | sglang_plugin.TEST_AND_BUILD_VARIABLES.keys():
        environment.setenv(name, "0")
    environment.setenv(sglang_seams.VERSION_OVERRIDE_VARIABLE, sglang_seams.installed_version())
    environment.setenv("SWA_EXT_SGLANG", "1")
    sglang_plugin.plugin()
    assert adapter.installed() == ["SWATokenToKVPoolAllocator"]


# Names spelt SWA_EXT_ that are no environment variable: C++ macros, a CMake option, a
# Python constant.
NOT_VARIABLES = {"SWA_EXT_FREE", "SWA_EXT_FREE_SEGMENT", "SWA_EXT_WITH_CUDA", "SWA_EXT_TSAN",
                 "SWA_EXT_EVICTION_INTERVAL"}


def test_every_swa_ext_variable_of_the_project_is_known():
    """A new SWA_EXT_ variable must be listed in sglang_plugin, or the plugin refuses it."""
    found = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "build"]
        for name in files:
            path = os.path.join(folder, name)
            if path == os.path.abspath(__file__):  # its misspelt names are planted
                continue
            if name.endswith((".py", ".sh", ".cpp", ".h", ".md", ".txt")) or name in ("run", "CMakeLists.txt"):
                with open(path, errors="replace") as f:
                    found |= set(re.findall(r"\bSWA_EXT_[A-Z_]*[A-Z]\b", f.read()))
    assert found - NOT_VARIABLES - sglang_plugin.KNOWN_VARIABLES == set()
    assert {"SWA_EXT_SGLANG", "SWA_EXT_TEST_KV_FAULT"} <= found  # the walk read the sources


# --- the version ----------------------------------------------------------------------

def test_another_sglang_version_is_refused_unless_overridden(environment):
    environment.setenv("SWA_EXT_SGLANG", "1")
    environment.setattr(sglang_seams, "installed_version", lambda: "0.5.99")
    message = refused()
    assert "swa_ext supports SGLang 0.5.23, this is 0.5.99: install sglang==0.5.23" in message
    assert "set SWA_EXT_SGLANG_VERSION_OVERRIDE=0.5.99 to try this version" in message
    environment.setenv("SWA_EXT_SGLANG_VERSION_OVERRIDE", "0.5.98")
    assert "SWA_EXT_SGLANG_VERSION_OVERRIDE=0.5.98 names another SGLang than the one installed (0.5.99)" in refused()
    environment.setenv("SWA_EXT_SGLANG_VERSION_OVERRIDE", "0.5.99")
    sglang_plugin.plugin()
    assert adapter.installed() == ["SWATokenToKVPoolAllocator"]
    adapter.uninstall()
    # Overridden, the seams are still checked.
    environment.delattr(schedule_batch.ReqKvInfo, "swa_dead_lo")
    assert "ReqKvInfo.swa_dead_lo missing" in refused()


def test_no_sglang_installed_is_refused(environment):
    environment.setenv("SWA_EXT_SGLANG", "shared")
    environment.setattr(sglang_seams, "installed_version", lambda: None)
    assert "SGLang is not installed in this environment" in refused()


# --- the seams ------------------------------------------------------------------------

def test_each_moved_seam_is_named_in_the_one_line(environment):
    environment.setenv("SWA_EXT_SGLANG", "all")
    environment.delattr(kv_cache_configurator.KVCacheConfigurator, "_resolve_memory_pool_config")
    environment.delattr(schedule_batch.ReqKvInfo, "holds_kv")
    seams = [seam if seam[1] != "ScheduleBatch._swa_eviction_trigger" else
             (seam[0], seam[1], "self, sliding_window_size") for seam in sglang_seams.SEAMS]
    seams.append(("sglang.srt.no_such_module", "Allocator", None))
    environment.setattr(sglang_seams, "SEAMS", tuple(seams))
    message = refused()
    assert "SGLang 0.5.23 moved 4 of the seams swa_ext patches or calls: " in message
    assert "kv_cache_configurator:KVCacheConfigurator._resolve_memory_pool_config missing" in message
    assert "schedule_batch:ReqKvInfo.holds_kv missing" in message
    assert ("schedule_batch:ScheduleBatch._swa_eviction_trigger parameters (self, sliding_window_size, "
            "eviction_interval), expected (self, sliding_window_size)") in message
    assert "sglang.srt.no_such_module:Allocator module does not import (ModuleNotFoundError" in message


def test_a_moved_instance_attribute_is_found(monkeypatch):
    assert sglang_seams.moved() == []
    code = schedule_batch.Req.__init__.__code__
    monkeypatch.setattr(schedule_batch.Req.__init__, "__code__",
                        code.replace(co_names=tuple(n if n != "decode_batch_idx" else "batch_index"
                                                    for n in code.co_names)))
    assert sglang_seams.moved() == [(f"{schedule_batch.__name__}:Req().decode_batch_idx", "missing")]


def test_the_seams_of_this_sglang_are_all_where_swa_ext_expects_them():
    assert sglang_seams.installed_version() == sglang_seams.SUPPORTED_VERSION
    assert sglang_seams.moved() == []
    assert len({(module, path) for module, path, _ in sglang_seams.SEAMS}) == len(sglang_seams.SEAMS)


def seam_paths():
    """Every (module, attribute path) the seam list holds, with each path's prefixes."""
    paths = set()
    for module, path, _ in sglang_seams.SEAMS:
        parts = path.replace("().", ".").split(".")
        paths |= {(module, ".".join(parts[:i])) for i in range(1, len(parts) + 1)}
    return paths


def is_a_module(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a name in a module that is no package
        return False


def sglang_references(source):
    """(module, attribute path) of each SGLang name a module imports and of each attribute
    chain it reads on one: ``from sglang.a import b`` then ``b.C.d`` is ("sglang.a.b", "C.d")
    where sglang.a.b is a module, else ("sglang.a", "b.C.d")."""
    tree = ast.parse(source)
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0] == "sglang" for a in node.names), "import sglang...: use from-imports"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sglang":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                is_module = is_a_module(full)
                imported[alias.asname or alias.name] = (full, "") if is_module else (node.module, alias.name)
    found = {ref for ref in imported.values() if ref[1]}
    for node in ast.walk(tree):
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if chain and isinstance(node, ast.Name) and node.id in imported:
            module, path = imported[node.id]
            found.add((module, ".".join(([path] if path else []) + chain[::-1])))
    return found


def test_every_sglang_symbol_swa_ext_references_is_a_seam():
    held = seam_paths()
    references = {}
    for name in sorted(os.listdir(PACKAGE)):
        if name.endswith(".py"):
            with open(os.path.join(PACKAGE, name)) as f:
                for ref in sglang_references(f.read()):
                    references.setdefault(ref, name)
    assert len(references) > 30  # the parse found them
    assert {f"{m}:{p} ({where})" for (m, p), where in references.items() if (m, p) not in held} == set()


def test_the_reference_finder_sees_what_a_new_use_would_add():
    source = ("from sglang.srt.managers import schedule_batch\nfrom sglang.srt.mem_cache.common import helper\n"
              "schedule_batch.ScheduleBatch.new_method(x).y\n")
    assert sglang_references(source) == {("sglang.srt.managers.schedule_batch", "ScheduleBatch"),
                                         ("sglang.srt.managers.schedule_batch", "ScheduleBatch.new_method"),
                                         ("sglang.srt.mem_cache.common", "helper")}
    assert ("sglang.srt.managers.schedule_batch", "ScheduleBatch.new_method") not in seam_paths()


SUBCLASSES = [adapter.SWATokenToKVPoolAllocator, adapter.PagedTokenToKVPoolAllocator, adapter.TokenToKVPoolAllocator,
              adapter.LockstepSWATokenToKVPoolAllocator, adapter.LockstepPagedTokenToKVPoolAllocator,
              adapter.LockstepTokenToKVPoolAllocator, shared.SharedSWATokenToKVPoolAllocator,
              shared_pool.SharedSWAKVPool, shared_pool._KVViewPool, lockstep._ShadowKVCache]


@pytest.mark.parametrize("ours", SUBCLASSES, ids=lambda c: c.__name__)
def test_every_sglang_method_swa_ext_overrides_is_a_seam(ours):
    """Native methods and Python overrides alike answer SGLang's calls: each is a seam of
    the SGLang class swa_ext's class subclasses."""
    theirs = next(base for base in ours.__mro__ if base.__module__.startswith("sglang."))
    overridden = {name for name in dir(theirs)
                  if not name.startswith("__") and name != "_abc_impl"
                  and inspect.getattr_static(ours, name, None) is not inspect.getattr_static(theirs, name)}
    held = {path for module, path in seam_paths() if module == theirs.__module__}
    assert {f"{theirs.__name__}.{name}" for name in overridden} - held == set()


def test_lockstep_calls_and_rebound_names_are_seams():
    held = seam_paths()
    for module, cls, calls in [("sglang.srt.mem_cache.allocator.swa", "SWATokenToKVPoolAllocator",
                                lockstep._HYBRID_CALLS),
                               ("sglang.srt.mem_cache.allocator.paged", "PagedTokenToKVPoolAllocator",
                                lockstep._POOL_CALLS),
                               ("sglang.srt.mem_cache.allocator.token", "TokenToKVPoolAllocator", lockstep._POOL_CALLS)]:
        assert {call for call in calls if (module, f"{cls}.{call}") not in held} == set(), cls
    assert {name for name in (*installer._REPLACED, "SWAKVPool")
            if (kv_cache_configurator.__name__, name) not in held} == set()


def test_the_fields_the_native_eviction_reads_are_seams():
    """csrc/sglang/batch_reader.cpp reads SGLang's Req and ReqKvInfo through the CPython API."""
    with open(os.path.join(ROOT, "csrc", "sglang", "batch_reader.cpp")) as f:
        source = f.read()

    def names(array):
        return re.findall(r'"(\w+)"', re.search(array + r"\[\] = \{(.*?)\};", source, re.S).group(1))

    req_fields, kv_fields = names("kReqFields"), names("kKvFields")
    methods = re.findall(r'\{&(req|kv)_type, "(\w+)"\}', source)
    assert req_fields and kv_fields and methods
    held, module = seam_paths(), schedule_batch.__name__
    missing = [f"Req().{n}" for n in req_fields if (module, f"Req.{n}") not in held] + \
        [f"ReqKvInfo().{n}" for n in kv_fields if (module, f"ReqKvInfo.{n}") not in held] + \
        [f"{'Req' if owner == 'req' else 'ReqKvInfo'}.{n}" for owner, n in methods
         if (module, f"{'Req' if owner == 'req' else 'ReqKvInfo'}.{n}") not in held]
    assert missing == []


# --- install is all or nothing --------------------------------------------------------

def fail(*args, **kwargs):
    raise RuntimeError("planted failure")


FAILED_INSTALL = "installing swa_ext in SGLang 0.5.23 failed, nothing is patched: "
# A name gone from SGLang is a moved seam: the plugin refuses before it installs anything.
MOVED_NAME = "cannot serve: SGLang 0.5.23 moved 1 of the seams"


@pytest.mark.parametrize("mode,step,plugin_says", [("all", "hooks", FAILED_INSTALL),
                                                   ("all", "pool-builder", FAILED_INSTALL),
                                                   ("all", "third-name", MOVED_NAME),
                                                   ("shared", "pool-name", MOVED_NAME)])
def test_a_failure_midway_through_install_leaves_sglang_unpatched(environment, mode, step, plugin_says):
    before = patched_state()
    if step == "hooks":  # after _init_pools is patched
        environment.setattr(hooks, "install", fail)
    elif step == "pool-builder":  # after _init_pools, the scheduler hook, the hybrid's stand-in
        environment.setattr(installer, "_pool_builder", fail)
    elif step == "third-name":  # two names already rebound
        environment.delattr(kv_cache_configurator, "TokenToKVPoolAllocator")
        before["names"]["TokenToKVPoolAllocator"] = None
    else:  # the shared sizing patched and the hybrid's name rebound
        environment.delattr(kv_cache_configurator, "SWAKVPool")
        before["names"]["SWAKVPool"] = None
    with pytest.raises((RuntimeError, AttributeError)):
        adapter.install(single_pool=mode == "all", shared=mode == "shared")
    assert patched_state() == before
    assert adapter.installed() == [] and not hooks.installed()
    environment.setenv("SWA_EXT_SGLANG", mode)
    message = refused()
    assert f"swa_ext: SWA_EXT_SGLANG={mode}" in message and plugin_says in message
    assert patched_state() == before


def test_an_import_failing_in_the_plugin_is_refused(environment):
    environment.setenv("SWA_EXT_SGLANG", "1")
    environment.delattr(swa_ext, "sglang")
    environment.setitem(sys.modules, "swa_ext.sglang", None)
    before = patched_state()
    assert FAILED_INSTALL + "ModuleNotFoundError" in refused()
    assert patched_state() == before


def test_a_successful_install_is_undone_by_uninstall(environment):
    before = patched_state()
    adapter.install(single_pool=True)
    assert patched_state() != before
    adapter.uninstall()
    assert patched_state() == before


# --- what serves ------------------------------------------------------------------------

@pytest.mark.parametrize("mode,build,says", [
    ("1", lambda: kv_cache_configurator.SWATokenToKVPoolAllocator(256, 128, 16, torch.float16, "cpu",
                                                                   RecordingSWAKVCache(), False),
     "SWATokenToKVPoolAllocator serves a full pool of 256 tokens and an SWA pool of 128 tokens (kernels cpu), "
     "page size 16, on cpu (SWA_EXT_SGLANG=1, SGLang 0.5.23)"),
    ("shared", lambda: kv_cache_configurator.SWATokenToKVPoolAllocator(256, 256, 16, torch.float16, "cpu",
                                                                        RecordingSWAKVCache(), False),
     "SharedSWATokenToKVPoolAllocator serves one budget for full and SWA pages: 256 full or 256 SWA slots, "
     "parent_k 1 (small side full), shared mode (kernels cpu), page size 16, on cpu (SWA_EXT_SGLANG=shared, "
     "SGLang 0.5.23)"),
    # A KV pool of parent pages of 3 full pages or one SWA page: the allocator takes its layout.
    ("shared", lambda: kv_cache_configurator.SWATokenToKVPoolAllocator(768, 256, 16, torch.float16, "cpu",
                                                                        RecordingSWAKVCache(parent_k=3), False),
     "SharedSWATokenToKVPoolAllocator serves one budget for full and SWA pages: 768 full or 256 SWA slots, "
     "parent_k 3 (small side full), shared mode (kernels cpu), page size 16, on cpu (SWA_EXT_SGLANG=shared, "
     "SGLang 0.5.23)"),
    ("all", lambda: kv_cache_configurator.PagedTokenToKVPoolAllocator(256, 16, torch.float16, "cpu", None, False),
     "PagedTokenToKVPoolAllocator serves one pool of 256 tokens, page size 16, on cpu (SWA_EXT_SGLANG=all, "
     "SGLang 0.5.23)"),
], ids=["1", "shared", "shared-parent-pages", "all"])
def test_the_served_line_names_mode_allocator_pools_page_size_and_sglang(environment, caplog, mode, build, says):
    environment.setenv("SWA_EXT_SGLANG", mode)
    sglang_plugin.plugin()
    with caplog.at_level(logging.INFO, logger="swa_ext.sglang"):
        build()
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("swa_ext:")] == [f"swa_ext: {says}"]


# --- swa-ext sglang-check ---------------------------------------------------------------

def test_sglang_check_serving(environment, capsys):
    environment.setenv("SWA_EXT_SGLANG", "shared")
    assert cli.main(["sglang-check"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "SGLang: 0.5.23 (swa_ext supports 0.5.23)"
    count = len(sglang_seams.SEAMS)
    assert out[1] == f"seams: {count} of {count} where swa_ext expects them"
    assert len(out) == count + 3 and all(line.startswith("  ok     sglang.") for line in out[2:-1])
    assert out[-1] == "SWA_EXT_SGLANG=shared serves swa_ext's shared mode: one budget of pages for full and SWA KV"
    assert adapter.installed() == []  # a check, not an install


def test_sglang_check_refusing(environment, capsys):
    environment.delattr(schedule_batch.ReqKvInfo, "swa_dead_lo")
    environment.setenv("SWA_EXT_SGLANG", "1")
    assert cli.main(["sglang-check"]) == 1
    out = capsys.readouterr().out.splitlines()
    count = len(sglang_seams.SEAMS)
    assert out[1] == f"seams: {count - 1} of {count} where swa_ext expects them"
    assert "  moved  sglang.srt.managers.schedule_batch:ReqKvInfo.swa_dead_lo: missing" in out
    assert out[-1].startswith("swa_ext: SWA_EXT_SGLANG=1 cannot serve: SGLang 0.5.23 moved 1 of the seams")
    environment.undo()
    capsys.readouterr()
    for name in [n for n in os.environ if n.startswith("SWA_EXT_")]:
        environment.delenv(name)
    assert cli.main(["sglang-check"]) == 1  # unset: it serves nothing
    assert capsys.readouterr().out.splitlines()[-1] == ("SWA_EXT_SGLANG is unset: swa_ext serves nothing, SGLang's "
                                                        "own allocators serve")


def test_sglang_check_without_sglang(environment, capsys):
    environment.setenv("SWA_EXT_SGLANG", "1")
    environment.setattr(sglang_seams, "installed_version", lambda: None)
    assert cli.main(["sglang-check"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "SGLang: not installed (swa_ext supports 0.5.23)" and len(out) == 2
    assert "SGLang is not installed in this environment" in out[1]


# --- SGLang's real plugin loader, in its offline engine ------------------------------------

@pytest.mark.parametrize("variables,why", [
    ({"SWA_EXT_SGLANG_VERSION_OVERRIDE": "0.5.22"},
     "SWA_EXT_SGLANG_VERSION_OVERRIDE=0.5.22 names another SGLang than the one installed (0.5.23)"),
    ({"SWA_EXT_SGLANGG": "shared"}, "SWA_EXT_SGLANGG: no such swa_ext setting"),
], ids=["version", "unknown-variable"])
def test_sglangs_engine_stops_at_start_up_in_one_line(tiny_model, tmp_path, variables, why):
    env = {name: value for name, value in os.environ.items() if not name.startswith("SWA_EXT_")}
    env.update(variables, SWA_EXT_SGLANG="1", TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([STUBS] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                     if p]))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "engine_run.py"), tiny_model,
                           str(tmp_path / "result.json"), "16", "8192", "default"],
                          env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    lines = [line for line in log.splitlines() if "swa_ext:" in line]
    # engine_run.py imports nothing of swa_ext's: SGLang's plugin loader ran it. Status 1:
    # SystemExit with a message, which no part of SGLang caught.
    assert proc.returncode == 1 and not (tmp_path / "result.json").exists(), log[-4000:]
    assert len(lines) == 1 and lines[0].startswith("swa_ext: ") and why in lines[0], log[-4000:]
    assert log.rstrip().endswith(lines[0])  # the last word, no traceback after it
