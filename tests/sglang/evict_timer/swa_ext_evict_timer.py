"""A test-only SGLang plugin (tests/sglang/evict_cost.py puts this directory, with its
dist-info, on an engine's PYTHONPATH; SGLang loads it in each of its processes).

With ``SWA_EXT_EVICT_TIMES`` set it times each decode batch's ``maybe_evict_swa`` in
the scheduler, whichever serves it (SGLang's loop or swa_ext's hook), and writes the
batch sizes and times to ``evict-<pid>.json`` under that directory, replaced whole after
each step, outside the time measured (the scheduler may be killed at any time).
"""
import json
import os
import time

TIMES_VARIABLE = "SWA_EXT_EVICT_TIMES"


def _timer(path):
    record = {"steps": []}  # [batch size, µs] of each decode batch

    def write():
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)

    def timed(evict):
        def maybe_evict_swa(batch):
            if not batch.forward_mode.is_decode():
                return evict(batch)
            start = time.perf_counter_ns()
            evict(batch)
            elapsed = time.perf_counter_ns() - start
            record["steps"].append([len(batch.reqs), elapsed / 1e3])
            write()

        maybe_evict_swa.untimed = evict
        return maybe_evict_swa

    return timed


def plugin():
    if not os.environ.get(TIMES_VARIABLE):
        return
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    os.makedirs(os.environ[TIMES_VARIABLE], exist_ok=True)
    timed = _timer(os.path.join(os.environ[TIMES_VARIABLE], f"evict-{os.getpid()}.json"))
    prepare_for_decode = ScheduleBatch.prepare_for_decode

    def timed_prepare_for_decode(self):
        # Whoever serves maybe_evict_swa was installed by its own plugin, in an order
        # this one does not know: it is wrapped at the first decode step.
        if not hasattr(ScheduleBatch.maybe_evict_swa, "untimed"):
            ScheduleBatch.maybe_evict_swa = timed(ScheduleBatch.maybe_evict_swa)
        return prepare_for_decode(self)

    ScheduleBatch.prepare_for_decode = timed_prepare_for_decode
