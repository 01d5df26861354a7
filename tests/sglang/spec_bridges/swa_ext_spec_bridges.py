"""A test-only SGLang plugin (tests/sglang/spec_engine_run.py puts this directory, with its
dist-info, on the engine's PYTHONPATH; SGLang loads it in each of its processes).

SGLang 0.5.23 runs speculative decoding on CUDA, ROCm, XPU, NPU and its own CPU engine
(``SGLANG_USE_CPU_ENGINE``, sgl_kernel's CPU ops), not on a plain ``cpu`` torch device,
where tests/sglang runs its engine. ``SWA_EXT_SPEC_BRIDGES`` (a comma-separated list of the
names below) gives it, each on its own, what it lacks there, as the path another device
already has. None of them calls the KV allocator or changes what it is asked: they compute
where a forward writes and which draft tokens the target accepts, from the slots SGLang's
scheduler already allocated.
"""
import os
import sys
import types

VARIABLE = "SWA_EXT_SPEC_BRIDGES"


def _replace(module, name, bridge):
    """Puts ``bridge`` in place of ``module.name`` and of every copy of that function an SGLang
    module imported by name before this plugin ran."""
    original = getattr(module, name)
    for loaded in list(sys.modules.values()):
        if getattr(loaded, "__name__", "").startswith("sglang.") and getattr(loaded, name, None) is original:
            setattr(loaded, name, bridge)


def tree_mask_op():
    """``sglang.kernels.ops.speculative.reconstruct_tree`` imports
    ``sgl_kernel.speculative.reconstruct_indices_from_tree_mask`` at import time on every
    device but CUDA, ROCm and XPU; a CPU install has no sgl_kernel, so the NGRAM worker
    cannot be imported (``ModuleNotFoundError: No module named 'sgl_kernel'``). The name is
    answered, for that one import, by the same module's Triton kernel, which XPU runs and
    whose contract is that op's; ``sgl_kernel`` stays absent for every other import."""
    added = [name for name in ("sgl_kernel", "sgl_kernel.speculative") if name not in sys.modules]
    op = types.ModuleType("sgl_kernel.speculative")

    def reconstruct_indices_from_tree_mask(*args):
        from sglang.kernels.ops.speculative import reconstruct_tree

        return reconstruct_tree.reconstruct_indices_from_tree_mask_triton(*args)

    op.reconstruct_indices_from_tree_mask = reconstruct_indices_from_tree_mask
    if "sgl_kernel" in added:
        sys.modules["sgl_kernel"] = types.ModuleType("sgl_kernel")
    sys.modules["sgl_kernel.speculative"] = op
    try:
        import sglang.kernels.ops.speculative.reconstruct_tree  # noqa: F401
    finally:
        for name in added:
            del sys.modules[name]


def greedy_verify():
    """``verify_tree_greedy_func`` (the target's greedy acceptance of draft tokens) has a path
    on CUDA, ROCm, MUSA, SGLang's CPU engine, NPU and XPU; on any other device it ends in
    ``reject_out_of_tree_path``, which raises for out-of-tree platforms only, so on a plain
    ``cpu`` it returns without writing: the accepted counts stay ``torch.empty``'s bytes, and
    the kernels that move the accepted slots by those counts write out of bounds (the
    scheduler aborts, "Fatal Python error: Aborted"). On a plain ``cpu`` it takes XPU's path,
    ``verify_tree_greedy_triton`` (Triton, interpreted)."""
    from sglang.kernels.ops.speculative import spec_tree

    def verify_tree_greedy_func(predicts, accept_index, accept_token_num, candidates, retrieve_index,
                                retrieve_next_token, retrieve_next_sibling, target_predict, topk=-1):
        spec_tree.verify_tree_greedy_triton(
            predicts=predicts, accept_index=accept_index, accept_token_num=accept_token_num,
            candidates=candidates, retrieve_index=retrieve_index, retrieve_next_token=retrieve_next_token,
            retrieve_next_sibling=retrieve_next_sibling, target_predict=target_predict)
        return predicts, accept_index, accept_token_num

    _replace(spec_tree, "verify_tree_greedy_func", verify_tree_greedy_func)


def tree_build():
    """``build_tree_kernel_efficient_func`` (the EAGLE v2 draft's verify tree: mask, positions
    and the next/sibling links of the draft tokens) calls sgl_kernel's op on every device but
    NPU, XPU and SGLang's CPU engine; that op is imported on CUDA, ROCm and MUSA only, so on a
    plain ``cpu`` the EAGLE and STANDALONE workers fail at their first draft (``NameError:
    name 'sgl_build_tree_kernel_efficient' is not defined``). There it takes XPU's path,
    ``sgl_build_tree_kernel_triton`` (Triton, interpreted)."""
    from sglang.kernels.ops.speculative import spec_tree

    def build_tree_kernel_efficient_func(*args):
        spec_tree.sgl_build_tree_kernel_triton(*args)

    _replace(spec_tree, "build_tree_kernel_efficient_func", build_tree_kernel_efficient_func)


def extend_cache_locs():
    """``assign_extend_cache_locs_func`` (the slots a verify writes: each request's
    ``req_to_token`` row from its committed length on) falls through every device branch on
    a plain ``cpu`` and returns None, which the verify forward then fails on. There it runs
    the kernel CUDA runs, ``assign_extend_cache_locs`` (Triton, interpreted), on the same
    row and offsets."""
    import torch
    from sglang.kernels.ops.speculative import cache_locs
    from sglang.srt.utils import next_power_of_2

    def assign_extend_cache_locs_func(req_pool_indices, req_to_token, start_offset, end_offset, batch_size,
                                      draft_token_num, device):
        out_cache_loc = torch.empty((batch_size * draft_token_num,), dtype=torch.int64, device=device)
        cache_locs.assign_extend_cache_locs[(batch_size,)](
            req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, req_to_token.shape[1],
            next_power_of_2(batch_size))
        return out_cache_loc

    _replace(cache_locs, "assign_extend_cache_locs_func", assign_extend_cache_locs_func)


BRIDGES = {"tree_mask_op": tree_mask_op, "tree_build": tree_build, "greedy_verify": greedy_verify,
           "extend_cache_locs": extend_cache_locs}


def plugin():
    names = [n.strip() for n in os.environ.get(VARIABLE, "").split(",") if n.strip()]
    unknown = set(names) - set(BRIDGES)
    if unknown:
        raise ValueError(f"{VARIABLE}: unknown bridges {sorted(unknown)}; known: {sorted(BRIDGES)}")
    for name in names:
        BRIDGES[name]()
