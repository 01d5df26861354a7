"""swa_ext: the KV cache page allocator for hybrid sliding-window-attention LLMs."""
import importlib
import os
import signal
import sys

from ._version import __version__

# Run as the swa-ext command (its script, or python -m swa_ext), a Ctrl-C from here on is
# noted until swa_ext.cli, which loads next, takes over: it ends the command with one line
# and status 130. Imported as a library, SIGINT is left alone.
_argv = getattr(sys, "orig_argv", [])
_AS_COMMAND = os.path.basename(sys.argv[0]) == "swa-ext" or ["-m", "swa_ext"] in (
    _argv[i:i + 2] for i in range(len(_argv)))
_noted_interrupts = []
if _AS_COMMAND:
    signal.signal(signal.SIGINT, lambda signum, frame: _noted_interrupts.append(signum))

# The native module links against libtorch, and importing torch takes seconds: both load on
# first use, so that the swa-ext command parses its arguments and handles Ctrl-C before.
_ALLOCATORS = ("PagedTokenToKVPoolAllocator", "SWATokenToKVPoolAllocator", "TokenToKVPoolAllocator")
# DeferredError: a device allocator's check that failed on the GPU, found after its call returned;
# parent_k: the shared mode's parent pages for two KV entry sizes (SPEC.md section 8.1).
_NATIVE = ("_C", "ConcurrentUseError", "DeferredError", "parent_k")


def __getattr__(name):
    if name in _NATIVE:
        import torch  # noqa: F401  (loads libtorch, which the native module links against)

        native = importlib.import_module("._C", __name__)
        value = native if name == "_C" else getattr(native, name)
    elif name in _ALLOCATORS:
        value = getattr(importlib.import_module(".allocator", __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def built_with_cuda() -> bool:
    """Whether the installed extension holds the CUDA kernels (even on a machine without a GPU)."""
    return __getattr__("_C").built_with_cuda()


__all__ = [
    "ConcurrentUseError",
    "DeferredError",
    "PagedTokenToKVPoolAllocator",
    "SWATokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "__version__",
    "built_with_cuda",
    "parent_k",
]
