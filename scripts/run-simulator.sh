#!/usr/bin/env bash
# The main job: the decode-node simulator on the bundled Azure conversation trace,
# the three KV policies side by side. Extra arguments go to `swa-ext simulate`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup-env.sh"
mkdir -p "$ROOT/out"
exec "$VENV/bin/swa-ext" simulate --json "$ROOT/out/simulation.json" --plot "$ROOT/out/simulation.png" "$@"
