"""SGLang nodes of a prefill/decode deployment on the CPU, for tests/sglang/test_pd_*.py:
their environment, their processes (each in its own process group, always killed at the
end, every wait bounded), and what the probe plugin (tests/sglang/pd_probe) recorded in
them.

Run as a script it is one SGLang offline engine (settings and prompts in a JSON file):
``python pd_harness.py engine SPEC_JSON RESULT_JSON``. SWA_EXT_SGLANG and SGLang's checks
are read at start-up, so each allocator mode is its own process.

Every address is 127.0.0.1. Mooncake's engine also listens on all interfaces; these
nodes are for a trusted host.
"""
import concurrent.futures
import contextlib
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
STUBS = os.path.join(HERE, "stubs")
PROBE = os.path.join(HERE, "pd_probe")
KV_CHECK = os.path.join(HERE, "kv_check")  # KV-sensitive dummy weights, planted KV faults (its docstring)
HOST = "127.0.0.1"

# What a CPU-only run of SGLang's nodes needs, here and not in swa_ext:
# - attention through SGLang's triton kernels, run by triton's interpreter on the CPU
#   (TRITON_INTERPRET=1, node_env);
# - one KV split in the decode kernel (its multi-split path sizes buffers for a GPU);
# - CUDA graphs off;
# - a decode retraction backs the KV up to plain CPU tensors: the default host pool
#   pins its memory with cudaHostRegister, which needs a driver.
# (MooncakeKVSender.supports_host_tensor_indices = False is set by the probe plugin, in
# the prefill node's scheduler.)
CPU_ENGINE_ARGS = {"device": "cpu", "attention_backend": "triton", "triton_attention_num_kv_splits": 1,
                   "disable_cuda_graph": True}
DECODE_CPU_ARGS = {"disaggregation_decode_retraction_backup": "cpu_tensor"}
# - a prefill node sends a prompt's cached prefix early, after recording a CUDA event
#   (its overlap scheduler): without CUDA a repeated prompt kills its scheduler, so the
#   prefill node keeps no prefix cache.
PREFILL_CPU_ARGS = {"disable_radix_cache": True}


def node_env(mode, probe_dir, lockstep_report=None, fault=None):
    """The environment of one SGLang node: allocator mode (allocator_variables), SGLang's strict memory and KV-page checks on, the probe's
    report directory, and only loopback addresses. The shared mode runs with SWA_EXT_DEBUG=1
    (each step checks that no slot holds two kinds of KV); ``fault`` plants a KV fault
    (tests/sglang/kv_check)."""
    env = dict(os.environ, TRITON_INTERPRET="1", SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY="1",
               SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE="1", SGLANG_CHECK_KV_PAGE_INVARIANTS="1",
               # SGLang frees a request's out-of-window SWA every 128 decode steps by default,
               # more than a short test decodes: every 16, the tests see the window move.
               SGLANG_SWA_EVICTION_INTERVAL="16",
               SGLANG_HOST_IP=HOST, MC_TCP_BIND_ADDRESS=HOST, SWA_EXT_PD_PROBE_DIR=probe_dir,
               PYTHONPATH=os.pathsep.join([STUBS, PROBE, KV_CHECK] + [
                   p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    for name in ("SWA_EXT_SGLANG", "SWA_EXT_SHARED", "SWA_EXT_LOCKSTEP_REPORT", "SGLANG_PLUGINS", "SWA_EXT_DEBUG",
                 "SWA_EXT_TEST_KV_FAULT"):
        env.pop(name, None)
    env.update(allocator_variables(mode))
    if mode == "shared":
        env["SWA_EXT_DEBUG"] = "1"
    if fault:
        env["SWA_EXT_TEST_KV_FAULT"] = fault
    if lockstep_report:
        env["SWA_EXT_LOCKSTEP_REPORT"] = lockstep_report
    os.makedirs(probe_dir, exist_ok=True)
    return env


# Work started in the background where a core is idle (while a fault deployment waits):
# runs whose results are cached (functools.lru_cache), read later by their own tests.
_beside = []


def run_beside(work):
    """Starts ``work()`` in a background thread. It should fill a cache: a failure there is
    only printed, and the test that reads the cache runs the work again and reports it."""
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    _beside.append(thread)


def join_beside():
    """Waits for the work run_beside started (before a cache it fills is read)."""
    while _beside:
        _beside.pop().join()


def two_at_a_time(run, argument_tuples):
    """``run`` on each argument tuple, two engines at a time (one a core: an engine's
    scheduler runs on one): {arguments: result}."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {arguments: pool.submit(run, *arguments) for arguments in argument_tuples}
        return {arguments: future.result() for arguments, future in futures.items()}


def allocator_variables(mode):
    """The variables of an allocator mode: ``sglang`` (SGLang's own: none), ``shared``
    (swa_ext's shared mode: SWA_EXT_SGLANG=shared) or another SWA_EXT_SGLANG value."""
    if mode == "sglang":
        return {}
    return {"SWA_EXT_SGLANG": mode}


def probe_records(probe_dir, kind):
    """The probe's records of one kind (``alloc`` or ``sent``) in a node's processes."""
    records = []
    for path in sorted(glob.glob(os.path.join(probe_dir, f"{kind}-*.json"))):
        with open(path) as f:
            records.append(json.load(f))
    return records


def allocator_calls(probe_dir):
    """The calls the node's scheduler made on its KV allocator (one scheduler: tp 1)."""
    records = probe_records(probe_dir, "alloc")
    assert len(records) == 1, f"expected one scheduler's allocator record in {probe_dir}, got {len(records)}"
    return records[0]


def allocator_class(calls):
    """(top-level package, class name) of the allocator the calls were made on."""
    module, _, name = calls["allocator"].rpartition(".")
    return module.split(".")[0], name


def settled_allocator_calls(probe_dir, timeout=60):
    """The node's allocator calls once both pools are whole again, or after timeout
    seconds: a request's answer can leave before its KV is released."""
    deadline = time.monotonic() + timeout
    while True:
        calls = allocator_calls(probe_dir)
        if calls["free_after_last_call"] == calls["pool_sizes"] or time.monotonic() > deadline:
            return calls
        time.sleep(0.5)


def sent_bytes(probe_dir):
    """Bytes the node handed to Mooncake in successful transfers, by KV region."""
    total = {}
    for record in probe_records(probe_dir, "sent"):
        for key, value in record.items():
            total[key] = value if key.endswith(("_item_bytes", "_buffers")) else total.get(key, 0) + value
    return total


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Process:
    """A child in its own process group with its output in a log file; stop() ends the
    group (SIGTERM to the leader, then to the group, then SIGKILL, each after a bounded
    wait), whatever it started."""

    def __init__(self, name, argv, env, log_path):
        self.name, self.log_path = name, log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def log(self, tail=6000):
        with open(self.log_path, errors="replace") as f:
            return f.read()[-tail:] if tail else f.read()

    def stop(self, grace=20):
        if self._log.closed:  # stopped or killed already
            return
        # The leader first: SGLang's server then stops its subprocess watchdog and ends its
        # scheduler itself (a scheduler killed under it is logged as crashed); then the group.
        steps = ((os.kill, signal.SIGTERM, grace), (os.killpg, signal.SIGTERM, 10), (os.killpg, signal.SIGKILL, 10))
        for kill, sig, wait in steps:
            with contextlib.suppress(ProcessLookupError):
                kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # The group may outlive its leader (SGLang's scheduler, Mooncake's threads).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()

    def kill(self):
        """SIGKILL to the whole group at once, as when its machine dies."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._log.close()


def http_json(url, payload=None, timeout=600):
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = response.read()
    return json.loads(body) if body else None


def wait_healthy(process, url, timeout):
    """Waits until GET url answers 200, at most timeout seconds; fails early if the
    process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.proc.poll() is not None:
            raise RuntimeError(f"{process.name} exited ({process.proc.returncode}):\n{process.log()}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{process.name} not healthy at {url} after {timeout} s:\n{process.log()}")


def server_argv(model, page_size, max_total_tokens, port, mode=None, bootstrap_port=None, extra=()):
    """``python -m sglang.launch_server`` on 127.0.0.1 with the CPU settings, as a
    prefill or decode node (mode) or a single engine (mode None)."""
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", HOST, "--port", str(port),
            "--skip-tokenizer-init", "--page-size", str(page_size), "--max-total-tokens", str(max_total_tokens),
            "--random-seed", "0", "--log-level", "info"]
    args = dict(CPU_ENGINE_ARGS)
    if mode is not None:
        args.update(disaggregation_mode=mode, disaggregation_transfer_backend="mooncake_tcp",
                    disaggregation_bootstrap_port=bootstrap_port)
        args.update(DECODE_CPU_ARGS if mode == "decode" else PREFILL_CPU_ARGS)
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv + list(extra)


def router_argv(port, prefill_url, bootstrap_port, decode_url):
    return [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--mini-lb", "--host", HOST,
            "--port", str(port), "--prefill", prefill_url, str(bootstrap_port), "--decode", decode_url]


class Pair:
    """A prefill node, a decode node and SGLang's router in front of them, all on
    127.0.0.1: the KV goes from one node to the other over Mooncake's TCP transport.
    ``decode_mode`` says who serves the decode node's allocator (node_env)."""

    START_TIMEOUT = 300  # seconds: the nodes' start on a loaded 2-core machine took 31-51 s

    def __init__(self, model, workdir, decode_mode, page_size, max_total_tokens, decode_extra=(),
                 decode_max_total_tokens=None, env=None, decode_env=None):
        """``decode_max_total_tokens``: the decode node's pool when it differs from the
        prefill node's; ``env``: settings of both nodes, ``decode_env``: of the decode node
        (with ``decode_mode``'s own)."""
        self.workdir = workdir
        self.prefill_probe, self.decode_probe = (os.path.join(workdir, f"{role}-probe") for role in ("prefill", "decode"))
        self.lockstep_report = os.path.join(workdir, "decode-lockstep.json") if decode_mode == "lockstep" else None
        bootstrap, ports = free_port(), [free_port() for _ in range(3)]
        self.prefill_url, self.decode_url, self.url = (f"http://{HOST}:{port}" for port in ports)
        self.bootstrap_port = bootstrap
        self.processes = []
        self._prefill_argv = server_argv(model, page_size, max_total_tokens, ports[0], "prefill", bootstrap)
        self._prefill_env = dict(node_env("sglang", self.prefill_probe), **(env or {}))
        try:
            prefill = self._start("prefill", self._prefill_argv, self._prefill_env)
            decode = self._start("decode", server_argv(model, page_size, decode_max_total_tokens or max_total_tokens,
                                                       ports[1], "decode", bootstrap, decode_extra),
                                 dict(node_env(decode_mode, self.decode_probe, self.lockstep_report), **(env or {}),
                                      **(decode_env or {})))
            wait_healthy(prefill, self.prefill_url + "/health", self.START_TIMEOUT)
            wait_healthy(decode, self.decode_url + "/health", self.START_TIMEOUT)
            router = self._start("router", router_argv(ports[2], self.prefill_url, bootstrap, self.decode_url),
                                 dict(os.environ))
            wait_healthy(router, self.url + "/health", 120)
        except BaseException:
            self.stop()
            raise

    def _start(self, role, argv, env):
        process = Process(role, argv, env, os.path.join(self.workdir, f"{role}.log"))
        self.processes.append(process)
        return process

    def process(self, role):
        """The live process of a role (the latest one started)."""
        return next(p for p in reversed(self.processes) if p.name == role)

    def kill_prefill(self):
        self.process("prefill").kill()

    def start_prefill(self):
        """A new prefill node at the killed one's addresses (the router's list is fixed)."""
        count = sum(p.name == "prefill" for p in self.processes)
        process = Process("prefill", self._prefill_argv, self._prefill_env,
                          os.path.join(self.workdir, f"prefill-{count + 1}.log"))
        self.processes.append(process)
        wait_healthy(process, self.prefill_url + "/health", 2 * self.START_TIMEOUT)  # beside two busy nodes

    def generate(self, prompts, new_tokens, timeout=600):
        """Greedy generation of each prompt through the router: their output ids."""
        out = http_json(self.url + "/generate", {"input_ids": prompts, "sampling_params": {
            "temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}, timeout=timeout)
        return [o["output_ids"] for o in out]

    def logs(self):
        return {os.path.basename(p.log_path)[:-4]: p.log(tail=None) for p in self.processes}

    def stop(self):
        for process in reversed(self.processes):
            process.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


# --- the offline engine, run as a script --------------------------------------------------


def offline_engine(model, **engine_args):
    """SGLang's offline Engine on the CPU (CPU_ENGINE_ARGS, which engine_args may override),
    token ids in and out, seeded: every engine runner of tests/sglang builds its engine here."""
    import sglang

    return sglang.Engine(model_path=model, **{"skip_tokenizer_init": True, "log_level": "info", "random_seed": 0,
                                              **CPU_ENGINE_ARGS, **engine_args})


def run_engine(spec, result_path):
    """One offline engine: ``spec`` holds the engine arguments, the rounds of prompts, the
    new tokens (one number, or one a round), and for a decode node with the fake transfer
    the requests' bootstrap fields. Writes each request's output ids."""
    engine = offline_engine(spec["model"], **spec["engine_args"])
    new_tokens = spec["new_tokens"]
    if isinstance(new_tokens, int):
        new_tokens = [new_tokens] * len(spec["rounds"])
    rounds = []
    try:
        for r, prompts in enumerate(spec["rounds"]):
            extra = {}
            if spec["engine_args"].get("disaggregation_mode") == "decode":
                from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

                # The fake transfer moves no KV (the prompt's KV stays zeros) and takes its first
                # token from a hash of the rid: fixed rids make runs comparable.
                rids = [f"round{r}-req{i}" for i in range(len(prompts))]
                extra = {"bootstrap_host": [FAKE_BOOTSTRAP_HOST] * len(prompts), "bootstrap_port": [8998] * len(prompts),
                         "bootstrap_room": [1000 * r + i for i in range(len(prompts))], "rid": rids}
            out = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "ignore_eos": True,
                                                                      "max_new_tokens": new_tokens[r]}, **extra)
            rounds.append([o["output_ids"] for o in out])
        settled_allocator_calls(os.environ["SWA_EXT_PD_PROBE_DIR"])  # before the scheduler is stopped
    finally:
        engine.shutdown()
    with open(result_path, "w") as f:
        json.dump({"rounds": rounds}, f)


def out_of_window_frees(calls):
    """Requests whose out-of-window SWA KV a decode node freed: one free_swa_segment each
    on SGLang's loop, one each among those the hook's batched native calls freed from."""
    return calls.get("free_swa_segment", 0) + calls.get("evict_out_of_window_rows", 0)


if __name__ == "__main__":
    assert sys.argv[1] == "engine", sys.argv
    with open(sys.argv[2]) as f:
        run_engine(json.load(f), sys.argv[3])

