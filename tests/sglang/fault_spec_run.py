"""One SGLang offline Engine with NGRAM speculative decoding, for tests/sglang/test_faults.py:
an abort while the requests verify drafts, then the same requests again.

Run as a script in its own process (the environment of test_spec_engine.engine_env, with the
probe plugin): ``python fault_spec_run.py MODEL_DIR RESULT_JSON PAGE_SIZE MAX_TOTAL_TOKENS``.
Round one streams spec_engine_run's four prompts at once and aborts the first after its
first verified chunks (SGLang finishes an aborted running request at its next step: a
verify); round two runs the four to the end. Writes round one's finish reasons and tokens,
round two's outputs, and the allocator's pools once the prefix cache is flushed.
"""
import asyncio
import json
import os
import sys
import time

import pd_harness
import spec_engine_run

DRAFT_TOKENS = 4
ABORT_AFTER_CHUNKS = 2
FLUSH_TIMEOUT_S = 60


def flush(engine):
    """Empties the prefix cache. SGLang flushes an idle scheduler only, and the last answer
    can leave before its request is released: tried again until it flushes."""
    deadline = time.monotonic() + FLUSH_TIMEOUT_S
    while not engine.flush_cache().success:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the prefix cache not flushed after {FLUSH_TIMEOUT_S} s")
        time.sleep(0.5)


def main(model_dir, result_path, page_size, max_total_tokens):
    engine = pd_harness.offline_engine(model_dir, page_size=page_size, max_total_tokens=max_total_tokens,
                                       swa_full_tokens_ratio=1.0, speculative_algorithm="NGRAM",
                                       speculative_num_draft_tokens=DRAFT_TOKENS, speculative_ngram_max_bfs_breadth=1,
                                       speculative_ngram_min_bfs_breadth=1)
    prompts = spec_engine_run.prompts()
    params = {"temperature": 0, "max_new_tokens": spec_engine_run.NEW_TOKENS, "ignore_eos": True}

    async def streamed(i):
        rid = f"round1-{i}"
        chunks, last = 0, None
        async for out in await engine.async_generate(input_ids=prompts[i], sampling_params=params, stream=True,
                                                     rid=rid):
            chunks, last = chunks + 1, out
            if i == 0 and chunks == ABORT_AFTER_CHUNKS:
                engine.tokenizer_manager.abort_request(rid)
        return {"finish_reason": last["meta_info"]["finish_reason"], "tokens": len(last["output_ids"]),
                "spec_verify_ct": last["meta_info"].get("spec_verify_ct")}

    async def round_one():
        return await asyncio.gather(*(streamed(i) for i in range(len(prompts))))

    try:
        first = engine.loop.run_until_complete(round_one())
        second = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        # The prefix cache keeps the finished requests' KV: emptied, both pools are whole.
        flush(engine)
        calls = pd_harness.settled_allocator_calls(os.environ["SWA_EXT_PD_PROBE_DIR"])
    finally:
        engine.shutdown()
    with open(result_path, "w") as f:
        json.dump({"round1": first, "round2": second, "calls": calls}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
