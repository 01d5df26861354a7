"""swa_ext: the KV cache page allocator for hybrid sliding-window-attention LLMs."""
import torch  # noqa: F401  (loads libtorch, which the native module links against)

from . import _C
from ._version import __version__
from .allocator import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator, TokenToKVPoolAllocator

ConcurrentUseError = _C.ConcurrentUseError
# A device allocator's check that failed on the GPU, found after its call returned.
DeferredError = _C.DeferredError


def built_with_cuda() -> bool:
    """Whether the installed extension holds the CUDA kernels (even on a machine without a GPU)."""
    return _C.built_with_cuda()


__all__ = [
    "ConcurrentUseError",
    "DeferredError",
    "PagedTokenToKVPoolAllocator",
    "SWATokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "__version__",
    "built_with_cuda",
]
