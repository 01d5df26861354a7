"""Faults sent to a prefill/decode deployment of SGLang on the CPU (pd_harness.Pair: the
router, a prefill node and a decode node on swa_ext), for tests/sglang/test_faults.py: the
clients (streams that hang up, requests sent to the nodes directly as the router sends
them), the controls (the prefill node paused, its transfers held by the probe plugin),
and what the decode node is left with (free pages, its log since a point).

The allocator mode is a parameter (MODES): each names the decode node's SWA_EXT_SGLANG
value and the settings that go with it.
"""
import glob
import http.client
import json
import os
import random
import re
import threading
import time
import urllib.error
import urllib.parse

import pd_harness

EVICT_TIMER = os.path.join(pd_harness.HERE, "evict_timer")

# The decode node's allocator: mode name -> (pd_harness's allocator mode, extra settings,
# lockstep?). The default mode runs in lockstep: every allocator call repeated on SGLang's
# own, the first difference stops the node. The shared mode (one budget of pages,
# SWA_EXT_SGLANG=shared) has no SGLang allocator to run beside it.
MODES = {"default": ("lockstep", {}, True), "shared": ("shared", {}, False)}

# SGLang's PD timeouts for a test: a decode node holds an aborted request's pages until
# the prefill node acks the abort or DEFERRED..._TIMEOUT s pass (short: the faults wait
# for it); it gives up on a transfer after WAITING_TIMEOUT s, unless its heartbeat (every
# 5 s, two misses) finds the prefill node gone first, which it does in about 10 s, so the
# waiting timeout need not be short for the dead prefill node and is long enough for the
# load's queue at the prefill node. A prefill node drops a request no decode node asked
# for after BOOTSTRAP_TIMEOUT s: under load a request waits that long in the decode node's
# preallocation queue for its pages (at 20 s the prefill node dropped the load's requests
# that waited, and the decode node then waited for KV that never came), so it outlasts a
# wave.
SHORT_TIMEOUTS = {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "120",
                  "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "4",
                  "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "600"}

# A decode-node log line that reports a problem (SGLang prints no level: the words).
PROBLEM = re.compile(r"error|exception|traceback|leak|crash|fail|timed out|timeout|diverge|warning|abort",
                     re.IGNORECASE)


# The pair's requests (test_pd_pair.py's checks, sent first on the deployment at page 16):
# every prompt longer than the 64-token window, up to eight windows.
PAIR_PROMPT_LENS = (72, 150, 260, 390, 520)
PAIR_PROMPTS = [[(11 * i + 5 * j + j * j % 13) % 500 + 3 for j in range(n)] for i, n in enumerate(PAIR_PROMPT_LENS)]
PAIR_NEW_TOKENS = 64


def prompt(seed, length):
    gen = random.Random(seed)
    return [gen.randrange(3, 500) for _ in range(length)]


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout} s")
        time.sleep(0.1)


class Stream:
    """A streaming greedy /generate at ``url``, read chunk by chunk; close() hangs up."""

    def __init__(self, url, input_ids, new_tokens, rid, extra=None):
        address = urllib.parse.urlsplit(url)
        self.rid = rid
        self.conn = http.client.HTTPConnection(address.hostname, address.port, timeout=600)
        body = {"input_ids": input_ids, "rid": rid, "stream": True, "sampling_params": {
            "temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}, **(extra or {})}
        self.conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        self.response = self.conn.getresponse()
        self.chunks = []

    def read(self, count=None):
        """Reads chunks until ``count`` of them or the end; the last one read."""
        while count is None or len(self.chunks) < count:
            line = self.response.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            self.chunks.append(json.loads(payload))
        return self.chunks[-1] if self.chunks else None

    def finish_reason(self):
        last = self.read()
        return last.get("meta_info", {}).get("finish_reason") if last else None

    def close(self):
        self.conn.sock.shutdown(2)
        self.conn.close()


def post(url, payload, timeout=600):
    """(status, body) of a JSON POST; an HTTP error is a status, not an exception."""
    try:
        return 200, pd_harness.http_json(url, payload, timeout=timeout)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


class Deployment:
    """A router, prefill node and decode node (pd_harness.Pair) with the controls and
    readings the faults need."""

    def __init__(self, model, workdir, mode, page_size, prefill_tokens, decode_tokens, decode_args=()):
        decode_mode, decode_env, self.lockstep = MODES[mode]
        self.page_size, self.decode_tokens = page_size, decode_tokens
        # The evict timer plugin times each decode step's window eviction (the hook's).
        self.evict_times = os.path.join(workdir, "evict-times")
        pythonpath = pd_harness.node_env(decode_mode, os.path.join(workdir, "decode-probe"))["PYTHONPATH"]
        decode_env = dict(decode_env, SWA_EXT_EVICT_TIMES=self.evict_times,
                          PYTHONPATH=os.pathsep.join([EVICT_TIMER, pythonpath]))
        self.pair = pd_harness.Pair(model, workdir, decode_mode, page_size, prefill_tokens, decode_extra=decode_args,
                                    decode_max_total_tokens=decode_tokens, env=SHORT_TIMEOUTS, decode_env=decode_env)
        self.hold_path = os.path.join(self.pair.prefill_probe, "hold-transfers")
        self._rid = 0

    def rid(self, tag):
        self._rid += 1
        return f"{tag}-{self._rid}"

    # --- readings ----------------------------------------------------------------

    def calls(self):
        return pd_harness.allocator_calls(self.pair.decode_probe)

    def free_pages(self):
        """Free pages of the decode node's (full, SWA) pools, from swa_ext's counters
        after the allocator's last call."""
        free = self.calls()["free_after_last_call"]
        return tuple(tokens // self.page_size for tokens in free)

    def pool_pages(self):
        return tuple(tokens // self.page_size for tokens in self.calls()["pool_sizes"])

    def decode_alive(self):
        return self.pair.process("decode").proc.poll() is None

    def decode_log(self, since=0):
        return self.pair.process("decode").log(tail=None)[since:]

    def decode_problems(self, since=0):
        return [line for line in self.decode_log(since).splitlines() if PROBLEM.search(line)]

    def evict_steps(self):
        """[batch size, µs] of each decode step's window eviction on the decode node."""
        steps = []
        for path in glob.glob(os.path.join(self.evict_times, "evict-*.json")):
            with open(path) as f:
                steps += json.load(f)["steps"]
        return steps

    def wait_logged(self, rid, since, timeout=10):
        """Waits until the decode node logs a line naming ``rid`` (its abort, a failed
        transfer) after offset ``since``; whether it did."""
        try:
            return bool(wait_for(lambda: f"rid='{rid}'" in self.decode_log(since), timeout, f"{rid} in the log"))
        except TimeoutError:
            return False

    def held_transfers(self):
        return sum(r.get("transfers", 0) for r in pd_harness.probe_records(self.pair.prefill_probe, "held"))

    def lockstep_counts(self):
        with open(self.pair.lockstep_report) as f:
            return json.load(f)

    def wait_idle(self, pages, timeout=120):
        """Waits until the decode node's pools hold ``pages`` free again; returns them as read."""
        try:
            return wait_for(lambda: self.free_pages() == pages and self.free_pages(), timeout,
                            f"decode node back to {pages} free pages")
        except TimeoutError:
            return self.free_pages()

    # --- controls ----------------------------------------------------------------

    def pause_prefill(self):
        status, body = post(self.pair.prefill_url + "/pause_generation", {"mode": "in_place"})
        assert status == 200, body

    def continue_prefill(self):
        status, body = post(self.pair.prefill_url + "/continue_generation", {})
        assert status == 200, body

    def hold_transfers(self):
        open(self.hold_path, "w").close()

    def release_transfers(self):
        if os.path.exists(self.hold_path):
            os.remove(self.hold_path)

    def abort(self, rid=None):
        """SGLang's abort endpoint on the decode node: one request, or all."""
        payload = {"rid": rid} if rid else {"abort_all": True}
        status, body = post(self.pair.decode_url + "/abort_request", payload)
        assert status == 200, body

    # --- clients -----------------------------------------------------------------

    def stream(self, input_ids, new_tokens, tag):
        return Stream(self.pair.url, input_ids, new_tokens, self.rid(tag))

    def generate(self, prompts, new_tokens):
        """Each prompt its own request through the router, all at once: their output ids."""
        outputs, errors = [None] * len(prompts), []

        def one(i):
            try:
                out = pd_harness.http_json(self.pair.url + "/generate", {
                    "input_ids": prompts[i], "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens[i],
                                                                 "ignore_eos": True}})
                outputs[i] = out["output_ids"]
            except Exception as e:  # noqa: BLE001 - reported with the request
                errors.append((i, repr(e)))

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=900)
        assert not errors, errors[:5]
        return outputs

    def direct(self, input_ids, new_tokens, tag, to_prefill=True):
        """One request sent to the nodes as the router sends it (each node its copy, the
        bootstrap fields naming the prefill node), without the router: the decode node's
        answer reaches this client whatever happens to the prefill node. Returns a thread
        whose ``result`` is the decode node's (status, body) once joined."""
        rid, room = self.rid(tag), random.randrange(2 ** 62)
        body = {"input_ids": input_ids, "rid": rid, "sampling_params": {
            "temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
            "bootstrap_host": pd_harness.HOST, "bootstrap_port": self.pair.bootstrap_port, "bootstrap_room": room}

        def send(thread, url):
            thread.result = post(url + "/generate", body)

        urls = [self.pair.decode_url] + ([self.pair.prefill_url] if to_prefill else [])
        threads = []
        for url in urls:
            thread = threading.Thread(target=lambda u=url: send(threading.current_thread(), u), daemon=True)
            thread.result = None
            thread.start()
            threads.append(thread)
        return threads[0]

    def stop(self):
        self.release_transfers()
        self.pair.stop()
