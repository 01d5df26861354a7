"""swa_ext as SGLang's KV page allocator (docs/sglang.md).

The package, one file for each part:

- ``adapters``: the classes that ARE SGLang 0.5.23's allocator types, served by swa_ext;
- ``lockstep``: SGLang's own allocator shadowing every call (``LockstepDivergence``);
- ``installer``: which allocator SGLang builds, and ``install()`` / ``uninstall()``;
- ``shared``, ``shared_pool``: the shared mode (``SWA_EXT_SGLANG=shared``): one budget of pages
  for full and SWA KV, the scheduler's capacity gates priced on it, the KV pool whose SWA
  layers use the full layers' storage, sized at SGLang's KV bytes;
- ``hooks``: the scheduler's per-step SWA bookkeeping (``maybe_evict_swa``) as one
  native call (docs/sglang-eviction.md).

The plugin entry point SGLang loads is ``swa_ext.sglang_plugin.plugin``.

``install()`` makes SGLang build swa_ext's classes: it rebinds the allocator names in
``sglang.srt.mem_cache.kv_cache_configurator``, the one module that constructs
allocators. SGLang loads ``swa_ext.sglang_plugin.plugin`` (entry point group
``sglang.srt.plugins``) in every process it starts; it installs according to
``SWA_EXT_SGLANG``:

- unset, empty or ``0``: nothing (SGLang's allocators serve);
- ``1``: swa_ext serves the hybrid SWA allocator;
- ``all``: also the single-pool allocators of non-SWA models;
- ``lockstep``: as ``all``, and SGLang's own allocator shadows every call (hybrid and
  sub-allocator calls); the first difference in returned indices, available sizes or
  the mapping raises ``LockstepDivergence`` naming the call and its arguments;
- ``shared``: swa_ext's shared mode serves the hybrid SWA allocator: one budget of pages
  for full and SWA KV; a configuration it cannot serve is refused at start-up in one line.

Any other value (or the retired ``SWA_EXT_SHARED``) ends the process at start-up with one
``swa_ext:`` line (swa_ext.sglang_plugin), as does an unknown ``SWA_EXT_`` variable, an
SGLang other than the supported one or a seam of SGLang's that moved
(swa_ext.sglang_seams).

Where swa_ext cannot serve a configuration (the per-request SWA ring, a device other
than cpu/cuda, a platform's own paged allocator such as the NPU's, cuda with a CPU-only
build of swa_ext), SGLang's class is built instead and a warning says why.

Under every value but ``0`` the scheduler hook is installed too (``hooks``); where a
request or a batch needs a rule the native call does not cover, SGLang's own loop
serves it and a warning says why, once.

sglang is imported when this package is; ``import swa_ext`` does not import it.
"""
from .adapters import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator, TokenToKVPoolAllocator
from .installer import _REPLACED, install, installed, uninstall
from .lockstep import (LOCKSTEP_REPORT_VARIABLE, LockstepDivergence, LockstepPagedTokenToKVPoolAllocator,
                       LockstepSWATokenToKVPoolAllocator, LockstepTokenToKVPoolAllocator)

__all__ = ["LOCKSTEP_REPORT_VARIABLE", "LockstepDivergence", "LockstepPagedTokenToKVPoolAllocator",
           "LockstepSWATokenToKVPoolAllocator", "LockstepTokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator",
           "SWATokenToKVPoolAllocator", "TokenToKVPoolAllocator", "install", "installed", "uninstall"]
