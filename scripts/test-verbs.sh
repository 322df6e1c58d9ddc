#!/usr/bin/env bash
# test-verbs.sh - run the RDMA verbs tests on a real kernel RDMA stack.
#
#   scripts/test-verbs.sh [TEST-BINARY ARGS...]    e.g. scripts/test-verbs.sh --nocapture
#
# Builds the test binaries of the verbs crates on the host
# (`cargo test --no-run --message-format=json`), then boots one throw-away
# soft-RoCE VM (tools/rxe-vm/run-in-rxe-vm.sh, device rxe0 at $RXE_VM_IP,
# default 10.77.0.1) and runs every binary in it, one after the other. Extra
# arguments go to each test binary.
#
# Exit status: 0 if every binary passed; the failing binary's status
# otherwise; 124 if the VM timed out; 125 if the VM itself failed.
#
# Environment:
#   QS_VERBS_CRATES      crates whose tests run in the VM (default: na-verbs)
#   QS_VERBS_TIMEOUT     seconds per test binary inside the VM (default 300)
#   QS_VERBS_VM_TIMEOUT  seconds for the whole VM (default: 120 + binaries x per-binary)
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
case $PER_BIN in ''|*[!0-9]*) die "QS_VERBS_TIMEOUT must be a number of seconds, got '$PER_BIN'" ;; esac

SUDO=()
if [ "$(id -u)" != 0 ]; then
    sudo -n true 2>/dev/null || die "the soft-RoCE VM needs root: run as root or allow passwordless sudo"
    SUDO=(sudo -n --preserve-env)
fi
[ -x "$VM" ] || die "missing $VM"

# ------------------------------------------------------------------ build --
PKG_ARGS=()
for c in "${CRATES[@]}"; do PKG_ARGS+=(-p "$c"); done
log "building test binaries on the host: cargo test ${PKG_ARGS[*]} --no-run"
JSON=$(mktemp "${TMPDIR:-/tmp}/test-verbs.XXXXXX.json")
trap 'rm -f "$JSON"' EXIT
if ! cargo test "${PKG_ARGS[@]}" --no-run --message-format=json-render-diagnostics > "$JSON"; then
    die "cargo test --no-run failed"
fi
# Test executables: compiler-artifact lines of test profiles with an executable.
mapfile -t BINS < <(grep '"reason":"compiler-artifact"' "$JSON" | grep '"test":true' |
                     grep -o '"executable":"[^"]*"' | sed 's/^"executable":"//; s/"$//' | sort -u)
[ ${#BINS[@]} -gt 0 ] || die "cargo produced no test binaries for ${CRATES[*]}"
# Each binary runs with its crate's directory as cwd, like `cargo test` does.
DIRS=()
for b in "${BINS[@]}"; do
    line=$(grep -F "\"executable\":\"$b\"" "$JSON" | head -n1)
    manifest=$(grep -o '"manifest_path":"[^"]*"' <<< "$line" | sed 's/^"manifest_path":"//; s/"$//')
    DIRS+=("$(dirname "${manifest:-$ROOT/Cargo.toml}")")
done
log "${#BINS[@]} test binaries:"
for b in "${BINS[@]}"; do log "  ${b#"$ROOT"/}"; done

# --------------------------------------------------------------------- VM --
# The guest runs this script: every binary, bounded, status of the first failure.
GUEST_SCRIPT='
per_bin=$1; shift
n=$1; shift
bins=("${@:1:$n}"); dirs=("${@:$((n+1)):$n}"); args=("${@:$((2*n+1))}")
rc=0
for i in "${!bins[@]}"; do
    b=${bins[$i]}
    echo "==> [rxe-vm] ${b##*/} (cwd ${dirs[$i]})"
    t0=$(date +%s%N)
    # The guest console is a tty: keep the harness output free of colour codes.
    (cd "${dirs[$i]}" && timeout -k 5 "$per_bin" "$b" --color never "${args[@]}")
    s=$?
    echo "==> [rxe-vm] ${b##*/}: exit $s in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
    [ $s = 124 ] && echo "==> [rxe-vm] ${b##*/} TIMED OUT after ${per_bin}s" >&2
    [ $s != 0 ] && [ $rc = 0 ] && rc=$s
done
exit $rc'
VM_TIMEOUT=${QS_VERBS_VM_TIMEOUT:-$((120 + ${#BINS[@]} * PER_BIN))}
log "running them in the soft-RoCE VM (timeout ${VM_TIMEOUT}s, ${PER_BIN}s per binary)"
T0=$(date +%s)
set +e
RUST_BACKTRACE=${RUST_BACKTRACE:-1} "${SUDO[@]}" "$VM" --timeout "$VM_TIMEOUT" -- \
    bash -c "$GUEST_SCRIPT" rxe-tests "$PER_BIN" "${#BINS[@]}" "${BINS[@]}" "${DIRS[@]}" "$@"
RC=$?
set -e
T=$(( $(date +%s) - T0 ))
case $RC in
    0) log "all ${#BINS[@]} verbs test binaries passed in the VM (${T}s including boot)" ;;
    124) log "FAILED: the VM timed out after ${VM_TIMEOUT}s" ;;
    125) log "FAILED: the soft-RoCE VM itself failed (see the console output above)" ;;
    *) log "FAILED: a verbs test failed in the VM (exit $RC, ${T}s)" ;;
esac
exit "$RC"
