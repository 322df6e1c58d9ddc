#!/usr/bin/env bash
# test-verbs.sh - run the RDMA verbs tests on a real kernel RDMA stack.
#
#   scripts/test-verbs.sh [TEST-BINARY ARGS...]    e.g. scripts/test-verbs.sh --nocapture
#
# Builds on the host the test binaries of the verbs crates, hg-rpc's `verbs`
# test (RPC and bulk over RDMA), the blobstore example and hg-perf, then
# boots one throw-away soft-RoCE VM (tools/rxe-vm/run-in-rxe-vm.sh, device
# rxe0 at $RXE_VM_IP, default 10.77.0.1) and runs in it, one after the
# other: every test binary (extra arguments go to each), blobstore over
# verbs, and hg-perf rate/lat/bw and na-perf lat/bw over verbs (functional
# figures only).
#
# Exit status: 0 if every job passed; the first failing job's status
# otherwise; 124 if the VM timed out; 125 if the VM itself failed.
#
# Environment:
#   QS_VERBS_CRATES      crates whose tests run in the VM (default: na-verbs)
#   QS_VERBS_TIMEOUT     seconds per job inside the VM (default 300)
#   QS_VERBS_VM_TIMEOUT  seconds for the whole VM (default: 120 + jobs x per-job)
#   CARGO_TARGET_DIR     honoured as usual
# Needs root (qemu exports / over 9p); uses `sudo -n` when not root.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
VM=$ROOT/tools/rxe-vm/run-in-rxe-vm.sh

log() { printf 'test-verbs: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

read -r -a CRATES <<< "${QS_VERBS_CRATES:-na-verbs}"
PER_BIN=${QS_VERBS_TIMEOUT:-300}
# A whole number of seconds above 0, no leading zero: `timeout 0` would
# mean no timeout at all, and bash arithmetic reads 08 as bad octal.
seconds() { case $2 in ''|0*|*[!0-9]*) die "$1 must be a whole number of seconds above 0, got '$2'" ;; esac; }
seconds QS_VERBS_TIMEOUT "$PER_BIN"
[ -z "${QS_VERBS_VM_TIMEOUT:-}" ] || seconds QS_VERBS_VM_TIMEOUT "$QS_VERBS_VM_TIMEOUT"

SUDO=()
if [ "$(id -u)" != 0 ]; then
    sudo -n true 2>/dev/null || die "the soft-RoCE VM needs root: run as root or allow passwordless sudo"
    SUDO=(sudo -n --preserve-env)
fi
[ -x "$VM" ] || die "missing $VM"

# ------------------------------------------------------------------ build --
# Test binaries: every test target of the verbs crates, plus hg-rpc's
# `verbs` test (hg-rpc and hg-bulk over RDMA); its peer binary
# (hg-rpc-testpeer) is built along with it.
SELECTORS=()
for c in "${CRATES[@]}"; do SELECTORS+=("-p $c"); done
SELECTORS+=("-p hg-rpc --test verbs")
JSON=$(mktemp "${TMPDIR:-/tmp}/test-verbs.XXXXXX.json")
trap 'rm -f "$JSON"' EXIT
for sel in "${SELECTORS[@]}"; do
    log "building test binaries on the host: cargo test $sel --no-run"
    # shellcheck disable=SC2086 # a selector is several words on purpose
    cargo test $sel --no-run --message-format=json-render-diagnostics >> "$JSON" ||
        die "cargo test $sel --no-run failed"
done
# Programs run after the tests: the blobstore example and hg-perf over verbs.
log "building the programs on the host: blobstore example, hg-perf"
cargo build -p hg-rpc -p na-perf --example blobstore --bin hg-perf --bin na-perf --message-format=json-render-diagnostics >> "$JSON" ||
    die "cargo build of the verbs programs failed"
# Reads cargo's JSON messages: `tests` prints "executable<TAB>crate dir" of
# every test binary (profile.test), `exe NAME` the executable of target NAME.
artifacts() {
    python3 - "$JSON" "$@" <<'PY'
import json, os, sys
path, what = sys.argv[1], sys.argv[2]
seen = set()
for line in open(path):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    exe = m.get("executable")
    if m.get("reason") != "compiler-artifact" or not exe or exe in seen:
        continue
    seen.add(exe)
    if what == "tests" and m["profile"]["test"]:
        print(exe + "\t" + os.path.dirname(m["manifest_path"]))
    elif what == "exe" and m["target"]["name"] == sys.argv[3] and not m["profile"]["test"]:
        print(exe)
PY
}
mapfile -t TESTS < <(artifacts tests | sort)
BINS=()
for t in "${TESTS[@]}"; do BINS+=("${t%%$'\t'*}"); done
[ ${#BINS[@]} -gt 0 ] || die "cargo produced no test binaries for ${CRATES[*]}"
BLOBSTORE=$(artifacts exe blobstore)
HG_PERF=$(artifacts exe hg-perf)
NA_PERF=$(artifacts exe na-perf)
[ -n "$BLOBSTORE" ] && [ -n "$HG_PERF" ] && [ -n "$NA_PERF" ] || die "blobstore, hg-perf or na-perf was not built"

# The guest runs a job file (each job bounded; the status is that of the
# first failure). It lives under the target directory, which the VM sees.
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
JOBS=$TARGET_DIR/rxe-vm-jobs.sh
SPEC='verbs://rxe0/${RXE_VM_ADDR}:0'
{
    echo 'rc=0'
    echo 'job() { # dir name command...'
    echo '    local dir=$1 name=$2; shift 2'
    echo '    echo "==> [rxe-vm] $name (cwd $dir)"'
    echo '    local t0; t0=$(date +%s%N)'
    echo "    (cd \"\$dir\" && timeout -k 5 $PER_BIN \"\$@\")"
    echo '    local s=$?'
    echo '    echo "==> [rxe-vm] $name: exit $s in $(( ($(date +%s%N) - t0) / 1000000 )) ms"'
    echo "    [ \$s = 124 ] && echo \"==> [rxe-vm] \$name TIMED OUT after ${PER_BIN}s\" >&2"
    echo '    [ $s != 0 ] && [ $rc = 0 ] && rc=$s'
    echo '    [ $s != 0 ] && rxe_counters "after $name"'
    echo '    return 0'
    echo '}'
    # The device's own counters (retransmissions, sequence errors, ...)
    # tell a lost or stalled packet from a plugin bug when a job fails.
    echo 'rxe_counters() {'
    echo '    echo "==> [rxe-vm] soft-RoCE counters that are not zero ($1):"'
    echo '    for f in /sys/class/infiniband/*/ports/*/hw_counters/*; do'
    echo '        [ -r "$f" ] || continue; v=$(cat "$f" 2>/dev/null); [ "${v:-0}" != 0 ] && echo "    ${f#/sys/class/infiniband/} $v"'
    echo '    done'
    echo '    return 0'
    echo '}'
    for t in "${TESTS[@]}"; do
        # Each test binary runs with its crate's directory as cwd, like `cargo test`.
        b=${t%%$'\t'*} dir=${t#*$'\t'}
        # Not an RDMA test: it runs `cargo check` on a probe crate (what a
        # user's build can reach), which the host's run covers; in the
        # emulated guest a cold probe build can outlast a job's bound.
        case ${b##*/} in test_hooks_hidden-*) continue ;; esac
        # The guest console is a tty: keep the harness output free of colour codes.
        printf 'job %q %q %q --color never' "$dir" "${b##*/}" "$b"
        for a in "$@"; do printf ' %q' "$a"; done
        echo
    done
    printf 'job %q blobstore-over-verbs %q --transport "%s"\n' "$ROOT" "$BLOBSTORE" "$SPEC"
    # Functional figures only (software RDMA under emulation): short batches.
    printf 'job %q hg-perf-rate-over-verbs %q rate --transport "%s" --mode busy,blocking --sizes 0,4K,64K --inflight 1,16 --batch-ms 100 --batches 3\n' "$ROOT" "$HG_PERF" "$SPEC"
    printf 'job %q hg-perf-lat-over-verbs %q lat --transport "%s" --mode busy --sizes 0 --batch-ms 100 --batches 3\n' "$ROOT" "$HG_PERF" "$SPEC"
    printf 'job %q hg-perf-bw-over-verbs %q bw --transport "%s" --mode busy --sizes 64K,1M,16M --batch-ms 100 --batches 3\n' "$ROOT" "$HG_PERF" "$SPEC"
    printf 'job %q na-perf-lat-over-verbs %q lat --transport "%s" --mode busy,blocking --quick\n' "$ROOT" "$NA_PERF" "$SPEC"
    printf 'job %q na-perf-bw-over-verbs %q bw --transport "%s" --quick\n' "$ROOT" "$NA_PERF" "$SPEC"
    echo 'rxe_counters "at the end"'
    echo 'exit $rc'
} > "$JOBS"
NJOBS=$(grep -c '^job ' "$JOBS")
log "$NJOBS jobs:"
grep '^job ' "$JOBS" | awk '{print "  " $3}' | sed "s|$ROOT/||" >&2

# --------------------------------------------------------------------- VM --
VM_TIMEOUT=${QS_VERBS_VM_TIMEOUT:-$((120 + NJOBS * PER_BIN))}
log "running them in the soft-RoCE VM (timeout ${VM_TIMEOUT}s, ${PER_BIN}s per job)"
T0=$(date +%s)
set +e
RUST_BACKTRACE=${RUST_BACKTRACE:-1} "${SUDO[@]}" "$VM" --timeout "$VM_TIMEOUT" -- \
    bash "$JOBS"
RC=$?
set -e
T=$(( $(date +%s) - T0 ))
case $RC in
    0) log "all $NJOBS verbs jobs passed in the VM (${T}s including boot)" ;;
    124) log "FAILED: the VM timed out after ${VM_TIMEOUT}s" ;;
    125) log "FAILED: the soft-RoCE VM itself failed (see the console output above)" ;;
    *) log "FAILED: a verbs test failed in the VM (exit $RC, ${T}s)" ;;
esac
exit "$RC"
