"""One SGLang offline Engine run with speculative decoding on the CPU, for
tests/sglang/test_spec_engine.py.

Run as a script in its own process (SWA_EXT_SGLANG, SWA_EXT_SPEC_BRIDGES and SGLang's checks
are read at start-up): ``python spec_engine_run.py MODEL_DIR DRAFT_DIR RESULT_JSON ALGORITHM
DRAFT_TOKENS PAGE_SIZE MAX_TOTAL_TOKENS LOAD_FORMAT`` (DRAFT_DIR ``-`` for NGRAM; LOAD_FORMAT
``dummy``: SGLang's random weights for the model and its draft, from their configs alone). One round of greedy
generation on prompts that repeat themselves (so NGRAM's drafts are sometimes right);
writes the output ids, cached-token counts and the accepted-draft counts.
"""
import json
import sys

from pd_harness import offline_engine

NEW_TOKENS = 36


def prompts():
    # Four prompts of one to two 64-token windows, each a short phrase repeated with drift.
    out = []
    for i in range(4):
        phrase = [(11 * i + 5 * j) % 500 + 3 for j in range(6 + i)]
        out.append([t + (k // 3) % 2 for k in range(10 + 2 * i) for t in phrase][: 70 + 12 * i])
    return out


def main(model_dir, draft_dir, result_path, algorithm, draft_tokens, page_size, max_total_tokens, load_format):
    spec = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": draft_tokens}
    if load_format == "dummy":
        spec.update(load_format="dummy", speculative_draft_load_format="dummy")
    if algorithm == "NGRAM":
        # One chain of draft tokens (a tree needs the tree-mask attention of a GPU backend).
        spec.update(speculative_ngram_max_bfs_breadth=1, speculative_ngram_min_bfs_breadth=1)
    else:
        spec.update(speculative_draft_model_path=draft_dir, speculative_num_steps=draft_tokens - 1,
                    speculative_eagle_topk=1, speculative_draft_attention_backend="triton")
    engine = offline_engine(model_dir, page_size=page_size, max_total_tokens=max_total_tokens,
                            swa_full_tokens_ratio=1.0, **spec)
    try:
        out = engine.generate(input_ids=prompts(),
                              sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True})
    finally:
        engine.shutdown()
    rows = [{"output_ids": o["output_ids"], "cached_tokens": o["meta_info"]["cached_tokens"],
             "spec_verify_ct": o["meta_info"].get("spec_verify_ct")} for o in out]
    with open(result_path, "w") as f:
        json.dump({"rows": rows}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]),
         sys.argv[8])
