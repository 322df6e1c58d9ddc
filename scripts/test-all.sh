#!/usr/bin/env bash
# Runs every test of the workspace: formatting, lint, unit and multi-process
# integration tests on the host, then the RDMA tests inside a soft-RoCE VM.
# Called by `./x test` (the README's test command) and so by CI.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "cargo fmt --check"
cargo fmt --all --check

step "cargo clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets --quiet -- -D warnings

step "cargo clippy of na-verbs as a user builds it (no test hooks: the sys items only its tests use are allowed one by one)"
# The workspace run above builds na-verbs with its test-hooks feature
# (its tests turn it on), so it never sees the crate as users build it.
cargo clippy -p na-verbs --quiet -- -D warnings

step "cargo doc of the private items too, with every feature (test hooks, lock audit; warnings are errors)"
# The internals' docs link each other: this keeps those links resolving, and
# the public docs the test-hooks feature exposes from linking private items.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --document-private-items --all-features --quiet

step "cargo doc (the public docs, last so that target/doc holds them; warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet

# The registration-cache suite has a hugetlbfs scenario; it needs a few
# reserved huge pages (root only; restored afterwards). Without them that
# scenario says NOT RUN and why.
if [ "$(id -u)" = 0 ] && [ -w /proc/sys/vm/nr_hugepages ]; then
  old_huge=$(cat /proc/sys/vm/nr_hugepages)
  if [ "$old_huge" -lt 4 ]; then
    echo 4 > /proc/sys/vm/nr_hugepages || true
    trap 'echo "$old_huge" > /proc/sys/vm/nr_hugepages' EXIT
  fi
fi

# Tests that cannot run something here say so in this file too (see
# na_core::testing::report_not_run): the harness hides a passing test's
# output, so the list is printed at the end.
QS_SKIP_LOG=$PWD/target/qs-not-run.txt
: > "$QS_SKIP_LOG"
export QS_SKIP_LOG
not_run_summary() {
  step "what could not run on this host (and why)"
  if [ -s "$QS_SKIP_LOG" ]; then
    # One entry per reason, with the tests that gave it ("<test>: <reason>").
    sort -u "$QS_SKIP_LOG" | awk '{
        name = $0; sub(/: .*/, "", name); reason = $0; sub(/^[^:]*: /, "", reason)
        if (!(reason in count)) order[++k] = reason
        count[reason]++; names[reason] = names[reason] (count[reason] > 1 ? ", " : "") name
      } END {
        for (i = 1; i <= k; i++) printf "- %s\n  %d test(s): %s\n", order[i], count[order[i]], names[order[i]]
      }'
  else
    echo "nothing: every test ran in full"
  fi
}

step "workspace tests on the host (real processes over shared memory)"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast
  cargo test --workspace --doc --quiet
else
  echo "cargo-nextest is not installed: falling back to cargo test"
  cargo test --workspace --no-fail-fast
fi

step "the na-sm conformance suite again, woken through pipes (QS_SM_WAKE=pipe)"
QS_SM_WAKE=pipe cargo test --quiet -p na-sm --test suite

step "the na-sm conformance suite again, peers' exits watched by pid as before Linux 6.5 (QS_SM_PIDFD=pid)"
QS_SM_PIDFD=pid cargo test --quiet -p na-sm --test suite

step "the na-sm conformance suite again, RMA on transfer threads (QS_SM_RMA_THREADS=2)"
QS_SM_RMA_THREADS=2 cargo test --quiet -p na-sm --test suite

step "the RPC and bulk tests again over sm's RMA transfer threads (QS_SM_RMA_THREADS=2): spills, transfers, the user story"
QS_SM_RMA_THREADS=2 cargo test --quiet -p hg-rpc --test spilled_args --test bulk_transfers --test bulk_batch \
  --test async_bulk --test bulk_given_up --test bulk_misuse --test bulk_counters --test output_pull_budget \
  --test origin_memory --test user_story --test examples_robust

step "the RPC tests again with posted receives instead of sm's pull mode (QS_RPC_RECV=posted)"
QS_RPC_RECV=posted cargo test --quiet -p hg-rpc --test rpc --test spilled_args --test bulk_transfers \
  --test response_routing --test abandoned_inputs --test bulk_given_up --test async_rpc --test async_stop \
  --test async_held --test origin_memory --test failure_paths --test notices --test async_bulk --test bulk_batch

step "the RPC tests again with payload checksums on (QS_RPC_CHECKSUM=on; off by default)"
QS_RPC_CHECKSUM=on cargo test --quiet -p hg-rpc --test rpc --test spilled_args --test bulk_transfers \
  --test response_routing --test abandoned_inputs --test bulk_given_up --test async_rpc --test async_stop \
  --test async_held --test origin_memory --test failure_paths --test notices

step "the registration cache's race and corruption suites again with the opt-in map watch (QS_MR_CACHE_MAP_WATCH=on)"
echo "skipped in this pass: an_address_freed_in_flight_and_mremapped_is_never_served_stale (it checks the default; the opt-in watch cannot see mremap, as documented)"
QS_MR_CACHE_MAP_WATCH=on cargo test --quiet -p na-regcache --test inflight --test settle --test stress --test corruption \
  -- --skip an_address_freed_in_flight_and_mremapped_is_never_served_stale

step "examples (each verifies what it does and fails loudly otherwise)"
cargo run --quiet -p hg-rpc --example hello
cargo run --quiet -p hg-rpc --example blobstore
cargo run --quiet -p hg-rpc --example blobstore_async
cargo run --quiet -p hg-rpc --example demo -- --passes 2
cargo run --quiet -p na-sm --example na_demo

step "the fuzz targets still build (fuzz/ is outside the workspace; ./x fuzz runs them)"
cargo check --quiet --manifest-path fuzz/Cargo.toml --bins

not_run_summary

step "RDMA verbs tests inside a soft-RoCE VM"
# Each job gets 5 minutes; the whole VM at most 20 (a normal run: about 3).
QS_VERBS_VM_TIMEOUT=${QS_VERBS_VM_TIMEOUT:-1200} bash scripts/test-verbs.sh
