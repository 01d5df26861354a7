#!/usr/bin/env bash
# A prefill/decode deployment of SGLang on this machine's CPU, the decode node on swa_ext
# (docs/pd-deployment.md): tests/sglang's tiny random-weight Granite-SWA model (window 64),
# a prefill node, a decode node with SWA_EXT_SGLANG=1 and SGLang's router, all on
# 127.0.0.1; one request of 300 prompt tokens and 160 new tokens through the router; then
# what swa_ext served on the decode node. Ends every process it started, whatever happens.
# Needs scripts/setup-sglang.sh first (SGLang, its router and Mooncake in .venv-cuda).
# For a trusted host: Mooncake's transfer engine also listens on all interfaces.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${SWA_EXT_CUDA_VENV:-$ROOT/.venv-cuda}/bin/python"
WORK="$(mktemp -d /tmp/swa-ext-pd-demo.XXXXXX)"
MODEL="$WORK/model"
# Free loopback ports: prefill, decode, router, the prefill node's bootstrap server.
read -r PREFILL_PORT DECODE_PORT ROUTER_PORT BOOTSTRAP_PORT < <("$PY" - <<'EOF'
import socket
socks = [socket.socket() for _ in range(4)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
EOF
)

groups=()
# Waits up to $1 seconds while any process (or group: "-") of the list is alive.
wait_gone() {
  local seconds=$1 prefix=$2
  for _ in $(seq "$seconds"); do
    alive=0
    for pid in "${groups[@]}"; do kill -0 -- "$prefix$pid" 2>/dev/null && alive=1; done
    (( alive )) || return 0
    sleep 1
  done
}
# The leaders first: SGLang's server then stops its subprocess watchdog and ends its
# scheduler itself (a scheduler killed under it is logged as crashed); then each group.
stop_all() {
  for pid in "${groups[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait_gone 20 ""
  for pid in "${groups[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  wait_gone 10 -
  for pid in "${groups[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  if grep -l "crashed with exit code" "$WORK"/*.log >/dev/null 2>&1; then
    echo "a process crashed:"; grep -h "crashed with exit code" "$WORK"/*.log
  fi
  echo "logs: $WORK"
}
trap stop_all EXIT

# Each process in its own process group (setsid), so that stop_all ends what it started.
start() {
  local name=$1; shift
  setsid "$@" >"$WORK/$name.log" 2>&1 &
  groups+=("$!")
  disown  # stop_all reports nothing of bash's own about the groups it kills
}

wait_healthy() {
  local name=$1 url=$2 pid=$3
  for _ in $(seq 300); do
    curl -sf "$url/health" >/dev/null 2>&1 && return 0
    kill -0 "$pid" 2>/dev/null || { echo "$name exited:"; tail -30 "$WORK/$name.log"; exit 1; }
    sleep 1
  done
  echo "$name not healthy after 300 s:"; tail -30 "$WORK/$name.log"; exit 1
}

"$PY" -c "import sys; sys.path.insert(0, '$ROOT/tests/sglang'); from conftest import write_checkpoint; write_checkpoint('$MODEL')"

# The CPU-only settings (a GPU needs none of them): SGLang's triton attention kernels run
# in triton's interpreter, with one KV split and no CUDA graphs; a KV pool of 8192 tokens
# (sized from free memory, SGLang's CPU pool takes most of the host's); a decode retraction
# backs up to plain CPU tensors (the default host pool pins memory through the CUDA driver);
# tests/sglang/stubs gives SGLang's CPU path the one vLLM function it imports, and the
# plugin in tests/sglang/pd_probe turns off Mooncake's CUDA-event path and counts the
# decode node's allocator calls (SWA_EXT_PD_PROBE_DIR).
export TRITON_INTERPRET=1 SGLANG_HOST_IP=127.0.0.1
export PYTHONPATH="$ROOT/build/cuda-lib:$ROOT/tests/sglang/stubs:$ROOT/tests/sglang/pd_probe"
CPU_FLAGS=(--device cpu --attention-backend triton --triton-attention-num-kv-splits 1 --disable-cuda-graph
           --max-total-tokens 8192)
COMMON=(--model-path "$MODEL" --skip-tokenizer-init --page-size 16 --host 127.0.0.1
        --disaggregation-transfer-backend mooncake_tcp --disaggregation-bootstrap-port "$BOOTSTRAP_PORT")

echo "starting the prefill node (:$PREFILL_PORT) and the decode node on swa_ext (:$DECODE_PORT)..."
start prefill "$PY" -m sglang.launch_server "${COMMON[@]}" "${CPU_FLAGS[@]}" --port "$PREFILL_PORT" \
  --disaggregation-mode prefill
prefill_pid=$!
start decode env SWA_EXT_SGLANG=1 SWA_EXT_PD_PROBE_DIR="$WORK/decode-probe" \
  "$PY" -m sglang.launch_server "${COMMON[@]}" "${CPU_FLAGS[@]}" --port "$DECODE_PORT" \
  --disaggregation-mode decode --disaggregation-decode-retraction-backup cpu_tensor
decode_pid=$!
wait_healthy prefill "http://127.0.0.1:$PREFILL_PORT" "$prefill_pid"
wait_healthy decode "http://127.0.0.1:$DECODE_PORT" "$decode_pid"

echo "starting the router (:$ROUTER_PORT)..."
start router "$PY" -m sglang_router.launch_router --pd-disaggregation --mini-lb --host 127.0.0.1 \
  --port "$ROUTER_PORT" --prefill "http://127.0.0.1:$PREFILL_PORT" "$BOOTSTRAP_PORT" \
  --decode "http://127.0.0.1:$DECODE_PORT"
wait_healthy router "http://127.0.0.1:$ROUTER_PORT" "$!"

before="$(cat "$WORK"/decode-probe/alloc-*.json)"  # the nodes' own warm-up requests
# 160 new tokens: SGLang frees the SWA KV that left the window every 128 decode steps.
echo "one request through the router: 300 prompt tokens, 160 new tokens (greedy)..."
REQUEST='{"input_ids": ['"$(seq -s, 3 302)"'], "sampling_params": {"temperature": 0, "max_new_tokens": 160, "ignore_eos": true}}'
curl -sf --max-time 600 "http://127.0.0.1:$ROUTER_PORT/generate" -H 'Content-Type: application/json' \
  -d "$REQUEST" >"$WORK/response.json"
sleep 2  # the decode node releases the request's KV after it answers

grep -h "swa_ext:" "$WORK/decode.log" | sed 's/^/decode node: /' | sort -u
BEFORE="$before" "$PY" - "$WORK" <<'EOF'
import glob, json, os, sys
work = sys.argv[1]
out = json.load(open(os.path.join(work, "response.json")))
print(f"output ids ({len(out['output_ids'])}): {out['output_ids'][:12]} ...")
before = json.loads(os.environ["BEFORE"])
(path,) = glob.glob(os.path.join(work, "decode-probe", "alloc-*.json"))
after = json.load(open(path))
print(f"the decode node's KV allocator: {after['allocator']}")
print("its calls for this request:")
for call, n in after.items():
    if isinstance(n, int) and n - before.get(call, 0):
        print(f"  {call}: {n - before.get(call, 0)}")
full, swa = after["free_after_last_call"]
print(f"free tokens after the request: full {full} of {after['pool_sizes'][0]}, SWA {swa} of {after['pool_sizes'][1]}")
EOF
