#!/usr/bin/env bash
# Builds hg-perf and na-perf with profile-guided optimization (PGO), the
# way a service that embeds Quicksilver can build itself:
#
#   1. an instrumented build (-Cprofile-generate) of both benchmarks;
#   2. training runs that go through the code paths the benchmarks
#      measure, but never with the configuration they report (payloads
#      of 8 B, 1 KiB and 64 KiB at 4 in flight, not 0 B at 1 and 16;
#      na-perf at 64 B and 1 KiB, not its 8-byte ceilings);
#   3. the profiles merged (llvm-profdata of rustc's own LLVM);
#   4. the optimized build (-Cprofile-use), in target/pgo/.
#
#   scripts/pgo-build.sh      # or ./x pgo; prints the directory of the two binaries:
#   target/pgo/<host>/release/hg-perf rate --mode busy --sizes 0 --inflight 1,16 --floors
#
# The plain release build stays what `cargo build --release` makes; see
# docs/PERFORMANCE.md ("Profile-guided builds") for what PGO changes.
# Needs rustup's llvm-tools component (installed here if missing) or, failing
# that, Debian's llvm package of rustc's LLVM major version.
set -euo pipefail
cd "$(dirname "$0")/.."

host=$(rustc -vV | sed -n 's/^host: //p')
llvm_major=$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')
root=${CARGO_TARGET_DIR:-target}
gen_dir=$root/pgo-gen
use_dir=$root/pgo
raw=$root/pgo-profiles/raw
merged=$root/pgo-profiles/merged.profdata

# llvm-profdata must read the raw format of rustc's own LLVM.
find_profdata() {
  local p
  p="$(rustc --print sysroot)/lib/rustlib/$host/bin/llvm-profdata"
  [ -x "$p" ] && { echo "$p"; return; }
  p=/usr/lib/llvm-$llvm_major/bin/llvm-profdata
  [ -x "$p" ] && { echo "$p"; return; }
  return 1
}
profdata=$(find_profdata) || {
  echo "pgo-build: installing llvm-profdata (rustup llvm-tools, else Debian llvm-$llvm_major)" >&2
  rustup component add llvm-tools >/dev/null 2>&1 ||
    { apt-get update -qq && apt-get install -y -qq "llvm-$llvm_major" >/dev/null; } ||
    true
  profdata=$(find_profdata) || {
    echo "pgo-build: no llvm-profdata for LLVM $llvm_major (rustup component llvm-tools or Debian llvm-$llvm_major)" >&2
    exit 2
  }
}

# --target keeps RUSTFLAGS off build scripts and proc macros (they would
# write profiles of their own). The caller's RUSTFLAGS stay (ab-compare's
# plain build uses them too).
build() {
  RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }$1" cargo build --quiet --release --target "$host" --target-dir "$2" \
    -p na-perf -p hg-rpc --bin hg-perf --bin na-perf
}

echo "pgo-build: 1/4 instrumented build" >&2
rm -rf "$raw" && mkdir -p "$raw"
build "-Cprofile-generate=$(realpath "$raw")" "$gen_dir"

echo "pgo-build: 2/4 training runs" >&2
bin=$gen_dir/$host/release
train=(--batches 3 --batch-ms 100)
"$bin/hg-perf" rate --mode busy,adaptive --sizes 8,1K,64K --inflight 4 "${train[@]}" >/dev/null
"$bin/hg-perf" lat --mode busy,blocking --sizes 8,1K "${train[@]}" >/dev/null
"$bin/hg-perf" bw --mode busy --sizes 64K "${train[@]}" >/dev/null
"$bin/na-perf" lat --sizes 64,1K --batches 3 >/dev/null
"$bin/na-perf" bw --sizes 64K --batches 3 >/dev/null
ls "$raw"/*.profraw >/dev/null 2>&1 || { echo "pgo-build: the training runs wrote no profile" >&2; exit 1; }

echo "pgo-build: 3/4 merging $(find "$raw" -name '*.profraw' | wc -l) profiles" >&2
"$profdata" merge -o "$merged" "$raw"
# The server side must be in it (a server process killed before its exit
# writes none): the function that runs a request's handler has counts.
"$profdata" show --counts --function=run_decoded "$merged" | grep -q 'Block counts: \[[0-9, ]*[1-9]' || {
  echo "pgo-build: the merged profile has no server-side counts (run_decoded never ran?)" >&2
  exit 1
}

echo "pgo-build: 4/4 optimized build" >&2
build "-Cprofile-use=$(realpath "$merged") -Cllvm-args=-pgo-warn-missing-function=false" "$use_dir"
out=$use_dir/$host/release

# The optimized build must work, not only link: one short busy rate run.
smoke=$("$out/hg-perf" rate --mode busy --sizes 0 --inflight 1 --batches 1 --batch-ms 50 --json) || {
  echo "pgo-build: the optimized hg-perf failed its check run" >&2
  exit 1
}
printf '%s\n' "$smoke" | grep -q '"test":"rate"' || {
  echo "pgo-build: the optimized hg-perf printed no rate: $smoke" >&2
  exit 1
}
echo "pgo-build: done; check run: $(printf '%s\n' "$smoke" | grep '"test":"rate"')" >&2
echo "$out"
