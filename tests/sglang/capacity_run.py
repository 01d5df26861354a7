"""One SGLang offline Engine run of tests/sglang/test_shared_engine.py's capacity workload on
the CPU: ``python capacity_run.py MODEL_DIR RESULT_JSON`` (SWA_EXT_SGLANG and
SGLang's checks are read at start-up, so each mode is its own process). Writes the output ids;
the scheduler logs every decode step's ``#running-req``.

The workload SGLang's fixed split mis-sizes: prompts of 960 tokens (15 windows of the tiny
model), 16 new tokens each, SGLang's 0.8 fallback SWA ratio. Its full pool of 4096 tokens
holds four such requests; its SWA pool, 0.8 of that, holds little more than each request's
window once decoding starts.
"""
import json
import sys

from pd_harness import offline_engine

PROMPTS = [[(13 * i + 7 * j + j * j % 17) % 500 + 3 for j in range(960)] for i in range(7)]
NEW_TOKENS = 16
ENGINE_ARGS = {"page_size": 16, "max_total_tokens": 4096, "max_running_requests": 32, "decode_log_interval": 1}


def main(model_dir, result_path):
    engine = offline_engine(model_dir, **ENGINE_ARGS)
    try:
        out = engine.generate(input_ids=PROMPTS,
                              sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True})
    finally:
        engine.shutdown()
    with open(result_path, "w") as f:
        json.dump({"outputs": [o["output_ids"] for o in out]}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
