"""The faults tests/sglang/test_faults.py sends to a prefill/decode deployment
(fault_harness.Deployment), each a function of the deployment that returns what it saw,
in FAULTS' order, and the requests they send: the check requests sent after each fault
and the load's waves.
"""
import random
import re
import time

from fault_harness import prompt, wait_for

# The requests sent after each fault (longer than the 64-token window but the first).
CHECK = [prompt(100 + i, n) for i, n in enumerate((40, 130, 300))]
CHECK_NEW = 16

# SGLang's line for a retraction on a full pool.
RETRACTED = re.compile(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)")
# The load's requests: prompt and output lengths drawn from these ranges.
LOAD_PROMPT_TOKENS = (4, 100)
LOAD_NEW_TOKENS = (2, 16)


def load_wave(size):
    gen = random.Random(size)
    return [(prompt(1000 * size + i, gen.randint(*LOAD_PROMPT_TOKENS)), gen.randint(*LOAD_NEW_TOKENS))
            for i in range(size)]


# --- the faults: each returns what it saw --------------------------------------------


def preallocated(dep, before, count=1, timeout=20):
    """Whether the decode node preallocated ``count`` more requests' pages (their window
    tail) within timeout seconds. At page size 1 SGLang preallocates with ``alloc``, which
    decoding requests call too: a wait of 3 s, and None."""
    if dep.page_size == 1:
        time.sleep(3)
        return None
    try:
        return bool(wait_for(lambda: dep.calls().get("alloc_extend_swa_tail", 0) >= before + count, timeout,
                             "prealloc"))
    except TimeoutError:
        return False


# How long the decode node takes to see a client gone (SGLang polls every 4 s), with margin.
DISCONNECT_NOTICED_S = 6


def close_waiting(dep):
    dep.pause_prefill()
    try:
        before, since = dep.calls().get("alloc_extend_swa_tail", 0), len(dep.decode_log())
        stream = dep.stream(CHECK[2], 200, "close-waiting")
        seen = {"preallocated": preallocated(dep, before)}
        stream.close()
        seen["abort_logged"] = dep.wait_logged(stream.rid, since, DISCONNECT_NOTICED_S + 4)
    finally:
        dep.continue_prefill()
    return seen


def close_in_transfer(dep):
    dep.hold_transfers()
    try:
        held, since = dep.held_transfers(), len(dep.decode_log())
        stream = dep.stream(CHECK[1], 200, "close-transfer")
        wait_for(lambda: dep.held_transfers() > held, 60, "a transfer held")
        stream.close()
        seen = {"abort_logged": dep.wait_logged(stream.rid, since, DISCONNECT_NOTICED_S + 4)}
    finally:
        dep.release_transfers()
    seen["held_transfers"] = dep.held_transfers() - held
    return seen


def close_decoding(dep):
    stream = dep.stream(CHECK[2], 200, "close-decoding")
    stream.read(3)
    stream.close()
    time.sleep(DISCONNECT_NOTICED_S)
    return {"tokens_read": len(stream.chunks)}


def abort_running(dep):
    stream = dep.stream(CHECK[2], 200, "abort-running")
    stream.read(3)
    dep.abort(stream.rid)
    return {"finish_reason": stream.finish_reason(), "chunks": len(stream.chunks)}


def abort_waiting(dep):
    dep.pause_prefill()
    try:
        before = dep.calls().get("alloc_extend_swa_tail", 0)
        stream = dep.stream(CHECK[2], 200, "abort-waiting")
        seen = {"preallocated": preallocated(dep, before)}
        dep.abort(stream.rid)
        seen["finish_reason"] = stream.finish_reason()
    finally:
        dep.continue_prefill()
    return seen


def abort_all(dep):
    running = [dep.stream(p, 200, "abort-all-running") for p in CHECK]
    for stream in running:
        stream.read(2)
    dep.pause_prefill()
    try:
        before = dep.calls().get("alloc_extend_swa_tail", 0)
        waiting = [dep.stream(p, 200, "abort-all-waiting") for p in CHECK[:2]]
        seen = {"preallocated": preallocated(dep, before, 2)}
        dep.abort()
        seen["finish_reasons"] = [s.finish_reason() for s in running + waiting]
    finally:
        dep.continue_prefill()
    return seen


def prefill_killed(dep):
    dep.hold_transfers()
    held = dep.held_transfers()
    clients = [dep.direct(p, CHECK_NEW, "killed") for p in CHECK]
    seen = {}
    try:
        wait_for(lambda: dep.held_transfers() > held, 60, "a transfer held")
        time.sleep(2)  # the other requests' transfers reach the hold too, as far as they get
        seen["held_transfers"] = dep.held_transfers() - held
    finally:
        killed = time.monotonic()
        dep.pair.kill_prefill()
        dep.release_transfers()
        try:
            for client in clients:
                client.join(timeout=300)
            seen["answers"] = [client.result for client in clients]
            seen["answered_after_s"] = round(time.monotonic() - killed, 1)
        finally:
            start = time.monotonic()
            dep.pair.start_prefill()
            seen["new_prefill_start_s"] = round(time.monotonic() - start, 1)
    return seen


def too_long(dep):
    # The previous requests' pages may still be on their way back (an answer leaves first).
    before = dep.wait_idle(dep.pool_pages())
    # Longer than the pool: the shared mode's one budget holds more slots than
    # --max-total-tokens.
    longest = max(dep.calls()["pool_sizes"])
    client = dep.direct(prompt(7, longest + 64), 8, "too-long", to_prefill=False)
    client.join(timeout=120)
    return {"answer": client.result, "pages_before": before, "pages_after": dep.free_pages()}


def load(dep):
    """The waves one after the other; the retractions counted twice: the decode node's
    CPU backups of a retracted request's KV (the probe's get_cpu_copy) and SGLang's log."""
    backups, since = dep.calls().get("get_cpu_copy", 0), len(dep.decode_log())
    waves = []
    for size in dep.load_waves:
        requests = load_wave(size)
        start = time.monotonic()
        outputs = dep.generate([p for p, _ in requests], [n for _, n in requests])
        waves.append({"size": size, "outputs": outputs, "wall_s": round(time.monotonic() - start, 1)})
    return {"waves": waves, "retraction_backups": dep.calls().get("get_cpu_copy", 0) - backups,
            "retracted_logged": sum(int(n) for n in RETRACTED.findall(dep.decode_log(since)))}


FAULTS = [close_waiting, close_in_transfer, close_decoding, abort_running, abort_waiting, abort_all, prefill_killed,
          too_long, load]
