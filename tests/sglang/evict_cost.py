"""What ``maybe_evict_swa`` costs a decode step in SGLang's own engine: a PD decode node
(the offline engine with SGLang's fake transfer, on the CPU as tests/sglang/pd_harness.py
runs it) decoding a batch of running requests, the model's forward pass between steps,
timed in the scheduler by the test-only plugin in tests/sglang/evict_timer.

    PYTHONPATH=build/cuda-lib .venv-cuda/bin/python tests/sglang/evict_cost.py \\
        [--requests 48] [--page-size 16] [--interval 1] [--new-tokens 64] [--modes sglang,1] [--json OUT]

Each mode (``sglang``: SGLang's allocator and loop; a SWA_EXT_SGLANG value: swa_ext's
allocator and hook; ``shared``: swa_ext's shared mode and hook) is one engine process; the table gives the median and the 90th
percentile of the steps whose batch held every request, and each mode's median against
SGLang's. Unlike bench/sglang_step.py, whose setups take turns on warm caches, the
forward pass here leaves the caches cold, as a serving engine's does. Run as
``evict_cost.py engine SPEC_JSON RESULT_JSON`` it is one such engine (the modes' child).
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

import pd_harness

HERE = os.path.dirname(os.path.abspath(__file__))
TIMER = os.path.join(HERE, "evict_timer")


def prompts(count):
    """Prompts of 2 to 6 windows of the tiny model (64 tokens), a different length each."""
    return [[(7 * i + 3 * j + j * j % 11) % 500 + 3 for j in range(128 + (i * 37) % 256)] for i in range(count)]


def run_engine(spec, result_path):
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    engine = pd_harness.offline_engine(spec["model"], log_level="warning", **spec["engine_args"])
    try:
        n = len(spec["prompts"])
        # The fake transfer moves no KV and takes each request's first token from its rid.
        engine.generate(input_ids=spec["prompts"], rid=[f"req{i}" for i in range(n)],
                        bootstrap_host=[FAKE_BOOTSTRAP_HOST] * n, bootstrap_port=[8998] * n,
                        bootstrap_room=list(range(n)),
                        sampling_params={"temperature": 0, "ignore_eos": True, "max_new_tokens": spec["new_tokens"]})
    finally:
        engine.shutdown()
    with open(result_path, "w") as f:
        json.dump({"done": True}, f)


def decode_node(model, mode, args, workdir, run):
    """One decode node (the run-th of this command): the µs of maybe_evict_swa at each
    decode step whose batch held every request."""
    out = os.path.join(workdir, f"node-{run}-{mode}")
    times = os.path.join(out, "times")
    os.makedirs(out, exist_ok=True)
    tokens = args.requests * 2048  # room for every request at once: none waits for memory
    spec = {"model": model, "prompts": prompts(args.requests), "new_tokens": args.new_tokens,
            "engine_args": dict(page_size=args.page_size, max_total_tokens=tokens,
                                max_running_requests=args.requests, disaggregation_mode="decode",
                                disaggregation_transfer_backend="fake", **pd_harness.DECODE_CPU_ARGS)}
    spec_path, result = os.path.join(out, "spec.json"), os.path.join(out, "result.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = pd_harness.node_env(mode, os.path.join(out, "probe"))
    del env["SWA_EXT_PD_PROBE_DIR"]  # the probe's counting would be timed with the calls it counts
    env.update(SGLANG_SWA_EVICTION_INTERVAL=str(args.interval), SWA_EXT_EVICT_TIMES=times,
               PYTHONPATH=os.pathsep.join([TIMER, env["PYTHONPATH"]]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "engine", spec_path, result], env=env,
                          capture_output=True, text=True, timeout=args.timeout, start_new_session=True)
    if proc.returncode != 0 or not os.path.exists(result):
        raise RuntimeError(f"decode node {mode} failed:\n{(proc.stdout + proc.stderr)[-6000:]}")
    (record,) = glob.glob(os.path.join(times, "evict-*.json"))  # one scheduler
    with open(record) as f:
        steps = json.load(f)["steps"]
    full = [us for size, us in steps if size == args.requests]
    if not full:
        raise RuntimeError(f"decode node {mode}: no step held all {args.requests} requests "
                           f"(batch sizes {sorted({size for size, _ in steps})})")
    return full


def summary(mode, times):
    ordered = sorted(times)
    return {"mode": mode, "steps": len(times), "median_us": statistics.median(times),
            "p90_us": ordered[int(0.9 * (len(ordered) - 1))]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--interval", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--modes", default="sglang,1", help="sglang, shared and SWA_EXT_SGLANG values (default sglang,1)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a node may take")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    sys.path.insert(0, HERE)
    from conftest import write_checkpoint

    rows = []
    with tempfile.TemporaryDirectory(prefix="swa_ext_evict_cost_") as workdir:
        model = os.path.join(workdir, "model")
        write_checkpoint(model)
        for run, mode in enumerate(args.modes.split(",")):  # a mode may repeat: runs in turn
            rows.append(summary(mode, decode_node(model, mode, args, workdir, run)))
            print(f"[{mode}] {rows[-1]}", file=sys.stderr)
    reference = rows[0]["median_us"]
    print(f"maybe_evict_swa in a decode node: {args.requests} requests, page {args.page_size}, "
          f"interval {args.interval}\n\n| mode | steps | median µs | p90 µs | vs {rows[0]['mode']} |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['steps']} | {r['median_us']:.1f} | {r['p90_us']:.1f} "
              f"| {reference / r['median_us']:.2f}x |")
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    if len(modes) < len(rows):  # modes that ran in turn: each one's median over its runs
        per_mode = {m: statistics.median(r["median_us"] for r in rows if r["mode"] == m) for m in modes}
        print(f"\n| mode | runs | median of the runs' medians µs | vs {modes[0]} |\n|---|---:|---:|---:|")
        for m, us in per_mode.items():
            print(f"| {m} | {sum(r['mode'] == m for r in rows)} | {us:.1f} | {per_mode[modes[0]] / us:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"requests": args.requests, "page_size": args.page_size, "interval": args.interval,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["engine"]:
        with open(sys.argv[2]) as f:
            run_engine(json.load(f), sys.argv[3])
    else:
        sys.exit(main())
