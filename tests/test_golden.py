"""Every golden trace recorded from SGLang 0.5.23 replays exactly through the native allocator."""
import pytest
import torch

import swa_ext
from golden_replay import load_trace, replay, trace_paths


def make_native(init, device="cpu"):
    return swa_ext.SWATokenToKVPoolAllocator(
        size=init["size"], size_swa=init["size_swa"], page_size=init["page_size"],
        dtype=torch.bfloat16, device=device, need_sort=init["need_sort"],
    )


def to_tensor(values):
    return torch.tensor(values, dtype=torch.int64)


@pytest.mark.parametrize("path", trace_paths(), ids=lambda p: p.name.split(".")[0])
def test_golden_trace_replays_exactly_on_cpu(path):
    replay(load_trace(path), make_native, to_tensor, lambda t: t.tolist(), name=path.name)


def test_all_traces_present():
    assert len(trace_paths()) == 36
