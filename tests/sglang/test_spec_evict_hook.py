"""The eviction hook (swa_ext.sglang.hooks) under speculative decoding: EAGLE v2's
eagle_prepare_for_decode runs the window eviction on requests that hold more slots than
they have committed (kv_allocated_len past kv_committed_len: the decode reserve of
get_alloc_reserve_per_decode, with the committed length one verify late as under the
overlap scheduler), then allocates the next reserve. The hook's frees and evicted lengths
must be those of SGLang's own maybe_evict_swa loop, step after step."""
import random

import pytest
from sglang.srt.runtime_context import get_spec
from sglang.srt.speculative.eagle_utils import eagle_prepare_for_decode

from swa_ext.sglang import hooks
from test_evict_hook import NUM_REQS, interval, pools, protect, same, sglang_step  # noqa: F401 (interval: a fixture)

STEPS = 40
CHAIN = dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1,
             speculative_num_draft_tokens=4)


def verify(scheduler, accepted):
    """The result processor's bookkeeping of one verify: the accepted run is committed."""
    for req, n in zip(scheduler.reqs, accepted):
        req.kv.kv_committed_len += n
        req.output_ids.extend([5] * n)


@pytest.mark.parametrize("interval", [1, 8], indirect=True)
@pytest.mark.parametrize("page_size,radix_cache", [(1, False), (16, True), (16, False), (64, True)],
                         ids=["page1-no-radix", "page16-radix", "page16-no-radix", "page64-radix"])
def test_hook_frees_what_sglangs_loop_frees_under_a_decode_reserve(page_size, radix_cache, interval):
    sglang_step._publish_server_args(page_size)
    rng = random.Random(page_size * 100 + interval)
    room = 4 * STEPS + 64  # every step may commit up to four tokens; the reserve on top
    with get_spec().override(**CHAIN):
        setups = {s: sglang_step.Scheduler(s, NUM_REQS, page_size, interval, room, radix_cache)
                  for s in ("sglang", "hook")}
        for s in setups.values():
            protect(s, page_size)
        before = hooks.served()
        pending, under_reserve = None, 0
        for _ in range(STEPS):
            evicted_before = pools(setups["hook"])["evicted"]
            held = [(req.kv.kv_allocated_len, req.kv.kv_committed_len) for req in setups["hook"].reqs]
            for s in setups.values():
                eagle_prepare_for_decode(s.batch)
            states = {name: pools(s) for name, s in setups.items()}
            same(states["hook"], states["sglang"], order=False)
            for s in setups.values():
                assert [r.kv.kv_allocated_len for r in s.reqs] == [r.kv.kv_allocated_len for r in setups["hook"].reqs]
            under_reserve += sum(new != old and allocated > committed + 1
                                 for new, old, (allocated, committed) in zip(states["hook"]["evicted"], evicted_before,
                                                                            held))
            if pending:  # the previous verify's result, one step late
                for s in setups.values():
                    verify(s, pending)
            pending = [rng.randint(1, 4) for _ in range(NUM_REQS)]
    assert hooks.served()["native"] - before["native"] == STEPS and hooks.served()["sglang"] == before["sglang"]
    assert under_reserve > 0  # requests holding a reserve past their committed length had pages evicted
