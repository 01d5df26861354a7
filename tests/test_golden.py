"""Every golden trace recorded from SGLang 0.5.23 replays exactly through the native allocator.

Three backends run the same replay: the CPU core, the device algorithm with its kernels
emulated on the CPU (kernels="emulated"), and the CUDA kernels on a GPU.
"""
import pytest
import torch

import swa_ext
from cuda_support import cuda_skip_reason
from golden_replay import load_trace, replay, trace_paths

BACKENDS = ["cpu", "emulated", "cuda"]


def backend_device(backend):
    """(device, kernels) of a backend; skips the test where the backend cannot run."""
    if backend == "cuda":
        reason = cuda_skip_reason()
        if reason:
            pytest.skip(reason)
        return "cuda", "auto"
    return "cpu", "emulated" if backend == "emulated" else "auto"


def make_native(init, device="cpu", kernels="auto"):
    return swa_ext.SWATokenToKVPoolAllocator(
        size=init["size"], size_swa=init["size_swa"], page_size=init["page_size"],
        dtype=torch.bfloat16, device=device, need_sort=init["need_sort"], kernels=kernels,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", trace_paths(), ids=lambda p: p.name.split(".")[0])
def test_golden_trace_replays_exactly(path, backend):
    device, kernels = backend_device(backend)
    alloc_box = []

    def make(init):
        alloc_box.append(make_native(init, device, kernels))
        return alloc_box[-1]

    replay(load_trace(path), make, lambda v: torch.tensor(v, dtype=torch.int64, device=device),
           lambda t: t.tolist(), name=path.name, to_host_arg=lambda v: torch.tensor(v, dtype=torch.int64))
    alloc_box[0].check_invariants()


def test_all_traces_present():
    names = [p.name for p in trace_paths()]
    assert len(names) == 44 and sum(n.startswith("spec_") for n in names) == 8  # SPEC.md sections 6 and 7
