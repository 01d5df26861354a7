"""One SGLang offline Engine run on the CPU, for tests/sglang/test_engine.py.

Run as a script in its own process (SWA_EXT_SGLANG and SGLang's checks are read at
start-up): ``python engine_run.py MODEL_DIR RESULT_JSON PAGE_SIZE MAX_TOTAL_TOKENS SWA_RATIO [ATTENTION_BACKEND [WORKLOAD
[LOAD_FORMAT]]]`` (SWA_RATIO ``default`` leaves SGLang's swa_full_tokens_ratio; the backend is triton unless
given; WORKLOAD ``short``, for a model of many layers, keeps the first two requests of each
round and fewer new tokens, still past the window and with radix hits; LOAD_FORMAT ``dummy``:
SGLang's random weights, from the model's config alone).
Two rounds of greedy generation; the second round's prompts share long prefixes with
the first's, so the radix cache hits. Writes the output ids and cached-token counts.
"""
import json
import sys

from pd_harness import offline_engine


# Round 1: four prompts longer than the 64-token window, 40 new tokens each, so the
# window slides during decoding (SWA pages leave it from the first steps). Round 2: the first 80 tokens of each round-1 prompt
# with another tail and the round-1 prompt's last token, so the radix cache hits (and
# test_outputs_depend_on_the_context has a last token seen after another context).
NEW_TOKENS = {"full": (40, 24), "short": (28, 12)}  # per round
REQUESTS = {"full": 4, "short": 2}


def prompts(round_index):
    first = [[(7 * i + 3 * j + j * j % 11) % 500 + 3 for j in range(72 + 8 * i)] for i in range(4)]
    if round_index == 0:
        return first
    return [p[:80] + [(5 * i + j) % 500 + 3 for j in range(12)] + p[-1:] for i, p in enumerate(first)]


def main(model_dir, result_path, page_size, max_total_tokens, swa_ratio, attention_backend="triton",
         workload="full", load_format="auto"):
    ratio = {} if swa_ratio == "default" else {"swa_full_tokens_ratio": float(swa_ratio)}
    engine = offline_engine(model_dir, page_size=page_size, max_total_tokens=max_total_tokens, **ratio,
                            attention_backend=attention_backend, load_format=load_format)
    rounds = []
    try:
        for r, new_tokens in enumerate(NEW_TOKENS[workload]):
            out = engine.generate(input_ids=prompts(r)[:REQUESTS[workload]],
                                  sampling_params={"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True})
            rounds.append([{"output_ids": o["output_ids"], "cached_tokens": o["meta_info"]["cached_tokens"]}
                           for o in out])
    finally:
        engine.shutdown()
    with open(result_path, "w") as f:
        json.dump({"rounds": rounds}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:9])
