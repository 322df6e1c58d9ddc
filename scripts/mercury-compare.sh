#!/usr/bin/env bash
# Mercury's own RPC rate and ours, in the same minutes: the host's phase
# (this 2-core VM runs 2-3x slower for minutes at a time) moves both, so
# the ratio of the two, round by round, is the figure to compare.
#
#   scripts/mercury-compare.sh MERCURY_SRC ROUNDS [HG_PERF...]
#   scripts/mercury-compare.sh ~/src/mercury 12
#   scripts/mercury-compare.sh ~/src/mercury 12 target/release/hg-perf target/pgo/x86_64-unknown-linux-gnu/release/hg-perf
#
# MERCURY_SRC is a checkout of github.com/mercury-hpc/mercury (not
# fetched here: CI has no network beyond the package mirrors, so this is a
# manual benchmark, as in docs/PERFORMANCE.md). It is built once, Release,
# with only its sm plugin and its perf tools, into target/mercury-build
# (needs cmake and a C compiler). Each round runs, alternating the order:
# Mercury's hg_perf_server and hg_rate (busy, 0 B, 1 and then 16 handles in
# flight, LOOPS calls each (environment, default 500000), a fresh server
# per run), and each HG_PERF binary's `rate --mode busy --sizes 0
# --inflight 1,16` (default: the working tree's release build). Server on
# CPU 0, client on CPU 1, both tools. Printed: each round's figures, then
# per figure and binary the median and best, and the median and range of
# the per-round ratios to Mercury.
set -euo pipefail
[ $# -ge 2 ] || { sed -n '6,8p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
# Paths are the caller's: made absolute before the move to the tree's root.
src=$(cd "$1" && pwd) || { echo "mercury-compare: no directory $1" >&2; exit 2; }
rounds=$2
shift 2
bins=()
for b in "$@"; do
  [ -x "$b" ] || { echo "mercury-compare: $b is not an executable" >&2; exit 2; }
  bins+=("$(cd "$(dirname "$b")" && pwd)/$(basename "$b")")
done
cd "$(dirname "$0")/.."
[ ${#bins[@]} -gt 0 ] || bins=("$PWD/target/release/hg-perf")
loops=${LOOPS:-500000}
for t in cmake cc python3 taskset; do
  command -v "$t" >/dev/null || { echo "mercury-compare: needs $t" >&2; exit 2; }
done
[ -f "$src/Testing/perf/hg/hg_rate.c" ] || { echo "mercury-compare: $src is not a Mercury source tree" >&2; exit 2; }

build=$PWD/target/mercury-build
if [ ! -x "$build/bin/hg_rate" ]; then
  echo "building Mercury from $src into $build..." >&2
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=ON \
    -DBUILD_TESTING_UNIT=OFF -DBUILD_TESTING_PERF=ON -DNA_USE_SM=ON >"$build.log" 2>&1 &&
    cmake --build "$build" -j "$(nproc)" >>"$build.log" 2>&1 ||
    { echo "mercury-compare: the Mercury build failed; see $build.log" >&2; exit 1; }
fi
if [ ${#bins[@]} -eq 1 ] && [ "${bins[0]}" = "$PWD/target/release/hg-perf" ]; then
  cargo build --quiet --release -p hg-rpc --bin hg-perf
fi

# One Mercury run: a fresh server (it exits when the client is done), the
# client's rate line for 0 B. Prints the rate, or "nan" if the run failed.
mercury_rate() {
  local dir
  dir=$(mktemp -d)
  (cd "$dir" && setsid taskset -c 0 "$build/bin/hg_perf_server" -c na -p sm -b \
    >"$dir/server.log" 2>&1 </dev/null &)
  for _ in $(seq 50); do [ -s "$dir/port.cfg" ] && break; sleep 0.1; done
  (cd "$dir" && timeout 60 taskset -c 1 "$build/bin/hg_rate" -c na -p sm -b -y 0 -z 1 \
    -x "$1" -l "$loops" 2>/dev/null) | awk '$1 == "0" && NF >= 2 { print $2; found = 1 } END { if (!found) print "nan" }'
  pkill -f "$build/bin/hg_perf_server" 2>/dev/null || true
  rm -rf "$dir"
}

out=$(mktemp)
trap 'rm -f "$out"' EXIT
for i in $(seq "$rounds"); do
  runs=(mercury "${bins[@]}")
  if [ $((i % 2)) = 0 ]; then runs=("${bins[@]}" mercury); fi
  for r in "${runs[@]}"; do
    if [ "$r" = mercury ]; then
      for n in 1 16; do echo "$i mercury $n $(mercury_rate "$n")" >>"$out"; done
    else
      "$r" rate --mode busy --sizes 0 --inflight 1,16 --cpu 1,0 --json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    o = json.loads(l); print(sys.argv[1], sys.argv[2], o["inflight"], o["median"])' "$i" "$r" >>"$out"
    fi
  done
  echo "round $i/$rounds done" >&2
done

python3 - "$out" <<'PY'
import math, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    rnd, who, n, v = line.split()
    rows.setdefault((int(n), who), {})[rnd] = float(v)
for n in (1, 16):
    merc = rows.get((n, 'mercury'), {})
    good = [v for v in merc.values() if not math.isnan(v)]
    if not good:
        print(f'{n} in flight: every Mercury run failed'); continue
    print(f'{n} in flight: mercury median {statistics.median(good)/1e6:.2f}M best {max(good)/1e6:.2f}M ({len(good)} runs)')
    for (m, who), vals in sorted(rows.items()):
        if m != n or who == 'mercury':
            continue
        ratios = sorted(v / merc[r] for r, v in vals.items() if r in merc and not math.isnan(merc[r]) and merc[r] > 0)
        print(f'  {who}: median {statistics.median(vals.values())/1e6:.2f}M best {max(vals.values())/1e6:.2f}M;'
              f' /mercury per round median {statistics.median(ratios):.2f} ({ratios[0]:.2f}..{ratios[-1]:.2f})')
    for rnd in sorted(merc, key=int):
        print(f'    round {rnd}: mercury {merc[rnd]/1e6:.2f}M ' + ' '.join(
            f'{vals[rnd]/1e6:.2f}M' for (m, who), vals in sorted(rows.items()) if m == n and who != 'mercury' and rnd in vals))
PY
