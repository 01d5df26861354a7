"""Whether this machine and build can run the CUDA backend (shared by the tests)."""
import torch

import swa_ext


def cuda_skip_reason():
    """Why the CUDA tests cannot run here, or None when they can."""
    if not swa_ext.built_with_cuda():
        return "this swa_ext build has no CUDA kernels (build with a CUDA torch, or USE_CUDA=1)"
    if not torch.cuda.is_available():
        return "no GPU on this machine"
    return None
