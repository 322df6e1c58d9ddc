#!/usr/bin/env bash
# install-deps.sh - install every system package and cargo tool that building
# and testing Quicksilver needs, on Debian 12 (bookworm), x86_64.
#
#   sudo scripts/install-deps.sh          # or: ./x deps
#   scripts/install-deps.sh --check       # only report what is missing (exit 1 if anything is)
#
# Idempotent: a package that is already installed is left alone, `apt-get
# update` runs at most once and only when something is missing, and a stamp
# file makes the second run a single dpkg-query call.  It never removes a
# package (`apt-get install --no-remove`): in particular the preinstalled
# backports qemu-utils stays (installing Debian 12's qemu-system-x86 would
# remove it, so the soft-RoCE VM unpacks its own qemu privately instead; see
# tools/rxe-vm/README.md).
#
# Environment:
#   QS_DEPS_STAMP   stamp file (default /var/lib/quicksilver/install-deps.stamp)
#   QS_DEPS_FORCE=1 ignore the stamp and check everything again
set -euo pipefail

log() { printf 'install-deps: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

CHECK_ONLY=0
case "${1:-}" in
    --check) CHECK_ONLY=1 ;;
    '') ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
esac

# ------------------------------------------------------------ package list --
# Build: rdma-sys 0.3 runs bindgen 0.59 (through clang-sys, at build time)
# over the rdma-core headers it finds with pkg-config.  Without
# libclang-common-14-dev bindgen fails with "'stddef.h' file not found".
BUILD_PKGS=(build-essential pkg-config
            libibverbs-dev librdmacm-dev
            libclang-dev libclang1-14 libclang-common-14-dev)
# Runtime for the verbs tests: the rxe provider (ibverbs-providers) and the
# rdma-core libraries.  The soft-RoCE VM runs the host's userland, so these
# are also what the guest uses.
RDMA_RUNTIME_PKGS=(ibverbs-providers libibverbs1 librdmacm1)
# tools/rxe-vm/run-in-rxe-vm.sh: kmod for depmod/modprobe, xz to unpack the
# kernel, iproute2 for `ip`/`rdma`/`ss`, and the standard RDMA tools its
# --selftest runs.  The script installs these itself when missing;
# installing them here keeps test runs offline.  (Its static busybox is
# unpacked privately when /bin/busybox is not static: busybox-static
# conflicts with the `busybox` package, and this script never removes one.)
# python3: scripts/test-verbs.sh reads cargo's JSON messages with it.
RXE_VM_PKGS=(kmod xz-utils iproute2 util-linux coreutils
             ibverbs-utils rdmacm-utils perftest python3)
PKGS=("${BUILD_PKGS[@]}" "${RDMA_RUNTIME_PKGS[@]}" "${RXE_VM_PKGS[@]}")
# Rust toolchain components the test command uses (cargo fmt, cargo clippy).
RUST_COMPONENTS=(rustfmt clippy)

STAMP=${QS_DEPS_STAMP:-/var/lib/quicksilver/install-deps.stamp}
case ${QS_DEPS_FORCE:-0} in 0 | 1) ;; *) die "QS_DEPS_FORCE must be 0 or 1, got '$QS_DEPS_FORCE'" ;; esac
# The stamp records the package list it was written for: editing the list
# above invalidates it.
STAMP_KEY=$(printf '%s\n' "${PKGS[@]}" "${RUST_COMPONENTS[@]}" | sha256sum | cut -c1-16)

# Prints the packages of "$@" that are not installed (one dpkg-query call).
missing_pkgs() {
    local installed
    installed=$(dpkg-query -W -f='${Package} ${db:Status-Status}\n' "$@" 2>/dev/null |
                awk '$2 == "installed" { print $1 }' | sort -u || true)
    local p
    for p in "$@"; do
        grep -qxF -- "$p" <<<"$installed" || printf '%s\n' "$p"
    done
}

missing_components() {
    local have c
    have=$(rustup component list --installed 2>/dev/null || true)
    for c in "${RUST_COMPONENTS[@]}"; do
        grep -q "^$c" <<<"$have" || printf '%s\n' "$c"
    done
}

# ---------------------------------------------------------------- fast path --
if [ "${QS_DEPS_FORCE:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$STAMP_KEY" ] &&
   [ -z "$(missing_pkgs "${PKGS[@]}")" ]; then
    log "all system packages present (stamp $STAMP)"
    exit 0
fi

command -v dpkg-query >/dev/null && command -v apt-get >/dev/null ||
    die "this script supports Debian 12 (apt/dpkg) only; install by hand: ${PKGS[*]}"
if [ -r /etc/debian_version ]; then
    case "$(cat /etc/debian_version)" in
        12*|bookworm*) ;;
        *) log "warning: tested on Debian 12, this is Debian $(cat /etc/debian_version)" ;;
    esac
fi

# ---------------------------------------------------------- system packages --
mapfile -t MISSING < <(missing_pkgs "${PKGS[@]}")
if [ ${#MISSING[@]} -eq 0 ]; then
    log "all ${#PKGS[@]} system packages already installed"
elif [ $CHECK_ONLY = 1 ]; then
    log "missing packages: ${MISSING[*]}"
else
    [ "$(id -u)" = 0 ] || die "missing packages (${MISSING[*]}); run as root: sudo $0"
    export DEBIAN_FRONTEND=noninteractive
    # Update the index only if apt cannot resolve what we need from it.
    if ! apt-get install -s -qq --no-install-recommends --no-remove "${MISSING[@]}" >/dev/null 2>&1; then
        log "apt-get update"
        apt-get update -qq || die "apt-get update failed"
    fi
    log "installing: ${MISSING[*]}"
    # Show what apt will pull in as dependencies, too.
    apt-get install -s -qq --no-install-recommends --no-remove "${MISSING[@]}" 2>/dev/null |
        awk '$1 == "Inst" { printf "install-deps:   + %s %s\n", $2, $3 }' >&2 || true
    APT_LOG=$(mktemp "${TMPDIR:-/tmp}/install-deps.XXXXXX.log")
    if ! apt-get install -y -qq --no-install-recommends --no-remove "${MISSING[@]}" >"$APT_LOG" 2>&1; then
        cat "$APT_LOG" >&2
        die "apt-get install failed (--no-remove: it fails rather than remove a package; log above)"
    fi
    rm -f "$APT_LOG"
    mapfile -t STILL < <(missing_pkgs "${PKGS[@]}")
    [ ${#STILL[@]} -eq 0 ] || die "still missing after apt-get install: ${STILL[*]}"
    log "installed ${#MISSING[@]} package(s)"
fi

# ------------------------------------------------------------- cargo tools --
command -v cargo >/dev/null ||
    die "cargo not found: install Rust with rustup (https://rustup.rs), then re-run"
mapfile -t MISSING_COMP < <(missing_components)
if [ ${#MISSING_COMP[@]} -gt 0 ]; then
    if [ $CHECK_ONLY = 1 ]; then
        log "missing rust components: ${MISSING_COMP[*]}"
    else
        log "rustup component add ${MISSING_COMP[*]}"
        rustup component add "${MISSING_COMP[@]}" || die "rustup component add failed"
    fi
fi
if cargo nextest --version >/dev/null 2>&1; then
    log "cargo-nextest: $(cargo nextest --version 2>/dev/null | head -n1)"
else
    # Optional: scripts/test-all.sh falls back to `cargo test` without it.
    log "cargo-nextest not installed (optional; tests fall back to cargo test)." \
        "Install with: cargo install --locked cargo-nextest"
fi

if [ $CHECK_ONLY = 1 ]; then
    [ ${#MISSING[@]} -eq 0 ] && [ ${#MISSING_COMP[@]} -eq 0 ] && exit 0
    exit 1
fi

if [ "$(id -u)" = 0 ]; then
    mkdir -p "$(dirname "$STAMP")" && printf '%s\n' "$STAMP_KEY" > "$STAMP"
fi
log "done"
