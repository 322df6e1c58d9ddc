#!/usr/bin/env bash
# run-in-rxe-vm.sh - run a command inside a throw-away qemu VM that has a
# soft-RoCE (rdma_rxe) RDMA device "rxe0", so real libibverbs/librdmacm
# traffic can be tested on machines without RDMA hardware or without
# CONFIG_INFINIBAND in the host kernel.
#
#   run-in-rxe-vm.sh [options] [--] COMMAND [ARGS...]
#   run-in-rxe-vm.sh --selftest          # ibv_devinfo, ibv_rc_pingpong, rping
#   run-in-rxe-vm.sh --prepare           # only install/download/build the cache
#
# How it works
#   * The guest kernel is Debian's stock linux-image-<ver>-amd64, downloaded
#     with `apt-get download` and unpacked (dpkg -x) into a cache dir; it is
#     never installed as the host kernel.  Its config has CONFIG_RDMA_RXE=m.
#   * qemu (the host's qemu-system-x86_64 if present, otherwise Debian's
#     qemu-system-x86 unpacked privately into the cache dir, so nothing on the
#     host is removed or upgraded) boots that kernel with a tiny busybox
#     initramfs.
#   * The host's whole root filesystem is shared read-only over virtio-9p and
#     used as the guest's root, with a tmpfs overlay on top (so the guest can
#     write anywhere; those writes vanish at power-off).  The current directory
#     (and every --rw DIR) is additionally shared read-write, so files written
#     there land on the host.  Paths are identical inside and outside the VM,
#     so host-built binaries (cargo test --no-run ...) run unchanged.
#   * The guest init loads rdma_rxe/ib_uverbs/rdma_ucm/ib_umad, creates a
#     dummy netdev "rxe-net" (default 10.77.0.1/24) and
#     `rdma link add rxe0 type rxe netdev rxe-net`, waits for the port to be
#     ACTIVE with its IPv4 GID, then runs the command as root in the current
#     directory with the caller's environment, and powers off.
#   * The command's stdout/stderr are streamed to this script's stdout/stderr
#     (through two emulated serial ports); its exit status becomes ours.
#
# Exit status: the command's status; 124 on timeout; 125 if the VM itself
# failed (console log is printed then).
#
# Environment knobs (all optional):
#   RXE_VM_CACHE_DIR   cache dir (default ${XDG_CACHE_HOME:-/tmp}/rxe-vm-cache)
#   RXE_VM_KERNEL_PKG  kernel package (default: whatever linux-image-amd64 pulls)
#   RXE_VM_QEMU        qemu-system-x86_64 binary to use
#   RXE_VM_ACCEL       tcg | kvm | auto (default auto: kvm only if the CPU
#                      advertises vmx/svm and /dev/kvm is usable and the host
#                      KVM is not "kvm_pvm"; otherwise tcg)
#   RXE_VM_MEM         guest RAM in MiB (default 2048)
#   RXE_VM_SMP         guest vCPUs (default: host cores, max 8)
#   RXE_VM_TIMEOUT     seconds before the VM is killed (default 1800)
#   RXE_VM_IP          IPv4/prefix of the rxe netdev (default 10.77.0.1/24)
#   RXE_VM_IP2         IPv4/prefix of the second device's netdev (rxe1;
#                      default 10.78.0.1/24)
#   RXE_VM_NO_APT=1    never call apt-get (fail if something is missing)
#
# Inside the guest the command additionally sees RXE_VM=1, RXE_VM_DEV=rxe0,
# RXE_VM_IP=<addr/prefix> and RXE_VM_ADDR=<addr> (default 10.77.0.1): use
# that address for RDMA CM, never 127.0.0.1. A second device, for tests of
# picking a device by address: RXE_VM_DEV2=rxe1, RXE_VM_ADDR2 (10.78.0.1).
#
# As a cargo runner (cargo passes the test binary and its arguments):
#   CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER=$PWD/tools/rxe-vm/run-in-rxe-vm.sh \
#       cargo test -p na-verbs --test sys_rc
set -euo pipefail

SCRIPT_NAME=${0##*/}
log() { printf '%s: %s\n' "$SCRIPT_NAME" "$*" >&2; }
die() { log "error: $*"; exit 125; }

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
    cat <<EOF
Options:
  --prepare       install packages and build the kernel/initramfs cache, then exit
  --selftest      run a built-in RDMA smoke test in the VM
  --rw DIR        also share DIR read-write (repeatable; the cwd is shared rw by default)
  --no-cwd-rw     do not share the current directory read-write
  --mem MB        guest RAM (default \$RXE_VM_MEM or 2048)
  --smp N         guest vCPUs
  --timeout SEC   kill the VM after SEC seconds (exit 124)
  --accel A       tcg | kvm | auto
  -v, --verbose   show kernel/init console on stderr
  -h, --help
EOF
}

# ---------------------------------------------------------------- options --
CACHE_DIR=${RXE_VM_CACHE_DIR:-${XDG_CACHE_HOME:-/tmp}/rxe-vm-cache}
MEM=${RXE_VM_MEM:-2048}
NCPU=$(nproc 2>/dev/null || echo 2); [ "$NCPU" -gt 8 ] && NCPU=8
SMP=${RXE_VM_SMP:-$NCPU}
TIMEOUT=${RXE_VM_TIMEOUT:-1800}
ACCEL=${RXE_VM_ACCEL:-auto}
RXE_IP=${RXE_VM_IP:-10.77.0.1/24}
RXE_IP2=${RXE_VM_IP2:-10.78.0.1/24}
PREPARE_ONLY=0 SELFTEST=0 VERBOSE=0 CWD_RW=1
RW_DIRS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --prepare) PREPARE_ONLY=1 ;;
        --selftest) SELFTEST=1 ;;
        --rw) RW_DIRS+=("$(realpath -e -- "$2")"); shift ;;
        --no-cwd-rw) CWD_RW=0 ;;
        --mem) MEM=$2; shift ;;
        --smp) SMP=$2; shift ;;
        --timeout) TIMEOUT=$2; shift ;;
        --accel) ACCEL=$2; shift ;;
        -v|--verbose) VERBOSE=1 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
    shift
done
if [ $# -eq 0 ] && [ $PREPARE_ONLY = 0 ] && [ $SELFTEST = 0 ]; then
    usage >&2; exit 125
fi
[ "$(id -u)" = 0 ] || die "must run as root (apt-get, and qemu 9p export of /)"

mkdir -p "$CACHE_DIR"
CACHE_DIR=$(realpath "$CACHE_DIR")

# ---------------------------------------------------------- host packages --
# Runtime tools used on the host *and* inside the guest (the guest runs the
# host's userland): kmod (depmod/modprobe), iproute2 (ip, rdma), the rxe
# verbs provider, and the usual RDMA test tools.  The initramfs's static
# busybox is not among them: see ensure_busybox.
HOST_PKGS=(kmod xz-utils iproute2 ibverbs-providers libibverbs1 librdmacm1
           ibverbs-utils rdmacm-utils perftest)
APT_UPDATED=0
apt_update_once() {
    [ "${RXE_VM_NO_APT:-0}" = 1 ] && die "RXE_VM_NO_APT=1 but packages are missing"
    if [ $APT_UPDATED = 0 ]; then
        log "apt-get update"
        apt-get update -qq >&2 || die "apt-get update failed"
        APT_UPDATED=1
    fi
}
pkg_installed() {
    [ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null)" = installed ]
}
ensure_host_packages() {
    local missing=() p
    for p in "${HOST_PKGS[@]}"; do pkg_installed "$p" || missing+=("$p"); done
    [ ${#missing[@]} = 0 ] && return 0
    apt_update_once
    log "installing ${missing[*]}"
    # --no-remove: never let apt remove anything on the host.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        --no-remove "${missing[@]}" > "$CACHE_DIR/apt-install.log" 2>&1 ||
        { cat "$CACHE_DIR/apt-install.log" >&2; die "apt-get install ${missing[*]} failed"; }
}

# ----------------------------------------------------------------- busybox --
# The initramfs needs a *static* busybox.  Use /bin/busybox if it is one
# (Debian's busybox-static); otherwise unpack busybox-static privately into
# $CACHE_DIR/busybox: installing it would conflict with (and, without
# --no-remove, remove) the dynamic `busybox` package many images carry.
BUSYBOX=
is_static() {
    [ -x "$1" ] || return 1
    local out; out=$(LC_ALL=C ldd "$1" 2>&1 || true)   # ldd exits 1 for a static binary
    [[ $out == *'not a dynamic executable'* ]]
}
ensure_busybox() {
    if is_static /bin/busybox; then BUSYBOX=/bin/busybox; return; fi
    local b=$CACHE_DIR/busybox
    if ! is_static "$b/root/bin/busybox"; then
        apt_update_once
        log "unpacking a private busybox-static into $b"
        rm -rf "$b"; mkdir -p "$b/debs"
        (cd "$b/debs" && apt-get download -qq -o APT::Sandbox::User=root busybox-static >&2) ||
            die "apt-get download busybox-static failed"
        dpkg-deb -x "$b"/debs/*.deb "$b/root"
        rm -rf "$b/debs"
        is_static "$b/root/bin/busybox" || die "busybox-static did not give a static $b/root/bin/busybox"
    fi
    BUSYBOX=$b/root/bin/busybox
}

# -------------------------------------------------------------------- qemu --
# Prefer an installed qemu-system-x86_64.  Otherwise unpack Debian's
# qemu-system-x86 and exactly the packages apt *would* install with it into
# $CACHE_DIR/qemu (apt-get install would, e.g., remove a newer backported
# qemu-utils on some images; unpacking privately never touches the host).
QEMU=() QEMU_ENV=()
ensure_qemu() {
    if [ -n "${RXE_VM_QEMU:-}" ]; then QEMU=("$RXE_VM_QEMU"); return; fi
    if command -v qemu-system-x86_64 >/dev/null; then QEMU=(qemu-system-x86_64); return; fi
    local q=$CACHE_DIR/qemu
    if [ ! -x "$q/root/usr/bin/qemu-system-x86_64" ]; then
        apt_update_once
        log "unpacking a private qemu-system-x86 into $q"
        rm -rf "$q"; mkdir -p "$q/debs" "$q/root"
        # Ask apt what it would install (simulation, changes nothing).
        local specs
        specs=$(apt-get install -s --no-install-recommends qemu-system-x86 2>/dev/null |
                awk '$1=="Inst" { v=$3; if (v ~ /^\[/) v=$4; gsub(/[()]/,"",v); print $2"="v }')
        [ -n "$specs" ] || die "apt-get could not resolve qemu-system-x86"
        # shellcheck disable=SC2086
        (cd "$q/debs" && apt-get download -qq -o APT::Sandbox::User=root $specs >&2) || die "apt-get download qemu failed"
        local d; for d in "$q"/debs/*.deb; do dpkg-deb -x "$d" "$q/root"; done
        rm -rf "$q/debs"
    fi
    QEMU=("$q/root/usr/bin/qemu-system-x86_64"
          -L "$q/root/usr/share/qemu" -L "$q/root/usr/share/seabios" -L "$q/root/usr/lib/ipxe/qemu")
    QEMU_ENV=(env "LD_LIBRARY_PATH=$q/root/usr/lib/x86_64-linux-gnu:$q/root/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
}

# ------------------------------------------------------------------ kernel --
KVER= KDIR=
ensure_kernel() {
    local pkg=${RXE_VM_KERNEL_PKG:-}
    if [ -z "$pkg" ]; then
        # Reuse a cached kernel if there is one (keeps repeated runs offline).
        local cached; cached=$(ls -d "$CACHE_DIR"/kernel/linux-image-*/ 2>/dev/null | sort -V | tail -n1 || true)
        if [ -n "$cached" ] && [ -f "$cached/.ok" ]; then
            pkg=$(basename "$cached")
        else
            apt_update_once
            pkg=$(apt-cache depends linux-image-amd64 2>/dev/null |
                  awk '$1=="Depends:" && $2 ~ /^linux-image-[0-9]/ { print $2; exit }')
            [ -n "$pkg" ] || die "cannot find the Debian kernel package (linux-image-amd64)"
        fi
    fi
    KVER=${pkg#linux-image-}
    KDIR=$CACHE_DIR/kernel/$pkg
    if [ ! -f "$KDIR/.ok" ]; then
        apt_update_once
        log "downloading and unpacking $pkg"
        rm -rf "$KDIR"; mkdir -p "$KDIR"
        (cd "$KDIR" && apt-get download -qq -o APT::Sandbox::User=root "$pkg" >&2) || die "apt-get download $pkg failed"
        dpkg-deb -x "$KDIR"/*.deb "$KDIR/root"
        rm -f "$KDIR"/*.deb
        grep -q '^CONFIG_RDMA_RXE=[ym]' "$KDIR/root/boot/config-$KVER" ||
            die "$pkg has no CONFIG_RDMA_RXE"
        depmod -b "$KDIR/root" "$KVER"
        # Unpack the xz-compressed bzImage into a plain ELF vmlinux: qemu can
        # boot that directly (PVH entry), which saves ~4s of in-guest
        # decompression under TCG.  Falls back to the bzImage if this fails.
        local bz=$KDIR/root/boot/vmlinuz-$KVER off
        off=$(LC_ALL=C grep -aob $'\xfd7zXZ\x00' "$bz" | head -n1 | cut -d: -f1 || true)
        if [ -n "$off" ]; then
            tail -c +$((off + 1)) "$bz" | xz -dc > "$KDIR/vmlinux" 2>/dev/null || true
            if [ "$(head -c4 "$KDIR/vmlinux" | od -An -c | tr -d ' ')" != '177ELF' ]; then
                rm -f "$KDIR/vmlinux"
            fi
        fi
        touch "$KDIR/.ok"
    fi
}

# --------------------------------------------------------------- initramfs --
# PID 1 of the guest (busybox sh).  Kept in the initramfs; the host root is
# only chroot'ed into for the command, so that PID 1 can always power off.
read -r -d '' GUEST_INIT <<'INIT_EOF' || true
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
say() { echo "rxe-vm-init: [$(cut -d' ' -f1 /proc/uptime)s] $*" > /dev/ttyS0; }
fail() { say "FATAL: $*"; echo init-failed > /rxerun/status 2>/dev/null; sync; poweroff -f; }
R=/newroot

say "init started"
for m in $(cat /modules/order); do insmod /modules/$m || say "insmod $m failed"; done

mkdir -p /rxerun /lower /ovl $R
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=none rxerun /rxerun || fail "mount rxerun"
. /rxerun/vm.conf
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=loose,ro hostroot /lower || fail "mount host root"
mount -t tmpfs -o mode=0755 tmpfs /ovl && mkdir -p /ovl/upper /ovl/work
mount -t overlay -o lowerdir=/lower,upperdir=/ovl/upper,workdir=/ovl/work overlay $R || fail "overlay"

# Fresh pseudo filesystems for the guest root.
mount -t proc proc $R/proc
mount -t sysfs sysfs $R/sys
mount -t devtmpfs devtmpfs $R/dev
mkdir -p $R/dev/pts $R/dev/shm $R/run/rxe-vm
mount -t devpts -o newinstance,ptmxmode=0666 devpts $R/dev/pts
mount -t tmpfs -o mode=1777 tmpfs $R/dev/shm
# (No tmpfs on /tmp: the host's /tmp must stay visible; the overlay already
# makes it writable.)
[ -d $R/sys/kernel/debug ] && mount -t debugfs debugfs $R/sys/kernel/debug 2>/dev/null
mount --bind /rxerun $R/run/rxe-vm
# Read-write shares (cwd, --rw DIRs) at their host paths.
i=0
while [ $i -lt "$RW_COUNT" ]; do
    eval "p=\$RW_$i"
    mkdir -p "$R$p"
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=mmap "rw$i" "$R$p" || fail "mount rw$i at $p"
    i=$((i+1))
done
# The guest kernel's modules, where the host's kmod expects them; the kernel
# asks for modules through the host's modprobe run inside the chroot.
mkdir -p "$R/lib/modules/$KVER"
mount --bind "$R$KMODDIR" "$R/lib/modules/$KVER" || fail "bind modules"
printf '#!/bin/busybox sh\nexec /bin/busybox chroot %s /sbin/modprobe "$@"\n' $R > /bin/modprobe-chroot
chmod 755 /bin/modprobe-chroot
echo /bin/modprobe-chroot > /proc/sys/kernel/modprobe
ch() { chroot $R "$@"; }

say "root filesystem ready"
# Network + soft-RoCE.
ch ip link set lo up
ch modprobe dummy numdummies=0 || say "modprobe dummy failed"
ch ip link add rxe-net type dummy || fail "ip link add dummy"
ch ip addr add "$RXE_IP" dev rxe-net
ch ip link set rxe-net up
for m in rdma_rxe ib_uverbs rdma_ucm ib_umad crc32_generic; do ch modprobe $m || say "modprobe $m failed"; done
ch rdma link add rxe0 type rxe netdev rxe-net || fail "rdma link add"
# A second device on a netdev of its own (a host with two NICs): tests of
# choosing the device an address belongs to use it.
ch ip link add rxe-net2 type dummy || fail "ip link add dummy 2"
ch ip addr add "$RXE_IP2" dev rxe-net2
ch ip link set rxe-net2 up
ch rdma link add rxe1 type rxe netdev rxe-net2 || fail "rdma link add rxe1"
# Wait (max ~10s each) for the ports to become ACTIVE with their IPv4 GIDs.
wait_port() { # device ip
    n=0
    while :; do
        st=$(cat /sys/class/infiniband/$1/ports/1/state 2>/dev/null)
        gids=$(cat /sys/class/infiniband/$1/ports/1/gids/* 2>/dev/null)
        case "$st" in *ACTIVE*) echo "$gids" | grep -q "ffff:$(printf '%02x%02x:%02x%02x' $(echo $2 | tr . ' '))" && break ;; esac
        n=$((n+1)); [ $n -gt 100 ] && { say "$1 port not ready: $st"; break; }
        sleep 0.1
    done
    say "$1 ready after $((n*100))ms"
}
wait_port rxe0 "${RXE_IP%/*}"
wait_port rxe1 "${RXE_IP2%/*}"
say "running command"

# Raw serial lines: no \n -> \r\n translation, no echo.
stty -F /dev/ttyS1 raw -echo 2>/dev/null
stty -F /dev/ttyS2 raw -echo 2>/dev/null
chroot $R /bin/bash /run/rxe-vm/cmd.sh < /dev/null > /dev/ttyS1 2> /dev/ttyS2
rc=$?
echo $rc > /rxerun/status
say "command exited with status $rc"
sync
poweroff -f
INIT_EOF

INITRD=
BOOT_MODULES=(virtio_pci 9pnet_virtio 9p overlay)
ensure_initramfs() {
    local h
    h=$( { printf '%s\n' "$GUEST_INIT" "${BOOT_MODULES[@]}"; cat "$BUSYBOX"; } | sha256sum | cut -c1-12)
    INITRD=$KDIR/initramfs-$h.cpio
    [ -f "$INITRD" ] && return 0
    log "building initramfs $INITRD"
    local t; t=$(mktemp -d "$CACHE_DIR/initramfs.XXXXXX")
    mkdir -p "$t/bin" "$t/modules" "$t/proc" "$t/sys" "$t/dev" "$t/newroot"
    cp "$BUSYBOX" "$t/bin/busybox"
    printf '%s\n' "$GUEST_INIT" > "$t/init"; chmod 755 "$t/init"
    # Module load order with dependencies, as modprobe would do it.
    local m f seen=" "
    for m in "${BOOT_MODULES[@]}"; do
        while read -r _ f _; do
            case "$seen" in *" ${f##*/} "*) continue ;; esac
            seen="$seen${f##*/} "
            cp "$f" "$t/modules/"
            echo "${f##*/}" >> "$t/modules/order"
        done < <(modprobe -d "$KDIR/root" -S "$KVER" --show-depends "$m" | grep '^insmod ')
    done
    (cd "$t" && find . | "$BUSYBOX" cpio -o -H newc 2>/dev/null) > "$t.cpio"
    mv "$t.cpio" "$INITRD"
    rm -rf "$t"
}

choose_accel() {
    case "$ACCEL" in
        tcg|kvm) return ;;
        auto) ;;
        *) die "bad --accel $ACCEL" ;;
    esac
    ACCEL=tcg
    # /dev/kvm is not enough: some sandboxes (e.g. "kvm_pvm" hosts) expose a
    # /dev/kvm that cannot run a stock kernel at useful speed.
    if [ -r /dev/kvm ] && [ -w /dev/kvm ] && grep -qwE 'vmx|svm' /proc/cpuinfo &&
       [ ! -d /sys/module/kvm_pvm ]; then
        ACCEL=kvm
    fi
}

shq() { # single-quote for sh/bash
    local s=${1//\'/\'\\\'\'}; printf "'%s'" "$s"
}

# -------------------------------------------------------------------- main --
# Serialise cache preparation between concurrent invocations.
exec 9> "$CACHE_DIR/.lock"
flock 9
ensure_host_packages
ensure_busybox
ensure_qemu
ensure_kernel
ensure_initramfs
exec 9>&-
choose_accel
if [ $PREPARE_ONLY = 1 ]; then
    log "cache ready in $CACHE_DIR (kernel $KVER, qemu ${QEMU[0]}, accel $ACCEL)"
    exit 0
fi

if [ $SELFTEST = 1 ]; then
    # Server and client in the same VM; both use rxe0 (loopback inside rxe).
    set -- bash -c '
        set -eu
        ip4=$1
        retry() { local i; for i in $(seq 30); do "$@" && return 0; sleep 0.5; done; return 1; }
        wait_tcp() { local i; for i in $(seq 100); do ss -ltnH | grep -q ":$1 " && return 0; sleep 0.1; done; }
        rdma link show
        ibv_devices
        ibv_devinfo -d rxe0 | grep -E "hca_id|state|active_mtu|link_layer"
        echo "== ibv_rc_pingpong: RC send/recv, GID index 1 (RoCEv2, IPv4-mapped)"
        ibv_rc_pingpong -d rxe0 -g 1 -n 1000 > /tmp/srv.log 2>&1 & s=$!
        wait_tcp 18515
        retry ibv_rc_pingpong -d rxe0 -g 1 -n 1000 localhost
        wait $s
        echo "== rping: RDMA CM connect + RDMA READ/WRITE, 100 x 1 KiB, verified"
        rping -s -a "$ip4" -C 100 -S 1024 > /tmp/srv.log 2>&1 & s=$!
        sleep 1
        retry rping -c -a "$ip4" -C 100 -S 1024 -V
        wait $s
        echo "== ib_write_bw: 1000 x 64 KiB RDMA WRITE"
        ib_write_bw -d rxe0 -x 1 -s 65536 -n 1000 > /tmp/srv.log 2>&1 & s=$!
        wait_tcp 18515
        retry ib_write_bw -d rxe0 -x 1 -s 65536 -n 1000 "$ip4" | tail -n 3
        wait $s
        echo SELFTEST-OK' rxe-selftest "${RXE_IP%/*}"
fi

RUN=$(mktemp -d "${TMPDIR:-/tmp}/rxe-vm-run.XXXXXX")
QPID= CATS=()
cleanup() {
    [ -z "$QPID" ] || kill "$QPID" 2>/dev/null || true
    local p; for p in "${CATS[@]}"; do kill "$p" 2>/dev/null || true; done
    rm -rf "$RUN"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

CWD=$(pwd -P)
RW=()
[ $CWD_RW = 1 ] && [ "$CWD" != / ] && RW+=("$CWD")
RW+=("${RW_DIRS[@]}")

{
    echo "KVER=$(shq "$KVER")"
    echo "KMODDIR=$(shq "$KDIR/root/lib/modules/$KVER")"
    echo "RXE_IP=$(shq "$RXE_IP")"
    echo "RXE_IP2=$(shq "$RXE_IP2")"
    echo "RW_COUNT=${#RW[@]}"
    for i in "${!RW[@]}"; do echo "RW_$i=$(shq "${RW[$i]}")"; done
} > "$RUN/vm.conf"

{
    echo '# generated by run-in-rxe-vm.sh: caller environment, cwd and command'
    export -p | grep -vE '^declare -x (PWD|OLDPWD|SHLVL|_)(=|$)'
    # What the command can rely on inside the guest (tests key off these).
    printf 'export RXE_VM=1 RXE_VM_DEV=rxe0 RXE_VM_IP=%s RXE_VM_ADDR=%s RXE_VM_DEV2=rxe1 RXE_VM_ADDR2=%s\n' \
        "$(shq "$RXE_IP")" "$(shq "${RXE_IP%/*}")" "$(shq "${RXE_IP2%/*}")"
    echo 'ulimit -l unlimited 2>/dev/null'
    printf 'cd -- %s || exit 125\n' "$(shq "$CWD")"
    printf 'exec'; for a in "$@"; do printf ' %s' "$(shq "$a")"; done; echo
} > "$RUN/cmd.sh"

KIMG=$KDIR/vmlinux; [ -f "$KIMG" ] || KIMG=$KDIR/root/boot/vmlinuz-$KVER
KARGS="console=ttyS0 loglevel=4 panic=-1 rdinit=/init mitigations=off init_on_alloc=0 8250.nr_uarts=4 random.trust_cpu=on"
case $ACCEL in
    kvm) ACCEL_ARGS=(-accel kvm -cpu host) ;;
    tcg) ACCEL_ARGS=(-accel tcg,thread=multi -cpu max) ;;
esac
VIRTFS=(-virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"
        -virtfs "local,path=$RUN,mount_tag=rxerun,security_model=none")
for i in "${!RW[@]}"; do
    VIRTFS+=(-virtfs "local,path=${RW[$i]},mount_tag=rw$i,security_model=none,multidevs=remap")
done
if [ $VERBOSE = 1 ]; then CONSOLE=$RUN/console.fifo; else CONSOLE=$RUN/console.log; fi

# The guest's serial output reaches our stdout/stderr through FIFOs drained
# by `cat`, so it goes through *our* file descriptors (qemu opening
# /proc/self/fd/1 itself would get a new file offset and clobber a
# redirected output file).
mkfifo "$RUN/stdout.fifo" "$RUN/stderr.fifo" "$RUN/console.fifo"
cat "$RUN/stdout.fifo" & CATS+=($!)
cat "$RUN/stderr.fifo" >&2 & CATS+=($!)
[ $VERBOSE = 1 ] && { cat "$RUN/console.fifo" >&2 & CATS+=($!); }

# Serial ports: ttyS0 = kernel/init console, ttyS1 = command stdout,
# ttyS2 = command stderr.  Our own stdin is never connected to the guest.
timeout -k 10 "$TIMEOUT" "${QEMU_ENV[@]}" "${QEMU[@]}" "${ACCEL_ARGS[@]}" -machine pc -m "$MEM" -smp "$SMP" \
    -nodefaults -no-user-config -display none -no-reboot -nic none \
    -kernel "$KIMG" -initrd "$INITRD" -append "$KARGS" \
    -chardev "file,id=con,path=$CONSOLE,append=on" -serial chardev:con \
    -chardev "file,id=out,path=$RUN/stdout.fifo,append=on" -serial chardev:out \
    -chardev "file,id=err,path=$RUN/stderr.fifo,append=on" -serial chardev:err \
    "${VIRTFS[@]}" </dev/null &
QPID=$!
set +e
wait "$QPID"; QRC=$?
set -e
QPID=
# Release any cat still blocked in open() (qemu died early), then let the
# cats drain whatever qemu wrote.
for f in stdout stderr console; do exec 3<>"$RUN/$f.fifo"; exec 3>&-; done
wait "${CATS[@]}" 2>/dev/null || true

if [ $QRC = 124 ] && [ ! -f "$RUN/status" ]; then
    log "timed out after ${TIMEOUT}s"; [ $VERBOSE = 1 ] || tail -n 40 "$RUN/console.log" >&2; exit 124
fi
if [ ! -f "$RUN/status" ]; then
    log "VM ended without a command status (qemu exit $QRC); console follows"
    [ $VERBOSE = 1 ] || cat "$RUN/console.log" >&2
    exit 125
fi
STATUS=$(cat "$RUN/status")
case "$STATUS" in
    ''|*[!0-9]*)
        log "VM setup failed ($STATUS); console follows"
        [ $VERBOSE = 1 ] || cat "$RUN/console.log" >&2
        exit 125 ;;
esac
exit "$STATUS"
