#!/usr/bin/env bash
# Instructions per busy RPC round trip (both sides), counted by callgrind:
# the same every run, whatever the host does. See
# crates/hg-rpc/examples/busy_path_cost.rs and docs/PERFORMANCE.md.
#
#   scripts/busy-path-cost.sh [CALLS]      (default 100000)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "busy-path-cost: needs valgrind (apt-get install valgrind)" >&2; exit 2; }
calls=${1:-100000}
cargo build --quiet --release -p hg-rpc --example busy_path_cost
bin=${CARGO_TARGET_DIR:-target}/release/examples/busy_path_cost
count() {
  valgrind --tool=callgrind --callgrind-out-file=/dev/null "$bin" "$1" 2>&1 |
    sed -n 's/.*Collected : *\([0-9]*\).*/\1/p'
}
# Two runs, so that setup (handshake, registration) cancels out.
short=$(count 1000)
long=$(count $((calls + 1000)))
[ -n "$short" ] && [ -n "$long" ] || { echo "busy-path-cost: callgrind printed no count" >&2; exit 1; }
echo "instructions per call: $(( (long - short) / calls )) ($calls calls)"
