#!/usr/bin/env bash
# Instructions per busy RPC round trip (both sides), counted by callgrind:
# the same every run, whatever the host does. See
# crates/hg-rpc/examples/busy_path_cost.rs and docs/PERFORMANCE.md.
# Also counts the NA round trip on the same path with no RPC work
# (crates/na-sm/examples/pull_path_cost.rs) and prints the difference:
# hg-rpc's own instructions per call.
#
#   scripts/busy-path-cost.sh [CALLS]      (default 100000)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "busy-path-cost: needs valgrind (apt-get install valgrind)" >&2; exit 2; }
calls=${1:-100000}
cargo build --quiet --release -p hg-rpc --example busy_path_cost
cargo build --quiet --release -p na-sm --example pull_path_cost
dir=${CARGO_TARGET_DIR:-target}/release/examples
# Prints the instruction count of one run; on failure, the run's output
# (the example's error) goes to stderr.
count() {
  local out
  out=$(valgrind --tool=callgrind --callgrind-out-file=/dev/null "$1" "$2" 2>&1) ||
    { printf '%s\n' "$out" | grep -v '^==' >&2; return 1; }
  printf '%s\n' "$out" | sed -n 's/.*Collected : *\([0-9]*\).*/\1/p'
}
# Two runs each, so that setup (handshake, registration) cancels out.
# (`set -e` does not reach into `$(...)`: each count is checked here.)
per_call() {
  local short long
  short=$(count "$1" 1000) || { echo "busy-path-cost: $1 failed" >&2; exit 1; }
  long=$(count "$1" $((calls + 1000))) || { echo "busy-path-cost: $1 failed" >&2; exit 1; }
  [ -n "$short" ] && [ -n "$long" ] || { echo "busy-path-cost: callgrind printed no count for $1" >&2; exit 1; }
  echo $(( (long - short) / calls ))
}
rpc=$(per_call "$dir/busy_path_cost") || exit 1
na=$(per_call "$dir/pull_path_cost") || exit 1
echo "instructions per call: $rpc ($calls calls)"
echo "NA round trip on the same path (pull_path_cost): $na; hg-rpc's own: $((rpc - na))"
