"""What SGLang's speculative kernels do on a plain ``cpu`` device without each bridge of
tests/sglang/spec_bridges and with it, for tests/sglang/test_spec_engine.py.

Run as a script in its own process (a bridge, once applied, stays for the process):
``python spec_bridges_check.py RESULT_JSON``. For each bridge it calls the SGLang function
the bridge answers, first as SGLang has it, then with the bridge, on a small batch whose
answer the script builds from its inputs, and writes what each call gave.
"""
import json
import sys

import torch

import swa_ext_spec_bridges as bridges

ROWS, WIDTH, DRAFT = 3, 24, 4  # req_to_token rows, their width, draft tokens a request
# A chain of DRAFT tokens after 10 verified ones: its positions and links.
CHAIN_FROM_10 = {"positions": [10 + k for k in range(DRAFT)], "next_token": list(range(1, DRAFT)) + [-1],
                 "next_sibling": [-1] * DRAFT}


def extend_cache_locs():
    """The verify's slots: each request's row from its committed length on."""
    from sglang.kernels.ops.speculative import cache_locs

    req_to_token = torch.arange(ROWS * WIDTH, dtype=torch.int32).reshape(ROWS, WIDTH) + 100
    rows, seq_lens = torch.tensor([2, 0]), torch.tensor([5, 9])
    want = torch.cat([req_to_token[r, s:s + DRAFT] for r, s in zip(rows.tolist(), seq_lens.tolist())]).tolist()

    def call():
        out = cache_locs.assign_extend_cache_locs_func(req_pool_indices=rows, req_to_token=req_to_token,
                                                       start_offset=seq_lens, end_offset=seq_lens + DRAFT,
                                                       batch_size=2, draft_token_num=DRAFT, device="cpu")
        return None if out is None else out.tolist()

    without = call()
    bridges.extend_cache_locs()
    return {"without": without, "with": call(), "want": want}


def greedy_verify():
    """One chain of DRAFT tokens whose first two agree with the target: two drafts and the
    target's next token accepted."""
    from sglang.kernels.ops.speculative import spec_tree

    candidates = torch.tensor([[7, 11, 12, 13]])  # the verified token, then three drafts
    target_predict = torch.tensor([[11, 12, 40, 41]])  # the target agrees on 11 and 12, then says 40
    retrieve_index = torch.arange(DRAFT).reshape(1, DRAFT)
    retrieve_next_token = torch.tensor([[1, 2, 3, -1]])
    retrieve_next_sibling = torch.full((1, DRAFT), -1)
    want = {"accepted_drafts": 2, "accept_index": [0, 1, 2, -1], "predict": [11, 12, 40]}

    def call():
        predicts = torch.full((DRAFT,), -7, dtype=torch.int32)
        accept_index = torch.full((1, DRAFT), -1, dtype=torch.int32)
        accept_token_num = torch.full((1,), -7, dtype=torch.int32)  # what torch.empty might hold
        spec_tree.verify_tree_greedy_func(predicts=predicts, accept_index=accept_index,
                                          accept_token_num=accept_token_num, candidates=candidates,
                                          retrieve_index=retrieve_index, retrieve_next_token=retrieve_next_token,
                                          retrieve_next_sibling=retrieve_next_sibling, target_predict=target_predict,
                                          topk=1)
        return {"accepted_drafts": int(accept_token_num[0]), "accept_index": accept_index[0].tolist(),
                "predict": predicts[:3].tolist()}

    without = call()
    bridges.greedy_verify()
    return {"without": without, "with": call(), "want": want}


def tree_build():
    """The EAGLE v2 verify tree of one chain of DRAFT tokens (topk 1: each draft's parent the
    one before): positions from the verified length on, each node's next the node after it."""
    from sglang.kernels.ops.speculative import spec_tree
    from sglang.srt.speculative.eagle_utils import TreeMaskMode

    def call():
        tree_mask = torch.zeros(DRAFT * (10 + DRAFT), dtype=torch.bool)
        positions = torch.zeros(DRAFT, dtype=torch.int64)
        retrieve = [torch.full((1, DRAFT), -1, dtype=torch.int64) for _ in range(3)]  # as build_tree_kernel_efficient
        try:
            spec_tree.build_tree_kernel_efficient_func(torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2]]),
                                                       torch.tensor([10]), tree_mask, positions, *retrieve, 1,
                                                       DRAFT - 1, DRAFT, TreeMaskMode.FULL_MASK)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return {"positions": positions.tolist(), "next_token": retrieve[1][0].tolist(),
                "next_sibling": retrieve[2][0].tolist()}

    without = call()
    bridges.tree_build()
    return {"without": without, "with": call(), "want": CHAIN_FROM_10}


def tree_mask_op():
    """NGRAM's verify metadata from a chain's tree mask: positions from the verified length on,
    each node's next the node after it."""
    try:
        import sglang.srt.speculative.ngram_worker  # noqa: F401
        without = "imported"
    except ImportError as e:
        without = f"{type(e).__name__}: {e}"
    bridges.tree_mask_op()
    from sglang.kernels.ops.speculative import reconstruct_tree

    mask = torch.tril(torch.ones(DRAFT, DRAFT, dtype=torch.bool)).reshape(-1)  # a chain: every earlier node
    positions = torch.zeros(DRAFT, dtype=torch.int64)
    retrieve_index, retrieve_next_token, retrieve_next_sibling = (torch.zeros(1, DRAFT, dtype=torch.int64)
                                                                  for _ in range(3))
    reconstruct_tree.reconstruct_indices_from_tree_mask_func(mask, torch.tensor([10]), positions, retrieve_index,
                                                             retrieve_next_token, retrieve_next_sibling, 1, DRAFT)
    import sglang.srt.speculative.ngram_worker  # noqa: F401, E402  (the worker imports now)

    got = {"positions": positions.tolist(), "next_token": retrieve_next_token[0].tolist(),
           "next_sibling": retrieve_next_sibling[0].tolist()}
    return {"without": without, "with": got, "want": CHAIN_FROM_10}


def main(result_path):
    with open(result_path, "w") as f:
        json.dump({name: globals()[name]() for name in bridges.BRIDGES}, f)


if __name__ == "__main__":
    main(sys.argv[1])
