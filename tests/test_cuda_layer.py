"""The CUDA layer under the device algorithm (csrc/torch/cuda_executor.cpp, csrc/cuda).

- a pool larger than one pass of the kernels' grid (4096 blocks of 256 threads) gives
  what the CPU core gives: the grid-stride loop reaches every element (also run with
  the device algorithm emulated on the CPU, which checks the test itself);
- a serving lifecycle whose calls run on a side stream, on an allocator built on the
  default stream behind a long kernel, gives the CPU core's results;
- a launch is not failed by an error an earlier, unrelated CUDA call left behind;
- a device fault names the last op the allocator launched, and freeing the allocator
  afterwards logs instead of terminating the process;
- waits for the GPU release the GIL, and another thread's call on the same allocator
  waits for the call in progress instead of raising ConcurrentUseError;
- uploads take no device memory per call (the staging ring and input buffer persist).

All but the first skip without a GPU.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import swa_ext
from cuda_support import cuda_skip_reason

# One pass of the grid: csrc/cuda/kernels.cu's kMaxBlocks blocks of kThreads threads.
GRID_ELEMENTS = 4096 * 256
BIG_POOL = 1_200_000  # pages (page size 1): more than one pass of the grid


def needs_gpu():
    reason = cuda_skip_reason()
    if reason:
        pytest.skip(reason)


def T(values, device="cpu"):
    return torch.tensor(list(values), dtype=torch.int64, device=device)


@pytest.mark.parametrize("kernels", ["emulated", "cuda"])
def test_a_pool_past_one_grid_pass_matches_the_cpu_core(kernels, monkeypatch):
    monkeypatch.delenv("SWA_EXT_DEBUG", raising=False)
    if kernels == "cuda":
        needs_gpu()
    device = "cuda" if kernels == "cuda" else "cpu"
    assert BIG_POOL > GRID_ELEMENTS + 50_000
    allocs = [swa_ext.SWATokenToKVPoolAllocator(BIG_POOL, BIG_POOL, 1, torch.bfloat16, dev, need_sort=True, kernels=k)
              for dev, k in (("cpu", "auto"), (device, kernels))]
    n = BIG_POOL - 1000  # nearly every page, in one alloc_extend: AllocSlotsOp over n elements
    results = []
    for a in allocs:
        dev = a.device
        zero, seq = T([0]), T([n])
        rows = a.alloc_extend(zero.to(dev), zero, seq.to(dev), seq, T([-1], dev), n)
        assert rows is not None
        # Free every other run of 1000 slots (the release ops over most of the pool), then
        # merge the sorted free list (ops over every page) and allocate across it again.
        cut = rows.view(-1, 1000)[::2].reshape(-1)
        a.free(cut)
        a.free_swa_segment(rows[1000:2000], start_pos=1000)  # a run the free above kept
        again = a.alloc(len(cut) + 500)
        assert again is not None
        results.append((rows.cpu().tolist()[-3:], again.cpu().tolist(), a.available_size(),
                        a.full_available_size(), a.swa_available_size()))
    assert results[0] == results[1]
    assert allocs[0].backup_state() == allocs[1].backup_state()
    assert allocs[0].full_to_swa_index_mapping.tolist() == allocs[1].full_to_swa_index_mapping.cpu().tolist()
    allocs[1].check_invariants()
    allocs[1].check_device_errors()


def test_a_serving_lifecycle_on_a_side_stream(monkeypatch):
    needs_gpu()
    from test_cuda import ServingScript, host_values

    monkeypatch.delenv("SWA_EXT_DEBUG", raising=False)
    # The allocator is built (its state reset) on the default stream behind a long kernel;
    # every call then runs on a side stream. Without ordering the side stream after the
    # allocator's earlier work, the calls would read the pools before their reset lands.
    for ps in (1, 16):
        script = ServingScript(ps, "cuda")  # its tensors first: building them waits for the GPU
        side = torch.cuda.Stream()
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU cycles on the default stream
        alloc = script.make_alloc("cuda", "auto")
        with torch.cuda.stream(side):
            rtt = script.new_req_to_token()
            got = script.run(alloc, rtt)
            got_host = host_values(got)  # reads on the side stream
            rtt_host = rtt.cpu().tolist()
            state = alloc.backup_state()
            alloc.check_device_errors()
        cpu_script = ServingScript(ps, "cpu")
        cpu = cpu_script.make_alloc("cpu", "auto")
        cpu_rtt = cpu_script.new_req_to_token()
        assert got_host == host_values(cpu_script.run(cpu, cpu_rtt)), f"page size {ps}"
        assert rtt_host == cpu_rtt.tolist()
        assert state == cpu.backup_state()
        # Back on the default stream: the allocator's next calls follow the side stream's.
        torch.cuda._sleep(50_000_000)
        with torch.cuda.stream(side):
            torch.cuda._sleep(100_000_000)
            out = alloc.alloc(2 * ps)
        again = alloc.alloc(2 * ps)
        assert out is not None and again is not None
        assert not set(out.cpu().tolist()) & set(again.cpu().tolist())
        alloc.check_invariants()


def _cudart():
    """The CUDA runtime library torch (and swa_ext) use, as loaded in this process."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart" in line}
    if not paths:
        pytest.skip("libcudart is not loaded as a shared library here")
    return ctypes.CDLL(sorted(paths)[0])


def test_a_stale_error_from_another_call_does_not_fail_a_launch(monkeypatch):
    needs_gpu()
    monkeypatch.delenv("SWA_EXT_DEBUG", raising=False)
    alloc = swa_ext.SWATokenToKVPoolAllocator(4096, 2048, 16, torch.bfloat16, "cuda")
    cudart = _cudart()
    seq = T([64 + 1])
    seq_dev = seq.cuda()
    torch.cuda.synchronize()
    # An earlier caller's failed call leaves an error in the runtime's last-error slot;
    # only allocator calls follow until it is cleared (torch's own launch checks read it).
    assert cudart.cudaSetDevice(ctypes.c_int(10_000)) != 0
    try:
        out = alloc.alloc(64)
        dec = alloc.alloc_decode(seq_dev, seq, out[-1:])
    finally:
        cudart.cudaGetLastError()
    assert out is not None and dec is not None and out.numel() == 64 and dec.numel() == 1
    alloc.free(torch.cat([out, dec]))
    assert alloc.available_size() == 2048
    alloc.check_invariants()


FAULT_CHILD = textwrap.dedent("""
    import gc, sys, torch, swa_ext
    alloc = swa_ext.SWATokenToKVPoolAllocator(4096, 2048, 16, torch.bfloat16, "cuda")
    seq = torch.tensor([300])
    zero = torch.tensor([0])
    rows = alloc.alloc_extend(zero.cuda(), zero, seq.cuda(), seq, torch.tensor([-1]).cuda(), 300)
    alloc.free(rows[:100])  # a page pool's free: a count read-back is due
    # A fault on the allocator's stream (an out-of-bounds index: a device-side assert).
    x = torch.zeros(4, device="cuda")
    x[torch.tensor([1 << 40], device="cuda")] = 1.0
    try:
        alloc.alloc(32)
        alloc.available_size()
        torch.cuda.synchronize()
    except RuntimeError as e:
        print("RAISED:", e, flush=True)
    del alloc
    gc.collect()
    print("TEARDOWN_OK", flush=True)
    sys.stdout.flush()
    import os
    os._exit(0)
""")


def test_a_device_fault_names_the_last_op_and_teardown_logs_it():
    needs_gpu()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("CUDA_LAUNCH_BLOCKING", None)
    proc = subprocess.run([sys.executable, "-c", FAULT_CHILD], capture_output=True, text=True, timeout=120, env=env)
    out = proc.stdout + proc.stderr
    assert "TEARDOWN_OK" in proc.stdout, f"the allocator's teardown after a fault ended the process:\n{out[-3000:]}"
    raised = [line for line in proc.stdout.splitlines() if line.startswith("RAISED:")]
    assert raised, out[-3000:]
    if "swa_ext CUDA" in raised[0]:  # our wait saw the fault first (else torch's did)
        assert "the last op this allocator launched: dev::" in raised[0], raised[0]


def test_waits_release_the_gil_and_a_second_thread_waits_its_turn(monkeypatch):
    needs_gpu()
    monkeypatch.delenv("SWA_EXT_DEBUG", raising=False)
    ps = 16
    alloc = swa_ext.SWATokenToKVPoolAllocator(64 * ps, 32 * ps, ps, torch.bfloat16, "cuda")
    seq, zero = T([5 * ps + 3]), T([0])
    rows = alloc.alloc_extend(zero.cuda(), zero, seq.cuda(), seq, T([-1], "cuda"), 5 * ps + 3)
    assert alloc.available_size() == (32 - 6) * ps
    torch.cuda.synchronize()
    ticks, errors, second = [0], [], []
    done = threading.Event()

    def ticker():  # runs only while no thread holds the GIL for long
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0)

    def caller():  # a call on the same allocator while the main thread waits in one
        time.sleep(0.05)
        try:
            second.append(alloc.alloc(ps))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    torch.cuda._sleep(400_000_000)  # about 0.2 s: the free and its count read-back queue behind it
    alloc.free(rows)  # a page pool's free: the next count needs a read-back
    threads = [threading.Thread(target=ticker), threading.Thread(target=caller)]
    for t in threads:
        t.start()
    before, t0 = ticks[0], time.perf_counter()
    first = alloc.alloc(2 * ps)  # waits for the read-back, holding the allocator's guard
    waited, during = time.perf_counter() - t0, ticks[0] - before
    done.set()
    for t in threads:
        t.join()
    assert waited > 0.05, f"the call waited {waited:.3f} s only: the test did not make it wait"
    assert during > 1000, f"other threads ran {during} steps in a {waited:.3f} s wait: the GIL was held"
    assert not errors, errors
    assert first is not None and second and second[0] is not None
    assert not set(first.cpu().tolist()) & set(second[0].cpu().tolist())
    assert alloc.available_size() == (32 - 3) * ps
    alloc.check_invariants()


def test_uploads_take_no_device_memory_per_call(monkeypatch):
    needs_gpu()
    monkeypatch.delenv("SWA_EXT_DEBUG", raising=False)
    alloc = swa_ext.SWATokenToKVPoolAllocator(1 << 16, 1 << 15, 1, torch.bfloat16, "cuda")
    batch = 256
    seq0 = T([40] * batch)
    zero = T([0] * batch)
    rows = alloc.alloc_extend(zero.cuda(), zero, seq0.cuda(), seq0, T([-1] * batch, "cuda"), 40 * batch)
    last = rows.view(batch, 40)[:, -1].contiguous()
    steps = []
    for k in range(1, 21):
        s = T([40 + k] * batch)
        steps.append((s.cuda(), s))
    torch.cuda.synchronize()
    for s_dev, s_host in steps[:4]:  # warm: the ring's slots and the input buffer exist now
        last = alloc.alloc_decode(s_dev, s_host, last)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for s_dev, s_host in steps[4:]:
        last = alloc.alloc_decode(s_dev, s_host, last)
    calls = len(steps) - 4
    taken = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    assert taken <= calls, f"{taken} device allocations in {calls} alloc_decode calls (one output each)"
    alloc.check_invariants()
